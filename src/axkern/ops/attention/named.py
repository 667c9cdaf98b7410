"""`attention` over haliax named axes: the role table (which axes of `q`, `k`, `v` and the sinks
mean what), the sharding rule, the mask's arrays as inputs, and the named function, which runs
`api.attention_positional` on each shard."""

from __future__ import annotations

import math

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from axkern import masks as masks_
from axkern.core import named
from axkern.core.mesh import mesh_axes_for
from axkern.core.typing import Array

from .api import NAME, AttentionImplementation, attention_positional
from .blocks import AttentionBlockSizes

__all__ = ["attention", "ROLES", "SHARDING", "SHARDING_MQA"]

ROLES = named.Roles(
    NAME,
    {
        "q": named.Arg(("batch", "QPos", "Heads", "HeadDim"), describe="batch axes + QPos + Heads + HeadDim"),
        "k": named.Arg(
            ("batch", "KPos", "KVHeads", "HeadDim"), describe="q's batch axes + KPos + KVHeads + HeadDim"
        ),
        "v": named.Arg(
            ("batch", "KPos", "KVHeads", "VDim"), describe="q's batch axes + KPos + KVHeads + HeadDim"
        ),
        "sinks": named.Arg(("Heads",), optional=True, describe="Heads"),
    },
    fallbacks={"KPos": "QPos", "KVHeads": "Heads"},
)
SHARDING = named.Sharding(
    parallel=("Heads", "KVHeads"),
    together=("Heads", "KVHeads"),
    describe="batch axes data parallel; Heads and KVHeads head parallel (mapped to the same mesh axes; "
    "no communication); positions and head dims gathered",
)
# a single kv head (multi-query) is read by every shard of the query heads
SHARDING_MQA = named.Sharding(parallel=("Heads",), describe=SHARDING.describe)


def _mask_inputs(mask, bound):
    """The mask's arrays as extra inputs of `Bound.run` (canonical order, batch axes unflattened),
    and how to rebuild the mask from their local blocks."""
    leaves, treedef = jax.tree_util.tree_flatten(mask, is_leaf=lambda a: isinstance(a, NamedArray))
    roles = masks_.leaf_roles(mask)
    lead = tuple(a.size for a in bound.batch)
    extra, shared = [], []
    for i, (leaf, leaf_roles) in enumerate(zip(leaves, roles, strict=True)):
        what = f"{type(mask).__name__}'s array {i}"
        if isinstance(leaf, NamedArray):
            want = bound.axes_of(leaf_roles)
            need = {a.name: a.size for a in want}
            pos = [bound.axis(r).name for r in leaf_roles if r != "batch"]
            have = {a.name: a.size for a in leaf.axes}
            if any(need.get(n) != size for n, size in have.items()) or any(p not in have for p in pos):
                raise ValueError(
                    f"{NAME}: {what} has axes {named.axes_str(leaf.axes)}; it must carry "
                    f"{' + '.join(pos)} and a subset of q's batch axes, within {named.axes_str(want)}"
                )
            extra.append((what, hax.broadcast_to(leaf, want).rearrange(want).array, leaf_roles))
            shared.append(False)
            continue
        leaf = jnp.asarray(leaf)
        if leaf.ndim and leaf.shape[0] == 1 and math.prod(lead) != 1:  # shared by every batch row
            extra.append((what, leaf[0], leaf_roles[1:]))
            shared.append(True)
        elif leaf.ndim and leaf.shape[0] == math.prod(lead):
            extra.append((what, jnp.reshape(leaf, lead + leaf.shape[1:]), leaf_roles))
            shared.append(False)
        else:
            raise ValueError(
                f"{NAME}: the mask's arrays must lead with q's batch axes {named.axes_str(bound.batch)} flattened "
                f"({math.prod(lead)} rows) or with 1; {mask!r} has an array of shape {list(jnp.shape(leaf))}"
            )

    def rebuild(local_leaves):
        return treedef.unflatten([x[None] if one else x for x, one in zip(local_leaves, shared, strict=True)])

    return extra, rebuild


def attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    *,
    QPos: named.AxisSelector = "position",
    KPos: named.AxisSelector = "key_position",
    Heads: named.AxisSelector = "heads",
    KVHeads: named.AxisSelector = "kv_heads",
    HeadDim: named.AxisSelector = "head_size",
    mask: masks_.Mask | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: NamedArray | Array | None = None,
    implementation: AttentionImplementation | tuple[AttentionImplementation, ...] | None = None,
    block_sizes: AttentionBlockSizes | dict | None = None,
    return_lse: bool = False,
) -> NamedArray | tuple[NamedArray, NamedArray]:
    """Attention over named axes.

    `q` has batch axes, `QPos`, `Heads` and `HeadDim`; `k` and `v` the same batch axes,
    `KPos` (or `QPos`'s name when `KPos` is absent: self-attention), `KVHeads` (or `Heads`
    when absent) and `HeadDim` (`v`'s may differ in size). Batch axes are every other axis
    of `q`, in any order. `sinks`: over `Heads`.

    `mask=None` attends to every key; causal attention is `mask=axkern.masks.Causal()`.
    Masks that hold arrays (`Segments`, `PrefixLM`, `Dense`) take `NamedArray`s over the batch
    axes (any subset, any order) and `QPos` / `KPos`; plain arrays lead with the batch axes
    flattened in `q`'s order (`Dense` may lead with 1).

    ```python
    out = axkern.attention(q, k, v, mask=axkern.masks.Causal())
    docs = axkern.masks.Segments(doc_ids, doc_ids.rename({"position": "key_position"}))
    out = axkern.attention(q, k, v, mask=axkern.masks.Causal() & docs)
    ```

    Under a haliax axis mapping with a mesh, batch axes and heads run in parallel (`KVHeads`
    mapped like `Heads`, or a single kv head); positions and head dims are gathered.

    **Returns:** the batch axes, `QPos`, `Heads` and `v`'s `HeadDim`, in `q`'s axis order; with
    `return_lse=True`, `(out, lse)`: `lse` over the batch axes, `QPos` and `Heads` (in `q`'s
    order, float32), each query's log-sum-exp of its visible scores (as `attention_positional`'s).

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Batch, Pos, Heads, HeadDim = hax.Axis("batch", 1), hax.Axis("position", 32), hax.Axis("heads", 2), hax.Axis("head_size", 8)
    >>> q = k = v = hax.random.normal(jax.random.PRNGKey(0), (Batch, Pos, Heads, HeadDim))
    >>> axkern.attention(q, k, v, mask=axkern.masks.Causal()).axes == q.axes
    True

    ```
    """
    if sinks is not None and not isinstance(sinks, NamedArray):
        sinks = hax.named(jnp.asarray(sinks), (Heads.name if isinstance(Heads, hax.Axis) else Heads,))
    bound = ROLES.bind(
        {"q": q, "k": k, "v": v, "sinks": sinks},
        QPos=QPos,
        KPos=KPos,
        Heads=Heads,
        KVHeads=KVHeads,
        HeadDim=HeadDim,
        VDim=getattr(HeadDim, "name", HeadDim),  # v's head dim may differ in size
    )
    heads, kvheads = bound.axis("Heads"), bound.axis("KVHeads")
    sharding = SHARDING
    if kvheads.name != heads.name and kvheads.size == 1:
        sharding = SHARDING_MQA
    elif kvheads.name != heads.name and bound.sharded(SHARDING):
        if mesh_axes_for(heads) != mesh_axes_for(kvheads):
            raise ValueError(
                f"{NAME}: {heads.name} is mapped to mesh axes {mesh_axes_for(heads)!r} but "
                f"{kvheads.name} to {mesh_axes_for(kvheads)!r}; map both to the same mesh axes "
                "(each shard's query heads must find their kv heads on it)"
            )
    extra, rebuild = _mask_inputs(masks_.Full() if mask is None else mask, bound)

    def body(ctx, qs, ks, vs, ss, *mask_leaves):
        return attention_positional(
            qs,
            ks,
            vs,
            mask=rebuild(mask_leaves),
            sinks=ss,
            scale=scale,
            logits_soft_cap=logits_soft_cap,
            implementation=implementation,
            block_sizes=block_sizes,
            return_lse=return_lse,
        )

    out = named.Out(("batch", "QPos", "Heads", "VDim"), like="q", swap={"HeadDim": "VDim"})
    if return_lse:
        return bound.run(body, sharding, (out, named.Out(("batch", "QPos", "Heads"), like="q")), extra=extra)
    return bound.run(body, sharding, out, extra=extra)
