"""Attention's cases, shared by the CPU tests (tests/ops/test_attention.py) and the GPU tests
(tests/gpu/test_attention_gpu.py): random inputs, and a runner returning the output and the
gradients of `q`, `k`, `v` (and the sinks); with `lse=True` the output is `(out, lse where
finite else 0, 1 where lse is -inf)` and the loss weighs `lse` too.

The loss weighs the output by `cos(0, 1, 2, ...)`: in float32 by default, or (`weights="bfloat16"`)
computed on the host and rounded to bfloat16, which bf16 and every wider dtype hold exactly. A 16-bit output's
cotangent is the weights rounded to its dtype; on a CPU plain JAX's reference rounds it as a kernel
does, but XLA on a TPU keeps the reference's product in float32, so the reference there never
rounds it while a kernel, which receives the cotangent as an array, must: the TPU tests take the
bf16 weights, with which no implementation rounds anything."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

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


def weights(shape, fn, dtype):
    """The loss's weights of an output of `shape`: `fn` (`jnp.cos` or `jnp.sin`) of 0, 1, 2, ...
    in float32, or (`dtype="bfloat16"`) in float64 on the host rounded to bfloat16."""
    if dtype == "float32":
        return fn(jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape))
    w = {jnp.cos: np.cos, jnp.sin: np.sin}[fn](np.arange(int(np.prod(shape)), dtype=np.float64))
    return jnp.asarray(w.astype(jnp.bfloat16).astype(np.float32).reshape(shape))


@functools.cache
def _runner(impl, sinks, cap, blocks, interpret, lse=False, loss_weights="float32"):
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
            return_lse=lse,
        )
        o, l = o if lse else (o, None)
        cot = weights(o.shape, jnp.cos, loss_weights)
        loss = jnp.sum(o.astype(jnp.float32) * cot)
        if not lse:
            return loss, o
        seen = jnp.isfinite(l)
        l_cot = weights(l.shape, jnp.sin, loss_weights)
        finite = jnp.where(seen, l, 0.0)
        return loss + jnp.sum(finite * l_cot), (o, finite, jnp.isneginf(l).astype(jnp.float32))

    def g(a, mask):
        (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(
            a["q"], a["k"], a["v"], a["sinks"], mask
        )
        return out, grads if sinks else grads[:3]

    return jit(g)


def run(impl, arrays, mask, *, sinks=True, cap=None, blocks=(16, 16), lse=False, weights="float32"):
    if blocks is not None and not isinstance(blocks, dict):
        blocks = dict(block_q=blocks[0], block_kv=blocks[1])
    blocked = impl in ("xla", "pallas_gpu", "pallas_tpu", "mosaic_gpu")  # the others take no block sizes
    key = tuple(sorted(blocks.items())) if blocks is not None and blocked else None
    return _runner(impl, sinks, cap, key, config.current().interpret, lse, weights)(arrays, mask)
