"""Levanter's `dot_product_attention`, computed by `axkern.attention` with axkern's structured masks."""

from __future__ import annotations

import math
from typing import Any

import haliax as hax
import jax
from haliax import NamedArray

from ..ops.attention import attention
from .mask import to_axkern_mask

_DPA = "axkern.levanter.dot_product_attention"


def _backend_name(attn_backend) -> str | None:
    if attn_backend is None:
        return None
    return str(getattr(attn_backend, "value", attn_backend)).lower()


def backend_implementation(use_flash, attn_backend, flash_block_size, q_len: int, k_len: int):
    """Levanter's choice of backend from `use_flash`, `attn_backend` and `flash_block_size`, as
    axkern's `implementation`: `"reference"` for `vanilla`, `"pallas_tpu"` for a requested `splash`
    on a TPU, None (the dispatcher's order) for the default and `jax_flash`, and for a requested
    `nvte` on a GPU. Raises where Levanter raises: conflicting `use_flash` and `attn_backend`
    (`ValueError`, Levanter's words), a requested `splash` off a TPU or `nvte` off a GPU
    (`NotImplementedError`)."""
    backend = _backend_name(attn_backend)
    if use_flash is not None:
        if backend is None:
            backend = "default" if use_flash else "vanilla"
        elif backend != "vanilla" and not use_flash:
            raise ValueError("use_flash is False, but flash_backend is not VANILLA")
        elif backend == "vanilla" and use_flash:
            raise ValueError("use_flash is True, but flash_backend is VANILLA")
    elif backend is None and flash_block_size is not None:
        if q_len % flash_block_size or k_len % flash_block_size:
            backend = "vanilla"
    platform = jax.default_backend()
    if backend == "vanilla":
        return "reference"
    if backend == "splash":
        if platform != "tpu":
            raise NotImplementedError(
                f"{_DPA}: attn_backend=splash needs a TPU (this is {platform}); Levanter raises here too"
            )
        return "pallas_tpu"
    if backend == "nvte" and platform != "gpu":
        raise NotImplementedError(
            f"{_DPA}: attn_backend=nvte needs an NVIDIA GPU (this is {platform}); Levanter raises here too"
        )
    return None  # default, jax_flash, nvte on a GPU, and names Levanter runs as jax_flash


def _value_head_axis(key: NamedArray, value: NamedArray, Key: hax.Axis) -> hax.Axis:
    """`value`'s head axis: `Key` when `value` has it, else its one axis that `key` lacks."""
    if value.has_axis(Key.name):
        return value.resolve_axis(Key.name)
    k_names = {a.name for a in key.axes}
    own = [a for a in value.axes if a.name not in k_names]
    if len(own) != 1:
        raise ValueError(
            f"{_DPA}: value must carry Key ({Key.name!r}) or exactly one axis that key lacks (its head "
            f"axis); value has {[a.name for a in value.axes]}, key {sorted(k_names)}"
        )
    return own[0]


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

    `query` carries `QPos`, `Key` and any other axes; `key` carries `KPos` (a name different
    from `QPos`'s) and `Key`; `value` carries `KPos` and `Key` or a head axis of its own (of any
    size, e.g. `v_size`). Axes that `query` and `key` share are batch axes, except those the sink
    carries (kv heads); axes only `query` has are query heads that share each kv head
    (grouped-query attention). `mask`: Levanter's `AttentionMask`, a bool `NamedArray` or an
    `axkern.masks` mask.

    **Returns:** `query`'s axes without `Key`, then `value`'s head axis.

    `use_flash`, `attn_backend` and `flash_block_size` choose as Levanter does
    (`backend_implementation`): `vanilla` runs `reference`, a requested `splash` `pallas_tpu`,
    the rest the dispatcher's order; conflicting `use_flash` and `attn_backend` raise
    `ValueError`, `splash` off a TPU and `nvte` off a GPU `NotImplementedError`. Refused
    (`ValueError`): a `bias`, dropout during training, several `KPos` axes. `precision` and
    `prng` are accepted.

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
    QPos = query.resolve_axis(hax.axis_name(QPos))
    KPos = key.resolve_axis(hax.axis_name(KPos))
    Key = query.resolve_axis(hax.axis_name(Key))
    implementation = backend_implementation(use_flash, attn_backend, flash_block_size, QPos.size, KPos.size)
    if bias is not None:
        raise ValueError(
            f"{_DPA}: bias must be None (axkern's attention takes no additive bias); got {bias.axes}"
        )
    if dropout and not inference:
        raise ValueError(f"{_DPA}: dropout must be 0 in training (inference=False); got dropout={dropout}")
    vdim = _value_head_axis(key, value, Key)
    k_names = {a.name for a in key.axes}
    sink_names = set() if attn_sink is None else {a.name for a in attn_sink.axes}
    shared = [a for a in query.axes if a.name in k_names and a.name != Key.name]
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
    VDim = Key.resize(vdim.size)  # axkern's attention names v's head axis as q's and k's

    def heads(arr, pos, head_axes, head_axis, dim, as_dim):
        data = arr.rearrange((*batch, pos, *head_axes, dim)).array
        return hax.named(
            data.reshape(data.shape[: len(batch) + 1] + (head_axis.size, dim.size)),
            (*batch, pos, head_axis, as_dim),
        )

    q = heads(query, QPos, kv_heads + q_heads, H, Key, Key)
    k = heads(key, KPos, kv_heads, KVH, Key, Key)
    v = heads(value, KPos, kv_heads, KVH, vdim, VDim)
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
        implementation=implementation,
    )
    data = out.rearrange((*batch, QPos, H, Key.name)).array
    data = data.reshape(
        data.shape[: len(batch) + 1] + tuple(a.size for a in kv_heads + q_heads) + (vdim.size,)
    )
    result = hax.named(data, (*batch, QPos, *kv_heads, *q_heads, vdim)).astype(dtype)
    return result.rearrange(out_axes)
