"""Mamba-3's angles `Θ` by one Pallas Triton kernel, forward and backward (`angle_thetas`), where
XLA forms them in several passes (`angles.angle_sums`: `π tanh(angles) Δ`, the sums inside
chunks as a masked product, the carry between chunks, the remainder, the move to heads first).

**Math.** `inc_t = π tanh(angles_t) Δ_t` (non-finite `angles` as 0, `Δ` given clean), `Θ_t =
(Θ_0 [t in the first segment] + Σ_{s <= t in t's segment} inc_s) mod 2π`. The backward:
`dinc_t = Σ_{s >= t in t's segment} dΘ_s` (the remainder's derivative is 1), `dangles_t =
dinc_t π Δ_t (1 - tanh² angles_t)` (NaN where `angles_t` is not finite, as `chunks.clean`
reports it), `dΔ_t = Σ_a dinc_t π tanh angles_t`, `dΘ_0 = dinc_0` (position 0 is always in the
first segment). A NaN cotangent `dΘ_s` reaches every earlier position of its block through the
masked product's zeros (`0 · NaN`), other segments' too: NaN gradients there where the
recurrence's are numbers (never the reverse; XLA's `angle_sums` does the same within its
chunks).

**Layout and grid.** One program per (batch row, head, group of `COLS` angles) walks the
positions in blocks of `ROWS`, the running angle carried in registers: the sums inside a block
are a `[ROWS, ROWS]` 0/1 mask (same segment, `s <= t`) times the block's `[ROWS, COLS]`
increments (products about as exact as float32 ones, `_exact`, as XLA's `Precision.HIGHEST`
einsum), plus the carried angle where the block's rows continue its segment, and the remainder
taken per block, as `angle_sums` takes it per chunk: its rounding does not grow with the length.
The backward walks the blocks from the last, the sums over `s >= t`; each group's share of `dΔ`
is summed in XLA. `angles` are read where they lie (`[b, L, h, A]`), `Θ` written heads first
(`[b, h, L, A]` float32, where the rotation and the kernels read it), `Δ` read as `[b, h, L]`.

**Bytes** per position and head: forward `angles` read and `Θ` written, `8 A` bytes (float32
angles); backward `dΘ`, `angles` read and `dangles` written, `12 A`. FLOPs: `6 ROWS A` per
position for the masked sums (three TF32 products). Each program walks its blocks in turn, so
latency rather than these bytes bounds it (docs/ops/mamba3.md).

**Sizes**: `A` is widened to a power of two of at least 16 (Triton's product tiles) with zero
angles, the length to a multiple of `ROWS` with zeros (both only where needed: a copy in XLA).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from axkern.core.blocks import next_power_of_2

ROWS = 64  # positions per block: the masked product's tile
WARPS = 4
COLS = 16  # angles per program (None: all of them)
STAGES = 3
_TWO_PI = 2 * math.pi
_MAX = float(jnp.finfo(jnp.float32).max)


def _exact(interpret):
    """The masked sums' precision: float32 products exact enough (Triton's default for float32
    is TF32, whose 10-bit increments lose `Θ`'s accuracy over long segments, docs/ops/mamba3.md):
    three TF32 products on the GPU (the 0/1 mask is exact in TF32, the increments' low part
    keeps what their TF32 rounding loses), `HIGHEST` in interpret mode (the CPU has no TF32)."""
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _finite(a):
    return jnp.abs(a) <= _MAX  # False for NaN and both infinities


def _mask(seg, rows, later):
    """`[rows, rows]` float32: 1 where positions `t` (rows) and `s` (columns) share a segment
    and `s <= t` (`later`: `s >= t`)."""
    t = lax.broadcasted_iota(jnp.int32, (rows, rows), 0)
    s = lax.broadcasted_iota(jnp.int32, (rows, rows), 1)
    order = s >= t if later else s <= t
    return ((seg[:, None] == seg[None, :]) & order).astype(jnp.float32)


def _row(x, rows, at):
    """Row `at` of `x` (`[rows, ...]`) as a sum (a Triton tile has no indexing)."""
    pick = lax.broadcasted_iota(jnp.int32, (rows,), 0) == at
    if x.ndim == 1:
        return jnp.sum(jnp.where(pick, x, 0))
    return jnp.sum(jnp.where(pick[:, None], x, 0.0), axis=0)


def _forward_kernel(ang_ref, dt_ref, theta0_ref, seg_ref, theta_ref, *, rows, exact):
    blocks = seg_ref.shape[0] // rows

    def block(i, carry):
        theta_c, seg_c = carry
        at = pl.ds(pl.multiple_of(i * rows, rows), rows)
        a = ang_ref[at, :].astype(jnp.float32)
        inc = math.pi * jnp.tanh(jnp.where(_finite(a), a, 0.0)) * dt_ref[at][:, None]
        seg = seg_ref[at]
        local = jnp.dot(_mask(seg, rows, False), inc, precision=exact)
        theta = jnp.mod(local + jnp.where((seg == seg_c)[:, None], theta_c[None, :], 0.0), _TWO_PI)
        theta_ref[at, :] = theta
        return _row(theta, rows, rows - 1), _row(seg, rows, rows - 1)

    lax.fori_loop(0, blocks, block, (theta0_ref[...].astype(jnp.float32), jnp.int32(0)))


def _backward_kernel(g_ref, ang_ref, dt_ref, seg_ref, dang_ref, ddt_ref, dtheta0_ref, *, rows, exact):
    blocks = seg_ref.shape[0] // rows

    def block(j, carry):
        d_c, seg_c = carry
        at = pl.ds(pl.multiple_of((blocks - 1 - j) * rows, rows), rows)
        seg = seg_ref[at]
        d_inc = jnp.dot(_mask(seg, rows, True), g_ref[at, :], precision=exact) + jnp.where(
            (seg == seg_c)[:, None], d_c[None, :], 0.0
        )
        a = ang_ref[at, :].astype(jnp.float32)
        ok = _finite(a)
        th = jnp.tanh(jnp.where(ok, a, 0.0))
        dt = dt_ref[at]
        dang_ref[at, :] = jnp.where(ok, d_inc * (math.pi * dt)[:, None] * (1.0 - th * th), jnp.nan).astype(
            dang_ref.dtype
        )
        ddt_ref[at] = jnp.sum(d_inc * th, axis=1) * math.pi
        return _row(d_inc, rows, 0), _row(seg, rows, 0)

    d0 = jnp.zeros(dtheta0_ref.shape, jnp.float32)
    d_first, _ = lax.fori_loop(0, blocks, block, (d0, jnp.int32(-1)))
    dtheta0_ref[...] = d_first


def _sizes(ang, rows):
    length, a = ang.shape[1], ang.shape[-1]
    return -(-length // rows) * rows, max(16, next_power_of_2(a))


def _pad(x, axis, size):
    widen = [(0, 0)] * x.ndim
    widen[axis] = (0, size - x.shape[axis])
    return x if size == x.shape[axis] else jnp.pad(x, widen)


def _pad_seg(seg, size):
    """The ids padded to `size` positions with the last one (the padding continues the last
    segment, with zero increments)."""
    b, length = seg.shape
    if size == length:
        return seg
    return jnp.concatenate([seg, jnp.broadcast_to(seg[:, -1:], (b, size - length))], axis=1)


def _specs(lp, cols):
    """Block specs over the grid (batch, head, column block of `cols` angles)."""
    return dict(
        ang=pl.BlockSpec((None, lp, None, cols), lambda i, j, k: (i, 0, j, k)),
        heads_first=pl.BlockSpec((None, None, lp, cols), lambda i, j, k: (i, j, 0, k)),
        per_head=pl.BlockSpec((None, None, lp), lambda i, j, k: (i, j, 0)),
        per_block=pl.BlockSpec((None, None, None, lp), lambda i, j, k: (i, j, k, 0)),
        seg=pl.BlockSpec((None, lp), lambda i, j, k: (i, 0)),
        angle0=pl.BlockSpec((None, None, cols), lambda i, j, k: (i, j, k)),
    )


def _tiles(tiles, ap):
    """`(rows, warps, cols, stages)` with `cols` (None: all) at most the widened angle count."""
    rows, warps, cols, stages = tiles
    return rows, warps, min(cols or ap, ap), stages


def _forward(ang, dt, theta0, seg, tiles, interpret):
    b, length, h, a = ang.shape
    lp, ap = _sizes(ang, tiles[0])
    rows, warps, cols, stages = _tiles(tiles, ap)
    sp = _specs(lp, cols)
    theta = pl.pallas_call(
        functools.partial(_forward_kernel, rows=rows, exact=_exact(interpret)),
        name="axkern_mamba3_angles",
        grid=(b, h, ap // cols),
        in_specs=[sp["ang"], sp["per_head"], sp["angle0"], sp["seg"]],
        out_specs=sp["heads_first"],
        out_shape=jax.ShapeDtypeStruct((b, h, lp, ap), jnp.float32),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
    )(
        _pad(_pad(ang, 1, lp), 3, ap),
        _pad(dt.astype(jnp.float32), 2, lp),
        _pad(theta0.astype(jnp.float32), 2, ap),
        _pad_seg(seg, lp),
    )
    return theta[:, :, :length, :a]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _thetas(ang, dt, theta0, seg, tiles, interpret):
    return _forward(ang, dt, theta0, seg, tiles, interpret)


def _thetas_fwd(ang, dt, theta0, seg, tiles, interpret):
    return _forward(ang, dt, theta0, seg, tiles, interpret), (ang, dt, theta0, seg)


def _thetas_bwd(tiles, interpret, res, g):
    ang, dt, theta0, seg = res
    b, length, h, a = ang.shape
    lp, ap = _sizes(ang, tiles[0])
    rows, warps, cols, stages = _tiles(tiles, ap)
    sp = _specs(lp, cols)
    dang, ddt, dtheta0 = pl.pallas_call(
        functools.partial(_backward_kernel, rows=rows, exact=_exact(interpret)),
        name="axkern_mamba3_angles_bwd",
        grid=(b, h, ap // cols),
        in_specs=[sp["heads_first"], sp["ang"], sp["per_head"], sp["seg"]],
        out_specs=[sp["ang"], sp["per_block"], sp["angle0"]],
        out_shape=[
            jax.ShapeDtypeStruct((b, lp, h, ap), ang.dtype),
            jax.ShapeDtypeStruct((b, h, ap // cols, lp), jnp.float32),  # each column block's share
            jax.ShapeDtypeStruct((b, h, ap), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
    )(
        _pad(_pad(g.astype(jnp.float32), 2, lp), 3, ap),
        _pad(_pad(ang, 1, lp), 3, ap),
        _pad(dt.astype(jnp.float32), 2, lp),
        _pad_seg(seg, lp),
    )
    seg_zero = jnp.zeros(seg.shape, jax.dtypes.float0)
    return (
        dang[:, :length, :, :a],
        ddt.sum(2)[:, :, :length].astype(dt.dtype),
        dtheta0[..., :a].astype(theta0.dtype),
        seg_zero,
    )


_thetas.defvjp(_thetas_fwd, _thetas_bwd)


def angle_thetas(
    angles,
    dt,
    theta0,
    seg,
    *,
    rows: int = ROWS,
    warps: int = WARPS,
    cols: int | None = COLS,
    stages: int = STAGES,
    interpret: bool = False,
):
    """`Θ`, `[b, h, L, A]` float32 heads first, from `angles [b, L, h, A]` as given (float32 or
    16-bit; non-finite values taken as 0), `dt [b, h, L]` (`Δ`, finite: the caller cleans it),
    `theta0 [b, h, A]` (finite) and the internal segment ids `seg [b, L]` (int32, running
    counts from 0, `chunks.segment_starts`: `Θ_0` joins the segment of id 0); `angles.angle_sums` by one Pallas Triton kernel
    (the module docstring), differentiable in `angles`, `dt` and `theta0`. `rows`, `warps`: the
    blocks' positions and the programs' warps, `cols` the angles a program takes (None: all; a
    power of two of at least 16), `stages` Triton's pipeline stages."""
    for name, n in (("rows", rows), ("cols", cols or 16)):
        if n < 16 or n & (n - 1):
            raise ValueError(
                f"angle_thetas: {name}={n} is not a power of two of at least 16 (Triton's product tiles)"
            )
    b, length, h, a = angles.shape
    if a == 0 or length == 0:
        return jnp.zeros((b, h, length, a), jnp.float32)
    return _thetas(angles, dt, theta0, seg.astype(jnp.int32), (rows, warps, cols, stages), interpret)


def angle_thetas_for(interpret: bool):
    """`angle_thetas` compiled, or in interpret mode: a core's `angle_kernel`."""
    return functools.partial(angle_thetas, interpret=bool(interpret))
