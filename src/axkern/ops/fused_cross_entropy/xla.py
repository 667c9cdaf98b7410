"""Fused linear cross-entropy in plain JAX: the streaming statistics (`common.py`: never more
than one logits tile alive) and the reduced loss with its gradients formed in the forward."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core.blocks import for_each_block

from .blocks import CrossEntropyBlockSizes
from .common import (
    Static,
    acc_dtype,
    mm,
    out_of_range,
    stream_forward,
    stream_stats,
    streaming_config,
    token_losses,
)


def stats(x, w, labels, *, block_sizes: CrossEntropyBlockSizes, logits_soft_cap=None, with_sum=False):
    """Per-token `(lse, label_logit, sum_logits)`, each `[N]` float32 (float64 for float64 inputs)."""
    cfg = Static(
        block_tokens=min(block_sizes.block_tokens, max(1, x.shape[0])),
        block_vocab=min(block_sizes.block_vocab, w.shape[1]),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        with_sum=bool(with_sum),
    )
    return stream_stats(cfg, x, w, labels)


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
# dw accumulates across token blocks in float32: accumulating in w's 16-bit dtype, as
# Liger-Kernel does, would halve that buffer and its traffic but misses the oracle rule at
# large vocabularies (docs/decisions.md).


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
    acc = acc_dtype(x, w)
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
    lse, label_logit, sum_logits = stream_forward(stat_cfg, x, w, labels)[0]
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
    acc = acc_dtype(x, w)
    operand = jnp.result_type(x, w)
    eps, wz = cfg.label_smoothing, cfg.logsumexp_weight

    def block(t0, ts, carry):
        dx, dw, total = carry
        xt = lax.dynamic_slice_in_dim(x, t0, ts, axis=0)
        lt = lax.dynamic_slice_in_dim(labels, t0, ts)
        kt = lax.dynamic_slice_in_dim(keep, t0, ts)
        z = mm(xt, w, acc)
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
        dx_rows = mm(dz, w.T, acc).astype(x.dtype)
        dx = lax.dynamic_update_slice_in_dim(dx, dx_rows, t0, axis=0)
        dw = dw + mm(jnp.where(kt[:, None], xt, 0).T, dz, acc)
        return dx, dw, total + jnp.sum(per)

    init = (jnp.zeros_like(x), jnp.zeros((d, v), acc), jnp.zeros((), acc))
    dx, dw, total = for_each_block(n, cfg.block_tokens, block, init)
    return scale * total, (dx, dw, total)


def _loss_bwd(cfg: _LossStatic, residuals, g):
    dx, dw, total = residuals
    scaled = lambda a, dtype: (g * a.astype(g.dtype)).astype(dtype)  # noqa: E731
    return scaled(dx, dx.dtype), scaled(dw, cfg.w_dtype), None, None, g * total


_loss.defvjp(_loss_fwd, _loss_bwd)
