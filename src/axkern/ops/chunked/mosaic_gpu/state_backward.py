"""The reverse recurrence between chunks and the chunk state's backward as one Mosaic GPU kernel
(`SSDBlockSizes(backward="fused")`): one block per (batch row, head) walking its chunks from the
last, the gradient `g` of the state leaving the current chunk carried in registers.

**Why.** Apart, the reverse recurrence (`pallas_gpu`'s Triton kernel) writes every chunk's
`d own = g` (`[b, c, h, P, N]` float32, 0.63 GiB at the 2.7B layer's L 4096) and the chunk-state
backward reads it back; fused, `g` never leaves the block. The price is parallelism: `batch ·
heads` blocks walking their chunks in order, with the next chunk's `B` copied by TMA into the
second of two slots while the block computes on the first.

**A chunk's step**, from the last chunk, `g` entering as the final state's gradient: `g` out to
shared memory as two 16-bit halves (`dS`), and as float32 (read back after the products, so
that its registers are free while they run); `d keep_c`'s row sums `Σ_n g ∘ S_in` (the states
entering the chunks, the forward's residual); `d(w ∘ x) = B dSᵀ`, giving `dx = · w` and `dw =
rowsum(· x)`; `dB = (w ∘ x) dS` (as `_state_bwd_kernel`: three products of halves, or one);
then `g ← keep_c g + dS_in,c` (the scan backward's gradient of the state entering the chunk).
After chunk 0, `g` is the initial state's gradient.

**The lean form** (`SSDBlockSizes(backward="lean")`, 16-bit `B`): one slot of `B`, copied in
for the next chunk once `B dSᵀ`, its one reader, is done (so the copy overlaps `dB`, the
sends and `g`'s update rather than the whole step), and `dx`, `dB` out through the staging tiles
`kernels.STAGES` block by block (`backward._staged`) where the fused kernel stages them whole:
99 KiB at P 64, N 128 where the fused kernel takes 148, so that two blocks share an SM
(`lean_state_bwd_shares_an_sm`) and the 2.7B layer's 320 blocks fill an H200's 132 SMs in two
rounds of 264 rather than three of 132. The arithmetic is the fused kernel's.

**Over the state's columns** (`SSDBlockSizes(backward="columns")`, `columns=N / 64` here): the
lean kernel a block per (batch row, head, 64 of the state's `N` columns), each carrying its
columns of `g` (the recurrence is elementwise in the state), copying in its columns of `B`, and
forming its columns of `dB` whole but its part of `d(w ∘ x) = B dSᵀ` (a sum over the state's
columns): its `dx` goes out added by TMA reductions onto the chunk-scan backward's (`dx_in`, so
XLA adds nothing after) and its `dw` onto zeros, its `d keep` row sums to its own slots for XLA
to sum. 60 KiB at P 64, N 128: three blocks an SM, twice the blocks (640 at the 2.7B layer, two
rounds of 396), each step half the products; `x` is read once per column block.

**Cost** per chunk and head: `4·Q·P·N` FLOPs (`B dSᵀ`, two halves) + `2·Q·P·N` (`dB`, one with
16-bit `B`, three products with float32 `B`);
bytes: `B`, `x` rows and `w` read, the float32 states entering and their gradients read (`2 · P ·
N · 4`), `dx`, `dw`, `dB` written (`dB` per head, or added into the group's rows with
`group_sums`), `d keep`'s `P` row sums written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load
from axkern.core.op import Unsupported

from .backward import _batch_folding, _send_state_grads, _staged, _state_grads
from .kernels import (
    CHUNK,
    STAGES,
    _halves,
    _launch,
    _products,
    _put_last,
    _rows_type,
    _walk_setup,
    blocks_per_sm,
    operand_parts,
    pairs,
    parts_of,
    plgpu,
    tile_bytes,
)

__all__ = ["fused_state_bwd", "fused_state_bwd_smem_bytes", "lean_state_bwd_shares_an_sm"]


def _tiles(p: int, n: int, dtype=jnp.bfloat16, parts=1, lean=False) -> list:
    """Shared memory: `B` in two slots (`lean`: one; `parts` tiles each, slot-major); `dS`'s
    halves; `g` (float32); the staging tiles of `dx`, `dB` (`lean`: `STAGES`, which both go
    through in turn); the vectors `dw` and `d keep`'s row sums."""
    q, f32 = CHUNK, jnp.float32
    staging = list(STAGES) if lean else [((q, p), f32), ((q, n), f32)]
    return [
        (((1 if lean else 2) * parts, q, n), dtype),
        ((p, n), dtype),
        ((p, n), dtype),
        ((p, n), f32),
        *staging,
        ((q,), f32),
        ((p,), f32),
    ]


def fused_state_bwd_smem_bytes(p: int, n: int, lean: bool = False, columns: int = 1) -> int:
    return tile_bytes(_tiles(p, n // columns, lean=lean))


def lean_state_bwd_shares_an_sm(p: int, n: int, columns: int = 1) -> bool:
    """Whether two blocks of the lean fused state backward (a block `n / columns` of the state's
    columns) fit a Hopper SM's 228 KiB of shared memory (each with the 1 KiB the system keeps a
    block) at head dim `p` and state `n`: 99 KiB at P 64, N 128 and 92 at P 128, N 64 (the fused
    kernel's 148 and 132 leave one a SM), 60 at P and N 64 and at P 64, N 128 in two column
    blocks (three a SM; the fused kernel's 84 at P and N 64, two)."""
    return blocks_per_sm(_tiles(p, n // columns, lean=True)) >= 2


def columns_reason(n: int, columns: int, lean: bool) -> str | None:
    """Why the fused state backward cannot split the state's `n` columns over `columns` blocks
    (the lean form only, 64 columns a block or more), or None."""
    if columns == 1:
        return None
    if not lean:
        return "the state's columns split over blocks in the lean form only"
    if n % columns or (n // columns) % CHUNK:
        return f"state={n}: {columns} column blocks must take a multiple of {CHUNK} columns each"
    return None


def _kernel(
    x_ref,
    w_ref,
    b_ref,
    keep_ref,
    s_ref,
    ds_in_ref,
    d_final_ref,
    dx_ref,
    dw_ref,
    db_ref,
    d_keep_ref,
    d_init_ref,
    scoped,
    *,
    rep,
    dtype,
    chunks,
    add,
    rows_of,
    lean=False,
    column_blocks=1,
    sums,
):
    # `add` (from `_launch`): some output is added into; `sums`: dB is, into each group's rows
    add = sums
    (b_smem, dsh_smem, dsl_smem, g_smem, *staging, dw_smem, dk_smem), loaded = scoped
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    q, n = b_smem.shape[1:]  # (n: the block's columns of the state)
    p = dsh_smem.shape[0]
    parts = b_smem.shape[0] // (1 if lean else 2)
    group = lax.div(head, jnp.int32(rep))
    f32, wgmma_layout = jnp.float32, plgpu.Layout.WGMMA
    row = wgmma_layout.reduce(1)
    split = column_blocks > 1  # a block of the state's columns: dx, dw added over the blocks
    first = lax.axis_index("columns") * n if split else 0

    def state_at(ref, *index):  # the block's columns of a state-shaped ref
        return ref.at[(*index, slice(None), pl.ds(first, n))] if split else ref.at[index]

    def fetch(chunk, slot):
        dsts = parts_of(b_smem, slot * parts, parts)
        index = (batch, group, pl.ds(chunk * q, q)) + ((pl.ds(first, n),) if split else ())
        for i, (ref, dst) in enumerate(zip(b_ref, dsts, strict=True)):
            plgpu.copy_gmem_to_smem(ref.at[index], dst, loaded.at[slot * parts + i])

    fetch(chunks - 1, 0)

    def step(i, g):
        chunk, slot = chunks - 1 - i, 0 if lean else lax.rem(i, 2)

        if not lean:  # the next chunk's B into the other slot while this one's runs

            @pl.when(chunk > 0)
            def _():
                fetch(chunk - 1, 1 - slot)

        rows = pl.ds(chunk * q, q)
        # the staging tiles' last copies out have been read; g out as halves and whole before
        # x is loaded (g, the state entering and x's halves together would crowd the registers)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        s_in = mosaic_gpu_load(state_at(s_ref, batch, chunk, head), layout=wgmma_layout, optimized=False)
        dk_smem[...] = jnp.sum(g * s_in, axis=1)  # d keep_c's row sums (over the block's columns)
        g_smem[...] = g
        dsh_smem[...], dsl_smem[...] = _halves(g, dtype)
        x = mosaic_gpu_load(rows_of(x_ref, batch, head, rows), layout=wgmma_layout, optimized=False)
        x = x.astype(f32)
        w = mosaic_gpu_load(w_ref.at[batch, head, rows], layout=row, optimized=False)
        xw_h, xw_l = _halves(x * lax.broadcast_in_dim(w, x.shape, [0]), dtype)
        plgpu.commit_smem()
        for i in range(parts):
            plgpu.barrier_wait(loaded.at[slot * parts + i])
        # the chunk state's gradients (as `_state_bwd_kernel`) and d keep's row sums out
        bs, ds = parts_of(b_smem, slot * parts, parts), (dsh_smem, dsl_smem)
        db_rows = db_ref.at[batch, group if add else head, rows]
        dsts = (rows_of(dx_ref, batch, head, rows), db_rows, dw_ref.at[batch, head, rows])
        if lean:  # B's one reader first, then the previous chunk's B into the slot
            dxw = _products((q, p), pairs(bs, ds, True))

            @pl.when(chunk > 0)
            def _():
                fetch(chunk - 1, 0)

            dsts = (  # (the gradients' rows are the chunk's: one block of 64 rows each)
                lambda _, cols: rows_of(dx_ref, batch, head, rows, cols),
                lambda _, cols: db_ref.at[
                    batch, group if add else head, rows, pl.ds(first + cols.start, cols.size)
                ],
                dsts[2],
            )
            tiles = (tuple(staging), dw_smem)
            _lean_state_grads(dxw, ds, x, w, (xw_h, xw_l), tiles, dsts, add=add, split=split)
        else:
            _state_grads(bs, ds, x, w, (xw_h, xw_l), (*staging, dw_smem))
            _send_state_grads((*staging, dw_smem), dsts, add=add)
        keep_rows = (pl.ds(lax.axis_index("columns") * p, p),) if split else ()
        plgpu.copy_smem_to_gmem(dk_smem, d_keep_ref.at[(batch, head, chunk, *keep_rows)])

        # g <- keep_c g + dS_in,c (keep: one value along g's rows)
        keep = mosaic_gpu_load(keep_ref.at[batch, head, chunk], layout=row, optimized=False)
        ds_in = mosaic_gpu_load(state_at(ds_in_ref, batch, chunk, head), layout=wgmma_layout, optimized=False)
        return g_smem[...] * lax.broadcast_in_dim(keep, (p, n), [0]) + ds_in

    g = mosaic_gpu_load(state_at(d_final_ref, batch, head), layout=wgmma_layout, optimized=False)
    _put_last(g_smem, lax.fori_loop(0, chunks, step, g), state_at(d_init_ref, batch, head))


def _lean_state_grads(dxw, ds, x, w, xw, staging, dsts, *, add, split=False):
    """`_state_grads` and `_send_state_grads` from `d(w ∘ x) = B dSᵀ` (`dxw`, registers) with
    the staging tiles `(stages, dw)`: `dx`, then `dB`, out through `stages` block by block
    (`backward._staged`; `dsts`: `dx`'s and `dB`'s `dst(r, cols)`, `dw`'s ref), `dB` added
    (`add`: a group's rows) or stored, `dx` and `dw` added where `split` (a block of the state's
    columns gives a part of each) or stored; `dw` through its own tile. `dB = (w ∘ x) dS` with
    both operands rounded once (`rounds_once`: the lean form takes 16-bit `B`)."""
    stages, dw_smem = staging
    (q, p), n = dxw.shape, ds[0].shape[1]
    dx_dst, db_dst, dw_dst = dsts
    adds = "add" if split else None
    dw_smem[...] = jnp.sum(dxw * x, axis=1)
    send = _staged(stages)  # (the tiles' copies read: waited by the caller)
    send(dxw * lax.broadcast_in_dim(w, (q, p), [0]), dx_dst, reduction_op=adds)
    send(_products((q, n), pairs(xw[:1], ds[:1])), db_dst, reduction_op="add" if add else None)
    plgpu.copy_smem_to_gmem(dw_smem, dw_dst, reduction_op=adds)  # (committed by the sends)


def fused_state_bwd(
    xt,
    w,
    bt,
    keep,
    states_in,
    d_states_in,
    d_final,
    dx_in=None,
    *,
    group_sums=False,
    positions_first=False,
    lean=False,
    columns=1,
):
    """`(dx [b, h, L, P], dw [b, h, L], dB [b, h, L, N], d keep [b, h, c], d initial state [b, h,
    P, N])`, float32, of the chunk states and the recurrence between them, from `xt [b, h, L, P]`
    and `bt [b, g, L, N]` (bf16 or float32, `operand_parts`), the weights `w [b, h, L]` and
    carries `keep [b, h, c]`, the states entering the chunks and their gradients (`[b, c, h, P,
    N]` float32) and the final state's gradient (`[b, h, P, N]`), by the fused kernel; `dx_in`
    (float32, `dx`'s shape) added to `dx` where given. `group_sums`: `dB [b, g, L, N]` by TMA
    reductions; `positions_first`: `xt` and `dx` are `[b, L, h, P]`; `lean`: the kernel in one
    slot of `B` and the staging tiles `STAGES` (16-bit `B` only); `columns`: the lean kernel a
    block per `N / columns` of the state's columns, each adding its part of `dx` (onto `dx_in`)
    and `dw` by TMA reductions (`columns_reason`)."""
    reason = columns_reason(operand_parts(bt)[0].shape[-1], columns, lean)
    if reason:
        raise Unsupported(f"columns={columns}: {reason}")
    kw = dict(group_sums=group_sums, positions_first=positions_first, lean=lean, columns=columns)
    body = functools.partial(_fused_state_bwd, **kw)
    args = (xt, w, bt, keep, states_in, d_states_in, d_final) + (() if dx_in is None else (dx_in,))
    return _batch_folding(body)(*args) if group_sums or columns > 1 else body(*args)


def _fused_state_bwd(
    xt, w, bt, keep, states_in, d_states_in, d_final, *dx_in, group_sums, positions_first, lean, columns
):
    bt = operand_parts(bt)
    if lean and len(bt) != 1:
        raise Unsupported("the lean fused state backward takes 16-bit B (its dB rounds dS once)")
    f32, dtype, g = jnp.float32, xt.dtype, bt[0].shape[1]
    tiles = _tiles(xt.shape[-1], bt[0].shape[-1] // columns, dtype, len(bt), lean)
    setup = _walk_setup(xt, bt, keep, tiles, "the fused state backward", positions_first=positions_first)
    b, h, lp, p, n, c, keep_rows = setup
    db = jax.ShapeDtypeStruct((b, g if group_sums else h, lp, n), f32)
    out_type = (
        _rows_type(b, h, lp, p, positions_first),
        jax.ShapeDtypeStruct((b, h, lp), f32),
        db,
        jax.ShapeDtypeStruct((b, h, c, columns * p), f32),
        jax.ShapeDtypeStruct((b, h, p, n), f32),
    )
    args = [xt, w, bt, keep_rows, states_in, d_states_in, d_final.astype(f32)]
    # outputs the kernel adds into: dB with the group sums; dx (onto dx_in) and dw over column blocks
    into = {}
    for o in ((0, 1) if columns > 1 else ()) + ((2,) if group_sums else ()):
        into[o] = len(args)
        args.append(dx_in[0].astype(f32) if o == 0 and dx_in else jnp.zeros(out_type[o].shape, f32))
    barrier = plgpu.Barrier(num_barriers=(1 if lean else 2) * len(bt))
    kw = dict(into=into or None, positions_first=positions_first, tiles=tiles, chunks=c, lean=lean)
    kw |= dict(column_blocks=columns, sums=group_sums)
    kind = "state_bwd_fused" + "_lean" * lean + "_columns" * (columns > 1)
    launch = _launch(kind, _kernel, out_type, xt, bt, barrier, columns=columns, **kw)
    dx, dw, db_out, d_keep_rows, d_init = launch(*args)
    if dx_in and columns == 1:
        dx = dx + dx_in[0]
    return dx, dw, db_out, d_keep_rows.sum(-1), d_init
