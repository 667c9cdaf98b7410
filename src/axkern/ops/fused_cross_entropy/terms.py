"""The per-token loss from the three statistics every implementation computes."""

from __future__ import annotations

import jax.numpy as jnp


def token_losses(lse, label_logit, sum_logits, labels, keep, vocab, *, logsumexp_weight, label_smoothing):
    """Per-token loss from the three statistics: 0 where not `keep`, NaN for a kept label outside `[0, V)`."""
    eps = float(label_smoothing)
    out = lse - (1.0 - eps) * label_logit
    if eps:
        out = out - (eps / vocab) * sum_logits
    if logsumexp_weight:
        out = out + float(logsumexp_weight) * jnp.square(lse)
    valid = (labels >= 0) & (labels < vocab)
    return jnp.where(keep, jnp.where(valid, out, jnp.nan), 0.0)
