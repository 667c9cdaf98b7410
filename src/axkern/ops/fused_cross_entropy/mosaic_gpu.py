"""The fused cross-entropy statistics as a Hopper kernel (Pallas Mosaic GPU): no logits in HBM.

**Kernel.** A persistent grid of one CTA per multiprocessor walks the `[token tiles, vocab
tiles]` output tiles in a locality-preserving snake (`plgpu.planar_snake`, bands of
`RASTER` token tiles). A CTA tile is `2·tile_m` rows of `x` by `tile_n` columns of `w`: a
producer warpgroup streams `[2·tile_m, tile_k]` slices of `x` and `[tile_k, tile_n]` slices of
`w` by TMA into a ring of `stages` shared-memory slots
(`plgpu.emit_pipeline_warp_specialized`), and two consumer warpgroups each accumulate their
`tile_m` rows with `wgmma` into float32 registers over the `D / tile_k` steps. The epilogue
never leaves the registers: the soft cap, then per row the tile's max `m`,
`s = sum exp(z - m)` and (with label smoothing) the sum of the logits, staged through shared
memory and written by TMA as one float32 value per row and vocab tile. XLA merges the tiles
(`common.merge_tiles`: `lse = max_j m_j + log sum_j s_j exp(m_j - max_j m_j)`).

Each step waits for its `wgmma` before its ring slot is released: with a group left in flight
(`delay_release`), the last step's slot of a tile is never released, and the next tile's first
loads, into the ring the tiles share, could overwrite it under a product still reading it.

**The label's logit.** The kernel reads each row's label and its epilogue picks the logit
from the tile holding that column: one more float32 value per row and vocab tile, zero in the
other tiles, that XLA sums.

**Outside the kernel.** XLA merges the per-tile statistics. Columns past the last whole vocab
tile (`V mod tile_n` of them) are one `[N, V mod tile_n]` XLA product folded in as one more
tile (the label's logit of a label among them picked there); token rows are padded to a whole
CTA tile (with a copy of `x` only when `N` is not a multiple of `2·tile_m`).

**Backward: recomputation in XLA** (`common.recomputing`), as `pallas_gpu`'s. The reduced
loss (`fused_cross_entropy_loss`) calls the same kernel for its undifferentiated value (its
gradients are formed in its forward pass by XLA, `6·N·D·V` FLOPs).

**Cost.** `2·N·D·V` tensor-core FLOPs; bytes: `x` once per vocab tile and `w` once per token
tile, mostly from L2 (the snake keeps `RASTER` token tiles' rows and about
`multiprocessors / RASTER` vocab tiles' columns in flight), plus `4·N·V / tile_n` bytes of
statistics per value (the label's logit one of them) and `4·N` bytes of labels per vocab tile.

**Constraints.** bf16 or fp16 `x` and `w` (`wgmma` operands), `D` a multiple of `tile_k`,
`V` a multiple of 64 (the TMA copies of `w` take 128-byte swizzled tiles), a Hopper GPU. **Interpret mode:**
Mosaic GPU's `wgmma` and TMA copies have no CPU rule, so the kernel runs only on the device.
The CPU tests lower it for a CUDA GPU (`lowering_platforms=("cuda",)`: every Pallas and Mosaic
GPU lowering step, layouts and TMA tilings included), and `emulate_tile_stats` computes its
outputs in XLA: they carry everything around the kernel (padding, the tail, the label's logit,
the merge, dispatch) with it in the kernel's place.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core import backend
from axkern.core.blocks import cdiv
from axkern.core.compat import mosaic_gpu_load
from axkern.core.op import Implementation, Unsupported

from . import common
from .blocks import MOSAIC_GPU_SMEM as SMEM_LIMIT
from .blocks import (
    CrossEntropyBlockSizes,
    describe_loss,
    loss_heuristic,
    loss_space,
    mosaic_gpu_heuristic,
    mosaic_gpu_space,
)
from .blocks import mosaic_gpu_smem_bytes as smem_bytes

try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means the kernel cannot serve
    pl = plgpu = None
    _IMPORT_ERROR = e

__all__ = [
    "IMPLEMENTATION",
    "LOSS_IMPLEMENTATION",
    "KernelConfig",
    "supports",
    "stats",
    "value_stats",
    "emulated_value_stats",
    "kernel_config",
    "kernel_tiles",
    "tile_stats",
    "emulate_tile_stats",
    "smem_bytes",
    "SMEM_LIMIT",
]

COMPUTE_WGS = 2  # consumer warpgroups, each its own tile_m rows of the CTA tile
RASTER = 8  # token tiles per band of the snake over output tiles
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    tile_m: int  # rows per consumer warpgroup (the CTA tile is COMPUTE_WGS times as many)
    tile_n: int  # vocab columns per tile
    tile_k: int  # embedding step per pipeline stage
    stages: int
    soft_cap: float | None
    with_sum: bool
    emulate: bool  # the kernel's outputs from `emulate_tile_stats` (tests on a machine without one)


def _dims_reason(embed: int, vocab: int, tile_k: int) -> str | None:
    if embed % tile_k:
        return f"embed={embed}: the Mosaic GPU kernel steps over the embedding {tile_k} at a time"
    if vocab % 64:
        return f"vocab={vocab}: the TMA copies of w take 128-byte swizzled tiles (a vocabulary that is a multiple of 64)"
    return None


def supports(spec) -> str | None:
    return backend.mosaic_gpu_reason(spec, _IMPORT_ERROR) or _dims_reason(
        spec.dim("embed"), spec.dim("vocab"), 64
    )


def kernel_config(
    x, w, block_sizes: CrossEntropyBlockSizes, logits_soft_cap, with_sum, emulate
) -> KernelConfig:
    """The kernel's tiles from the block sizes: `block_tokens` is the CTA tile's rows (two
    warpgroups' worth), `block_vocab` its columns, `block_embed` the pipeline step,
    `num_stages` the ring's slots."""
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise Unsupported(f"the Mosaic GPU kernel takes bf16 or fp16 x and w, not {x.dtype} and {w.dtype}")
    bt, bv = block_sizes.block_tokens, block_sizes.block_vocab
    bd, stages = block_sizes.block_embed or 64, block_sizes.num_stages or 4
    if bt not in (128, 256):
        raise Unsupported(
            f"block_tokens={bt}: the Mosaic GPU kernel's CTA tile is 128 or 256 rows (64 or 128 a warpgroup)"
        )
    if bv not in (64, 128, 256):
        raise Unsupported(f"block_vocab={bv}: the Mosaic GPU kernel takes 64, 128 or 256 vocab columns")
    if bd not in (32, 64):
        raise Unsupported(f"block_embed={bd}: the Mosaic GPU kernel steps 32 or 64 embedding columns")
    if (bt // COMPUTE_WGS) * bv > 128 * 128:
        raise Unsupported(
            f"block_tokens={bt}, block_vocab={bv}: a warpgroup's float32 accumulator of "
            f"{bt // COMPUTE_WGS}x{bv} takes more than the 128 registers a thread the kernel leaves it"
        )
    if not 2 <= stages <= 6:
        raise Unsupported(f"num_stages={stages}: the Mosaic GPU kernel's ring holds 2 to 6 slots")
    stats_staged = 4 if with_sum else 3  # max, sum of exponentials, [sum,] the label's logit
    need = smem_bytes(bt // COMPUTE_WGS, bv, bd, stages, x.dtype.itemsize, stats_staged)
    if need > SMEM_LIMIT:
        raise Unsupported(
            f"block_tokens={bt}, block_vocab={bv}, block_embed={bd}, num_stages={stages} need {need} bytes "
            f"of shared memory, more than {SMEM_LIMIT}"
        )
    reason = _dims_reason(x.shape[1], w.shape[1], bd)
    if reason:
        raise Unsupported(reason)
    return KernelConfig(
        tile_m=bt // COMPUTE_WGS,
        tile_n=bv,
        tile_k=bd,
        stages=stages,
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        with_sum=bool(with_sum),
        emulate=bool(emulate),
    )


def _capped(z, soft_cap):
    return z if soft_cap is None else jnp.tanh(z * (1.0 / soft_cap)) * soft_cap


def _kernel_capped(z, soft_cap):
    """The soft cap in the kernel, `c·tanh(z/c) = c - 2c / (2^(2 log2e · z/c) + 1)` from one
    `exp2` and a division (both limits exact: 2^±inf)."""
    if soft_cap is None:
        return z
    return soft_cap - (2.0 * soft_cap) / (jnp.exp2(z * (2.0 * _LOG2E / soft_cap)) + 1.0)


def _kernel(x_gmem, w_gmem, labels_gmem, *stat_gmem, cfg: KernelConfig, n_tiles: int):
    """`n_tiles` vocab tiles of every row of `x`: per row and tile the statistics, and the row's
    label logit where the tile holds its label (`labels_gmem`: `[rows]` int32)."""
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_m = COMPUTE_WGS * tm
    rows, d = x_gmem.shape
    m_iters, k_iters = rows // cta_m, d // tk
    itemsize = jnp.dtype(x_gmem.dtype).itemsize
    swizzle = plgpu.find_swizzle(tk * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

    def pipeline(body, context):
        spec = functools.partial(plgpu.BlockSpec, transforms=transforms, memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[spec((cta_m, tk), lambda k: (0, k)), spec((tk, tn), lambda k: (k, 0))],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=cfg.stages,
            compute_context=context,
        )

    ignore = lambda *_, **__: None  # noqa: E731 - the allocations depend on neither function

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        staged=[plgpu.SMEM((COMPUTE_WGS, tm), jnp.float32) for _ in stat_gmem],
        collective_axes="wg",
    )
    def _scope(allocations, staged):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_tiles,), collective_axes="cta")
        def _tiles(info):
            (lin,) = info.index
            m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_tiles), 0, min(RASTER, m_iters))
            row0 = m_idx * cta_m + wg * tm

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                def _acc(acc_ref):
                    wgmma = plgpu.Layout.WGMMA
                    # loaded before the products, where its latency hides: a row's label as a
                    # column of this tile (outside [0, tn): none of them)
                    lab = (
                        mosaic_gpu_load(
                            labels_gmem.at[pl.ds(row0, tm)], layout=wgmma.reduce(1), optimized=False
                        )
                        - n_idx * tn
                    )
                    eval_pipeline(acc_ref)
                    z = _kernel_capped(acc_ref[...], cfg.soft_cap)
                    col = plgpu.broadcasted_iota(jnp.int32, (tm, tn), 1, layout=wgmma)
                    hit = col == lax.broadcast_in_dim(lab, (tm, tn), [0])
                    picked = jnp.where(hit, z, 0.0).sum(axis=1)
                    top = z.max(axis=1)
                    values = [top] + ([z.sum(axis=1)] if cfg.with_sum else [])
                    p = jnp.exp2(z * _LOG2E - lax.broadcast_in_dim(top * _LOG2E, z.shape, [0]))
                    values.insert(1, p.sum(axis=1))
                    values.append(picked)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's rows have left
                    for buf, value in zip(staged, values, strict=True):
                        buf.at[wg][...] = value
                    plgpu.commit_smem()
                    for buf, out in zip(staged, stat_gmem, strict=True):
                        plgpu.copy_smem_to_gmem(buf.at[wg], out.at[n_idx, pl.ds(row0, tm)])

            def product(_, x_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * tm, tm)], w_smem)
                plgpu.wgmma_wait(0)
                return acc_ref

            refs = (x_gmem.at[pl.ds(m_idx * cta_m, cta_m), :], w_gmem.at[:, pl.ds(n_idx * tn, tn)])
            pipeline(product, context)(*refs, allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _sm_count() -> int:
    return getattr(jax.devices()[0], "core_count", None) or 132


def tile_stats(cfg: KernelConfig, x, w, n_tiles: int, labels):
    """`(m, s[, sum], pick)`, each `[n_tiles, rows]` float32: the kernel's statistics of vocab
    tiles `0 .. n_tiles - 1` (`x` rows a whole number of CTA tiles, `labels` `[rows]` ints):
    per row and tile the max, the sum of exponentials, (with `cfg.with_sum`) the sum of the
    logits, and the row's label logit in the tile holding its column, 0 in the others."""
    labels = labels.astype(jnp.int32)
    if cfg.emulate:
        return emulate_tile_stats(cfg, x, w, n_tiles, labels)
    out = jax.ShapeDtypeStruct((n_tiles, x.shape[0]), jnp.float32)
    kernel = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, n_tiles=n_tiles),
        out_type=[out] * (4 if cfg.with_sum else 3),
        grid=(_sm_count(),),
        grid_names=("cta",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        kernel_name="axkern_fused_cross_entropy_mosaic_gpu_forward",
    )
    return tuple(kernel(x, w, labels))


def emulate_tile_stats(cfg: KernelConfig, x, w, n_tiles: int, labels):
    """The kernel's outputs in XLA: per vocab tile `j` and row, the max of the soft-capped
    logits, the sum of `exp(z - max)`, (with label smoothing) the sum of the logits and the
    label's logit where the tile holds its column, else 0."""
    cols = n_tiles * cfg.tile_n
    z = lax.dot_general(x, w[:, :cols], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    z = _kernel_capped(z, cfg.soft_cap).reshape(x.shape[0], n_tiles, cfg.tile_n)
    top = z.max(axis=2)
    out = [top.T, jnp.exp(z - top[:, :, None]).sum(axis=2).T]
    out += [z.sum(axis=2).T] if cfg.with_sum else []
    col = jnp.arange(cols, dtype=jnp.int32).reshape(n_tiles, cfg.tile_n)
    hit = col[None] == labels[:, None, None]
    out.append(jnp.where(hit, z, 0.0).sum(axis=2).T)
    return tuple(out)


def kernel_tiles(cfg: KernelConfig, vocab: int) -> int:
    """The vocab tiles the kernel computes (the whole ones); XLA takes the columns after them."""
    return vocab // cfg.tile_n


def _forward(cfg: KernelConfig, x, w, labels):
    n, v = x.shape[0], w.shape[1]
    cta_m = COMPUTE_WGS * cfg.tile_m
    rows = cdiv(max(n, 1), cta_m) * cta_m
    xp = x if rows == n else jnp.pad(x, ((0, rows - n), (0, 0)))
    n_tiles = kernel_tiles(cfg, v)
    parts, picked = [], jnp.zeros((n,), jnp.float32)
    if n_tiles:  # labels outside the vocabulary as -1, like the padded rows: no column matches
        lp = jnp.pad(jnp.where((labels >= 0) & (labels < v), labels, -1), (0, rows - n), constant_values=-1)
        parts = list(tile_stats(cfg, xp, w, n_tiles, lp))
        picked = parts.pop()[:, :n].sum(axis=0)
    tail = v - n_tiles * cfg.tile_n
    if tail:  # the last columns, one more tile of the merge
        z = lax.dot_general(x, w[:, v - tail :], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        z = _capped(z, cfg.soft_cap)
        top = z.max(axis=1)
        extra = [top, jnp.exp(z - top[:, None]).sum(axis=1)] + ([z.sum(axis=1)] if cfg.with_sum else [])
        extra = [jnp.pad(e, (0, rows - n))[None] for e in extra]
        parts = [jnp.concatenate([p, e]) for p, e in zip(parts, extra, strict=True)] if parts else extra
        hit = jnp.arange(v - tail, v, dtype=jnp.int32)[None] == labels[:, None]
        picked = picked + jnp.where(hit, z, 0.0).sum(axis=1)
    m, s, *sm = (p[:, :n] for p in parts)
    lse, sum_logits = common.merge_tiles(m, s, sm[0] if sm else None)
    return lse, picked, sum_logits


def stats(
    x, w, labels, *, block_sizes: CrossEntropyBlockSizes, logits_soft_cap=None, with_sum=False, emulate=False
):
    """Per-token `(lse, label_logit, sum_logits)` (float32) by the Mosaic GPU kernel; backward in
    XLA. `emulate=True` puts `emulate_tile_stats` in the kernel's place (for tests without a
    Hopper GPU)."""
    cfg = kernel_config(x, w, block_sizes, logits_soft_cap, with_sum, emulate)
    return _stats(cfg, x, w, labels)


_stats = common.recomputing(_forward)


def value_stats(x, w, labels, *, logits_soft_cap=None, with_sum=False):
    """`stats` with the heuristic's tiles: the reduced loss's undifferentiated value
    (`LOSS_IMPLEMENTATION`)."""
    tiles = mosaic_gpu_heuristic(None)
    return stats(x, w, labels, block_sizes=tiles, logits_soft_cap=logits_soft_cap, with_sum=with_sum)


def emulated_value_stats(x, w, labels, *, logits_soft_cap=None, with_sum=False):
    """`value_stats` with `emulate_tile_stats` in the kernel's place (tests without a Hopper GPU)."""
    tiles = mosaic_gpu_heuristic(None)
    return stats(
        x, w, labels, block_sizes=tiles, logits_soft_cap=logits_soft_cap, with_sum=with_sum, emulate=True
    )


IMPLEMENTATION = Implementation(
    "mosaic_gpu",
    stats,
    platforms=("gpu",),
    supports=supports,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=mosaic_gpu_heuristic,
    space=mosaic_gpu_space,
    backward="custom_vjp: recomputes the logits in XLA (streamed tiles, as xla)",
)

# the reduced loss (`fused_cross_entropy_loss`): its undifferentiated value by the kernel; under a
# gradient the gradients-in-forward path of `common.loss`, as `xla`'s (the statistics kernel
# forms no `dx` or `dw`)
LOSS_IMPLEMENTATION = Implementation(
    "mosaic_gpu",
    functools.partial(common.loss, value_stats=value_stats),
    platforms=("gpu",),
    supports=supports,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=loss_heuristic,
    space=loss_space,
    backward=describe_loss,
)
