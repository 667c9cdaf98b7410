"""The plainest correct attention: materialise the `[q, kv]` scores. The test oracle."""

from __future__ import annotations

import jax.numpy as jnp


def attention(q, k, v, sinks, mask, *, scale, logits_soft_cap):
    """`q [B, Sq, H, D]`, `k [B, Sk, KVH, D]`, `v [B, Sk, KVH, Dv]`, `sinks [H]` or None.

    Query head `h` reads kv head `h // (H // KVH)`. A sink is one more logit per head in the
    softmax's denominator with no value. A query that sees no key (and has no sink) gets 0.
    Computes in float32, or float64 for float64 inputs.
    """
    acc = jnp.promote_types(q.dtype, jnp.float32)
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, sq, kvh, h // kvh, d).astype(acc)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(acc)) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    vis = mask.dense(sq, k.shape[1])[:, None, None]  # [B|1, 1, 1, Sq, Sk]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if sinks is not None:
        sink = sinks.astype(acc).reshape(kvh, h // kvh)[None, :, :, None]
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0)
    p = jnp.exp(s - m[..., None])
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    out = jnp.einsum("bhgqk,bkhd->bhgqd", p, v.astype(acc))
    out = jnp.where(denom[..., None] > 0, out / jnp.where(denom > 0, denom, 1)[..., None], 0)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, sq, h, -1).astype(q.dtype)
