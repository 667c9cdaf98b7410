"""`short_conv`: the named function, its positional form, the decode step, and the `Op` behind them.

`y[b, t, c] = act(bias[c] + sum_{k < W} weight[k, c] * x[b, t - k, c])`: a causal depthwise
convolution of width `W` (1..8) over the sequence. Positions before the start read the
`initial_state` (the `W-1` previous inputs, oldest first); with `segment_ids` a tap never
reads a position of another segment (packed documents stay independent; the state belongs
to the sequence's first segment). A segment starts wherever the id changes from one position
to the next: `[0, 0, 1, 1, 0]` holds three segments, the last one not continuing the first.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from haliax import NamedArray
from jax import lax

from axkern.core import compat, named
from axkern.core.mesh import mesh_axes_for
from axkern.core.named import StepResult, WithFinalState
from axkern.core.op import Implementation, Op, step_op
from axkern.core.typing import Array, Float, Int, checked

from . import cuda, pallas_gpu, pallas_tpu, reference, xla
from .blocks import (
    ConvBlockSizes,
    bucket,
    cuda_heuristic,
    cuda_space,
    heuristic,
    pallas_gpu_space,
    pallas_tpu_space,
)
from .common import extended, segment_runs, zero_state

__all__ = [
    "short_conv",
    "short_conv_positional",
    "short_conv_step",
    "short_conv_step_positional",
    "OP",
    "STEP_OP",
]

NAME = "short_conv"
MAX_WIDTH = 8
ACTIVATIONS = (None, "silu")
STATE_AXIS = "conv_state"

OP = Op(
    NAME,
    [
        Implementation(
            "cuda",
            cuda.conv,
            platforms=("gpu",),
            supports=cuda.supports,
            block_sizes=ConvBlockSizes,
            heuristic=cuda_heuristic,
            space=cuda_space,
            backward="custom_vjp: one CUDA pass (dx, partial dw/dbias per tile), state grad in JAX",
        ),
        Implementation(
            "pallas_gpu",
            pallas_gpu.conv,
            platforms=("gpu",),
            block_sizes=ConvBlockSizes,
            heuristic=heuristic,
            space=pallas_gpu_space,
            interpretable=True,
            backward="custom_vjp: one Pallas kernel (dx, partial dw/dbias), state grad in JAX",
        ),
        Implementation(
            "pallas_tpu",
            pallas_tpu.conv,
            platforms=("tpu",),
            block_sizes=ConvBlockSizes,
            heuristic=heuristic,
            space=pallas_tpu_space,
            interpretable=True,
            backward="custom_vjp: Pallas TPU kernels (verified in interpret mode only)",
        ),
        Implementation("xla", xla.conv, backward="custom_vjp: shifted sums (fused by XLA)"),
        Implementation("reference", reference.conv, backward="autodiff through the shifted sum"),
    ],
    # GPU: cuda, then pallas_gpu where the CUDA library cannot be built or the channels are not
    # a multiple of its vector (docs/ops/short_conv.md has the measurements)
    default_order={"cpu": ("xla",), "gpu": ("cuda", "pallas_gpu", "xla"), "tpu": ("pallas_tpu", "xla")},
    package=__package__,
    bucket=bucket,
)


STEP_OP = step_op("short_conv_step", xla.step, reference.step, package=__package__)

ConvImplementation = Literal["cuda", "pallas_gpu", "pallas_tpu", "xla", "reference"]
StepImplementation = Literal["xla", "reference"]


def _check_width(width: int) -> None:
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"{NAME}: width must be in 1..{MAX_WIDTH}, got {width}")


def _check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{NAME}: activation must be None or 'silu', got {activation!r}")


def _check_channels(op: str, channels: int) -> None:
    if channels == 0:
        raise ValueError(f"{op}: channels must be at least 1, got 0")


def final_state(x, segment_ids, initial_state):
    """The last `W-1` inputs of each sequence (oldest first): the decode cache after `x`.

    Rows that belong to an earlier segment than the last token's are zero.
    """
    width_1 = initial_state.shape[1]
    xe, se = extended(x, segment_ids, initial_state)
    tail = xe[:, xe.shape[1] - width_1 :]
    if se is not None:
        tail = jnp.where((se[:, se.shape[1] - width_1 :] == segment_ids[:, -1:])[..., None], tail, 0)
    return tail


@checked
def short_conv_positional(
    x: Float[Array, "batch seq channels"],
    weight: Float[Array, "width channels"],
    *,
    bias: Float[Array, " channels"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    initial_state: Float[Array, "batch state channels"] | None = None,
    return_final_state: bool = False,
    activation: str | None = None,
    implementation: ConvImplementation | tuple[ConvImplementation, ...] | None = None,
    block_sizes: ConvBlockSizes | dict | None = None,
) -> Float[Array, "batch seq channels"] | WithFinalState:
    """Causal depthwise convolution on plain arrays.

    **Arguments:**

    - `x`: `[batch, seq, channels]`.
    - `weight`: `[width, channels]`; tap `k` multiplies `x[t - k]`. Width 1..8.
    - `bias`: optional `[channels]`.
    - `segment_ids`: optional `[batch, seq]` ints; a change of id starts a segment and taps never
      reach into another segment.
    - `initial_state`: optional `[batch, width - 1, channels]`, the inputs before position 0.
    - `return_final_state`: also return the last `width - 1` inputs (the decode cache).
    - `activation`: `None` or `"silu"`.
    - `implementation`, `block_sizes`: override the dispatcher.

    **Returns:** `y` like `x`, or `WithFinalState(y, final_state)`. Empty `batch` or `seq` give
    an empty `y` (and the initial state as the final one); empty `channels` is a `ValueError`.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> y = axkern.positional.short_conv(jnp.ones((1, 6, 2)), jnp.ones((2, 2)))  # [batch, seq, channels], [width, channels]
    >>> y[0, :, 0].tolist()
    [1.0, 2.0, 2.0, 2.0, 2.0, 2.0]

    ```
    """
    width = weight.shape[0]
    _check_width(width)
    _check_activation(activation)
    batch, seq, channels = x.shape
    _check_channels(NAME, channels)
    if initial_state is not None and initial_state.shape[1] != width - 1:
        raise ValueError(
            f"{NAME}: initial_state holds {initial_state.shape[1]} previous inputs, but width {width} needs "
            f"width - 1 = {width - 1}"
        )
    bias = jnp.zeros((channels,), weight.dtype) if bias is None else bias
    if 0 in (batch, seq):  # nothing to convolve: an empty y, the state passes through
        y = jnp.zeros(x.shape, x.dtype)
        return WithFinalState(y, zero_state(x, width, initial_state)) if return_final_state else y
    spec = OP.spec(
        {"batch": batch, "seq": seq, "channels": channels, "width": width},
        x.dtype,
        activation=activation,
        segments=segment_ids is not None,
    )
    y = OP(
        spec,
        x,
        weight,
        bias,
        segment_ids,
        initial_state,  # None: zeros, formed (or not) by the implementation
        implementation=implementation,
        block_sizes=block_sizes,
        activation=activation,
    )
    if return_final_state:
        return WithFinalState(
            y, final_state(x, segment_runs(segment_ids), zero_state(x, width, initial_state))
        )
    return y


@checked
def short_conv_step_positional(
    x_t: Float[Array, "batch channels"],
    state: Float[Array, "batch state channels"],
    weight: Float[Array, "width channels"],
    *,
    bias: Float[Array, " channels"] | None = None,
    activation: str | None = None,
    implementation: StepImplementation | tuple[StepImplementation, ...] | None = None,
    block_sizes: None = None,
) -> StepResult:
    """One decode step: `StepResult(y_t, new_state)` from the newest input and the `W-1` previous ones.

    `block_sizes` is accepted for a uniform signature; the step is not blocked.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> y_t, state = axkern.positional.short_conv_step(jnp.ones((1, 2)), jnp.ones((1, 2, 2)), jnp.ones((3, 2)))
    >>> y_t.tolist(), state.shape
    ([[3.0, 3.0]], (1, 2, 2))

    ```
    """
    width = weight.shape[0]
    _check_width(width)
    _check_activation(activation)
    _check_channels("short_conv_step", x_t.shape[1])
    if state.shape[1] != width - 1:
        raise ValueError(
            f"{NAME}: state holds {state.shape[1]} previous inputs, but width {width} needs {width - 1}"
        )
    spec = STEP_OP.spec(
        {"batch": x_t.shape[0], "channels": x_t.shape[1], "width": width}, x_t.dtype, activation=activation
    )
    y, new = STEP_OP(
        spec,
        x_t,
        state,
        weight,
        bias,
        implementation=implementation,
        block_sizes=block_sizes,
        activation=activation,
    )
    return StepResult(y, new)


# -- named layer -------------------------------------------------------------------------------

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
    _check_activation(activation)
    bound = ROLES.bind(locals())
    width = bound.axis("Width").size
    _check_width(width)
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
    bound = STEP_ROLES.bind(locals())
    _check_width(bound.axis("Width").size)
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
