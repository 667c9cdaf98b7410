"""Expert-parallel transport on 8 CPU devices against the single-device MoE: values, gradients,
dropped tokens, empty experts, uneven counts, top-1 and top-8."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from axkern.core import compat
from axkern.ops.moe_ep.api import capacity_for
from axkern.positional import moe_ep_combine, moe_ep_dispatch

RANKS = 8
P = PartitionSpec("ep")


def _mesh():
    return Mesh(np.array(jax.devices()[:RANKS]), ("ep",))


def _case(seed, tokens, hidden, out, experts, topk, kind="random"):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(k[0], (RANKS * tokens, hidden))
    if kind == "skewed":  # most pairs to a few experts: uneven counts
        idx = jnp.minimum(jax.random.geometric(k[1], 0.5, (RANKS * tokens, topk)) - 1, experts - 1)
    elif kind == "few":  # only experts 0..3 get tokens: empty experts and empty ranks
        idx = jax.random.randint(k[1], (RANKS * tokens, topk), 0, 4)
    else:
        idx = jnp.argsort(jax.random.uniform(k[1], (RANKS * tokens, experts)), axis=1)[:, :topk]
    w = jax.random.uniform(k[2], (RANKS * tokens, topk))
    weights = jax.random.normal(k[3], (experts, hidden, out)) / hidden**0.5
    return x, idx.astype(jnp.int32), w, weights


def _dense(x, idx, w, weights, keep=None):
    per = jnp.einsum("td,tkdo->tko", x, weights[idx], precision="highest")
    w = w if keep is None else jnp.where(keep, w, 0)
    return jnp.einsum("tk,tko->to", w, per, precision="highest")


def _ep_layer(experts, capacity_factor=None, impl=None):
    def local(x, idx, w, weights):
        expert_x, group_sizes, layout = moe_ep_dispatch(
            x, idx, num_experts=experts, axis_name="ep", capacity_factor=capacity_factor, implementation=impl
        )
        y = jax.lax.ragged_dot(expert_x, weights, group_sizes, precision=jax.lax.Precision.HIGHEST)
        return moe_ep_combine(y, w, layout, implementation=impl), layout.sent, layout.dropped[None]

    return compat.shard_map(local, mesh=_mesh(), in_specs=(P, P, P, P), out_specs=(P, P, P))


@pytest.mark.parametrize(
    "topk, experts, kind", [(1, 8, "random"), (2, 16, "skewed"), (8, 16, "random"), (2, 16, "few")]
)
def test_exact_capacity_equals_the_single_device_moe(topk, experts, kind):
    x, idx, w, weights = _case(topk + experts, 12, 6, 5, experts, topk, kind)
    layer = _ep_layer(experts)
    y, sent, dropped = jax.jit(layer)(x, idx, w, weights)
    assert bool(jnp.all(sent)) and int(dropped.sum()) == 0
    np.testing.assert_allclose(y, _dense(x, idx, w, weights), rtol=1e-5, atol=1e-5)

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(*a)))

    got = jax.grad(loss(lambda *a: layer(*a)[0]), argnums=(0, 2, 3))(x, idx, w, weights)
    want = jax.grad(loss(_dense), argnums=(0, 2, 3))(x, idx, w, weights)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def _expected_sent(idx, experts, capacity_factor, tokens):
    """Which pairs fit: per source device, a pair's slot among its pairs to the same rank."""
    idx = np.asarray(idx).reshape(RANKS, tokens, -1)
    local = experts // RANKS
    cap = capacity_for(tokens, idx.shape[2], RANKS, capacity_factor)
    sent = np.zeros(idx.shape, bool)
    for src in range(RANKS):
        used = np.zeros(RANKS, int)
        for t in range(tokens):
            for k in range(idx.shape[2]):
                dst = idx[src, t, k] // local
                sent[src, t, k] = used[dst] < cap
                used[dst] += 1
    return sent.reshape(RANKS * tokens, -1)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_capacity_drops_pairs_and_counts_them(impl):
    tokens, experts, topk, factor = 12, 16, 2, 0.5
    x, idx, w, weights = _case(3, tokens, 6, 5, experts, topk, "skewed")
    layer = _ep_layer(experts, capacity_factor=factor, impl=impl)
    y, sent, dropped = jax.jit(layer)(x, idx, w, weights)
    want_sent = _expected_sent(idx, experts, factor, tokens)
    np.testing.assert_array_equal(np.asarray(sent), want_sent)
    assert int(dropped.sum()) == int((~want_sent).sum()) > 0
    np.testing.assert_allclose(y, _dense(x, idx, w, weights, keep=want_sent), rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda *a: jnp.sum(layer(*a)[0] ** 2), argnums=(0, 2, 3))(x, idx, w, weights)
    r = jax.grad(lambda *a: jnp.sum(_dense(*a, keep=want_sent) ** 2), argnums=(0, 2, 3))(x, idx, w, weights)
    for a, b in zip(g, r, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_out_of_range_ids_are_dropped_and_bad_input_is_refused():
    x, idx, w, weights = _case(5, 8, 6, 5, 16, 2)
    idx = idx.at[3, 1].set(99).at[20, 0].set(-1)
    y, sent, dropped = jax.jit(_ep_layer(16))(x, idx, w, weights)
    keep = (idx >= 0) & (idx < 16)
    assert int(dropped.sum()) == 2 and not bool(sent[3, 1]) and not bool(sent[20, 0])
    np.testing.assert_allclose(
        y, _dense(x, jnp.clip(idx, 0, 15), w, weights, keep=keep), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="num_experts=12 must be a positive multiple of the 8 devices"):
        jax.jit(_ep_layer(12))(x, idx, w, weights)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        jax.jit(_ep_layer(16, capacity_factor=0.0))(x, idx, w, weights)
