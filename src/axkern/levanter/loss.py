"""Levanter's cross-entropy losses, positional and named, computed by `axkern.fused_cross_entropy`."""

from __future__ import annotations

from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax import lax

from ..core.blocks import for_each_block
from ..ops.fused_cross_entropy import (
    CrossEntropyBlockSizes,
    fused_cross_entropy,
    fused_cross_entropy_positional,
)
from .common import map_impl, needs_platform

_CE = "axkern.levanter.fused_cross_entropy_loss_and_logsumexp_penalty"
# Levanter's implementation names and the axkern implementation each maps to (None: the
# dispatcher's order), and those that run on one platform only (Levanter raises elsewhere)
CE_IMPLEMENTATIONS: dict[str, str | None] = {
    "xla": "xla",
    "xla_fast_bwd": "xla",
    "batched_xla": None,
    "reference": "reference",
    "pallas_tpu": "pallas_tpu",
}
CE_UNAVAILABLE = {"pallas_tpu": needs_platform("tpu"), "batched_xla": needs_platform("gpu")}


def _ce_block_sizes(block_size, block_sizes):
    """Levanter's `block_size` (vocab block) or `BlockSizes(b_block_size, h_block_size, v_block_size)`."""
    if block_sizes is None:
        return None if block_size is None else CrossEntropyBlockSizes(block_vocab=int(block_size))
    if isinstance(block_sizes, CrossEntropyBlockSizes):
        return block_sizes
    try:
        b, h, v = block_sizes.b_block_size, block_sizes.h_block_size, block_sizes.v_block_size
    except AttributeError:
        raise TypeError(
            f"{_CE}: block_sizes must be Levanter's BlockSizes (b_block_size, h_block_size, v_block_size) "
            f"or axkern.CrossEntropyBlockSizes; got {block_sizes!r}"
        ) from None
    if block_size is not None and block_size != v:
        raise ValueError(f"{_CE}: block_size={block_size} and block_sizes.v_block_size={v} disagree")
    return CrossEntropyBlockSizes(block_tokens=b, block_vocab=v, block_embed=h)


def _argmax(x, w, *, block_vocab: int = 4096):
    """Per-token `argmax_v (x @ w)_v` (int32, the first index on ties), streamed over vocab blocks."""
    n, v = x.shape[0], w.shape[1]
    acc = jnp.promote_types(jnp.result_type(x, w), jnp.float32)

    def block(v0, vs, carry):
        best, index = carry
        z = jnp.matmul(x, lax.dynamic_slice_in_dim(w, v0, vs, axis=1), preferred_element_type=acc)
        m, i = jnp.max(z, axis=1), jnp.argmax(z, axis=1).astype(jnp.int32) + v0
        better = m > best
        return jnp.where(better, m, best), jnp.where(better, i, index)

    init = (jnp.full((n,), -jnp.inf, acc), jnp.zeros((n,), jnp.int32))
    x, w = lax.stop_gradient(x), lax.stop_gradient(w)
    return for_each_block(v, min(block_vocab, v), block, init)[1]


def _check_inputs(x, labels, w) -> None:
    """Levanter's checks of the kernel-level arguments, in its words."""
    if x.ndim != 2:
        raise ValueError(f"{_CE}: x must be rank-2 [B, H], got shape {x.shape}.")
    if labels.ndim != 1:
        raise ValueError(f"{_CE}: labels must be rank-1 [B], got shape {labels.shape}.")
    if w.ndim != 2:
        raise ValueError(f"{_CE}: w must be rank-2 [H, V], got shape {w.shape}.")
    if x.shape[0] != labels.shape[0]:
        raise ValueError(f"{_CE}: Batch mismatch: x has B={x.shape[0]}, labels has B={labels.shape[0]}.")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"{_CE}: Hidden mismatch: x has H={x.shape[1]}, w has H={w.shape[0]}.")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"{_CE}: labels must be integer dtype, got {labels.dtype}.")


def _soft_capped(z, soft_cap):
    return z if soft_cap is None else soft_cap * jnp.tanh(z / soft_cap)


def levanter_labels(labels, vocab: int, column_logit):
    """Labels read as Levanter's kernels read them (JAX's indexing), where axkern's op gives NaN
    for a label outside `[0, vocab)`: a negative label counts from the end; one still outside
    takes its nearest column's logit (0 or `vocab - 1`) in the loss, and adds no label term to
    the gradient (a gather clamps its index, its transpose drops it).

    **Returns:** `(labels, correction)`: the labels in `[0, vocab)`, and per token what to add
    to axkern's loss on them: 0 in value, with the gradient that takes the label term back out
    where Levanter has none. `column_logit(j)` gives each token's logit of column `j` (a product
    with one column of `w`).
    """
    if jnp.dtype(labels.dtype).itemsize < 4:
        labels = labels.astype(jnp.int32)  # room for `labels + vocab`
    wrapped = jnp.where(labels < 0, labels + vocab, labels)
    correction = 0.0
    for column, outside in ((0, wrapped < 0), (vocab - 1, wrapped >= vocab)):
        z = column_logit(column)
        correction = correction + jnp.where(outside, z - lax.stop_gradient(z), 0.0)
    return jnp.clip(wrapped, 0, vocab - 1).astype(jnp.int32), correction


def fused_cross_entropy_loss_and_logsumexp_penalty(
    x: jax.Array,
    labels: jax.Array,
    w: jax.Array,
    *,
    reduction: str | None = "mean",
    weight: jax.Array | None = None,
    logsumexp_weight: float | None = 0.0,
    block_size: int | None = None,
    block_sizes: Any = None,
    dtype: Any = jnp.float32,
    logit_soft_cap: float | None = None,
    precision: Any = None,
    implementation: Any = None,
    return_argmax: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Levanter's `levanter.kernels.pallas.fused_cross_entropy_loss.fused_cross_entropy_loss_and_logsumexp_penalty`.

    **Arguments:** `x [B, H]`, `labels [B]` (integers; one outside `[0, V)` is read as Levanter
    reads it: `levanter_labels`), `w [H, V]`; `reduction` `"mean"`, `"sum"` or `None`; `weight`: float
    weights broadcastable to `[B]`: the loss is `loss * weight`, and its mean `sum(loss * weight)
    / sum(weight)` with the sum over `weight` as given (a scalar weight divides by itself), 0
    when that is 0, as Levanter's; `logsumexp_weight`: the z-loss weight (`None` is 0);
    `block_size` / `block_sizes`: Levanter's vocab block (mapped to `block_vocab`; Levanter's
    `BlockSizes` to `CrossEntropyBlockSizes`); `dtype`: the loss's dtype (axkern accumulates in
    float32 whatever it is); `logit_soft_cap`; `precision`: accepted (float32 operands are always
    multiplied at full precision); `implementation`: Levanter's names, mapped (`xla`,
    `xla_fast_bwd` to `xla`; `batched_xla` to the dispatcher's order, on a GPU only;
    `pallas_tpu` on a TPU only, or under `axkern.use(interpret=True)`): a name that cannot run
    here is skipped in a sequence and raises `NotImplementedError` alone, as in Levanter;
    `return_argmax`: also return each token's argmax id (int32).

    **Returns:** the loss, or `(loss, argmax)` with `return_argmax`.

    Without `weight` or explicit block sizes a reduced loss runs `fused_cross_entropy_loss`
    (gradients formed in the forward); otherwise the per-token `fused_cross_entropy` runs and
    the weights are applied to its output.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> from axkern.levanter import fused_cross_entropy_loss_and_logsumexp_penalty
    >>> x, labels, w = jnp.ones((4, 8)), jnp.zeros(4, jnp.int32), jnp.zeros((8, 10))
    >>> round(float(fused_cross_entropy_loss_and_logsumexp_penalty(x, labels, w)), 4)  # zero logits: log(10)
    2.3026

    ```
    """
    if reduction not in ("mean", "sum", None):
        raise ValueError(f"{_CE}: reduction must be 'mean', 'sum' or None; got {reduction!r}")
    _check_inputs(x, labels, w)
    impl = map_impl(_CE, implementation, CE_IMPLEMENTATIONS, CE_UNAVAILABLE)
    bs = _ce_block_sizes(block_size, block_sizes)
    options = dict(
        logsumexp_weight=float(logsumexp_weight or 0.0), logits_soft_cap=logit_soft_cap, block_sizes=bs
    )
    out_dtype = jnp.dtype(dtype) if dtype is not None else jnp.float32

    def column_logit(j):
        z = jnp.matmul(x, w[:, j], preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
        return _soft_capped(z, logit_soft_cap)

    labels, correction = levanter_labels(labels, w.shape[1], column_logit)
    if weight is None and reduction is not None and bs is None:
        # the reduced op: its gradients are formed in the forward
        loss = fused_cross_entropy_positional(
            x, w, labels, reduction=reduction, implementation=impl, **options
        )
        loss = loss + (jnp.sum(correction) if reduction == "sum" else jnp.mean(correction))
        loss = loss.astype(out_dtype)
    else:
        loss = fused_cross_entropy_positional(x, w, labels, reduction=None, implementation=impl, **options)
        loss = (loss + correction).astype(out_dtype)
        if weight is not None:  # Levanter's reduction: the weight as given, broadcast only in the product
            weight = jnp.asarray(weight).astype(loss.dtype)
            loss = loss * weight
        if reduction == "sum":
            loss = jnp.sum(loss)
        elif reduction == "mean":
            if weight is None:
                loss = jnp.mean(loss)
            else:
                denom = jnp.sum(weight)
                loss = jnp.where(denom != 0, jnp.sum(loss) / denom, jnp.zeros_like(denom))
    if return_argmax:
        return loss, _argmax(x, w)
    return loss


# -- named losses ------------------------------------------------------------------------------


def _reduce_loss(arr: NamedArray, reduction, reduction_axis, weight: NamedArray | None):
    """haliax's `maybe_reduce_loss(arr, reduction, reduction_axis, where=None, weight=weight)`:
    weighted, a mean is `sum(arr * weight) / sum(weight)` (0 where that is 0)."""
    if weight is not None:
        weight = hax.broadcast_axis(weight, arr.axes).astype(arr.dtype)
    if reduction is None or reduction_axis == ():
        return arr if weight is None else arr * weight
    if weight is None:
        return reduction(arr, axis=reduction_axis)
    weighted = arr * weight
    if reduction is hax.mean or reduction is jnp.mean:
        num = hax.sum(weighted, axis=reduction_axis)
        denom = hax.sum(weight, axis=reduction_axis)
        return hax.where(denom != 0, num / denom, hax.zeros_like(num))
    return reduction(weighted, axis=reduction_axis)


def next_token_loss_weight(Pos: hax.Axis, loss_weight: NamedArray | None) -> NamedArray:
    """Levanter's: the per-position weight of next-token prediction (the last position is 0).

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> from axkern.levanter import next_token_loss_weight
    >>> next_token_loss_weight(hax.Axis("position", 4), None).array.tolist()
    [1.0, 1.0, 1.0, 0.0]

    ```
    """
    not_last = hax.arange(Pos) != Pos.size - 1
    if loss_weight is not None:
        return loss_weight * not_last.astype(loss_weight.dtype)
    return not_last.astype(jnp.float32)


def named_fused_cross_entropy_loss_and_logsumexp_penalty(
    pred_embeddings: NamedArray,
    pred_lm_head: NamedArray,
    Contract: hax.AxisSelector,
    Label: hax.AxisSelector,
    target_y: NamedArray,
    *,
    reduction=hax.mean,
    reduction_axis=None,
    weight: NamedArray | None = None,
    logsumexp_weight: float | None = 0.0,
    block_size: int | None = None,
    dtype: Any = jnp.float32,
    logit_soft_cap: float | None = None,
    precision: Any = None,
    implementation: Any = None,
    return_argmax: bool = False,
):
    """Levanter's `levanter.models.loss.fused_cross_entropy_loss_and_logsumexp_penalty` (named).

    A label outside `[0, V)` is read as Levanter reads it (`levanter_labels`); `implementation`
    as in the kernel-level function."""
    fn = "axkern.levanter.named_fused_cross_entropy_loss_and_logsumexp_penalty"
    impl = map_impl(fn, implementation, CE_IMPLEMENTATIONS, CE_UNAVAILABLE)
    bs = _ce_block_sizes(block_size, None)
    Embed = pred_embeddings.resolve_axis(hax.axis_name(Contract))
    Vocab = pred_lm_head.resolve_axis(hax.axis_name(Label))

    def column_logit(j):
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731 - exact products, float32 sums
        z = hax.dot(f32(pred_embeddings), f32(pred_lm_head[Vocab.name, j]), axis=Embed, precision="highest")
        return _soft_capped(z, logit_soft_cap).rearrange(target_y.axes).array

    # Levanter's kernel receives the labels as int32
    labels, correction = levanter_labels(target_y.array.astype(jnp.int32), Vocab.size, column_logit)
    labels, correction = hax.named(labels, target_y.axes), hax.named(correction, target_y.axes)
    loss = fused_cross_entropy(
        pred_embeddings,
        pred_lm_head,
        labels,
        Embed=Contract,
        Vocab=Label,
        reduction=None,
        logsumexp_weight=float(logsumexp_weight or 0.0),
        logits_soft_cap=logit_soft_cap,
        implementation=impl,
        block_sizes=bs,
    )
    loss = (loss + correction).rearrange(target_y.axes).astype(dtype if dtype is not None else jnp.float32)
    reduced = _reduce_loss(loss, reduction, reduction_axis, weight)
    if not return_argmax:
        return reduced
    batch = tuple(a for a in target_y.axes)
    xs = pred_embeddings.rearrange((*batch, Embed)).array.reshape(-1, Embed.size)
    ids = _argmax(xs, pred_lm_head.rearrange((Embed, Vocab)).array)
    return reduced, hax.named(ids.reshape(tuple(a.size for a in batch)), batch)


def maybe_fused_next_token_loss(
    Pos: hax.AxisSelector,
    Embed: hax.AxisSelector,
    Vocab: hax.AxisSelector,
    pred_embeddings: NamedArray,
    pred_lm_head: NamedArray,
    true_ids: NamedArray,
    loss_weight: NamedArray | None = None,
    reduction=hax.mean,
    reduction_axis=None,
    logsumexp_weight: float | None = None,
    block_size: int | None = None,
    dtype: Any = jnp.float32,
    logit_soft_cap: float | None = None,
    precision: Any = None,
) -> NamedArray | jax.Array:
    """Levanter's `levanter.models.loss.maybe_fused_next_token_loss`, computed by `axkern.fused_cross_entropy`.

    The targets are `true_ids` rolled by one along `Pos` (position `t` predicts `t + 1`); the last
    position's weight is 0, times `loss_weight` when given (whose dtype the loss then takes). The
    loss is reduced by `reduction` (a haliax reduction such as `hax.mean`, or `None`) over
    `reduction_axis` (all axes when `None`), weighted: a mean is `sum(loss * w) / sum(w)`.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> from axkern.levanter import maybe_fused_next_token_loss
    >>> Pos, Embed, Vocab = hax.Axis("position", 4), hax.Axis("embed", 8), hax.Axis("vocab", 10)
    >>> x, lm_head, ids = hax.ones((Pos, Embed)), hax.zeros((Embed, Vocab)), hax.zeros(Pos, dtype=jnp.int32)
    >>> round(float(maybe_fused_next_token_loss(Pos, Embed, Vocab, x, lm_head, ids).array), 4)  # over the 3 predicted positions: log(10)
    2.3026

    ```
    """
    Pos = pred_embeddings.resolve_axis(hax.axis_name(Pos))
    target_y = hax.roll(true_ids, -1, Pos)
    if loss_weight is not None:
        dtype = loss_weight.dtype
    weight = next_token_loss_weight(Pos, loss_weight)
    return named_fused_cross_entropy_loss_and_logsumexp_penalty(
        pred_embeddings,
        pred_lm_head,
        Embed,
        Vocab,
        target_y,
        reduction=reduction,
        reduction_axis=reduction_axis,
        weight=weight,
        logsumexp_weight=logsumexp_weight,
        block_size=block_size,
        dtype=dtype,
        logit_soft_cap=logit_soft_cap,
        precision=precision,
    )
