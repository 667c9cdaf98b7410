"""The pieces the Mosaic GPU kernels' bodies are made of: TMA copies of a chunk's rows into
shared memory and of results out of it, `wgmma` products over 16-bit tiles or a float32
value's two 16-bit halves, and the decay mask of a `[Q, Q]` tile."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load
from axkern.core.kernels import halves

from .operands import finite_or_zero
from .tiles import CHUNK, plgpu

__all__ = [
    "halves",
    "products",
    "pairs",
    "rounds_once",
    "parts_of",
    "part_copies",
    "copy_chunk_in",
    "cleaned_rows",
    "put_last",
    "staged",
    "decay",
]


def products(shape, terms, acc=None):
    """`Σ a @ b` over `terms` (left, right, transpose the right?) into a zeroed float32
    accumulator of `shape` (or `acc`, a running sum in registers, added in place), waited for."""

    def run(acc_ref):
        for a, b, trans in terms:
            plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if trans else b)

    if acc is None:
        acc = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    return pl.run_state(run)(plgpu.ACC.init(acc))


def pairs(left, right, trans=False) -> list:
    """The `wgmma` operands `(left, right, transpose the right?)` of a product whose two operands
    are each one 16-bit tile or a float32 value's two halves (`hi`, `lo`): every pair of parts
    but `lo · lo` (`|lo_a lo_b| <= 2^-16 |a b|`, the size of the halves' own rounding)."""
    return [(a, b, trans) for i, a in enumerate(left) for j, b in enumerate(right) if i + j <= 1]


def rounds_once(parts: int) -> bool:
    """Whether the backward kernels take the operands of `(f ∘ dy) S_in` (the chunk scan's) and
    of `(w ∘ x) dS` (the chunk state's) each rounded once to 16 bits, one product where their
    halves take three: where `B`, `C` come as one 16-bit part (SSD's). Where they come as
    float32 halves (Mamba-3's rotated `k`, `q`), both keep their halves (docs/ops/ssd.md,
    "Accuracy", has the precision sweep that decided it)."""
    return parts == 1


def parts_of(smem, first=0, parts=None) -> tuple:
    """The 16-bit tiles of one operand held as `parts` consecutive tiles of `smem` from `first`
    (all of them where `parts` is None)."""
    parts = smem.shape[0] if parts is None else parts
    return tuple(smem.at[first + k] for k in range(parts))


def part_copies(refs, dsts, batch, group, rows) -> list:
    """The TMA copies `(source, destination)` of a group's `rows` of `B` or `C` (`refs`: its
    parts, `[b, g, L, N]` each) into the tiles `dsts` (`[Q, N]` each, `parts_of`), one per part."""
    return [(ref.at[batch, group, rows], dst) for ref, dst in zip(refs, dsts, strict=True)]


def copy_chunk_in(c, b, x, batch, group, head, rows, rows_of, loaded) -> int:
    """TMA copies of a chunk's `rows` of `C`, `B` (`(refs, tiles)`: their parts, the head's group) and
    `x` (`(ref, tile)`) into shared memory, a barrier each (arrived on once, with its bytes); how many."""
    copies = part_copies(*c, batch, group, rows) + part_copies(*b, batch, group, rows)
    copies.append((rows_of(x[0], batch, head, rows), x[1]))
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])
    return len(copies)


def cleaned_rows(smem) -> None:
    """The non-finite values of a `[64 r, d]` tile in shared memory (its copy in waited) as 0, 64
    rows at a time through registers; the caller commits before a product reads it."""
    for k in range(smem.shape[0] // CHUNK):
        block = smem.at[pl.ds(k * CHUNK, CHUNK)]
        value = mosaic_gpu_load(block, layout=plgpu.Layout.WGMMA, optimized=False)
        block[...] = finite_or_zero(value.astype(jnp.float32)).astype(smem.dtype)


def put_last(smem, value, ref):
    """A walking kernel's last result `value` (registers) out through its staging tile `smem` by
    TMA to `ref`, once the copies in flight have read the tile; waited for."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    smem[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, ref)
    plgpu.wait_smem_to_gmem(0)


def staged(tile):
    """`send(value, dst, reduction_op=None)`: a result in registers (`[R, C]`, WGMMA layout, `R`
    a multiple of 64, `C` of the tile's width) out by TMA through the staging tile `tile` (`[64,
    W]`, `tiles.STAGE`), block by block, `dst(r, cols)` the gmem view of the block at row `r` and
    columns `cols`. Before the tile is written again, the copy before has read it; the tile is
    free when `send` is made (the caller waited) and the last copy is left in flight."""
    sent = []
    width = tile.shape[1]

    def send(value, dst, reduction_op=None):
        rows, cols = value.shape
        for r in range(0, rows, CHUNK):
            for c in range(0, cols, width):
                if sent:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                tile[...] = value[r : r + CHUNK, c : c + width]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(tile, dst(r, pl.ds(c, width)), reduction_op=reduction_op)
                sent.append(None)

    return send


def decay(cum_t, cum_s, seg_t, seg_s, diagonal=True):
    """`Λ[t, s] = exp(cum_t - cum_s)` for `s <= t` in one segment, else 0 (`[Q, Q]`, WGMMA
    layout, from per-row `_t` and per-column `_s` vectors), and the broadcast of a per-column
    vector onto it. `diagonal=False`: a tile whose columns all precede its rows (only the
    segments mask)."""
    q = cum_t.shape[0]
    shape, layout = (q, q), plgpu.Layout.WGMMA
    if diagonal:
        t_idx = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
        s_idx = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    on_rows = lambda v: lax.broadcast_in_dim(v, shape, [0])  # noqa: E731
    on_cols = lambda v: lax.broadcast_in_dim(v, shape, [1])  # noqa: E731
    if diagonal:
        visible = (s_idx <= t_idx) & (on_rows(seg_t) == on_cols(seg_s))
    else:
        visible = on_rows(seg_t) == on_cols(seg_s)
    return jnp.exp(jnp.where(visible, on_rows(cum_t) - on_cols(cum_s), -jnp.inf)), on_cols
