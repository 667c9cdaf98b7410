"""Short causal convolution as Pallas GPU (Triton) kernels, forward and backward.

**Layout.** `x`, `y`, `dy`, `dx`: `[B·S, C]` (rows are positions of one batch element after
another), `weight: [W·C]`, `bias: [C]`, `state: [B·(W-1), C]`, `segment_ids: [B·S]`.

**Grid.** `(B, cdiv(S, block_seq), cdiv(C, block_channels))`: one program per tile of
`block_seq` positions by `block_channels` channels. A program reads its tile at `W` row
offsets (tap `k` reads rows `t - k`); the overlap of neighbouring offsets is served by L1/L2,
so each input byte comes from HBM about once. Rows before 0 read the state; a tap of another
segment is selected away with its product (never `w[k] · 0`, NaN for a NaN weight). Edge tiles are masked; row indices are clipped so no address is ever out
of bounds (Triton's and interpret mode's loads then agree).

**Backward.** With an activation, a first kernel writes `g = dy · act'(pre)` (float32; `pre`
recomputed from `x`); without one `g = dy`. The second kernel walks up to 256 positions per
program, tile by tile: it reads `g` at offsets `0..W-1`, writes `dx(t) = sum_k w[k] · g(t + k)`
over taps that stay in `t`'s segment and before `S` (the others selected away), and accumulates in registers the partial sums of
`dw[k] = sum_t g(t) · x~(t - k)` (a tap of another segment selected away, never `0 · g`) and
`dbias = sum_t g(t)`, one row per program (summed by XLA). The state's gradient needs only the
first `W-1` positions: plain JAX.

**Bound.** Memory: forward `2·B·S·C` elements (read `x`, write `y`), backward `3·B·S·C`
(read `x`, `dy`; write `dx`), plus a float32 `g` written and read once with an activation.
FLOPs are `O(W)` per element.

**SiLU.** For 16-bit inputs the sigmoid is `(1 + tanh(p/2)) / 2` with PTX `tanh.approx.f32`
(one MUFU op); the exact `exp` and IEEE division made the SiLU kernels compute-bound. Not in
interpret mode (no PTX there) and not for float32.

`g` is written once by the forward rather than recomputed inside the `dx` kernel, whose `W`
live pre-activations would spill registers. Second on the GPU, after `cuda` (where the CUDA
library cannot be built or the channels are not a multiple of its vector); the alternatives
measured are in docs/ops/short_conv.md ("Performance") and docs/decisions.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from axkern.core.op import Implementation

from .blocks import ConvBlockSizes, heuristic, pallas_gpu_space
from .common import activate as _act
from .common import activation_grad as _act_grad
from .common import segment_runs, state_grad, zero_state


def program_ids():
    return pl.program_id(0), pl.program_id(1), pl.program_id(2)


class _Tile:
    """Index helpers for one program's tile."""

    def __init__(self, *, seq, channels, width, block_seq, block_channels, ids=None, sub=0, subs=1):
        self.seq, self.channels, self.width = seq, channels, width
        # program ids are read at the kernel's top level (interpret mode cannot read them in a loop)
        self.ids = ids if ids is not None else program_ids()
        self.b = self.ids[0]
        # a program covers `subs` consecutive tiles along the sequence; this is tile `sub`
        self.t = (self.ids[1] * subs + sub) * block_seq + jnp.arange(block_seq)
        # Columns are never clipped: masked lanes past C are never dereferenced, and an
        # unclipped `c0 + arange` keeps the contiguity Triton needs for 16-byte accesses.
        self.c = self.ids[2] * block_channels + jnp.arange(block_channels)
        self.cmask = self.c < channels
        self._memo = {}  # one load per (what, offset) per tile, however often the math asks

    def once(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def rows(self, offset):
        """Source positions `t + offset`, clipped into `[0, S)`, and whether each is in range."""
        src = self.t + offset
        return src, jnp.clip(src, 0, self.seq - 1)

    def load_x(self, x_ref, state_ref, offset):
        """`x~` at rows `t + offset` (state rows below 0, zero at or past S), float32 `[bs, bc]`."""
        return self.once(("x", offset), lambda: self._load_x(x_ref, state_ref, offset))

    def _load_x(self, x_ref, state_ref, offset):
        src, clipped = self.rows(offset)
        flat = self.b * self.seq + clipped
        ok = ((src >= 0) & (src < self.seq))[:, None] & self.cmask[None, :]
        val = plgpu.load(x_ref.at[flat[:, None], self.c[None, :]], mask=ok, other=0).astype(jnp.float32)
        if self.width > 1 and offset < 0:
            srow = self.b * (self.width - 1) + jnp.clip(self.width - 1 + src, 0, self.width - 2)
            sok = (src < 0)[:, None] & self.cmask[None, :]
            val = val + plgpu.load(state_ref.at[srow[:, None], self.c[None, :]], mask=sok, other=0).astype(
                jnp.float32
            )
        return val

    def load_rows(self, ref, offset, *, other=0):
        src, clipped = self.rows(offset)
        ok = ((src >= 0) & (src < self.seq))[:, None] & self.cmask[None, :]
        return plgpu.load(
            ref.at[(self.b * self.seq + clipped)[:, None], self.c[None, :]], mask=ok, other=other
        )

    def segment(self, seg_ref, offset):
        """Segment ids at rows `t + offset`; rows below 0 (the state) take position 0's id."""
        return self.once(("segment", offset), lambda: self._segment(seg_ref, offset))

    def _segment(self, seg_ref, offset):
        _, clipped = self.rows(offset)
        src = self.t + offset
        return plgpu.load(seg_ref.at[self.b * self.seq + jnp.where(src < 0, 0, clipped)])

    def weight(self, w_ref, k):
        return self.once(
            ("weight", k),
            lambda: plgpu.load(w_ref.at[k * self.channels + self.c], mask=self.cmask, other=0).astype(
                jnp.float32
            ),
        )


def _sigmoid(approx):
    """`jax.nn.sigmoid`, or `(1 + tanh(p/2)) / 2` with PTX `tanh.approx.f32` (one MUFU op, relative
    error about 2^-11) for 16-bit outputs, whose rounding (2^-9) dwarfs it. The exact form's
    `exp` and IEEE division make the SiLU kernels compute-bound."""
    if approx:
        return lambda p: 0.5 + 0.5 * plgpu.approx_tanh(0.5 * p)
    return jax.nn.sigmoid


def _pre(tile, x_ref, w_ref, b_ref, state_ref, seg_ref, at, *, segments):
    """Pre-activation at rows `t + at` (float32 `[bs, bc]`)."""
    bias = tile.once(
        ("bias", 0), lambda: plgpu.load(b_ref.at[tile.c], mask=tile.cmask, other=0).astype(jnp.float32)
    )
    acc = jnp.broadcast_to(bias[None, :], (tile.t.shape[0], tile.c.shape[0]))
    seg_here = tile.segment(seg_ref, at) if segments else None
    for k in range(tile.width):
        val = tile.load_x(x_ref, state_ref, at - k)
        term = tile.weight(w_ref, k)[None, :] * val
        if segments:  # a tap of another segment: its product selected away, never w[k] * 0
            term = jnp.where((tile.segment(seg_ref, at - k) == seg_here)[:, None], term, 0)
        acc = acc + term
    return acc


def _store_tile(tile, ref, value):
    """Store a `[bs, bc]` tile at rows `t`; lanes past S or C are masked (their addresses are
    distinct, unclipped ones, so a masked lane never overwrites a real one)."""
    ok = (tile.t < tile.seq)[:, None] & tile.cmask[None, :]
    flat = tile.b * tile.seq + tile.t
    plgpu.store(ref.at[flat[:, None], tile.c[None, :]], value.astype(ref.dtype), mask=ok)


def _fwd_kernel(x_ref, w_ref, b_ref, state_ref, seg_ref, y_ref, *, activation, approx, segments, **dims):
    tile = _Tile(**dims)
    pre = _pre(tile, x_ref, w_ref, b_ref, state_ref, seg_ref, 0, segments=segments)
    _store_tile(tile, y_ref, _act(pre, activation, _sigmoid(approx)))


def _grad_kernel(
    x_ref, w_ref, b_ref, state_ref, seg_ref, dy_ref, g_ref, *, activation, approx, segments, **dims
):
    """`g = dy * act'(pre)` at every position (only when there is an activation)."""
    tile = _Tile(**dims)
    pre = _pre(tile, x_ref, w_ref, b_ref, state_ref, seg_ref, 0, segments=segments)
    grad = _act_grad(pre, activation, _sigmoid(approx))
    _store_tile(tile, g_ref, tile.load_rows(dy_ref, 0).astype(jnp.float32) * grad)


def _bwd_kernel(
    x_ref,
    w_ref,
    b_ref,
    state_ref,
    seg_ref,
    g_ref,
    dx_ref,
    dw_ref,
    db_ref,
    *,
    activation,
    approx,
    segments,
    subs,
    **dims,
):
    """`dx` for `subs` consecutive tiles, and their summed partial `dw` / `dbias` (one row per program).

    Walking several tiles per program keeps the partial sums in registers: one partial per
    `subs` tiles, not per tile (with 16-row tiles a partial per tile was as large as `x`).
    """
    del b_ref, activation, approx  # g already holds dy * act'(pre)
    width = dims["width"]
    ids = program_ids()
    parts_per_batch = pl.num_programs(1)

    def tile_step(sub, acc):
        tile = _Tile(**dims, ids=ids, sub=sub, subs=subs)
        seg_t = tile.segment(seg_ref, 0) if segments else None
        dx = jnp.zeros((tile.t.shape[0], tile.c.shape[0]), jnp.float32)
        g0 = None
        for k in range(width):
            g = tile.load_rows(g_ref, k).astype(jnp.float32)  # zero past S
            if k == 0:
                g0 = g
            tap = tile.weight(w_ref, k)[None, :] * g
            # an output past S or of another segment: its product selected away, never w[k] * 0
            keep = (tile.t + k < dims["seq"])[:, None]
            if segments:
                keep = keep & (tile.segment(seg_ref, k) == seg_t)[:, None]
            dx = dx + jnp.where(keep, tap, 0)
        _store_tile(tile, dx_ref, dx)
        out = []
        inside = (tile.t < dims["seq"])[:, None]  # rows past S: their product selected away, not 0 * x
        for k in range(width):
            val = tile.load_x(x_ref, state_ref, -k)
            keep = inside
            if segments:  # a tap of another segment: its product selected away too, not g * 0
                same = (tile.segment(seg_ref, -k) == seg_t)[:, None]
                val, keep = jnp.where(same, val, 0), keep & same
            out.append(acc[k] + jnp.sum(jnp.where(keep, g0 * val, 0), axis=0))
        return (*out, acc[width] + jnp.sum(g0, axis=0))

    zeros = jnp.zeros((dims["block_channels"],), jnp.float32)
    acc = jax.lax.fori_loop(0, subs, tile_step, (zeros,) * (width + 1))
    tile = _Tile(**dims, ids=ids, subs=subs)
    part = ids[0] * parts_per_batch + ids[1]
    for k in range(width):
        plgpu.store(dw_ref.at[part * width + k, tile.c], acc[k], mask=tile.cmask)
    plgpu.store(db_ref.at[part, tile.c], acc[width], mask=tile.cmask)


def _prepare(x, weight, bias, segment_ids, initial_state):
    batch, seq, channels = x.shape
    width = weight.shape[0]
    seg = (
        jnp.zeros((batch * seq,), jnp.int32)
        if segment_ids is None
        else segment_ids.reshape(-1).astype(jnp.int32)
    )
    state = initial_state.reshape(batch * (width - 1), channels)
    if width == 1:  # a one-row placeholder: the kernel never reads it
        state = jnp.zeros((1, channels), x.dtype)
    return x.reshape(batch * seq, channels), weight.reshape(-1), bias, state, seg


def _call(kernel, out_shape, grid, *, interpret, num_warps, **static):
    return pl.pallas_call(
        functools.partial(kernel, **static),
        name=f"axkern_short_conv_gpu_{getattr(kernel, 'func', kernel).__name__.strip('_')}",
        grid=grid,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
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
        block_sizes.num_warps,
    )
    initial_state = zero_state(x, weight.shape[0], initial_state)
    return _conv(cfg, x, weight, bias, segment_runs(segment_ids), initial_state)


def _static(cfg, x, weight):
    activation, segments, block_seq, block_channels, interpret, num_warps = cfg
    batch, seq, channels = x.shape
    dims = dict(
        seq=seq, channels=channels, width=weight.shape[0], block_seq=block_seq, block_channels=block_channels
    )
    grid = (batch, pl.cdiv(seq, block_seq), pl.cdiv(channels, block_channels))
    num_warps = num_warps or max(1, min(8, block_seq * block_channels // 1024))
    # the PTX approximation cannot run in interpret mode, and float32 outputs need the exact form
    approx = activation is not None and not interpret and jnp.dtype(x.dtype).itemsize == 2
    static = dict(activation=activation, approx=approx, segments=segments, **dims)
    return static, grid, num_warps, interpret


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(cfg, x, weight, bias, segment_ids, initial_state):
    static, grid, num_warps, interpret = _static(cfg, x, weight)
    args = _prepare(x, weight, bias, segment_ids, initial_state)
    out = jax.ShapeDtypeStruct(args[0].shape, x.dtype)
    y = _call(_fwd_kernel, out, grid, interpret=interpret, num_warps=num_warps, **static)(*args)
    return y.reshape(x.shape)


def _fwd(cfg, x, weight, bias, segment_ids, initial_state):
    return _conv(cfg, x, weight, bias, segment_ids, initial_state), (
        x,
        weight,
        bias,
        segment_ids,
        initial_state,
    )


def _bwd(cfg, residuals, dy):
    x, weight, bias, segment_ids, initial_state = residuals
    static, grid, num_warps, interpret = _static(cfg, x, weight)
    batch, seq, channels = x.shape
    width = weight.shape[0]
    block_seq = static["block_seq"]
    subs = max(1, min(256 // block_seq, pl.cdiv(seq, block_seq)))  # tiles per backward program
    bwd_grid = (batch, pl.cdiv(seq, block_seq * subs), grid[2])
    parts = batch * bwd_grid[1]
    args = _prepare(x, weight, bias, segment_ids, initial_state)
    out = (
        jax.ShapeDtypeStruct(args[0].shape, x.dtype),
        jax.ShapeDtypeStruct((parts * width, channels), jnp.float32),
        jax.ShapeDtypeStruct((parts, channels), jnp.float32),
    )
    g = dy.reshape(batch * seq, channels)
    if static["activation"] is not None:
        g_shape = jax.ShapeDtypeStruct(args[0].shape, jnp.float32)
        g = _call(_grad_kernel, g_shape, grid, interpret=interpret, num_warps=num_warps, **static)(*args, g)
    dx, dw, db = _call(
        _bwd_kernel, out, bwd_grid, interpret=interpret, num_warps=num_warps, subs=subs, **static
    )(*args, g)
    dw = dw.reshape(parts, width, channels).sum(0).astype(weight.dtype)
    db = db.sum(0).astype(bias.dtype)
    dstate = state_grad(x, weight, bias, segment_ids, initial_state, dy, cfg[0])
    return dx.reshape(x.shape), dw, db, None, dstate


_conv.defvjp(_fwd, _bwd)


IMPLEMENTATION = Implementation(
    "pallas_gpu",
    conv,
    platforms=("gpu",),
    block_sizes=ConvBlockSizes,
    heuristic=heuristic,
    space=pallas_gpu_space,
    interpretable=True,
    backward="custom_vjp: one Pallas kernel (dx, partial dw/dbias), state grad in JAX",
)
