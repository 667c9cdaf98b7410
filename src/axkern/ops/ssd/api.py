"""`ssd`: the Mamba-2 state-space-duality layer, named and positional, its decode step, and the Op.

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
from haliax import NamedArray

from axkern.core import compat, named
from axkern.core.named import StepResult, WithFinalState
from axkern.core.op import Implementation, Op, step_op
from axkern.core.typing import Array, Float, Int, checked

from . import pallas_gpu, pallas_tpu, reference, xla
from .blocks import (
    SSDBlockSizes,
    bucket,
    heuristic,
    pallas_gpu_heuristic,
    pallas_gpu_space,
    pallas_tpu_heuristic,
    pallas_tpu_space,
    space,
)

__all__ = [
    "ssd",
    "ssd_step",
    "ssd_positional",
    "ssd_step_positional",
    "OP",
    "STEP_OP",
    "SSDBlockSizes",
]

NAME = "ssd"


def _gpu_order(spec) -> tuple[str, ...]:
    """16-bit inputs: `pallas_gpu`, then `xla` (the kernels are faster and need less than half
    the temporary memory); float32 inputs: `xla`, as Triton's exact float32 products make
    `pallas_gpu` several times slower (docs/ops/ssd.md, "Performance", has the figures)."""
    return ("pallas_gpu", "xla") if jnp.dtype(spec.dtype).itemsize <= 2 else ("xla",)


OP = Op(
    NAME,
    [
        Implementation(
            "xla",
            xla.ssd,
            block_sizes=SSDBlockSizes,
            heuristic=heuristic,
            space=space,
            backward="autodiff through the chunked scan (states saved per chunk)",
        ),
        Implementation(
            "pallas_gpu",
            pallas_gpu.ssd,
            platforms=("gpu",),
            supports=pallas_gpu.supports,
            block_sizes=SSDBlockSizes,
            heuristic=pallas_gpu_heuristic,
            space=pallas_gpu_space,
            interpretable=True,
            backward="custom_vjp: chunk-scan and chunk-state backward kernels, the reverse recurrence as a kernel",
        ),
        Implementation(
            "pallas_tpu",
            pallas_tpu.ssd,
            platforms=("tpu",),
            block_sizes=SSDBlockSizes,
            heuristic=pallas_tpu_heuristic,
            space=pallas_tpu_space,
            interpretable=True,
            backward="custom_vjp: the same backward kernels (TPU interpret mode only)",
        ),
        Implementation("reference", reference.ssd, backward="autodiff through the sequential scan"),
    ],
    # GPU: pallas_gpu first for 16-bit inputs, xla for float32 (`_gpu_order`); TPU: pallas_tpu
    # is verified in interpret mode only, in no default order until timed on a TPU
    default_order={"cpu": ("xla",), "gpu": _gpu_order, "tpu": ("xla",)},
    package=__package__,
    bucket=bucket,
)


STEP_OP = step_op("ssd_step", xla.step, reference.step, package=__package__)

SSDImplementation = Literal["xla", "pallas_gpu", "pallas_tpu", "reference"]
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


def _dt(dt, dt_bias, dt_softplus, dt_limit):
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
    if chunk_size is not None:
        if block_sizes is not None:
            raise ValueError(f"{NAME}: pass chunk_size or block_sizes, not both")
        block_sizes = SSDBlockSizes(chunk_size=chunk_size)
    if block_sizes is not None:
        cs = (
            block_sizes.chunk_size
            if isinstance(block_sizes, SSDBlockSizes)
            else block_sizes.get("chunk_size")
        )
        if not isinstance(cs, int) or cs < 1 or cs & (cs - 1):
            raise ValueError(f"{NAME}: chunk_size must be a power of two, got {cs!r}")
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
        _dt(dt, dt_bias, dt_softplus, dt_limit),
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
        _dt(dt_t, dt_bias, dt_softplus, dt_limit),
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


# -- named layer -------------------------------------------------------------------------------

ROLES = named.Roles(
    NAME,
    {
        "x": named.Arg(("batch", "Pos", "Heads", "HeadDim"), describe="batch axes + Pos + Heads + HeadDim"),
        "dt": named.Arg(("batch", "Pos", "Heads"), describe="x's batch axes + Pos + Heads"),
        "A": named.Arg(("Heads",), describe="Heads"),
        "B": named.Arg(("batch", "Pos", "Groups", "State"), describe="x's batch axes + Pos + Groups + State"),
        "C": named.Arg(("batch", "Pos", "Groups", "State"), describe="x's batch axes + Pos + Groups + State"),
        "D": named.Arg(("Heads",), optional=True, describe="Heads"),
        "D_per_dim": named.Arg(("Heads", "HeadDim"), optional=True, name="D", describe="Heads + HeadDim"),
        "z": named.Arg(("batch", "Pos", "Heads", "HeadDim"), optional=True, describe="x's axes"),
        "dt_bias": named.Arg(("Heads",), optional=True, describe="Heads"),
        "segment_ids": named.Arg(("batch", "Pos"), optional=True, describe="x's batch axes + Pos"),
        "initial_state": named.Arg(
            ("batch", "Heads", "HeadDim", "State"),
            optional=True,
            describe="x's batch axes + Heads + HeadDim + State",
        ),
    },
)
SHARDING = named.Sharding(
    parallel=("Pos",),
    describe="batch axes data parallel; Pos sequence parallel: every shard's final state and total "
    "decay all-gathered ([batch, heads, head_dim, state] per shard), each shard rerun from its "
    "incoming state",
)
STEP_ROLES = named.Roles(
    "ssd_step",
    {
        "x_t": named.Arg(("batch", "Heads", "HeadDim"), describe="batch axes + Heads + HeadDim"),
        "dt_t": named.Arg(("batch", "Heads"), describe="x_t's batch axes + Heads"),
        "A": named.Arg(("Heads",), describe="Heads"),
        "B_t": named.Arg(("batch", "Groups", "State"), describe="x_t's batch axes + Groups + State"),
        "C_t": named.Arg(("batch", "Groups", "State"), describe="x_t's batch axes + Groups + State"),
        "state": named.Arg(
            ("batch", "Heads", "HeadDim", "State"), describe="x_t's batch axes + Heads + HeadDim + State"
        ),
        "D": named.Arg(("Heads",), optional=True, describe="Heads"),
        "D_per_dim": named.Arg(("Heads", "HeadDim"), optional=True, name="D", describe="Heads + HeadDim"),
        "z_t": named.Arg(("batch", "Heads", "HeadDim"), optional=True, describe="x_t's axes"),
        "dt_bias": named.Arg(("Heads",), optional=True, describe="Heads"),
    },
)
STEP_SHARDING = named.Sharding(describe="batch axes data parallel; no communication")


def _split_D(D) -> dict:
    """`D` goes to the role table as `D` (over Heads) or `D_per_dim` (Heads + HeadDim)."""
    if D is None or len(getattr(D, "axes", ())) < 2:
        return {"D": D, "D_per_dim": None}
    return {"D": None, "D_per_dim": D}


def _check_groups(op, bound) -> None:
    heads, groups = bound.axis("Heads"), bound.axis("Groups")
    if groups.size == 0:
        raise ValueError(f"{op}: {groups.name} must be at least 1, got 0")
    if heads.size % groups.size:
        raise ValueError(f"{op}: {heads.name}={heads.size} is not divisible by {groups.name}={groups.size}")


def ssd(
    x: NamedArray,
    dt: NamedArray,
    A: NamedArray,
    B: NamedArray,
    C: NamedArray,
    *,
    Pos: named.AxisSelector = "position",
    Heads: named.AxisSelector = "heads",
    HeadDim: named.AxisSelector = "head_size",
    State: named.AxisSelector = "state",
    Groups: named.AxisSelector = "groups",
    chunk_size: int | None = None,
    D: NamedArray | None = None,
    z: NamedArray | None = None,
    dt_bias: NamedArray | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    segment_ids: NamedArray | None = None,
    initial_state: NamedArray | None = None,
    return_final_state: bool = False,
    implementation: SSDImplementation | tuple[SSDImplementation, ...] | None = None,
    block_sizes: SSDBlockSizes | dict | None = None,
) -> NamedArray | WithFinalState:
    """Mamba-2 SSD over named axes.

    **Arguments:** `x`: batch axes + `Pos` + `Heads` + `HeadDim`; `dt`: batch + `Pos` + `Heads`;
    `A`: `Heads`; `B`, `C`: batch + `Pos` + `Groups` + `State`; optional `D` (`Heads` or
    `Heads` + `HeadDim`), `z` (like `x`), `dt_bias` (`Heads`), `segment_ids` (batch + `Pos`;
    a change of id starts a segment from a zero state), `initial_state` (batch + `Heads` +
    `HeadDim` + `State`). Options as in `axkern.positional.ssd`.

    **Returns:** `y` with `x`'s axes, or `WithFinalState(y, final_state)` (`final_state` in
    `initial_state`'s axis order when given).

    !!! info "Sharding"
        Batch axes mapped to mesh axes run data parallel; a mapped `Pos` runs sequence
        parallel, passing states between shards (see `_sequence_parallel`).

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Pos, Heads, HeadDim = hax.Axis("position", 32), hax.Axis("heads", 2), hax.Axis("head_size", 4)
    >>> Groups, State = hax.Axis("groups", 1), hax.Axis("state", 4)
    >>> x = hax.random.normal(jax.random.PRNGKey(0), (Pos, Heads, HeadDim))
    >>> dt, A = hax.ones((Pos, Heads)) * 0.1, -hax.ones(Heads)
    >>> B = C = hax.random.normal(jax.random.PRNGKey(1), (Pos, Groups, State))
    >>> y, state = axkern.ssd(x, dt, A, B, C, chunk_size=16, return_final_state=True)
    >>> y.axes == x.axes, state.axes
    (True, (Axis(name='heads', size=2), Axis(name='head_size', size=4), Axis(name='state', size=4)))

    ```
    """
    bound = ROLES.bind(locals(), **_split_D(D))
    _check_groups(NAME, bound)
    options = dict(
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        chunk_size=chunk_size,
        implementation=implementation,
        block_sizes=block_sizes,
    )

    def body(ctx, xs, dts, As, Bs, Cs, D1s, D2s, zs, bias, segs, s0):
        args = (xs, dts, As, Bs, Cs)
        kw = dict(
            D=D1s if D2s is None else D2s, z=zs, dt_bias=bias, segment_ids=segs, initial_state=s0, **options
        )
        seq = ctx.mesh_axes("Pos")
        if seq is None:
            return tuple(ssd_positional(*args, return_final_state=True, **kw))
        return _sequence_parallel(args, kw, seq)

    outs = (
        named.Out(("batch", "Pos", "Heads", "HeadDim"), like="x"),
        named.Out(("batch", "Heads", "HeadDim", "State"), like=("initial_state",)),
    )
    y, final = bound.run(body, SHARDING, outs)
    return WithFinalState(y, final) if return_final_state else y


def ssd_step(
    x_t: NamedArray,
    dt_t: NamedArray,
    A: NamedArray,
    B_t: NamedArray,
    C_t: NamedArray,
    state: NamedArray,
    *,
    Heads: named.AxisSelector = "heads",
    HeadDim: named.AxisSelector = "head_size",
    State: named.AxisSelector = "state",
    Groups: named.AxisSelector = "groups",
    D: NamedArray | None = None,
    z_t: NamedArray | None = None,
    dt_bias: NamedArray | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    implementation: StepImplementation | tuple[StepImplementation, ...] | None = None,
    block_sizes: None = None,
) -> StepResult:
    """One SSD decode step over named axes: `x_t` batch axes + `Heads` + `HeadDim`, `dt_t` batch +
    `Heads`, `B_t`, `C_t` batch + `Groups` + `State`, `state` batch + `Heads` + `HeadDim` + `State`.

    **Returns:** `StepResult(y_t, new_state)` with `x_t`'s and `state`'s axes.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Heads, HeadDim, Groups, State = hax.Axis("heads", 2), hax.Axis("head_size", 4), hax.Axis("groups", 1), hax.Axis("state", 4)
    >>> x_t, dt_t, A = hax.ones((Heads, HeadDim)), hax.ones(Heads), -hax.ones(Heads)
    >>> B_t = C_t = hax.ones((Groups, State))
    >>> y_t, state = axkern.ssd_step(x_t, dt_t, A, B_t, C_t, hax.zeros((Heads, HeadDim, State)))
    >>> y_t.axes == x_t.axes, float(state.array[0, 0, 0])  # from a zero state: dt * x * B
    (True, 1.0)

    ```
    """
    bound = STEP_ROLES.bind(locals(), **_split_D(D))
    _check_groups("ssd_step", bound)

    def body(ctx, xs, dts, As, Bs, Cs, ss, D1s, D2s, zs, bias):
        out = ssd_step_positional(
            xs,
            dts,
            As,
            Bs,
            Cs,
            ss,
            D=D1s if D2s is None else D2s,
            z_t=zs,
            dt_bias=bias,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            implementation=implementation,
            block_sizes=block_sizes,
        )
        return tuple(out)

    outs = (
        named.Out(("batch", "Heads", "HeadDim"), like="x_t"),
        named.Out(("batch", "Heads", "HeadDim", "State"), like="state"),
    )
    return StepResult(*bound.run(body, STEP_SHARDING, outs))


def _sequence_parallel(args, kw, seq_mesh):
    """SSD on a sequence shard: each shard's incoming state from every earlier shard's.

    Pass 1 runs the shard from a zero state, giving its final state `S_i`; with `keep_i`
    (the shard's total decay `exp(sum dt A)`, zero if a segment starts inside it) the state
    entering shard `i` is the fold `h <- keep_j h + S_j` over earlier shards (all-gathered,
    one `[b, h, p, n]` per shard), started from the caller's state on shard 0 and dropped
    where the shard's first token starts a new segment. Pass 2 reruns the shard from that
    state: twice the local work, in exchange for exactness with any segment layout.
    """
    x, dt, A, B, C = args
    names = (seq_mesh,) if isinstance(seq_mesh, str) else tuple(seq_mesh)
    s0 = kw.pop("initial_state")
    batch, _, heads, head_dim = x.shape
    zero = jnp.zeros((batch, heads, head_dim, B.shape[3]), jnp.float32)
    _, S = ssd_positional(*args, initial_state=zero, return_final_state=True, **kw)
    dts = _dt(dt, kw.get("dt_bias"), kw["dt_softplus"], kw["dt_limit"])
    keep = jnp.exp(jnp.sum(dts * A.astype(dts.dtype), axis=1))  # [b, h]
    seg = kw.get("segment_ids")
    first_seg = last_seg = None
    if seg is not None:
        keep = keep * jnp.all(seg == seg[:, :1], axis=1)[:, None]
        first_seg, last_seg = seg[:, 0], seg[:, -1]
    idx = compat.axis_index(seq_mesh)
    shards = compat.axis_size(compat.current_mesh(), seq_mesh)

    def gather(a):  # every shard's `a`, stacked; a psum so the result is typed as replicated
        return jax.lax.psum(jnp.zeros((shards, *a.shape), a.dtype).at[idx].set(a), names)

    all_S, all_keep = gather(S), gather(keep)
    h = zero if s0 is None else s0.astype(jnp.float32)
    if seg is not None:
        all_first, all_last = gather(first_seg), gather(last_seg)
    h_in = h
    for j in range(shards):
        h_in = jnp.where(idx == j, h, h_in)  # the state entering shard j
        if seg is not None and j + 1 < shards:
            cont = (all_first[j + 1] == all_last[j])[:, None, None, None]
        else:
            cont = 1.0
        h = (all_keep[j][:, :, None, None] * h + all_S[j]) * cont
    return ssd_positional(*args, initial_state=h_in, return_final_state=True, **kw)[0], h
