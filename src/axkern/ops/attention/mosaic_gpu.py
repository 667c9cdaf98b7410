"""Flash attention forward as a Pallas Mosaic GPU kernel for Hopper (FA3-style), block-sparse.

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

**Backward.** There is no Mosaic GPU backward yet: `attention` takes the backward as an
argument, and the registered implementation passes `pallas_gpu`'s Triton `dq` and `dk, dv`
kernels, fed this forward's residuals (`out`, `lse`). `explain` says so.

**Constraints** (`supports`, or an `Unsupported` at the call): a GPU of compute capability
9.x, bf16 or fp16, head dims 64, 128 or 256 (`q`, `k`, `v` alike), static masks only
(`Full`, `Causal`, `SlidingWindow` and their `&`, `|`; `Segments`, `PrefixLM`, `Dense` not
yet), no logit soft cap and no sinks yet. Block sizes: `block_q` (rows per compute warpgroup,
64 or 128), `block_kv` (64, 128 or 256), `num_stages` (ring depth, 2 to 4); their shared
memory must fit 227 KiB.
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

from .blocks import MOSAIC_GPU_SMEM, mosaic_gpu_smem_bytes

try:  # the kernel runs only on a Hopper GPU; importing it must never break a CPU install
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - a jax without Pallas Mosaic GPU
    pl = plgpu = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

__all__ = ["supports", "check", "schedule", "mask_schedule", "forward", "attention", "HEAD_DIMS"]

HEAD_DIMS = (64, 128, 256)
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
    if spec.flag("mask") in ("Segments", "PrefixLM", "Dense"):
        return (
            f"mask {spec.flag('mask')} holds arrays; the Mosaic GPU kernel schedules static masks only (yet)"
        )
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
    raise Unsupported(f"{mask!r}: the Mosaic GPU kernel schedules static masks only (yet)")


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
    if not masks_.is_static(mask):
        raise Unsupported(f"{mask!r} holds arrays; the Mosaic GPU kernel schedules static masks only (yet)")
    _grid_visible(mask, 0, 0)  # raises for a static mask it cannot evaluate on index grids


def _kernel(q_ref, k_ref, v_ref, sched_ref, out_ref, lse_ref, scoped, *, cfg, mask, dtype):
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
    d = q_ref.shape[-1]
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    cta = cfg.blocks - 1 - lax.axis_index("q_seq")  # heaviest causal rows first
    wg = lax.axis_index("wg")
    (qo_smem2, k_smem, v_smem, lse_smem2), loaded, consumed, sched_barrier = scoped
    k_loaded, v_loaded, q_loaded = loaded
    k_consumed, v_consumed = consumed
    clo, chi = sched_ref[cta, CTA_LO], sched_ref[cta, CTA_HI]
    slot_of = lambda t: lax.rem(t - clo, jnp.int32(stages))  # noqa: E731

    def sync_schedule():  # one ping-pong step between the two compute warpgroups
        plgpu.barrier_arrive(sched_barrier)
        plgpu.barrier_wait(sched_barrier)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
        col = 2 + 4 * wg
        lo, flo, fhi, hi = (sched_ref[cta, col + i] for i in (LO, FLO, FHI, HI))
        q_base = (cta * COMPUTE_WGS + wg) * bq
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

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.int32(cfg.groups))

        @pl.loop(clo, chi)
        def _(t):
            slot, reuse = slot_of(t), t - clo >= stages
            rows = (batch, pl.ds(t * bk, bk), kv_head)

            @pl.when(reuse)
            def _():
                plgpu.barrier_wait(k_consumed.at[slot])

            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])

            @pl.when(reuse)
            def _():
                plgpu.barrier_wait(v_consumed.at[slot])

            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])


def forward(q, k, v, mask, *, scale, block_q, block_kv, num_stages):
    """`(out [B, Sq, H, D], lse [B, H, Sq] float32)` of the Mosaic GPU kernel (static `mask`)."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    _check(mask, block_q, block_kv, num_stages, d)
    sqp, skp = cdiv(sq, COMPUTE_WGS * block_q) * COMPUTE_WGS * block_q, cdiv(sk, block_kv) * block_kv
    table = jnp.asarray(mask_schedule(mask, sq, sk, block_q, block_kv))
    pad = lambda a, n: a if a.shape[1] == n else jnp.pad(a, [(0, 0), (0, n - a.shape[1]), (0, 0), (0, 0)])  # noqa: E731
    qp, kp, vp = pad(q, sqp), pad(k, skp), pad(v, skp)
    cfg = _Cfg(block_q, block_kv, num_stages, float(scale), sq, sk, h // kvh, sqp // (COMPUTE_WGS * block_q))
    body = functools.partial(_kernel, cfg=cfg, mask=mask, dtype=q.dtype)

    def entry(q_ref, k_ref, v_ref, sched_ref, out_ref, lse_ref):
        swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
        scratch = [
            plgpu.SMEM((COMPUTE_WGS, block_q, d), q.dtype, **swizzled),
            plgpu.SMEM((num_stages, block_kv, d), q.dtype, **swizzled),
            plgpu.SMEM((num_stages, block_kv, d), q.dtype, **swizzled),
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
        ]
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, v_ref, sched_ref, out_ref, lse_ref, scoped),
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
    )(qp, kp, vp, table)
    return out[:, :sq], lse[:, :, :sq]


def _blocks(block_sizes) -> dict:
    return dict(
        block_q=block_sizes.block_q, block_kv=block_sizes.block_kv, num_stages=block_sizes.num_stages or 2
    )


def check(mask, block_sizes, head_dim, sinks=None, logits_soft_cap=None) -> None:
    """`Unsupported` with the reason when the kernel cannot serve these options."""
    if sinks is not None or logits_soft_cap is not None:
        raise Unsupported("the Mosaic GPU kernel has no sinks and no logit soft cap yet")
    b = _blocks(block_sizes)
    _check(mask, b["block_q"], b["block_kv"], b["num_stages"], head_dim)


def attention(q, k, v, sinks, mask, *, scale, logits_soft_cap, block_sizes, backward):
    """The forward kernel under a `custom_vjp` whose backward is `backward(q, k, v, out, lse,
    d_out) -> (dq, dk, dv)` (the registered implementation passes `pallas_gpu`'s kernels)."""
    check(mask, block_sizes, q.shape[3], sinks, logits_soft_cap)
    fwd = functools.partial(forward, mask=mask, scale=scale, **_blocks(block_sizes))

    @jax.custom_vjp
    def fn(q, k, v):
        return fwd(q, k, v)[0]

    def fn_fwd(q, k, v):
        out, lse = fwd(q, k, v)
        return out, (q, k, v, out, lse)

    def fn_bwd(res, d_out):
        return backward(*res, d_out)

    fn.defvjp(fn_fwd, fn_bwd)
    return fn(q, k, v)
