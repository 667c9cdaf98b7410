"""`cross_entropy` over named axes: its role table and sharding rule, bound to the caller's axes;
batch axes data parallel."""

from __future__ import annotations

import haliax as hax
import jax
from haliax import NamedArray

from axkern.core import named
from axkern.core.loss import CrossEntropyOutput, check_options, kept, reduction_name
from axkern.core.loss import reduce as reduce_loss

from .api import NAME, CrossEntropyImplementation, cross_entropy_positional

__all__ = ["cross_entropy"]

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
    bound = ROLES.bind({"logits": logits, "labels": labels, "where": where}, Vocab=Vocab)
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
