"""Levanter's `AttentionMask` as axkern's masks, and the class `axkern.levanter.AttentionMask` stands
for where Levanter is not installed.

Where Levanter is importable, `axkern.levanter.AttentionMask` *is*
`levanter.layers.attention_mask.AttentionMask` (Levanter's layers apply a model's sliding window
only to an instance of their own class); `LevanterlessAttentionMask` below has the same fields,
constructors and combinators for code that runs without Levanter.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from .. import masks

_DPA = "axkern.levanter.dot_product_attention"


def _narrower(a: int | None, b: int | None) -> int | None:
    """The window of an and: the smaller one given (None: no window)."""
    return a if b is None else b if a is None else min(a, b)


def _wider(a: int | None, b: int | None) -> int | None:
    """The window of an or: none unless both have one, then the larger."""
    return None if a is None or b is None else max(a, b)


class LevanterlessAttentionMask(eqx.Module):
    """Levanter's `AttentionMask` (marin-levanter 0.2.227): an and of a causal mask (with an
    offset: key `j` visible to query `i` when `j <= i + offset`), an explicit bool mask, segment
    ids, a causal sliding window (`0 <= i - j < sliding_window`) and a bidirectional window
    (`|i - j| <= bidirectional_window`). `&` and `|` combine two as Levanter's do."""

    is_causal: bool = eqx.field(default=False, static=True)
    causal_offset: NamedArray | None = None
    explicit_mask: NamedArray | None = None
    segment_ids: tuple[NamedArray, NamedArray] | None = None
    sliding_window: int | None = eqx.field(default=None, static=True)
    bidirectional_window: int | None = eqx.field(default=None, static=True)

    @staticmethod
    def causal(*, sliding_window=None, offset=None, segment_ids=None) -> LevanterlessAttentionMask:
        return LevanterlessAttentionMask(
            is_causal=True, causal_offset=offset, sliding_window=sliding_window, segment_ids=segment_ids
        )

    @staticmethod
    def explicit(mask: NamedArray) -> LevanterlessAttentionMask:
        return LevanterlessAttentionMask(explicit_mask=mask)

    @staticmethod
    def bidirectional_sliding_window(radius: int) -> LevanterlessAttentionMask:
        return LevanterlessAttentionMask(bidirectional_window=radius)

    def __post_init__(self):
        if self.causal_offset is not None and not isinstance(self.causal_offset, NamedArray):
            object.__setattr__(self, "causal_offset", hax.named(self.causal_offset, ()))
        if self.segment_ids is not None and not isinstance(self.segment_ids, tuple):
            object.__setattr__(self, "segment_ids", (self.segment_ids, self.segment_ids))

    def _with(self, **changes) -> LevanterlessAttentionMask:
        fields = dict(
            is_causal=self.is_causal,
            causal_offset=self.causal_offset,
            explicit_mask=self.explicit_mask,
            segment_ids=self.segment_ids,
            sliding_window=self.sliding_window,
            bidirectional_window=self.bidirectional_window,
        )
        return LevanterlessAttentionMask(**{**fields, **changes})

    def with_segment_ids(
        self, segment_ids: NamedArray, kv_segment_ids: NamedArray | None = None
    ) -> LevanterlessAttentionMask:
        return self._with(
            segment_ids=(segment_ids, segment_ids if kv_segment_ids is None else kv_segment_ids)
        )

    def with_sliding_window(self, sliding_window: int | None) -> LevanterlessAttentionMask:
        return self._with(sliding_window=sliding_window)

    def _one_segment_ids(self, other):
        if self.segment_ids is None or other.segment_ids is None:
            return self.segment_ids if other.segment_ids is None else other.segment_ids
        (q, kv), (q2, kv2) = self.segment_ids, other.segment_ids
        differ = jnp.any(q.array != q2.array) | jnp.any(kv.array != kv2.array)
        return hax.named(eqx.error_if(q.array, differ, "Only one segment mask is allowed"), q.axes), kv

    def __and__(self, other) -> LevanterlessAttentionMask:
        offsets = [m.causal_offset for m in (self, other) if m.is_causal and m.causal_offset is not None]
        offset = offsets[0] if offsets else None
        if len(offsets) == 2:
            a, b = offsets
            differ = jnp.any(a.array != b.array)
            offset = hax.named(
                eqx.error_if(a.array, differ, "Mismatched causal offsets cannot be combined with &"), a.axes
            )
        return LevanterlessAttentionMask(
            is_causal=self.is_causal or other.is_causal,
            causal_offset=offset,
            explicit_mask=_combined(self.explicit_mask, other.explicit_mask, hax.logical_and),
            segment_ids=self._one_segment_ids(other),
            sliding_window=_narrower(self.sliding_window, other.sliding_window),
            bidirectional_window=_narrower(self.bidirectional_window, other.bidirectional_window),
        )

    def __or__(self, other) -> LevanterlessAttentionMask:
        same_offset = (self.causal_offset is None and other.causal_offset is None) or (
            self.causal_offset is not None and self.causal_offset == other.causal_offset
        )
        causal = self.is_causal and other.is_causal and bool(same_offset)
        return LevanterlessAttentionMask(
            is_causal=causal,
            causal_offset=self.causal_offset if causal else None,
            explicit_mask=_combined(self.explicit_mask, other.explicit_mask, hax.logical_or),
            segment_ids=self._one_segment_ids(other),
            sliding_window=_wider(self.sliding_window, other.sliding_window),
            bidirectional_window=_wider(self.bidirectional_window, other.bidirectional_window),
        )

    def materialize(self, QPos: hax.Axis, KPos: hax.Axis) -> NamedArray | None:
        """The whole boolean mask over `QPos` and `KPos` (and the arrays' other axes)."""
        return materialize(self, QPos, KPos)


def _combined(a, b, op):
    return a if b is None else b if a is None else op(a, b)


def _concrete_offset(offset) -> int | None:
    """The causal offset as an int, or None when it is traced or has axes (a per-example offset)."""
    if offset is None:
        return 0
    value = offset.array if isinstance(offset, NamedArray) else offset
    if getattr(value, "ndim", 0) or isinstance(value, jax.core.Tracer):
        return None
    return int(value)


def _distance(QPos: hax.Axis, KPos: hax.Axis) -> NamedArray:
    """`k - q` over `(QPos, KPos)`."""
    return hax.arange(KPos).broadcast_axis(QPos) - hax.arange(QPos).broadcast_axis(KPos)


def _segments(segment_ids, QPos: hax.Axis, KPos: hax.Axis) -> masks.Segments:
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    if kv_ids.has_axis(QPos.name) and not kv_ids.has_axis(KPos.name):
        kv_ids = kv_ids.rename({QPos.name: KPos.name})
    return masks.Segments(q_ids, kv_ids)


def to_axkern_mask(mask, QPos: hax.Axis, KPos: hax.Axis) -> masks.Mask | None:
    """A Levanter mask (its `AttentionMask` or this module's, a bool `NamedArray`, `None`) as an
    axkern mask: a causal mask with a concrete offset, the sliding window and segment ids stay
    structured (the tiles they hide are skipped); a traced or per-example offset, the explicit
    mask and the bidirectional window are dense."""
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
        offset = _concrete_offset(mask.causal_offset)
        if offset is not None:
            parts.append(masks.Causal(offset=offset))
        else:
            parts.append(masks.Dense(_distance(QPos, KPos) <= mask.causal_offset))
    if getattr(mask, "sliding_window", None) is not None:
        parts.append(masks.SlidingWindow(int(mask.sliding_window)))
    if getattr(mask, "bidirectional_window", None) is not None:
        radius = int(mask.bidirectional_window)
        d = _distance(QPos, KPos)
        parts.append(masks.Dense((d <= radius) & (d >= -radius)))
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


def _conjuncts(m: masks.Mask) -> list[masks.Mask]:
    if type(m) is masks.And:
        return _conjuncts(m.a) + _conjuncts(m.b)
    return [m]


def materialize(mask, QPos: hax.Axis, KPos: hax.Axis) -> NamedArray | None:
    """The whole boolean mask of a Levanter mask over `QPos` and `KPos` (and its arrays' axes)."""
    m = to_axkern_mask(mask, QPos, KPos)
    if m is None:
        return None
    out = hax.ones((QPos, KPos), dtype=jnp.bool_)
    for part in _conjuncts(m):
        if isinstance(part, masks.Segments):
            out = out & (part.q_ids.broadcast_axis(KPos) == part.kv_ids.broadcast_axis(QPos))
        elif isinstance(part, masks.Dense):
            out = out & part.array
        else:
            out = out & hax.named(part.dense(QPos.size, KPos.size)[0], (QPos, KPos))
    return out
