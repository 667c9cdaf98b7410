"""attention's `return_lse`: each query's log-sum-exp, a differentiable output, in every
implementation that returns it (the Pallas kernels in interpret mode), against the float64
oracle by DESIGN.md's rule; `-inf` for a query that sees nothing, NaN where its row is NaN;
merging two halves of the keys by their `lse` gives the whole; cuDNN refuses it by name."""

from __future__ import annotations

import dataclasses

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import masks
from axkern.positional import attention
from tests.cases.attention import inputs as _inputs
from tests.cases.attention import run as _run
from tests.harness import check_rules
from tests.helpers import poke

IMPLS = ["xla", "pallas_gpu", "pallas_tpu"]
CASES = {
    # name: (batch, q_len, kv_len, heads, kv_heads, mask, sinks, cap)
    "causal gqa sinks cap": (2, 37, 53, 4, 2, masks.Causal(offset=16), True, 3.0),
    "window": (1, 45, 45, 2, 1, masks.SlidingWindow(7), False, None),
    "segments&causal": (
        2,
        40,
        40,
        2,
        2,
        masks.Segments(*(jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(3), 0.1, (2, 40)), 1),) * 2)
        & masks.Causal(),
        True,
        None,
    ),
    # the first 6 rows see no key and, without sinks, have lse -inf; with sinks, the sink's logit
    "rows that see nothing": (1, 30, 30, 2, 1, masks.Causal(offset=-6), False, None),
    "rows that see nothing, sinks": (1, 30, 30, 4, 2, masks.Causal(offset=-6), True, None),
}


# each case compiles five programs (the oracle, the reference, three implementations): the
# richest case in both dtypes, the other four in one each, so that each dtype meets three masks
DTYPES = {
    "causal gqa sinks cap": ("float32", "bfloat16"),
    "window": ("bfloat16",),
    "segments&causal": ("float32",),
    "rows that see nothing": ("bfloat16",),
    "rows that see nothing, sinks": ("float32",),
}


@pytest.mark.parametrize("case,dtype", [(c, d) for c, ds in DTYPES.items() for d in ds])
def test_lse_and_its_gradient_against_the_oracle(case, dtype):
    b, sq, sk, h, kvh, mask, sinks, cap = CASES[case]
    arrays = _inputs(list(CASES).index(case), b, sq, sk, h, kvh, 16, dtype)
    got = check_rules(
        _run, IMPLS, arrays, dtype, "attention lse", interpret=True, mask=mask, sinks=sinks, cap=cap, lse=True
    )
    nothing = np.asarray(got["xla"][0][2])
    assert nothing.any() == (case == "rows that see nothing")
    if nothing.any():
        assert nothing[0, :6].all() and not nothing[0, 6:].any()
    if case == "rows that see nothing, sinks":  # log Σ over the sink alone
        lse = np.asarray(got["xla"][0][1])[0, :6]
        np.testing.assert_allclose(lse, np.broadcast_to(np.asarray(arrays["sinks"]), lse.shape), rtol=1e-6)


def test_merging_two_halves_of_the_keys_by_their_lse_gives_the_whole():
    a = _inputs(5, 1, 32, 64, 4, 2, 16, "float32")
    q, k, v = a["q"], a["k"], a["v"]
    whole, lse = attention(q, k, v, return_lse=True)
    o1, l1 = attention(q, k[:, :40], v[:, :40], return_lse=True)
    o2, l2 = attention(q, k[:, 40:], v[:, 40:], return_lse=True)
    merged_lse = jnp.logaddexp(l1, l2)
    merged = o1 * jnp.exp(l1 - merged_lse)[..., None] + o2 * jnp.exp(l2 - merged_lse)[..., None]
    np.testing.assert_allclose(merged_lse, lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(merged, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_row_has_a_nan_lse(impl):
    a = _inputs(6, 1, 24, 24, 2, 1, 16, "float32")
    q = poke(a["q"], (0, 5, 1, 3), np.nan)
    with axkern.use(interpret=True):
        out, lse = attention(q, a["k"], a["v"], mask=masks.Causal(), implementation=impl, return_lse=True)
    lse = np.asarray(lse)
    assert np.isnan(lse[0, 5, 1]) and np.isnan(np.asarray(out)[0, 5, 1]).all()
    assert np.isfinite(np.delete(lse.reshape(24 * 2), 5 * 2 + 1)).all()


def test_named_lse_keeps_qs_axis_order():
    Batch, Pos, Heads, HeadDim = (
        hax.Axis("batch", 2),
        hax.Axis("position", 24),
        hax.Axis("heads", 4),
        hax.Axis("head_size", 8),
    )
    a = _inputs(3, 2, 24, 24, 4, 4, 8, "float32")
    q = hax.named(a["q"], (Batch, Pos, Heads, HeadDim)).rearrange((Heads, Batch, HeadDim, Pos))
    k, v = (hax.named(a[n], (Batch, Pos, Heads, HeadDim)) for n in "kv")
    out, lse = axkern.attention(q, k, v, mask=masks.Causal(), return_lse=True)
    assert [ax.name for ax in lse.axes] == ["heads", "batch", "position"]
    want_out, want_lse = attention(a["q"], a["k"], a["v"], mask=masks.Causal(), return_lse=True)
    np.testing.assert_allclose(np.asarray(lse.rearrange((Batch, Pos, Heads)).array), want_lse, rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(out.rearrange((Batch, Pos, Heads, HeadDim)).array), want_out, rtol=1e-6
    )


def test_cudnn_refuses_lse_by_name():
    from axkern.ops.attention import OP, cudnn

    dims = {"batch": 1, "q_len": 16, "kv_len": 16, "heads": 2, "kv_heads": 2, "head_dim": 64, "v_dim": 64}
    base = dict(soft_cap=False, sinks=False, mask="Causal")
    spec = dataclasses.replace(OP.spec(dims, jnp.bfloat16, **base, lse=True), platform="gpu")
    assert "log-sum-exp" in cudnn.supports(spec)
    q = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
    with pytest.raises(axkern.Unsupported, match="log-sum-exp"):
        cudnn.attention(q, q, q, None, masks.Causal(), scale=1.0, logits_soft_cap=None, return_lse=True)


def test_empty_kv_gives_zeros_and_minus_infinity_or_the_sink():
    q = jnp.ones((1, 3, 2, 8))
    k = jnp.ones((1, 0, 2, 8))
    out, lse = attention(q, k, k, return_lse=True)
    assert out.shape == (1, 3, 2, 8) and not np.asarray(out).any()
    assert lse.shape == (1, 3, 2) and np.isneginf(np.asarray(lse)).all()
    sinks = jnp.array([0.5, -1.0])
    total, d_sinks = jax.value_and_grad(lambda s: attention(q, k, k, sinks=s, return_lse=True)[1].sum())(
        sinks
    )
    np.testing.assert_allclose(total, 3 * sinks.sum())
    np.testing.assert_allclose(d_sinks, [3.0, 3.0])


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_of_v_reaches_the_output_not_lse(impl):
    a = _inputs(9, 1, 24, 24, 2, 1, 16, "float32")
    v = poke(a["v"], (0, 10, 0, 2), np.nan)  # key 10: the causal rows 10.. see it
    with axkern.use(interpret=True):
        out, lse = attention(a["q"], a["k"], v, mask=masks.Causal(), implementation=impl, return_lse=True)
    assert np.isnan(np.asarray(out)[0, 10:, :, 2]).all() and np.isfinite(np.asarray(out)[0, :10]).all()
    assert np.isfinite(np.asarray(lse)).all()


def test_the_guard_keeps_a_nan_lse_cotangent_on_rows_that_see_nothing_on_the_fast_path():
    # a z-loss's cotangent `2 · lse · 0` is NaN where lse is -inf: it reaches no score, so the
    # backward stays the fast path's (a stand-in that computes something else: q doubled)
    from axkern.ops.attention import common

    mask = masks.Causal(offset=-4)  # rows 0..3 see nothing
    kw = dict(scale=0.25, logits_soft_cap=None)

    def fast(q, k, v, s, m):
        return attention(2 * q, k, v, mask=m, implementation="xla", return_lse=True, **kw)

    def safe(q, k, v, s, m):
        return attention(q, k, v, mask=m, sinks=s, implementation="reference", return_lse=True, **kw)

    def guarded(q, k, v):
        return common.guarded(fast, safe, q, k, v, None, mask)

    a = _inputs(10, 1, 24, 24, 2, 1, 16, "float32")
    args = (a["q"], a["k"], a["v"])
    cot = (jnp.ones((1, 24, 2, 16)), jnp.ones((1, 24, 2)).at[0, :4].set(jnp.nan))
    got = jax.vjp(jax.jit(guarded), *args)[1](cot)
    want = jax.vjp(lambda q, k, v: fast(q, k, v, None, mask), *args)[1]((cot[0], jnp.nan_to_num(cot[1])))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def _named(a, Batch, Pos, KPos, Heads, KVHeads, HeadDim):
    """`q`, `k`, `v` of `a` as NamedArrays, the keys on `KPos` and `KVHeads`."""
    q = hax.named(a["q"], (Batch, Pos, Heads, HeadDim))
    k, v = (hax.named(a[n], (Batch, KPos, KVHeads, HeadDim)) for n in "kv")
    return q, k, v


def test_named_lse_with_kv_heads_apart():
    Batch, Pos, KPos = hax.Axis("batch", 1), hax.Axis("position", 20), hax.Axis("key_position", 20)
    Heads, KVHeads, HeadDim = hax.Axis("heads", 4), hax.Axis("kv_heads", 2), hax.Axis("head_size", 8)
    a = _inputs(11, 1, 20, 20, 4, 2, 8, "float32")
    q, k, v = _named(a, Batch, Pos, KPos, Heads, KVHeads, HeadDim)
    _, lse = axkern.attention(q, k, v, mask=masks.Causal(), return_lse=True)
    _, want = attention(a["q"], a["k"], a["v"], mask=masks.Causal(), return_lse=True)
    assert [ax.name for ax in lse.axes] == ["batch", "position", "heads"]
    np.testing.assert_allclose(np.asarray(lse.array), want, rtol=1e-6)


def test_the_guard_passes_lse_and_its_cotangent_through_either_path():
    # `common.guarded` (what `cudnn` and `mosaic_gpu` run behind) with `return_lse`: a stand-in
    # fast path (`xla`) and the rule-following one (`reference`); a NaN in `lse`'s cotangent
    # alone sends the backward to the rule-following path
    from axkern.ops.attention import common

    mask = masks.Causal()
    kw = dict(scale=0.25, logits_soft_cap=None)
    fast = lambda q, k, v, s, m: attention(q, k, v, mask=m, implementation="xla", return_lse=True, **kw)  # noqa: E731
    safe = lambda q, k, v, s, m: attention(q, k, v, mask=m, implementation="reference", return_lse=True, **kw)  # noqa: E731

    def guarded(q, k, v):
        return common.guarded(fast, safe, q, k, v, None, mask)

    def ref(q, k, v):
        return attention(q, k, v, mask=mask, implementation="reference", return_lse=True, **kw)

    a = _inputs(8, 1, 24, 24, 2, 1, 16, "float32")
    cots = (
        jnp.cos(jnp.arange(24 * 2 * 16.0)).reshape(1, 24, 2, 16),
        jnp.sin(jnp.arange(48.0)).reshape(1, 24, 2),
    )
    for q, cot in (
        (a["q"], cots),
        (poke(a["q"], (0, 4, 1, 3), np.nan), cots),
        (a["q"], (cots[0], poke(cots[1], (0, 7, 0), np.nan))),
    ):
        got_out, vjp = jax.vjp(jax.jit(guarded), q, a["k"], a["v"])
        want_out, want_vjp = jax.vjp(ref, q, a["k"], a["v"])
        for g, w in zip((*got_out, *vjp(cot)), (*want_out, *want_vjp(cot)), strict=True):
            g, w = np.asarray(g), np.asarray(w)
            np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_named_lse_sharded_equals_unsharded():
    # batch over "data", heads (and kv heads) over "model": lse comes back sharded like out
    from jax.sharding import Mesh

    Batch, Pos, KPos = hax.Axis("batch", 4), hax.Axis("position", 16), hax.Axis("key_position", 16)
    Heads, KVHeads, HeadDim = hax.Axis("heads", 8), hax.Axis("kv_heads", 4), hax.Axis("head_size", 8)
    a = _inputs(12, 4, 16, 16, 8, 4, 8, "float32")
    q, k, v = _named(a, Batch, Pos, KPos, Heads, KVHeads, HeadDim)

    def f(q, k, v):
        out, lse = axkern.attention(q, k, v, mask=masks.Causal(), return_lse=True)
        return (hax.sum(out * out) + hax.sum(lse * lse)).array, (out, lse)

    want = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    mapping = {"batch": "data", "heads": "model", "kv_heads": "model"}
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
        fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
        got = fn(q, k, v)
        text = fn.lower(q, k, v).as_text()
        assert "manual_computation" in text or "shard_map" in text
    assert [ax.name for ax in got[0][1][1].axes] == ["batch", "position", "heads"]
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
