"""MoE routing: xla and reference against NumPy and each other, forward and gradients; edge cases; a MoE layer."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern.positional import moe_combine, moe_dispatch, moe_layout
from tests.cases.moe import KINDS, make, run
from tests.harness import check_rules, implementations, jit

COMPILED = implementations("moe_dispatch", "cpu")
IMPLS = [*COMPILED, "reference"]  # the reference against NumPy too


def routing_case(seed, tokens, topk, experts, dtype="float32", *, kind="random"):
    """`(x, idx, w)` of a case."""
    arrays = make(seed, tokens, topk, experts, dtype, kind=kind)
    return arrays["x"], arrays["idx"], arrays["w"]


def numpy_dispatch(x, idx, experts):
    x, idx = np.asarray(x), np.asarray(idx)
    pairs = [(int(idx[t, k]), t, k) for t in range(idx.shape[0]) for k in range(idx.shape[1])]
    order = sorted(range(len(pairs)), key=lambda p: (pairs[p][0], p))  # expert-major, stable by pair
    out = np.stack([x[pairs[p][1]] for p in order])
    return out, np.bincount(idx.reshape(-1), minlength=experts), order


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "kind,tokens,topk,experts",
    [
        ("random", 37, 4, 8),
        ("duplicates", 20, 3, 8),
        ("sparse", 16, 2, 9),
        ("random", 25, 1, 5),
    ],
)
def test_dispatch_layout_and_combine_against_numpy(impl, kind, tokens, topk, experts):
    x, idx, w = routing_case(1, tokens, topk, experts, kind=kind)

    @jit  # one compilation rather than one per primitive (eager calls: test_named_round_trip_and_errors)
    def f(x, idx, w):
        ex, gs, routing = moe_dispatch(x, idx, num_experts=experts, implementation=impl)
        lay = moe_layout(idx, num_experts=experts, num_ranks=1, implementation=impl)
        return ex, gs, lay, moe_combine(ex * 3.0, w, routing, implementation=impl)

    ex, gs, lay, y = f(x, idx, w)
    want_x, want_gs, order = numpy_dispatch(x, idx, experts)
    np.testing.assert_array_equal(ex, want_x)
    np.testing.assert_array_equal(gs, want_gs)
    np.testing.assert_array_equal(lay.tokens_per_expert, want_gs)
    assert int(lay.dropped) == 0
    np.testing.assert_allclose(y, 3.0 * np.asarray(w).sum(1)[:, None] * np.asarray(x), rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_layout_per_rank(impl, ranks):
    x, idx, _ = routing_case(2, 30, 3, 8, kind="duplicates")
    lay = moe_layout(idx, num_experts=8, num_ranks=ranks, implementation=impl)
    ids = np.asarray(idx)
    in_rank = np.zeros((30, ranks), bool)
    for t in range(30):
        for e in ids[t]:
            in_rank[t, e // (8 // ranks)] = True
    np.testing.assert_array_equal(lay.is_token_in_rank, in_rank)
    np.testing.assert_array_equal(lay.tokens_per_rank, in_rank.sum(0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_against_oracle(dtype, kind):
    arrays = make(3, 33, 3, 6, dtype, kind=kind)
    check_rules(run, COMPILED, arrays, dtype, f"moe {kind}", experts=6)


def test_traced_out_of_range_ids_are_dropped_and_counted():
    x, idx, w = routing_case(4, 12, 2, 4)
    bad = idx.at[3, 1].set(7).at[5, 0].set(-1)

    @jax.jit
    def run(x, bad, w):
        ex, gs, routing = moe_dispatch(x, bad, num_experts=4)
        return ex, gs, moe_combine(ex, w, routing), moe_layout(bad, num_experts=4).dropped

    ex, gs, y, dropped = run(x, bad, w)
    assert int(dropped) == 2 and int(gs.sum()) == 12 * 2 - 2
    np.testing.assert_array_equal(ex[-2:], 0)  # dropped rows last, zero
    valid = (np.asarray(bad) >= 0) & (np.asarray(bad) < 4)
    np.testing.assert_allclose(y, (np.asarray(w) * valid).sum(1)[:, None] * np.asarray(x), rtol=1e-5)
    assert np.isfinite(y).all()


def test_bad_input():
    x, idx, w = routing_case(5, 8, 2, 4)
    with pytest.raises(ValueError, match=r"topk_idx\[2, 1\] = 9 is outside \[0, 4\)"):
        moe_dispatch(x, idx.at[2, 1].set(9), num_experts=4)
    with pytest.raises(ValueError, match="integer dtype, got float32"):
        moe_dispatch(x, idx.astype(jnp.float32), num_experts=4)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by num_ranks=4"):
        moe_layout(idx, num_experts=6, num_ranks=4)
    _, _, routing = moe_dispatch(x, idx, num_experts=4)
    with pytest.raises(ValueError, match="needs 8"):
        moe_combine(jnp.zeros((16, 6)), w[:4], routing)


def test_moe_layer_with_ragged_dot_matches_dense():
    # the case runner's layer with the experts' products by `ragged_dot` (as tests/gpu runs it)
    arrays = make(6, 24, 2, 4, hidden=8, out=5)
    x, idx, w, weights = (arrays[k] for k in ("x", "idx", "w", "weights"))
    (_, _, y), grads = run(COMPILED[0], arrays, experts=4)

    def dense(x, w, weights):
        per = jnp.einsum("td,tkdo->tko", x, weights[idx])
        return jnp.einsum("tk,tko->to", w, per)

    np.testing.assert_allclose(y, dense(x, w, weights), rtol=1e-5, atol=1e-5)
    want = jax.grad(lambda *a: jnp.sum(dense(*a) ** 2), argnums=(0, 1, 2))(x, w, weights)
    for a, b in zip(grads, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_named_round_trip_and_errors():
    Token, TopK, Embed = hax.Axis("token", 10), hax.Axis("topk", 2), hax.Axis("embed", 6)
    x, idx, w = routing_case(9, 10, 2, 4)
    xn, idxn, wn = hax.named(x, (Token, Embed)), hax.named(idx, (Token, TopK)), hax.named(w.T, (TopK, Token))
    ex, gs, routing = axkern.moe_dispatch(xn, idxn, num_experts=4)
    assert ex.axes == (hax.Axis("dispatched", 20), Embed) and gs.axes == (hax.Axis("experts", 4),)
    y = axkern.moe_combine(ex.rename({"embed": "out"}), wn, routing)
    assert y.axes == (Token, hax.Axis("out", 6))
    np.testing.assert_allclose(y.array, np.asarray(w).sum(1)[:, None] * np.asarray(x), rtol=1e-5)
    lay = axkern.moe_layout(idxn, num_experts=4, num_ranks=2)
    assert lay.is_token_in_rank.axes == (Token, hax.Axis("ranks", 2))
    with pytest.raises(ValueError, match=r"topk_idx has no axis 'k' \(TopK\)"):
        axkern.moe_dispatch(xn, idxn, TopK="k", num_experts=4)
    with pytest.raises(ValueError, match="topk_weights's axes"):
        axkern.moe_combine(ex, wn.rename({"token": "other"}), routing)
    d = axkern.explain(lambda a, b: axkern.moe_dispatch(a, b, num_experts=4), xn, idxn)
    assert d.op == "moe_dispatch" and d.implementation == "xla"


def _named_moe_case():
    Batch, Pos, TopK, Embed = (
        hax.Axis("batch", 4),
        hax.Axis("position", 6),
        hax.Axis("topk", 2),
        hax.Axis("embed", 5),
    )
    x, idx, w = routing_case(11, 24, 2, 4)
    xn = hax.named(x[:, :5].reshape(4, 6, 5), (Batch, Pos, Embed))
    idxn = hax.named(idx.reshape(4, 6, 2), (Batch, Pos, TopK)).rearrange((TopK, Pos, Batch))
    wn = hax.named(w.reshape(4, 6, 2), (Batch, Pos, TopK))
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((4, 5, 3), np.float32))
    return xn, idxn, wn, weights


def _named_layer(xn, idxn, wn, weights):
    ex, gs, routing = axkern.moe_dispatch(xn, idxn, num_experts=4)
    if len(gs.axes) == 1:  # one block: the whole dispatched array is expert-major
        ys = jax.lax.ragged_dot(ex.array, weights, gs.array)
    else:  # one block per token shard, each expert-major on its own
        blocks = ex.array.reshape(gs.array.shape[0], -1, ex.array.shape[-1])
        ys = jnp.concatenate(
            [jax.lax.ragged_dot(b, weights, g) for b, g in zip(blocks, gs.array, strict=True)]
        )
    y = axkern.moe_combine(hax.named(ys, (ex.axes[0], hax.Axis("out", 3))), wn, routing)
    return hax.sum(y * y).array, y


def test_named_takes_any_token_axes():
    xn, idxn, wn, weights = _named_moe_case()
    (_, y), grads = jax.jit(jax.value_and_grad(_named_layer, argnums=(0, 2, 3), has_aux=True))(
        xn, idxn, wn, weights
    )
    assert [a.name for a in y.axes] == ["batch", "position", "out"]
    x = xn.array.reshape(24, 5)
    idx = idxn.rearrange(("batch", "position", "topk")).array.reshape(24, 2)
    w = wn.array.reshape(24, 2)
    per = jnp.einsum("td,tkdo->tko", x, weights[idx])
    want = jnp.einsum("tk,tko->to", w, per).reshape(4, 6, 3)
    np.testing.assert_allclose(y.array, want, rtol=1e-5, atol=1e-5)
    lay = axkern.moe_layout(idxn, num_experts=4, num_ranks=2)
    assert [a.name for a in lay.is_token_in_rank.axes] == ["position", "batch", "ranks"]
    assert int(lay.tokens_per_expert.array.sum()) == 48


def test_named_token_parallel_equals_unsharded():
    from jax.sharding import Mesh

    xn, idxn, wn, weights = _named_moe_case()
    f = jax.value_and_grad(_named_layer, argnums=(0, 2, 3), has_aux=True)
    want = jit(f)(xn, idxn, wn, weights)
    want_layout = axkern.moe_layout(idxn, num_experts=4, num_ranks=2)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    # tokens over one mesh axis (one dispatch block per batch shard) and over both
    for mapping, blocks in (({"batch": "data"}, 2), ({"batch": "data", "position": "model"}, 4)):
        with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
            got = jit(f)(xn, idxn, wn, weights)
            layout = jit(lambda i: axkern.moe_layout(i, num_experts=4, num_ranks=2))(idxn)
            _, gs, _ = jax.eval_shape(lambda x, i: axkern.moe_dispatch(x, i, num_experts=4), xn, idxn)
        assert gs.axes[0] == hax.Axis("dispatch_blocks", blocks)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(layout), jax.tree.leaves(want_layout), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_named_combine_refuses_a_routing_from_another_mapping():
    from jax.sharding import Mesh

    xn, idxn, wn, weights = _named_moe_case()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": "data"}):
        ex, _, routing = jit(lambda x, i: axkern.moe_dispatch(x, i, num_experts=4))(xn, idxn)
    with pytest.raises(ValueError, match="call moe_combine under the axis mapping moe_dispatch ran under"):
        axkern.moe_combine(ex.rename({"embed": "out"}), wn, routing)


@pytest.mark.parametrize(
    "dims, reason",
    [
        ({"topk": 17}, "top-k at most 16"),
        ({"experts": 8193}, "at most 8192 experts"),
        ({"tokens": 2**28, "topk": 8}, "int32"),
    ],
)
def test_cuda_refuses_sizes_its_kernels_cannot_hold(dims, reason):
    from axkern.core.op import Spec
    from axkern.ops.moe import cuda

    sizes = {"tokens": 4096, "topk": 8, "embed": 1024, "experts": 64, **dims}
    spec = Spec("moe_dispatch", tuple(sizes.items()), "bfloat16", "gpu", "H200", "nvidia_h200")
    assert reason in cuda.supports(spec)
