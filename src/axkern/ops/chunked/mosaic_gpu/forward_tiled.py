"""The fused forward (`forward.py`) at chunks of `Q = 64 r` positions (`r > 1`): the same walk
over one (batch row, head)'s chunks, each chunk's output formed by tiles of 64 rows
(`tiled.chunk_output_tiled`) and its shared memory held in tiles of 64 rows: one slot of `C`'s
`r` row blocks, each refilled with the next chunk's as soon as the chunk's output has read it,
two slots of `B`'s and `x`'s row blocks, and `w ∘ x`'s halves and `y`'s staging for one row
block."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load

from .body import halves, pairs, part_copies, parts_of, products, put_last
from .forward_lean import seen_rows, split_seen
from .operands import finite_or_zero
from .tiled import chunk_output_tiled
from .tiles import plgpu

__all__ = ["forward_tiled_kernel"]


def forward_tiled_kernel(*refs, rep, dtype, add, rows_of, chunks, clean_x=False, seen=False):
    """The fused forward's walk (`forward.py`) at chunks of `Q = 64 r` (`r > 1`), by tiles of 64 rows:
    a chunk's output row block by row block (`chunk_output_tiled`), each out by TMA through one
    staging tile, the next chunk's `C` rows of that block copied into its tile as soon as the
    block has read them; then `S ← keep · S + Σ_j (w ∘ x)_jᵀ B_j`, a row block's `w ∘ x` halves
    at a time, formed from the `x` tile in shared memory. The next chunk's `B`, `x` go into the
    second of two slots while the block computes on the first. Barriers: `C`'s row blocks
    (`r · parts`), then each slot's row blocks of `B`'s parts and `x`. Grid `(batch, heads)`,
    one warpgroup a block, as at 64. Cost per chunk and head: the tiled output's FLOPs
    (`tiled.py`) plus the state's `4·Q·P·N`; bytes: `x`, `B`, `C` read once, `y` written,
    the entering state written once (`P·N·4`, the backward's residual; not without `states_ref`),
    so the states' bytes a position fall as `1 / Q`. `seen`: each chunk's `seen_rows` out
    (`forward_lean.split_seen`), read from the `x` tiles."""
    x_ref, w_ref, dt_ref, cum_ref, f_ref, keep_ref, seg_ref, b_ref, c_ref, s0_ref = refs[:10]
    # (the refs the fused forward's kernel at 64 takes, in its order)
    (y_ref, states_ref, final_ref), seen_ref, scoped, seen_smem = split_seen(refs[10:], seen)
    (c_smem, b_smem, x_smem, xh_smem, xl_smem, s16_smem, y_smem, st_smem), loaded = scoped
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    r, (t, p) = x_smem.shape[0] // 2, x_smem.shape[1:]
    parts, q, n = c_smem.shape[0] // r, r * x_smem.shape[1], c_smem.shape[-1]
    group = lax.div(head, jnp.int32(rep))
    f32, wgmma_layout = jnp.float32, plgpu.Layout.WGMMA
    row = wgmma_layout.reduce(1)
    c_tile = lambda i: parts_of(c_smem, i * parts, parts)  # noqa: E731
    b_tile = lambda slot, j: parts_of(b_smem, (slot * r + j) * parts, parts)  # noqa: E731
    block_rows = lambda chunk, i: pl.ds(chunk * q + i * t, t)  # noqa: E731
    bx_barrier = lambda slot, j, k: loaded.at[r * parts + (slot * r + j) * (parts + 1) + k]  # noqa: E731

    def fetch_c(chunk, i):
        for k, (src, dst) in enumerate(part_copies(c_ref, c_tile(i), batch, group, block_rows(chunk, i))):
            plgpu.copy_gmem_to_smem(src, dst, loaded.at[i * parts + k])

    def fetch_bx(chunk, slot):
        for j in range(r):
            rows = block_rows(chunk, j)
            pieces = part_copies(b_ref, b_tile(slot, j), batch, group, rows)
            pieces.append((rows_of(x_ref, batch, head, rows), x_smem.at[slot * r + j]))
            for k, (src, dst) in enumerate(pieces):
                plgpu.copy_gmem_to_smem(src, dst, bx_barrier(slot, j, k))

    for i in range(r):
        fetch_c(0, i)
    fetch_bx(0, 0)

    def step(chunk, state):
        slot, more = lax.rem(chunk, 2), chunk + 1 < chunks

        @pl.when(more)
        def _():
            fetch_bx(chunk + 1, 1 - slot)

        # the staging tiles' last copies out have been read; the entering state out and in
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        st_smem[...] = state
        s16_smem[...] = state.astype(dtype)
        plgpu.commit_smem()
        if states_ref is not None:
            plgpu.copy_smem_to_gmem(st_smem, states_ref.at[batch, chunk, head])
        xs = [x_smem.at[slot * r + j] for j in range(r)]
        for j, k in itertools.product(range(r), range(parts + 1)):
            plgpu.barrier_wait(bx_barrier(slot, j, k))
        if clean_x or seen:  # over the tiles their copies have filled, before the products read them
            for j, x_j in enumerate(xs):
                x = _read(x_j, wgmma_layout).astype(f32)
                if seen:  # (the previous chunk's copy out of the tile read it: waited above)
                    seen_smem.at[pl.ds(j * t, t)][...] = seen_rows(x)
                if clean_x:
                    x_j[...] = finite_or_zero(x).astype(dtype)
            plgpu.commit_smem()
            if seen:
                plgpu.copy_smem_to_gmem(seen_smem, seen_ref.at[batch, head, pl.ds(chunk * q, q)])

        def ready(i):
            for k in range(parts):
                plgpu.barrier_wait(loaded.at[i * parts + k])

        def emit(i, y):
            @pl.when(more)  # C_i's products are done: the next chunk's rows into its tile
            def _():
                fetch_c(chunk + 1, i)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            y_smem[...] = y.astype(y_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(y_smem, rows_of(y_ref, batch, head, block_rows(chunk, i)))

        tiles = [c_tile(i) for i in range(r)], [b_tile(slot, j) for j in range(r)], xs
        refs = (dt_ref, cum_ref, f_ref, seg_ref)
        chunk_output_tiled(tiles, s16_smem, emit, refs, batch, head, chunk * q, dtype=dtype, ready=ready)

        # S <- keep S + Σ_j (w ∘ x)_jᵀ B_j, the entering state read back from its staging tile
        keep = _read(keep_ref.at[batch, head, chunk], row)
        acc = st_smem[...] * lax.broadcast_in_dim(keep, (p, n), [0])
        xw_t = (xh_smem.transpose((1, 0)), xl_smem.transpose((1, 0)))
        for j, x_j in enumerate(xs):
            w_t = _read(w_ref.at[batch, head, block_rows(chunk, j)], row)
            x = _read(x_j, wgmma_layout).astype(f32)
            xh_smem[...], xl_smem[...] = halves(x * lax.broadcast_in_dim(w_t, x.shape, [0]), dtype)
            plgpu.commit_smem()
            acc = products((p, n), pairs(xw_t, b_tile(slot, j)), acc=acc)
        return acc

    s0 = _read(s0_ref.at[batch, head], wgmma_layout)
    put_last(st_smem, lax.fori_loop(0, chunks, step, s0), final_ref.at[batch, head])


def _read(ref, layout):
    return mosaic_gpu_load(ref, layout=layout, optimized=False)
