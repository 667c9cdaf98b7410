"""`moe_ep_dispatch` / `moe_ep_combine`: expert-parallel MoE transport between devices.

Inside `shard_map` over a mesh axis `axis_name` of `R` devices, each holding its own tokens and
`E / R` of the `E` experts (rank `r` holds experts `r·E/R ... (r+1)·E/R - 1`):

```python
def layer(x, topk_idx, topk_weights, w_local):          # per device, under shard_map
    expert_x, group_sizes, layout = axkern.positional.moe_ep_dispatch(
        x, topk_idx, num_experts=E, axis_name="ep", capacity_factor=1.25)
    expert_y = jax.lax.ragged_dot(expert_x, w_local, group_sizes)
    return axkern.positional.moe_ep_combine(expert_y, topk_weights, layout)
```

`moe_ep_dispatch` sends each routed pair's token row to the device of its expert and returns
the rows that device received, grouped by local expert (`[R·C, D]`, empty slots last) with
the per-expert counts for `jax.lax.ragged_dot`; `moe_ep_combine` sends the expert outputs
back and sums each token's weighted outputs. `C` is the capacity per pair of devices: with
`capacity_factor=f`, `ceil(f·T·K / R)`, pairs beyond it are dropped (not sent, contributing
nothing, counted in `layout.dropped`); without it, `T·K` (exact: nothing is dropped, at `R`
times the bytes). An expert id outside `[0, E)` is dropped and counted too.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from haliax import NamedArray
from jax import lax
from jax.sharding import PartitionSpec

from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Float, Shaped, checked

from . import cuda, reference, xla, xla_ragged

__all__ = [
    "EpLayout",
    "EpDispatch",
    "moe_ep_dispatch_positional",
    "moe_ep_combine_positional",
    "DISPATCH",
    "COMBINE",
]

EpImplementation = Literal["xla", "xla_ragged", "cuda", "reference"]
# xla everywhere; xla_ragged and cuda explicit only (docs/ops/moe_ep.md, "Implementations", says why)
_ORDER = {"cpu": ("xla",), "gpu": ("xla",), "tpu": ("xla",)}
_BUCKET = lambda spec: dict(spec.dims)  # noqa: E731 - no tuned tables

DISPATCH = Op(
    "moe_ep_dispatch",
    [
        xla.DISPATCH_IMPLEMENTATION,
        xla_ragged.DISPATCH_IMPLEMENTATION,
        cuda.DISPATCH_IMPLEMENTATION,
        Implementation("reference", reference.dispatch, backward="JAX's, through the all-gathers"),
    ],
    _ORDER,
    package=__package__,
    bucket=_BUCKET,
)
COMBINE = Op(
    "moe_ep_combine",
    [
        xla.COMBINE_IMPLEMENTATION,
        xla_ragged.COMBINE_IMPLEMENTATION,
        cuda.COMBINE_IMPLEMENTATION,
        Implementation("reference", reference.combine, backward="JAX's, through the all-gathers"),
    ],
    _ORDER,
    package=__package__,
    bucket=_BUCKET,
)


class EpLayout(eqx.Module):
    """What `moe_ep_combine` needs to bring a dispatch back: for each pair its destination rank,
    slot and whether it was sent; the received rows' order; the counts of dropped pairs.

    From the named `moe_ep_dispatch`, `dst`, `slot` and `sent` are `NamedArray`s over the token
    axes and `TopK`, `order` over the dispatched rows, `dropped` is the total over every device,
    and `experts_axis` / `batch_mesh` record the axis mapping it ran under.
    """

    dst: Array | NamedArray
    slot: Array | NamedArray
    sent: Array | NamedArray
    order: Array | NamedArray
    dropped: Array
    axis_name: str = eqx.field(static=True)
    ranks: int = eqx.field(static=True)
    capacity: int = eqx.field(static=True)
    experts_axis: hax.Axis | None = eqx.field(static=True, default=None)
    batch_mesh: tuple[str, ...] = eqx.field(static=True, default=())

    def expert_specs(self) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
        """A named layout's `PartitionSpec`s for running the experts per device under `shard_map`:
        of `expert_x` (and `expert_y`: one block per token shard, over the token axes' mesh axes
        in their order), of `group_sizes`, and of a weight whose first axis is `Experts`."""
        if self.experts_axis is None:
            raise ValueError("EpLayout.expert_specs: a positional layout is already per device")
        others = tuple(m for m in self.batch_mesh if m != self.axis_name) or None
        return (
            PartitionSpec(self.batch_mesh),
            PartitionSpec(others, self.axis_name),
            PartitionSpec(self.axis_name),
        )


class EpDispatch(NamedTuple):
    """`moe_ep_dispatch`'s results: this device's received rows grouped by local expert, the rows
    per local expert (for `jax.lax.ragged_dot`), and the layout `moe_ep_combine` takes (named:
    every device's rows over `Dispatched`, the counts over `("dispatch_blocks", Experts)`)."""

    expert_x: Array | NamedArray
    group_sizes: Array | NamedArray
    layout: EpLayout


def capacity_for(tokens: int, topk: int, ranks: int, capacity_factor: float | None) -> int:
    """Rows per pair of devices: `ceil(f·T·K / R)` for a capacity factor `f`, `T·K` (exact) without."""
    if capacity_factor is None:
        return max(1, tokens * topk)
    if not capacity_factor > 0:
        raise ValueError(f"moe_ep_dispatch: capacity_factor must be > 0 or None, got {capacity_factor!r}")
    return max(1, math.ceil(capacity_factor * tokens * topk / ranks))


@checked
def moe_ep_dispatch_positional(
    x: Float[Array, "tokens embed"],
    topk_idx: Shaped[Array, "tokens topk"],
    *,
    num_experts: int,
    axis_name: str,
    capacity_factor: float | None = None,
    implementation: EpImplementation | tuple[EpImplementation, ...] | None = None,
    block_sizes: None = None,
) -> EpDispatch:
    """Send each routed pair's row of `x` to the device holding its expert (inside `shard_map`
    over `axis_name`). **Returns:** `EpDispatch(expert_x [R·C, embed], group_sizes [E/R], layout)`.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> def route(x, topk_idx):  # per device, inside shard_map over "ep"
    ...     expert_x, group_sizes, layout = axkern.positional.moe_ep_dispatch(x, topk_idx, num_experts=4, axis_name="ep")
    ...     return expert_x, group_sizes
    >>> mesh = Mesh(jax.devices()[:1], ("ep",))
    >>> run = jax.jit(jax.shard_map(route, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    >>> expert_x, group_sizes = run(jnp.ones((4, 3)), jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]]))
    >>> expert_x.shape, group_sizes.tolist()
    ((8, 3), [2, 2, 2, 2])

    ```
    """
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(f"moe_ep_dispatch: topk_idx must have an integer dtype, got {topk_idx.dtype}")
    ranks = lax.psum(1, axis_name)
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % ranks:
        raise ValueError(
            f"moe_ep_dispatch: num_experts={num_experts!r} must be a positive multiple of the {ranks} devices "
            f"of mesh axis {axis_name!r}"
        )
    tokens, topk = topk_idx.shape
    capacity = capacity_for(tokens, topk, ranks, capacity_factor)
    spec = DISPATCH.spec(
        {
            "tokens": tokens,
            "topk": topk,
            "embed": x.shape[1],
            "experts": num_experts,
            "ranks": ranks,
            "capacity": capacity,
        },
        x.dtype,
    )
    expert_x, group_sizes, order, dst, slot, sent, dropped = DISPATCH(
        spec,
        x,
        topk_idx,
        implementation=implementation,
        block_sizes=block_sizes,
        num_experts=num_experts,
        axis_name=axis_name,
        ranks=ranks,
        capacity=capacity,
    )
    return EpDispatch(
        expert_x, group_sizes, EpLayout(dst, slot, sent, order, dropped, axis_name, ranks, capacity)
    )


@checked
def moe_ep_combine_positional(
    expert_y: Float[Array, "rows out"],
    topk_weights: Float[Array, "tokens topk"],
    layout: EpLayout,
    *,
    implementation: EpImplementation | tuple[EpImplementation, ...] | None = None,
    block_sizes: None = None,
) -> Float[Array, "tokens out"]:
    """Bring the expert outputs back to their tokens: `y[t] = Σ_k w[t, k] · expert_y[row of (t, k)]`
    over the pairs that were sent (inside the same `shard_map` as the dispatch).

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> def layer(x, topk_idx, topk_weights):  # identity experts: y = x when the weights sum to 1
    ...     expert_x, group_sizes, layout = axkern.positional.moe_ep_dispatch(x, topk_idx, num_experts=4, axis_name="ep")
    ...     return axkern.positional.moe_ep_combine(expert_x, topk_weights, layout)
    >>> mesh = Mesh(jax.devices()[:1], ("ep",))
    >>> run = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    >>> y = run(jnp.ones((4, 3)), jnp.array([[0, 1], [1, 2], [2, 3], [3, 0]]), jnp.full((4, 2), 0.5))
    >>> y.tolist()[0]
    [1.0, 1.0, 1.0]

    ```
    """
    if layout.experts_axis is not None:
        raise ValueError(
            "moe_ep_combine: this layout came from the named moe_ep_dispatch; use axkern.moe_ep_combine"
        )
    rows = layout.ranks * layout.capacity
    if expert_y.shape[0] != rows or topk_weights.shape != layout.sent.shape:
        raise ValueError(
            f"moe_ep_combine: expert_y has {expert_y.shape[0]} rows and topk_weights the shape "
            f"{tuple(topk_weights.shape)}; the layout needs {rows} rows and {tuple(layout.sent.shape)}"
        )
    tokens, topk = topk_weights.shape
    spec = COMBINE.spec(
        {
            "tokens": tokens,
            "topk": topk,
            "out": expert_y.shape[1],
            "ranks": layout.ranks,
            "capacity": layout.capacity,
        },
        expert_y.dtype,
    )
    return COMBINE(
        spec,
        expert_y,
        topk_weights,
        layout.order,
        layout.dst,
        layout.slot,
        layout.sent,
        implementation=implementation,
        block_sizes=block_sizes,
        axis_name=layout.axis_name,
        ranks=layout.ranks,
        capacity=layout.capacity,
    )
