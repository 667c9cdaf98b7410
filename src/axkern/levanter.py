"""Drop-ins for Levanter's functions, with Levanter's signatures and meaning, backed by axkern's ops.

```python
# from levanter.models.loss import maybe_fused_next_token_loss
# from levanter.layers.attention import dot_product_attention, AttentionMask
from axkern.levanter import AttentionMask, dot_product_attention, maybe_fused_next_token_loss
```

Each argument of Levanter's signature is accepted as Levanter means it, mapped to axkern's
nearest option, or refused with a `ValueError` / `TypeError` that names it (the table is in
`docs/levanter.md`). The reference is marin-levanter 0.2.227.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax import lax

from . import masks
from .core.blocks import for_each_block
from .ops.attention.api import attention
from .ops.fused_cross_entropy.api import fused_cross_entropy, fused_cross_entropy_positional
from .ops.fused_cross_entropy.blocks import CrossEntropyBlockSizes
from .ops.short_conv.api import short_conv_positional

__all__ = [
    "fused_cross_entropy_loss_and_logsumexp_penalty",
    "maybe_fused_next_token_loss",
    "next_token_loss_weight",
    "dot_product_attention",
    "AttentionMask",
    "short_conv",
]

_CE = "axkern.levanter.fused_cross_entropy_loss_and_logsumexp_penalty"
# Levanter's implementation names and the axkern implementation each maps to
_CE_IMPLS = {
    "xla": "xla",
    "xla_fast_bwd": "xla",
    "batched_xla": "xla",
    "reference": "reference",
    "pallas_tpu": "pallas_tpu",
}
_CONV_IMPLS = {"reference": "reference", "triton_gpu": "pallas_gpu"}


def _map_impl(fn: str, implementation, table: dict[str, str]):
    """Levanter's `implementation` (a name or a sequence of names) as axkern's."""
    if implementation is None:
        return None
    names = (implementation,) if isinstance(implementation, str) else implementation
    if not isinstance(names, Sequence) or any(not isinstance(n, str) for n in names):
        raise TypeError(
            f"{fn}: implementation must be None, a name or a sequence of names from {sorted(table)}; "
            f"got {implementation!r} (callables are Levanter's own kernels and cannot run here)"
        )
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"{fn}: implementation must be one of {sorted(table)}; got {unknown[0]!r}")
    mapped = tuple(dict.fromkeys(table[n] for n in names))
    return mapped[0] if isinstance(implementation, str) else mapped


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

    **Arguments:** `x [B, H]`, `labels [B]` (integers), `w [H, V]`; `reduction` `"mean"` (over all
    tokens, or `sum(loss * weight) / sum(weight)` with a `weight`, 0 when that is 0), `"sum"` or
    `None`; `weight`: float per-token weights (broadcastable to `[B]`); `logsumexp_weight`: the
    z-loss weight (`None` is 0); `block_size` / `block_sizes`: Levanter's vocab block (mapped to
    `block_vocab`; Levanter's `BlockSizes` to `CrossEntropyBlockSizes`); `dtype`: the loss's dtype
    (axkern accumulates in float32 whatever it is); `logit_soft_cap`; `precision`: accepted
    (float32 operands are always multiplied at full precision); `implementation`: Levanter's names,
    mapped (`xla`, `xla_fast_bwd`, `batched_xla` to `xla`); `return_argmax`: also return each
    token's argmax id (int32).

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
    if x.ndim != 2 or labels.ndim != 1 or w.ndim != 2:
        raise ValueError(
            f"{_CE}: x must be [B, H], labels [B] and w [H, V]; got {list(x.shape)}, {list(labels.shape)}, "
            f"{list(w.shape)}"
        )
    impl = _map_impl(_CE, implementation, _CE_IMPLS)
    bs = _ce_block_sizes(block_size, block_sizes)
    lsw = float(logsumexp_weight or 0.0)
    out_dtype = jnp.dtype(dtype) if dtype is not None else jnp.float32
    options = dict(logsumexp_weight=lsw, logits_soft_cap=logit_soft_cap, block_sizes=bs)
    labels = labels.astype(jnp.int32)
    per_token_impls = impl is not None and any(
        n == "pallas_tpu" for n in ((impl,) if isinstance(impl, str) else impl)
    )
    if weight is None and reduction is not None and bs is None and not per_token_impls:
        loss = fused_cross_entropy_positional(
            x, w, labels, reduction=reduction, implementation=impl, **options
        )
        loss = loss.astype(out_dtype)
    else:
        loss = fused_cross_entropy_positional(x, w, labels, reduction=None, implementation=impl, **options)
        loss = loss.astype(out_dtype)
        if weight is not None:
            weight = jnp.broadcast_to(jnp.asarray(weight), loss.shape).astype(loss.dtype)
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
    """Levanter's `levanter.models.loss.fused_cross_entropy_loss_and_logsumexp_penalty` (named)."""
    fn = "axkern.levanter.named_fused_cross_entropy_loss_and_logsumexp_penalty"
    impl = _map_impl(fn, implementation, _CE_IMPLS)
    bs = _ce_block_sizes(block_size, None)
    loss = fused_cross_entropy(
        pred_embeddings,
        pred_lm_head,
        target_y.astype(jnp.int32),
        Embed=Contract,
        Vocab=Label,
        reduction=None,
        logsumexp_weight=float(logsumexp_weight or 0.0),
        logits_soft_cap=logit_soft_cap,
        implementation=impl,
        block_sizes=bs,
    )
    loss = loss.rearrange(target_y.axes).astype(dtype if dtype is not None else jnp.float32)
    reduced = _reduce_loss(loss, reduction, reduction_axis, weight)
    if not return_argmax:
        return reduced
    embed = pred_embeddings.resolve_axis(hax.axis_name(Contract))
    vocab = pred_lm_head.resolve_axis(hax.axis_name(Label))
    batch = tuple(a for a in target_y.axes)
    xs = pred_embeddings.rearrange((*batch, embed)).array.reshape(-1, embed.size)
    ids = _argmax(xs, pred_lm_head.rearrange((embed, vocab)).array)
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


# -- attention ---------------------------------------------------------------------------------


class AttentionMask(eqx.Module):
    """Levanter's `levanter.layers.attention_mask.AttentionMask`, the parts axkern maps to its own
    masks: causal (with an offset), a causal sliding window, segment ids and an explicit mask,
    all and-ed. Levanter's own `AttentionMask` is accepted by `dot_product_attention` too."""

    is_causal: bool = eqx.field(default=False, static=True)
    causal_offset: int | NamedArray | None = None
    explicit_mask: NamedArray | None = None
    segment_ids: tuple[NamedArray, NamedArray] | None = None
    sliding_window: int | None = eqx.field(default=None, static=True)
    bidirectional_window: int | None = eqx.field(default=None, static=True)

    @staticmethod
    def causal(*, sliding_window=None, offset=None, segment_ids=None) -> AttentionMask:
        return AttentionMask(
            is_causal=True, causal_offset=offset, sliding_window=sliding_window, segment_ids=segment_ids
        )

    @staticmethod
    def explicit(mask: NamedArray) -> AttentionMask:
        return AttentionMask(explicit_mask=mask)

    def with_segment_ids(
        self, segment_ids: NamedArray, kv_segment_ids: NamedArray | None = None
    ) -> AttentionMask:
        seg = (segment_ids, segment_ids if kv_segment_ids is None else kv_segment_ids)
        return eqx.tree_at(lambda m: m.segment_ids, self, seg, is_leaf=lambda x: x is None)

    def with_sliding_window(self, sliding_window: int | None) -> AttentionMask:
        return AttentionMask(
            self.is_causal,
            self.causal_offset,
            self.explicit_mask,
            self.segment_ids,
            sliding_window,
            self.bidirectional_window,
        )

    def materialize(self, QPos: hax.Axis, KPos: hax.Axis) -> NamedArray | None:
        """The whole boolean mask over `QPos` and `KPos` (and the ids' batch axes)."""
        return _materialize(self, QPos, KPos)


_DPA = "axkern.levanter.dot_product_attention"


def _static_offset(offset) -> int:
    if offset is None:
        return 0
    value = offset.array if isinstance(offset, NamedArray) else offset
    try:
        return int(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ValueError(
            f"{_DPA}: mask.causal_offset must be a concrete int (axkern's causal mask is static); got a traced value"
        ) from None


def _segments(segment_ids, QPos: hax.Axis, KPos: hax.Axis) -> masks.Segments:
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    if kv_ids.has_axis(QPos.name) and not kv_ids.has_axis(KPos.name):
        kv_ids = kv_ids.rename({QPos.name: KPos.name})
    return masks.Segments(q_ids, kv_ids)


def _bidirectional(radius: int, QPos: hax.Axis, KPos: hax.Axis) -> NamedArray:
    diff = hax.arange(QPos).broadcast_axis(KPos) - hax.arange(KPos).broadcast_axis(QPos)
    return (diff <= radius) & (diff >= -radius)


def to_axkern_mask(mask, QPos: hax.Axis, KPos: hax.Axis) -> masks.Mask | None:
    """A Levanter mask (`AttentionMask`-like, a bool `NamedArray`, or `None`) as an axkern mask:
    causal, sliding window and segment ids stay structured (tiles they hide are skipped)."""
    if mask is None or isinstance(mask, masks.Mask):
        return mask
    if isinstance(mask, NamedArray):
        return masks.Dense(mask.astype(jnp.bool_))
    if not hasattr(mask, "is_causal"):
        raise TypeError(
            f"{_DPA}: mask must be None, an AttentionMask, a bool NamedArray or an axkern mask; got {mask!r}"
        )
    parts: list[masks.Mask] = []
    if mask.is_causal:
        parts.append(masks.Causal(offset=_static_offset(mask.causal_offset)))
    if getattr(mask, "sliding_window", None) is not None:
        parts.append(masks.SlidingWindow(int(mask.sliding_window)))
    if getattr(mask, "bidirectional_window", None) is not None:
        parts.append(masks.Dense(_bidirectional(int(mask.bidirectional_window), QPos, KPos)))
    if getattr(mask, "explicit_mask", None) is not None:
        parts.append(masks.Dense(mask.explicit_mask.astype(jnp.bool_)))
    if getattr(mask, "segment_ids", None) is not None:
        parts.append(_segments(mask.segment_ids, QPos, KPos))
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


def _materialize(mask, QPos: hax.Axis, KPos: hax.Axis) -> NamedArray | None:
    m = to_axkern_mask(mask, QPos, KPos)
    if m is None:
        return None
    out = hax.ones((QPos, KPos), dtype=jnp.bool_)
    for part in _conjuncts(m):
        if isinstance(part, masks.Segments):
            q_ids, kv_ids = part.q_ids, part.kv_ids
            out = out & (q_ids.broadcast_axis(KPos) == kv_ids.broadcast_axis(QPos))
        elif isinstance(part, masks.Dense):
            out = out & part.array
        else:
            out = out & hax.named(part.dense(QPos.size, KPos.size)[0], (QPos, KPos))
    return out


def _conjuncts(m: masks.Mask) -> list[masks.Mask]:
    if type(m) is masks.And:
        return _conjuncts(m.a) + _conjuncts(m.b)
    return [m]


def dot_product_attention(
    QPos: hax.AxisSelector,
    KPos: hax.AxisSelection,
    Key: hax.AxisSelector,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask=None,
    bias: NamedArray | None = None,
    attention_dtype: Any = None,
    precision: Any = None,
    use_flash: bool | None = None,
    attn_backend: Any = None,
    flash_block_size: int | None = None,
    dropout: float = 0.0,
    *,
    logits_soft_cap: float | None = None,
    scaling_factor: float | None = None,
    inference: bool = True,
    prng: Any = None,
    attn_sink: NamedArray | None = None,
) -> NamedArray:
    """Levanter's `levanter.layers.attention.dot_product_attention`, computed by `axkern.attention`.

    `query` carries `QPos`, `Key` and any other axes; `key` and `value` carry `KPos` (a name
    different from `QPos`'s) and `Key` (`value`'s head axis may differ in size). Axes that
    `query` and `key` share are batch axes, except those the sink carries (kv heads); axes only
    `query` has are query heads that share each kv head (grouped-query attention). `mask`: a
    Levanter `AttentionMask` (or this module's), a bool `NamedArray` or an `axkern.masks` mask.

    **Returns:** `query`'s axes without `Key`, then `value`'s head axis.

    Refused: a `bias`, dropout during training, and several `KPos` axes (`ValueError`).
    `precision`, `use_flash`, `attn_backend` (but `"vanilla"`, which runs `reference`),
    `flash_block_size` and `prng` are accepted and leave the choice to axkern's dispatcher.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> from axkern.levanter import dot_product_attention
    >>> Pos, KPos, Heads, Key = hax.Axis("position", 16), hax.Axis("key_position", 16), hax.Axis("heads", 2), hax.Axis("head_size", 8)
    >>> q = hax.random.normal(jax.random.PRNGKey(0), (Pos, Heads, Key))
    >>> k = v = hax.random.normal(jax.random.PRNGKey(1), (KPos, Heads, Key))
    >>> dot_product_attention("position", "key_position", "head_size", q, k, v).axes == q.axes
    True

    ```
    """
    if not isinstance(KPos, (str, hax.Axis)):
        raise ValueError(f"{_DPA}: KPos must be one axis (a name or hax.Axis); got {KPos!r}")
    if hax.axis_name(QPos) == hax.axis_name(KPos):
        raise ValueError("QPos and KPos must have different names")
    if bias is not None:
        raise ValueError(
            f"{_DPA}: bias must be None (axkern's attention takes no additive bias); got {bias.axes}"
        )
    if dropout and not inference:
        raise ValueError(f"{_DPA}: dropout must be 0 in training (inference=False); got dropout={dropout}")
    QPos = query.resolve_axis(hax.axis_name(QPos))
    KPos = key.resolve_axis(hax.axis_name(KPos))
    Key = query.resolve_axis(hax.axis_name(Key))
    vdim = next((a for a in value.axes if a.name not in {ax.name for ax in key.axes} - {Key.name}), None)
    if vdim is None:
        raise ValueError(f"{_DPA}: value's axes {value.axes} have no head axis besides key's")
    k_names = {a.name for a in key.axes}
    sink_names = set() if attn_sink is None else {a.name for a in attn_sink.axes}
    shared = [a for a in query.axes if a.name in k_names and a.name not in (Key.name,)]
    kv_heads = [a for a in shared if a.name in sink_names]
    batch = [a for a in shared if a.name not in sink_names]
    q_heads = [a for a in query.axes if a.name not in k_names and a.name not in (QPos.name, Key.name)]
    out_axes = tuple(a for a in query.axes if a.name != Key.name) + (vdim,)
    dtype = query.dtype
    if attention_dtype is not None:
        query, key, value = (
            query.astype(attention_dtype),
            key.astype(attention_dtype),
            value.astype(attention_dtype),
        )

    H = hax.Axis("__axkern_heads", math.prod(a.size for a in kv_heads + q_heads))
    KVH = hax.Axis("__axkern_kv_heads", math.prod(a.size for a in kv_heads))

    def heads(arr, pos, head_axes, head_axis, dim):
        data = arr.rearrange((*batch, pos, *head_axes, dim)).array
        return hax.named(
            data.reshape(data.shape[: len(batch) + 1] + (head_axis.size, dim.size)),
            (*batch, pos, head_axis, dim),
        )

    q = heads(query, QPos, kv_heads + q_heads, H, Key)
    k = heads(key, KPos, kv_heads, KVH, Key)
    v = heads(value, KPos, kv_heads, KVH, vdim)
    sinks = None
    if attn_sink is not None:
        sinks = (
            hax.broadcast_to(attn_sink, (*kv_heads, *q_heads))
            .rearrange((*kv_heads, *q_heads))
            .array.reshape(-1)
        )
    out = attention(
        q,
        k,
        v,
        QPos=QPos,
        KPos=KPos,
        Heads=H,
        KVHeads=KVH,
        HeadDim=Key,
        mask=to_axkern_mask(mask, QPos, KPos),
        scale=scaling_factor,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        implementation="reference" if str(attn_backend).lower().endswith("vanilla") else None,
    )
    data = out.rearrange((*batch, QPos, H, vdim)).array
    data = data.reshape(
        data.shape[: len(batch) + 1] + tuple(a.size for a in kv_heads + q_heads) + (vdim.size,)
    )
    result = hax.named(data, (*batch, QPos, *kv_heads, *q_heads, vdim)).astype(dtype)
    return result.rearrange(out_axes)


# -- short convolution -------------------------------------------------------------------------

DEFAULT_BATCH_AXES: tuple[str, ...] = ("replica_dcn", "data", "expert")


def short_conv(
    weight: jax.Array,
    x: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    implementation: Any = None,
    exact_reference_rounding: bool = True,
    batch_axes: Sequence[str] = DEFAULT_BATCH_AXES,
) -> jax.Array:
    """Levanter's `levanter.kernels.triton.short_conv.short_conv(weight, x, segment_ids)`, computed by
    `axkern.positional.short_conv(x, weight, segment_ids=...)`.

    `out[b, t, c] = sum_lag weight[lag, c] * x[b, t - lag, c]`, a tap into another segment
    dropped. `implementation`: `"reference"` or `"triton_gpu"` (mapped to `pallas_gpu`).
    `exact_reference_rounding` and `batch_axes` are accepted: axkern accumulates the taps in
    float32 (Levanter's `exact_reference_rounding=False`) and shards as the inputs are laid out.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> from axkern.levanter import short_conv
    >>> short_conv(jnp.ones((2, 2)), jnp.ones((1, 6, 2)))[0, :, 0].tolist()  # weight [width, channels], x [batch, seq, channels]
    [1.0, 2.0, 2.0, 2.0, 2.0, 2.0]

    ```
    """
    fn = "axkern.levanter.short_conv"
    if weight.dtype != x.dtype:
        raise ValueError(
            f"{fn}: weight and x must share a dtype; got weight={weight.dtype}, x={x.dtype}. "
            "Cast to a common dtype before calling."
        )
    impl = _map_impl(fn, implementation, _CONV_IMPLS)
    del exact_reference_rounding, batch_axes
    return short_conv_positional(x, weight, segment_ids=segment_ids, implementation=impl)
