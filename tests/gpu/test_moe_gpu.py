"""MoE routing on a real GPU (every GPU implementation), against the oracle rule, alone and in a MoE layer.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Builds the native library on
first use (nvcc must be on PATH or under CUDA_HOME).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import axkern
from axkern.positional import moe_combine, moe_dispatch
from tests.cases.moe import make, run
from tests.harness import check_rule, implementations

pytestmark = pytest.mark.gpu


def _case(tokens, hidden, experts, topk, dtype, seed=0):
    arrays = make(seed, tokens, topk, experts, dtype, hidden=hidden)
    return arrays["x"], arrays["idx"], arrays["w"]


@pytest.mark.parametrize("topk", [8, 12])  # 12: the kernels' 16-slot variant
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden", [4096, 1001])  # 1001: rows not whole 16-byte vectors (element path)
@pytest.mark.parametrize("impl", implementations("moe_dispatch", "gpu"))
def test_on_gpu_against_oracle(impl, dtype, hidden, topk):
    arrays = make(0, 4096, topk, 64, dtype, hidden=hidden)
    d = axkern.explain(
        lambda x, i: moe_dispatch(x, i, num_experts=64, implementation=impl), arrays["x"], arrays["idx"]
    )
    assert d.implementation == impl and not d.interpret
    (ex, gs, _), _ = check_rule(
        run, impl, arrays, dtype, f"moe {hidden}x{topk}", oracle_dtype="float32", experts=64
    )
    # a permutation of rows: exactly the reference's
    ex_ref, gs_ref, _ = moe_dispatch(arrays["x"], arrays["idx"], num_experts=64, implementation="reference")
    np.testing.assert_array_equal(np.asarray(ex, np.float32), np.asarray(ex_ref, np.float32))
    np.testing.assert_array_equal(gs, gs_ref)


@pytest.mark.parametrize(
    "tokens, topk, experts",
    [
        (32768, 8, 64),
        (8192, 8, 256),
        (1000, 1, 7),
        (3001, 4, 5000),
        (5, 3, 2),
        (2000, 16, 8192),
        (140001, 2, 3),  # 274 chunks: the scan runs two tiles of 256
    ],
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
    # the dispatch handler runs the same sort before its scatter (chained launches on Hopper)
    x = jax.numpy.arange(tokens * 4, dtype=jax.numpy.float32).reshape(tokens, 4)
    out, counts, rows = jax.jit(lambda x, i: cuda.dispatch(x, i, num_experts=experts))(x, idx)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(counts, want_counts)
    want_out = np.zeros((tokens * topk, 4), np.float32)
    pairs = np.flatnonzero(want_valid)
    want_out[np.asarray(want_rows)[pairs]] = np.asarray(x)[pairs // topk]
    np.testing.assert_array_equal(out, want_out)


def test_cuda_drops_traced_out_of_range_ids():
    x, idx, w = _case(256, 512, 8, 2, "bfloat16")
    bad = idx.at[3, 1].set(9)

    @jax.jit
    def layer(x, bad, w):
        ex, gs, routing = moe_dispatch(x, bad, num_experts=8, implementation="cuda")
        return ex, gs, moe_combine(ex, w, routing, implementation="cuda")

    ex, gs, y = layer(x, bad, w)
    assert int(gs.sum()) == 256 * 2 - 1 and not np.asarray(ex[-1], np.float32).any()
    assert np.isfinite(np.asarray(y, np.float32)).all()


@pytest.mark.parametrize("impl", implementations("moe_dispatch", "gpu"))
def test_moe_layer_with_ragged_dot_against_oracle(impl):
    arrays = make(3, 2048, 4, 16, "bfloat16", hidden=1024, out=512)
    check_rule(run, impl, arrays, "bfloat16", "moe layer with ragged_dot", oracle_dtype="float32", experts=16)


@pytest.mark.parametrize("ranks", [1, 8])
def test_cuda_layout_against_xla(ranks):
    from axkern.positional import moe_layout

    _, idx, _ = _case(32768, 8, 64, 8, "float32")
    idx = idx.at[5, 2].set(70)  # traced below: dropped and counted
    layout = jax.jit(
        lambda i, impl: moe_layout(i, num_experts=64, num_ranks=ranks, implementation=impl), static_argnums=1
    )
    got, want = layout(idx, "cuda"), layout(idx, "xla")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(got.dropped) == 1
