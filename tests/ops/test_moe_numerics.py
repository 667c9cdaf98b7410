"""MoE routing and the rules of docs/guide.md ("Non-finite values, segments and empty axes"): a
non-finite input reaches exactly the rows its routed pairs touch (a dropped pair's row and weight
are selected away, never multiplied by 0, and a routed pair is multiplied by its weight even
when that is 0); no token or a top-k of 0 gives empty results; an empty feature axis, a
`num_ranks` below 1 are `ValueError`s; narrow id dtypes route to many experts. Every
implementation the registry lists for this machine runs (`tests.harness.implementations_here`:
on a GPU, `AXKERN_TEST_GPU=1`, the `cuda` kernels too)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axkern.positional import moe_combine, moe_dispatch, moe_layout
from tests.harness import implementations_here, serving
from tests.helpers import assert_nonfinite_rule

IMPLS = implementations_here("moe_dispatch", reference=True)


@functools.cache
def _compiled(impl, num_experts):
    def f(x, weights, topk_idx):
        d = moe_dispatch(x, topk_idx, num_experts=num_experts, implementation=impl)
        y = moe_combine(2 * d.expert_x + 1, weights, d.routing, implementation=impl)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)), (d.expert_x, y)

    # traced ids (under jit): out-of-range ones are dropped, not refused
    return jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))


def _layer(impl, x, topk_idx, weights, num_experts, *, drawn=False):
    """`(expert_x, y)` of dispatch then combine (expert = 2·row + 1), and d(sum y·cos)/d(x, weights),
    jitted (a case of the same shapes compiles once); a case `impl` cannot serve is skipped with
    the reason (`serving`)."""
    with serving(impl, drawn=drawn):
        grads, out = _compiled(impl, num_experts)(x, weights, topk_idx)
    return out, grads


@pytest.mark.parametrize("impl", IMPLS)
def test_a_non_finite_token_reaches_only_its_routed_rows(impl):
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 3)).at[1, 2].set(jnp.nan)
    ids = jnp.array([[0, 2], [1, 9], [2, 1], [0, 1]])  # token 1's second pair is dropped (id 9)
    weights = jnp.ones((4, 2)).at[1, 1].set(jnp.inf).at[3, 0].set(jnp.nan)  # a dropped pair's, a routed one's
    (expert_x, y), (dx, dw) = _layer(impl, x, ids, weights, 4)
    assert_nonfinite_rule(((expert_x, y), (dx, dw)), _layer("reference", x, ids, weights, 4), impl)
    bad_rows = np.argwhere(~np.isfinite(np.asarray(expert_x)).all(1) & np.isnan(np.asarray(expert_x)).any(1))
    assert len(bad_rows) == 1  # token 1's one routed pair; its dropped pair's row stays zero
    assert not np.asarray(expert_x)[-1].any()
    y = np.asarray(y)
    assert np.isnan(y[1]).tolist() == [False, False, True]  # the NaN feature only; the inf weight is dropped
    assert np.isnan(y[3]).all() and np.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_routed_pair_of_weight_zero_on_a_nan_row_gives_nan(impl):
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 3)).at[1, 2].set(jnp.nan)
    ids = jnp.array([[0, 1], [2, 7], [1, 3], [3, 0]])  # token 1: one routed pair (expert 2), one dropped
    weights = jnp.full((4, 2), 0.5).at[1, 0].set(0.0).at[2, 1].set(0.0)  # routed pairs of weight 0
    (expert_x, y), grads = _layer(impl, x, ids, weights, 4)
    assert_nonfinite_rule(((expert_x, y), grads), _layer("reference", x, ids, weights, 4), impl)
    y = np.asarray(y)
    assert np.isnan(y[1]).tolist() == [False, False, True]  # 0 · NaN is NaN: the NaN feature
    assert np.isfinite(y[[0, 2, 3]]).all()  # token 2's weight-0 pair reads a finite row: it adds 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens,topk", [(0, 2), (3, 0), (0, 0)])
def test_no_pair_gives_empty_results(impl, tokens, topk):
    ids = jnp.zeros((tokens, topk), jnp.int32)
    layout = moe_layout(ids, num_experts=4, num_ranks=2, implementation=impl)
    assert not layout.tokens_per_expert.any() and not layout.tokens_per_rank.any() and layout.dropped == 0
    assert layout.is_token_in_rank.shape == (tokens, 2)
    x, weights = jnp.ones((tokens, 5)), jnp.ones((tokens, topk))
    (expert_x, y), (dx, dw) = _layer(impl, x, ids, weights, 4)
    assert expert_x.shape == (0, 5) and y.shape == (tokens, 5) and not y.any()
    assert dx.shape == x.shape and dw.shape == weights.shape and not dx.any()


def test_errors_and_narrow_ids():
    ids = jnp.array([[0, 3], [2, 1]], jnp.int32)
    for ranks in (0, -1):
        with pytest.raises(ValueError, match=f"moe_layout: num_ranks must be a positive int, got {ranks}"):
            moe_layout(ids, num_experts=4, num_ranks=ranks)
    with pytest.raises(ValueError, match="moe_dispatch: embed must be at least 1"):
        moe_dispatch(jnp.ones((2, 0)), ids, num_experts=4)
    d = moe_dispatch(jnp.ones((2, 3)), ids, num_experts=4)
    with pytest.raises(ValueError, match="moe_combine: out must be at least 1"):
        moe_combine(d.expert_x[:, :0], jnp.ones((2, 2)), d.routing)
    wide = jnp.array([[120, 3], [199, 7]], jnp.int32)
    for impl in IMPLS:  # int8 ids (< 128 here) for 200 experts count as int32 ones do
        narrow = moe_layout(wide.at[1, 0].set(5).astype(jnp.int8), num_experts=200, implementation=impl)
        want = moe_layout(wide.at[1, 0].set(5), num_experts=200, implementation=impl)
        np.testing.assert_array_equal(narrow.tokens_per_expert, want.tokens_per_expert)
        got = moe_dispatch(jnp.ones((2, 3)), wide.at[1, 0].set(5).astype(jnp.int8), num_experts=200)
        assert int(got.group_sizes.sum()) == 4


@st.composite
def _case(draw):
    tokens, topk, experts = draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(st.integers(1, 5))
    ids = draw(st.lists(st.integers(-1, experts), min_size=tokens * topk, max_size=tokens * topk))
    values = st.sampled_from([np.nan, np.inf, -np.inf])
    x_pokes = (
        draw(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), values), max_size=2)) if tokens else []
    )
    w_pokes = (
        draw(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), values), max_size=2)) if topk else []
    )
    return tokens, topk, experts, ids, x_pokes, w_pokes, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("impl", implementations_here("moe_dispatch"))
@settings(max_examples=8, deadline=None)
@given(_case())
def test_property_nan_pattern_and_values_match_the_reference(impl, case):
    tokens, topk, experts, ids, x_pokes, w_pokes, seed = case
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (tokens, 3))
    weights = jax.random.uniform(kw, (tokens, topk))
    for t, c, v in x_pokes:
        x = x.at[t % tokens, c].set(v)
    for t, k, v in w_pokes:
        weights = weights.at[t % max(tokens, 1), k % topk].set(v) if tokens else weights
    idx = jnp.asarray(np.array(ids, np.int32).reshape(tokens, topk))
    got = _layer(impl, x, idx, weights, experts, drawn=True)
    want = _layer("reference", x, idx, weights, experts)
    assert_nonfinite_rule(got, want, str(case))
