"""Streaming fused linear cross-entropy in plain JAX: never more than one logits tile alive.

**Math.** For `z = softcap(x @ w)` (`softcap(z) = c * tanh(z / c)`, or the identity), per token
`lse = logsumexp_v z_v`, `label_logit = z_label`, `sum_logits = sum_v z_v`. The loss is
assembled from these three by the caller (`api.py`), so one kernel serves z-loss, label
smoothing and vocab-parallel sharding (where the three are combined across shards).

**Layout and loop.** `x: [N, D]`, `w: [D, V]`, `labels: [N]` (int, indices into this `w`).
Vocab blocks are the outer loop and token blocks the inner one; each step computes one
`[block_tokens, block_vocab]` float32 tile `z = x_t @ w_v` and folds it into per-token
running statistics (online logsumexp: running max `m` and `s = sum exp(z - m)`). Ragged last
blocks run as one more static step: nothing is padded and no input is copied.

**Backward** (`jax.custom_vjp`, residuals `x, w, labels, lse`): recompute each tile, form
`dz = g_lse * exp(z - lse) + g_label * [v == label] + g_sum` (times `1 - (z/c)^2` under the
soft cap), cast `dz` to the input dtype (bf16 operands for the tensor cores, float32
accumulation), then `dx[t] += dz @ w_v^T` (a float32 `[N, D]` accumulator) and
`dw[:, v] = sum_t x_t^T dz` (a float32 `[D, block_vocab]` accumulator per vocab block).

**Cost.** Forward `2·N·D·V` FLOPs, backward `6·N·D·V` (recompute + two products): `8·N·D·V`
in all against `6·N·D·V` for the materialising form, in exchange for temporary memory of
`O(N·D + block_tokens·block_vocab)` instead of `O(N·V)`. Bytes: `x` once per vocab block
and `w` once per token block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core import backend, kernels
from axkern.core.blocks import for_each_block

from .blocks import CrossEntropyBlockSizes, stream_tiles
from .terms import out_of_range, token_losses


@dataclasses.dataclass(frozen=True)
class _Static:
    block_tokens: int
    block_vocab: int
    soft_cap: float | None
    with_sum: bool


def stats(x, w, labels, *, block_sizes: CrossEntropyBlockSizes, logits_soft_cap=None, with_sum=False):
    """Per-token `(lse, label_logit, sum_logits)`, each `[N]` float32 (float64 for float64 inputs)."""
    cfg = _Static(
        block_tokens=min(block_sizes.block_tokens, max(1, x.shape[0])),
        block_vocab=min(block_sizes.block_vocab, w.shape[1]),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        with_sum=bool(with_sum),
    )
    return _stats(cfg, x, w, labels)


def _acc_dtype(x, w):
    return jnp.promote_types(jnp.result_type(x, w), jnp.float32)


def _mm(a, b, acc):
    """`a @ b` accumulated in `acc`; float32 operands at full precision: XLA's default on GPU
    is TF32, and a TF32 recomputation of the logits does not match an exact forward's `lse`
    (`pallas_gpu`), which put its float32 `dx` 2.3x the plain-JAX error on the H200."""
    precision = kernels.full_precision(jnp.result_type(a, b))
    return jnp.matmul(a, b, precision=precision, preferred_element_type=acc)


def _tile(cfg: _Static, x, w, t0, ts, v0, vs):
    """Rows `[t0, t0+ts)` of x, columns `[v0, v0+vs)` of w, and their capped logits tile."""
    xt = lax.dynamic_slice_in_dim(x, t0, ts, axis=0)
    wv = lax.dynamic_slice_in_dim(w, v0, vs, axis=1)
    z = _mm(xt, wv, _acc_dtype(x, w))
    if cfg.soft_cap is not None:
        z = cfg.soft_cap * jnp.tanh(z / cfg.soft_cap)
    return xt, wv, z


def _hits(labels, t0, ts, v0, vs):
    local = lax.dynamic_slice_in_dim(labels, t0, ts) - v0
    return local[:, None] == lax.broadcasted_iota(local.dtype, (ts, vs), 1)


def _forward(cfg: _Static, x, w, labels):
    n, v = x.shape[0], w.shape[1]
    acc = _acc_dtype(x, w)
    init = (jnp.full((n,), -jnp.inf, acc), jnp.zeros((n,), acc), jnp.zeros((n,), acc), jnp.zeros((n,), acc))

    def tile(v0, vs, t0, ts, carry):
        m, s, label_logit, sum_logits = carry
        _, _, z = _tile(cfg, x, w, t0, ts, v0, vs)
        rows = lambda a: lax.dynamic_slice_in_dim(a, t0, ts)  # noqa: E731
        put = lambda a, u: lax.dynamic_update_slice_in_dim(a, u, t0, axis=0)  # noqa: E731
        m_old = rows(m)
        m_new = jnp.maximum(m_old, jnp.max(z, axis=1))
        s_new = rows(s) * jnp.exp(m_old - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        ll_new = rows(label_logit) + jnp.sum(jnp.where(_hits(labels, t0, ts, v0, vs), z, 0), axis=1)
        out = (put(m, m_new), put(s, s_new), put(label_logit, ll_new), sum_logits)
        if cfg.with_sum:
            out = out[:3] + (put(sum_logits, rows(sum_logits) + jnp.sum(z, axis=1)),)
        return out

    def vocab_block(v0, vs, carry):
        return for_each_block(n, cfg.block_tokens, lambda t0, ts, c: tile(v0, vs, t0, ts, c), carry)

    m, s, label_logit, sum_logits = for_each_block(v, cfg.block_vocab, vocab_block, init)
    lse = m + jnp.log(s)
    return (lse, label_logit, sum_logits), (x, w, labels, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stats(cfg: _Static, x, w, labels):
    return _forward(cfg, x, w, labels)[0]


def _backward(cfg: _Static, residuals, cotangents):
    x, w, labels, lse = residuals
    g_lse, g_label, g_sum = cotangents
    live = (g_lse != 0) | (g_label != 0)
    if cfg.with_sum:
        live = live | (g_sum != 0)
    n, d, v = x.shape[0], x.shape[1], w.shape[1]
    acc = _acc_dtype(x, w)
    operand = jnp.result_type(x, w)

    def tile(v0, vs, t0, ts, carry):
        dx, dw_block = carry
        xt, wv, z = _tile(cfg, x, w, t0, ts, v0, vs)
        rows = lambda a: lax.dynamic_slice_in_dim(a, t0, ts)[:, None]  # noqa: E731
        dz = rows(g_lse) * jnp.exp(z - rows(lse))
        dz = dz + jnp.where(_hits(labels, t0, ts, v0, vs), rows(g_label), 0)
        if cfg.with_sum:
            dz = dz + rows(g_sum)
        if cfg.soft_cap is not None:
            dz = dz * (1 - jnp.square(z / cfg.soft_cap))
        # a row whose cotangents are all 0 (a dropped token) is selected away, in dz and in x,
        # so a non-finite input there never turns into 0 * NaN
        dz = jnp.where(rows(live), dz, 0).astype(operand)
        dx_rows = lax.dynamic_slice_in_dim(dx, t0, ts) + _mm(dz, wv.T, acc)
        dx = lax.dynamic_update_slice_in_dim(dx, dx_rows, t0, axis=0)
        dw_block = dw_block + _mm(jnp.where(rows(live), xt, 0).T, dz, acc)
        return dx, dw_block

    def vocab_block(v0, vs, carry):
        dx, dw = carry
        dx, dw_block = for_each_block(
            n, cfg.block_tokens, lambda t0, ts, c: tile(v0, vs, t0, ts, c), (dx, jnp.zeros((d, vs), acc))
        )
        return dx, lax.dynamic_update_slice_in_dim(dw, dw_block.astype(w.dtype), v0, axis=1)

    dx, dw = for_each_block(v, cfg.block_vocab, vocab_block, (jnp.zeros((n, d), acc), jnp.zeros_like(w)))
    return dx.astype(x.dtype), dw, None


_stats.defvjp(lambda cfg, x, w, labels: _forward(cfg, x, w, labels), _backward)


def streaming_config(n: int, v: int, soft_cap, with_sum) -> _Static:
    """Tiles for this module's forward or backward when another path calls them (the Pallas
    kernels' backward, the reduced loss's undifferentiated value): the platform heuristic's."""
    tiles = stream_tiles(backend.platform(), max(1, n), v)
    return _Static(tiles.block_tokens, tiles.block_vocab, soft_cap, with_sum)


def recomputing(forward):
    """`forward(cfg, x, w, labels) -> (lse, label_logit, sum_logits)` (a Pallas kernel; `cfg`
    has `soft_cap` and `with_sum`) wrapped in a `custom_vjp` whose backward is this module's
    recomputation (residuals `x, w, labels, lse`)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def fn(cfg, x, w, labels):
        return forward(cfg, x, w, labels)

    def fwd(cfg, x, w, labels):
        out = forward(cfg, x, w, labels)
        return out, (x, w, labels, out[0])

    def bwd(cfg, residuals, cotangents):
        x, w = residuals[0], residuals[1]
        tiles = streaming_config(x.shape[0], w.shape[1], cfg.soft_cap, cfg.with_sum)
        return _backward(tiles, residuals, cotangents)

    fn.defvjp(fwd, bwd)
    return fn


# -- the reduced loss with its gradients formed in the forward ("grad in forward") -------------
#
# For a scalar `L = scale * sum_{kept i} loss_i` every token's cotangents are known once its
# `lse` is: `dL/dz_iv = scale * (p_iv * (1 + 2 w_z lse_i) - (1 - eps) [v == label_i] - eps / V)`
# (times `1 - (z/c)^2` under the soft cap). So the forward of the differentiated loss computes
# each token block's full `[block_tokens, V]` logits once, its lse, and at once `dz`, `dx` rows
# and the block's share of `dw`; the backward only scales `dx, dw` by the incoming cotangent.
# Cost: `6·N·D·V` FLOPs in all (no recomputation); temporary memory one float32 logits block,
# its 16-bit `dz` and the float32 `[D, V]` dw accumulator. Called without differentiation it is
# the streaming forward above.
#
# dw accumulates across token blocks in float32. Accumulating in w's 16-bit dtype, as
# Liger-Kernel does, halves that buffer and its traffic (84.6 ms and 0.74 GiB at llama3's size
# on the H200), but at 8192x4096x128256 in bf16 it failed the oracle rule on the GPU (2026-11-30).


@dataclasses.dataclass(frozen=True)
class _LossStatic:
    block_tokens: int
    soft_cap: float | None
    logsumexp_weight: float
    label_smoothing: float
    w_dtype: str


def loss(
    x,
    w,
    labels,
    keep,
    scale,
    *,
    block_sizes,
    logits_soft_cap=None,
    logsumexp_weight=0.0,
    label_smoothing=0.0,
):
    """`scale * sum_{keep} loss_i` (float32), gradients for `x` and `w` formed in the forward
    (`dw` accumulated over token blocks in float32)."""
    n = x.shape[0]
    acc = _acc_dtype(x, w)
    cfg = _LossStatic(
        block_tokens=min(block_sizes.block_tokens, max(1, n)),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        logsumexp_weight=float(logsumexp_weight),
        label_smoothing=float(label_smoothing),
        w_dtype=jnp.dtype(w.dtype).name,
    )
    return _loss(cfg, x, w, labels, keep, jnp.asarray(scale, acc))


def _loss_value(cfg: _LossStatic, x, w, labels, keep):
    # undifferentiated: the streaming forward with its own (larger) tiles, not the loss's block
    stat_cfg = streaming_config(x.shape[0], w.shape[1], cfg.soft_cap, bool(cfg.label_smoothing))
    lse, label_logit, sum_logits = _forward(stat_cfg, x, w, labels)[0]
    per = token_losses(
        lse,
        label_logit,
        sum_logits,
        labels,
        keep,
        w.shape[1],
        logsumexp_weight=cfg.logsumexp_weight,
        label_smoothing=cfg.label_smoothing,
    )
    return jnp.sum(per)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(cfg: _LossStatic, x, w, labels, keep, scale):
    return scale * _loss_value(cfg, x, w, labels, keep)


def _loss_fwd(cfg: _LossStatic, x, w, labels, keep, scale):
    n, d, v = x.shape[0], x.shape[1], w.shape[1]
    acc = _acc_dtype(x, w)
    operand = jnp.result_type(x, w)
    eps, wz = cfg.label_smoothing, cfg.logsumexp_weight

    def block(t0, ts, carry):
        dx, dw, total = carry
        xt = lax.dynamic_slice_in_dim(x, t0, ts, axis=0)
        lt = lax.dynamic_slice_in_dim(labels, t0, ts)
        kt = lax.dynamic_slice_in_dim(keep, t0, ts)
        z = _mm(xt, w, acc)
        if cfg.soft_cap is not None:
            z = cfg.soft_cap * jnp.tanh(z / cfg.soft_cap)
        m = lax.stop_gradient(jnp.max(z, axis=1))
        lse = m + jnp.log(jnp.sum(jnp.exp(z - m[:, None]), axis=1))
        hit = lt[:, None] == lax.broadcasted_iota(lt.dtype, (ts, v), 1)
        label_logit = jnp.sum(jnp.where(hit, z, 0), axis=1)
        sum_logits = jnp.sum(z, axis=1) if eps else jnp.zeros_like(lse)
        per = token_losses(lse, label_logit, sum_logits, lt, kt, v, logsumexp_weight=wz, label_smoothing=eps)
        coef = (jnp.where(kt, scale, 0) * out_of_range(lt, kt, v)).astype(acc)
        g_lse = coef * (1 + 2 * wz * lse) if wz else coef
        dz = g_lse[:, None] * jnp.exp(z - lse[:, None]) - jnp.where(hit, ((1 - eps) * coef)[:, None], 0)
        if eps:
            dz = dz - (eps / v) * coef[:, None]
        if cfg.soft_cap is not None:
            dz = dz * (1 - jnp.square(z / cfg.soft_cap))
        dz = jnp.where(kt[:, None], dz, 0).astype(operand)  # dropped rows selected away (and in x below)
        dx_rows = _mm(dz, w.T, acc).astype(x.dtype)
        dx = lax.dynamic_update_slice_in_dim(dx, dx_rows, t0, axis=0)
        dw = dw + _mm(jnp.where(kt[:, None], xt, 0).T, dz, acc)
        return dx, dw, total + jnp.sum(per)

    init = (jnp.zeros_like(x), jnp.zeros((d, v), acc), jnp.zeros((), acc))
    dx, dw, total = for_each_block(n, cfg.block_tokens, block, init)
    return scale * total, (dx, dw, total)


def _loss_bwd(cfg: _LossStatic, residuals, g):
    dx, dw, total = residuals
    scaled = lambda a, dtype: (g * a.astype(g.dtype)).astype(dtype)  # noqa: E731
    return scaled(dx, dx.dtype), scaled(dw, cfg.w_dtype), None, None, g * total


_loss.defvjp(_loss_fwd, _loss_bwd)
