"""`ssd`: the Mamba-2 state-space-duality layer, named and positional, its decode step, and the Op.

`state_t = exp(dt_t A) state_{t-1} + dt_t x_t ⊗ B_t`, `y_t = C_t · state_t + D x_t`, gated by
`silu(z)` when `z` is given, with mamba_ssm's shapes: `x [.., L, H, P]`, `dt [.., L, H]`,
`A [H]`, `B, C [.., L, G, N]` (heads split evenly over groups), `D [H]` or `[H, P]`. `dt` is
first shifted by `dt_bias`, passed through softplus (`dt_softplus`) and clipped to `dt_limit`.
A positive `A` makes the state grow without bound: allowed, and on the caller.
"""

from __future__ import annotations

import functools

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from axkern.core import compat, named
from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Float, Int, checked

from . import pallas_gpu, pallas_tpu, reference, xla
from .blocks import SSDBlockSizes, bucket, heuristic

__all__ = ["ssd", "ssd_positional", "ssd_step_positional", "OP", "SSDBlockSizes"]

NAME = "ssd"


def _gpu_order(spec) -> tuple[str, ...]:
    """On the H200 (benchmarks/results/h200/ssd_mamba2_2.7b*_2026-11-30[fg].json, forward+backward,
    bf16): `pallas_gpu` 8.62 / 4.39 / 33.9 ms against `xla` 12.66 / 6.37 / 48.0 at lengths
    4096 / 2048 / 16384 (P 64, N 128) with 43-48% of its temporary memory, 4.50 against 6.23
    ms at P 128, N 64. float32: Triton's exact float32 products made `pallas_gpu` 22x slower
    (264 ms, against 12.1 for `xla` with TF32 products); with exact products too `xla`'s forward
    took 6.25 ms against `pallas_gpu`'s 55.6 (before `xla`'s float32 segment sums, untimed), so
    `xla` serves float32."""
    return ("pallas_gpu", "xla") if jnp.dtype(spec.dtype).itemsize <= 2 else ("xla",)


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
        Implementation(
            "pallas_gpu",
            pallas_gpu.ssd,
            platforms=("gpu",),
            supports=pallas_gpu.supports,
            block_sizes=SSDBlockSizes,
            heuristic=pallas_gpu.heuristic,
            interpretable=True,
            backward="custom_vjp: chunk-scan and chunk-state backward kernels, the reverse recurrence as a kernel",
        ),
        Implementation(
            "pallas_tpu",
            pallas_tpu.ssd,
            platforms=("tpu",),
            block_sizes=SSDBlockSizes,
            heuristic=pallas_tpu.heuristic,
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

    !!! info "Sharding"
        Batch axes mapped to mesh axes run data parallel; a mapped `Pos` runs sequence
        parallel, passing states between shards (see `_sequence_parallel`).
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
    x_axes, dt_axes, bc_axes = (
        batch + (pos, heads, head_dim),
        batch + (pos, heads),
        batch + (pos, groups, state),
    )
    state_axes = batch + (heads, head_dim, state)
    inputs = [
        ("x", named.match_axes(NAME, "x", x, x_axes, "batch + Pos + Heads + HeadDim"), x_axes),
        ("dt", named.match_axes(NAME, "dt", dt, dt_axes, "x's batch axes + Pos + Heads"), dt_axes),
        ("A", named.match_axes(NAME, "A", A, (heads,), "Heads"), (heads,)),
        ("B", named.match_axes(NAME, "B", B, bc_axes, "x's batch axes + Pos + Groups + State"), bc_axes),
        ("C", named.match_axes(NAME, "C", C, bc_axes, "x's batch axes + Pos + Groups + State"), bc_axes),
        None,
        None if z is None else ("z", named.match_axes(NAME, "z", z, x_axes, "x's axes"), x_axes),
        None
        if dt_bias is None
        else ("dt_bias", named.match_axes(NAME, "dt_bias", dt_bias, (heads,), "Heads"), (heads,)),
        None
        if segment_ids is None
        else (
            "segment_ids",
            named.match_axes(NAME, "segment_ids", segment_ids, batch + (pos,), "x's batch axes + Pos"),
            batch + (pos,),
        ),
        None
        if initial_state is None
        else (
            "initial_state",
            named.match_axes(
                NAME, "initial_state", initial_state, state_axes, "batch + Heads + HeadDim + State"
            ),
            state_axes,
        ),
    ]
    if D is not None:
        d_axes = (heads,) if len(D.axes) == 1 else (heads, head_dim)
        inputs[5] = ("D", named.match_axes(NAME, "D", D, d_axes, "Heads [+ HeadDim]"), d_axes)
    options = dict(
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        chunk_size=chunk_size,
        implementation=implementation,
        block_sizes=block_sizes,
    )
    seq_mesh = named.mesh_axes_for(pos) if compat.current_mesh() is not None else None

    def local(xs, dts, As, Bs, Cs, Ds, zs, bias, segs, s0, seq_mesh=None):
        lead = xs.shape[:n]
        fl = lambda a: named.flatten(a, n)  # noqa: E731
        args = (fl(xs), fl(dts), As, fl(Bs), fl(Cs))
        kw = dict(D=Ds, z=fl(zs), dt_bias=bias, segment_ids=fl(segs), initial_state=fl(s0), **options)
        if seq_mesh is None:
            y, final = ssd_positional(*args, return_final_state=True, **kw)
        else:
            y, final = _sequence_parallel(args, kw, seq_mesh)
        unfl = lambda a: named.unflatten(a, lead)  # noqa: E731
        return unfl(y), unfl(final)

    out = named.shard_by_mapping(
        NAME,
        functools.partial(local, seq_mesh=seq_mesh),
        inputs,
        (x_axes, state_axes),
        replicated=(heads.name, head_dim.name, groups.name, state.name),
    )
    y, final = out if out is not None else local(*[None if i is None else i[1] for i in inputs])
    y = hax.named(y, x_axes)
    if tuple(a.name for a in x.axes) != tuple(a.name for a in y.axes):
        y = y.rearrange(x.axes)
    if not return_final_state:
        return y
    return y, hax.named(final, state_axes)


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
