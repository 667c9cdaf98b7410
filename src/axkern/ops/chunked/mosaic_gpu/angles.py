"""The backward kernels' angles (Mamba-3's rotation, `operands.RotatedOperand`): what `theta` must be, its
chunk read into registers, and a float32 cotangent tile turned back by it in place."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load

from .operands import finite_or_zero, operand_parts
from .tiles import dims, plgpu

__all__ = ["check_angles", "read_angles", "turned_back"]


def check_angles(kernel, theta, group_sums, xt, bt, positions_first):
    """A `ValueError` naming the problem where `theta` is not what the backward kernels turn by:
    float32 `[b, h, L, A]` (`x`'s batch, heads and length), `A` a multiple of 32 at most `N/2`."""
    if theta is None:
        return
    if group_sums:
        raise ValueError(f"{kernel}: theta (dB, dC turned back per head) with group_sums")
    b, h, lp, _ = dims(xt, positions_first)
    n = operand_parts(bt)[0].shape[-1]
    a = theta.shape[-1]
    if theta.shape[:-1] != (b, h, lp) or a % 32 or a > n // 2 or theta.dtype != jnp.float32:
        raise ValueError(
            f"{kernel}: theta must be float32 [batch, heads, length, angles] = [{b}, {h}, {lp}, A] with A a "
            f"multiple of 32, at most state/2 = {n // 2}; got {theta.dtype}{list(theta.shape)}"
        )


def read_angles(theta_ref, batch, head, rows):
    """The chunk's angles `Θ` (`[Q, A]`, float32) of the head, read into registers."""
    return mosaic_gpu_load(theta_ref.at[batch, head, rows], layout=plgpu.Layout.WGMMA, optimized=False)


def turned_back(smem, cos, sin):
    """The float32 tile `smem` (`[Q, N]`, a rotated value's cotangent, `operands.py`) turned back
    by `-Θ` in place, `cos`, `sin` `[Q, A]`: columns `i < A` and `i + N/2` become `(g_i cos +
    g_{i+N/2} sin, g_{i+N/2} cos - g_i sin)`, non-finite results as 0 (as
    `operands.rotate_halves`); the other columns pass through untouched. Each thread reads back
    what it stored (a column slice of the `wgmma` layout at a multiple of 8 is the same threads'
    registers), so no barrier comes between. `A` a multiple of 32 (whole swizzled float32 tiles)."""
    n2, a = smem.shape[-1] // 2, cos.shape[-1]
    halves = (pl.ds(0, a), pl.ds(n2, a))
    g0, g1 = (mosaic_gpu_load(smem.at[:, c], layout=plgpu.Layout.WGMMA, optimized=False) for c in halves)
    for cols, r in zip(halves, (g0 * cos + g1 * sin, g1 * cos - g0 * sin), strict=True):
        smem.at[:, cols][...] = finite_or_zero(r)
