"""MoE routing's CUDA path on a real GPU, against the reference, and inside a jitted MoE layer.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Builds the native library on
first use (nvcc must be on PATH or under CUDA_HOME).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern.positional import moe_combine, moe_dispatch
from tests.helpers import assert_oracle_rule

pytestmark = pytest.mark.gpu


def _case(tokens, hidden, experts, topk, dtype, seed=0):
    kx, ki, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (tokens, hidden), jnp.float32).astype(dtype)
    idx = jax.random.randint(ki, (tokens, topk), 0, experts)
    w = jax.random.uniform(kw, (tokens, topk), jnp.float32).astype(dtype)
    return x, idx, w


def _layer(impl, x, idx, w, experts):
    def f(x, w):
        ex, _, routing = moe_dispatch(x, idx, num_experts=experts, implementation=impl)
        return jnp.sum(moe_combine(jnp.sin(ex), w, routing, implementation=impl).astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("topk", [8, 12])  # 12: the kernels' 16-slot variant
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden", [4096, 1001])  # 1001: rows not whole 16-byte vectors (element path)
def test_cuda_against_reference(dtype, hidden, topk):
    assert (
        axkern.explain(
            lambda x, i: moe_dispatch(x, i, num_experts=64, implementation="cuda"),
            *_case(8, hidden, 64, topk, dtype)[:2],
        ).implementation
        == "cuda"
    )
    x, idx, w = _case(4096, hidden, 64, topk, dtype)
    ex, gs, r = moe_dispatch(x, idx, num_experts=64, implementation="cuda")
    ex_ref, gs_ref, r_ref = moe_dispatch(x, idx, num_experts=64, implementation="reference")
    np.testing.assert_array_equal(np.asarray(ex, np.float32), np.asarray(ex_ref, np.float32))
    np.testing.assert_array_equal(gs, gs_ref)
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    oracle = _layer("reference", up(x), idx, up(w), 64)
    same = _layer("reference", x, idx, w, 64)
    got = _layer("cuda", x, idx, w, 64)
    assert_oracle_rule(got, same, oracle, dtype, f"moe cuda {dtype}")


@pytest.mark.parametrize(
    "tokens, topk, experts",
    [(32768, 8, 64), (8192, 8, 256), (1000, 1, 7), (3001, 4, 5000), (5, 3, 2)],
)
def test_cuda_routing_is_the_stable_counting_sort(tokens, topk, experts):
    from axkern.ops.moe import cuda, reference

    idx = jax.random.randint(jax.random.PRNGKey(tokens), (tokens, topk), 0, experts)
    idx = idx.at[:, -1].set(idx[:, 0])  # duplicate ids within a token
    idx = idx.at[::97, 0].set(experts + 3).at[1::89, -1].set(-2)  # dropped pairs (traced: no ValueError)
    rows, counts, valid = jax.jit(lambda i: cuda.route(i, experts))(idx)
    want_rows, want_counts, want_valid = reference.positions(idx, experts)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(counts, want_counts)
    np.testing.assert_array_equal(valid, want_valid)


def test_cuda_drops_traced_out_of_range_ids():
    x, idx, w = _case(256, 512, 8, 2, "bfloat16")
    bad = idx.at[3, 1].set(9)

    @jax.jit
    def run(x, bad, w):
        ex, gs, routing = moe_dispatch(x, bad, num_experts=8, implementation="cuda")
        return ex, gs, moe_combine(ex, w, routing, implementation="cuda")

    ex, gs, y = run(x, bad, w)
    assert int(gs.sum()) == 256 * 2 - 1 and not np.asarray(ex[-1], np.float32).any()
    assert np.isfinite(np.asarray(y, np.float32)).all()


def test_jitted_moe_layer_with_ragged_dot():
    tokens, hidden, out, experts, topk = 2048, 1024, 512, 16, 4
    x, idx, w = _case(tokens, hidden, experts, topk, "bfloat16", seed=3)
    weights = (jax.random.normal(jax.random.PRNGKey(4), (experts, hidden, out)) * hidden**-0.5).astype(
        jnp.bfloat16
    )

    def layer(impl):
        def f(x, weights, w):
            ex, gs, routing = moe_dispatch(x, idx, num_experts=experts, implementation=impl)
            y = moe_combine(jax.lax.ragged_dot(ex, weights, gs), w, routing, implementation=impl)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, weights, w)

    got, same = layer("cuda"), layer("xla")
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    x, weights, w = up(x), up(weights), up(w)
    oracle = layer("xla")
    assert_oracle_rule(got, same, oracle, "bfloat16", "moe layer with ragged_dot")


@pytest.mark.parametrize("ranks", [1, 8])
def test_cuda_layout_against_xla(ranks):
    from axkern.positional import moe_layout

    _, idx, _ = _case(32768, 8, 64, 8, "float32")
    idx = idx.at[5, 2].set(70)  # traced below: dropped and counted
    run = jax.jit(
        lambda i, impl: moe_layout(i, num_experts=64, num_ranks=ranks, implementation=impl), static_argnums=1
    )
    got, want = run(idx, "cuda"), run(idx, "xla")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(got.dropped) == 1
