"""SSD's cases, shared by the CPU tests (tests/ops/test_ssd.py) and the GPU tests
(tests/gpu/test_ssd_gpu.py): random inputs, and a runner returning outputs and gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from axkern.core import config
from axkern.positional import ssd
from tests.harness import jit

# GPU shapes (b, l, h, p, g, n): a length of 1500 gives 24 or 12 chunks, not a power of two
# (the recurrence kernels' all-chunks blocks); the second is the one where float32's rounding
# of `cum_t - cum_s` is largest
GPU_DIMS = [(1, 1500, 8, 64, 1, 128), (2, 512, 4, 32, 2, 64)]


def make(seed, b, l, h, p, g, n, dtype, *, segments=True, extras=True):
    k = jax.random.split(jax.random.PRNGKey(seed), 10)
    dt_ = jnp.dtype(dtype)
    arrays = dict(
        x=jax.random.normal(k[0], (b, l, h, p)).astype(dt_),
        dt=jax.random.normal(k[1], (b, l, h)).astype(dt_),
        A=-jnp.exp(jax.random.normal(k[2], (h,))),
        B=jax.random.normal(k[3], (b, l, g, n)).astype(dt_),
        C=jax.random.normal(k[4], (b, l, g, n)).astype(dt_),
    )
    if extras:
        arrays |= dict(
            D=jax.random.normal(k[5], (h,)),
            z=jax.random.normal(k[6], (b, l, h, p)).astype(dt_),
            dt_bias=jax.random.normal(k[7], (h,)) * 0.1,
            initial_state=jax.random.normal(k[8], (b, h, p, n)),
        )
    seg = jnp.cumsum(jax.random.bernoulli(k[9], 0.1, (b, l)), axis=1).astype(jnp.int32) if segments else None
    return arrays, seg


@functools.cache
def _runner(impl, chunk_size, names, interpret, block_sizes=None):
    """`(outputs, gradients)` of `impl` as one jitted function of `(arrays, segment_ids)`: the
    cases of one shape compile once, and a case compiles as one program rather than running op
    by op (the interpret setting is read while tracing, so it is part of the key)."""

    def f(seg, *vals):
        kw = dict(zip(names, vals, strict=True))
        y, final = ssd(
            kw.pop("x"),
            kw.pop("dt"),
            kw.pop("A"),
            kw.pop("B"),
            kw.pop("C"),
            dt_softplus=True,
            segment_ids=seg,
            return_final_state=True,
            implementation=impl,
            chunk_size=chunk_size,
            block_sizes=block_sizes,
            **kw,
        )
        # multiples of 1/64: the same cotangent in every dtype (a bf16 output's cotangent is rounded
        # to bf16, the oracle's is not, and XLA on GPU may skip that rounding where it fuses)
        cot = jnp.round(64 * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))) / 64
        return jnp.sum(y.astype(jnp.float32) * cot) + jnp.sum(jnp.sin(final.astype(jnp.float32))), (y, final)

    def g(arrays, seg):
        (_, out), grads = jax.value_and_grad(f, argnums=tuple(range(1, len(names) + 1)), has_aux=True)(
            seg, *[arrays[k] for k in names]
        )
        return out, grads

    return jit(g)


def run(impl, arrays, seg, chunk_size=None, block_sizes=None):
    """`(outputs, gradients)` of `impl` (`chunk_size` or whole `block_sizes`, not both)."""
    names, interpret = tuple(sorted(arrays)), config.current().interpret
    return _runner(impl, chunk_size, names, interpret, block_sizes)(arrays, seg)
