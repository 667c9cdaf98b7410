"""Drop-in replacements for haliax functions, backed by axkern's kernels.

```python
# from haliax.nn.attention import dot_product_attention
from axkern.haliax_compat import dot_product_attention
```
"""

from __future__ import annotations

import warnings

import haliax as hax
import haliax.nn.attention as hattn
import jax
import jax.numpy as jnp
from haliax import NamedArray

from . import masks
from .core import caller
from .core.op import FallbackWarning
from .ops.attention import attention

__all__ = ["dot_product_attention"]

_HEAD = "__axkern_head"  # a size-1 heads axis: haliax's heads are batch-like axes here


def dot_product_attention(
    KPos,
    Key,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: NamedArray | masks.Mask | None = None,
    bias: NamedArray | None = None,
    attention_dtype=None,
    precision=None,
    *,
    implementation=None,
    block_sizes=None,
) -> NamedArray:
    """`haliax.nn.attention.dot_product_attention`'s signature and result (same axes, same order),
    computed by `axkern.attention`.

    The query's one axis that `key` lacks is its position axis; every axis shared by `query`
    and `key` other than `Key` (batch, heads) runs in parallel. `mask` (bool, broadcastable to
    those axes, the query position and `KPos`) becomes an `axkern.masks.Dense` mask; an
    `axkern.masks` mask (`Causal()`, `SlidingWindow(n)`, `Segments(...)`, combined with `&` and
    `|`) is used as it is, so the tiles it hides are skipped. `value` carries `Key` or one head
    axis of its own (any size), which the result carries.

    Differences: a query whose keys are all masked gets zeros here, where haliax spreads its
    attention evenly over the masked keys. Calls this cannot serve as haliax defines them — a
    `bias`, an `attention_dtype` or `precision`, several `KPos` axes, a query with more than
    one axis missing from `key`, a value with several — run haliax's own function, with an `axkern.FallbackWarning`
    that says why (an axkern mask cannot go to haliax: such a call raises `ValueError`).

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> from axkern.haliax_compat import dot_product_attention
    >>> Pos, KPos, Key = hax.Axis("position", 16), hax.Axis("key_position", 16), hax.Axis("head_size", 8)
    >>> q = hax.random.normal(jax.random.PRNGKey(0), (Pos, Key))
    >>> k = v = hax.random.normal(jax.random.PRNGKey(1), (KPos, Key))
    >>> dot_product_attention("key_position", "head_size", q, k, v).axes == q.axes
    True

    ```
    """
    axk_given = isinstance(mask, masks.Mask)

    def haliax_call(reason=None):
        if reason is not None:
            if axk_given:
                raise ValueError(
                    f"axkern.haliax_compat.dot_product_attention: {reason}, which axkern cannot serve, and "
                    f"haliax cannot take the axkern mask {mask!r}; pass a bool NamedArray mask instead"
                )
            warnings.warn(
                f"axkern.haliax_compat.dot_product_attention: {reason}; running "
                "haliax.nn.attention.dot_product_attention instead",
                FallbackWarning,
                stacklevel=caller.stacklevel(),
            )
        return hattn.dot_product_attention(
            KPos, Key, query, key, value, mask, bias, attention_dtype, precision
        )

    kpos_spec = KPos if isinstance(KPos, (str, hax.Axis)) else None
    given = [
        n
        for n, a in (("bias", bias), ("attention_dtype", attention_dtype), ("precision", precision))
        if a is not None
    ]
    if given:
        return haliax_call(f"{', '.join(given)} given")
    if kpos_spec is None:
        return haliax_call(f"KPos={KPos!r} names several axes")
    kpos = key.resolve_axis(kpos_spec.name if isinstance(kpos_spec, hax.Axis) else kpos_spec)
    key_name = Key.name if isinstance(Key, hax.Axis) else Key
    if query.has_axis(kpos.name):
        raise ValueError(
            f"Axis {kpos.name} in KPos is also in query. Attended-to axes must be distinct from query axis"
        )
    k_names = {a.name for a in key.axes}
    q_only = [a for a in query.axes if a.name not in k_names]
    if len(q_only) != 1:
        return haliax_call(
            f"the query has {len(q_only)} axes that key lacks ({[a.name for a in q_only]}), not one"
        )
    (qpos,) = q_only
    out_axes = tuple(a.name for a in query.axes if a.name != key_name)
    out_axes += tuple(a.name for a in value.axes if a.name not in set(out_axes) | {kpos.name})
    if not axk_given:
        out_axes = tuple(a.name for a in jax.eval_shape(haliax_call).axes)  # the axes haliax would return
    # value's head axis, when it is not the key's: renamed to it for axkern's attention and back
    v_head = None
    if not value.has_axis(key_name):
        v_only = [a.name for a in value.axes if a.name not in k_names]
        if len(v_only) != 1:
            return haliax_call(f"value has {len(v_only)} axes that key lacks ({v_only}) and not {key_name!r}")
        (v_head,) = v_only
        value = value.rename({v_head: key_name})
    one = hax.Axis(_HEAD, 1)
    add_head = lambda a: hax.broadcast_axis(a, one)  # noqa: E731
    axk_mask = mask if axk_given else None
    if mask is not None and not axk_given:
        batch = [a for a in query.axes if a.name not in (qpos.name, key_name)]
        mask_batch = [a for a in batch if mask.has_axis(a.name)]
        lead = batch if mask_batch else []
        arr = hax.broadcast_to(mask, (*lead, qpos, kpos)).rearrange((*lead, qpos, kpos)).array
        arr = arr.reshape(-1, qpos.size, kpos.size) if lead else arr[None]
        axk_mask = masks.Dense(arr.astype(jnp.bool_))
    out = attention(
        add_head(query),
        add_head(key),
        add_head(value),
        QPos=qpos,
        KPos=kpos,
        Heads=_HEAD,
        KVHeads=_HEAD,
        HeadDim=key_name,
        mask=axk_mask if axk_mask is not None else masks.Full(),
        implementation=implementation,
        block_sizes=block_sizes,
    )
    out = out[_HEAD, 0]
    if v_head is not None:
        out = out.rename({key_name: v_head})
    return out.rearrange(out_axes)
