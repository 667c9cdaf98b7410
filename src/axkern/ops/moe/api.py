"""MoE routing ops: `moe_layout`, `moe_dispatch`, `moe_combine` (DeepEP-style), named and positional.

Pairs `(token t, slot k)` of `topk_idx: [tokens, topk]` go to expert `topk_idx[t, k]`.
`moe_dispatch` copies rows of `x` into expert-major order (experts contiguous, stable by
token), ready for `jax.lax.ragged_dot` with `group_sizes`; `moe_combine` weights and sums
each token's expert outputs back in token order. An expert id outside `[0, num_experts)`
is a *dropped* pair: a `ValueError` when the ids are concrete, otherwise (traced) its row is
zero, it is not routed, and `MoeLayout.dropped` counts it.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from axkern.core import compat, named
from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Float, Shaped, checked

from . import cuda, reference, xla

__all__ = [
    "MoeLayout",
    "MoeRouting",
    "MoeDispatch",
    "moe_layout",
    "moe_dispatch",
    "moe_combine",
    "moe_layout_positional",
    "moe_dispatch_positional",
    "moe_combine_positional",
]

# GPU: the CUDA kernels (faster than xla: docs/ops/moe.md, "Performance"); xla wherever they
# cannot serve (no nvcc, top-k > 16, ...)
_ORDER = {"cpu": ("xla",), "gpu": ("cuda", "xla"), "tpu": ("xla",)}
_BUCKET = lambda spec: dict(spec.dims)  # noqa: E731 - no tuned tables yet

LAYOUT = Op(
    "moe_layout",
    [
        Implementation("xla", xla.layout, backward="none (integer outputs)"),
        Implementation(
            "cuda", cuda.layout, platforms=("gpu",), supports=cuda.layout_supports, backward="none"
        ),
        Implementation("reference", reference.layout, backward="none (integer outputs)"),
    ],
    _ORDER,
    package=__package__,
    bucket=_BUCKET,
)
DISPATCH = Op(
    "moe_dispatch",
    [
        Implementation("xla", xla.dispatch, backward="custom_vjp: gather back and sum over top-k"),
        Implementation(
            "cuda",
            cuda.dispatch,
            platforms=("gpu",),
            supports=cuda.supports,
            backward="custom_vjp: the CUDA gather-sum kernel",
        ),
        Implementation("reference", reference.dispatch, backward="autodiff (scatter)"),
    ],
    _ORDER,
    package=__package__,
    bucket=_BUCKET,
)
COMBINE = Op(
    "moe_combine",
    [
        Implementation("xla", xla.combine, backward="custom_vjp: dispatch-like gather + weight grads"),
        Implementation(
            "cuda",
            cuda.combine,
            platforms=("gpu",),
            supports=cuda.supports,
            backward="custom_vjp: the CUDA row-gather kernel, weight grads in XLA",
        ),
        Implementation("reference", reference.combine, backward="autodiff (scatter)"),
    ],
    _ORDER,
    package=__package__,
    bucket=_BUCKET,
)


class MoeLayout(eqx.Module):
    """Counts for a routing: `tokens_per_expert [experts]` (pairs), `tokens_per_rank [ranks]`
    (tokens with at least one expert there), `is_token_in_rank [tokens, ranks]`, `dropped`
    (pairs whose expert id is out of range)."""

    tokens_per_expert: Array | NamedArray
    tokens_per_rank: Array | NamedArray
    is_token_in_rank: Array | NamedArray
    dropped: Array


class MoeRouting(eqx.Module):
    """What `moe_combine` needs to undo a dispatch: each pair's row in the dispatched array.

    From the named `moe_dispatch`, `rows` and `topk_idx` are laid out over the token axes and
    `TopK` (`token_axes`, `topk_axis`), and `dispatched_axis` names the dispatched rows; under
    token parallelism each shard's `rows` index its own block of the dispatched rows.
    """

    rows: Array
    topk_idx: Array
    num_experts: int = eqx.field(static=True)
    token_axes: tuple[hax.Axis, ...] | None = eqx.field(static=True, default=None)
    topk_axis: hax.Axis | None = eqx.field(static=True, default=None)
    dispatched_axis: hax.Axis | None = eqx.field(static=True, default=None)
    blocks_mesh: tuple[str, ...] = eqx.field(static=True, default=())  # the token shards' mesh axes


class MoeDispatch(NamedTuple):
    """`moe_dispatch`'s results: the rows in expert-major order, the rows per expert (for
    `jax.lax.ragged_dot`), and the routing that `moe_combine` takes."""

    expert_x: Array | NamedArray
    group_sizes: Array | NamedArray
    routing: MoeRouting


MoeImplementation = Literal["cuda", "xla", "reference"]


def _check(op: str, topk_idx, num_experts: int, num_ranks: int = 1):
    """`topk_idx` as at least 32-bit ids (an int8 table may route to 200 experts), after checking
    the dtype, `num_experts`, `num_ranks` and, when concrete, the ids."""
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(f"{op}: topk_idx must have an integer dtype, got {topk_idx.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"{op}: num_ranks must be a positive int, got {num_ranks!r}")
    if num_experts % num_ranks:
        raise ValueError(f"{op}: num_experts={num_experts} is not divisible by num_ranks={num_ranks}")
    if not isinstance(topk_idx, jax.core.Tracer):  # concrete ids: check them now
        ids = np.asarray(topk_idx)
        bad = (ids < 0) | (ids >= num_experts)
        if bad.any():
            t, k = np.argwhere(bad)[0]
            raise ValueError(
                f"{op}: topk_idx[{t}, {k}] = {ids[t, k]} is outside [0, {num_experts}) "
                f"({int(bad.sum())} such entries); traced ids are dropped and counted instead"
            )
    return topk_idx.astype(jnp.int32) if jnp.iinfo(topk_idx.dtype).bits < 32 else topk_idx


def _check_features(op: str, **sizes: int) -> None:
    for axis, n in sizes.items():
        if n == 0:
            raise ValueError(f"{op}: {axis} must be at least 1, got 0")


@checked
def moe_layout_positional(
    topk_idx: Shaped[Array, "tokens topk"],
    *,
    num_experts: int,
    num_ranks: int = 1,
    implementation: MoeImplementation | tuple[MoeImplementation, ...] | None = None,
    block_sizes: None = None,
) -> MoeLayout:
    """Per-expert and per-rank counts of a top-k routing (DeepEP's `get_dispatch_layout`).

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> layout = axkern.positional.moe_layout(jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]]), num_experts=4, num_ranks=2)
    >>> layout.tokens_per_expert.tolist(), layout.tokens_per_rank.tolist()
    ([2, 2, 2, 2], [3, 3])

    ```
    """
    topk_idx = _check("moe_layout", topk_idx, num_experts, num_ranks)
    tokens, topk = topk_idx.shape
    if tokens * topk == 0:  # no pair: nothing counted
        zeros = jnp.zeros((num_experts,), jnp.int32), jnp.zeros((num_ranks,), jnp.int32)
        return MoeLayout(*zeros, jnp.zeros((tokens, num_ranks), bool), jnp.zeros((), jnp.int32))
    spec = LAYOUT.spec(
        {"tokens": tokens, "topk": topk, "experts": num_experts, "ranks": num_ranks}, jnp.int32
    )
    return MoeLayout(
        *LAYOUT(
            spec,
            topk_idx,
            implementation=implementation,
            block_sizes=block_sizes,
            num_experts=num_experts,
            num_ranks=num_ranks,
        )
    )


@checked
def moe_dispatch_positional(
    x: Float[Array, "tokens embed"],
    topk_idx: Shaped[Array, "tokens topk"],
    *,
    num_experts: int,
    implementation: MoeImplementation | tuple[MoeImplementation, ...] | None = None,
    block_sizes: None = None,
) -> MoeDispatch:
    """`MoeDispatch(expert_x [tokens*topk, embed], group_sizes [experts], routing)`; dropped pairs'
    rows are zero, last.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> topk_idx = jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]])
    >>> expert_x, group_sizes, routing = axkern.positional.moe_dispatch(jnp.ones((4, 3)), topk_idx, num_experts=4)
    >>> expert_x.shape, group_sizes.tolist()
    ((8, 3), [2, 2, 2, 2])

    ```
    """
    topk_idx = _check("moe_dispatch", topk_idx, num_experts)
    tokens, topk = topk_idx.shape
    _check_features("moe_dispatch", embed=x.shape[1])
    if tokens * topk == 0:  # no pair: no row
        rows = jnp.zeros((0,), jnp.int32)
        empty = jnp.zeros((0, x.shape[1]), x.dtype), jnp.zeros((num_experts,), jnp.int32)
        return MoeDispatch(*empty, MoeRouting(rows, topk_idx, num_experts))
    spec = DISPATCH.spec(
        {"tokens": tokens, "topk": topk, "embed": x.shape[1], "experts": num_experts}, x.dtype
    )
    expert_x, group_sizes, rows = DISPATCH(
        spec, x, topk_idx, implementation=implementation, block_sizes=block_sizes, num_experts=num_experts
    )
    return MoeDispatch(expert_x, group_sizes, MoeRouting(rows, topk_idx, num_experts))


@checked
def moe_combine_positional(
    expert_y: Float[Array, "rows out"],
    topk_weights: Float[Array, "tokens topk"],
    routing: MoeRouting,
    *,
    implementation: MoeImplementation | tuple[MoeImplementation, ...] | None = None,
    block_sizes: None = None,
) -> Float[Array, "tokens out"]:
    """`y[t] = sum_k topk_weights[t, k] * expert_y[row of (t, k)]`, dropped pairs contributing nothing.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> topk_idx = jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]])
    >>> expert_x, _, routing = axkern.positional.moe_dispatch(jnp.ones((4, 3)), topk_idx, num_experts=4)
    >>> axkern.positional.moe_combine(expert_x, jnp.full((4, 2), 0.5), routing).tolist()[0]
    [1.0, 1.0, 1.0]

    ```
    """
    tokens, topk = topk_weights.shape
    if routing.rows.shape[0] != tokens * topk or expert_y.shape[0] != tokens * topk:
        raise ValueError(
            f"moe_combine: expert_y has {expert_y.shape[0]} rows and the routing {routing.rows.shape[0]}, "
            f"but topk_weights is [{tokens}, {topk}] (needs {tokens * topk})"
        )
    _check_features("moe_combine", out=expert_y.shape[1])
    if tokens * topk == 0:  # no pair: every token's sum is empty
        return jnp.zeros((tokens, expert_y.shape[1]), expert_y.dtype)
    spec = COMBINE.spec(
        {"tokens": tokens, "topk": topk, "out": expert_y.shape[1], "experts": routing.num_experts},
        expert_y.dtype,
    )
    return COMBINE(
        spec,
        expert_y,
        topk_weights,
        routing.topk_idx,
        routing.rows,
        implementation=implementation,
        block_sizes=block_sizes,
        num_experts=routing.num_experts,
    )


EXPERTS, RANKS, DISPATCHED = "experts", "ranks", "dispatched"

# -- named layer -------------------------------------------------------------------------------

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
    bound = LAYOUT_ROLES.bind(locals())
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
    bound = DISPATCH_ROLES.bind(locals())
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
