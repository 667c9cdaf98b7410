"""SSD's Pallas chunk kernels as Mamba-3's chunk scan (`kernel_core`): the engine's
`kernel_scan.scan` through a backend's `Layout`, each MIMO token's ranks as consecutive kernel
positions (`layer.py` has the chunked form that calls it)."""

from __future__ import annotations

import jax.numpy as jnp

from axkern.ops.chunked import kernel_scan
from axkern.ops.chunked.mosaic_gpu.operands import RotatedOperand, halves_to_pairs, pairs_to_halves

from ..blocks import kernel_slots
from .angle_kernel import angle_thetas_for
from .layer import Core

__all__ = ["kernel_core", "kernel_x_dtype", "refuse_float64", "rotating_core"]

# `reference.mamba3`'s arguments, in order
ARGUMENTS = (
    "q k v adt dt trap q_bias k_bias angles D z segment_ids angle_state ssm_state k_state v_state W_x W_z W_o"
).split()


def refuse_float64(args) -> None:
    """`Unsupported`, naming them, where any of `reference.mamba3`'s arguments `args` is float64
    (`kernel_scan.refuse_float64`: the kernels compute in float32)."""
    kernel_scan.refuse_float64(**dict(zip(ARGUMENTS, args, strict=True)))


def kernel_x_dtype(dtype, mimo):
    """The dtype `x` enters the kernels in: the inputs' `dtype` for SISO (`x` is `v`), float32 for
    MIMO (`x = v ⊙ W_x` rounded to bf16 missed the oracle rule at rank 3)."""
    return jnp.promote_types(dtype, jnp.float32) if mimo else jnp.dtype(dtype)


def kernel_core(
    layout, *, chunk_size, interpret, dtype, mimo, diagonal=True, rotation_backward=None, angle_kernel=False
) -> Core:
    """SSD's Pallas chunk kernels (`chunked/kernel_scan.py`, with `layout` a `Layout` subclass) as a
    `Core` over chunks of `chunk_size` tokens. `x` goes in as `kernel_x_dtype(dtype, mimo)`; the
    kernels take the path of the inputs' `dtype` (the products' precision, the decay's form);
    `B`, `C` (rotated `k`, `q`) per head, heads first (`[b, H, l, R, N]`, the `heads_major` form
    of `layer.forward`: the kernels' layout, so the rotation writes them where the kernels read them).
    `rotation_backward`: the rotation's backward for `rotated` (None: XLA's). `angle_kernel`:
    `Θ` by the Triton kernel `angle_thetas` (a GPU layout's; in interpret mode with `interpret`).

    The kernels take one input per position, so token `t`'s `R` inputs run as `S =
    blocks.kernel_slots(R)` consecutive positions `(t, 0..S-1)` (ranks past `R` zero): the
    log-decay `a_t` on `(t, 0)` and 0 on the others, the scale `s_t` and the segment id on all.
    The kernels apply position `(t, r)`'s decay before adding its input, so after `(t, S-1)` the
    state is `exp(a_t) state_{t-1} + s_t Σ_r x_{t,r} B_{t,r}ᵀ`, exactly the recurrence's: the
    states between the kernels' chunks (`chunk_size · S` positions, starting at tokens) and the
    final state are exact, and a segment starting at `t` resets at `(t, 0)`. Output `(t, r)`
    reads the state after `(t, r)`: it misses the same token's later ranks, `s_t Σ_{u > r}
    (C_{t,r} · B_{t,u}) x_{t,u}`, which `layer.forward` adds (`later_ranks=True`)."""

    def core(x, a, s, B, C, seg, initial_state, diag=None):
        batch, length, rank, heads, _ = x.shape
        slots = kernel_slots(rank)

        def spread(u):  # [b, l, R, h, d] -> [b, l·S, h, d]
            u = jnp.pad(u, [(0, 0), (0, 0), (0, slots - rank), (0, 0), (0, 0)])
            return u.reshape(batch, length * slots, *u.shape[3:])

        def spread_heads_first(u):  # [b, h, l, R, n] -> [b, h, l·S, n]
            u = jnp.pad(u, [(0, 0), (0, 0), (0, 0), (0, slots - rank), (0, 0)])
            return u.reshape(batch, heads, length * slots, u.shape[-1])

        first = jnp.arange(slots) == 0
        y, final = kernel_scan.scan(
            layout,
            spread(x.astype(kernel_x_dtype(dtype, mimo))),
            jnp.where(first[:, None], a[:, :, None], 0).reshape(batch, length * slots, heads),
            jnp.repeat(s, slots, axis=1),
            spread_heads_first(B),
            spread_heads_first(C),
            jnp.repeat(seg, slots, axis=1),
            initial_state,
            chunk_size=chunk_size * slots,
            interpret=interpret,
            products=dtype,
            groups_first=True,
            diag=diag,
        )
        return y.reshape(batch, length, slots, *y.shape[2:])[:, :, :rank], final

    core.heads_major = True
    core.rotation_backward = rotation_backward
    core.angle_kernel = angle_thetas_for(interpret) if angle_kernel else None
    core.x_dtype = kernel_x_dtype(dtype, mimo)
    # SISO with `diagonal`: the diagonal correction inside the chunk-scan kernels
    # (`chunked/chunk_scan.py`); MIMO's correction also holds a token's later ranks, which stay in XLA
    core.diagonal = diagonal and not mimo and layout.diagonal
    return core


def rotating_core(
    layout, *, chunk_size, dtype, interpret=False, clean_x=False, diagonal=False, angle_kernel=False
) -> Core:
    """SSD's chunk kernels as a SISO `Core` whose kernels turn `q` and `k` themselves (`rotates`:
    `B`, `C` come as the unrotated values per group, the biases and `Θ` heads first, and enter
    the scan as `chunked.mosaic_gpu.operands.RotatedOperand`s: `mosaic_gpu`'s fused forward,
    `pallas_tpu`'s kernels, `chunked/tpu_rotation.py`). The rotation pairs `(i, i + N/2)`, so the
    state's columns run evens first, odds next inside the scan (`pairs_to_halves` on `q`, `k`,
    the biases and the initial state, undone on the final state): no product notices the order.
    `clean_x`: `x` as it comes (`cleans_x`), the scan taking its non-finite values as 0 in every
    kernel that reads it. `diagonal`: the diagonal correction inside the chunk-scan kernels
    where the layout's take it. `interpret`: the layout's Pallas stages in interpret mode.
    `angle_kernel`: `Θ` by the Triton kernel `common.angle_thetas` (`kernel_core`'s)."""

    def operand(u, bias, theta):  # u [b, l, 1, g, n], bias [1, h, n], theta [b, h, l, a]
        u = pairs_to_halves(jnp.transpose(u[:, :, 0], (0, 2, 1, 3)))  # [b, g, l, n]
        return RotatedOperand(u, pairs_to_halves(bias[0]), theta, same_angles=True)  # q, k: the same Θ

    def core(x, a, s, B, C, seg, initial_state, diag=None):
        y, final = kernel_scan.scan(
            layout,
            x[:, :, 0].astype(dtype),
            a,
            s,
            operand(*B),
            operand(*C),
            seg,
            pairs_to_halves(initial_state),
            chunk_size=chunk_size,
            interpret=interpret,
            products=dtype,
            groups_first=True,
            clean_x=clean_x,
            diag=diag,
        )
        return y[:, :, None], halves_to_pairs(final)

    core.heads_major, core.rotates, core.x_dtype = True, True, jnp.dtype(dtype)
    core.diagonal = diagonal and layout.diagonal
    core.cleans_x = clean_x  # `x` may come with non-finite values: the scan takes them as 0
    core.angle_kernel = angle_thetas_for(interpret) if angle_kernel else None
    return core
