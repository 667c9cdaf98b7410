"""MoE routing ops: `moe_layout`, `moe_dispatch`, `moe_combine` (DeepEP-style), named and positional.

Pairs `(token t, slot k)` of `topk_idx: [tokens, topk]` go to expert `topk_idx[t, k]`.
`moe_dispatch` copies rows of `x` into expert-major order (experts contiguous, stable by
token), ready for `jax.lax.ragged_dot` with `group_sizes`; `moe_combine` weights and sums
each token's expert outputs back in token order. An expert id outside `[0, num_experts)`
is a *dropped* pair: a `ValueError` when the ids are concrete, otherwise (traced) its row is
zero, it is not routed, and `MoeLayout.dropped` counts it.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from axkern.core import named
from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Float, Shaped, checked

from . import cuda, reference, xla

__all__ = [
    "MoeLayout",
    "MoeRouting",
    "moe_layout",
    "moe_dispatch",
    "moe_combine",
    "moe_layout_positional",
    "moe_dispatch_positional",
    "moe_combine_positional",
]

# GPU: the CUDA kernels, checked against the reference on the H200 and measured faster than
# xla there (cuda.py has the figures); xla wherever they cannot serve (no nvcc, top-k > 16, ...)
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
    """What `moe_combine` needs to undo a dispatch: each pair's row in the dispatched array."""

    rows: Array
    topk_idx: Array
    num_experts: int = eqx.field(static=True)
    token_axis: hax.Axis | None = eqx.field(static=True, default=None)
    topk_axis: hax.Axis | None = eqx.field(static=True, default=None)


def _check(op: str, topk_idx, num_experts: int, num_ranks: int = 1) -> None:
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(f"{op}: topk_idx must have an integer dtype, got {topk_idx.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
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


@checked
def moe_layout_positional(
    topk_idx: Shaped[Array, "tokens topk"], *, num_experts: int, num_ranks: int = 1, implementation=None
) -> MoeLayout:
    """Per-expert and per-rank counts of a top-k routing (DeepEP's `get_dispatch_layout`)."""
    _check("moe_layout", topk_idx, num_experts, num_ranks)
    tokens, topk = topk_idx.shape
    spec = LAYOUT.spec(
        {"tokens": tokens, "topk": topk, "experts": num_experts, "ranks": num_ranks}, jnp.int32
    )
    return MoeLayout(
        *LAYOUT(spec, topk_idx, implementation=implementation, num_experts=num_experts, num_ranks=num_ranks)
    )


@checked
def moe_dispatch_positional(
    x: Float[Array, "tokens embed"],
    topk_idx: Shaped[Array, "tokens topk"],
    *,
    num_experts: int,
    implementation=None,
):
    """`(expert_x [tokens*topk, embed], group_sizes [experts], routing)`; dropped pairs' rows are zero, last."""
    _check("moe_dispatch", topk_idx, num_experts)
    tokens, topk = topk_idx.shape
    spec = DISPATCH.spec(
        {"tokens": tokens, "topk": topk, "embed": x.shape[1], "experts": num_experts}, x.dtype
    )
    expert_x, group_sizes, rows = DISPATCH(
        spec, x, topk_idx, implementation=implementation, num_experts=num_experts
    )
    return expert_x, group_sizes, MoeRouting(rows, topk_idx, num_experts)


@checked
def moe_combine_positional(
    expert_y: Float[Array, "rows out"],
    topk_weights: Float[Array, "tokens topk"],
    routing: MoeRouting,
    *,
    implementation=None,
) -> Float[Array, "tokens out"]:
    """`y[t] = sum_k topk_weights[t, k] * expert_y[row of (t, k)]`, dropped pairs contributing nothing."""
    tokens, topk = topk_weights.shape
    if routing.rows.shape[0] != tokens * topk or expert_y.shape[0] != tokens * topk:
        raise ValueError(
            f"moe_combine: expert_y has {expert_y.shape[0]} rows and the routing {routing.rows.shape[0]}, "
            f"but topk_weights is [{tokens}, {topk}] (needs {tokens * topk})"
        )
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
        num_experts=routing.num_experts,
    )


# -- named layer -------------------------------------------------------------------------------

EXPERTS, RANKS, DISPATCHED = "experts", "ranks", "dispatched"


def _resolve_topk(op, topk_idx, Token, TopK):
    named.require_named(op, "topk_idx", topk_idx)
    token = named.resolve(op, "topk_idx", topk_idx, Token, "Token")
    topk = named.resolve(op, "topk_idx", topk_idx, TopK, "TopK")
    if len(topk_idx.axes) != 2:
        raise ValueError(
            f"{op}: topk_idx must have exactly axes Token and TopK; its axes are "
            f"{named.axes_str(topk_idx.axes)}"
        )
    return token, topk, named.ordered(topk_idx, (token, topk))


def moe_layout(
    topk_idx: NamedArray,
    *,
    Token="token",
    TopK="topk",
    num_experts: int,
    num_ranks: int = 1,
    implementation=None,
) -> MoeLayout:
    """Named `moe_layout`: counts as NamedArrays over axes `"experts"`, `"ranks"` and `Token`."""
    token, _, idx = _resolve_topk("moe_layout", topk_idx, Token, TopK)
    out = moe_layout_positional(
        idx, num_experts=num_experts, num_ranks=num_ranks, implementation=implementation
    )
    experts, ranks = hax.Axis(EXPERTS, num_experts), hax.Axis(RANKS, num_ranks)
    return MoeLayout(
        hax.named(out.tokens_per_expert, (experts,)),
        hax.named(out.tokens_per_rank, (ranks,)),
        hax.named(out.is_token_in_rank, (token, ranks)),
        out.dropped,
    )


def moe_dispatch(
    x: NamedArray,
    topk_idx: NamedArray,
    *,
    Token="token",
    Embed="embed",
    TopK="topk",
    num_experts: int,
    implementation=None,
):
    """Named `moe_dispatch`: `x` has `Token` and `Embed`; returns `expert_x` over
    (`"dispatched"`, `Embed`), `group_sizes` over `"experts"`, and the routing."""
    named.require_named("moe_dispatch", "x", x)
    token, topk, idx = _resolve_topk("moe_dispatch", topk_idx, Token, TopK)
    x_token = named.resolve("moe_dispatch", "x", x, token.name, "Token")
    embed = named.resolve("moe_dispatch", "x", x, Embed, "Embed")
    if x_token.size != token.size or len(x.axes) != 2:
        raise ValueError(
            f"moe_dispatch: x must have exactly axes {token} and Embed; its axes are {named.axes_str(x.axes)}"
        )
    expert_x, group_sizes, routing = moe_dispatch_positional(
        named.ordered(x, (token, embed)), idx, num_experts=num_experts, implementation=implementation
    )
    rows = hax.Axis(DISPATCHED, token.size * topk.size)
    routing = MoeRouting(routing.rows, routing.topk_idx, num_experts, token, topk)
    return (
        hax.named(expert_x, (rows, embed)),
        hax.named(group_sizes, (hax.Axis(EXPERTS, num_experts),)),
        routing,
    )


def moe_combine(expert_y: NamedArray, topk_weights: NamedArray, routing: MoeRouting, *, implementation=None):
    """Named `moe_combine`: `expert_y` over (`"dispatched"`, any output axis), `topk_weights` over the
    routing's Token and TopK axes; returns `y` over (Token, the output axis)."""
    named.require_named("moe_combine", "expert_y", expert_y)
    named.require_named("moe_combine", "topk_weights", topk_weights)
    if routing.token_axis is None:
        raise ValueError(
            "moe_combine: this routing came from the positional moe_dispatch; use moe_combine_positional"
        )
    rows = named.resolve("moe_combine", "expert_y", expert_y, DISPATCHED, "Dispatched")
    out_axes = named.without(expert_y, rows.name)
    if len(out_axes) != 1:
        raise ValueError(
            f"moe_combine: expert_y must have {DISPATCHED!r} and one output axis; its axes are "
            f"{named.axes_str(expert_y.axes)}"
        )
    token, topk = routing.token_axis, routing.topk_axis
    w = named.match_axes(
        "moe_combine", "topk_weights", topk_weights, (token, topk), "the routing's Token and TopK"
    )
    y = moe_combine_positional(
        named.ordered(expert_y, (rows, out_axes[0])), w, routing, implementation=implementation
    )
    return hax.named(y, (token, out_axes[0]))
