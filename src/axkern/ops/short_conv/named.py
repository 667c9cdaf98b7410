"""`short_conv` and `short_conv_step` over named axes: their role tables and sharding rules,
bound to the caller's axes; Pos sequence parallel by handing each shard the previous shard's
last `W-1` inputs."""

from __future__ import annotations

import jax.numpy as jnp
from haliax import NamedArray
from jax import lax

from axkern.core import compat, named
from axkern.core.mesh import mesh_axes_for
from axkern.core.named import StepResult, WithFinalState

from .api import (
    NAME,
    ConvBlockSizes,
    ConvImplementation,
    StepImplementation,
    check_activation,
    check_width,
    short_conv_positional,
    short_conv_step_positional,
)

__all__ = ["short_conv", "short_conv_step"]

ROLES = named.Roles(
    NAME,
    {
        "x": named.Arg(("batch", "Pos", "Channel"), describe="batch axes + Pos + Channel"),
        "weight": named.Arg(("Width", "Channel"), describe="Width + Channel"),
        "bias": named.Arg(("Channel",), optional=True, describe="Channel"),
        "segment_ids": named.Arg(("batch", "Pos"), optional=True, describe="x's batch axes + Pos"),
        "initial_state": named.Arg(
            ("batch", "ConvState", "Channel"), optional=True, describe="x's batch axes + ConvState + Channel"
        ),
    },
)
SHARDING = named.Sharding(
    parallel=("Pos", "Channel"),
    describe="batch axes data parallel; Channel split with the weight (depthwise: no communication); "
    "Pos sequence parallel, each shard receiving the previous shard's last W-1 inputs (and segment "
    "ids) with one ppermute as its initial state",
)
STEP_ROLES = named.Roles(
    "short_conv_step",
    {
        "x_t": named.Arg(("batch", "Channel"), describe="batch axes + Channel"),
        "state": named.Arg(
            ("batch", "ConvState", "Channel"), describe="x_t's batch axes + ConvState + Channel"
        ),
        "weight": named.Arg(("Width", "Channel"), describe="Width + Channel"),
        "bias": named.Arg(("Channel",), optional=True, describe="Channel"),
    },
)
STEP_SHARDING = named.Sharding(
    parallel=("Channel",), describe="batch axes and Channel split; no communication"
)


def short_conv(
    x: NamedArray,
    weight: NamedArray,
    *,
    Pos: named.AxisSelector = "position",
    Channel: named.AxisSelector = "embed",
    Width: named.AxisSelector = "width",
    ConvState: named.AxisSelector = "conv_state",
    bias: NamedArray | None = None,
    segment_ids: NamedArray | None = None,
    initial_state: NamedArray | None = None,
    return_final_state: bool = False,
    activation: str | None = None,
    implementation: ConvImplementation | tuple[ConvImplementation, ...] | None = None,
    block_sizes: ConvBlockSizes | dict | None = None,
) -> NamedArray | WithFinalState:
    """Causal depthwise convolution of width `Width` (1..8) along `Pos`, per `Channel`.

    **Arguments:**

    - `x`: batch axes + `Pos` + `Channel` (any order).
    - `weight`: `Width` x `Channel`; tap `k` multiplies `x[t - k]`.
    - `bias`: optional, axis `Channel`.
    - `segment_ids`: optional ints with `x`'s batch axes and `Pos`: taps never cross a segment
      (a change of id starts one).
    - `initial_state`: optional, batch axes + `ConvState` (size `Width - 1`) + `Channel`.
    - `return_final_state`: also return the last `Width - 1` inputs, as `initial_state` is laid out.
    - `activation`: `None` or `"silu"`.
    - `ConvState`: the name of the state axis (created by the op when no state is passed).

    **Returns:** `y` with `x`'s axes, or `WithFinalState(y, final_state)`.

    ```python
    x = hax.random.normal(jax.random.PRNGKey(0), (Batch, Pos, Embed))
    y = axkern.short_conv(x, weight, activation="silu")  # weight: (width, embed)
    ```

    !!! info "Sharding"
        Batch axes mapped to mesh axes run data parallel and a mapped `Channel` splits with the
        weight. A mapped `Pos` runs sequence parallel: each shard receives the previous shard's
        last `Width - 1` inputs (and segment ids) with `ppermute` as its initial state.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Pos, Embed, Width = hax.Axis("position", 6), hax.Axis("embed", 2), hax.Axis("width", 2)
    >>> y = axkern.short_conv(hax.ones((Pos, Embed)), hax.ones((Width, Embed)))
    >>> y.array[:, 0].tolist()  # y[t] = x[t] + x[t - 1], zero before the start
    [1.0, 2.0, 2.0, 2.0, 2.0, 2.0]

    ```
    """
    check_activation(activation)
    bound = ROLES.bind(
        {"x": x, "weight": weight, "bias": bias, "segment_ids": segment_ids, "initial_state": initial_state},
        Pos=Pos,
        Channel=Channel,
        Width=Width,
        ConvState=ConvState,
    )
    width = bound.axis("Width").size
    check_width(width)
    bound.create("ConvState", ConvState, width - 1)
    pos = bound.axis("Pos")
    seq_mesh = bound.sharded(SHARDING) and mesh_axes_for(pos)
    if seq_mesh:
        n_shards = compat.axis_size(compat.current_mesh(), seq_mesh)
        if pos.size // n_shards < width - 1:
            raise ValueError(
                f"{NAME}: {pos.name}={pos.size} split over {n_shards} shards leaves {pos.size // n_shards} "
                f"positions per shard, fewer than the width - 1 = {width - 1} halo"
            )

    def body(ctx, xs, ws, bs, ss, sts):
        seq = ctx.mesh_axes("Pos")
        if seq is not None:
            if sts is None:
                sts = jnp.zeros((xs.shape[0], width - 1, xs.shape[2]), xs.dtype)
            sts = _halo(xs, ss, sts, width - 1, seq)
        out = short_conv_positional(
            xs,
            ws,
            bias=bs,
            segment_ids=ss,
            initial_state=sts,
            return_final_state=return_final_state,
            activation=activation,
            implementation=implementation,
            block_sizes=block_sizes,
        )
        if not return_final_state:
            return out
        y, fs = out
        if seq is not None:  # the sequence's final state is the last shard's
            last = compat.axis_index(seq) == compat.axis_size(compat.current_mesh(), seq) - 1
            fs = lax.psum(jnp.where(last, fs, jnp.zeros_like(fs)), seq)
        return y, fs

    y_out = named.Out(("batch", "Pos", "Channel"), like="x")
    if not return_final_state:
        return bound.run(body, SHARDING, y_out)
    state_out = named.Out(("batch", "ConvState", "Channel"), like=("initial_state",))
    return WithFinalState(*bound.run(body, SHARDING, (y_out, state_out)))


def _halo(x, segment_ids, state, width_1, seq_mesh):
    """This shard's initial state: the previous shard's last `W-1` inputs (the caller's state on shard 0).

    Halo rows of another segment than this shard's first token (an id change between the row and
    that token) are zeroed, so the kernel's rule (state rows belong to the first segment) stays
    exact across the shard boundary.
    """
    if width_1 == 0:
        return state
    names = (seq_mesh,) if isinstance(seq_mesh, str) else tuple(seq_mesh)
    size = 1
    for m in names:
        size *= lax.psum(1, m)
    perm = [(i, i + 1) for i in range(size - 1)]
    tail = lax.ppermute(x[:, -width_1:], names, perm)
    if segment_ids is not None:
        seg_tail = lax.ppermute(segment_ids[:, -width_1:], names, perm)
        chain = jnp.concatenate([seg_tail, segment_ids[:, :1]], axis=1)
        same = (chain[:, :-1] == chain[:, 1:]).astype(jnp.int32)
        # a row is in the first token's segment when no id changes between them
        unbroken = jnp.flip(jnp.cumprod(jnp.flip(same, axis=1), axis=1), axis=1) == 1
        tail = jnp.where(unbroken[..., None], tail, 0)
    first = compat.axis_index(seq_mesh) == 0
    return jnp.where(first, state.astype(tail.dtype), tail)


def short_conv_step(
    x_t: NamedArray,
    state: NamedArray,
    weight: NamedArray,
    *,
    Channel: named.AxisSelector = "embed",
    Width: named.AxisSelector = "width",
    ConvState: named.AxisSelector = "conv_state",
    bias: NamedArray | None = None,
    activation: str | None = None,
    implementation: StepImplementation | tuple[StepImplementation, ...] | None = None,
    block_sizes: None = None,
) -> StepResult:
    """One decode step. `x_t`: batch axes + `Channel`; `state`: batch axes + `ConvState` + `Channel`.

    **Returns:** `StepResult(y_t, new_state)`, with `x_t`'s and `state`'s axes.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Embed, Width, ConvState = hax.Axis("embed", 2), hax.Axis("width", 3), hax.Axis("conv_state", 2)
    >>> y_t, state = axkern.short_conv_step(hax.ones(Embed), hax.ones((ConvState, Embed)), hax.ones((Width, Embed)))
    >>> y_t.array.tolist(), state.axes == (ConvState, Embed)
    ([3.0, 3.0], True)

    ```
    """
    bound = STEP_ROLES.bind(
        {"x_t": x_t, "state": state, "weight": weight, "bias": bias},
        Channel=Channel,
        Width=Width,
        ConvState=ConvState,
    )
    check_width(bound.axis("Width").size)
    bound.create("ConvState", ConvState, bound.axis("Width").size - 1)

    def body(ctx, xs, ss, ws, bs):
        return tuple(
            short_conv_step_positional(
                xs,
                ss,
                ws,
                bias=bs,
                activation=activation,
                implementation=implementation,
                block_sizes=block_sizes,
            )
        )

    outs = (
        named.Out(("batch", "Channel"), like="x_t"),
        named.Out(("batch", "ConvState", "Channel"), like="state"),
    )
    return StepResult(*bound.run(body, STEP_SHARDING, outs))
