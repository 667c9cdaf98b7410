"""Cross-entropy from precomputed logits whose gradient is formed in the forward pass.

**Math.** For `z = softcap(logits)` (`c * tanh(logits / c)`, or the identity) and a kept token
with label `y`, `loss = lse - (1 - eps) z_y - (eps / V) sum_v z_v + w_z lse**2`, so

    d loss / d logits_v = (p_v (1 + 2 w_z lse) - (1 - eps) [v == y] - eps / V) * (1 - (z_v / c)**2)

with `p = softmax(z)`. Every term is known once the row's `lse` is, so the forward of the
differentiated call writes this gradient `G` (`[tokens, vocab]`, in the logits' dtype, rows of
dropped tokens zero, rows of a kept out-of-range label NaN) in place of the softmax, as Liger-Kernel's cross-entropy overwrites its
logits buffer. The residual is `G` alone: the logits themselves are not kept for the backward.

**Backward** (`jax.custom_vjp`): `d logits = g_loss[:, None] * G`, with `g_loss` the per-token
cotangent (for a reduced loss, the reduction's scale times the incoming scalar). The lse is
differentiable only when `lse_grad` is set (`return_lse=True`): its gradient
`p * (1 - (z / c)**2)` is then a second residual of the same size.

**Cost.** One pass over the logits in the forward (read `z`, write `G`), one in the backward
(read `G`, write `d logits`); XLA fuses each pass into one loop. Not blocked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from axkern.core.op import Implementation


@dataclasses.dataclass(frozen=True)
class _Static:
    soft_cap: float | None
    logsumexp_weight: float
    label_smoothing: float
    lse_grad: bool


def cross_entropy(
    logits, labels, keep, *, logits_soft_cap=None, logsumexp_weight=0.0, label_smoothing=0.0, lse_grad=False
):
    """Per-token `(loss, lse)`, float32 (float64 for float64 logits); see the module docstring."""
    cfg = _Static(
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        logsumexp_weight=float(logsumexp_weight),
        label_smoothing=float(label_smoothing),
        lse_grad=bool(lse_grad),
    )
    return _ce(cfg, logits, labels, keep)


def _statistics(cfg: _Static, logits, labels, keep):
    """The capped float32 logits, the per-token loss and lse, the label hits and kept rows."""
    vocab = logits.shape[-1]
    acc = jnp.promote_types(logits.dtype, jnp.float32)
    z = logits.astype(acc)
    if cfg.soft_cap is not None:
        z = cfg.soft_cap * jnp.tanh(z / cfg.soft_cap)
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse = m[:, 0] + jnp.log(jnp.sum(jnp.exp(z - m), axis=-1))
    hit = labels[:, None] == jax.lax.broadcasted_iota(labels.dtype, z.shape, 1)
    eps = cfg.label_smoothing
    out = lse - (1.0 - eps) * jnp.sum(jnp.where(hit, z, 0), axis=-1)
    if eps:
        out = out - (eps / vocab) * jnp.sum(z, axis=-1)
    if cfg.logsumexp_weight:
        out = out + cfg.logsumexp_weight * jnp.square(lse)
    nan_label = _out_of_range(labels, keep, vocab)
    loss = jnp.where(keep, out * nan_label, 0.0)
    return z, loss, lse, hit, nan_label


def _out_of_range(labels, keep, vocab):
    """1 per token, NaN for a kept token whose label is outside `[0, vocab)` (its loss and its
    gradient row are NaN)."""
    valid = (labels >= 0) & (labels < vocab)
    return jnp.where(valid | ~keep, 1.0, jnp.nan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ce(cfg: _Static, logits, labels, keep):
    _, loss, lse, _, _ = _statistics(cfg, logits, labels, keep)
    return loss, lse


def _ce_fwd(cfg: _Static, logits, labels, keep):
    z, loss, lse, hit, nan_label = _statistics(cfg, logits, labels, keep)
    vocab = logits.shape[-1]
    eps, wz = cfg.label_smoothing, cfg.logsumexp_weight
    p = jnp.exp(z - lse[:, None])
    cap = 1.0 if cfg.soft_cap is None else 1.0 - jnp.square(z / cfg.soft_cap)
    g = (p * (1.0 + 2.0 * wz * lse[:, None]) if wz else p) - jnp.where(hit, 1.0 - eps, 0.0)
    if eps:
        g = g - eps / vocab
    # dropped rows selected away (a non-finite logit there never becomes 0 * NaN)
    grad = jnp.where(keep[:, None], g * cap * nan_label[:, None], 0.0).astype(logits.dtype)
    lse_grad = (p * cap).astype(logits.dtype) if cfg.lse_grad else None
    return (loss, lse), (grad, lse_grad)


def _ce_bwd(cfg: _Static, residuals, cotangents):
    grad, lse_grad = residuals
    g_loss, g_lse = cotangents
    acc = jnp.promote_types(grad.dtype, jnp.float32)
    d = g_loss.astype(acc)[:, None] * grad.astype(acc)
    if lse_grad is not None:
        # rows whose lse cotangent is 0 are selected away, as dropped rows are in `grad`
        d = d + jnp.where((g_lse != 0)[:, None], g_lse.astype(acc)[:, None] * lse_grad.astype(acc), 0)
    return d.astype(grad.dtype), None, None


_ce.defvjp(_ce_fwd, _ce_bwd)


IMPLEMENTATION = Implementation(
    "xla",
    cross_entropy,
    backward="custom_vjp: the gradient formed in the forward, in place of the softmax "
    "(one [tokens, vocab] residual in the logits' dtype; the backward scales it)",
)
