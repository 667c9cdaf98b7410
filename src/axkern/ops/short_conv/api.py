"""`short_conv`: the named function, its positional form, the decode step, and the `Op` behind them.

`y[b, t, c] = act(bias[c] + sum_{k < W} weight[k, c] * x[b, t - k, c])`: a causal depthwise
convolution of width `W` (1..8) over the sequence. Positions before the start read the
`initial_state` (the `W-1` previous inputs, oldest first); with `segment_ids` a tap never
reads a position of another segment (packed documents stay independent; the state belongs
to the sequence's first segment). Segment ids are runs of equal ids, as packing makes them.
"""

from __future__ import annotations

import functools

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax import lax

from axkern.core import compat, named
from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Float, Int, checked

from . import pallas_gpu, pallas_tpu, reference, xla
from .blocks import ConvBlockSizes, bucket, heuristic
from .shifts import extended

__all__ = ["short_conv", "short_conv_positional", "short_conv_step", "short_conv_step_positional", "OP"]

NAME = "short_conv"
MAX_WIDTH = 8
ACTIVATIONS = (None, "silu")
STATE_AXIS = "conv_state"

OP = Op(
    NAME,
    [
        Implementation(
            "pallas_gpu",
            pallas_gpu.conv,
            platforms=("gpu",),
            block_sizes=ConvBlockSizes,
            heuristic=heuristic,
            interpretable=True,
            backward="custom_vjp: one Pallas kernel (dx, partial dw/dbias), state grad in JAX",
        ),
        Implementation(
            "pallas_tpu",
            pallas_tpu.conv,
            platforms=("tpu",),
            block_sizes=ConvBlockSizes,
            heuristic=heuristic,
            interpretable=True,
            backward="custom_vjp: Pallas TPU kernels (verified in interpret mode only)",
        ),
        Implementation("xla", xla.conv, backward="custom_vjp: shifted sums (fused by XLA)"),
        Implementation("reference", reference.conv, backward="autodiff through the shifted sum"),
    ],
    # GPU: pallas_gpu measured faster than xla on the H200 in every benchmarked case, forward and
    # forward+backward, with and without SiLU (pallas_gpu.py has the figures)
    default_order={"cpu": ("xla",), "gpu": ("pallas_gpu", "xla"), "tpu": ("pallas_tpu", "xla")},
    package=__package__,
    bucket=bucket,
)


def _check_width(width: int) -> None:
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"{NAME}: width must be in 1..{MAX_WIDTH}, got {width}")


def _check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{NAME}: activation must be None or 'silu', got {activation!r}")


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
    implementation: str | tuple[str, ...] | None = None,
    block_sizes: ConvBlockSizes | dict | None = None,
):
    """Causal depthwise convolution on plain arrays.

    **Arguments:**

    - `x`: `[batch, seq, channels]`.
    - `weight`: `[width, channels]`; tap `k` multiplies `x[t - k]`. Width 1..8.
    - `bias`: optional `[channels]`.
    - `segment_ids`: optional `[batch, seq]` ints; taps never reach into another segment.
    - `initial_state`: optional `[batch, width - 1, channels]`, the inputs before position 0.
    - `return_final_state`: also return the last `width - 1` inputs (the decode cache).
    - `activation`: `None` or `"silu"`.
    - `implementation`, `block_sizes`: override the dispatcher.

    **Returns:** `y` like `x`, or `(y, final_state)`.
    """
    width = weight.shape[0]
    _check_width(width)
    _check_activation(activation)
    batch, seq, channels = x.shape
    if initial_state is not None and initial_state.shape[1] != width - 1:
        raise ValueError(
            f"{NAME}: initial_state holds {initial_state.shape[1]} previous inputs, but width {width} needs "
            f"width - 1 = {width - 1}"
        )
    bias = jnp.zeros((channels,), weight.dtype) if bias is None else bias
    state = jnp.zeros((batch, width - 1, channels), x.dtype) if initial_state is None else initial_state
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
        state,
        implementation=implementation,
        block_sizes=block_sizes,
        activation=activation,
    )
    if return_final_state:
        return y, final_state(x, segment_ids, state)
    return y


@checked
def short_conv_step_positional(
    x_t: Float[Array, "batch channels"],
    state: Float[Array, "batch state channels"],
    weight: Float[Array, "width channels"],
    *,
    bias: Float[Array, " channels"] | None = None,
    activation: str | None = None,
):
    """One decode step: `(y_t, new_state)` from the newest input and the `W-1` previous ones."""
    width = weight.shape[0]
    _check_width(width)
    _check_activation(activation)
    if state.shape[1] != width - 1:
        raise ValueError(
            f"{NAME}: state holds {state.shape[1]} previous inputs, but width {width} needs {width - 1}"
        )
    acc = jnp.promote_types(x_t.dtype, jnp.float32)
    window = jnp.concatenate([state, x_t[:, None].astype(state.dtype)], axis=1)  # oldest first
    y = jnp.einsum("bwc,wc->bc", window.astype(acc), weight[::-1].astype(acc))
    if bias is not None:
        y = y + bias.astype(acc)
    if activation == "silu":
        y = jax.nn.silu(y)
    return y.astype(x_t.dtype), window[:, 1:]


# -- named layer -------------------------------------------------------------------------------


def _resolve(x, weight, Pos, Channel, Width):
    named.require_named(NAME, "x", x)
    named.require_named(NAME, "weight", weight)
    pos = named.resolve(NAME, "x", x, Pos, "Pos")
    chan = named.resolve(NAME, "x", x, Channel, "Channel")
    width = named.resolve(NAME, "weight", weight, Width, "Width")
    _check_width(width.size)
    w_chan = named.resolve(NAME, "weight", weight, chan.name, "Channel")
    if w_chan.size != chan.size:
        raise ValueError(f"{NAME}: weight's {chan.name}={w_chan.size} but x's {chan.name}={chan.size}")
    extra = named.without(weight, width.name, chan.name)
    if extra:
        raise ValueError(
            f"{NAME}: weight must have only axes {width.name!r} and {chan.name!r}; its axes are "
            f"{named.axes_str(weight.axes)}"
        )
    return pos, chan, width


def short_conv(
    x: NamedArray,
    weight: NamedArray,
    *,
    Pos: named.AxisSelector = "position",
    Channel: named.AxisSelector = "embed",
    Width: named.AxisSelector = "width",
    bias: NamedArray | None = None,
    segment_ids: NamedArray | None = None,
    initial_state: NamedArray | None = None,
    return_final_state: bool = False,
    activation: str | None = None,
    implementation: str | tuple[str, ...] | None = None,
    block_sizes: ConvBlockSizes | dict | None = None,
):
    """Causal depthwise convolution of width `Width` (1..8) along `Pos`, per `Channel`.

    **Arguments:**

    - `x`: batch axes + `Pos` + `Channel` (any order).
    - `weight`: `Width` x `Channel`; tap `k` multiplies `x[t - k]`.
    - `bias`: optional, axis `Channel`.
    - `segment_ids`: optional ints with `x`'s batch axes and `Pos`: taps never cross a segment.
    - `initial_state`: optional, batch axes + `"conv_state"` (`Width - 1`) + `Channel`.
    - `return_final_state`: also return the last `Width - 1` inputs, as `initial_state` is laid out.
    - `activation`: `None` or `"silu"`.

    **Returns:** `y` with `x`'s axes, or `(y, final_state)`.

    !!! info "Sharding"
        Batch axes mapped to mesh axes run data parallel. A mapped `Pos` runs sequence
        parallel: each shard receives the previous shard's last `Width - 1` inputs (and
        segment ids) with `ppermute` as its initial state.
    """
    _check_activation(activation)
    pos, chan, width = _resolve(x, weight, Pos, Channel, Width)
    batch = named.without(x, pos.name, chan.name)
    state_ax = hax.Axis(STATE_AXIS, width.size - 1)
    xd = named.ordered(x, batch + (pos, chan))
    wd = named.ordered(weight, (width, chan))
    bd = None
    if bias is not None:
        named.require_named(NAME, "bias", bias)
        bd = named.match_axes(NAME, "bias", bias, (chan,), "the Channel axis")
    sd = None
    if segment_ids is not None:
        named.require_named(NAME, "segment_ids", segment_ids)
        sd = named.match_axes(NAME, "segment_ids", segment_ids, batch + (pos,), "x's batch axes and Pos")
    st = None
    if initial_state is not None:
        named.require_named(NAME, "initial_state", initial_state)
        have = {a.name: a.size for a in initial_state.axes}
        if have.get(STATE_AXIS) != state_ax.size:
            raise ValueError(
                f"{NAME}: initial_state needs axis {STATE_AXIS!r} of size width - 1 = {state_ax.size}; "
                f"its axes are {named.axes_str(initial_state.axes)}"
            )
        st = named.match_axes(
            NAME, "initial_state", initial_state, batch + (state_ax, chan), "batch + conv_state + Channel"
        )
    seq_mesh = named.mesh_axes_for(pos) if compat.current_mesh() is not None else None

    def local(xs, ws, bs, ss, sts, seq_mesh=None):
        n = len(batch)
        lead = xs.shape[:n]
        xf = named.flatten(xs, n)
        sf = named.flatten(ss, n)
        stf = named.flatten(sts, n)
        if seq_mesh is not None:
            stf = _halo(xf, sf, stf, ws.shape[0] - 1, seq_mesh)
        y = short_conv_positional(
            xf,
            ws,
            bias=bs,
            segment_ids=sf,
            initial_state=stf,
            activation=activation,
            implementation=implementation,
            block_sizes=block_sizes,
        )
        return named.unflatten(y, lead)

    inputs = [
        ("x", xd, batch + (pos, chan)),
        ("weight", wd, (width, chan)),
        None if bd is None else ("bias", bd, (chan,)),
        None if sd is None else ("segment_ids", sd, batch + (pos,)),
        None if st is None else ("initial_state", st, batch + (state_ax, chan)),
    ]
    if seq_mesh is not None:
        n_shards = compat.axis_size(compat.current_mesh(), seq_mesh)
        if pos.size // n_shards < width.size - 1:
            raise ValueError(
                f"{NAME}: {pos.name}={pos.size} split over {n_shards} shards leaves {pos.size // n_shards} "
                f"positions per shard, fewer than the width - 1 = {width.size - 1} halo"
            )
    out = named.shard_by_mapping(
        NAME,
        functools.partial(local, seq_mesh=seq_mesh),
        inputs,
        batch + (pos, chan),
        replicated=(chan.name,),
    )
    y = out if out is not None else local(xd, wd, bd, sd, st)
    y = hax.named(y, batch + (pos, chan))
    if tuple(a.name for a in x.axes) != tuple(a.name for a in y.axes):
        y = y.rearrange(x.axes)
    if not return_final_state:
        return y
    n = len(batch)
    flat_x = named.flatten(xd, n)
    flat_s = named.flatten(sd, n)
    flat_st = (
        jnp.zeros((flat_x.shape[0], width.size - 1, chan.size), xd.dtype)
        if st is None
        else named.flatten(st, n)
    )
    fs = final_state(flat_x, flat_s, flat_st)
    fs = named.unflatten(fs, tuple(a.size for a in batch))
    return y, hax.named(fs, batch + (state_ax, chan))


def _halo(x, segment_ids, state, width_1, seq_mesh):
    """This shard's initial state: the previous shard's last `W-1` inputs (the caller's state on shard 0).

    Halo rows of another segment than this shard's first token are zeroed, so the kernel's
    rule (state rows belong to the first segment) stays exact across the shard boundary.
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
        tail = jnp.where((seg_tail == segment_ids[:, :1])[..., None], tail, 0)
    first = compat.axis_index(seq_mesh) == 0
    if state is None:
        state = jnp.zeros_like(tail)
    return jnp.where(first, state.astype(tail.dtype), tail)


def short_conv_step(
    x_t: NamedArray,
    state: NamedArray,
    weight: NamedArray,
    *,
    Channel: named.AxisSelector = "embed",
    Width: named.AxisSelector = "width",
    bias: NamedArray | None = None,
    activation: str | None = None,
):
    """One decode step. `x_t`: batch axes + `Channel`; `state`: batch axes + `"conv_state"` + `Channel`.

    **Returns:** `(y_t, new_state)`, with `x_t`'s and `state`'s axes.
    """
    named.require_named(NAME, "x_t", x_t)
    named.require_named(NAME, "state", state)
    named.require_named(NAME, "weight", weight)
    chan = named.resolve(NAME, "x_t", x_t, Channel, "Channel")
    width = named.resolve(NAME, "weight", weight, Width, "Width")
    _check_width(width.size)
    batch = named.without(x_t, chan.name)
    state_ax = hax.Axis(STATE_AXIS, width.size - 1)
    sd = named.match_axes(NAME, "state", state, batch + (state_ax, chan), "batch + conv_state + Channel")
    wd = named.match_axes(NAME, "weight", weight, (width, chan), "Width + Channel")
    bd = None if bias is None else named.match_axes(NAME, "bias", bias, (chan,), "the Channel axis")
    n = len(batch)
    xf = named.flatten(named.ordered(x_t, batch + (chan,)), n)
    sf = named.flatten(sd, n)
    y, new = short_conv_step_positional(xf, sf, wd, bias=bd, activation=activation)
    lead = tuple(a.size for a in batch)
    y = hax.named(named.unflatten(y, lead), batch + (chan,))
    new = hax.named(named.unflatten(new, lead), batch + (state_ax, chan))
    return y, new
