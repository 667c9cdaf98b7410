"""`ssd`: the Mamba-2 state-space-duality layer and its decode step: their Ops and positional
functions (the named functions and their role tables are in `named.py`).

`state_t = exp(dt_t A) state_{t-1} + dt_t x_t ⊗ B_t`, `y_t = C_t · state_t + D x_t`, gated by
`silu(z)` when `z` is given, with mamba_ssm's shapes: `x [.., L, H, P]`, `dt [.., L, H]`,
`A [H]`, `B, C [.., L, G, N]` (heads split evenly over groups), `D [H]` or `[H, P]`. `dt` is
first shifted by `dt_bias`, passed through softplus (`dt_softplus`) and clipped to `dt_limit`.
A positive `A` makes the state grow without bound: allowed, and on the caller.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from axkern.core import kernels
from axkern.core.blocks import chunk_blocks
from axkern.core.named import StepResult, WithFinalState
from axkern.core.op import Implementation, Op, step_op
from axkern.core.typing import Array, Float, Int, checked

from . import mosaic_gpu, pallas_gpu, pallas_tpu, reference, xla
from .blocks import SSDBlockSizes, bucket

__all__ = [
    "ssd_positional",
    "ssd_step_positional",
    "OP",
    "STEP_OP",
    "SSDBlockSizes",
]

NAME = "ssd"


def _gpu_order(spec) -> tuple[str, ...]:
    """bf16 inputs: `mosaic_gpu` (Hopper, the head dims and states its tiles serve), then
    `pallas_gpu`, then `xla`; fp16 and float32 inputs: `xla`, as the kernels' exact float32
    products for them are slower than its (docs/ops/ssd.md, "Performance", has the times behind
    this order)."""
    return ("mosaic_gpu", "pallas_gpu", "xla") if kernels.tf32_suffices(spec.dtype) else ("xla",)


OP = Op(
    NAME,
    [
        xla.IMPLEMENTATION,
        pallas_gpu.IMPLEMENTATION,
        mosaic_gpu.IMPLEMENTATION,
        pallas_tpu.IMPLEMENTATION,
        Implementation("reference", reference.ssd, backward="autodiff through the sequential scan"),
    ],
    # GPU: mosaic_gpu then pallas_gpu for 16-bit inputs, xla for float32 (`_gpu_order`); TPU:
    # pallas_tpu first, as measured on the chip (compiled, within the oracle rule, faster than
    # xla: docs/tpu.md), xla for what it cannot serve
    default_order={"cpu": ("xla",), "gpu": _gpu_order, "tpu": ("pallas_tpu", "xla")},
    package=__package__,
    bucket=bucket,
)


STEP_OP = step_op("ssd_step", xla.step, reference.step, package=__package__)

SSDImplementation = Literal["xla", "pallas_gpu", "mosaic_gpu", "pallas_tpu", "reference"]
StepImplementation = Literal["xla", "reference"]


def _check_sizes(op, heads, groups, **features):
    """Empty feature axes (`head_dim`, `state`) and `groups` are refused, naming the axis; heads
    must be a multiple of groups."""
    for axis, n in {"groups": groups, **features}.items():
        if n == 0:
            raise ValueError(f"{op}: {axis} must be at least 1, got 0")
    if heads % groups:
        raise ValueError(f"{op}: heads={heads} is not divisible by groups={groups}")


def _check_dt_limit(op, dt_limit):
    if dt_limit is None:
        return
    lo, hi = (float(v) for v in dt_limit)
    if not lo <= hi:  # also false for a NaN bound
        raise ValueError(f"{op}: dt_limit must be (low, high) with low <= high, got {dt_limit!r}")


def prepared_dt(dt, dt_bias, dt_softplus, dt_limit):
    """`dt` as the implementations take it: shifted by `dt_bias`, through softplus, clipped to
    `dt_limit`, in float32 (or wider)."""
    acc = jnp.promote_types(dt.dtype, jnp.float32)
    dt = dt.astype(acc)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(acc)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    if dt_limit is not None:
        dt = jnp.clip(dt, dt_limit[0], dt_limit[1])
    return dt


@checked
def ssd_positional(
    x: Float[Array, "batch length heads head_dim"],
    dt: Float[Array, "batch length heads"],
    A: Float[Array, " heads"],
    B: Float[Array, "batch length groups state"],
    C: Float[Array, "batch length groups state"],
    *,
    D: Float[Array, " heads"] | Float[Array, "heads head_dim"] | None = None,
    z: Float[Array, "batch length heads head_dim"] | None = None,
    dt_bias: Float[Array, " heads"] | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    segment_ids: Int[Array, "batch length"] | None = None,
    initial_state: Float[Array, "batch heads head_dim state"] | None = None,
    return_final_state: bool = False,
    chunk_size: int | None = None,
    implementation: SSDImplementation | tuple[SSDImplementation, ...] | None = None,
    block_sizes: SSDBlockSizes | dict | None = None,
) -> Float[Array, "batch length heads head_dim"] | WithFinalState:
    """Mamba-2 SSD on plain arrays.

    **Arguments:** `x [batch, length, heads, head_dim]`, `dt [batch, length, heads]`,
    `A [heads]`, `B, C [batch, length, groups, state]`; optional `D [heads]` or
    `[heads, head_dim]`, `z` like `x`, `dt_bias [heads]`, `segment_ids [batch, length]` (a
    change of id starts a segment from a zero state), `initial_state [batch, heads, head_dim,
    state]`. `dt` is shifted by `dt_bias`, passed through softplus when `dt_softplus` and
    clipped to `dt_limit`.

    **Returns:** `y` like `x`, or `WithFinalState(y, final_state [batch, heads, head_dim, state])`.
    Empty `batch`, `length` or `heads` give an empty `y` (and the initial state as the final
    one); an empty `head_dim`, `state` or `groups`, or a `dt_limit` with low > high, is a
    `ValueError`.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> x = jax.random.normal(jax.random.PRNGKey(0), (1, 32, 2, 4))  # batch, length, heads, head_dim
    >>> dt, A = jnp.full((1, 32, 2), 0.1), -jnp.ones(2)
    >>> B = C = jax.random.normal(jax.random.PRNGKey(1), (1, 32, 1, 4))  # batch, length, groups, state
    >>> axkern.positional.ssd(x, dt, A, B, C, chunk_size=16).shape
    (1, 32, 2, 4)

    ```
    """
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    _check_sizes(NAME, heads, groups, head_dim=head_dim, state=state)
    _check_dt_limit(NAME, dt_limit)
    block_sizes = chunk_blocks(NAME, SSDBlockSizes, chunk_size, block_sizes)
    s0 = jnp.zeros((batch, heads, head_dim, state), jnp.float32) if initial_state is None else initial_state
    if 0 in (batch, length, heads):  # nothing to scan: an empty y, the state passes through
        y = jnp.zeros(x.shape, x.dtype)
        return WithFinalState(y, s0) if return_final_state else y
    spec = OP.spec(
        {
            "batch": batch,
            "length": length,
            "heads": heads,
            "head_dim": head_dim,
            "groups": groups,
            "state": state,
        },
        x.dtype,
        segments=segment_ids is not None,
    )
    y, final = OP(
        spec,
        x,
        prepared_dt(dt, dt_bias, dt_softplus, dt_limit),
        A,
        B,
        C,
        D,
        z,
        segment_ids,
        s0,
        implementation=implementation,
        block_sizes=block_sizes,
    )
    return WithFinalState(y, final) if return_final_state else y


@checked
def ssd_step_positional(
    x_t: Float[Array, "batch heads head_dim"],
    dt_t: Float[Array, "batch heads"],
    A: Float[Array, " heads"],
    B_t: Float[Array, "batch groups state"],
    C_t: Float[Array, "batch groups state"],
    state: Float[Array, "batch heads head_dim state"],
    *,
    D: Float[Array, " heads"] | Float[Array, "heads head_dim"] | None = None,
    z_t: Float[Array, "batch heads head_dim"] | None = None,
    dt_bias: Float[Array, " heads"] | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    implementation: StepImplementation | tuple[StepImplementation, ...] | None = None,
    block_sizes: None = None,
) -> StepResult:
    """One decode step: `StepResult(y_t [batch, heads, head_dim], new_state)`.

    `block_sizes` is accepted for a uniform signature; the step is not blocked.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> y_t, state = axkern.positional.ssd_step(
    ...     jnp.ones((1, 2, 4)), jnp.ones((1, 2)), -jnp.ones(2), jnp.ones((1, 1, 4)), jnp.ones((1, 1, 4)),
    ...     jnp.zeros((1, 2, 4, 4)))
    >>> y_t.shape, state.shape
    ((1, 2, 4), (1, 2, 4, 4))

    ```
    """
    batch, heads, head_dim = x_t.shape
    groups, n = B_t.shape[1], B_t.shape[2]
    _check_sizes("ssd_step", heads, groups, head_dim=head_dim, state=n)
    _check_dt_limit("ssd_step", dt_limit)
    if 0 in (batch, heads):
        return StepResult(jnp.zeros(x_t.shape, x_t.dtype), state)
    spec = STEP_OP.spec(
        {"batch": batch, "heads": heads, "head_dim": head_dim, "groups": groups, "state": n}, x_t.dtype
    )
    y, new = STEP_OP(
        spec,
        x_t,
        prepared_dt(dt_t, dt_bias, dt_softplus, dt_limit),
        A,
        B_t,
        C_t,
        state,
        D,
        z_t,
        implementation=implementation,
        block_sizes=block_sizes,
    )
    return StepResult(y, new)
