"""The plainest correct attention: materialise the `[q, kv]` scores. The test oracle."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def attention(q, k, v, sinks, mask, *, scale, logits_soft_cap, return_lse=False):
    """`q [B, Sq, H, D]`, `k [B, Sk, KVH, D]`, `v [B, Sk, KVH, Dv]`, `sinks [H]` or None.
    `return_lse`: also `lse [B, Sq, H]` (float32, or float64), `log Σ exp(s)` over the visible
    keys and the sink, `-inf` for a query that sees nothing.

    Query head `h` reads kv head `h // (H // KVH)`. A sink is one more logit per head in the
    softmax's denominator with no value. A query that sees no key (and has no sink) gets 0.
    Computes in float32, or float64 for float64 inputs.

    Non-finite values: a non-finite score is NaN (before the soft cap, whose `tanh` would make
    an infinity finite), so a query that sees one is NaN; invisible entries are selected away
    (never multiplied by 0), so a NaN in `v` reaches only the queries that see its key. For
    that (and for autodiff's products with the cotangents) both products are formed per visible
    (query, key) pair with the invisible pairs' operands selected to 0: `[.., Sq, Sk, D]` memory.
    """
    acc = jnp.promote_types(q.dtype, jnp.float32)
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    vis = mask.dense(sq, k.shape[1])[:, None, None]  # [B|1, 1, 1, Sq, Sk]
    pairs = lambda a: jnp.where(vis[..., None], a, 0)  # noqa: E731 - [.., Sq, Sk, D], invisible pairs 0
    qg = q.reshape(b, sq, kvh, h // kvh, d).astype(acc).transpose(0, 2, 3, 1, 4)[:, :, :, :, None]
    kg = jnp.moveaxis(k.astype(acc), 1, 2)[:, :, None, None]  # [B, KVH, 1, 1, Sk, D]
    s = jnp.sum(pairs(qg) * pairs(kg), axis=-1) * scale
    s = s + jnp.where(jnp.isfinite(s), 0, jnp.nan)  # an addition: the gradient passes unchanged
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    m = jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1)
    if sinks is not None:
        sink = sinks.astype(acc).reshape(kvh, h // kvh)[None, :, :, None]
        m = jnp.maximum(m, sink)
    m = lax.stop_gradient(jnp.where(m == -jnp.inf, 0, m))
    p = jnp.where(vis, jnp.exp(s - m[..., None]), 0)
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    vg = jnp.moveaxis(v.astype(acc), 1, 2)[:, :, None, None]  # [B, KVH, 1, 1, Sk, Dv]
    out = jnp.sum(pairs(p[..., None]) * pairs(vg), axis=-2)
    seen = denom != 0  # 0: no key and no sink; a NaN stays NaN
    out = jnp.where(seen[..., None], out / jnp.where(seen, denom, 1)[..., None], 0)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, sq, h, -1).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1)), -jnp.inf)  # [B, KVH, G, Sq]
    return out, jnp.moveaxis(lse.reshape(b, h, sq), 2, 1)
