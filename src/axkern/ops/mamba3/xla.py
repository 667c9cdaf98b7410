"""Mamba-3 by chunks in plain JAX: the SSD chunk scan (`chunked/scan.py`) with the per-position
log-decay `adt` and the trapezoid's input scale, plus a diagonal correction (`common/layer.py` has the
derivation). The scan is a `custom_vjp` whose backward recomputes each chunk's `[Q, Q]` terms
from the inputs and the states entering the chunks (`[b, c, H, P, N]`, the only states kept);
the per-position preparation (angles, weights) and the output's correction, skip, gate and rank
collapse differentiate by autodiff, the rotation of `q` and `k` by its own backward
(`common.rotation.rotated`: it keeps the unrotated inputs and turns the cotangent back).

**Cost.** `O(L·Q·R²·(N + P)·H)` inside chunks and `O(L/Q · H·P·N)` between them (`R` the MIMO
rank, 1 for SISO), about twice that backward plus the recomputed forward terms.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from axkern.core import kernels
from axkern.core.op import Implementation
from axkern.ops.chunked.chunks import uses_segment_sums
from axkern.ops.chunked.scan import scan_recompute

from .blocks import Mamba3BlockSizes, heuristic, refuse_forms, space
from .common.layer import forward
from .common.rotation import rotate

__all__ = ["IMPLEMENTATION", "mamba3", "step"]


def mamba3(*args, block_sizes):
    """`reference.mamba3`'s arguments and results, by chunks of `block_sizes.chunk_size`."""
    refuse_forms(block_sizes, "xla")
    prec, sums = kernels.products_precision(args[2].dtype), uses_segment_sums(args[2].dtype)
    core = functools.partial(scan_recompute, chunk_size=block_sizes.chunk_size, precision=prec, sums=sums)
    return forward(core, *args, chunk_size=block_sizes.chunk_size)


def step(
    q_t, k_t, v_t, adt_t, dt_t, trap_t, q_bias, k_bias, angles_t, D, z_t, angle, ssm, k, v, W_x, W_z, W_o
):
    """One recurrence step (`reference.step`'s arguments and results), in float32 (float64 for
    float64); no segment, so nothing is masked and a NaN goes where the arithmetic takes it.
    `q_t, k_t [b, r, g, n]`, `v_t, z_t [b, h, p]`, `adt_t, dt_t, trap_t [b, h]`, `angles_t [b, h, a]`."""
    acc = jnp.promote_types(v_t.dtype, jnp.float32)
    heads = v_t.shape[1]
    mimo = W_x is not None
    f = lambda a: a.astype(acc)  # noqa: E731
    by_rank = lambda w: jnp.swapaxes(f(w), 0, 1)  # noqa: E731 - [h, r, ..] -> [r, h, ..]
    nan_if = lambda a: a + jnp.where(jnp.isfinite(a), 0, jnp.nan).astype(a.dtype)  # noqa: E731
    lam, alpha, dt = jax.nn.sigmoid(nan_if(f(trap_t))), jnp.exp(nan_if(f(adt_t))), f(dt_t)
    theta = jnp.mod(f(angle) + math.pi * jnp.tanh(nan_if(f(angles_t))) * dt[..., None], 2 * math.pi)
    per_head = lambda a: jnp.repeat(f(a), heads // a.shape[2], axis=2)  # noqa: E731 - [b, r, h, n]
    qr = rotate(per_head(q_t) + by_rank(q_bias), theta[:, None], mimo)
    kr = rotate(per_head(k_t) + by_rank(k_bias), theta[:, None], mimo)
    v_new = f(v_t)[:, None] * by_rank(W_x) if mimo else f(v_t)[:, None]  # [b, r, h, p]
    v_old = f(v)[:, None] * by_rank(W_x) if mimo else f(v)[:, None]
    prec = kernels.full_precision(acc)
    outer = lambda a, b: jnp.einsum("brhp,brhn->bhpn", a, b, precision=prec)  # noqa: E731
    beta, gamma = ((1 - lam) * dt * alpha)[..., None, None], (lam * dt)[..., None, None]
    h = alpha[..., None, None] * f(ssm) + beta * outer(v_old, f(k)) + gamma * outer(v_new, kr)
    y = jnp.einsum("bhpn,brhn->brhp", h, qr, precision=prec)
    if D is not None:
        y = y + f(D)[:, None] * v_new
    if z_t is not None:
        y = y * jax.nn.silu(f(z_t)[:, None] * by_rank(W_z) if mimo else f(z_t)[:, None])
    y = jnp.sum(y * by_rank(W_o), axis=1) if mimo else y[:, 0]
    return (
        y.astype(v_t.dtype),
        theta.astype(angle.dtype),
        h.astype(ssm.dtype),
        kr.astype(k.dtype),
        v_t.astype(v.dtype),
    )


IMPLEMENTATION = Implementation(
    "xla",
    mamba3,
    block_sizes=Mamba3BlockSizes,
    heuristic=heuristic,
    space=space,
    backward="custom_vjp: chunked, each chunk's terms recomputed from the states entering the chunks",
)
