"""The fused cross-entropy statistics as a Pallas GPU (Triton) kernel: no logits in HBM.

**Kernel.** Grid `(token blocks, vocab splits)`. A program owns `block_tokens` rows of `x`
and one contiguous share of the vocabulary tiles; per `[block_tokens, block_vocab]` tile it
accumulates `z = x_t @ w_v` in float32 over `block_embed` steps (the operands in the inputs'
dtype, float32 at full precision), applies the soft cap, and folds the tile into running
per-row statistics: max `m`, `s = sum exp(z - m)`, the label's logit and (with label
smoothing) the sum of the logits. Each split writes its four rows; XLA merges the splits
(`lse = logsumexp_splits(m + log s)`). Ragged edges (tokens, vocabulary, embedding) are
masked loads: nothing is padded or copied.

**Backward: recomputation in XLA** (`common.recomputing`: cuBLAS products over streamed tiles).
Why not a Pallas backward: `dx[t] = sum_v dz_tv w_v^T` needs a `[block_tokens, D]` float32
accumulator per program (2 MiB at D = 4096, 128 rows), far beyond registers and shared
memory, and splitting it over D multiplies the recomputation of `z`. The reduced loss does
not come here under `jax.grad`: `fused_cross_entropy_loss` forms its gradients in the
forward pass (6·N·D·V FLOPs instead of 8).

**Cost.** `2·N·D·V` FLOPs; bytes: `x` once per vocab tile (from L2), `w` once per token
block. Compute bound at real sizes.

**Constraints.** `block_tokens`, `block_vocab`, `block_embed` powers of two >= 16 (Triton
tiles); otherwise `supports()` or the call says why and the dispatcher moves on.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from axkern.core.blocks import cdiv
from axkern.core.kernels import dot as _dot
from axkern.core.op import Implementation, Unsupported

from . import common
from .blocks import CrossEntropyBlockSizes, pallas_gpu_heuristic, pallas_gpu_space

MIN = 16
_SMS = 132  # a Hopper GPU's multiprocessors: the vocab splits aim to fill them


def _pow2(n) -> bool:
    return n >= MIN and not n & (n - 1)


def supports(spec) -> str | None:
    if spec.dtype == "float64":
        return "float64: Triton has no float64 tensor-core products"
    return None


@dataclasses.dataclass(frozen=True)
class _Static:
    block_tokens: int
    block_vocab: int
    block_embed: int
    splits: int
    num_warps: int
    num_stages: int
    soft_cap: float | None
    with_sum: bool
    interpret: bool


def _config(x, w, block_sizes: CrossEntropyBlockSizes, logits_soft_cap, with_sum, interpret) -> _Static:
    n, d = x.shape
    v = w.shape[1]
    bt, bv = block_sizes.block_tokens, block_sizes.block_vocab
    bd = block_sizes.block_embed or min(64, max(MIN, 1 << (d - 1).bit_length()))
    for name, b in (("block_tokens", bt), ("block_vocab", bv), ("block_embed", bd)):
        if not _pow2(b):
            raise Unsupported(f"{name}={b}: Triton tiles need a power of two >= {MIN}")
    token_blocks, vocab_tiles = cdiv(n, bt), cdiv(v, bv)
    splits = block_sizes.vocab_splits or max(1, min(vocab_tiles, cdiv(2 * _SMS, token_blocks)))
    return _Static(
        block_tokens=bt,
        block_vocab=bv,
        block_embed=bd,
        splits=min(splits, vocab_tiles),
        num_warps=block_sizes.num_warps or 8,
        num_stages=block_sizes.num_stages or 3,
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        with_sum=bool(with_sum),
        interpret=bool(interpret),
    )


def _kernel(x_ref, w_ref, labels_ref, m_ref, s_ref, ll_ref, sum_ref, *, cfg: _Static, n, d, v):
    bt, bv, bd = cfg.block_tokens, cfg.block_vocab, cfg.block_embed
    t, split = pl.program_id(0), pl.program_id(1)
    rows = t * bt + jnp.arange(bt)
    row_ok = rows < n
    labels = plgpu.load(labels_ref.at[pl.ds(t * bt, bt)], mask=row_ok, other=-1)
    tiles = cdiv(v, bv)
    per_split = cdiv(tiles, cfg.splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, tiles)
    ragged_d = d % bd != 0

    def embed_step(k, acc, v0, col_ok):
        ks = k * bd + jnp.arange(bd)
        k_ok = ks < d
        x_mask = row_ok[:, None] & k_ok[None, :] if ragged_d else row_ok[:, None]
        w_mask = k_ok[:, None] & col_ok[None, :] if ragged_d else col_ok[None, :]
        xa = plgpu.load(x_ref.at[pl.ds(t * bt, bt), pl.ds(k * bd, bd)], mask=x_mask, other=0)
        wb = plgpu.load(w_ref.at[pl.ds(k * bd, bd), pl.ds(v0, bv)], mask=w_mask, other=0)
        return acc + _dot(xa, wb)

    def vocab_tile(j, carry):
        m, s, ll, sm = carry
        v0 = j * bv
        cols = v0 + jnp.arange(bv)
        col_ok = cols < v
        z = lax.fori_loop(
            0,
            cdiv(d, bd),
            lambda k, acc: embed_step(k, acc, v0, col_ok),
            jnp.zeros((bt, bv), jnp.float32),
        )
        if cfg.soft_cap is not None:
            z = cfg.soft_cap * jnp.tanh(z / cfg.soft_cap)
        zm = jnp.where(col_ok[None, :], z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(zm, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(zm - m_new[:, None]), axis=1)
        ll = ll + jnp.sum(jnp.where(labels[:, None] == cols[None, :], z, 0.0), axis=1)
        if cfg.with_sum:
            sm = sm + jnp.sum(jnp.where(col_ok[None, :], z, 0.0), axis=1)
        return m_new, s, ll, sm

    zero = jnp.zeros((bt,), jnp.float32)
    # every split owns at least one tile (splits <= tiles), so m is finite after the loop
    m, s, ll, sm = lax.fori_loop(first, last, vocab_tile, (jnp.full((bt,), -jnp.inf), zero, zero, zero))
    at = (split, pl.ds(t * bt, bt))
    m_ref[at] = m
    s_ref[at] = s
    ll_ref[at] = ll
    sum_ref[at] = sm


def _forward(cfg: _Static, x, w, labels):
    n, d = x.shape
    v = w.shape[1]
    padded = cdiv(n, cfg.block_tokens) * cfg.block_tokens
    part = jax.ShapeDtypeStruct((cfg.splits, padded), jnp.float32)
    m, s, ll, sm = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, n=n, d=d, v=v),
        name="axkern_fused_cross_entropy_gpu_forward",
        grid=(padded // cfg.block_tokens, cfg.splits),
        out_shape=[part] * 4,
        interpret=cfg.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(x, w, labels.astype(jnp.int32))
    m, s, ll, sm = (a[:, :n] for a in (m, s, ll, sm))
    lse, sum_logits = common.merge_tiles(m, s, sm)
    return lse, jnp.sum(ll, axis=0), sum_logits


def stats(
    x,
    w,
    labels,
    *,
    block_sizes: CrossEntropyBlockSizes,
    logits_soft_cap=None,
    with_sum=False,
    interpret=False,
):
    """Per-token `(lse, label_logit, sum_logits)` (float32) by the Pallas kernel; backward in XLA."""
    cfg = _config(x, w, block_sizes, logits_soft_cap, with_sum, interpret)
    return _stats(cfg, x, w, labels)


_stats = common.recomputing(_forward)


IMPLEMENTATION = Implementation(
    "pallas_gpu",
    stats,
    platforms=("gpu",),
    supports=supports,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=pallas_gpu_heuristic,
    space=pallas_gpu_space,
    interpretable=True,
    backward="custom_vjp: recomputes the logits in XLA (streamed tiles, as xla)",
)
