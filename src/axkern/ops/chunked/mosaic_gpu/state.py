"""Stage 2, each chunk's own state `(w ∘ x)ᵀ B`, and its backward, as Mosaic GPU kernels: one
warpgroup per (batch row, head, chunk), or (backward) per 64 of a chunk's rows.

**The state kernel.** TMA copies the chunk's `B` rows (`[Q, N]`); `x` (`[Q, P]`) is read into
registers, scaled by `w` per row and stored as two 16-bit halves (`w ∘ x = hi + lo`, what the
rounding loses as `bf16x2`); two `wgmma`s with the halves transposed as the left operand give
the `[P, N]` float32 state, written back through shared memory by TMA. A chunk of `64 r` takes
its rows in one product.

**Its backward**: `d(w ∘ x) = B dSᵀ` (`dS`, float32, as two halves in shared memory), giving
`dx = · w` and `dw = rowsum(· x)`, and `dB = (w ∘ x) dS` (three products: both operands float32;
one of their high halves where `B`, `C` are 16-bit: `body.rounds_once`). It adds the chunk-scan
backward's `dx` (`dx_in`, in the input dtype) to its own and writes `dx` in the input dtype; with the group
sums it adds `dB` into its group's rows by a TMA reduction; given the angles it returns `dB`
turned back (`angles.turned_back`).

**Cost** per chunk and head (Q = 64), in tensor-core FLOPs: the state `4·Q·P·N` (two halves),
its backward `6·Q·P·N` (`B dSᵀ` with two products, `(w ∘ x) dS` with one), with 16-bit `B`;
bytes: `x`, `B` rows once, the float32 state `P·N·4` written (forward) or `dS` read (backward),
`dx`, `dw`, `dB` written (with `dx_in`, the chunk-scan backward's bf16 `dx` also read, from the
buffer the sum is written over: `2·Q·P` bytes each way).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load

from .angles import check_angles, read_angles, turned_back
from .body import halves, pairs, part_copies, parts_of, products, rounds_once
from .operands import finite_or_zero, operand_parts
from .sizes import check_operands, check_tiles, kernel_tiles
from .tiles import CHUNK, batch_folding, dims, launch, plgpu, rows_type

__all__ = ["chunk_state", "chunk_state_bwd"]


def _state_kernel(x_ref, w_ref, b_ref, own_ref, scoped, *, rep, dtype, add, rows_of, clean_x=False):
    """`clean_x`: `x`'s non-finite values taken as 0."""
    (b_smem, xh_smem, xl_smem, own_smem), loaded = scoped
    chunk, head, batch = lax.axis_index("chunks"), lax.axis_index("heads"), lax.axis_index("batch")
    q = b_smem.shape[1]
    rows = pl.ds(chunk * q, q)
    copies = part_copies(b_ref, parts_of(b_smem), batch, lax.div(head, jnp.int32(rep)), rows)
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])
    # w ∘ x in registers (w per row), as two 16-bit halves in shared memory, 64 rows at a time
    # (the whole tiles at chunks of 64)
    blocks = [(rows, xh_smem, xl_smem)]
    if q > CHUNK:
        at = lambda k: pl.ds(k * CHUNK, CHUNK)  # noqa: E731
        blocks = [
            (pl.ds(chunk * q + k * CHUNK, CHUNK), xh_smem.at[at(k)], xl_smem.at[at(k)])
            for k in range(q // CHUNK)
        ]
    for r, xh, xl in blocks:
        x = mosaic_gpu_load(rows_of(x_ref, batch, head, r), layout=plgpu.Layout.WGMMA, optimized=False)
        x = x.astype(jnp.float32)
        x = finite_or_zero(x) if clean_x else x
        w = mosaic_gpu_load(w_ref.at[batch, head, r], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        xh[...], xl[...] = halves(x * lax.broadcast_in_dim(w, x.shape, [0]), dtype)
    plgpu.commit_smem()
    for i in range(len(copies)):
        plgpu.barrier_wait(loaded.at[i])
    # (w ∘ x)ᵀ B: [P, N]
    xw = (xh_smem.transpose((1, 0)), xl_smem.transpose((1, 0)))
    own_smem[...] = products(own_smem.shape, pairs(xw, parts_of(b_smem)))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(own_smem, own_ref.at[batch, chunk, head])
    plgpu.wait_smem_to_gmem(0)


def chunk_state(xt, w, bt, *, positions_first=False, chunk=CHUNK, clean_x=False):
    """Each chunk's own state `[b, c, h, P, N]` float32, `(w ∘ x)ᵀ B` (`xt [b, h, L, P]` bf16,
    `bt [b, g, L, N]` bf16 or float32 (`operand_parts`), `w [b, h, L]` float32, `L = c · chunk`)
    by the Mosaic GPU kernel: `w ∘ x` as two 16-bit halves (`bf16x2`), `B` as its parts.
    `positions_first`: `xt` is `[b, L, h, P]` (here and in the other kernels: `x`, `y`, `dy`,
    `dx` so). `chunk`: a multiple of 64, the block's product taking the chunk's rows at once
    (its tiles within shared memory). `clean_x`: `x`'s non-finite values taken as 0."""
    bt = operand_parts(bt)
    check_operands(xt, bt, positions_first=positions_first, chunk=chunk)
    b, h, lp, p = dims(xt, positions_first)
    check_tiles("state", p, bt, chunk)
    n = bt[0].shape[-1]
    out = jax.ShapeDtypeStruct((b, lp // chunk, h, p, n), jnp.float32)
    barrier = plgpu.Barrier(num_barriers=len(bt))
    tiles = kernel_tiles("state", p, n, xt.dtype, parts=len(bt), q=chunk)
    kw = dict(rows=chunk, positions_first=positions_first) | ({"clean_x": True} if clean_x else {})
    call = launch("state", _state_kernel, out, xt, bt, barrier, tiles, **kw)
    return call(xt, w, bt)


def _state_bwd_kernel(*refs, rep, dtype, add, rows_of, adds_dx, turns=False, blocks=1, clean_x=False):
    """`add`: `dB` added by a TMA reduction into the head's group's rows (`[b, g, L, N]`).
    `adds_dx`: the output `dx` holds the scan's backward's `dx` as the kernel starts (its
    buffer, `tiles.launch`'s `into`), which each block reads and adds to its own before writing
    its rows over it. `turns`: one more input, the angles `Θ`, by which `dB`
    leaves turned back (`angles.turned_back`). `blocks`: the blocks a chunk's rows take (chunks of
    `64 · blocks`; each block its 64 rows, the chunk's `dS` read by each: the gradients are row
    by row). `clean_x`: `x`'s non-finite values taken as 0."""
    x_ref, w_ref, b_ref, ds_ref, *rest = refs
    theta_ref = rest.pop(0) if turns else None
    dx_ref, dw_ref, db_ref, scoped = rest
    (b_smem, dsh_smem, dsl_smem, dx_smem, db_smem, dw_smem), loaded = scoped
    batch, head, block = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("chunks")
    chunk = block if blocks == 1 else lax.div(block, jnp.int32(blocks))
    q = b_smem.shape[1]
    rows = pl.ds(block * q, q)
    bs = parts_of(b_smem)
    copies = part_copies(b_ref, bs, batch, lax.div(head, jnp.int32(rep)), rows)
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])
    f32, wgmma_layout = jnp.float32, plgpu.Layout.WGMMA
    # dS (float32) as two 16-bit halves in shared memory; w ∘ x's halves in registers
    dsh, dsl = halves(
        mosaic_gpu_load(ds_ref.at[batch, chunk, head], layout=wgmma_layout, optimized=False), dtype
    )
    dsh_smem[...], dsl_smem[...] = dsh, dsl
    x = mosaic_gpu_load(rows_of(x_ref, batch, head, rows), layout=wgmma_layout, optimized=False).astype(f32)
    x = finite_or_zero(x) if clean_x else x
    w = mosaic_gpu_load(w_ref.at[batch, head, rows], layout=wgmma_layout.reduce(1), optimized=False)
    xw_h, xw_l = halves(x * lax.broadcast_in_dim(w, x.shape, [0]), dtype)
    plgpu.commit_smem()
    for i in range(len(copies)):
        plgpu.barrier_wait(loaded.at[i])

    staging = (dx_smem, db_smem, dw_smem)
    dx_in = None
    if adds_dx:
        dx_in = mosaic_gpu_load(rows_of(dx_ref, batch, head, rows), layout=wgmma_layout, optimized=False)
        dx_in = dx_in.astype(f32)
    theta = None if theta_ref is None else read_angles(theta_ref, batch, head, rows)
    _state_grads(bs, (dsh_smem, dsl_smem), x, w, (xw_h, xw_l), staging, dx_in, theta)
    group = lax.div(head, jnp.int32(rep)) if add else head
    dsts = (rows_of(dx_ref, batch, head, rows), db_ref.at[batch, group, rows], dw_ref.at[batch, head, rows])
    _send_state_grads(staging, dsts, add=add)
    plgpu.wait_smem_to_gmem(0)


def _state_grads(bs, ds, x, w, xw, staging, dx_in=None, theta=None):
    """The chunk state's gradients from `dS`'s halves `ds` (shared memory), `B`'s parts `bs`
    (shared memory),
    `x`, `w` and `w ∘ x`'s halves `xw` (registers), into the staging tiles `(dx, dB, dw)`:
    `d(w ∘ x) = B dSᵀ` (rows t), `dx = · w` (plus `dx_in`, float32 registers, if given; in the
    staging tile's dtype), `dw = rowsum(· x)`; `dB = (w ∘ x) dS`, three products of halves (one
    of the high halves where `rounds_once`), turned back by the angles `theta` (registers) where
    given."""
    dx_smem, db_smem, dw_smem = staging
    (q, n), p = bs[0].shape, ds[0].shape[0]
    dxw = products((q, p), pairs(bs, ds, True))
    dx = dxw * lax.broadcast_in_dim(w, (q, p), [0])
    dx_smem[...] = (dx if dx_in is None else dx + dx_in).astype(dx_smem.dtype)
    dw_smem[...] = jnp.sum(dxw * x, axis=1)
    db_smem[...] = products((q, n), pairs(xw[:1], ds[:1]) if rounds_once(len(bs)) else pairs(xw, ds))
    if theta is not None:
        turned_back(db_smem, jnp.cos(theta), jnp.sin(theta))
    plgpu.commit_smem()


def _send_state_grads(staging, dsts, *, add):
    """`(dx, dB, dw)` out of their staging tiles by TMA to `dsts`, `dB` added (`add`: a group's
    rows) or stored (the copies left in flight)."""
    for i, (smem, dst) in enumerate(zip(staging, dsts, strict=True)):
        plgpu.copy_smem_to_gmem(smem, dst, reduction_op="add" if add and i == 1 else None)


def chunk_state_bwd(
    xt,
    w,
    bt,
    d_own,
    dx_in=None,
    *,
    group_sums=False,
    positions_first=False,
    theta=None,
    chunk=CHUNK,
    clean_x=False,
):
    """Stage 2's backward by the Mosaic GPU kernel, `dS` (`d_own [b, c, h, P, N]`, float32)
    pulled back through `S = (w ∘ x)ᵀ B`: `(dx [b, h, L, P], dw [b, h, L], dB [b, h, L, N])`
    per head, `dw` and `dB` float32, `dx` float32 or, given `dx_in` (`x`'s layout, in its dtype
    or float32; the scan's backward's `dx`), that sum in `dx_in`'s dtype, written over
    `dx_in`'s buffer (one `x`-sized array live where two were; the kernel is then not named in
    its call on jax 0.10, as the other in-place ones); `chunk_state`'s other arguments (`B`
    bf16 or float32).
    `group_sums`: `dB` per group (`[b, g, L, N]`) by TMA reductions, as in `chunk_scan_bwd`.
    `theta`: `dB` turned back by `-Θ`, as in `chunk_scan_bwd`. `chunk`: a multiple of 64
    (`d_own [b, L / chunk, h, P, N]`), a block per 64 rows whatever the chunk. `clean_x`:
    `x`'s non-finite values taken as 0."""
    check_angles("chunk_state_bwd", theta, group_sums, xt, bt, positions_first)
    body = functools.partial(
        _chunk_state_bwd,
        group_sums=group_sums,
        positions_first=positions_first,
        turns=theta is not None,
        chunk=chunk,
        clean_x=clean_x,
    )
    if dx_in is not None and dx_in.dtype not in (xt.dtype, jnp.float32):
        raise ValueError(f"chunk_state_bwd: dx_in is {dx_in.dtype}: x's dtype ({xt.dtype}) or float32")
    args = (xt, w, bt, d_own) + (() if dx_in is None else (dx_in,))
    args += () if theta is None else (theta,)
    # (outputs written in place run as `pl.kernel` over refs, which batches only through the folding)
    in_place = group_sums or dx_in is not None
    return batch_folding(body)(*args) if in_place else body(*args)


def _chunk_state_bwd(xt, w, bt, d_own, *more, group_sums, positions_first, turns, chunk, clean_x):
    dx_in = more[: len(more) - turns]
    bt = operand_parts(bt)
    check_operands(xt, bt, positions_first=positions_first, chunk=chunk)
    b, h, lp, p = dims(xt, positions_first)
    f32, rows = jnp.float32, dx_in[0].dtype if dx_in else jnp.float32
    db = jax.ShapeDtypeStruct((b, bt[0].shape[1] if group_sums else h, lp, bt[0].shape[-1]), f32)
    out = (rows_type(b, h, lp, p, positions_first, rows), jax.ShapeDtypeStruct((b, h, lp), f32), db)
    args = [xt, w, bt, d_own, *more] + ([jnp.zeros(db.shape, f32)] if group_sums else [])
    # dx over dx_in's buffer; dB added into zeros with the group sums
    into = ({0: 4} if dx_in else {}) | ({2: len(args) - 1} if group_sums else {})
    kw = dict(into=into or None, add=group_sums, positions_first=positions_first, adds_dx=bool(dx_in))
    kw["turns"] = turns
    if chunk != CHUNK:
        kw["blocks"] = chunk // CHUNK
    if clean_x:
        kw["clean_x"] = True
    barrier = plgpu.Barrier(num_barriers=len(bt))
    tiles = kernel_tiles("state_bwd", p, bt[0].shape[-1], xt.dtype, rows, len(bt))  # a block per 64 rows
    return launch("state_bwd", _state_bwd_kernel, out, xt, bt, barrier, tiles, rows=CHUNK, **kw)(*args)
