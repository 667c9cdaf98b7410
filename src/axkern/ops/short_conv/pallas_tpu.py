"""Short causal convolution as Pallas Mosaic TPU kernels, forward and backward.

Verified in Pallas TPU interpret mode (`pltpu.InterpretParams`, with out-of-bounds reads of
ragged edge blocks returning NaN as real padding is undefined), lowered for a TPU in CI, and
compiled and run on a TPU v5e (`tests/tpu`; docs/tpu.md).

**Layout.** `x, y, dy, g, dx: [B, S, C]`, `weight: [W, C]`, `bias: [1, C]`,
`state: [B, W-1, C]`, `segment_ids` as rows `[B, ns, 1, block_seq]` (padded to whole blocks;
each kernel transposes its block into the column it compares: a column array `[B, S, 1]`
would fill 128 lanes in a TPU's memory). Blocks are `(1, block_seq, block_channels)`
(`block_seq` a multiple of 8, `block_channels` of 128, or the whole axis).

**Grid.** `(B, cdiv(S, block_seq), cdiv(C, block_channels))`. The `W-1` halo rows before a
block come from a second BlockSpec on the same array that points at the previous block (the
state on block 0); the backward's `W-1` look-ahead rows likewise from the next block. Rows
past `S` in a ragged last block are masked with `where` (never multiplied: padding may be NaN).

**Backward.** As in `pallas_gpu`: with an activation a first kernel writes
`g = dy · act'(pre)` (float32), then one kernel computes `dx(t) = sum_k w[k] · g(t + k)` within
`t`'s segment and before `S` (a tap of another segment selected away with its product, in the
forward too: never `w[k] · 0`) and each block's partial `dw` and `dbias` (summed by XLA). The state's gradient
(first `W-1` positions only) is plain JAX.

**Bound.** Memory: `2·B·S·C` elements forward, `3·B·S·C` backward (plus `g` with an activation),
each block reading one neighbour block besides its own (2x input traffic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from axkern.core.op import Implementation

from .blocks import ConvBlockSizes, heuristic, pallas_tpu_space
from .common import activate as _act
from .common import activation_grad as _act_grad
from .common import segment_runs, state_grad, zero_state


def _interpret_params(interpret: bool):
    if not interpret:
        return False
    return pltpu.InterpretParams(out_of_bounds_reads="uninitialized")


def _extended(cur, neighbour, first_rows, use_first, width_1, *, before: bool):
    """`cur` with `W-1` rows of the neighbour block before (halo) or after (look-ahead) it."""
    if width_1 == 0:
        return cur
    if before:
        halo = jnp.where(use_first, first_rows, neighbour[neighbour.shape[0] - width_1 :])
        return jnp.concatenate([halo, cur], axis=0)
    ahead = jnp.where(use_first, first_rows, neighbour[:width_1])
    return jnp.concatenate([cur, ahead], axis=0)


def _pre(x_e, seg_e, seg_cur, w, bias, width, block_seq):
    """`bias + sum_k w[k] · x~(t - k)` from the halo-extended block (float32 `[bs, bc]`)."""
    acc = jnp.broadcast_to(bias, (block_seq, bias.shape[-1]))
    for k in range(width):
        term = w[k][None, :] * x_e[width - 1 - k : width - 1 - k + block_seq]
        if seg_e is not None:  # a tap of another segment: its product selected away, never w[k] * 0
            term = jnp.where(seg_e[width - 1 - k : width - 1 - k + block_seq] == seg_cur, term, 0)
        acc = acc + term
    return acc


def _load_x_e(x_ref, xprev_ref, st_ref, width_1):
    i = pl.program_id(1)
    x = x_ref[0].astype(jnp.float32)
    if width_1 == 0:
        return x
    return _extended(
        x, xprev_ref[0].astype(jnp.float32), st_ref[0].astype(jnp.float32), i == 0, width_1, before=True
    )


def _seg_column(ref):
    """A block of the segment ids' rows (`[1, 1, 1, bs]`) as the column `[bs, 1]`."""
    return ref[0, 0].T


def _load_seg_e(seg_ref, segprev_ref, width_1):
    i = pl.program_id(1)
    seg = _seg_column(seg_ref)  # [bs, 1]
    first = jnp.broadcast_to(seg[:1], (width_1, 1))  # block 0: the state belongs to the first segment
    return seg, _extended(seg, _seg_column(segprev_ref), first, i == 0, width_1, before=True)


def _fwd_kernel(*refs, width, block_seq, activation, segments):
    x_ref, xprev_ref, w_ref, b_ref, st_ref, *rest = refs
    seg_ref, segprev_ref, y_ref = rest if segments else (None, None, rest[0])
    x_e = _load_x_e(x_ref, xprev_ref, st_ref, width - 1)
    seg_cur, seg_e = _load_seg_e(seg_ref, segprev_ref, width - 1) if segments else (None, None)
    pre = _pre(
        x_e, seg_e, seg_cur, w_ref[...].astype(jnp.float32), b_ref[...].astype(jnp.float32), width, block_seq
    )
    y_ref[0] = _act(pre, activation).astype(y_ref.dtype)


def _grad_kernel(*refs, width, block_seq, activation, segments):
    x_ref, xprev_ref, w_ref, b_ref, st_ref, *rest = refs
    seg_ref, segprev_ref, dy_ref, g_ref = rest if segments else (None, None, *rest)
    x_e = _load_x_e(x_ref, xprev_ref, st_ref, width - 1)
    seg_cur, seg_e = _load_seg_e(seg_ref, segprev_ref, width - 1) if segments else (None, None)
    pre = _pre(
        x_e, seg_e, seg_cur, w_ref[...].astype(jnp.float32), b_ref[...].astype(jnp.float32), width, block_seq
    )
    g_ref[0] = dy_ref[0].astype(jnp.float32) * _act_grad(pre, activation)


def _bwd_kernel(*refs, width, block_seq, seq, segments):
    x_ref, xprev_ref, w_ref, st_ref, *rest = refs
    if segments:
        seg_ref, segprev_ref, segnext_ref, g_ref, gnext_ref, dx_ref, dw_ref, db_ref = rest
    else:
        g_ref, gnext_ref, dx_ref, dw_ref, db_ref = rest
    i, last = pl.program_id(1), pl.num_programs(1) - 1
    width_1 = width - 1
    w = w_ref[...].astype(jnp.float32)
    rows = i * block_seq + jax.lax.broadcasted_iota(jnp.int32, (block_seq + width_1, 1), 0)
    g_cur = g_ref[0].astype(jnp.float32)
    zeros = jnp.zeros((width_1, g_cur.shape[1]), jnp.float32)
    g_e = _extended(g_cur, gnext_ref[0].astype(jnp.float32), zeros, i == last, width_1, before=False)
    g_e = jnp.where(rows < seq, g_e, 0)  # past S (ragged last block, or beyond the last block): no gradient
    if segments:
        seg_cur = _seg_column(seg_ref)
        seg_ahead = _extended(
            seg_cur,
            _seg_column(segnext_ref),
            jnp.broadcast_to(seg_cur[-1:], (width_1, 1)),
            i == last,
            width_1,
            before=False,
        )
    dx = jnp.zeros_like(g_cur)
    for k in range(width):
        tap = w[k][None, :] * g_e[k : k + block_seq]
        # an output past S or of another segment: its product selected away, never w[k] * 0
        keep = rows[k : k + block_seq] < seq
        if segments:
            keep = keep & (seg_ahead[k : k + block_seq] == seg_cur)
        dx = dx + jnp.where(keep, tap, 0)
    dx_ref[0] = dx.astype(dx_ref.dtype)
    x_e = _load_x_e(x_ref, xprev_ref, st_ref, width_1)
    seg_e = _load_seg_e(seg_ref, segprev_ref, width_1)[1] if segments else None
    g0 = g_e[:block_seq]
    for k in range(width):
        tap = x_e[width_1 - k : width_1 - k + block_seq]
        keep = rows[:block_seq] < seq
        if segments:
            keep = keep & (seg_e[width_1 - k : width_1 - k + block_seq] == seg_cur)
        dw_ref[0, k : k + 1, :] = jnp.sum(jnp.where(keep, g0 * tap, 0), axis=0, keepdims=True)
    db_ref[0] = jnp.sum(g0, axis=0, keepdims=True)


def _specs(seq, width, bs, bc):
    ns = pl.cdiv(seq, bs)
    block = (1, bs, bc)
    cur = pl.BlockSpec(block, lambda b, i, j: (b, i, j))
    prev = pl.BlockSpec(block, lambda b, i, j: (b, jnp.maximum(i - 1, 0), j))
    nxt = pl.BlockSpec(block, lambda b, i, j: (b, jnp.minimum(i + 1, ns - 1), j))
    seg_cur = pl.BlockSpec((1, 1, 1, bs), lambda b, i, j: (b, i, 0, 0))
    seg_prev = pl.BlockSpec((1, 1, 1, bs), lambda b, i, j: (b, jnp.maximum(i - 1, 0), 0, 0))
    seg_next = pl.BlockSpec((1, 1, 1, bs), lambda b, i, j: (b, jnp.minimum(i + 1, ns - 1), 0, 0))
    weight = pl.BlockSpec((width, bc), lambda b, i, j: (0, j))
    bias = pl.BlockSpec((1, bc), lambda b, i, j: (0, j))
    state = pl.BlockSpec((1, max(width - 1, 1), bc), lambda b, i, j: (b, 0, j))
    return dict(
        cur=cur,
        prev=prev,
        nxt=nxt,
        seg_cur=seg_cur,
        seg_prev=seg_prev,
        seg_next=seg_next,
        weight=weight,
        bias=bias,
        state=state,
        ns=ns,
    )


def conv(
    x,
    weight,
    bias,
    segment_ids,
    initial_state,
    *,
    activation=None,
    block_sizes: ConvBlockSizes,
    interpret=False,
):
    cfg = (
        activation,
        segment_ids is not None,
        block_sizes.block_seq,
        block_sizes.block_channels,
        bool(interpret),
    )
    initial_state = zero_state(x, weight.shape[0], initial_state)
    return _conv(cfg, x, weight, bias, segment_runs(segment_ids), initial_state)


def _inputs(x, weight, bias, segment_ids, initial_state, bs):
    batch, seq, channels = x.shape
    state = initial_state if weight.shape[0] > 1 else jnp.zeros((batch, 1, channels), x.dtype)
    seg = None
    if segment_ids is not None:  # rows of whole blocks, the last id repeated past S
        ns = pl.cdiv(seq, bs)
        seg = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, ns * bs - seq)], mode="edge")
        seg = seg.reshape(batch, ns, 1, bs)
    return bias.reshape(1, channels), state, seg


def _tiles(cfg, x):
    _, _, block_seq, block_channels, _ = cfg
    seq, channels = x.shape[1], x.shape[2]
    bs = min(block_seq, max(8, -(-seq // 8) * 8))
    bc = channels if channels <= block_channels else block_channels
    return bs, bc


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(cfg, x, weight, bias, segment_ids, initial_state):
    activation, segments, _, _, interpret = cfg
    batch, seq, channels = x.shape
    width = weight.shape[0]
    bs, bc = _tiles(cfg, x)
    sp = _specs(seq, width, bs, bc)
    b2, state, seg = _inputs(x, weight, bias, segment_ids, initial_state, bs)
    in_specs = [sp["cur"], sp["prev"], sp["weight"], sp["bias"], sp["state"]]
    args = [x, x, weight, b2, state]
    if segments:
        in_specs += [sp["seg_cur"], sp["seg_prev"]]
        args += [seg, seg]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, width=width, block_seq=bs, activation=activation, segments=segments),
        name="axkern_short_conv_tpu_forward",
        grid=(batch, sp["ns"], pl.cdiv(channels, bc)),
        in_specs=in_specs,
        out_specs=sp["cur"],
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=_interpret_params(interpret),
    )(*args)


def _fwd(cfg, x, weight, bias, segment_ids, initial_state):
    return _conv(cfg, x, weight, bias, segment_ids, initial_state), (
        x,
        weight,
        bias,
        segment_ids,
        initial_state,
    )


def _bwd(cfg, residuals, dy):
    activation, segments, _, _, interpret = cfg
    x, weight, bias, segment_ids, initial_state = residuals
    batch, seq, channels = x.shape
    width = weight.shape[0]
    bs, bc = _tiles(cfg, x)
    sp = _specs(seq, width, bs, bc)
    ns, nc = sp["ns"], pl.cdiv(channels, bc)
    grid = (batch, ns, nc)
    b2, state, seg = _inputs(x, weight, bias, segment_ids, initial_state, bs)
    seg_args = [seg, seg] if segments else []
    seg_specs = [sp["seg_cur"], sp["seg_prev"]] if segments else []
    g = dy
    if activation is not None:
        g = pl.pallas_call(
            functools.partial(
                _grad_kernel, width=width, block_seq=bs, activation=activation, segments=segments
            ),
            name="axkern_short_conv_tpu_activation_grad",
            grid=grid,
            in_specs=[sp["cur"], sp["prev"], sp["weight"], sp["bias"], sp["state"], *seg_specs, sp["cur"]],
            out_specs=sp["cur"],
            out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
            interpret=_interpret_params(interpret),
        )(x, x, weight, b2, state, *seg_args, dy)
    part = pl.BlockSpec((1, width, bc), lambda b, i, j: (b * ns + i, 0, j))
    part_b = pl.BlockSpec((1, 1, bc), lambda b, i, j: (b * ns + i, 0, j))
    in_specs = [sp["cur"], sp["prev"], sp["weight"], sp["state"]]
    args = [x, x, weight, state]
    if segments:
        in_specs += [sp["seg_cur"], sp["seg_prev"], sp["seg_next"]]
        args += [seg, seg, seg]
    dx, dw, db = pl.pallas_call(
        functools.partial(_bwd_kernel, width=width, block_seq=bs, seq=seq, segments=segments),
        name="axkern_short_conv_tpu_backward",
        grid=grid,
        in_specs=[*in_specs, sp["cur"], sp["nxt"]],
        out_specs=[sp["cur"], part, part_b],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((batch * ns, width, channels), jnp.float32),
            jax.ShapeDtypeStruct((batch * ns, 1, channels), jnp.float32),
        ],
        interpret=_interpret_params(interpret),
    )(*args, g, g)
    dstate = state_grad(x, weight, bias, segment_ids, initial_state, dy, activation)
    return dx, dw.sum(0).astype(weight.dtype), db.sum((0, 1)).astype(bias.dtype), None, dstate


_conv.defvjp(_fwd, _bwd)


IMPLEMENTATION = Implementation(
    "pallas_tpu",
    conv,
    platforms=("tpu",),
    block_sizes=ConvBlockSizes,
    heuristic=heuristic,
    space=pallas_tpu_space,
    interpretable=True,
    backward="custom_vjp: Pallas TPU kernels",
)
