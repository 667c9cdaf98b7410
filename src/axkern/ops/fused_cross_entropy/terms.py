"""The per-token loss from the three statistics every implementation computes."""

from __future__ import annotations

import jax.numpy as jnp


def token_losses(lse, label_logit, sum_logits, labels, keep, vocab, *, logsumexp_weight, label_smoothing):
    """Per-token loss from the three statistics: 0 where not `keep`, NaN for a kept label outside `[0, V)`.

    The NaN of such a label multiplies the token's loss (`loss * NaN`, not a NaN constant), so its
    gradients are NaN too: the token's `dx` row and every `dw` entry it reaches, in every
    implementation. A dropped token's loss is selected away (`jnp.where`)."""
    eps = float(label_smoothing)
    out = lse - (1.0 - eps) * label_logit
    if eps:
        out = out - (eps / vocab) * sum_logits
    if logsumexp_weight:
        out = out + float(logsumexp_weight) * jnp.square(lse)
    return jnp.where(keep, out * out_of_range(labels, keep, vocab), 0.0)


def out_of_range(labels, keep, vocab):
    """1 per token, NaN for a kept token whose label is outside `[0, vocab)`."""
    valid = (labels >= 0) & (labels < vocab)
    return jnp.where(valid | ~keep, 1.0, jnp.nan)
