"""Levanter's `dot_product_attention` and `AttentionMask`, computed by `axkern.attention` with
axkern's structured masks."""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from .. import masks
from ..ops.attention import attention


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
