"""`mamba3` and `mamba3_step` over named axes: the role tables of `api.py` (SISO and MIMO) bound
to the caller's axes. Batch axes run data parallel; every other axis is gathered."""

from __future__ import annotations

from haliax import NamedArray

from axkern.core import named
from axkern.core.named import StepResult, WithFinalState

from .api import (
    Mamba3BlockSizes,
    Mamba3Implementation,
    Mamba3State,
    StepImplementation,
    mamba3_positional,
    mamba3_step_positional,
)

__all__ = ["mamba3", "mamba3_step"]

NAME = "mamba3"


def _arg(roles, optional=False):
    return named.Arg(tuple(roles), optional=optional, describe=" + ".join(roles))


def _roles(op, *, mimo, step):
    pos = () if step else ("Pos",)
    rank = ("Rank",) if mimo else ()
    sfx = "_t" if step else ""
    table = {
        "v" + sfx: _arg(("batch", *pos, "Heads", "HeadDim")),
        "q" + sfx: _arg(("batch", *pos, *rank, "Groups", "State")),
        "k" + sfx: _arg(("batch", *pos, *rank, "Groups", "State")),
        "adt" + sfx: _arg(("batch", "Heads", *pos)),
        "dt" + sfx: _arg(("batch", "Heads", *pos)),
        "trap" + sfx: _arg(("batch", "Heads", *pos)),
        "q_bias": _arg(("Heads", *rank, "State")),
        "k_bias": _arg(("Heads", *rank, "State")),
        "angles" + sfx: _arg(("batch", *pos, "Heads", "Angles")),
        "D": _arg(("Heads",), optional=True),
        "z" + sfx: _arg(("batch", *pos, "Heads", "HeadDim"), optional=True),
    }
    if not step:
        table["segment_ids"] = _arg(("batch", "Pos"), optional=True)
    table |= {
        "angle_state": _arg(("batch", "Heads", "Angles"), optional=not step),
        "ssm_state": _arg(("batch", "Heads", "HeadDim", "State"), optional=not step),
        "k_state": _arg(("batch", *rank, "Heads", "State"), optional=not step),
        "v_state": _arg(("batch", "Heads", "HeadDim"), optional=not step),
    }
    if mimo:
        table |= {w: _arg(("Heads", "Rank", "HeadDim")) for w in ("W_x", "W_z", "W_o")}
    return named.Roles(op, table)


ROLES = {mimo: _roles(NAME, mimo=mimo, step=False) for mimo in (False, True)}
STEP_ROLES = {mimo: _roles("mamba3_step", mimo=mimo, step=True) for mimo in (False, True)}
SHARDING = named.Sharding(describe="batch axes data parallel; every other axis gathered")


def _state_outs(mimo):
    rank = ("Rank",) if mimo else ()
    return (
        named.Out(("batch", "Heads", "Angles"), like="angle_state"),
        named.Out(("batch", "Heads", "HeadDim", "State"), like="ssm_state"),
        named.Out(("batch", *rank, "Heads", "State"), like="k_state"),
        named.Out(("batch", "Heads", "HeadDim"), like="v_state"),
    )


def _states(state) -> dict:
    if state is None:
        return {f"{f}_state": None for f in Mamba3State._fields}
    return {f"{f}_state": a for f, a in zip(Mamba3State._fields, Mamba3State(*state), strict=True)}


def _weights(mimo) -> dict:
    return {} if mimo is None else dict(zip(("W_x", "W_z", "W_o"), mimo, strict=True))


def mamba3(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    adt: NamedArray,
    dt: NamedArray,
    trap: NamedArray,
    q_bias: NamedArray,
    k_bias: NamedArray,
    angles: NamedArray,
    *,
    Pos: named.AxisSelector = "position",
    Heads: named.AxisSelector = "heads",
    HeadDim: named.AxisSelector = "head_size",
    State: named.AxisSelector = "state",
    Groups: named.AxisSelector = "groups",
    Angles: named.AxisSelector = "angles",
    Rank: named.AxisSelector = "rank",
    D: NamedArray | None = None,
    z: NamedArray | None = None,
    segment_ids: NamedArray | None = None,
    initial_state: Mamba3State | None = None,
    return_final_state: bool = False,
    mimo: tuple[NamedArray, NamedArray, NamedArray] | None = None,
    chunk_size: int | None = None,
    implementation: Mamba3Implementation | tuple[Mamba3Implementation, ...] | None = None,
    block_sizes: Mamba3BlockSizes | dict | None = None,
) -> NamedArray | WithFinalState:
    """Mamba-3 over named axes (SISO, or MIMO with `mimo=(W_x, W_z, W_o)`).

    **Arguments:** `v`: batch axes + `Pos` + `Heads` + `HeadDim`; `q`, `k`: batch + `Pos` +
    `Groups` + `State` (MIMO: + `Rank`); `adt`, `dt`, `trap`: batch + `Heads` + `Pos`; `q_bias`,
    `k_bias`: `Heads` + `State` (MIMO: + `Rank`); `angles`: batch + `Pos` + `Heads` + `Angles`;
    optional `D` (`Heads`), `z` (like `v`), `segment_ids` (batch + `Pos`; a change of id starts a
    segment from a zero state), `initial_state` (a `Mamba3State` of named arrays), `mimo`
    (`W_x`, `W_z`, `W_o`, each `Heads` + `Rank` + `HeadDim`). Options as in
    `axkern.positional.mamba3`.

    **Returns:** `y` with `v`'s axes, or `WithFinalState(y, Mamba3State)` (each state in the
    initial state's axis order when given).

    **Example:**

    ```python
    >>> import haliax as hax, jax, axkern
    >>> Pos, Heads, HeadDim = hax.Axis("position", 32), hax.Axis("heads", 2), hax.Axis("head_size", 4)
    >>> Groups, State, Angles = hax.Axis("groups", 1), hax.Axis("state", 8), hax.Axis("angles", 2)
    >>> q = k = hax.random.normal(jax.random.PRNGKey(0), (Pos, Groups, State))
    >>> v = hax.random.normal(jax.random.PRNGKey(1), (Pos, Heads, HeadDim))
    >>> adt, dt, trap = hax.ones((Heads, Pos)) * -0.1, hax.ones((Heads, Pos)) * 0.1, hax.zeros((Heads, Pos))
    >>> bias, angles = hax.ones((Heads, State)), hax.zeros((Pos, Heads, Angles))
    >>> y, state = axkern.mamba3(q, k, v, adt, dt, trap, bias, bias, angles, return_final_state=True)
    >>> y.axes == v.axes, state.ssm.axes
    (True, (Axis(name='heads', size=2), Axis(name='head_size', size=4), Axis(name='state', size=8)))

    ```
    """
    roles = ROLES[mimo is not None]
    arrays = dict(
        q=q, k=k, v=v, adt=adt, dt=dt, trap=trap, q_bias=q_bias, k_bias=k_bias, angles=angles, D=D, z=z
    )
    axes = dict(Pos=Pos, Heads=Heads, HeadDim=HeadDim, State=State, Groups=Groups, Angles=Angles, Rank=Rank)
    bound = roles.bind(
        arrays | {"segment_ids": segment_ids} | _states(initial_state) | _weights(mimo), **axes
    )
    options = dict(chunk_size=chunk_size, implementation=implementation, block_sizes=block_sizes)

    def body(ctx, vs, qs, ks, adts, dts, traps, qbs, kbs, angs, Ds, zs, segs, a0, s0, k0, v0, *ws):
        init = None if s0 is None else (a0, s0, k0, v0)
        y, final = mamba3_positional(
            qs,
            ks,
            vs,
            adts,
            dts,
            traps,
            qbs,
            kbs,
            angs,
            D=Ds,
            z=zs,
            segment_ids=segs,
            initial_state=init,
            return_final_state=True,
            mimo=tuple(ws) if ws else None,
            **options,
        )
        return (y, *final)

    outs = (named.Out(("batch", "Pos", "Heads", "HeadDim"), like="v"), *_state_outs(mimo is not None))
    y, *final = bound.run(body, SHARDING, outs)
    return WithFinalState(y, Mamba3State(*final)) if return_final_state else y


def mamba3_step(
    q_t: NamedArray,
    k_t: NamedArray,
    v_t: NamedArray,
    adt_t: NamedArray,
    dt_t: NamedArray,
    trap_t: NamedArray,
    q_bias: NamedArray,
    k_bias: NamedArray,
    angles_t: NamedArray,
    state: Mamba3State,
    *,
    Heads: named.AxisSelector = "heads",
    HeadDim: named.AxisSelector = "head_size",
    State: named.AxisSelector = "state",
    Groups: named.AxisSelector = "groups",
    Angles: named.AxisSelector = "angles",
    Rank: named.AxisSelector = "rank",
    D: NamedArray | None = None,
    z_t: NamedArray | None = None,
    mimo: tuple[NamedArray, NamedArray, NamedArray] | None = None,
    implementation: StepImplementation | tuple[StepImplementation, ...] | None = None,
    block_sizes: None = None,
) -> StepResult:
    """One Mamba-3 decode step over named axes: `mamba3`'s arguments at one position (no `Pos`),
    and the `Mamba3State` to continue from.

    **Returns:** `StepResult(y_t, new Mamba3State)` with `v_t`'s and `state`'s axes.

    **Example:**

    ```python
    >>> import haliax as hax, axkern
    >>> Heads, HeadDim, Groups = hax.Axis("heads", 2), hax.Axis("head_size", 4), hax.Axis("groups", 1)
    >>> State, Angles = hax.Axis("state", 8), hax.Axis("angles", 2)
    >>> state = axkern.Mamba3State(hax.zeros((Heads, Angles)), hax.zeros((Heads, HeadDim, State)),
    ...     hax.zeros((Heads, State)), hax.zeros((Heads, HeadDim)))
    >>> q_t, v_t, one = hax.ones((Groups, State)), hax.ones((Heads, HeadDim)), hax.ones(Heads)
    >>> y_t, state = axkern.mamba3_step(q_t, q_t, v_t, -one, one, one * 0, hax.zeros((Heads, State)),
    ...     hax.zeros((Heads, State)), hax.zeros((Heads, Angles)), state)
    >>> y_t.axes == v_t.axes, float(state.ssm.array[0, 0, 0])  # from a zero state: sigmoid(0) * dt * v * k
    (True, 0.5)

    ```
    """
    roles = STEP_ROLES[mimo is not None]
    arrays = dict(
        q_t=q_t, k_t=k_t, v_t=v_t, adt_t=adt_t, dt_t=dt_t, trap_t=trap_t, q_bias=q_bias, k_bias=k_bias
    )
    arrays |= dict(angles_t=angles_t, D=D, z_t=z_t)
    axes = dict(Heads=Heads, HeadDim=HeadDim, State=State, Groups=Groups, Angles=Angles, Rank=Rank)
    bound = roles.bind(arrays | _states(state) | _weights(mimo), **axes)

    def body(ctx, vs, qs, ks, adts, dts, traps, qbs, kbs, angs, Ds, zs, a0, s0, k0, v0, *ws):
        y, new = mamba3_step_positional(
            qs,
            ks,
            vs,
            adts,
            dts,
            traps,
            qbs,
            kbs,
            angs,
            (a0, s0, k0, v0),
            D=Ds,
            z_t=zs,
            mimo=tuple(ws) if ws else None,
            implementation=implementation,
            block_sizes=block_sizes,
        )
        return (y, *new)

    outs = (named.Out(("batch", "Heads", "HeadDim"), like="v_t"), *_state_outs(mimo is not None))
    y, *new = bound.run(body, named.Sharding(describe="batch axes data parallel; no communication"), outs)
    return StepResult(y, Mamba3State(*new))
