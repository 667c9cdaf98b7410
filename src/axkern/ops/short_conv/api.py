"""`short_conv`: the positional functions of the convolution and its decode step and the `Op`s
behind them (the named functions are in `named.py`).

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

from axkern.core.named import StepResult, WithFinalState
from axkern.core.op import Implementation, Op, step_op
from axkern.core.typing import Array, Float, Int, checked

from . import cuda, pallas_gpu, pallas_tpu, reference, xla
from .blocks import ConvBlockSizes, bucket
from .common import extended, segment_runs, zero_state

__all__ = [
    "short_conv_positional",
    "short_conv_step_positional",
    "OP",
    "STEP_OP",
]

NAME = "short_conv"
MAX_WIDTH = 8
ACTIVATIONS = (None, "silu")

OP = Op(
    NAME,
    [
        cuda.IMPLEMENTATION,
        pallas_gpu.IMPLEMENTATION,
        pallas_tpu.IMPLEMENTATION,
        xla.IMPLEMENTATION,
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


def check_width(width: int) -> None:
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"{NAME}: width must be in 1..{MAX_WIDTH}, got {width}")


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{NAME}: activation must be None or 'silu', got {activation!r}")


def check_channels(op: str, channels: int) -> None:
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
    check_width(width)
    check_activation(activation)
    batch, seq, channels = x.shape
    check_channels(NAME, channels)
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
    check_width(width)
    check_activation(activation)
    check_channels("short_conv_step", x_t.shape[1])
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
