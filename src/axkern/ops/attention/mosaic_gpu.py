"""Flash attention as Pallas Mosaic GPU kernels for Hopper (FA3-style), forward and backward, block-sparse.

**Layout.** `q [B, Sq, H, D]`, `k`, `v [B, Sk, KVH, D]` as the caller gives them (no transpose):
the tensor memory accelerator (TMA) copies `[rows, D]` slices of one head straight into
shared memory. `Sq` is padded to whole `2 · block_q` and `Sk` to whole `block_kv` (only where
they are not). The kernel writes `[B, Sqp, H, D]` and `lse [B, H, Sqp]` (float32, natural
log); `forward` returns them cut to `Sq`.

**Grid.** `(H, Sqp / (2 · block_q), B)`, the query-tile axis walked last to first (the
heaviest causal rows start first). A block holds three warpgroups: two compute warpgroups,
each owning `block_q` query rows (registers raised to 232 a thread), and one producer
warpgroup (registers lowered to 40) that streams the key and value tiles into a ring of
`num_stages` shared-memory slots with TMA, each slot guarded by a "loaded" barrier and a
"consumed" barrier (both compute warpgroups arrive). The two compute warpgroups alternate on
the tensor cores through a schedule barrier: one runs its `q k^T` and `p v` `wgmma`s while the
other does its softmax (FA3's ping-pong; the pattern follows JAX's `attention_mgpu.py`).

**Block-sparse schedule** (`schedule`, pure numpy, tested on the CPU against brute force).
From the static mask's block kinds (`EMPTY` / `PARTIAL` / `FULL` per `block_q x block_kv`
tile) each block gets the key tiles `[clo, chi)` its producer loads (the union of its two
query tiles' visible ranges) and each compute warpgroup four bounds `lo <= flo <= fhi <= hi`:
tiles `[flo, fhi)` (the longest run of `FULL` tiles) run without any masking work, the rest
of `[lo, hi)` mask by position (`visible` on the tile's indices and the key length), and the
tiles of `[clo, chi)` outside `[lo, hi)` are only released (the other warpgroup needs them).
Fully masked tiles are never loaded. The table is a constant `int32 [blocks, 10]` input.
Packed documents (`Segments`, alone or `&` a static mask): the block kinds are computed on the
device per batch row (a tile is empty where the static part or the id ranges of its query and
key blocks leave it empty, full where the static part is full and both blocks hold one same
id; `schedule_rows` is `schedule` in jnp), the table is `[B, blocks, 10]`, and a partial tile
also compares the rows' and columns' ids (int32, read from global memory in the tile's row
and column layouts).

**Math.** Scores `s = q k^T` in float32 on the tensor cores; the running max is kept in
base-2 units (`s · scale · log2 e`) so `p = exp2(s · c - m)` is one fused multiply-add and an
`ex2`; `p` is cast to the input dtype for `p v`. A row that has seen no key yet keeps `m = -inf`
without NaN (only masked tiles can leave a row empty). Output `acc / l` (zeros for a row that
saw no key), `lse = m · ln 2 + log l` (`-inf` there).

**Cost.** `4 · B · H · D` FLOPs per visible (query, key) pair, tensor-core bound at these sizes;
`k`, `v` read once per query block that sees them (GQA: once per query head; L2 serves the
group).

**Non-finite input.** `p v` multiplies a masked entry's `p = 0` by `v`, so a NaN in `v`
would reach rows that cannot see its key: the registered implementation serves inputs holding
NaN or infinity with another implementation (`api._mosaic_gpu_where_finite`).

**Backward** (`backward`, head dims 64 and 128), two kernels of the same shape (a producer
warpgroup streaming tiles through a TMA ring past two compute warpgroups), on the forward's
residuals: `lse` goes in base-2 units with `+inf` for rows that saw no key (every `p` there is
0) and `delta = Σ out · d_out` is formed in XLA. The `dq` kernel (grid `(H, query blocks, B)`)
holds each warpgroup's query and `d_out` tiles and streams key and value tiles (the forward's
schedule): `dp = d_out vᵀ` and `s = q kᵀ` in one `wgmma` group, `p = exp2(s · scale · log2 e −
lse)`, `ds = p (dp − delta)`, `dq += ds k`. The `dk, dv` kernel (grid `(KVH, key blocks, B)`)
holds each warpgroup's key and value tiles and streams, for every query tile of
`key_schedule` (the transposed mask's), the query tiles, `d_out` tiles, `lse` and `delta` rows
of each query head of the group: `sᵀ = k qᵀ`, `dv += pᵀ d_out`, `dpᵀ = v d_outᵀ`,
`dk += dsᵀ q`, so the GQA sum stays in registers and `dk`, `dv` are written once. Only partial
tiles mask. At head dim 256 the `dk`, `dv` accumulators alone would fill a warpgroup's
registers: the registered implementation then passes `pallas_gpu`'s Triton kernels as the
backward (`attention`'s `backward` argument); `explain` says which runs.

**Constraints** (`supports`, or an `Unsupported` at the call): a GPU of compute capability
9.x, bf16 or fp16, head dims 64, 128 or 256 (`q`, `k`, `v` alike), static masks (`Full`,
`Causal`, `SlidingWindow` and their `&`, `|`) and `Segments` alone or `&` one of them
(`PrefixLM`, `Dense` not yet), no logit soft cap and no sinks yet. Block sizes: `block_q` (rows per compute warpgroup,
64 or 128), `block_kv` (64, 128 or 256), `num_stages` (ring depth, 2 to 4); their shared
memory must fit 227 KiB. Backward (`*_dq`, `*_dkv`): `dq` 64 query rows per warpgroup by 64 or
128 keys, `dk, dv` 64 keys per warpgroup by 64 or 128 query rows, 2 to 4 stages each.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from axkern import masks as masks_
from axkern.core import backend
from axkern.core.blocks import cdiv
from axkern.core.op import Unsupported

from . import common
from .blocks import (
    MOSAIC_GPU_SMEM,
    mosaic_gpu_dkv_smem_bytes,
    mosaic_gpu_dq_smem_bytes,
    mosaic_gpu_smem_bytes,
)

try:  # the kernel runs only on a Hopper GPU; importing it must never break a CPU install
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - a jax without Pallas Mosaic GPU
    pl = plgpu = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

__all__ = [
    "supports",
    "check",
    "check_backward",
    "schedule",
    "mask_schedule",
    "key_schedule",
    "forward",
    "backward",
    "backward_blocks",
    "backward_operands",
    "attention",
    "HEAD_DIMS",
    "BACKWARD_HEAD_DIMS",
]

HEAD_DIMS = (64, 128, 256)
BACKWARD_HEAD_DIMS = (64, 128)  # at 256 the dk, dv accumulators alone fill a warpgroup's registers
LOG2E = math.log2(math.e)
COMPUTE_WGS = 2  # compute warpgroups per block, each with its own query tile
_HOPPER_KEYS = ("nvidia_h100", "nvidia_h200", "nvidia_h800", "nvidia_gh200")
# columns of the schedule table: the block's loaded key tiles, then per compute warpgroup w
# the four bounds at 2 + 4 w + (0, 1, 2, 3)
CTA_LO, CTA_HI = 0, 1
LO, FLO, FHI, HI = 0, 1, 2, 3


def _is_hopper(spec) -> bool:
    cc = backend.compute_capability() if backend.platform() == "gpu" else None
    if cc is not None:
        return cc[0] == 9
    return spec.device_key.startswith(_HOPPER_KEYS)


def supports(spec) -> str | None:
    if _IMPORT_ERROR is not None:
        return f"jax.experimental.pallas.mosaic_gpu does not import here ({_IMPORT_ERROR})"
    if spec.platform != "gpu" or not _is_hopper(spec):
        return f"the Mosaic GPU kernel needs a Hopper GPU (compute capability 9.x), not {spec.device_kind}"
    if spec.dtype not in ("bfloat16", "float16"):
        return f"the Mosaic GPU kernel takes bf16 or fp16, not {spec.dtype}"
    d, dv = spec.dim("head_dim"), spec.dim("v_dim")
    if d not in HEAD_DIMS or dv != d:
        return f"head dims {d} and {dv}: the Mosaic GPU kernel takes equal head dims of 64, 128 or 256"
    if spec.flag("soft_cap"):
        return "the Mosaic GPU kernel has no logit soft cap yet"
    if spec.flag("sinks"):
        return "the Mosaic GPU kernel has no sinks yet"
    if spec.flag("mask") in ("PrefixLM", "Dense"):
        return f"mask {spec.flag('mask')}: the Mosaic GPU kernels take static masks and Segments (not this one yet)"
    return None


# -- the block-sparse schedule (host side, numpy) ------------------------------------------------


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


def _check_blocks(block_q, block_kv, stages, d):
    if block_q not in (64, 128):
        raise Unsupported(f"block_q={block_q}: the Mosaic GPU kernel takes 64 or 128 rows per warpgroup")
    if block_kv not in (64, 128, 256):
        raise Unsupported(f"block_kv={block_kv}: the Mosaic GPU kernel takes 64, 128 or 256")
    if not 2 <= stages <= 4:
        raise Unsupported(f"num_stages={stages}: the Mosaic GPU kernel's ring holds 2 to 4 tiles")
    need = mosaic_gpu_smem_bytes(block_q, block_kv, stages, d)
    if need > MOSAIC_GPU_SMEM:
        raise Unsupported(
            f"block_q={block_q}, block_kv={block_kv}, num_stages={stages} at head dim {d} need {need} bytes "
            f"of shared memory, more than {MOSAIC_GPU_SMEM}"
        )


def _check(mask, block_q, block_kv, stages, d):
    """`Unsupported` for block sizes or a mask the kernel cannot take."""
    _check_blocks(block_q, block_kv, stages, d)
    _grid_visible(split(mask)[1], 0, 0)  # raises for a static mask it cannot evaluate on index grids


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


def _kernel(q_ref, k_ref, v_ref, sched_ref, ids, out_ref, lse_ref, scoped, *, cfg, mask, dtype):
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
    d = q_ref.shape[-1]
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    cta = cfg.blocks - 1 - lax.axis_index("q_seq")  # heaviest causal rows first
    wg = lax.axis_index("wg")
    (qo_smem2, k_smem, v_smem, lse_smem2), loaded, consumed, sched_barrier = scoped
    k_loaded, v_loaded, q_loaded = loaded
    k_consumed, v_consumed = consumed
    at = _entry_of(sched_ref, batch, cfg)
    clo, chi = at(cta, CTA_LO), at(cta, CTA_HI)
    slot_of = lambda t: lax.rem(t - clo, jnp.int32(stages))  # noqa: E731

    def sync_schedule():  # one ping-pong step between the two compute warpgroups
        plgpu.barrier_arrive(sched_barrier)
        plgpu.barrier_wait(sched_barrier)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
        col = 2 + 4 * wg
        lo, flo, fhi, hi = (at(cta, col + i) for i in (LO, FLO, FHI, HI))
        q_base = (cta * COMPUTE_WGS + wg) * bq
        q_ids = None if ids is None else _load_ids(ids[0], batch, q_base, bq, 0)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), head], qo_smem, q_loaded.at[wg])
        plgpu.barrier_wait(q_loaded.at[wg])
        row = plgpu.Layout.WGMMA.reduce(1)
        m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row)
        l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row)
        acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
        c = cfg.scale * math.log2(math.e)  # scores to base-2 units in one multiply

        def wait_next(t):  # each step starts with its key tile waited for
            @pl.when(t + 1 < chi)
            def _():
                plgpu.barrier_wait(k_loaded.at[slot_of(t + 1)])

        @pl.when(chi > clo)
        def _():
            plgpu.barrier_wait(k_loaded.at[0])

        pl.when(wg == 1)(sync_schedule)

        def step(t, carry, masked):
            acc, m_i, l_i = carry
            slot = slot_of(t)

            def qk_product(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                sync_schedule()
                return acc_ref[...]

            s = pl.run_scoped(qk_product, plgpu.ACC((bq, bk), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            if masked:
                iota = lambda dim: plgpu.broadcasted_iota(jnp.int32, (bq, bk), dim, layout=plgpu.Layout.WGMMA)  # noqa: E731
                qi, kj = q_base + iota(0), t * bk + iota(1)
                vis = _grid_visible(mask, qi, kj)
                if cfg.sk % bk:
                    vis = kj < cfg.sk if vis is None else vis & (kj < cfg.sk)
                if ids is not None:
                    same = _same_segment(q_ids, _load_ids(ids[1], batch, t * bk, bk, 1), (bq, bk))
                    vis = same if vis is None else vis & same
                if vis is not None:
                    s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1) * c)
            # a row that has seen no key yet keeps m = -inf; only masked tiles can leave it so
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha
            p16 = p.astype(dtype)

            def end_softmax():
                plgpu.barrier_arrive(sched_barrier)
                plgpu.barrier_wait(v_loaded.at[slot])
                plgpu.barrier_wait(sched_barrier)  # the tensor cores are ours again

            if d <= 128:  # this order measured faster in JAX's kernel for small head dims
                l_i = l_i + p.sum(axis=1)
                acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                end_softmax()
            else:
                end_softmax()
                l_i = l_i + p.sum(axis=1)

            def pv_product(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                wait_next(t)

            acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_new, l_i

        def release(t, carry):  # a tile only the other warpgroup needs: keep the ring turning
            slot = slot_of(t)
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            sync_schedule()
            sync_schedule()
            wait_next(t)
            return carry

        carry = (acc, m_i, l_i)
        lax.fori_loop(clo, lo, release, None)
        carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), carry)
        lax.fori_loop(hi, chi, release, None)
        acc, m_i, l_i = carry
        pl.when(wg == 0)(sync_schedule)

        seen = l_i > 0.0
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
        acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        lse = jnp.where(seen, m_i * math.log(2.0) + jnp.log(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        qo_smem[...] = acc.astype(dtype)
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_base, bq), head])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_base, bq)])
        plgpu.wait_smem_to_gmem(0)

    ring = (k_smem, v_smem, (k_loaded, v_loaded), (k_consumed, v_consumed))
    pl.when(wg == COMPUTE_WGS)(
        functools.partial(_stream_kv, cfg, (batch, head, clo, chi), k_ref, v_ref, *ring)
    )


def forward(q, k, v, mask, *, scale, block_q, block_kv, num_stages):
    """`(out [B, Sq, H, D], lse [B, H, Sq] float32)` of the Mosaic GPU kernel."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    _check(mask, block_q, block_kv, num_stages, d)
    seg, static = split(mask)
    sqp, skp = cdiv(sq, COMPUTE_WGS * block_q) * COMPUTE_WGS * block_q, cdiv(sk, block_kv) * block_kv
    table = schedule_table(mask, sq, sk, block_q, block_kv, b)
    ids = () if seg is None else common.padded_ids(_segment_ids(seg, b), sqp, skp)
    pad = lambda a, n: a if a.shape[1] == n else jnp.pad(a, [(0, 0), (0, n - a.shape[1]), (0, 0), (0, 0)])  # noqa: E731
    qp, kp, vp = pad(q, sqp), pad(k, skp), pad(v, skp)
    blocks = sqp // (COMPUTE_WGS * block_q)
    cfg = _Cfg(block_q, block_kv, num_stages, float(scale), sq, sk, h // kvh, blocks, seg is not None)
    body = functools.partial(_kernel, cfg=cfg, mask=static, dtype=q.dtype)

    def entry(*refs):
        q_ref, k_ref, v_ref, sched_ref, *ids_refs, out_ref, lse_ref = refs
        swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
        scratch = [
            plgpu.SMEM((COMPUTE_WGS, block_q, d), q.dtype, **swizzled),
            plgpu.SMEM((num_stages, block_kv, d), q.dtype, **swizzled),
            plgpu.SMEM((num_stages, block_kv, d), q.dtype, **swizzled),
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
        ]
        pl.run_scoped(
            lambda *scoped: body(
                q_ref, k_ref, v_ref, sched_ref, tuple(ids_refs) or None, out_ref, lse_ref, scoped
            ),
            scratch,
            (
                plgpu.Barrier(num_barriers=num_stages),
                plgpu.Barrier(num_barriers=num_stages),
                plgpu.Barrier(num_barriers=COMPUTE_WGS),
            ),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=num_stages),) * 2,
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    out, lse = plgpu.kernel(
        entry,
        out_type=[
            jax.ShapeDtypeStruct((b, sqp, h, d), q.dtype),
            jax.ShapeDtypeStruct((b, h, sqp), jnp.float32),
        ],
        grid=(h, sqp // (COMPUTE_WGS * block_q), b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="axkern_attention_mosaic_gpu_fwd",
    )(qp, kp, vp, table, *ids)
    return out[:, :sq], lse[:, :, :sq]


# -- the backward kernels ----------------------------------------------------------------------


def key_schedule(mask, sq: int, sk: int, block_q: int, block_kv: int) -> np.ndarray:
    """`schedule` of the transposed mask for the `dk, dv` kernel: per block of `COMPUTE_WGS`
    key tiles (`block_kv` keys each), the query tiles (`block_q` rows) its producer loads and
    each compute warpgroup's four bounds, in query tiles."""
    kinds = masks_.static_block_kinds(mask, sq, sk, block_q, block_kv)[0].T
    nk = cdiv(kinds.shape[0], COMPUTE_WGS) * COMPUTE_WGS
    return schedule(np.pad(kinds, [(0, nk - kinds.shape[0]), (0, 0)], constant_values=masks_.EMPTY))


def backward_blocks(block_sizes) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """`((block_q, block_kv, num_stages) of dq, (block_q, block_kv, num_stages) of dk, dv)`:
    the `*_dq`, `*_dkv` fields, where `None` the heuristic's (`dq` 64 x 128, `dk, dv` 64 x 64,
    two stages each)."""
    pick = lambda name, f, default: getattr(block_sizes, f"{f}_{name}", None) or default  # noqa: E731
    return tuple(
        (pick(n, "block_q", 64), pick(n, "block_kv", kv), pick(n, "num_stages", 2))
        for n, kv in (("dq", 128), ("dkv", 64))
    )


def _check_backward(mask, block_sizes, d):
    if d not in BACKWARD_HEAD_DIMS:
        raise Unsupported(f"head dim {d}: the Mosaic GPU backward kernels take {BACKWARD_HEAD_DIMS}")
    (bq1, bk1, st1), (bq2, bk2, st2) = backward_blocks(block_sizes)
    if bq1 != 64 or bk1 not in (64, 128):
        raise Unsupported(
            f"dq tiles {bq1}x{bk1}: the Mosaic GPU dq kernel takes 64 query rows by 64 or 128 keys"
        )
    if bk2 != 64 or bq2 not in (64, 128):
        raise Unsupported(
            f"dk, dv tiles {bq2}x{bk2}: the Mosaic GPU kernel takes 64 or 128 query rows by 64 keys"
        )
    for name, stages in (("dq", st1), ("dkv", st2)):
        if not 2 <= stages <= 4:
            raise Unsupported(f"num_stages_{name}={stages}: the Mosaic GPU ring holds 2 to 4 tiles")
    for name, need in (
        ("dq", mosaic_gpu_dq_smem_bytes(bq1, bk1, st1, d)),
        ("dk, dv", mosaic_gpu_dkv_smem_bytes(bq2, bk2, st2, d)),
    ):
        if need > MOSAIC_GPU_SMEM:
            raise Unsupported(f"the Mosaic GPU {name} kernel's tiles need {need} bytes of shared memory")
    _grid_visible(split(mask)[1], 0, 0)


def backward_operands(q, k, v, out, lse, d_out, *, sqp, skp):
    """What both backward kernels read: `q`, `d_out` padded to `sqp` rows and `k`, `v` to `skp`
    (zeros), `lse` in base-2 units with `+inf` for rows that saw no key and for the padding
    (so every `p = exp2(s · scale · log2 e - lse2)` there is 0), and `delta = Σ_d out · d_out`
    (float32, 0 on the padding), `[B, H, sqp]` each."""
    sq = q.shape[1]
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * LOG2E)
    rows = lambda a, n: jnp.pad(a, [(0, 0), (0, n - a.shape[1]), (0, 0), (0, 0)])  # noqa: E731
    cols = lambda a, value: jnp.pad(a, [(0, 0), (0, 0), (0, sqp - sq)], constant_values=value)  # noqa: E731
    return (
        rows(q, sqp),
        rows(k, skp),
        rows(v, skp),
        rows(d_out, sqp),
        cols(lse2, jnp.inf),
        cols(delta, 0.0),
    )


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _visible_or_none(mask, qi, kj, sk, bk):
    vis = _grid_visible(mask, qi, kj)
    if sk % bk:
        vis = kj < sk if vis is None else vis & (kj < sk)
    return vis


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sched_ref, ids, dq_ref, scoped, *, cfg, mask, dtype
):
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
    d = q_ref.shape[-1]
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    cta = cfg.blocks - 1 - lax.axis_index("q_seq")  # heaviest causal rows first
    wg = lax.axis_index("wg")
    (q_smem2, do_smem2, k_smem, v_smem), (k_loaded, v_loaded, qd_loaded), (k_consumed, v_consumed) = scoped
    at = _entry_of(sched_ref, batch, cfg)
    clo, chi = at(cta, CTA_LO), at(cta, CTA_HI)
    slot_of = lambda t: lax.rem(t - clo, jnp.int32(stages))  # noqa: E731

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        col = 2 + 4 * wg
        lo, flo, fhi, hi = (at(cta, col + i) for i in (LO, FLO, FHI, HI))
        q_base = (cta * COMPUTE_WGS + wg) * bq
        q_ids = None if ids is None else _load_ids(ids[0], batch, q_base, bq, 0)
        rows = (batch, pl.ds(q_base, bq), head)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, qd_loaded.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, qd_loaded.at[wg])
        row = plgpu.Layout.WGMMA.reduce(1)
        lse = plgpu.load(lse_ref.at[batch, head, pl.ds(q_base, bq)], layout=row, optimized=False)
        delta = plgpu.load(delta_ref.at[batch, head, pl.ds(q_base, bq)], layout=row, optimized=False)
        plgpu.barrier_wait(qd_loaded.at[wg])
        c = cfg.scale * LOG2E

        def step(t, dq, masked):
            slot = slot_of(t)
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])

            def products(dp_acc, s_acc):
                plgpu.wgmma(dp_acc, do_smem, v_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma(s_acc, q_smem, k_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma_wait(1)
                plgpu.barrier_arrive(v_consumed.at[slot])
                return dp_acc[...], s_acc[...]

            acc = plgpu.ACC((bq, bk), jnp.float32)
            dp, s = pl.run_scoped(products, acc, acc)
            if masked:
                iota = functools.partial(_iota, (bq, bk))
                vis = _visible_or_none(mask, q_base + iota(0), t * bk + iota(1), cfg.sk, bk)
                if ids is not None:
                    same = _same_segment(q_ids, _load_ids(ids[1], batch, t * bk, bk, 1), (bq, bk))
                    vis = same if vis is None else vis & same
                if vis is not None:
                    s = jnp.where(vis, s, -jnp.inf)
            bcast = lambda x: lax.broadcast_in_dim(x, s.shape, [0])  # noqa: E731
            p = jnp.exp2(s * c - bcast(lse))
            ds = (p * (dp - bcast(delta))).astype(dtype)

            def dq_product(acc_ref):
                plgpu.wgmma(acc_ref, ds, k_smem.at[slot])

            dq = pl.run_state(dq_product)(plgpu.ACC.init(dq))
            plgpu.barrier_arrive(k_consumed.at[slot])
            return dq

        def release(t, carry):  # a tile only the other warpgroup needs
            slot = slot_of(t)
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            return carry

        dq = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
        lax.fori_loop(clo, lo, release, None)
        dq = lax.fori_loop(lo, flo, functools.partial(step, masked=True), dq)
        dq = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), dq)
        dq = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), dq)
        lax.fori_loop(hi, chi, release, None)
        q_smem[...] = (dq * cfg.scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    ring = (k_smem, v_smem, (k_loaded, v_loaded), (k_consumed, v_consumed))
    pl.when(wg == COMPUTE_WGS)(
        functools.partial(_stream_kv, cfg, (batch, head, clo, chi), k_ref, v_ref, *ring)
    )


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    sched_ref,
    ids,
    dk_ref,
    dv_ref,
    scoped,
    *,
    cfg,
    mask,
    dtype,
):
    bq, bk, stages, groups = cfg.block_q, cfg.block_kv, cfg.stages, cfg.groups
    d = k_ref.shape[-1]
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
    cta = lax.axis_index("kv_seq")  # causal: the first key blocks see the most queries
    wg = lax.axis_index("wg")
    (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem), (kv_loaded, loaded), consumed = scoped
    at = _entry_of(sched_ref, batch, cfg)
    clo, chi = at(cta, CTA_LO), at(cta, CTA_HI)
    g = jnp.int32(groups)
    # the ring's items: query tile clo + u // groups of the group's query head u % groups

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
        col = 2 + 4 * wg
        lo, flo, fhi, hi = (at(cta, col + i) for i in (LO, FLO, FHI, HI))
        kv_base = (cta * COMPUTE_WGS + wg) * bk
        k_ids = None if ids is None else _load_ids(ids[1], batch, kv_base, bk, 0)
        rows = (batch, pl.ds(kv_base, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_loaded.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_loaded.at[wg])
        plgpu.barrier_wait(kv_loaded.at[wg])
        c = cfg.scale * LOG2E
        column = plgpu.Layout.WGMMA.reduce(0)
        item = lambda t: (t - clo) * g  # noqa: E731 - the first ring item of query tile t

        def accumulate(dk_acc, dv_acc):
            def step(u, carry, masked):
                slot = lax.rem(u, jnp.int32(stages))
                plgpu.barrier_wait(loaded.at[slot])

                def s_product(acc):
                    plgpu.wgmma(acc, k_smem, q_smem.at[slot].transpose((1, 0)))
                    return acc[...]

                s = pl.run_scoped(s_product, plgpu.ACC((bk, bq), jnp.float32))  # keys by queries
                lse = plgpu.load(lse_smem.at[slot], layout=column)
                delta = plgpu.load(delta_smem.at[slot], layout=column)
                if masked:
                    iota = functools.partial(_iota, (bk, bq))
                    q_base = (clo + lax.div(u, g)) * bq
                    vis = _grid_visible(mask, q_base + iota(1), kv_base + iota(0))
                    if ids is not None:
                        same = _same_segment(k_ids, _load_ids(ids[0], batch, q_base, bq, 1), (bk, bq))
                        vis = same if vis is None else vis & same
                    if vis is not None:
                        s = jnp.where(vis, s, -jnp.inf)
                bcast = lambda x: lax.broadcast_in_dim(x, s.shape, [1])  # noqa: E731
                p = jnp.exp2(s * c - bcast(lse))

                def dp_product(acc):
                    plgpu.wgmma(acc, v_smem, do_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dv_acc, p.astype(dtype), do_smem.at[slot])
                    return plgpu.wgmma_accumulator_load(acc, wait_n=1)

                dp = pl.run_scoped(dp_product, plgpu.ACC((bk, bq), jnp.float32))
                ds = (p * (dp - bcast(delta))).astype(dtype)
                plgpu.wgmma(dk_acc, ds, q_smem.at[slot])
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed.at[slot])
                return carry

            def release(u, carry):  # a query tile only the other warpgroup needs
                slot = lax.rem(u, jnp.int32(stages))
                plgpu.barrier_wait(loaded.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])
                return carry

            lax.fori_loop(item(clo), item(lo), release, None)
            lax.fori_loop(item(lo), item(flo), functools.partial(step, masked=True), None)
            lax.fori_loop(item(flo), item(fhi), functools.partial(step, masked=False), None)
            lax.fori_loop(item(fhi), item(hi), functools.partial(step, masked=True), None)
            lax.fori_loop(item(hi), item(chi), release, None)
            return dk_acc[...], dv_acc[...]

        acc = plgpu.ACC((bk, d), jnp.float32)
        dk, dv = pl.run_scoped(accumulate, acc, acc)
        k_smem[...] = (dk * cfg.scale).astype(dtype)
        v_smem[...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows])
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        @pl.loop(0, (chi - clo) * g)
        def _(u):
            slot = lax.rem(u, jnp.int32(stages))
            t, head = clo + lax.div(u, g), kv_head * g + lax.rem(u, g)
            rows, cols = (batch, pl.ds(t * bq, bq), head), (batch, head, pl.ds(t * bq, bq))

            @pl.when(u >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[cols], lse_smem.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[cols], delta_smem.at[slot], loaded.at[slot])


def backward(q, k, v, out, lse, d_out, *, mask, scale, block_sizes):
    """`(dq, dk, dv)` of the forward from its residuals (`out`, `lse` as `forward` returns
    them) and the cotangent `d_out`, by the `dq` kernel (key tiles streamed past each query
    block) and the `dk, dv` kernel (query tiles of every query head of the group streamed past
    each key block: the GQA sum stays in registers)."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    _check_backward(mask, block_sizes, d)
    (bq1, bk1, st1), (bq2, bk2, st2) = backward_blocks(block_sizes)
    mq, mk = max(COMPUTE_WGS * bq1, bq2), max(bk1, COMPUTE_WGS * bk2)
    sqp, skp = cdiv(sq, mq) * mq, cdiv(sk, mk) * mk
    qp, kp, vp, dop, lse2, delta = backward_operands(q, k, v, out, lse, d_out, sqp=sqp, skp=skp)
    seg, static = split(mask)
    ids = () if seg is None else common.padded_ids(_segment_ids(seg, b), sqp, skp)
    swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    params = plgpu.CompilerParams(approx_math=True)
    dt = q.dtype

    table = schedule_table(mask, sq, sk, bq1, bk1, b)
    cfg = _Cfg(bq1, bk1, st1, float(scale), sq, sk, h // kvh, table.shape[-2], seg is not None)
    body = functools.partial(_dq_kernel, cfg=cfg, mask=static, dtype=dt)

    def dq_entry(*refs):  # 7 inputs, the segment ids (with Segments), dq
        pl.run_scoped(
            lambda *scoped: body(*refs[:7], tuple(refs[7:-1]) or None, refs[-1], scoped),
            [
                plgpu.SMEM((COMPUTE_WGS, bq1, d), dt, **swizzled),
                plgpu.SMEM((COMPUTE_WGS, bq1, d), dt, **swizzled),
                plgpu.SMEM((st1, bk1, d), dt, **swizzled),
                plgpu.SMEM((st1, bk1, d), dt, **swizzled),
            ],
            (
                plgpu.Barrier(num_barriers=st1),
                plgpu.Barrier(num_barriers=st1),
                plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),
            ),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=st1),) * 2,
            collective_axes="wg",
        )

    dq = plgpu.kernel(
        dq_entry,
        out_type=jax.ShapeDtypeStruct((b, sqp, h, d), dt),
        grid=(h, table.shape[-2], b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=params,
        kernel_name="axkern_attention_mosaic_gpu_dq",
    )(qp, kp, vp, dop, lse2, delta, table, *ids)

    table = schedule_table(mask, sq, sk, bq2, bk2, b, keys=True)
    cfg = _Cfg(bq2, bk2, st2, float(scale), sq, sk, h // kvh, table.shape[-2], seg is not None)
    body = functools.partial(_dkv_kernel, cfg=cfg, mask=static, dtype=dt)

    def dkv_entry(*refs):  # 7 inputs, the segment ids (with Segments), dk, dv
        pl.run_scoped(
            lambda *scoped: body(*refs[:7], tuple(refs[7:-2]) or None, *refs[-2:], scoped),
            [
                plgpu.SMEM((COMPUTE_WGS, bk2, d), dt, **swizzled),
                plgpu.SMEM((COMPUTE_WGS, bk2, d), dt, **swizzled),
                plgpu.SMEM((st2, bq2, d), dt, **swizzled),
                plgpu.SMEM((st2, bq2, d), dt, **swizzled),
                plgpu.SMEM((st2, bq2), jnp.float32),
                plgpu.SMEM((st2, bq2), jnp.float32),
            ],
            (
                plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),
                plgpu.Barrier(num_arrivals=4, num_barriers=st2),
            ),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=st2),
            collective_axes="wg",
        )

    kv_shape = jax.ShapeDtypeStruct((b, skp, kvh, d), dt)
    dk, dv = plgpu.kernel(
        dkv_entry,
        out_type=[kv_shape, kv_shape],
        grid=(kvh, table.shape[-2], b),
        grid_names=("heads", "kv_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=params,
        kernel_name="axkern_attention_mosaic_gpu_dkv",
    )(qp, kp, vp, dop, lse2, delta, table, *ids)
    return dq[:, :sq], dk[:, :sk], dv[:, :sk]


def _blocks(block_sizes) -> dict:
    return dict(
        block_q=block_sizes.block_q, block_kv=block_sizes.block_kv, num_stages=block_sizes.num_stages or 2
    )


def check(mask, block_sizes, head_dim, sinks=None, logits_soft_cap=None) -> None:
    """`Unsupported` with the reason when the forward kernel cannot serve these options (the
    backward kernels: `check_backward`)."""
    if sinks is not None or logits_soft_cap is not None:
        raise Unsupported("the Mosaic GPU kernel has no sinks and no logit soft cap yet")
    b = _blocks(block_sizes)
    _check(mask, b["block_q"], b["block_kv"], b["num_stages"], head_dim)


def check_backward(mask, block_sizes, head_dim) -> str | None:
    """Why the backward kernels cannot serve these options, or None."""
    try:
        _check_backward(mask, block_sizes, head_dim)
    except Unsupported as e:
        return str(e)
    return None


def attention(q, k, v, sinks, mask, *, scale, logits_soft_cap, block_sizes, backward=None):
    """The forward kernel under a `custom_vjp` whose backward is the Mosaic GPU `dq` and `dk, dv`
    kernels, or `backward(q, k, v, out, lse, d_out, *, mask) -> (dq, dk, dv)` when one is given
    (the registered implementation passes `pallas_gpu`'s kernels where `check_backward` refuses).
    The mask's arrays (segment ids) are arguments of the `custom_vjp`, not closed over, so a
    jitted call with traced ids differentiates."""
    check(mask, block_sizes, q.shape[3], sinks, logits_soft_cap)
    fwd = functools.partial(forward, scale=scale, **_blocks(block_sizes))
    if backward is None:
        backward = functools.partial(globals()["backward"], scale=scale, block_sizes=block_sizes)
    leaves, treedef = jax.tree.flatten(mask)
    rebuild = functools.partial(jax.tree.unflatten, treedef)

    @jax.custom_vjp
    def fn(q, k, v, leaves):
        return fwd(q, k, v, rebuild(leaves))[0]

    def fn_fwd(q, k, v, leaves):
        out, lse = fwd(q, k, v, rebuild(leaves))
        return out, (q, k, v, out, lse, leaves)

    def fn_bwd(res, d_out):
        *res, leaves = res
        return (*backward(*res, d_out, mask=rebuild(leaves)), None)

    fn.defvjp(fn_fwd, fn_bwd)
    return fn(q, k, v, leaves)
