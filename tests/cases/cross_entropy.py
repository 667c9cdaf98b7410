"""Cross-entropy's cases (the loss from precomputed logits), for tests/ops/test_cross_entropy.py:
random logits with a loss option drawn (ignored labels, a `where` mask), and a runner returning
the loss (and lse, per token) and the gradient of the logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from axkern.positional import cross_entropy
from tests.helpers import LOSS_OPTIONS

OPTIONS = LOSS_OPTIONS


def make(seed, n, v, dtype, options=None):
    """`(arrays, options)`: `logits [n, v]` of order 3, `labels [n]` (a quarter of them
    `ignore_index` when the options ignore one), the cotangents `cot [2, n]` of loss and lse,
    and `where [n]` when the options ask for a random mask; `options` without `where`. NumPy
    draws them: no compilation per shape."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((n, v), np.float32) * 3).astype(jnp.dtype(dtype))
    labels = rng.integers(0, v, n, dtype=np.int32)
    options = dict(options or {})
    if "ignore_index" in options:
        labels = np.where(rng.random(n) < 0.25, np.int32(options["ignore_index"]), labels)
    arrays = dict(logits=logits, labels=labels, cot=rng.standard_normal((2, n), np.float32))
    if options.pop("where", None) is True:
        arrays["where"] = rng.random(n) < 0.7
    return {k: jnp.asarray(a) for k, a in arrays.items()}, options


def run(impl, arrays, *, reduction="mean", options=None):
    """The loss (`(loss, lse)` per token for `reduction=None`, weighted by `cot`) and its gradient
    w.r.t. the logits."""

    def f(z, rest):
        kw = dict(where=rest.get("where"), implementation=impl, **(options or {}))
        if reduction is None:
            loss, lse = cross_entropy(z, rest["labels"], reduction=None, return_lse=True, **kw)
            return jnp.sum(loss * rest["cot"][0]) + jnp.sum(lse * rest["cot"][1]), (loss, lse)
        loss = cross_entropy(z, rest["labels"], reduction=reduction, **kw)
        return loss, (loss,)

    rest = {k: a for k, a in arrays.items() if k != "logits"}
    (_, out), grad = jax.value_and_grad(f, has_aux=True)(arrays["logits"], rest)
    return out, grad
