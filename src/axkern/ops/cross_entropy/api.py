"""`cross_entropy`: cross-entropy from precomputed logits, named and positional, and the `Op` behind them.

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

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from axkern.core import named
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

__all__ = ["cross_entropy", "cross_entropy_positional", "CrossEntropyOutput", "OP"]

NAME = "cross_entropy"

OP = Op(
    NAME,
    [
        Implementation(
            "xla",
            xla.cross_entropy,
            backward="custom_vjp: the gradient formed in the forward, in place of the softmax "
            "(one [tokens, vocab] residual in the logits' dtype; the backward scales it)",
        ),
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


# -- named layer -------------------------------------------------------------------------------

ROLES = named.Roles(
    NAME,
    {
        "logits": named.Arg(("batch", "Vocab"), describe="batch axes + Vocab"),
        "labels": named.Arg(("batch",), describe="logits' batch axes"),
        "where": named.Arg(("batch",), optional=True, subset=True, describe="logits' batch axes"),
    },
)
SHARDING = named.Sharding(describe="batch axes data parallel; Vocab gathered")


def cross_entropy(
    logits: NamedArray,
    labels: NamedArray,
    *,
    Vocab: named.AxisSelector = "vocab",
    reduction: str | None | object = "mean",
    where: NamedArray | None = None,
    ignore_index: int | None = None,
    logits_soft_cap: float | None = None,
    logsumexp_weight: float = 0.0,
    label_smoothing: float = 0.0,
    return_lse: bool = False,
    check_labels: bool = False,
    implementation: CrossEntropyImplementation | tuple[CrossEntropyImplementation, ...] | None = None,
    block_sizes: None = None,
) -> jax.Array | NamedArray | CrossEntropyOutput:
    """Cross-entropy of named logits against integer labels.

    **Arguments:**

    - `logits`: axis `Vocab` plus any batch axes (e.g. `batch, position, vocab`).
    - `labels`: integer targets with exactly `logits`' batch axes, in any order.
    - `Vocab`: an axis name or `hax.Axis`.
    - `reduction`, `where`, `ignore_index`, `logits_soft_cap`, `logsumexp_weight`,
      `label_smoothing`, `return_lse`, `check_labels`, `implementation`, `block_sizes`: as in
      `axkern.positional.cross_entropy`; `where` may carry a subset of the batch axes, and
      per-token results are `NamedArray`s with `logits`' batch axes in its order.

    **Returns:** the loss (a float32 scalar `jax.Array`, or a `NamedArray` of per-token losses
    when `reduction=None`), or `CrossEntropyOutput(loss, lse)` with `return_lse`.

    ```python
    loss = axkern.cross_entropy(logits, labels)              # logits [batch, vocab], labels [batch]
    ```

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Batch, Vocab = hax.Axis("batch", 4), hax.Axis("vocab", 10)
    >>> logits, labels = hax.zeros((Batch, Vocab)), hax.zeros(Batch, dtype=jnp.int32)
    >>> round(float(axkern.cross_entropy(logits, labels)), 4)  # uniform logits: log(10)
    2.3026

    ```
    """
    reduction = reduction_name(NAME, reduction)
    check_options(NAME, logits_soft_cap, logsumexp_weight, label_smoothing)
    bound = ROLES.bind(locals())
    if not bound.batch:
        raise ValueError(
            f"{NAME}: logits has no batch axes besides its Vocab axis: {named.axes_str(logits.axes)}"
        )

    options = dict(
        ignore_index=ignore_index,
        logits_soft_cap=logits_soft_cap,
        logsumexp_weight=logsumexp_weight,
        label_smoothing=label_smoothing,
        return_lse=return_lse,
        check_labels=check_labels,
        implementation=implementation,
        block_sizes=block_sizes,
    )

    def body(ctx, zs, ls, whs):
        return cross_entropy_positional(zs, ls, reduction=None, where=whs, **options)

    per_token = named.Out(("batch",), like="logits")
    if return_lse:
        loss, lse = bound.run(body, SHARDING, (per_token, per_token))
    else:
        loss, lse = bound.run(body, SHARDING, per_token), None
    if reduction is not None:
        keep = hax.named(kept(bound.data("labels"), bound.data("where"), ignore_index), bound.batch)
        loss = reduce_loss(loss.array, keep.rearrange(loss.axes).array, reduction)
    return CrossEntropyOutput(loss, lse) if return_lse else loss
