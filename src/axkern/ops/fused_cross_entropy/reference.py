"""The plainest correct form: materialise `[tokens, vocab]` logits. The test oracle, never a default."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stats(x, w, labels, *, logits_soft_cap=None, with_sum=False):
    """Per-token `(lse, label_logit, sum_logits)` of `z = softcap(x @ w)`.

    `labels` index this `w`'s columns; a label outside `[0, vocab)` contributes a label
    logit of 0 (the caller decides what such a token means). Computes in float32, or in
    float64 when given float64. Gradients by autodiff through the materialised logits, on the
    rows whose three cotangents are not all 0: the other rows (a dropped token's, whose loss
    is selected away) have their `x` row and their logits replaced by 0 before the arithmetic
    and their gradient selected away after it, as in every implementation, so a non-finite
    value that only they read (in their `x` row, or a column of `w`) reaches no gradient
    (autodiff alone would give it `0 * NaN`).
    """

    def plain(x, w, labels, rows=None):
        return _stats(x, w, labels, logits_soft_cap=logits_soft_cap, with_sum=with_sum, rows=rows)

    @jax.custom_vjp
    def selected(x, w, labels):
        return plain(x, w, labels)

    def forward(x, w, labels):
        return plain(x, w, labels), (x, w, labels)

    def backward(residuals, cotangents):
        x, w, labels = residuals
        live = (cotangents[0] != 0) | (cotangents[1] != 0) | (cotangents[2] != 0)
        _, vjp = jax.vjp(lambda x, w: plain(x, w, labels, live), jnp.where(live[:, None], x, 0), w)
        dx, dw = vjp(tuple(jnp.where(live, c, 0) for c in cotangents))
        return jnp.where(live[:, None], dx, 0), dw, None

    selected.defvjp(forward, backward)
    return selected(x, w, labels)


def _stats(x, w, labels, *, logits_soft_cap, with_sum, rows=None):
    """The three statistics; `rows`: the tokens whose logits are used, the others' selected away
    (0) right after the product, so that their gradient is 0, not `0 * NaN` from a NaN in `w`."""
    acc = jnp.promote_types(jnp.result_type(x, w), jnp.float32)
    z = jnp.dot(x, w, preferred_element_type=acc)
    if rows is not None:
        z = jnp.where(rows[:, None], z, 0)
    if logits_soft_cap is not None:
        z = logits_soft_cap * jnp.tanh(z / logits_soft_cap)
    lse = _logsumexp(z)
    hit = labels[:, None] == jnp.arange(w.shape[1])[None, :]
    label_logit = jnp.sum(jnp.where(hit, z, 0), axis=-1)
    sum_logits = jnp.sum(z, axis=-1) if with_sum else jnp.zeros_like(lse)
    return lse, label_logit, sum_logits


def _logsumexp(z):
    """`max + log sum exp(z - max)` per row, the max not differentiated. Unlike
    `jax.nn.logsumexp` it does not treat an infinite max apart: a `+inf` (or NaN) logit makes the
    row's lse NaN (`inf - inf`), and so, by autodiff, its whole gradient row, as the rule wants
    (`jax.nn.logsumexp` gives `+inf` and a row `[0, nan, 0]`); a `-inf` logit is an entry of
    probability 0."""
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    return m[..., 0] + jnp.log(jnp.sum(jnp.exp(z - m), axis=-1))


def loss(x, w, labels, keep, scale, *, logits_soft_cap=None, logsumexp_weight=0.0, label_smoothing=0.0):
    """`scale * sum_{keep} loss_i` from the materialised logits; gradients by plain autodiff. Dropped
    tokens' rows of `x` and of the logits are selected away first: a non-finite value that only
    dropped tokens read reaches no gradient."""
    x = jnp.where(keep[:, None], x, 0)
    lse, label_logit, sum_logits = _stats(
        x, w, labels, logits_soft_cap=logits_soft_cap, with_sum=True, rows=keep
    )
    per = _token_losses(
        lse,
        label_logit,
        sum_logits,
        labels,
        keep,
        w.shape[1],
        logsumexp_weight=logsumexp_weight,
        label_smoothing=label_smoothing,
    )
    return scale * jnp.sum(per)


def _token_losses(lse, label_logit, sum_logits, labels, keep, vocab, *, logsumexp_weight, label_smoothing):
    """Per-token loss from the three statistics: 0 where not `keep`, NaN for a kept label outside
    `[0, V)`, multiplying the loss so that the token's gradients are NaN too. Written here again
    (not imported from `common.py`), so the oracle shares no code with the implementations it
    checks."""
    eps = float(label_smoothing)
    out = lse - (1.0 - eps) * label_logit
    if eps:
        out = out - (eps / vocab) * sum_logits
    if logsumexp_weight:
        out = out + float(logsumexp_weight) * jnp.square(lse)
    valid = (labels >= 0) & (labels < vocab)
    return jnp.where(keep, out * jnp.where(valid | ~keep, 1.0, jnp.nan), 0.0)
