"""The Pallas Triton kernel that forms a rotated operand's two bf16 halves
(`operands.RotatedOperand.parts` with `kernel=True`: the differentiated forward's halves, where
the layout asks for them): one pass over the unrotated values per group, their biases and the
angles, `cos` and `sin` once for the operands turned by the same angles.

**Bytes**: per head and position `4 N` bytes of halves written for each operand and `4 T`
bytes of angles read for both (`T = turned_columns(A, N/2)`, the angles' columns widened to a
power of two; the pairs past them pass through), the group's `u` and the biases from the cache.
XLA's form of the same (`RotatedOperand.value()`, then `operand_parts`) keeps `cos Θ`, `sin Θ`
(`[b, h, L, N/2]` float32 each) and the rotated values in float32 in memory between its passes
(docs/ops/mamba3.md has the two timed)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = [
    "PARTS_ROWS",
    "PARTS_WARPS",
    "padded_angles",
    "turned_columns",
    "parts_kernel_reason",
    "rotated_parts",
]

_MAX = float(jnp.finfo(jnp.float32).max)


def padded_angles(theta, columns: int):
    """`theta` (`[.., A]`) padded with zero angles to `columns` columns."""
    return jnp.pad(theta, [(0, 0)] * (theta.ndim - 1) + [(0, columns - theta.shape[-1])])


# a `rotated_parts` program: positions, and Triton warps
PARTS_ROWS, PARTS_WARPS = 32, 4


def turned_columns(a: int, half: int) -> int:
    """The columns of each half `rotated_parts` turns: `A` widened (with zero angles) to a power
    of two whose rest of the half is 0 or a power of two too (Triton's blocks are powers of two),
    so the pass-through columns are no angles' work. `half` a power of two, `A <= half`."""
    if not 0 <= a <= half or half & (half - 1):
        raise ValueError(f"{a} angles do not fit a half of {half} columns (a power of two)")
    turned = 1 << max(a - 1, 0).bit_length()
    while (half - turned) & (half - turned - 1):
        turned *= 2
    return turned


def parts_kernel_reason(*ops) -> str | None:
    """Why `rotated_parts` cannot form the halves of `ops` (`operands.RotatedOperand`s: one
    operand, or two turned by the same angles), or None: Triton's blocks are powers of two (`N/2`
    columns a half), its rows whole blocks of `PARTS_ROWS` positions, `u` 16-bit."""
    rows = PARTS_ROWS
    op = ops[0]
    b, g, length, n = op.u.shape
    h, a, half = op.bias.shape[0], op.theta.shape[-1], n // 2
    if any(o.u.shape != op.u.shape or o.bias.shape != op.bias.shape for o in ops):
        return "the operands differ in shape"
    if any(o.theta.shape != (b, h, length, a) for o in ops):
        return f"the angles are not [batch, heads, length, A] = {(b, h, length, a)} for every operand"
    if h % g:
        return f"{h} heads are not a multiple of {g} groups"
    if a == 0:
        return "no angles: nothing to turn"
    if n % 2 or half & (half - 1) or half < 16:
        return f"state {n}: the kernel turns column halves of a power of two, at least 16"
    if a > half:
        return f"{a} angles for a state of {n}: at most {half}"
    if length % rows:
        return f"length {length} is not a multiple of {rows}"
    if jnp.dtype(op.u.dtype).itemsize != 2:
        return f"u is {op.u.dtype}, not 16-bit"
    return None


def _parts_kernel(*refs, count):
    """One (batch, head, rows) block of `count` operands turned by the same angles: `w = u + bias`
    turned on the pairs `(i, i + N/2)` by `Θ` (`[rows, T]`, `T = turned_columns`), the other
    columns as they are, non-finite results as 0, each value stored as `hi` (rounded to bf16)
    and `lo` (what that lost, rounded); `cos`, `sin` once for all the operands."""
    us, biases, theta_ref, outs = (
        refs[:count],
        refs[count : 2 * count],
        refs[2 * count],
        refs[2 * count + 1 :],
    )
    half, turned = us[0].shape[-1] // 2, theta_ref.shape[-1]
    f32 = jnp.float32
    theta = theta_ref[...]
    cos, sin = jnp.cos(theta), jnp.sin(theta)

    def store(hi_ref, lo_ref, cols, value):
        value = jnp.where(jnp.abs(value) <= _MAX, value, 0.0)  # (as `operands.finite_or_zero`)
        hi = value.astype(jnp.bfloat16)
        # `hi` back to float32 by its bits (`operand_parts`: a compiler may drop the round trip)
        back = lax.bitcast_convert_type(
            lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32) << 16, f32
        )
        hi_ref[:, cols] = hi
        lo_ref[:, cols] = (value - back).astype(jnp.bfloat16)

    for u_ref, bias_ref, hi_ref, lo_ref in zip(us, biases, outs[::2], outs[1::2], strict=True):

        def w(start, width, u_ref=u_ref, bias_ref=bias_ref):
            cols = pl.ds(start, width)
            return cols, u_ref[:, cols].astype(f32) + bias_ref[cols][None, :]

        (c0, w0), (c1, w1) = w(0, turned), w(half, turned)
        store(hi_ref, lo_ref, c0, w0 * cos - w1 * sin)
        store(hi_ref, lo_ref, c1, w0 * sin + w1 * cos)
        if turned < half:  # the columns no angle turns: `w · 1 + partner · 0`, as XLA's turn
            (c2, w2), (c3, w3) = w(turned, half - turned), w(half + turned, half - turned)
            store(hi_ref, lo_ref, c2, w2 + w3 * 0.0)  # (NaN, then 0, where the partner is not finite)
            store(hi_ref, lo_ref, c3, w3 + w2 * 0.0)


def rotated_parts(*ops, interpret: bool = False) -> tuple:
    """`operands.operand_parts(op.value())` of each of `ops` (one, or two turned by the same angles:
    Mamba-3's `q` and `k`), `(hi, lo)` per operand in one tuple, by one Pallas Triton kernel:
    grid (batch, head, `L / rows`), each program reading its group's `[rows, N]` of each `u`, the
    head's biases and `[rows, T]` angles (`T = turned_columns(A, N/2)`, `A` widened with zero
    angles in XLA where it is not such a power of two) and writing `[rows, N]` of each `hi`
    and `lo` (bf16, `[b, h, L, N]`). Memory bound: per head and position 4 bytes a rotated value
    written and `4 T` bytes of angles read for all the operands (`u`, per group, is read `h / g`
    times from the cache); `cos`, `sin` of each angle once. Each program takes `PARTS_ROWS`
    positions with `PARTS_WARPS` Triton warps."""
    rows, warps = PARTS_ROWS, PARTS_WARPS
    reason = parts_kernel_reason(*ops)
    if reason:
        raise ValueError(f"rotated_parts cannot form these halves: {reason}")
    op = ops[0]
    b, g, length, n = op.u.shape
    h = op.bias.shape[0]
    rep, count = h // g, len(ops)
    turned = turned_columns(op.theta.shape[-1], n // 2)
    theta = padded_angles(op.theta.astype(jnp.float32), turned)
    u_spec = pl.BlockSpec((None, None, rows, n), lambda i, j, c: (i, j // rep, c, 0))
    out = pl.BlockSpec((None, None, rows, n), lambda i, j, c: (i, j, c, 0))
    shape = jax.ShapeDtypeStruct((b, h, length, n), jnp.bfloat16)
    return tuple(
        pl.pallas_call(
            functools.partial(_parts_kernel, count=count),
            name="axkern_ssd_rotated_parts",
            grid=(b, h, length // rows),
            in_specs=[u_spec] * count
            + [pl.BlockSpec((None, n), lambda i, j, c: (j, 0))] * count
            + [pl.BlockSpec((None, None, rows, turned), lambda i, j, c: (i, j, c, 0))],
            out_specs=[out] * (2 * count),
            out_shape=[shape] * (2 * count),
            interpret=interpret,
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
        )(*(o.u for o in ops), *(o.bias.astype(jnp.float32) for o in ops), theta)
    )
