"""`ssd`: the Mamba-2 state-space-duality layer, named and positional, its decode step, and the Op.

`state_t = exp(dt_t A) state_{t-1} + dt_t x_t ⊗ B_t`, `y_t = C_t · state_t + D x_t`, gated by
`silu(z)` when `z` is given, with mamba_ssm's shapes: `x [.., L, H, P]`, `dt [.., L, H]`,
`A [H]`, `B, C [.., L, G, N]` (heads split evenly over groups), `D [H]` or `[H, P]`. `dt` is
first shifted by `dt_bias`, passed through softplus (`dt_softplus`) and clipped to `dt_limit`.
A positive `A` makes the state grow without bound: allowed, and on the caller.
"""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from axkern.core import named
from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Float, Int, checked

from . import reference, xla
from .blocks import SSDBlockSizes, bucket, heuristic

__all__ = ["ssd", "ssd_positional", "ssd_step_positional", "OP", "SSDBlockSizes"]

NAME = "ssd"

OP = Op(
    NAME,
    [
        Implementation(
            "xla",
            xla.ssd,
            block_sizes=SSDBlockSizes,
            heuristic=heuristic,
            backward="autodiff through the chunked scan (states saved per chunk)",
        ),
        Implementation("reference", reference.ssd, backward="autodiff through the sequential scan"),
    ],
    default_order={"cpu": ("xla",), "gpu": ("xla",), "tpu": ("xla",)},
    package=__package__,
    bucket=bucket,
)


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
    implementation: str | tuple[str, ...] | None = None,
    block_sizes: SSDBlockSizes | dict | None = None,
):
    """Mamba-2 SSD on plain arrays. **Returns:** `y` like `x`, or `(y, final_state [batch, heads, head_dim, state])`."""
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    if heads % groups:
        raise ValueError(f"{NAME}: heads={heads} is not divisible by groups={groups}")
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
    return (y, final) if return_final_state else y


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
):
    """One decode step: `(y_t [batch, heads, head_dim], new_state)`."""
    y, final = reference.ssd(
        x_t[:, None],
        _dt(dt_t, dt_bias, dt_softplus, dt_limit)[:, None],
        A,
        B_t[:, None],
        C_t[:, None],
        D,
        None if z_t is None else z_t[:, None],
        None,
        state,
    )
    return y[:, 0], final


def ssd(
    x: NamedArray,
    dt: NamedArray,
    A: NamedArray,
    B: NamedArray,
    C: NamedArray,
    *,
    Pos="position",
    Heads="heads",
    HeadDim="head_dim",
    State="state",
    Groups="groups",
    chunk_size: int | None = None,
    D: NamedArray | None = None,
    z: NamedArray | None = None,
    dt_bias: NamedArray | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    segment_ids: NamedArray | None = None,
    initial_state: NamedArray | None = None,
    return_final_state: bool = False,
    implementation: str | tuple[str, ...] | None = None,
    block_sizes: SSDBlockSizes | dict | None = None,
):
    """Mamba-2 SSD over named axes.

    **Arguments:** `x`: batch axes + `Pos` + `Heads` + `HeadDim`; `dt`: batch + `Pos` + `Heads`;
    `A`: `Heads`; `B`, `C`: batch + `Pos` + `Groups` + `State`; optional `D` (`Heads` or
    `Heads` + `HeadDim`), `z` (like `x`), `dt_bias` (`Heads`), `segment_ids` (batch + `Pos`),
    `initial_state` (batch + `Heads` + `HeadDim` + `State`).

    **Returns:** `y` with `x`'s axes, or `(y, final_state)`.
    """
    for arg, value in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        named.require_named(NAME, arg, value)
    pos = named.resolve(NAME, "x", x, Pos, "Pos")
    heads = named.resolve(NAME, "x", x, Heads, "Heads")
    head_dim = named.resolve(NAME, "x", x, HeadDim, "HeadDim")
    groups = named.resolve(NAME, "B", B, Groups, "Groups")
    state = named.resolve(NAME, "B", B, State, "State")
    if heads.size % groups.size:
        raise ValueError(f"{NAME}: {heads.name}={heads.size} is not divisible by {groups.name}={groups.size}")
    batch = named.without(x, pos.name, heads.name, head_dim.name)
    n = len(batch)

    def flat(arr, axes, arg, ref):
        data = named.match_axes(NAME, arg, arr, axes, ref)
        return named.flatten(data, n) if n else data[None]

    xs = flat(x, batch + (pos, heads, head_dim), "x", "batch + Pos + Heads + HeadDim")
    dts = flat(dt, batch + (pos, heads), "dt", "x's batch axes + Pos + Heads")
    As = named.match_axes(NAME, "A", A, (heads,), "Heads")
    Bs = flat(B, batch + (pos, groups, state), "B", "x's batch axes + Pos + Groups + State")
    Cs = flat(C, batch + (pos, groups, state), "C", "x's batch axes + Pos + Groups + State")
    Ds = None
    if D is not None:
        Ds = named.match_axes(
            NAME, "D", D, (heads,) if len(D.axes) == 1 else (heads, head_dim), "Heads [+ HeadDim]"
        )
    zs = None if z is None else flat(z, batch + (pos, heads, head_dim), "z", "x's axes")
    bias = None if dt_bias is None else named.match_axes(NAME, "dt_bias", dt_bias, (heads,), "Heads")
    segs = (
        None
        if segment_ids is None
        else flat(segment_ids, batch + (pos,), "segment_ids", "x's batch axes + Pos")
    )
    s0 = None
    if initial_state is not None:
        s0 = flat(
            initial_state,
            batch + (heads, head_dim, state),
            "initial_state",
            "batch + Heads + HeadDim + State",
        )
    y, final = ssd_positional(
        xs,
        dts,
        As,
        Bs,
        Cs,
        D=Ds,
        z=zs,
        dt_bias=bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        segment_ids=segs,
        initial_state=s0,
        return_final_state=True,
        chunk_size=chunk_size,
        implementation=implementation,
        block_sizes=block_sizes,
    )
    lead = tuple(a.size for a in batch)
    y = hax.named(y.reshape(lead + y.shape[1:]) if n else y[0], batch + (pos, heads, head_dim))
    if tuple(a.name for a in x.axes) != tuple(a.name for a in y.axes):
        y = y.rearrange(x.axes)
    if not return_final_state:
        return y
    final = hax.named(
        final.reshape(lead + final.shape[1:]) if n else final[0], batch + (heads, head_dim, state)
    )
    return y, final
