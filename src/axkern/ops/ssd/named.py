"""`ssd` and `ssd_step` over named axes: their role tables bound to the caller's axes, and Pos
sequence parallel by passing states between shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from haliax import NamedArray

from axkern.core import compat, named
from axkern.core.named import StepResult, WithFinalState

from .api import (
    NAME,
    SSDBlockSizes,
    SSDImplementation,
    StepImplementation,
    prepared_dt,
    ssd_positional,
    ssd_step_positional,
)

__all__ = ["ssd", "ssd_step"]

# the role tables and sharding rules the named functions bind their arguments with
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
    arrays = dict(
        x=x, dt=dt, A=A, B=B, C=C, z=z, dt_bias=dt_bias, segment_ids=segment_ids, initial_state=initial_state
    )
    axes = dict(Pos=Pos, Heads=Heads, HeadDim=HeadDim, State=State, Groups=Groups)
    bound = ROLES.bind(arrays | _split_D(D), **axes)
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
    arrays = dict(x_t=x_t, dt_t=dt_t, A=A, B_t=B_t, C_t=C_t, state=state, z_t=z_t, dt_bias=dt_bias)
    axes = dict(Heads=Heads, HeadDim=HeadDim, State=State, Groups=Groups)
    bound = STEP_ROLES.bind(arrays | _split_D(D), **axes)
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
    dts = prepared_dt(dt, kw.get("dt_bias"), kw["dt_softplus"], kw["dt_limit"])
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
