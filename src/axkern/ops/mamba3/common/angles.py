"""Mamba-3's angles `Θ`: running sums of `π tanh(angles) Δ` inside each segment, mod 2π, summed
inside chunks and carried between chunks by a parallel (associative) scan that takes the
remainder at every combination, so that its rounding does not grow with the length and no loop
of one step per chunk runs (`layer.py` has the rest of the chunked form)."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def within_chunks(ic, sc):
    """`Σ_{s <= t in t's segment} inc_s` inside each chunk (`ic [b, c, Q, h, a]`, `sc [b, c, Q]`)
    as a `[Q, Q]` masked product with exact float32 products (also without segments: docs/ops/mamba3.md
    has its times beside `jnp.cumsum` along the chunk and sums of 8 as products)."""
    t = jnp.arange(ic.shape[2])
    same = ((sc[..., :, None] == sc[..., None, :]) & (t[:, None] >= t[None, :])).astype(ic.dtype)
    return jnp.einsum("bcts,bcsha->bctha", same, ic, precision=lax.Precision.HIGHEST)


def angle_sums(inc, theta0, seg, q):
    """`Θ_t = (Θ_0 [t in the first segment] + Σ_{s <= t in t's segment} inc_s) mod 2π`, `inc
    [b, l, h, a]` finite, `theta0 [b, h, a]`, `seg [b, l]` internal ids; chunks of `q`."""
    batch, length, heads, a = inc.shape
    if a == 0:
        return inc
    pad = (-length) % q
    inc = jnp.pad(inc, [(0, 0), (0, pad), (0, 0), (0, 0)])
    seg = jnp.concatenate([seg, jnp.broadcast_to(seg[:, -1:], (batch, pad))], axis=1)
    ic = inc.reshape(batch, -1, q, heads, a)
    sc = seg.reshape(batch, -1, q)
    local = within_chunks(ic, sc)
    before = jnp.concatenate([sc[:, :1, 0], sc[:, :-1, -1]], axis=1)  # [b, c]
    whole = sc[:, :, -1] == before  # no segment starts inside the chunk

    # the angle entering each chunk: a segmented sum over chunks, the remainder taken at every
    # step, as a parallel (associative) scan rather than a loop of one step per chunk. An
    # element is (continues, angle): a chunk with no segment start continues the sum before it.
    def combine(x, y):
        (keep_x, th_x), (keep_y, th_y) = x, y
        summed = jnp.where(keep_y, th_x + th_y, th_y)
        return keep_x & keep_y, jnp.mod(summed, 2 * math.pi)

    keep = jnp.concatenate([jnp.zeros_like(whole[:, :1]), whole], axis=1)[:, :, None, None]
    angles = jnp.concatenate([theta0[:, None], local[:, :, -1]], axis=1)  # [b, c + 1, h, a]
    _, theta_out = lax.associative_scan(combine, (keep, angles), axis=1)
    # before chunk c: Θ_0 as given (a scan's first element is itself), then the remainder after c - 1
    theta_in = theta_out[:, :-1, None]  # [b, c, 1, h, a]
    cont = (sc == before[:, :, None])[..., None, None]
    theta = jnp.mod(jnp.where(cont, theta_in, 0) + local, 2 * math.pi)
    return theta.reshape(batch, -1, heads, a)[:, :length]
