"""Attention's cases, shared by the CPU tests (tests/ops/test_attention.py) and the GPU tests
(tests/gpu/test_attention_gpu.py): random inputs, and a runner returning the output and the
gradients of `q`, `k`, `v` (and the sinks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axkern.positional import attention


def inputs(seed, b, sq, sk, h, kvh, d, dtype):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    dt = jnp.dtype(dtype)
    return dict(
        q=jax.random.normal(k[0], (b, sq, h, d)).astype(dt),
        k=jax.random.normal(k[1], (b, sk, kvh, d)).astype(dt),
        v=jax.random.normal(k[2], (b, sk, kvh, d)).astype(dt),
        sinks=jax.random.normal(k[3], (h,)),
    )


def run(impl, arrays, mask, *, sinks=True, cap=None, blocks=(16, 16)):
    def f(q, k, v, s):
        o = attention(
            q,
            k,
            v,
            mask=mask,
            sinks=s if sinks else None,
            logits_soft_cap=cap,
            implementation=impl,
            block_sizes=(blocks if isinstance(blocks, dict) else dict(block_q=blocks[0], block_kv=blocks[1]))
            if impl in ("xla", "pallas_gpu", "pallas_tpu") and blocks is not None
            else None,
        )
        cot = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
        return jnp.sum(o.astype(jnp.float32) * cot), o

    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(
        arrays["q"], arrays["k"], arrays["v"], arrays["sinks"]
    )
    return out, grads if sinks else grads[:3]
