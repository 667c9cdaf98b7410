"""`moe_layout`, `moe_dispatch` and `moe_combine` over named axes: their role tables bound to the
caller's token axes, token parallel under a haliax axis mapping."""

from __future__ import annotations

import math

import haliax as hax
import jax
from haliax import NamedArray

from axkern.core import compat, named

from .api import (
    MoeDispatch,
    MoeImplementation,
    MoeLayout,
    MoeRouting,
    moe_combine_positional,
    moe_dispatch_positional,
    moe_layout_positional,
)

__all__ = ["moe_layout", "moe_dispatch", "moe_combine"]

EXPERTS, RANKS, DISPATCHED = "experts", "ranks", "dispatched"

# Token axes are the batch axes of each table: every axis of `topk_idx` (or `topk_weights`) but TopK.
LAYOUT_ROLES = named.Roles(
    "moe_layout", {"topk_idx": named.Arg(("batch", "TopK"), describe="token axes + TopK")}
)
DISPATCH_ROLES = named.Roles(
    "moe_dispatch",
    {
        "topk_idx": named.Arg(("batch", "TopK"), describe="token axes + TopK"),
        "x": named.Arg(("batch", "Embed"), describe="topk_idx's token axes + Embed"),
    },
)
COMBINE_ROLES = named.Roles(
    "moe_combine",
    {
        # the routing first: its token axes' order fixed the dispatched blocks' order
        "rows": named.Arg(("batch", "TopK")),
        "topk_idx": named.Arg(("batch", "TopK")),
        "topk_weights": named.Arg(("batch", "TopK"), describe="the routing's token axes + TopK"),
        "expert_y": named.Arg(("Dispatched", "Out"), describe="Dispatched + one output axis"),
    },
)
SHARDING = named.Sharding(
    with_batch=("Dispatched", "Blocks"),
    describe="token parallel: each shard routes its own tokens (its block of the dispatched rows is "
    "expert-major on its own; per-shard counts psummed); no other communication",
)


def _psum_over(ctx, value):
    return jax.lax.psum(value, ctx.batch_mesh) if ctx.batch_mesh else value


def moe_layout(
    topk_idx: NamedArray,
    *,
    TopK: named.AxisSelector = "topk",
    Experts: named.AxisSelector = EXPERTS,
    Ranks: named.AxisSelector = RANKS,
    num_experts: int,
    num_ranks: int = 1,
    implementation: MoeImplementation | tuple[MoeImplementation, ...] | None = None,
    block_sizes: None = None,
) -> MoeLayout:
    """Named `moe_layout`: per-expert and per-rank counts over axes `Experts` and `Ranks`,
    `is_token_in_rank` over the token axes (every axis of `topk_idx` but `TopK`) and `Ranks`.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Token, TopK = hax.Axis("token", 4), hax.Axis("topk", 2)
    >>> topk_idx = hax.named(jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]]), (Token, TopK))
    >>> axkern.moe_layout(topk_idx, num_experts=4).tokens_per_expert.array.tolist()
    [2, 2, 2, 2]

    ```
    """
    bound = LAYOUT_ROLES.bind({"topk_idx": topk_idx}, TopK=TopK)
    bound.create("Experts", Experts, num_experts)
    bound.create("Ranks", Ranks, num_ranks)

    def body(ctx, idx):
        out = moe_layout_positional(
            idx,
            num_experts=num_experts,
            num_ranks=num_ranks,
            implementation=implementation,
            block_sizes=block_sizes,
        )
        return (
            _psum_over(ctx, out.tokens_per_expert),
            _psum_over(ctx, out.tokens_per_rank),
            out.is_token_in_rank,
            _psum_over(ctx, out.dropped),
        )

    outs = (
        named.Out(("Experts",)),
        named.Out(("Ranks",)),
        named.Out(("batch", "Ranks"), like="topk_idx"),
        named.Out(()),
    )
    per_expert, per_rank, in_rank, dropped = bound.run(body, SHARDING, outs)
    return MoeLayout(per_expert, per_rank, in_rank, dropped.array)


def moe_dispatch(
    x: NamedArray,
    topk_idx: NamedArray,
    *,
    Embed: named.AxisSelector = "embed",
    TopK: named.AxisSelector = "topk",
    Dispatched: named.AxisSelector = DISPATCHED,
    Experts: named.AxisSelector = EXPERTS,
    num_experts: int,
    implementation: MoeImplementation | tuple[MoeImplementation, ...] | None = None,
    block_sizes: None = None,
) -> MoeDispatch:
    """Named `moe_dispatch`. `topk_idx`: token axes (every axis but `TopK`, e.g. `batch` and
    `position`) + `TopK`; `x`: the same token axes + `Embed`.

    **Returns:** `MoeDispatch(expert_x over (Dispatched, Embed), group_sizes over Experts, routing)`.
    Under a haliax axis mapping that splits the token axes, each shard dispatches its own
    tokens: `expert_x`'s `Dispatched` axis is split the same way, each block expert-major on
    its own, and `group_sizes` gains a leading axis `"dispatch_blocks"` (one row of counts
    per block): run `ragged_dot` per block, under `shard_map`.

    ```python
    expert_x, group_sizes, routing = axkern.moe_dispatch(x, topk_idx, num_experts=8)
    ```

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Token, TopK, Embed = hax.Axis("token", 4), hax.Axis("topk", 2), hax.Axis("embed", 3)
    >>> topk_idx = hax.named(jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]]), (Token, TopK))
    >>> expert_x, group_sizes, routing = axkern.moe_dispatch(hax.ones((Token, Embed)), topk_idx, num_experts=4)
    >>> expert_x.axes, group_sizes.array.tolist()
    ((Axis(name='dispatched', size=8), Axis(name='embed', size=3)), [2, 2, 2, 2])

    ```
    """
    bound = DISPATCH_ROLES.bind({"topk_idx": topk_idx, "x": x}, TopK=TopK, Embed=Embed)
    tokens = math.prod(a.size for a in bound.batch)
    dispatched = bound.create("Dispatched", Dispatched, tokens * bound.axis("TopK").size)
    bound.create("Experts", Experts, num_experts)
    sharded = bound.sharded(SHARDING)
    if sharded:
        blocks = compat.axis_size(compat.current_mesh(), bound.batch_mesh()) if bound.batch_mesh() else 1
        bound.create("Blocks", "dispatch_blocks", blocks)

    def body(ctx, idx, xs):
        expert_x, group_sizes, routing = moe_dispatch_positional(
            xs, idx, num_experts=num_experts, implementation=implementation, block_sizes=block_sizes
        )
        if sharded:
            group_sizes = group_sizes[None]
        return expert_x, group_sizes, routing.rows.reshape(idx.shape), idx

    groups = named.Out(("Blocks", "Experts") if sharded else ("Experts",))
    outs = (
        named.Out(("Dispatched", "Embed")),
        groups,
        named.Out(("batch", "TopK")),
        named.Out(("batch", "TopK")),
    )
    expert_x, group_sizes, rows, idx = bound.run(body, SHARDING, outs)
    blocks_mesh = bound.batch_mesh() if sharded else ()
    routing = MoeRouting(
        rows.array, idx.array, num_experts, tuple(bound.batch), bound.axis("TopK"), dispatched, blocks_mesh
    )
    return MoeDispatch(expert_x, group_sizes, routing)


def moe_combine(
    expert_y: NamedArray,
    topk_weights: NamedArray,
    routing: MoeRouting,
    *,
    implementation: MoeImplementation | tuple[MoeImplementation, ...] | None = None,
    block_sizes: None = None,
) -> NamedArray:
    """Named `moe_combine`: `expert_y` over the routing's `Dispatched` axis and one output axis,
    `topk_weights` over the routing's token axes and `TopK` (any order); returns `y` over the
    token axes (in `topk_weights`' order) and the output axis.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Token, TopK, Embed = hax.Axis("token", 4), hax.Axis("topk", 2), hax.Axis("embed", 3)
    >>> topk_idx = hax.named(jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]]), (Token, TopK))
    >>> expert_x, group_sizes, routing = axkern.moe_dispatch(hax.ones((Token, Embed)), topk_idx, num_experts=4)
    >>> y = axkern.moe_combine(expert_x, hax.ones((Token, TopK)) * 0.5, routing)  # identity experts
    >>> y.axes, y.array[0].tolist()
    ((Axis(name='token', size=4), Axis(name='embed', size=3)), [1.0, 1.0, 1.0])

    ```
    """
    named.require_named("moe_combine", "expert_y", expert_y)
    if routing.token_axes is None:
        raise ValueError(
            "moe_combine: this routing came from the positional moe_dispatch; use moe_combine_positional"
        )
    rows_axis = named.resolve("moe_combine", "expert_y", expert_y, routing.dispatched_axis, "Dispatched")
    out_axes = [a for a in expert_y.axes if a.name != rows_axis.name]
    if len(out_axes) != 1:
        raise ValueError(
            f"moe_combine: expert_y must have {rows_axis.name!r} and one output axis; its axes are "
            f"{named.axes_str(expert_y.axes)}"
        )
    table = (*routing.token_axes, routing.topk_axis)
    named.require_named("moe_combine", "topk_weights", topk_weights)
    if {(a.name, a.size) for a in topk_weights.axes} != {(a.name, a.size) for a in table}:
        raise ValueError(
            f"moe_combine: topk_weights's axes {named.axes_str(topk_weights.axes)} must be the routing's "
            f"token axes + TopK {named.axes_str(table)} (any order)"
        )
    bound = COMBINE_ROLES.bind(
        {
            "rows": hax.named(routing.rows, table),
            "topk_idx": hax.named(routing.topk_idx, table),
            "topk_weights": topk_weights,
            "expert_y": expert_y,
        },
        TopK=routing.topk_axis,
        Dispatched=rows_axis,
        Out=out_axes[0],
    )

    here = bound.batch_mesh() if bound.sharded(SHARDING) else ()
    if here != routing.blocks_mesh:
        raise ValueError(
            f"moe_combine: the routing's rows index one block per token shard over mesh axes "
            f"{routing.blocks_mesh or 'none'}, but here the token axes are split over {here or 'none'}; "
            "call moe_combine under the axis mapping moe_dispatch ran under"
        )

    def body(ctx, rows, idx, w, ys):
        local = MoeRouting(rows.reshape(-1), idx, routing.num_experts)
        return moe_combine_positional(ys, w, local, implementation=implementation, block_sizes=block_sizes)

    return bound.run(body, SHARDING, named.Out(("batch", "Out"), like="topk_weights"))
