"""What the Mosaic GPU kernels share inside: a call's static configuration, the schedule
table's reads, segment ids in a tile's row and column layouts, index grids, and the producer
warpgroup that streams key and value tiles through the ring (forward and `dq`)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

try:  # the kernel runs only on a Hopper GPU; importing it must never break a CPU install
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - a jax without Pallas Mosaic GPU
    pl = plgpu = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"


LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    block_q: int
    block_kv: int
    stages: int
    scale: float
    sq: int
    sk: int
    groups: int  # query heads per kv head
    blocks: int  # query blocks (of COMPUTE_WGS * block_q rows)
    segments: bool = False  # per-batch-row schedule tables and segment ids to compare


def _entry_of(sched_ref, batch, cfg):
    """`(block, column) -> int32` of the schedule table (a batch row's with segments)."""
    if cfg.segments:
        return lambda cta, col: sched_ref[batch, cta, col]
    return lambda cta, col: sched_ref[cta, col]


def _same_segment(row_ids, col_ids, shape):
    """Equal ids of a tile's rows (`WGMMA.reduce(1)` vector) and columns (`reduce(0)`)."""
    return lax.broadcast_in_dim(row_ids, shape, [0]) == lax.broadcast_in_dim(col_ids, shape, [1])


def _load_ids(ids_ref, batch, start, n, dim):
    """`n` int32 ids from `start` of a batch row, laid out along tile dimension `dim` (0: rows)."""
    layout = plgpu.Layout.WGMMA.reduce(1 - dim)
    return plgpu.load(ids_ref.at[batch, pl.ds(start, n)], layout=layout, optimized=False)


def _stream_kv(cfg, where, k_ref, v_ref, k_smem, v_smem, loaded, consumed):
    """The producer warpgroup of the forward and `dq` kernels: key and value tiles `[clo, chi)`
    of `head`'s kv head into the ring, each slot reused once both compute warpgroups have
    released it. `where`: `(batch, query head, clo, chi)`."""
    batch, head, clo, chi = where
    plgpu.set_max_registers(40, action="decrease")
    kv_head = lax.div(head, jnp.int32(cfg.groups))
    bk, stages = cfg.block_kv, cfg.stages

    @pl.loop(clo, chi)
    def _(t):
        slot, reuse = lax.rem(t - clo, jnp.int32(stages)), t - clo >= stages
        rows = (batch, pl.ds(t * bk, bk), kv_head)
        for ref, smem, ready, free in zip((k_ref, v_ref), (k_smem, v_smem), loaded, consumed, strict=True):

            @pl.when(reuse)
            def _(free=free):
                plgpu.barrier_wait(free.at[slot])

            plgpu.copy_gmem_to_smem(ref.at[rows], smem.at[slot], ready.at[slot])


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
