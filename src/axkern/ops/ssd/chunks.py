"""Plain-JAX pieces every chunked SSD implementation shares (not an implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pad_to_chunks(x, dt, B, C, segment_ids, q):
    """`x, dt, B, C` padded along the length to a multiple of `q` (zero rows: `dt = 0` leaves
    the state alone) and the segment ids (zeros when absent), the pad continuing the last id."""
    batch, length = x.shape[:2]
    pad = (-length) % q
    seg = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    if not pad:
        return x, dt, B, C, seg
    zeros = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
    seg = jnp.concatenate([seg, jnp.broadcast_to(seg[:, -1:], (batch, pad))], axis=1)
    return zeros(x), zeros(dt), zeros(B), zeros(C), seg


def skip_and_gate(y, x, D, z):
    """`(y + D x) · silu(z)`, each part only when given, in `y`'s (float32) dtype."""
    acc = y.dtype
    if D is not None:
        y = y + x.astype(acc) * (D.astype(acc) if D.ndim == 2 else D.astype(acc)[:, None])
    if z is not None:
        y = y * jax.nn.silu(z.astype(acc))
    return y
