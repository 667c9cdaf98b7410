"""The kernels' block-sparse schedules (pure numpy on the host for static masks, jnp on the
device for packed documents) and the masks evaluated on a tile's index grids (`__init__`'s
docstring has the table's layout and meaning)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from axkern import masks as masks_
from axkern.core.blocks import cdiv
from axkern.core.op import Unsupported

from .. import common

COMPUTE_WGS = 2  # compute warpgroups per block, each with its own query (or key) tile
# columns of the schedule table: the block's loaded tiles, then per compute warpgroup w the
# four bounds at 2 + 4 w + (0, 1, 2, 3)
CTA_LO, CTA_HI = 0, 1
LO, FLO, FHI, HI = 0, 1, 2, 3


def _longest_run(flags) -> tuple[int, int]:
    """`(start, stop)` of the longest run of True in a 1-D bool sequence (`(0, 0)` when none)."""
    best, start = (0, 0), None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            if i - start > best[1] - best[0]:
                best = (start, i)
            start = None
    return best


def schedule(kinds, wgs: int = COMPUTE_WGS) -> np.ndarray:
    """The kernel's tile schedule from a static mask's block kinds.

    **Arguments:** `kinds`: int `[nq, nk]` (`masks.EMPTY`, `PARTIAL`, `FULL` per query tile by
    key tile), `nq` a multiple of `wgs`; block `c` owns query tiles `c · wgs + w`.

    **Returns:** int32 `[nq / wgs, 2 + 4 · wgs]`: per block the key tiles its producer loads,
    `[clo, chi)` (the union of its query tiles' ranges; `clo == chi` when all are empty),
    then per compute warpgroup `(lo, flo, fhi, hi)`: the visited tiles `[lo, hi)` from the
    first to the last non-empty one, and inside them the longest run of `FULL` tiles
    `[flo, fhi)`, visited without masking (`flo == fhi == hi` when none). A warpgroup whose
    row is empty gets `lo = flo = fhi = hi = clo`.
    """
    kinds = np.asarray(kinds)
    nq, _ = kinds.shape
    if nq % wgs:
        raise ValueError(f"schedule: {nq} query tiles are not a multiple of {wgs} warpgroups")
    table = np.zeros((nq // wgs, 2 + 4 * wgs), np.int32)
    for c in range(nq // wgs):
        rows = []
        for w in range(wgs):
            row = kinds[c * wgs + w]
            seen = np.flatnonzero(row != masks_.EMPTY)
            if seen.size == 0:
                rows.append(None)
                continue
            lo, hi = int(seen[0]), int(seen[-1]) + 1
            flo, fhi = _longest_run(row[lo:hi] == masks_.FULL)
            flo, fhi = (lo + flo, lo + fhi) if fhi > flo else (hi, hi)
            rows.append((lo, flo, fhi, hi))
        live = [r for r in rows if r is not None]
        clo = min((r[LO] for r in live), default=0)
        chi = max((r[HI] for r in live), default=0)
        table[c, CTA_LO], table[c, CTA_HI] = clo, chi
        for w, r in enumerate(rows):
            table[c, 2 + 4 * w : 6 + 4 * w] = (clo,) * 4 if r is None else r
    return table


def mask_schedule(mask, sq: int, sk: int, block_q: int, block_kv: int) -> np.ndarray:
    """`schedule` of a static mask over `sq` queries and `sk` keys in `block_q x block_kv`
    tiles, the query tiles padded with empty ones to whole blocks of `COMPUTE_WGS`."""
    kinds = masks_.static_block_kinds(mask, sq, sk, block_q, block_kv)[0]
    nq = cdiv(kinds.shape[0], COMPUTE_WGS) * COMPUTE_WGS
    return schedule(np.pad(kinds, [(0, nq - kinds.shape[0]), (0, 0)], constant_values=masks_.EMPTY))


def _grid_visible(mask, q, k):
    """`visible` of a static mask on 2-D index grids (`q`, `k`: int32 `[bq, bk]` in the
    kernel's register layout), or None where it is everywhere visible."""
    if isinstance(mask, masks_.Full):
        return None
    if isinstance(mask, masks_.Causal):
        return k <= q + mask.offset
    if isinstance(mask, masks_.SlidingWindow):
        q = q + mask.offset
        return (k <= q) & (k > q - mask.size)
    if type(mask) in (masks_.And, masks_.Or):
        a, b = _grid_visible(mask.a, q, k), _grid_visible(mask.b, q, k)
        if type(mask) is masks_.Or:
            return None if a is None or b is None else a | b
        return b if a is None else a if b is None else a & b
    raise Unsupported(f"{mask!r}: the Mosaic GPU kernels evaluate no such static mask on a tile")


# -- the kernel -------------------------------------------------------------------------------


def split(mask):
    """`(Segments or None, the static rest)` of a mask the kernels take: static, `Segments`, or
    `Segments & static`; anything else is `Unsupported`."""
    try:
        return common.split_segments(mask)
    except Unsupported:
        raise Unsupported(
            f"{mask!r}: the Mosaic GPU kernels take static masks, Segments and Segments & a static mask "
            "(not PrefixLM or Dense yet)"
        ) from None


def schedule_rows(kinds) -> jax.Array:
    """`schedule` of each batch row of traced block kinds `[B, n, nk]` (`n` a multiple of
    `COMPUTE_WGS`), on the device: int32 `[B, n / COMPUTE_WGS, 2 + 4 · COMPUTE_WGS]`."""
    b, n, nk = kinds.shape
    idx = jnp.arange(nk, dtype=jnp.int32)
    nonempty = kinds != masks_.EMPTY
    live = nonempty.any(-1)
    lo = jnp.argmax(nonempty, axis=-1).astype(jnp.int32)
    hi = (nk - jnp.argmax(nonempty[..., ::-1], axis=-1)).astype(jnp.int32)
    full = kinds == masks_.FULL
    # the length of the run of FULL tiles ending at each tile; the first longest run wins
    run = jnp.where(full, idx - lax.cummax(jnp.where(full, -1, idx), axis=2), 0)
    best, end = run.max(-1), jnp.argmax(run, axis=-1).astype(jnp.int32)
    flo, fhi = jnp.where(best > 0, end + 1 - best, hi), jnp.where(best > 0, end + 1, hi)
    rows = jnp.stack([lo, flo, fhi, hi], axis=-1).reshape(b, n // COMPUTE_WGS, COMPUTE_WGS, 4)
    live = live.reshape(b, n // COMPUTE_WGS, COMPUTE_WGS)
    clo = jnp.where(live.any(-1), jnp.where(live, rows[..., 0], nk).min(-1), 0)
    chi = jnp.where(live, rows[..., 3], 0).max(-1)
    rows = jnp.where(live[..., None], rows, clo[..., None, None])
    return jnp.concatenate([clo[..., None], chi[..., None], rows.reshape(b, n // COMPUTE_WGS, -1)], -1)


def _segment_ids(seg, batch):
    return tuple(jnp.broadcast_to(a, (batch, a.shape[1])).astype(jnp.int32) for a in (seg.q_ids, seg.kv_ids))


def schedule_table(mask, sq: int, sk: int, block_q: int, block_kv: int, batch: int, keys: bool = False):
    """The kernels' schedule: per block of `COMPUTE_WGS` query tiles, the key tiles it walks
    (`keys=False`: the forward and `dq`), or per block of key tiles, the query tiles
    (`keys=True`: `dk, dv`). A static mask gives the constant `[n, cols]` of `mask_schedule` /
    `key_schedule`; with `Segments` the kinds are computed on the device per batch row (a tile
    is empty where the static part or the blocks' id ranges leave it so, full where the static
    part is full and both blocks hold one same id) and the table is `[batch, n, cols]`."""
    seg, static = split(mask)
    if seg is None:
        table = (key_schedule if keys else mask_schedule)(static, sq, sk, block_q, block_kv)
        return jnp.asarray(table)
    kinds = masks_.static_block_kinds(static, sq, sk, block_q, block_kv)[0]
    nq, nk = kinds.shape
    ids = _segment_ids(seg, batch)
    overlap = common.segment_overlap(ids, nq * block_q, nk * block_kv, block_q, block_kv)
    uniform = common.segment_uniform(ids, nq * block_q, nk * block_kv, block_q, block_kv)
    st = jnp.asarray(kinds)[None]
    kinds = jnp.where(
        ~overlap | (st == masks_.EMPTY),
        masks_.EMPTY,
        jnp.where((st == masks_.FULL) & uniform, masks_.FULL, masks_.PARTIAL),
    ).astype(jnp.int32)
    if keys:
        kinds = jnp.swapaxes(kinds, 1, 2)
    n = cdiv(kinds.shape[1], COMPUTE_WGS) * COMPUTE_WGS
    kinds = jnp.pad(kinds, [(0, 0), (0, n - kinds.shape[1]), (0, 0)], constant_values=masks_.EMPTY)
    return schedule_rows(kinds)


def key_schedule(mask, sq: int, sk: int, block_q: int, block_kv: int) -> np.ndarray:
    """`schedule` of the transposed mask for the `dk, dv` kernel: per block of `COMPUTE_WGS`
    key tiles (`block_kv` keys each), the query tiles (`block_q` rows) its producer loads and
    each compute warpgroup's four bounds, in query tiles."""
    kinds = masks_.static_block_kinds(mask, sq, sk, block_q, block_kv)[0].T
    nk = cdiv(kinds.shape[0], COMPUTE_WGS) * COMPUTE_WGS
    return schedule(np.pad(kinds, [(0, nk - kinds.shape[0]), (0, 0)], constant_values=masks_.EMPTY))


def _visible_or_none(mask, qi, kj, sk, bk):
    vis = _grid_visible(mask, qi, kj)
    if sk % bk:
        vis = kj < sk if vis is None else vis & (kj < sk)
    return vis
