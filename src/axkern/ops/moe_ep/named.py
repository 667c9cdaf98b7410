"""`moe_ep_dispatch` and `moe_ep_combine` over named axes: the experts axis on a mesh axis through
haliax's axis mapping, the positional transport run per device under `shard_map`.

Under `hax.axis_mapping({"token": "ep", "experts": "ep"})` (any token axes; more mesh axes, e.g.
`{"batch": ("data", "ep"), "experts": "ep"}`) each device routes its own tokens to the
devices of the mesh axis `ep` that hold their experts, as the positional functions do inside
`shard_map(..., axis_name="ep")`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from haliax import NamedArray
from jax import lax

from axkern.core import compat, named
from axkern.core.mesh import mesh_axes_for

from .api import (
    EpDispatch,
    EpImplementation,
    EpLayout,
    capacity_for,
    moe_ep_combine_positional,
    moe_ep_dispatch_positional,
)

__all__ = ["moe_ep_dispatch", "moe_ep_combine"]

EXPERTS, DISPATCHED, BLOCKS = "experts", "dispatched", "dispatch_blocks"

# Token axes are the batch axes of each table: every axis of `topk_idx` (or the layout's) but TopK.
DISPATCH_ROLES = named.Roles(
    "moe_ep_dispatch",
    {
        "topk_idx": named.Arg(("batch", "TopK"), describe="token axes + TopK"),
        "x": named.Arg(("batch", "Embed"), describe="topk_idx's token axes + Embed"),
    },
)
COMBINE_ROLES = named.Roles(
    "moe_ep_combine",
    {
        "dst": named.Arg(("batch", "TopK"), name="layout.dst"),
        "slot": named.Arg(("batch", "TopK"), name="layout.slot"),
        "sent": named.Arg(("batch", "TopK"), name="layout.sent"),
        "topk_weights": named.Arg(("batch", "TopK"), describe="the layout's token axes + TopK"),
        "order": named.Arg(("Dispatched",), name="layout.order"),
        "expert_y": named.Arg(("Dispatched", "Out"), describe="Dispatched + one output axis"),
    },
)
SHARDING = named.Sharding(
    parallel=("Experts",),
    with_batch=("Dispatched", "Blocks"),
    describe="expert parallel: the token axes split over the experts' mesh axis (and any others); "
    "rows exchanged by all_to_all over the experts' mesh axis; dispatched rows one block per token "
    "shard, counts over (blocks of the other token mesh axes, Experts)",
)


def _expert_mesh_axis(op: str, bound: named.Bound) -> str:
    """The one mesh axis the experts axis is mapped to, with the token axes split over it too."""
    experts = bound.axis("Experts")
    mesh_axes = mesh_axes_for(experts) if compat.current_mesh() is not None else None
    if mesh_axes is None:
        raise ValueError(
            f"{op}: the experts axis {experts.name!r} is mapped to no mesh axis; run under a mesh "
            f"(jax.set_mesh) and hax.axis_mapping({{{experts.name!r}: <mesh axis>, <token axis>: ...}}), "
            "or use axkern.moe_dispatch on one device"
        )
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    if len(mesh_axes) != 1:
        raise ValueError(
            f"{op}: the experts axis {experts.name!r} is mapped to mesh axes {mesh_axes}; map it to one mesh axis"
        )
    if mesh_axes[0] not in bound.batch_mesh():
        raise ValueError(
            f"{op}: the token axes {named.axes_str(bound.batch)} must be split over the experts' mesh "
            f"axis {mesh_axes[0]!r} too (each device routes its own tokens); they are split over "
            f"{bound.batch_mesh() or 'none'}"
        )
    return mesh_axes[0]


def moe_ep_dispatch(
    x: NamedArray,
    topk_idx: NamedArray,
    *,
    Embed: named.AxisSelector = "embed",
    TopK: named.AxisSelector = "topk",
    Experts: named.AxisSelector = EXPERTS,
    Dispatched: named.AxisSelector = DISPATCHED,
    num_experts: int,
    capacity_factor: float | None = None,
    implementation: EpImplementation | tuple[EpImplementation, ...] | None = None,
    block_sizes: None = None,
) -> EpDispatch:
    """Named `moe_ep_dispatch`: send each routed pair's row of `x` to the device holding its expert.

    `topk_idx`: token axes (every axis but `TopK`) + `TopK`; `x`: the same token axes + `Embed`.
    The experts axis (`Experts`, size `num_experts`) must be mapped to one mesh axis by the
    current haliax axis mapping, and the token axes split over that mesh axis (and any others).
    With `R` devices on it and `T` tokens per device, each device receives `R·C` rows (`C` as
    in `axkern.positional.moe_ep_dispatch`).

    **Returns:** `EpDispatch(expert_x, group_sizes, layout)`: `expert_x` over
    `(Dispatched, Embed)`, one block of `R·C` rows per device (grouped by its local experts,
    empty slots last); `group_sizes` over `("dispatch_blocks", Experts)`, the rows per expert
    of each block, split like `Experts` and over the token mesh axes other than the experts'
    (size 1 when there are none). Run the experts per device under `shard_map`, with the
    `PartitionSpec`s of `layout.expert_specs()`:
    `jax.lax.ragged_dot(expert_x, w_local, group_sizes[0])` (examples/ep_moe.py does).
    `layout.dropped` counts the dropped pairs of every device.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, numpy as np, axkern
    >>> Token, TopK, Embed = hax.Axis("token", 4), hax.Axis("topk", 2), hax.Axis("embed", 3)
    >>> topk_idx = hax.named(jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]]), (Token, TopK))
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ep",))
    >>> dispatch = jax.jit(lambda x, idx: axkern.moe_ep_dispatch(x, idx, num_experts=4))
    >>> with jax.set_mesh(mesh), hax.axis_mapping({"token": "ep", "experts": "ep"}):
    ...     expert_x, group_sizes, layout = dispatch(hax.ones((Token, Embed)), topk_idx)
    >>> expert_x.axes[0], group_sizes.array.tolist()
    (Axis(name='dispatched', size=8), [[2, 2, 2, 2]])

    ```
    """
    op = "moe_ep_dispatch"
    bound = DISPATCH_ROLES.bind({"topk_idx": topk_idx, "x": x}, TopK=TopK, Embed=Embed)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    bound.create("Experts", Experts, num_experts)
    axis_name = _expert_mesh_axis(op, bound)
    mesh = compat.current_mesh()
    ranks = compat.axis_size(mesh, axis_name)
    if num_experts % ranks:
        raise ValueError(
            f"{op}: num_experts={num_experts} must be a positive multiple of the {ranks} devices of "
            f"mesh axis {axis_name!r}"
        )
    shards = compat.axis_size(mesh, bound.batch_mesh())
    tokens = math.prod(a.size for a in bound.batch)
    if tokens % shards:
        raise ValueError(
            f"{op}: the {tokens} tokens {named.axes_str(bound.batch)} do not split over the "
            f"{shards} devices of mesh axes {bound.batch_mesh()}"
        )
    capacity = capacity_for(tokens // shards, bound.axis("TopK").size, ranks, capacity_factor)
    bound.create("Dispatched", Dispatched, shards * ranks * capacity)
    blocks_mesh = bound.blocks_mesh(SHARDING, ("Experts",))
    bound.create("Blocks", BLOCKS, compat.axis_size(mesh, blocks_mesh))

    def body(ctx, idx, xs):
        expert_x, group_sizes, layout = moe_ep_dispatch_positional(
            xs,
            idx,
            num_experts=num_experts,
            axis_name=ctx.mesh_axes("Experts"),
            capacity_factor=capacity_factor,
            implementation=implementation,
            block_sizes=block_sizes,
        )
        dropped = lax.psum(layout.dropped, ctx.batch_mesh)
        return expert_x, group_sizes[None], layout.order, layout.dst, layout.slot, layout.sent, dropped

    pairs = named.Out(("batch", "TopK"))
    outs = (
        named.Out(("Dispatched", "Embed")),
        named.Out(("Blocks", "Experts")),
        named.Out(("Dispatched",)),
        pairs,
        pairs,
        pairs,
        named.Out(()),
    )
    expert_x, group_sizes, order, dst, slot, sent, dropped = bound.run(body, SHARDING, outs)
    layout = EpLayout(
        dst,
        slot,
        sent,
        order,
        dropped.array,
        axis_name,
        ranks,
        capacity,
        bound.axis("Experts"),
        bound.batch_mesh(),
    )
    return EpDispatch(expert_x, group_sizes, layout)


def moe_ep_combine(
    expert_y: NamedArray,
    topk_weights: NamedArray,
    layout: EpLayout,
    *,
    implementation: EpImplementation | tuple[EpImplementation, ...] | None = None,
    block_sizes: None = None,
) -> NamedArray:
    """Named `moe_ep_combine`: bring the expert outputs back to their tokens,
    `y[t] = Σ_k w[t, k] · expert_y[row of (t, k)]` over the pairs that were sent.

    `expert_y`: the layout's `Dispatched` axis + one output axis; `topk_weights`: the layout's
    token axes + `TopK` (any order). Call it under the axis mapping `moe_ep_dispatch` ran
    under. **Returns:** `y` over the token axes (in `topk_weights`' order) and the output axis.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, numpy as np, axkern
    >>> Token, TopK, Embed = hax.Axis("token", 4), hax.Axis("topk", 2), hax.Axis("embed", 3)
    >>> topk_idx = hax.named(jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]]), (Token, TopK))
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ep",))
    >>> def layer(x, topk_idx, topk_weights):  # identity experts
    ...     expert_x, _, layout = axkern.moe_ep_dispatch(x, topk_idx, num_experts=4)
    ...     return axkern.moe_ep_combine(expert_x, topk_weights, layout)
    >>> with jax.set_mesh(mesh), hax.axis_mapping({"token": "ep", "experts": "ep"}):
    ...     y = jax.jit(layer)(hax.ones((Token, Embed)), topk_idx, hax.ones((Token, TopK)) * 0.5)
    >>> y.axes, y.array[0].tolist()
    ((Axis(name='token', size=4), Axis(name='embed', size=3)), [1.0, 1.0, 1.0])

    ```
    """
    op = "moe_ep_combine"
    named.require_named(op, "expert_y", expert_y)
    named.require_named(op, "topk_weights", topk_weights)
    if layout.experts_axis is None:
        raise ValueError(
            f"{op}: this layout came from the positional moe_ep_dispatch; use axkern.positional.moe_ep_combine"
        )
    rows_axis = named.resolve(op, "expert_y", expert_y, layout.order.axes[0], "Dispatched")
    out_axes = [a for a in expert_y.axes if a.name != rows_axis.name]
    if len(out_axes) != 1:
        raise ValueError(
            f"{op}: expert_y must have {rows_axis.name!r} and one output axis; its axes are "
            f"{named.axes_str(expert_y.axes)}"
        )
    table = layout.dst.axes
    if {(a.name, a.size) for a in topk_weights.axes} != {(a.name, a.size) for a in table}:
        raise ValueError(
            f"{op}: topk_weights's axes {named.axes_str(topk_weights.axes)} must be the layout's token "
            f"axes + TopK {named.axes_str(table)} (any order)"
        )
    bound = COMBINE_ROLES.bind(
        {
            "dst": layout.dst,
            "slot": layout.slot,
            "sent": layout.sent,
            "topk_weights": topk_weights,
            "order": layout.order,
            "expert_y": expert_y,
        },
        TopK=table[-1],
        Dispatched=rows_axis,
        Out=out_axes[0],
    )
    bound.create("Experts", layout.experts_axis, layout.experts_axis.size)
    here = mesh_axes_for(layout.experts_axis) if compat.current_mesh() is not None else None
    if here != layout.axis_name or bound.batch_mesh() != layout.batch_mesh:
        raise ValueError(
            f"{op}: the layout was made with the experts on mesh axis {layout.axis_name!r} and the "
            f"tokens over {layout.batch_mesh}; here they are on {here!r} and over "
            f"{bound.batch_mesh() or 'none'}: call moe_ep_combine under the axis mapping moe_ep_dispatch ran under"
        )

    def body(ctx, dst, slot, sent, w, order, ys):
        local = EpLayout(
            dst,
            slot,
            sent,
            order,
            jnp.zeros((), jnp.int32),
            ctx.mesh_axes("Experts"),
            layout.ranks,
            layout.capacity,
        )
        return moe_ep_combine_positional(ys, w, local, implementation=implementation, block_sizes=block_sizes)

    return bound.run(body, SHARDING, named.Out(("batch", "Out"), like="topk_weights"))
