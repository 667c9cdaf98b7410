"""The plainest correct form: per-token cross-entropy from materialised logits. The test oracle, never a default."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(
    logits, labels, keep, *, logits_soft_cap=None, logsumexp_weight=0.0, label_smoothing=0.0, lse_grad=False
):
    """Per-token `(loss, lse)` of `z = softcap(logits)`, float32 (float64 for float64 logits).

    `loss = lse - (1 - eps) z[label] - (eps / V) sum_v z_v + w_z lse**2` where `keep`, 0 elsewhere,
    NaN (and NaN gradients) for a kept token whose label is outside `[0, V)`. Gradients by autodiff
    (`lse_grad` is accepted for the signature every implementation shares; autodiff always
    differentiates lse). Dropped rows are selected away before the arithmetic: the loss is
    formed from their logits replaced by 0, then selected, and the reported `lse` (every row's)
    is differentiated on the rows whose cotangent is not 0, the others selected away as in
    `xla`; so a non-finite dropped row reaches no gradient (autodiff alone would give it `0 * NaN`).
    """
    del lse_grad
    vocab = logits.shape[-1]
    acc = jnp.promote_types(logits.dtype, jnp.float32)
    zk = _softcap(jnp.where(keep[:, None], logits, 0).astype(acc), logits_soft_cap)
    lse_k = _logsumexp(zk)
    hit = labels[:, None] == jnp.arange(vocab)[None, :]
    out = lse_k - (1.0 - label_smoothing) * jnp.sum(jnp.where(hit, zk, 0), axis=-1)
    if label_smoothing:
        out = out - (label_smoothing / vocab) * jnp.sum(zk, axis=-1)
    if logsumexp_weight:
        out = out + logsumexp_weight * jnp.square(lse_k)
    valid = (labels >= 0) & (labels < vocab)
    # a kept out-of-range label multiplies its loss by NaN: NaN loss and NaN gradients
    loss = jnp.where(keep, out * jnp.where(valid | ~keep, 1.0, jnp.nan), 0.0)
    return loss, _lse(logits, acc, logits_soft_cap)


def _logsumexp(z):
    """`max + log sum exp(z - max)` per row, the max not differentiated. Unlike
    `jax.nn.logsumexp` it does not treat an infinite max apart: a `+inf` (or NaN) logit makes the
    row's lse NaN (`inf - inf`), and so, by autodiff, its whole gradient row, as the rule wants
    (`jax.nn.logsumexp` gives `+inf` and a row `[-1, nan, 0, 0]`); a `-inf` logit is an entry of
    probability 0."""
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    return m[..., 0] + jnp.log(jnp.sum(jnp.exp(z - m), axis=-1))


def _softcap(z, cap):
    return z if cap is None else cap * jnp.tanh(z / cap)


def _lse(logits, acc, cap):
    """Every row's `logsumexp(softcap(logits))`; its backward is autodiff's on the rows whose
    cotangent is not 0, the other rows replaced by 0 before the arithmetic and selected away after it."""

    def plain(logits):
        return _logsumexp(_softcap(logits.astype(acc), cap))

    @jax.custom_vjp
    def selected(logits):
        return plain(logits)

    def forward(logits):
        return plain(logits), logits

    def backward(logits, g):
        live = g != 0
        _, vjp = jax.vjp(plain, jnp.where(live[:, None], logits, 0))
        (d,) = vjp(jnp.where(live, g, 0))
        return (jnp.where(live[:, None], d, 0),)

    selected.defvjp(forward, backward)
    return selected(logits)
