"""What the Mosaic GPU kernels share inside: a call's static configuration, the schedule
table's reads, the mask on a tile (segment ids in a tile's row and column layouts, prefix
lengths), index grids, soft-capped scores, and the producer warpgroup that streams key and
value tiles through the ring (forward and `dq`)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from axkern import masks as masks_
from axkern.core.compat import mosaic_gpu_load

from .schedules import LIST, Dynamic, grid_visible

try:  # the kernels run only on a Hopper GPU; importing them must never break a CPU install
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - a jax without Pallas Mosaic GPU
    pl = plgpu = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"


LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """A kernel's static configuration: its tiles (`block_q` rows by `block_kv` columns; the
    `dk, dv` kernel's rows are keys), ring depth, scale, lengths, the GQA group and the number of
    blocks of `COMPUTE_WGS` row tiles."""

    block_q: int
    block_kv: int
    stages: int
    scale: float
    sq: int
    sk: int
    groups: int  # query heads per kv head
    blocks: int  # blocks of the grid's row axis, each of COMPUTE_WGS row tiles
    dynamic: bool = False  # a mask holding arrays: per-batch-row schedule tables, mask operands
    soft_cap: float | None = None
    sinks: bool = False
    tiles: bool = False  # the schedule table has a tile list (`schedules.schedule`): steps are not tiles


def base2_scores(s, cfg):
    """Scores `s = q kᵀ` (float32, unscaled) toward base-2 units: `(s, c, None)`, the caller
    multiplying by `c = scale · log2 e` where it fuses best, or with a soft cap
    `(tanh(s · scale / cap) · cap · log2 e, None, t)`, already in base-2 units, with
    `t = tanh(...)` for the backward's derivative `1 - t²`."""
    if cfg.soft_cap is None:
        return s, cfg.scale * LOG2E, None
    t = jnp.tanh(s * (cfg.scale / cfg.soft_cap))
    return t * (cfg.soft_cap * LOG2E), None, t


def times(x, c):
    """`x · c`, or `x` where `c` is None (scores already in base-2 units)."""
    return x if c is None else x * c


def table_reader(sched_ref, batch, cfg):
    """`(block, column) -> int32` of the schedule table (a batch row's with segments)."""
    if cfg.dynamic:
        return lambda cta, col: sched_ref[batch, cta, col]
    return lambda cta, col: sched_ref[cta, col]


def dynamic_leaves(mask) -> list:
    """The `schedules.Dynamic` leaves of a lowered mask, in order."""
    return [m for m in masks_.leaves(mask) if isinstance(m, Dynamic)]


def tile_of(at, cta, cfg):
    """`step -> tile` of block `cta` (`at`: `table_reader`'s reader): the table's tile list where
    it has one (`cfg.tiles`), else the step itself."""
    if not cfg.tiles:
        return lambda t: t
    return lambda t: at(cta, LIST + t)


def warpgroup_bounds(at, cta, wg):
    """`(lo, flo, fhi, hi)` of compute warpgroup `wg` in block `cta`'s row of the schedule table
    (`at`: `table_reader`'s reader)."""
    return tuple(at(cta, 2 + 4 * wg + i) for i in range(4))


class TileMask:
    """A kernel's mask on its tiles (`schedules.lower`'s form): the static leaves on index
    grids, a `Segments` leaf by its rows' ids (loaded once, in the constructor) against each
    tile's columns' ids, a `PrefixLM` leaf by its batch row's prefix length (read once).
    `keys_first`: the tiles' rows are keys (the `dk, dv` kernel). Built inside a compute
    warpgroup."""

    def __init__(self, mask, refs, batch, row_base, rows, keys_first=False):
        self.mask, self.refs, self.batch, self.flip = mask, refs, batch, int(keys_first)
        self.own = {}
        for leaf in dynamic_leaves(mask):
            if leaf.kind == "segments":
                self.own[leaf.index] = _load_ids(refs[leaf.index + self.flip], batch, row_base, rows, 0)
            else:
                self.own[leaf.index] = refs[leaf.index][batch]

    def visible(self, q, k, col_base, cols, key_len=None):
        """Where a tile is visible (None: everywhere), `q`, `k` its index grids (rows by
        columns) and its columns `[col_base, col_base + cols)`; `key_len`: keys from there on
        are padding."""

        def dynamic(leaf, q, k):
            if leaf.kind == "prefix":
                return (k <= q) | (k < self.own[leaf.index])
            ids = _load_ids(self.refs[leaf.index + 1 - self.flip], self.batch, col_base, cols, 1)
            return _same_segment(self.own[leaf.index], ids, q.shape)

        vis = grid_visible(self.mask, q, k, dynamic)
        if key_len is not None:
            vis = k < key_len if vis is None else vis & (k < key_len)
        return vis


def _same_segment(row_ids, col_ids, shape):
    """Equal ids of a tile's rows (`WGMMA.reduce(1)` vector) and columns (`reduce(0)`)."""
    return lax.broadcast_in_dim(row_ids, shape, [0]) == lax.broadcast_in_dim(col_ids, shape, [1])


def _load_ids(ids_ref, batch, start, n, dim):
    """`n` int32 ids from `start` of a batch row, laid out along tile dimension `dim` (0: rows)."""
    layout = plgpu.Layout.WGMMA.reduce(1 - dim)
    return mosaic_gpu_load(ids_ref.at[batch, pl.ds(start, n)], layout=layout, optimized=False)


def stream_kv(cfg, where, k_ref, v_ref, k_smem, v_smem, loaded, consumed):
    """The producer warpgroup of the forward and `dq` kernels: key and value tiles `[clo, chi)`
    of `head`'s kv head into the ring, each slot reused once both compute warpgroups have
    released it (on its `consumed` mbarrier). `where`: `(batch, query head, clo, chi, tile)`,
    the steps `[clo, chi)` and `tile` (`tile_of`) the key tile of a step."""
    batch, head, clo, chi, tile = where
    plgpu.set_max_registers(40, action="decrease")
    kv_head = lax.div(head, jnp.int32(cfg.groups))
    bk, stages = cfg.block_kv, cfg.stages

    @pl.loop(clo, chi)
    def _(t):
        slot, reuse = lax.rem(t - clo, jnp.int32(stages)), t - clo >= stages
        rows = (batch, pl.ds(tile(t) * bk, bk), kv_head)
        for ref, smem, ready, free in zip((k_ref, v_ref), (k_smem, v_smem), loaded, consumed, strict=True):

            @pl.when(reuse)
            def _(free=free):
                plgpu.barrier_wait(free.at[slot])

            plgpu.copy_gmem_to_smem(ref.at[rows], smem.at[slot], ready.at[slot])


def iota(shape, dim):
    """int32 indices along `dim` of a `shape` tile in the `wgmma` register layout."""
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
