"""The plainest correct form: per-token cross-entropy from materialised logits. The test oracle, never a default."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(
    logits, labels, keep, *, logits_soft_cap=None, logsumexp_weight=0.0, label_smoothing=0.0, lse_grad=False
):
    """Per-token `(loss, lse)` of `z = softcap(logits)`, float32 (float64 for float64 logits).

    `loss = lse - (1 - eps) z[label] - (eps / V) sum_v z_v + w_z lse**2` where `keep`, 0 elsewhere,
    NaN (and NaN gradients) for a kept token whose label is outside `[0, V)`. Gradients by autodiff (`lse_grad` is
    accepted for the signature every implementation shares; autodiff always differentiates lse).
    """
    del lse_grad
    vocab = logits.shape[-1]
    acc = jnp.promote_types(logits.dtype, jnp.float32)
    z = logits.astype(acc)
    if logits_soft_cap is not None:
        z = logits_soft_cap * jnp.tanh(z / logits_soft_cap)
    lse = jax.nn.logsumexp(z, axis=-1)
    zk = jnp.where(keep[:, None], z, 0)  # dropped rows selected away before the loss
    lse_k = jax.nn.logsumexp(zk, axis=-1)
    hit = labels[:, None] == jnp.arange(vocab)[None, :]
    out = lse_k - (1.0 - label_smoothing) * jnp.sum(jnp.where(hit, zk, 0), axis=-1)
    if label_smoothing:
        out = out - (label_smoothing / vocab) * jnp.sum(zk, axis=-1)
    if logsumexp_weight:
        out = out + logsumexp_weight * jnp.square(lse_k)
    valid = (labels >= 0) & (labels < vocab)
    # a kept out-of-range label multiplies its loss by NaN: NaN loss and NaN gradients
    return jnp.where(keep, out * jnp.where(valid | ~keep, 1.0, jnp.nan), 0.0), lse
