"""MoE routing ops: `moe_layout`, `moe_dispatch`, `moe_combine` (DeepEP-style): their Ops, result
types and positional functions (the named functions and their role tables are in `named.py`).

Pairs `(token t, slot k)` of `topk_idx: [tokens, topk]` go to expert `topk_idx[t, k]`.
`moe_dispatch` copies rows of `x` into expert-major order (experts contiguous, stable by
token), ready for `jax.lax.ragged_dot` with `group_sizes`; `moe_combine` weights and sums
each token's expert outputs back in token order. An expert id outside `[0, num_experts)`
is a *dropped* pair: a `ValueError` when the ids are concrete, otherwise (traced) its row is
zero, it is not routed, and `MoeLayout.dropped` counts it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Float, Shaped, checked

from . import cuda, reference, xla

__all__ = [
    "MoeLayout",
    "MoeRouting",
    "MoeDispatch",
    "moe_layout_positional",
    "moe_dispatch_positional",
    "moe_combine_positional",
]

# GPU: the CUDA kernels (docs/ops/moe.md, "Performance", has their times beside xla's); xla
# wherever they cannot serve (no nvcc, top-k > 16, ...)
_ORDER = {"cpu": ("xla",), "gpu": ("cuda", "xla"), "tpu": ("xla",)}
_BUCKET = lambda spec: dict(spec.dims)  # noqa: E731 - no tuned tables yet

LAYOUT = Op(
    "moe_layout",
    [
        xla.LAYOUT_IMPLEMENTATION,
        cuda.LAYOUT_IMPLEMENTATION,
        Implementation("reference", reference.layout, backward="none (integer outputs)"),
    ],
    _ORDER,
    package=__package__,
    bucket=_BUCKET,
)
DISPATCH = Op(
    "moe_dispatch",
    [
        xla.DISPATCH_IMPLEMENTATION,
        cuda.DISPATCH_IMPLEMENTATION,
        Implementation("reference", reference.dispatch, backward="autodiff (scatter)"),
    ],
    _ORDER,
    package=__package__,
    bucket=_BUCKET,
)
COMBINE = Op(
    "moe_combine",
    [
        xla.COMBINE_IMPLEMENTATION,
        cuda.COMBINE_IMPLEMENTATION,
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
