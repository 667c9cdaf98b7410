"""`mamba3`: the Mamba-3 layer (SISO and MIMO) and its decode step: their Ops and positional
functions (the named functions and their role tables are in `named.py`).

mamba_ssm's layouts and semantics (`mamba3_siso_combined`): `q, k [.., L, G, N]` (C and B;
MIMO `[.., L, R, G, N]`), `v [.., L, H, P]` (x), `adt, dt, trap [.., H, L]`, `q_bias, k_bias
[H, N]` (MIMO `[H, R, N]`), `angles [.., L, H, A]` raw (`π tanh(angles) dt` is added to the angle
state inside), `D [H]`, `z` like `v`; `mimo=(W_x, W_z, W_o)`, each `[H, R, P]`. The state is a
`Mamba3State(angle [.., H, A], ssm [.., H, P, N], k [.., H, N] (MIMO [.., R, H, N]), v [.., H, P])`.
reference.py states the recurrence; common/layer.py the chunked form.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax.numpy as jnp

from axkern.core import kernels
from axkern.core.blocks import chunk_blocks
from axkern.core.named import StepResult, WithFinalState
from axkern.core.op import Implementation, Op, step_op
from axkern.core.typing import Array, Float, Int, checked

from . import mosaic_gpu, pallas_gpu, pallas_tpu, reference, xla
from .blocks import Mamba3BlockSizes, bucket

__all__ = ["mamba3_positional", "mamba3_step_positional", "Mamba3State", "OP", "STEP_OP", "Mamba3BlockSizes"]

NAME = "mamba3"


class Mamba3State(NamedTuple):
    """The recurrence's state after a position: the angles `Θ` (`[batch, heads, n_angles]`), the
    `[batch, heads, head_dim, state]` matrix `h`, and the last position's rotated `k`
    (`[batch, heads, state]`, MIMO `[batch, rank, heads, state]`) and `v` (`[batch, heads,
    head_dim]`), which the trapezoid weighs into the next position."""

    angle: Array
    ssm: Array
    k: Array
    v: Array


def _gpu_order(spec) -> tuple[str, ...]:
    """bf16 inputs: `mosaic_gpu` (Hopper, SISO, the head dims and states its tiles serve), then
    `pallas_gpu`, then `xla` (docs/ops/mamba3.md has the times behind this order, SISO and MIMO).
    fp16 and float32 inputs: `xla` (the kernels' exact float32 products for them are untimed)."""
    return ("mosaic_gpu", "pallas_gpu", "xla") if kernels.tf32_suffices(spec.dtype) else ("xla",)


OP = Op(
    NAME,
    [
        xla.IMPLEMENTATION,
        pallas_gpu.IMPLEMENTATION,
        mosaic_gpu.IMPLEMENTATION,
        pallas_tpu.IMPLEMENTATION,
        Implementation("reference", reference.mamba3, backward="autodiff through the sequential scan"),
    ],
    # TPU: pallas_tpu first, faster than xla forward and backward (training) on a v5e, SISO and
    # MIMO; its forward alone is a little slower (docs/tpu.md, Measured)
    default_order={"cpu": ("xla",), "gpu": _gpu_order, "tpu": ("pallas_tpu", "xla")},
    package=__package__,
    bucket=bucket,
)

STEP_OP = step_op("mamba3_step", xla.step, reference.step, package=__package__)

Mamba3Implementation = Literal["xla", "mosaic_gpu", "pallas_gpu", "pallas_tpu", "reference"]
StepImplementation = Literal["xla", "reference"]


def check_sizes(op, *, heads, groups, state, head_dim, n_angles, rank, mimo):
    """The ValueErrors of a bad call, each naming the sizes."""
    for axis, n in {"groups": groups, "state": state, "head_dim": head_dim, "rank": rank}.items():
        if n == 0:
            raise ValueError(f"{op}: {axis} must be at least 1, got 0")
    if heads % groups:
        raise ValueError(f"{op}: heads={heads} is not divisible by groups={groups}")
    if n_angles and state % 2:
        raise ValueError(f"{op}: n_angles={n_angles} rotates pairs of state dims, but state={state} is odd")
    if 2 * n_angles > state:
        raise ValueError(f"{op}: n_angles={n_angles} is more than state/2 = {state // 2}")
    if mimo is not None:
        if len(mimo) != 3:
            raise ValueError(f"{op}: mimo must be (W_x, W_z, W_o), got {len(mimo)} arrays")
        for name, w in zip(("W_x", "W_z", "W_o"), mimo, strict=True):
            if tuple(w.shape) != (heads, rank, head_dim):
                raise ValueError(
                    f"{op}: mimo's {name} has shape {tuple(w.shape)}, expected [heads, rank, head_dim] = "
                    f"{(heads, rank, head_dim)} (rank from q)"
                )


def _normalise(op, q, k, q_bias, k_bias, mimo, dims):
    """q, k as `[.., R, G, N]` and the biases as `[H, R, N]`, SISO with `R = 1` (`dims`: q's
    number of dims in SISO)."""
    if q.ndim != k.ndim:
        raise ValueError(f"{op}: q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    if mimo is None:
        if q.ndim != dims or q_bias.ndim != 2 or k_bias.ndim != 2:
            raise ValueError(
                f"{op}: without mimo, q and k have no rank axis (got {tuple(q.shape)}) and q_bias, k_bias are "
                f"[heads, state] (got {tuple(q_bias.shape)})"
            )
        return q[..., None, :, :], k[..., None, :, :], q_bias[:, None], k_bias[:, None]
    if q.ndim != dims + 1 or q_bias.ndim != 3 or k_bias.ndim != 3:
        raise ValueError(
            f"{op}: with mimo, q and k carry a rank axis before groups (got {tuple(q.shape)}) and "
            f"q_bias, k_bias are [heads, rank, state] (got {tuple(q_bias.shape)})"
        )
    return q, k, q_bias, k_bias


def _state_shapes(batch, heads, head_dim, state, n_angles, rank, mimo):
    k = (batch, rank, heads, state) if mimo else (batch, heads, state)
    return Mamba3State((batch, heads, n_angles), (batch, heads, head_dim, state), k, (batch, heads, head_dim))


def _initial(op, initial_state, shapes):
    if initial_state is None:
        return Mamba3State(*(jnp.zeros(s, jnp.float32) for s in shapes))
    if len(initial_state) != 4 or any(a is None for a in initial_state):
        raise ValueError(f"{op}: initial_state must hold all four of (angle, ssm, k, v)")
    initial_state = Mamba3State(*initial_state)
    for name, a, want in zip(Mamba3State._fields, initial_state, shapes, strict=True):
        if tuple(a.shape) != tuple(want):
            raise ValueError(f"{op}: initial_state.{name} has shape {tuple(a.shape)}, expected {tuple(want)}")
    return initial_state


QK = Float[Array, "batch length groups state"] | Float[Array, "batch length rank groups state"]
Bias = Float[Array, "heads state"] | Float[Array, "heads rank state"]
Scalars = Float[Array, "batch heads length"]


@checked
def mamba3_positional(
    q: QK,
    k: QK,
    v: Float[Array, "batch length heads head_dim"],
    adt: Scalars,
    dt: Scalars,
    trap: Scalars,
    q_bias: Bias,
    k_bias: Bias,
    angles: Float[Array, "batch length heads n_angles"],
    *,
    D: Float[Array, " heads"] | None = None,
    z: Float[Array, "batch length heads head_dim"] | None = None,
    initial_state: Mamba3State | tuple | None = None,
    return_final_state: bool = False,
    segment_ids: Int[Array, "batch length"] | None = None,
    mimo: tuple | None = None,
    chunk_size: int | None = None,
    implementation: Mamba3Implementation | tuple[Mamba3Implementation, ...] | None = None,
    block_sizes: Mamba3BlockSizes | dict | None = None,
) -> Float[Array, "batch length heads head_dim"] | WithFinalState:
    """Mamba-3 (SISO, or MIMO with `mimo=(W_x, W_z, W_o)`) on plain arrays.

    **Arguments:** `q, k [batch, length, groups, state]` (C and B; MIMO `[batch, length, rank,
    groups, state]`), `v [batch, length, heads, head_dim]` (x), `adt, dt, trap [batch, heads,
    length]` (`A·Δ`, `Δ`, the trapezoid's pre-sigmoid mix), `q_bias, k_bias [heads, state]` (MIMO
    `[heads, rank, state]`), `angles [batch, length, heads, n_angles]` raw (`π tanh(angles) dt`
    is added to the angle state); optional `D [heads]`, `z` like `v` (the gate `silu(z)`),
    `segment_ids [batch, length]` (a change of id starts a segment from a zero state),
    `initial_state` (a `Mamba3State`), `mimo=(W_x, W_z, W_o)`, each `[heads, rank, head_dim]`.

    **Returns:** `y` like `v`, or `WithFinalState(y, Mamba3State)`. Empty `batch`, `length` or
    `heads` give an empty `y` (and the initial state as the final one); an empty `head_dim`,
    `state`, `groups` or `rank`, heads not divisible by groups, `n_angles > state / 2`, an odd
    `state` with angles, or MIMO weights of another shape, is a `ValueError`.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, axkern
    >>> b, l, h, p, n = 1, 32, 2, 4, 8
    >>> q = k = jax.random.normal(jax.random.PRNGKey(0), (b, l, 1, n))  # batch, length, groups, state
    >>> v = jax.random.normal(jax.random.PRNGKey(1), (b, l, h, p))
    >>> adt, dt, trap = -0.1 * jnp.ones((b, h, l)), 0.1 * jnp.ones((b, h, l)), jnp.zeros((b, h, l))
    >>> bias, angles = jnp.ones((h, n)), jnp.zeros((b, l, h, 2))
    >>> y, state = axkern.positional.mamba3(q, k, v, adt, dt, trap, bias, bias, angles, return_final_state=True)
    >>> y.shape, state.ssm.shape
    ((1, 32, 2, 4), (1, 2, 4, 8))

    ```
    """
    batch, length, heads, head_dim = v.shape
    q, k, q_bias, k_bias = _normalise(NAME, q, k, q_bias, k_bias, mimo, 4)
    rank, groups, state = q.shape[2:]
    n_angles = angles.shape[-1]
    check_sizes(
        NAME,
        heads=heads,
        groups=groups,
        state=state,
        head_dim=head_dim,
        n_angles=n_angles,
        rank=rank,
        mimo=mimo,
    )
    block_sizes = chunk_blocks(NAME, Mamba3BlockSizes, chunk_size, block_sizes)
    shapes = _state_shapes(batch, heads, head_dim, state, n_angles, rank, mimo is not None)
    s0 = _initial(NAME, initial_state, shapes)
    if 0 in (batch, length, heads):  # nothing to scan: an empty y, the state passes through
        y = jnp.zeros(v.shape, v.dtype)
        return WithFinalState(y, s0) if return_final_state else y
    siso = mimo is None
    spec = OP.spec(
        {
            "batch": batch,
            "length": length,
            "heads": heads,
            "head_dim": head_dim,
            "groups": groups,
            "state": state,
            "rank": rank,
            "n_angles": n_angles,
        },
        v.dtype,
        segments=segment_ids is not None,
        mimo=not siso,
    )
    y, *finals = OP(
        spec,
        q,
        k,
        v,
        adt,
        dt,
        trap,
        q_bias,
        k_bias,
        angles,
        D,
        z,
        segment_ids,
        s0.angle,
        s0.ssm,
        s0.k[:, None] if siso else s0.k,
        s0.v,
        *((None, None, None) if siso else mimo),
        implementation=implementation,
        block_sizes=block_sizes,
    )
    final = Mamba3State(finals[0], finals[1], finals[2][:, 0] if siso else finals[2], finals[3])
    return WithFinalState(y, final) if return_final_state else y


QK_t = Float[Array, "batch groups state"] | Float[Array, "batch rank groups state"]


@checked
def mamba3_step_positional(
    q_t: QK_t,
    k_t: QK_t,
    v_t: Float[Array, "batch heads head_dim"],
    adt_t: Float[Array, "batch heads"],
    dt_t: Float[Array, "batch heads"],
    trap_t: Float[Array, "batch heads"],
    q_bias: Bias,
    k_bias: Bias,
    angles_t: Float[Array, "batch heads n_angles"],
    state: Mamba3State | tuple,
    *,
    D: Float[Array, " heads"] | None = None,
    z_t: Float[Array, "batch heads head_dim"] | None = None,
    mimo: tuple | None = None,
    implementation: StepImplementation | tuple[StepImplementation, ...] | None = None,
    block_sizes: None = None,
) -> StepResult:
    """One decode step: `StepResult(y_t [batch, heads, head_dim], new Mamba3State)`; the arguments
    are `mamba3`'s at one position (no length axis). `L` steps equal a length-`L` call.

    `block_sizes` is accepted for a uniform signature; the step is not blocked.

    **Example:**

    ```python
    >>> import jax.numpy as jnp, axkern
    >>> b, h, p, n = 1, 2, 4, 8
    >>> state = axkern.Mamba3State(jnp.zeros((b, h, 2)), jnp.zeros((b, h, p, n)), jnp.zeros((b, h, n)), jnp.zeros((b, h, p)))
    >>> q = jnp.ones((b, 1, n))
    >>> y_t, state = axkern.positional.mamba3_step(q, q, jnp.ones((b, h, p)), -jnp.ones((b, h)), jnp.ones((b, h)),
    ...     jnp.zeros((b, h)), jnp.zeros((h, n)), jnp.zeros((h, n)), jnp.zeros((b, h, 2)), state)
    >>> y_t.shape, state.ssm.shape
    ((1, 2, 4), (1, 2, 4, 8))

    ```
    """
    op = "mamba3_step"
    batch, heads, head_dim = v_t.shape
    q_t, k_t, q_bias, k_bias = _normalise(op, q_t, k_t, q_bias, k_bias, mimo, 3)
    rank, groups, n = q_t.shape[1:]
    n_angles = angles_t.shape[-1]
    check_sizes(
        op, heads=heads, groups=groups, state=n, head_dim=head_dim, n_angles=n_angles, rank=rank, mimo=mimo
    )
    siso = mimo is None
    state = _initial(op, state, _state_shapes(batch, heads, head_dim, n, n_angles, rank, not siso))
    if 0 in (batch, heads):
        return StepResult(jnp.zeros(v_t.shape, v_t.dtype), state)
    spec = STEP_OP.spec(
        {"batch": batch, "heads": heads, "head_dim": head_dim, "groups": groups, "state": n, "rank": rank},
        v_t.dtype,
    )
    y, *new = STEP_OP(
        spec,
        q_t,
        k_t,
        v_t,
        adt_t,
        dt_t,
        trap_t,
        q_bias,
        k_bias,
        angles_t,
        D,
        z_t,
        state.angle,
        state.ssm,
        state.k[:, None] if siso else state.k,
        state.v,
        *((None, None, None) if siso else mimo),
        implementation=implementation,
        block_sizes=block_sizes,
    )
    return StepResult(y, Mamba3State(new[0], new[1], new[2][:, 0] if siso else new[2], new[3]))
