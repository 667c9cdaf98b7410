"""The cotangents of two rotated operands turned by the same angles (Mamba-3's `q` and `k`,
`rotation.RotatedOperand` with `same_angles`) by one Pallas Triton kernel, from their
cotangents already turned back by `-Θ` (`back`, per head, float32: what the Mosaic GPU backward
kernels return given the angles): `RotatedOperand.cotangent(g, turned=True)`'s three sums for
both operands in one pass, where XLA reads each `back` once for each sum.

**Math**, for each operand with `w = u + bias` (the unrotated value per head) and its `back`:
`du = Σ_{heads of the group} back` (in `u`'s dtype), `dbias = Σ_{b, L} back`, and for the angles
both operands share `dΘ_i = Σ_{operands} back_{i+N/2} w_i - back_i w_{i+N/2}` (`i < A`; the
columns pair as `(i, i + N/2)`).

**Grid** `(b, G, L / T)`, `T = ROWS` positions a program (halved until it divides `L`): each
program reads its group's `u` rows of both operands once and loops over the group's heads,
reading each head's `back` rows of both (`[T, N]` float32), adding them into the two `du`
accumulators (registers), writing the head's `dΘ` rows and each operand's bias sums over its
rows (per program, `[b, L / T, H, N]` float32, which XLA adds). Memory bound: per head and
position `8 N` bytes read (the two `back`) and `4 A` written (`dΘ`) against about `4 N + 12 A`
FLOPs (the two sums of each `back`, and for `dΘ` each operand's `w`, two products and their
difference), where XLA's passes read each `back` for the head sums, the bias sums and `dΘ` in
turn.

**Sizes** it takes (`reason`): `A` and `N/2` powers of two (Triton's slices), `A <= N/2`,
heads a multiple of the groups, `T >= 4` dividing `L`; otherwise the caller runs XLA's sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

ROWS = 32  # positions a program takes
WARPS = 4


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def rows_for(length: int, rows: int = ROWS) -> int:
    """The positions a program takes: `rows` halved until it divides `length` (0: below 4)."""
    while rows >= 4 and length % rows:
        rows //= 2
    return rows if rows >= 4 else 0


def reason(u_shape, heads: int, a: int, rows: int = ROWS) -> str | None:
    """Why the kernel cannot form these cotangents (`u [b, G, L, N]`, `heads`, `A` angles,
    programs of up to `rows` positions), or None."""
    _, groups, length, n = u_shape
    if rows < 4 or not _pow2(rows):
        return f"rows={rows} is not a power of two of at least 4 (Triton's tiles)"
    if length == 0:
        return "no positions"

    if heads % groups:
        return f"{heads} heads are not a multiple of {groups} groups"
    if n % 2 or not _pow2(n // 2) or not _pow2(a) or a > n // 2:
        return f"state {n} with {a} angles: the kernel takes powers of two, A <= N/2"
    if not rows_for(length, rows):
        return f"length {length} has no block of at least 4 positions that divides it"
    return None


def _kernel(
    gq_ref, gk_ref, uq_ref, uk_ref, bq_ref, bk_ref, duq_ref, duk_ref, dbq_ref, dbk_ref, dth_ref, *, heads
):
    """One (batch, group, `T` positions) block: `g*_ref [heads, T, N]` (`back`), `u*_ref [T, N]`,
    `b*_ref [heads, N]`, `du*_ref [T, N]`, `db*_ref [heads, N]` (this block's sums),
    `dth_ref [heads, T, A]`."""
    n, a = uq_ref.shape[-1], dth_ref.shape[-1]
    c0, c1 = pl.ds(0, a), pl.ds(n // 2, a)
    f32 = jnp.float32
    u = [(u_ref[:, c0].astype(f32), u_ref[:, c1].astype(f32)) for u_ref in (uq_ref, uk_ref)]

    def head(j, acc):
        d_theta = jnp.zeros(dth_ref.shape[1:], f32)
        out = []
        for (g_ref, b_ref, db_ref), (u0, u1), total in zip(
            ((gq_ref, bq_ref, dbq_ref), (gk_ref, bk_ref, dbk_ref)), u, acc, strict=True
        ):
            back = g_ref[j]  # [T, N]
            db_ref[j] = jnp.sum(back, axis=0)
            w0 = u0 + b_ref[j, c0][None, :]
            w1 = u1 + b_ref[j, c1][None, :]
            d_theta = d_theta + g_ref[j, :, c1] * w0 - g_ref[j, :, c0] * w1
            out.append(total + back)
        dth_ref[j] = d_theta
        return tuple(out)

    zeros = jnp.zeros(uq_ref.shape, f32)
    du_q, du_k = lax.fori_loop(0, heads, head, (zeros, zeros))
    duq_ref[...] = du_q.astype(duq_ref.dtype)
    duk_ref[...] = du_k.astype(duk_ref.dtype)


def turned_cotangents(uq, uk, bias_q, bias_k, a: int, back_q, back_k, *, interpret=False, rows=ROWS):
    """`(du_q, dbias_q, du_k, dbias_k, dΘ)` from `u* [b, G, L, N]` (16-bit), `bias* [H, N]`, the
    angles' count `A` and `back* [b, H, L, N]` float32 (the module docstring): `du*` in `u`'s
    dtype, `dbias*` float32 `[H, N]`, `dΘ` float32 `[b, H, L, A]`, both operands' share."""
    why = reason(uq.shape, bias_q.shape[0], a, rows)
    if why:
        raise ValueError(f"turned_cotangents cannot form these sums: {why}")
    b, groups, length, n = uq.shape
    heads = bias_q.shape[0]
    per, t = heads // groups, rows_for(length, rows)
    blocks = length // t
    f32 = jnp.float32
    heads_rows = pl.BlockSpec((None, per, t, n), lambda i, g, c: (i, g, c, 0))
    group_rows = pl.BlockSpec((None, None, t, n), lambda i, g, c: (i, g, c, 0))
    biases = pl.BlockSpec((per, n), lambda i, g, c: (g, 0))
    sums = pl.BlockSpec((None, None, per, n), lambda i, g, c: (i, c, g, 0))
    du_q, du_k, db_q, db_k, d_theta = pl.pallas_call(
        functools.partial(_kernel, heads=per),
        name="axkern_ssd_rotation_cotangents",
        grid=(b, groups, blocks),
        in_specs=[heads_rows, heads_rows, group_rows, group_rows, biases, biases],
        out_specs=[
            group_rows,
            group_rows,
            sums,
            sums,
            pl.BlockSpec((None, per, t, a), lambda i, g, c: (i, g, c, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(uq.shape, uq.dtype),
            jax.ShapeDtypeStruct(uk.shape, uk.dtype),
            jax.ShapeDtypeStruct((b, blocks, heads, n), f32),
            jax.ShapeDtypeStruct((b, blocks, heads, n), f32),
            jax.ShapeDtypeStruct((b, heads, length, a), f32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=WARPS),
    )(back_q.astype(f32), back_k.astype(f32), uq, uk, bias_q.astype(f32), bias_k.astype(f32))
    return du_q, db_q.sum((0, 1)), du_k, db_k.sum((0, 1)), d_theta
