"""`cross_entropy`: cross-entropy from precomputed logits: the positional function and the `Op`
behind it (the named function is in `named.py`).

Per token, for `z = softcap(logits)`:

    loss = lse(z) - (1 - eps) * z[label] - (eps / V) * sum_v z_v + w_z * lse(z)**2

for tokens that are kept (`where` true, label != `ignore_index`), 0 for the others, and NaN for
a kept token whose label is outside `[0, V)`; then the reduction. The same options as
`fused_cross_entropy`, for a model that already holds its `[tokens, vocab]` logits. The `xla`
implementation forms the gradient in the forward pass, in place of the softmax, so the
backward keeps no second `[tokens, vocab]` buffer beside it.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp

from axkern.core.loss import (
    CrossEntropyOutput,
    check_features,
    check_options,
    checked_labels,
    kept,
    reduction_name,
)
from axkern.core.loss import reduce as reduce_loss
from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Bool, Float, Int, checked

from . import reference, xla

__all__ = ["cross_entropy_positional", "CrossEntropyOutput", "OP"]

NAME = "cross_entropy"

OP = Op(
    NAME,
    [
        xla.IMPLEMENTATION,
        Implementation("reference", reference.cross_entropy, backward="autodiff through the softmax"),
    ],
    default_order={"cpu": ("xla",), "gpu": ("xla",), "tpu": ("xla",)},
    package=__package__,
    bucket=lambda spec: dict(spec.dims),
)

CrossEntropyImplementation = Literal["xla", "reference"]


def _per_token(logits, labels, keep, *, options, lse_grad, check_labels, implementation):
    tokens, vocab = logits.shape
    check_features(NAME, vocab=vocab)
    if tokens == 0:
        empty = jnp.zeros((0,), jnp.promote_types(logits.dtype, jnp.float32))
        return empty, empty
    if check_labels:
        labels = checked_labels(NAME, labels, keep, vocab)
    spec = OP.spec(
        {"tokens": tokens, "vocab": vocab},
        logits.dtype,
        logits_soft_cap=options["logits_soft_cap"],
        lse_grad=lse_grad,
    )
    return OP(spec, logits, labels, keep, implementation=implementation, lse_grad=lse_grad, **options)


@checked
def cross_entropy_positional(
    logits: Float[Array, "tokens vocab"],
    labels: Int[Array, " tokens"],
    *,
    reduction: str | None | object = "mean",
    where: Bool[Array, " tokens"] | None = None,
    ignore_index: int | None = None,
    logits_soft_cap: float | None = None,
    logsumexp_weight: float = 0.0,
    label_smoothing: float = 0.0,
    return_lse: bool = False,
    check_labels: bool = False,
    implementation: CrossEntropyImplementation | tuple[CrossEntropyImplementation, ...] | None = None,
    block_sizes: object | None = None,
) -> Float[Array, ""] | Float[Array, " tokens"] | CrossEntropyOutput:
    """Cross-entropy of `[tokens, vocab]` logits against `[tokens]` labels, on plain arrays.

    **Arguments:**

    - `logits`: `[tokens, vocab]` (any float dtype; statistics in float32).
    - `labels`: `[tokens]` integer targets in `[0, vocab)`.
    - `reduction`: `"mean"` over kept tokens (0 when none is kept), `"sum"`, or `None` for the
      per-token losses (`hax.mean` / `hax.sum` are accepted for the strings).
    - `where`: optional `[tokens]` bool; false tokens get loss 0.
    - `ignore_index`: a label value whose tokens get loss 0 (e.g. `-100`).
    - `logits_soft_cap`: `c` in `z = c * tanh(logits / c)`.
    - `logsumexp_weight`: z-loss weight `w` (adds `w * lse**2`).
    - `label_smoothing`: `eps` (mixes `eps / vocab` uniform mass into the target).
    - `return_lse`: also return the per-token logsumexp (then differentiable too).
    - `check_labels`: raise at run time (`eqx.error_if`) on a kept label outside `[0, vocab)`.
    - `implementation`: `"xla"` (default) or `"reference"`; `block_sizes`: `None` (not blocked).

    **Returns:** the loss (a float32 scalar, or `[tokens]` float32 when `reduction=None`), or
    `CrossEntropyOutput(loss, lse)` with `return_lse`. A kept label outside `[0, vocab)` gives
    that token a NaN loss and a NaN gradient row. No token gives an empty per-token loss and a
    reduced loss of 0; an empty `vocab` is a `ValueError`.

    ```python
    loss = axkern.positional.cross_entropy(logits, labels)     # mean over tokens
    ```

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> loss = axkern.positional.cross_entropy(jnp.zeros((4, 10)), jnp.zeros(4, jnp.int32), reduction=None)
    >>> loss.shape, round(float(loss[0]), 4)
    ((4,), 2.3026)

    ```
    """
    reduction = reduction_name(NAME, reduction)
    check_options(NAME, logits_soft_cap, logsumexp_weight, label_smoothing)
    if block_sizes is not None:
        raise ValueError(f"{NAME}: block_sizes must be None (the op is not blocked), got {block_sizes!r}")
    keep = kept(labels, where, ignore_index)
    options = dict(
        logits_soft_cap=logits_soft_cap,
        logsumexp_weight=float(logsumexp_weight),
        label_smoothing=float(label_smoothing),
    )
    loss, lse = _per_token(
        logits,
        labels,
        keep,
        options=options,
        lse_grad=return_lse,
        check_labels=check_labels,
        implementation=implementation,
    )
    if reduction is not None:
        loss = reduce_loss(loss, keep, reduction)
    return CrossEntropyOutput(loss, lse) if return_lse else loss
