"""The kernels' block-sparse schedules (pure numpy on the host for static masks, jnp on the
device for masks holding arrays) and the masks evaluated on a tile's index grids (`lower`,
`grid_visible`); `__init__`'s docstring has the table's layout and meaning."""

from __future__ import annotations

import dataclasses

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
# a table with a tile list (`schedule(..., tiles=True)`): step s of a block loads the tile at
# column LIST + s
LIST = 2 + 4 * COMPUTE_WGS


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


def has_gaps(kinds, wgs: int = COMPUTE_WGS) -> bool:
    """Whether some block of `wgs` query tiles (rows of `kinds [nq, nk]`, `nq` a multiple of
    `wgs`) leaves an empty key tile between two that it sees (a `|` of masks with a gap between
    them)."""
    kinds = np.asarray(kinds)
    used = (kinds != masks_.EMPTY).reshape(kinds.shape[0] // wgs, wgs, -1).any(1)
    count = used.sum(1)
    first, last = used.argmax(1), used.shape[1] - used[:, ::-1].argmax(1)
    return bool(((count > 0) & (last - first > count)).any())


def schedule(kinds, wgs: int = COMPUTE_WGS, tiles: bool = False) -> np.ndarray:
    """The kernel's tile schedule from a static mask's block kinds.

    **Arguments:** `kinds`: int `[nq, nk]` (`masks.EMPTY`, `PARTIAL`, `FULL` per query tile by
    key tile), `nq` a multiple of `wgs`; block `c` owns query tiles `c · wgs + w`. `tiles`: a
    tile list per block (below).

    **Returns:** int32 `[nq / wgs, 2 + 4 · wgs]`: per block the key tiles its producer loads,
    `[clo, chi)` (the union of its query tiles' ranges; `clo == chi` when all are empty),
    then per compute warpgroup `(lo, flo, fhi, hi)`: the visited tiles `[lo, hi)` from the
    first to the last non-empty one, and inside them the longest run of `FULL` tiles
    `[flo, fhi)`, visited without masking (`flo == fhi == hi` when none). A warpgroup whose
    row is empty gets `lo = flo = fhi = hi = clo`.

    With `tiles=True`, `[nq / wgs, 2 + 4 · wgs + m]`: a block walks steps, not tiles. Its
    steps `[0, n)` are the `n` key tiles that any of its query tiles sees, in order, their
    indices at columns `2 + 4 · wgs + s` (`LIST`; zeros after; `m` the largest `n`, at least
    1), and every bound above counts steps: no empty tile between two seen ones is loaded
    (`has_gaps`).
    """
    kinds = np.asarray(kinds)
    nq, nk = kinds.shape
    if nq % wgs:
        raise ValueError(f"schedule: {nq} query tiles are not a multiple of {wgs} warpgroups")
    width = max(1, int((kinds != masks_.EMPTY).reshape(nq // wgs, wgs, nk).any(1).sum(1).max(initial=0)))
    table = np.zeros((nq // wgs, 2 + 4 * wgs + (width if tiles else 0)), np.int32)
    for c in range(nq // wgs):
        block = kinds[c * wgs : (c + 1) * wgs]
        if tiles:
            used = np.flatnonzero((block != masks_.EMPTY).any(0))
            table[c, 2 + 4 * wgs : 2 + 4 * wgs + used.size] = used
            block = block[:, used]
        rows = []
        for w in range(wgs):
            row = block[w]
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
    return _static_schedule(kinds)


def _static_schedule(kinds) -> np.ndarray:
    """`schedule` of a static mask's kinds padded with empty rows to whole blocks, with a tile
    list where a block would otherwise load an empty tile between two it sees."""
    n = cdiv(kinds.shape[0], COMPUTE_WGS) * COMPUTE_WGS
    kinds = np.pad(kinds, [(0, n - kinds.shape[0]), (0, 0)], constant_values=masks_.EMPTY)
    return schedule(kinds, tiles=has_gaps(kinds))


@dataclasses.dataclass(frozen=True)
class Dynamic(masks_.Mask):
    """In the mask a kernel evaluates (`lower`): a leaf holding arrays, which the kernel reads
    as its mask operands from `index` on (`Segments`: the query ids then the key ids, int32
    `[B, padded length]`; `PrefixLM`: the prefix lengths, int32 `[B]`)."""

    kind: str  # "segments" or "prefix"
    index: int


def lower(mask) -> tuple[masks_.Mask, list]:
    """`(the mask with each leaf holding arrays replaced by a `Dynamic`, those leaves in order)`
    for the masks the kernels take: static masks, `Segments` and `PrefixLM`, and `&`, `|` of
    them; anything else (`Dense`) is `Unsupported`."""
    leaves, at = [], [0]

    def walk(m):
        if masks_.is_static(m):
            grid_visible(m, 0, 0)  # raises for a static mask with no form on index grids
            return m
        if type(m) in (masks_.And, masks_.Or):
            return type(m)(walk(m.a), walk(m.b))
        kind = {masks_.Segments: "segments", masks_.PrefixLM: "prefix"}.get(type(m))
        if kind is None:
            raise Unsupported(
                f"{m!r}: the Mosaic GPU kernels take static masks, Segments and PrefixLM, and & or | of them "
                "(not Dense)"
            )
        leaves.append(m)
        at[0] += 2 if kind == "segments" else 1
        return Dynamic(kind, at[0] - (2 if kind == "segments" else 1))

    return walk(mask), leaves


def operands(leaves, batch: int, sqp: int, skp: int) -> tuple:
    """The kernels' mask operands of `lower`'s leaves: segment ids edge-padded to the padded
    lengths, prefix lengths, int32, each over the batch."""
    out = []
    for leaf in leaves:
        if isinstance(leaf, masks_.Segments):
            out += common.padded_ids(_segment_ids(leaf, batch), sqp, skp)
        else:
            out.append(masks_.int32_lengths(jnp.broadcast_to(leaf.prefix_lengths, (batch,))))
    return tuple(out)


def grid_visible(mask, q, k, dynamic=None):
    """`visible` of a mask on 2-D index grids (`q`, `k`: int32 `[rows, cols]` in the kernel's
    register layout), or None where it is everywhere visible; a `Dynamic` leaf is
    `dynamic(leaf, q, k)`."""
    if isinstance(mask, masks_.Full):
        return None
    if isinstance(mask, (masks_.Causal, masks_.SlidingWindow)):
        return mask.visible_grid(q, k)
    if isinstance(mask, Dynamic):
        return True if dynamic is None else dynamic(mask, q, k)
    if type(mask) in (masks_.And, masks_.Or):
        a, b = grid_visible(mask.a, q, k, dynamic), grid_visible(mask.b, q, k, dynamic)
        if type(mask) is masks_.Or:
            return None if a is None or b is None else a | b
        return b if a is None else a if b is None else a & b
    raise Unsupported(f"{mask!r}: the Mosaic GPU kernels evaluate no such static mask on a tile")


# -- on the device ----------------------------------------------------------------------------


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
    return masks_.int32_ids(*(jnp.broadcast_to(a, (batch, a.shape[1])) for a in (seg.q_ids, seg.kv_ids)))


def device_kinds(mask, sq: int, sk: int, block_q: int, block_kv: int, batch: int):
    """Block kinds `[B or 1, nq, nk]` (int32 `EMPTY`, `PARTIAL`, `FULL`) of a mask holding arrays,
    traced: a static part's from `block_kinds`; `Segments`: empty where the blocks' id ranges do
    not meet, full where both blocks hold one same id; `PrefixLM`: full where every key of the
    tile is at or before every query or inside the prefix, empty where every key is after every
    query and past the prefix. `&` takes the smaller kind, `|` the larger (`EMPTY < PARTIAL <
    FULL`: exact for empty and full, partial otherwise). The lengths bound all of it."""
    nq, nk = cdiv(sq, block_q), cdiv(sk, block_kv)

    def kinds(m):
        if masks_.is_static(m):
            return jnp.asarray(masks_.static_block_kinds(m, sq, sk, block_q, block_kv))
        if type(m) in (masks_.And, masks_.Or):
            pick = jnp.minimum if type(m) is masks_.And else jnp.maximum
            return pick(kinds(m.a), kinds(m.b))
        if isinstance(m, masks_.Segments):
            ids = _segment_ids(m, batch)
            overlap = common.segment_overlap(ids, nq * block_q, nk * block_kv, block_q, block_kv)
            uniform = common.segment_uniform(ids, nq * block_q, nk * block_kv, block_q, block_kv)
            return jnp.where(~overlap, masks_.EMPTY, jnp.where(uniform, masks_.FULL, masks_.PARTIAL))
        if isinstance(m, masks_.PrefixLM):
            p = masks_.int32_lengths(jnp.broadcast_to(m.prefix_lengths, (batch,)))[:, None, None]
            q0 = (jnp.arange(nq, dtype=jnp.int32) * block_q)[None, :, None]
            k0 = (jnp.arange(nk, dtype=jnp.int32) * block_kv)[None, None, :]
            q1, k1 = q0 + block_q - 1, k0 + block_kv - 1
            full = (k1 <= q0) | (k1 < p)
            empty = (k0 > q1) & (k0 >= p)
            return jnp.where(full, masks_.FULL, jnp.where(empty, masks_.EMPTY, masks_.PARTIAL))
        raise Unsupported(f"{m!r}: the Mosaic GPU kernels have no block kinds for it")

    bound = jnp.asarray(masks_.static_block_kinds(masks_.Full(), sq, sk, block_q, block_kv))
    return jnp.minimum(kinds(mask), bound).astype(jnp.int32)


def schedule_table(mask, sq: int, sk: int, block_q: int, block_kv: int, batch: int, keys: bool = False):
    """The kernels' schedule: per block of `COMPUTE_WGS` query tiles, the key tiles it walks
    (`keys=False`: the forward and `dq`), or per block of key tiles, the query tiles
    (`keys=True`: `dk, dv`). A static mask gives the constant `[n, cols]` of `mask_schedule` /
    `key_schedule` (with a tile list where some block's seen tiles leave a gap); a mask holding
    arrays (`Segments`, `PrefixLM`) has its kinds computed on the device (`device_kinds`) and
    the table per batch row, `[batch, n, cols]`, ranges without a tile list (a gap there, ids
    that repeat after other ids, is loaded and masked)."""
    if masks_.is_static(mask):
        table = (key_schedule if keys else mask_schedule)(mask, sq, sk, block_q, block_kv)
        return jnp.asarray(table)
    kinds = jnp.broadcast_to(
        device_kinds(mask, sq, sk, block_q, block_kv, batch), (batch, cdiv(sq, block_q), cdiv(sk, block_kv))
    )
    if keys:
        kinds = jnp.swapaxes(kinds, 1, 2)
    n = cdiv(kinds.shape[1], COMPUTE_WGS) * COMPUTE_WGS
    kinds = jnp.pad(kinds, [(0, 0), (0, n - kinds.shape[1]), (0, 0)], constant_values=masks_.EMPTY)
    return schedule_rows(kinds)


def key_schedule(mask, sq: int, sk: int, block_q: int, block_kv: int) -> np.ndarray:
    """`schedule` of the transposed mask for the `dk, dv` kernel: per block of `COMPUTE_WGS`
    key tiles (`block_kv` keys each), the query tiles (`block_q` rows) its producer loads and
    each compute warpgroup's four bounds, in query tiles."""
    return _static_schedule(masks_.static_block_kinds(mask, sq, sk, block_q, block_kv)[0].T)
