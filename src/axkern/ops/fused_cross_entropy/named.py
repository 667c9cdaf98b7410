"""`fused_cross_entropy` over named axes: its role table and sharding rule, bound to the caller's
axes; Vocab parallel by combining each shard's statistics with collectives."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax import lax

from axkern.core import compat, named
from axkern.core.loss import (
    CrossEntropyOutput,
    check_options,
    checked_labels,
    kept,
    reduction_name,
)
from axkern.core.loss import reduce as reduce_loss

from .api import (
    NAME,
    CrossEntropyBlockSizes,
    CrossEntropyImplementation,
    fused_cross_entropy_positional,
    per_token_loss,
    token_stats,
)
from .common import token_losses

__all__ = ["fused_cross_entropy"]

ROLES = named.Roles(
    NAME,
    {
        "x": named.Arg(("batch", "Embed"), describe="batch axes + Embed"),
        "lm_head": named.Arg(("Embed", "Vocab"), describe="Embed + Vocab"),
        "labels": named.Arg(("batch",), describe="x's batch axes"),
        "where": named.Arg(("batch",), optional=True, subset=True, describe="x's batch axes"),
    },
)
SHARDING = named.Sharding(
    parallel=("Vocab",),
    describe="batch axes data parallel; Vocab vocab parallel (each shard's lse, label logit and "
    "logit sum per token combined with one pmax and three psums of [tokens] float32); Embed gathered",
)


def _combine_over(mesh_axes, lse, label_logit, sum_logits):
    """Statistics of the whole vocabulary from each shard's statistics of its slice."""
    m = lax.pmax(lax.stop_gradient(lse), mesh_axes)
    lse = m + jnp.log(lax.psum(jnp.exp(lse - m), mesh_axes))
    return lse, lax.psum(label_logit, mesh_axes), lax.psum(sum_logits, mesh_axes)


def fused_cross_entropy(
    x: NamedArray,
    lm_head: NamedArray,
    labels: NamedArray,
    *,
    Embed: named.AxisSelector = "embed",
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
    block_sizes: CrossEntropyBlockSizes | dict | None = None,
    logit_soft_cap: float | None = None,
) -> jax.Array | NamedArray | CrossEntropyOutput:
    """Cross-entropy of `softcap(x @ lm_head)` against `labels`, without materialising the logits.

    **Arguments:**

    - `x`: hidden states with axis `Embed` plus any batch axes (e.g. `batch, position, embed`).
    - `lm_head`: axes `Embed` and `Vocab`, in either order.
    - `labels`: integer targets with exactly `x`'s batch axes, in any order.
    - `Embed`, `Vocab`: axis names or `hax.Axis` objects.
    - `reduction`: `"mean"` over kept tokens (0 when none is kept), `"sum"`, or `None` for a
      `NamedArray` of per-token losses with `x`'s batch axes (`hax.mean` / `hax.sum` too).
    - `where`: optional bool `NamedArray` over a subset of the batch axes; false tokens are dropped.
    - `ignore_index`, `logits_soft_cap`, `logsumexp_weight`, `label_smoothing`, `check_labels`:
      as in `axkern.positional.fused_cross_entropy` (`logit_soft_cap`: the former spelling).
    - `return_lse`: also return the per-token logsumexp (a `NamedArray` with the batch axes).
    - `implementation`, `block_sizes`: override the dispatcher.

    **Returns:** the loss (a float32 scalar `jax.Array`, ready for `jax.grad`; or a `NamedArray` of
    per-token losses when `reduction=None`), or `CrossEntropyOutput(loss, lse)` with `return_lse`.

    ```python
    loss = axkern.fused_cross_entropy(x, lm_head, labels, Embed="embed", Vocab="vocab")
    ```

    !!! info "Sharding"
        Under a haliax axis mapping with a mesh, batch axes mapped to mesh axes run data
        parallel and a mapped `Vocab` runs vocab parallel (each device holds a slice of
        `lm_head`; statistics are combined with `pmax`/`psum`). A mapped `Embed` is gathered.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Batch, Embed, Vocab = hax.Axis("batch", 4), hax.Axis("embed", 8), hax.Axis("vocab", 10)
    >>> x, lm_head = hax.ones((Batch, Embed)), hax.zeros((Embed, Vocab))
    >>> labels = hax.zeros(Batch, dtype=jnp.int32)
    >>> round(float(axkern.fused_cross_entropy(x, lm_head, labels)), 4)  # zero logits: log(10)
    2.3026
    >>> axkern.fused_cross_entropy(x, lm_head, labels, reduction=None).axes
    (Axis(name='batch', size=4),)

    ```
    """
    reduction = reduction_name(NAME, reduction)
    logits_soft_cap = named.deprecated_alias(
        NAME, "logit_soft_cap", "logits_soft_cap", logit_soft_cap, logits_soft_cap, None
    )
    check_options(NAME, logits_soft_cap, logsumexp_weight, label_smoothing)
    bound = ROLES.bind(
        {"x": x, "lm_head": lm_head, "labels": labels, "where": where}, Embed=Embed, Vocab=Vocab
    )
    if not bound.batch:
        raise ValueError(f"{NAME}: x has no batch axes besides its Embed axis: {named.axes_str(x.axes)}")
    vocab = bound.axis("Vocab")
    options = dict(
        ignore_index=ignore_index,
        logits_soft_cap=logits_soft_cap,
        logsumexp_weight=logsumexp_weight,
        label_smoothing=label_smoothing,
        check_labels=check_labels,
        implementation=implementation,
        block_sizes=block_sizes,
    )

    if not bound.sharded(SHARDING) and reduction is not None and not return_lse:
        # unsharded reduced loss: the op whose gradients come from the forward pass
        def reduced(ctx, xs, ws, ls, whs):
            return fused_cross_entropy_positional(xs, ws, ls, where=whs, reduction=reduction, **options)

        return bound.run(reduced, SHARDING, named.Out(())).array

    def body(ctx, xs, ws, ls, whs):
        vocab_mesh = ctx.mesh_axes("Vocab")
        if vocab_mesh is None:
            return tuple(per_token_loss(xs, ws, ls, where=whs, **options))
        offset = compat.axis_index(vocab_mesh) * ws.shape[1]
        keep = kept(ls, whs, ignore_index)
        if check_labels:
            ls = checked_labels(NAME, ls, keep, vocab.size)
        stats = token_stats(
            xs,
            ws,
            ls - offset,
            logits_soft_cap=logits_soft_cap,
            with_sum=bool(label_smoothing),
            implementation=implementation,
            block_sizes=block_sizes,
        )
        lse, label_logit, sum_logits = _combine_over(vocab_mesh, *stats)
        loss = token_losses(
            lse,
            label_logit,
            sum_logits,
            ls,
            keep,
            vocab.size,
            logsumexp_weight=logsumexp_weight,
            label_smoothing=label_smoothing,
        )
        return loss, lse

    per_token = named.Out(("batch",), like="x")
    loss, lse = bound.run(body, SHARDING, (per_token, per_token))
    if reduction is not None:
        keep = hax.named(kept(bound.data("labels"), bound.data("where"), ignore_index), bound.batch)
        loss = reduce_loss(loss.array, keep.rearrange(loss.axes).array, reduction)
    return CrossEntropyOutput(loss, lse) if return_lse else loss
