"""Attention's cases, shared by the CPU tests (tests/ops/test_attention.py) and the GPU tests
(tests/gpu/test_attention_gpu.py): random inputs, and a runner returning the output and the
gradients of `q`, `k`, `v` (and the sinks)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from axkern.core import config
from axkern.positional import attention
from tests.harness import jit


def inputs(seed, b, sq, sk, h, kvh, d, dtype):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    dt = jnp.dtype(dtype)
    return dict(
        q=jax.random.normal(k[0], (b, sq, h, d)).astype(dt),
        k=jax.random.normal(k[1], (b, sk, kvh, d)).astype(dt),
        v=jax.random.normal(k[2], (b, sk, kvh, d)).astype(dt),
        sinks=jax.random.normal(k[3], (h,)),
    )


@functools.cache
def _runner(impl, sinks, cap, blocks, interpret):
    """`(out, grads)` of `impl` as one jitted function of `(arrays, mask)`: the cases of one
    shape, dtype and mask kind compile once (the interpret setting is read while tracing, so it
    is part of the key)."""
    block_sizes = dict(blocks) if blocks is not None else None

    def f(q, k, v, s, mask):
        o = attention(
            q,
            k,
            v,
            mask=mask,
            sinks=s if sinks else None,
            logits_soft_cap=cap,
            implementation=impl,
            block_sizes=block_sizes,
        )
        cot = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
        return jnp.sum(o.astype(jnp.float32) * cot), o

    def g(a, mask):
        (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(
            a["q"], a["k"], a["v"], a["sinks"], mask
        )
        return out, grads if sinks else grads[:3]

    return jit(g)


def run(impl, arrays, mask, *, sinks=True, cap=None, blocks=(16, 16)):
    if blocks is not None and not isinstance(blocks, dict):
        blocks = dict(block_q=blocks[0], block_kv=blocks[1])
    blocked = impl in ("xla", "pallas_gpu", "pallas_tpu", "mosaic_gpu")  # the others take no block sizes
    key = tuple(sorted(blocks.items())) if blocks is not None and blocked else None
    return _runner(impl, sinks, cap, key, config.current().interpret)(arrays, mask)
