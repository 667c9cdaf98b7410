"""Shapes that `axkern bench attention` uses. FLOPs count the visible part of `q k^T` and `p v`
(`4·B·H·D` per visible (query, key) pair forward, 2.5 times that backward)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from axkern import masks
from axkern.bench import Case

from .api import attention_positional

# batch, length, heads, kv_heads, head_dim, mask
PRESETS = {
    "quick": [(1, 256, 4, 2, 32, "causal")],
    "h200": [
        (2, 8192, 32, 32, 128, "causal"),
        (2, 8192, 32, 8, 128, "causal"),
        (2, 8192, 32, 32, 64, "causal"),
        (2, 8192, 32, 32, 128, "window1024"),
        (2, 8192, 32, 32, 128, "docs1024"),
    ],
    # the Hopper forward's two headline cases: causal and no mask
    "h200_core": [
        (2, 8192, 32, 32, 128, "causal"),
        (2, 8192, 32, 32, 128, "full"),
    ],
}


def _mask(name, batch, length):
    if name == "full":
        return masks.Full()
    if name == "window1024":
        return masks.SlidingWindow(1024)
    if name == "docs1024":  # packed documents of 1024 tokens, causal within each
        ids = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) // 1024, (batch, length))
        return masks.Causal() & masks.Segments(ids, ids)
    return masks.Causal()


def case(batch, length, heads, kv_heads, head_dim, mask_name="causal", dtype="bfloat16") -> Case:
    dt = jnp.dtype(dtype)
    mask = _mask(mask_name, batch, length)

    def make(key):
        k = jax.random.split(key, 3)
        q = jax.random.normal(k[0], (batch, length, heads, head_dim), jnp.float32).astype(dt)
        kk = jax.random.normal(k[1], (batch, length, kv_heads, head_dim), jnp.float32).astype(dt)
        v = jax.random.normal(k[2], (batch, length, kv_heads, head_dim), jnp.float32).astype(dt)
        return q, kk, v

    def forward(impl, q, k, v):
        return attention_positional(q, k, v, mask=mask, implementation=impl)

    visible = float(np.asarray(mask.dense(length, length)).sum()) / (batch if mask.batch_size() else 1)

    flops = 4.0 * batch * heads * head_dim * visible
    return Case(
        op="attention",
        label=f"B={batch} L={length} H={heads}/{kv_heads} D={head_dim} {mask_name} {dt.name}",
        dims={"batch": batch, "length": length, "heads": heads},
        dtype=dt.name,
        make=make,
        forward=forward,
        loss=None,  # the backward pulls a random cotangent back
        grad_argnums=(0, 1, 2),
        flops_forward=flops,
        flops_backward=2.5 * flops,
    )


def cases(*, preset=None, tokens=None, dtype=None):
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"attention: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    dtype = dtype or ("float32" if name == "quick" else "bfloat16")
    return [case(b, tokens or n, h, kvh, d, m, dtype) for b, n, h, kvh, d, m in PRESETS[name]]
