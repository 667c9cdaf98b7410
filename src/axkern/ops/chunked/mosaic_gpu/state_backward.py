"""The reverse recurrence between chunks and the chunk state's backward as one Mosaic GPU kernel
(`SSDBlockSizes(backward="lean")`): one block per (batch row, head) walking its chunks from the
last, the gradient `g` of the state leaving the current chunk carried in registers, in one slot
of `B` and the staging tile `tiles.STAGE`, so that two blocks share an SM.

**Why.** Apart, the reverse recurrence (`pallas_gpu`'s Triton kernel) writes every chunk's
`d own = g` (`[b, c, h, P, N]` float32) and the chunk-state backward reads it back; fused, `g`
never leaves the block. The price is parallelism: `batch · heads` blocks walking their chunks in
order.

**A chunk's step**, from the last chunk, `g` entering as the final state's gradient: `g` out to
shared memory as two 16-bit halves (`dS`), and as float32 (read back after the products, so
that its registers are free while they run); `d keep_c`'s row sums `Σ_n g ∘ S_in` (the states
entering the chunks, the forward's residual); `d(w ∘ x) = B dSᵀ`, giving `dx = · w` and `dw =
rowsum(· x)`; `dB = (w ∘ x) dS` (as the chunk-state backward kernel, with both operands rounded
once: 16-bit `B`, `body.rounds_once`); then `g ← keep_c g + dS_in,c` (the scan backward's
gradient of the state entering the chunk). After chunk 0, `g` is the initial state's gradient.
The chunk's `B` is copied into the one slot for the next chunk once `B dSᵀ`, its one reader, is
done (so the copy overlaps `dB`, the sends and `g`'s update), and `dx`, `dB` leave through the
staging tile block by block (`body.staged`): 99 KiB at P 64, N 128.

**Over the state's columns** (`SSDBlockSizes(backward="columns")`, `columns=N / 64` here): a
block per (batch row, head, 64 of the state's `N` columns), each carrying its columns of `g`
(the recurrence is elementwise in the state), copying in its columns of `B`, and forming its
columns of `dB` whole but its part of `d(w ∘ x) = B dSᵀ` (a sum over the state's columns): its
`dx` goes out added by TMA reductions onto the chunk-scan backward's (`dx_in`, in float32
here: a float32 copy of the bf16 one the chunk-scan backward writes, so XLA adds nothing after) and its `dw` onto zeros, its `d keep` row sums to its own slots for XLA to sum.
60 KiB at P 64, N 128: three blocks an SM, twice the blocks, each step half the products; `x` is
read once per column block.

**Cost** per chunk and head: `4·Q·P·N` FLOPs (`B dSᵀ`, two halves) + `2·Q·P·N` (`dB`, one
product); bytes: `B`, `x` rows and `w` read, the float32 states entering and their gradients
read (`2 · P · N · 4`), `dx`, `dw`, `dB` written (`dB` per head, or added into the group's rows
with `group_sums`), `d keep`'s `P` row sums written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load
from axkern.core.op import Unsupported

from .body import halves, pairs, parts_of, products, put_last, staged
from .operands import finite_or_zero, operand_parts
from .sizes import walk_setup
from .tiles import CHUNK, STAGE, batch_folding, blocks_per_sm, launch, plgpu, rows_type, tile_bytes

__all__ = ["fused_state_bwd", "fused_state_bwd_smem_bytes", "lean_state_bwd_shares_an_sm", "columns_reason"]


def _tiles(p: int, n: int, dtype=jnp.bfloat16) -> list:
    """Shared memory: one slot of `B`; `dS`'s halves; `g` (float32); the staging tile `STAGE`,
    which `dx` and `dB` go through in turn; the vectors `dw` and `d keep`'s row sums."""
    q, f32 = CHUNK, jnp.float32
    return [
        ((1, q, n), dtype),
        ((p, n), dtype),
        ((p, n), dtype),
        ((p, n), f32),
        STAGE,
        ((q,), f32),
        ((p,), f32),
    ]


def fused_state_bwd_smem_bytes(p: int, n: int, columns: int = 1) -> int:
    return tile_bytes(_tiles(p, n // columns))


def lean_state_bwd_shares_an_sm(p: int, n: int, columns: int = 1) -> bool:
    """Whether two blocks of the fused state backward (a block `n / columns` of the state's
    columns) fit a Hopper SM's 228 KiB of shared memory (each with the 1 KiB the system keeps a
    block) at head dim `p` and state `n`: 99 KiB at P 64, N 128 and 92 at P 128, N 64, 60 at P
    and N 64 and at P 64, N 128 in two column blocks (three a SM)."""
    return blocks_per_sm(_tiles(p, n // columns)) >= 2


def columns_reason(n: int, columns: int) -> str | None:
    """Why the fused state backward cannot split the state's `n` columns over `columns` blocks
    (64 columns a block or more), or None."""
    if columns == 1:
        return None
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
    column_blocks=1,
    sums,
    clean_x=False,
):
    # `clean_x`: `x`'s non-finite values taken as 0
    # `add` (from `tiles.launch`): some output is added into; `sums`: dB is, into each group's rows
    add = sums
    (b_smem, dsh_smem, dsl_smem, g_smem, stage, dw_smem, dk_smem), loaded = scoped
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    q, n = b_smem.shape[1:]  # (n: the block's columns of the state)
    p = dsh_smem.shape[0]
    parts = b_smem.shape[0]
    group = lax.div(head, jnp.int32(rep))
    f32, wgmma_layout = jnp.float32, plgpu.Layout.WGMMA
    row = wgmma_layout.reduce(1)
    split = column_blocks > 1  # a block of the state's columns: dx, dw added over the blocks
    first = lax.axis_index("columns") * n if split else 0

    def state_at(ref, *index):  # the block's columns of a state-shaped ref
        return ref.at[(*index, slice(None), pl.ds(first, n))] if split else ref.at[index]

    def fetch(chunk):
        dsts = parts_of(b_smem, 0, parts)
        index = (batch, group, pl.ds(chunk * q, q)) + ((pl.ds(first, n),) if split else ())
        for i, (ref, dst) in enumerate(zip(b_ref, dsts, strict=True)):
            plgpu.copy_gmem_to_smem(ref.at[index], dst, loaded.at[i])

    fetch(chunks - 1)

    def step(i, g):
        chunk = chunks - 1 - i
        rows = pl.ds(chunk * q, q)
        # the staging tiles' last copies out have been read; g out as halves and whole before
        # x is loaded (g, the state entering and x's halves together would crowd the registers)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        s_in = mosaic_gpu_load(state_at(s_ref, batch, chunk, head), layout=wgmma_layout, optimized=False)
        dk_smem[...] = jnp.sum(g * s_in, axis=1)  # d keep_c's row sums (over the block's columns)
        g_smem[...] = g
        dsh_smem[...], dsl_smem[...] = halves(g, dtype)
        x = mosaic_gpu_load(rows_of(x_ref, batch, head, rows), layout=wgmma_layout, optimized=False)
        x = finite_or_zero(x.astype(f32)) if clean_x else x.astype(f32)
        w = mosaic_gpu_load(w_ref.at[batch, head, rows], layout=row, optimized=False)
        xw_h, xw_l = halves(x * lax.broadcast_in_dim(w, x.shape, [0]), dtype)
        plgpu.commit_smem()
        for k in range(parts):
            plgpu.barrier_wait(loaded.at[k])
        # the chunk state's gradients (as the chunk-state backward kernel) and d keep's row sums out
        bs, ds = parts_of(b_smem, 0, parts), (dsh_smem, dsl_smem)
        # B's one reader first, then the previous chunk's B into the slot
        dxw = products((q, p), pairs(bs, ds, True))

        @pl.when(chunk > 0)
        def _():
            fetch(chunk - 1)

        dsts = (  # (the gradients' rows are the chunk's: one block of 64 rows each)
            lambda _, cols: rows_of(dx_ref, batch, head, rows, cols),
            lambda _, cols: db_ref.at[
                batch, group if add else head, rows, pl.ds(first + cols.start, cols.size)
            ],
            dw_ref.at[batch, head, rows],
        )
        _state_grads(dxw, ds, x, w, (xw_h, xw_l), (stage, dw_smem), dsts, add=add, split=split)
        keep_rows = (pl.ds(lax.axis_index("columns") * p, p),) if split else ()
        plgpu.copy_smem_to_gmem(dk_smem, d_keep_ref.at[(batch, head, chunk, *keep_rows)])

        # g <- keep_c g + dS_in,c (keep: one value along g's rows)
        keep = mosaic_gpu_load(keep_ref.at[batch, head, chunk], layout=row, optimized=False)
        ds_in = mosaic_gpu_load(state_at(ds_in_ref, batch, chunk, head), layout=wgmma_layout, optimized=False)
        return g_smem[...] * lax.broadcast_in_dim(keep, (p, n), [0]) + ds_in

    g = mosaic_gpu_load(state_at(d_final_ref, batch, head), layout=wgmma_layout, optimized=False)
    put_last(g_smem, lax.fori_loop(0, chunks, step, g), state_at(d_init_ref, batch, head))


def _state_grads(dxw, ds, x, w, xw, staging, dsts, *, add, split=False):
    """The chunk state's gradients from `d(w ∘ x) = B dSᵀ` (`dxw`, registers) with the staging
    tiles `(stage, dw)`: `dx`, then `dB`, out through `stage` block by block (`body.staged`;
    `dsts`: `dx`'s and `dB`'s `dst(r, cols)`, `dw`'s ref), `dB` added (`add`: a group's rows) or
    stored, `dx` and `dw` added where `split` (a block of the state's columns gives a part of
    each) or stored; `dw` through its own tile. `dB = (w ∘ x) dS` with both operands rounded once
    (`body.rounds_once`: the kernel takes 16-bit `B`)."""
    stage, dw_smem = staging
    (q, p), n = dxw.shape, ds[0].shape[1]
    dx_dst, db_dst, dw_dst = dsts
    adds = "add" if split else None
    dw_smem[...] = jnp.sum(dxw * x, axis=1)
    send = staged(stage)  # (the tile's copies read: waited by the caller)
    send(dxw * lax.broadcast_in_dim(w, (q, p), [0]), dx_dst, reduction_op=adds)
    send(products((q, n), pairs(xw[:1], ds[:1])), db_dst, reduction_op="add" if add else None)
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
    columns=1,
    clean_x=False,
):
    """`(dx [b, h, L, P], dw [b, h, L], dB [b, h, L, N], d keep [b, h, c], d initial state [b, h,
    P, N])`, float32, of the chunk states and the recurrence between them, from `xt [b, h, L, P]`
    and `bt [b, g, L, N]` (bf16), the weights `w [b, h, L]` and carries `keep [b, h, c]`, the
    states entering the chunks and their gradients (`[b, c, h, P, N]` float32) and the final
    state's gradient (`[b, h, P, N]`), by the fused kernel; `dx_in` (`dx`'s shape, in `x`'s dtype
    or float32) added to `dx` where given. `group_sums`: `dB [b, g, L, N]` by TMA reductions; `positions_first`:
    `xt` and `dx` are `[b, L, h, P]`; `columns`: a block per `N / columns` of the state's
    columns, each adding its part of `dx` (onto `dx_in`) and `dw` by TMA reductions
    (`columns_reason`). `clean_x`: `x`'s non-finite values taken as 0."""
    reason = columns_reason(operand_parts(bt)[0].shape[-1], columns)
    if reason:
        raise Unsupported(f"columns={columns}: {reason}")
    kw = dict(group_sums=group_sums, positions_first=positions_first, columns=columns, clean_x=clean_x)
    body = functools.partial(_fused_state_bwd, **kw)
    args = (xt, w, bt, keep, states_in, d_states_in, d_final) + (() if dx_in is None else (dx_in,))
    return batch_folding(body)(*args) if group_sums or columns > 1 else body(*args)


def _fused_state_bwd(
    xt, w, bt, keep, states_in, d_states_in, d_final, *dx_in, group_sums, positions_first, columns, clean_x
):
    bt = operand_parts(bt)
    if len(bt) != 1:
        raise Unsupported("the fused state backward takes 16-bit B (its dB rounds dS once)")
    f32, dtype, g = jnp.float32, xt.dtype, bt[0].shape[1]
    tiles = _tiles(xt.shape[-1], bt[0].shape[-1] // columns, dtype)
    setup = walk_setup(xt, bt, keep, tiles, "the fused state backward", positions_first=positions_first)
    b, h, lp, p, n, c, keep_rows = setup
    db = jax.ShapeDtypeStruct((b, g if group_sums else h, lp, n), f32)
    out_type = (
        rows_type(b, h, lp, p, positions_first),
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
    barrier = plgpu.Barrier(num_barriers=len(bt))
    kw = dict(
        into=into or None, positions_first=positions_first, chunks=c, column_blocks=columns, sums=group_sums
    ) | ({"clean_x": True} if clean_x else {})
    kind = "state_bwd_fused_lean" + "_columns" * (columns > 1)
    call = launch(kind, _kernel, out_type, xt, bt, barrier, tiles, columns=columns, **kw)
    dx, dw, db_out, d_keep_rows, d_init = call(*args)
    if dx_in and columns == 1:
        dx = dx + dx_in[0]
    return dx, dw, db_out, d_keep_rows.sum(-1), d_init
