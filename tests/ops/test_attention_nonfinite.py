"""attention and non-finite input (docs/guide.md, "Non-finite values"): a NaN or an infinity in
`q`, `k`, `v`, `sinks` or the scale reaches exactly the outputs and gradients that depend on it,
respecting the mask, in every implementation the registry lists for this machine
(`tests.harness.implementations_here`: Pallas kernels in interpret mode on a CPU, every GPU
implementation compiled on a GPU: `AXKERN_TEST_GPU=1`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import axkern
from axkern import masks
from axkern.positional import attention
from tests.harness import INTERPRET, implementations_here, jit, serving
from tests.helpers import assert_nonfinite_rule, poke

IMPLS = implementations_here("attention")
# cuDNN takes bf16 or f16 only: its cases run on bf16 copies of the inputs, against the
# reference on the same copies
DTYPES = {"cudnn": jnp.bfloat16}
# finite values: float32 products on a GPU run as TF32 in XLA (the oracle-rule tests bound them)
RTOL = {jnp.float32: 1e-4 if INTERPRET else 5e-3, jnp.bfloat16: 3e-2}


def _inputs(seed, b=1, sq=24, sk=24, h=2, kvh=1, d=16):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return dict(
        q=jax.random.normal(k[0], (b, sq, h, d)),
        k=jax.random.normal(k[1], (b, sk, kvh, d)),
        v=jax.random.normal(k[2], (b, sk, kvh, d)),
        sinks=jax.random.normal(k[3], (h,)),
    )


@functools.cache
def _compiled(impl, sinks, scale, cap):
    """`(out, grads)` of `impl` as one jitted function of `(arrays, mask)`: a case of the same
    shapes and mask kind compiles once."""
    blocks = {"block_q": 16, "block_kv": 16} if impl in ("xla", "pallas_gpu", "pallas_tpu") else None

    def f(q, k, v, s, mask):
        o = attention(
            q,
            k,
            v,
            mask=mask,
            sinks=s if sinks else None,
            scale=scale,
            logits_soft_cap=cap,
            implementation=impl,
            block_sizes=blocks,
        )
        cot = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
        return jnp.sum(o.astype(jnp.float32) * cot), o

    def run(a, mask):
        (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(
            a["q"], a["k"], a["v"], a["sinks"], mask
        )
        return out, grads if sinks else grads[:3]

    return jit(run)


def _run(impl, a, mask, *, sinks=False, scale=None, cap=None):
    with axkern.use(interpret=INTERPRET):
        return _compiled(impl, sinks, scale, cap)(a, mask)


def _against_reference(impl, a, mask, *, drawn=False, **kw):
    """The reference's `(out, grads)`, after checking that `impl`'s match its non-finite pattern
    and values (on the dtype `impl` takes); a case `impl` cannot serve is skipped with the reason."""
    dtype = DTYPES.get(impl, jnp.float32)
    a = {name: x.astype(dtype) if name != "sinks" else x for name, x in a.items()}
    want = _run("reference", a, mask, **kw)
    with serving(impl, drawn=drawn):
        got = _run(impl, a, mask, **kw)
    assert_nonfinite_rule(got[0], want[0], f"{impl} out", rtol=RTOL[dtype])
    assert_nonfinite_rule(got[1], want[1], f"{impl} grads", rtol=RTOL[dtype])
    return want


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_q_or_k_gives_nan_not_zero(impl, value):
    a = _inputs(0)
    a["q"] = poke(a["q"], (0, 5, 1, 3), value)  # query 5, head 1
    out, grads = _against_reference(impl, a, masks.Causal())
    out = np.asarray(out)
    assert np.isnan(out[0, 5, 1]).all() and np.isfinite(np.delete(out[0, :, 1], 5, axis=0)).all()
    assert np.isfinite(out[0, :, 0]).all()
    a = _inputs(1)
    a["k"] = poke(a["k"], (0, 9, 0, 2), value)  # key 9: queries 9.. see it
    out, _ = _against_reference(impl, a, masks.Causal())
    assert np.isfinite(np.asarray(out)[0, :9]).all() and (~np.isfinite(np.asarray(out)[0, 9:])).all()


def test_a_non_finite_scale_or_cap_is_refused():
    a = _inputs(2)
    for kw in ({"scale": float("nan")}, {"scale": float("inf")}, {"logits_soft_cap": float("inf")}):
        with pytest.raises(ValueError, match="scale|logits_soft_cap"):
            attention(a["q"], a["k"], a["v"], **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_sink_gives_nan(impl):
    a = _inputs(2)
    a["sinks"] = poke(a["sinks"], 1, np.nan)
    # sinks and a soft cap, as in the next test: one compilation for both
    out, _ = _against_reference(impl, a, masks.Causal(), sinks=True, cap=5.0)
    assert np.isnan(np.asarray(out)[..., 1, :]).all() and np.isfinite(np.asarray(out)[..., 0, :]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_soft_cap_does_not_hide_an_infinity(impl):
    a = _inputs(3)
    a["q"] = poke(a["q"], (0, 4, 0, 0), np.inf)
    out, _ = _against_reference(impl, a, masks.Causal(), sinks=True, cap=5.0)
    assert np.isnan(np.asarray(out)[0, 4, 0]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_in_v_reaches_only_the_queries_that_see_it(impl):
    a = _inputs(4)
    a["v"] = poke(a["v"], (0, 6, 0, 3), np.nan)  # key 6, feature 3
    out, grads = _against_reference(impl, a, masks.Causal())
    out = np.asarray(out)
    assert np.isfinite(out[0, :6]).all()
    assert np.isnan(out[0, 6:, :, 3]).all() and np.isfinite(np.delete(out[0, 6:], 3, axis=-1)).all()
    dq, dk, dv = (np.asarray(g) for g in grads)
    assert np.isfinite(dq[0, :6]).all() and np.isnan(dq[0, 6:]).all()
    assert np.isfinite(dv).all()  # d out / d v does not involve v
    # a window hides key 6 from queries past 6 + 3 as well
    _against_reference(impl, a, masks.SlidingWindow(4))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_in_v_inside_a_prefix_reaches_every_query(impl):
    a = _inputs(4)
    a["v"] = poke(a["v"], (0, 6, 0, 3), np.nan)  # key 6, feature 3: inside a prefix of 10 keys
    out, _ = _against_reference(impl, a, masks.PrefixLM(jnp.asarray([10])))
    assert np.isnan(np.asarray(out)[0, :, :, 3]).all()
    out, _ = _against_reference(impl, a, masks.PrefixLM(jnp.asarray([3])))  # outside: as causal
    assert np.isfinite(np.asarray(out)[0, :6]).all() and np.isnan(np.asarray(out)[0, 6:, :, 3]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_in_v_reaches_the_sinks_gradient_only_through_queries_that_see_it(impl):
    a = _inputs(4)
    a["v"] = poke(a["v"], (0, 6, 0, 3), np.nan)  # key 6 of the one kv head
    _, grads = _against_reference(impl, a, masks.Causal(), sinks=True, cap=5.0)
    assert np.isnan(np.asarray(grads[3])).all()  # queries 6.. of both heads see it
    # queries 20.. see keys 0-3 only: key 6's NaN, in a partial tile, reaches nothing
    _, grads = _against_reference(impl, a, masks.Causal(offset=-20), sinks=True, cap=5.0)
    assert np.isfinite(np.asarray(grads[3])).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_minus_infinity_sink_beside_rows_that_see_nothing(impl):
    a = _inputs(6)
    a["sinks"] = poke(a["sinks"], 1, -np.inf)  # head 1 without a sink; queries 0-3 see no key
    out, grads = _against_reference(impl, a, masks.Causal(offset=-4), sinks=True, cap=5.0)
    assert (np.asarray(out)[0, :4, 1] == 0).all() and np.isfinite(np.asarray(grads[3])).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_that_sees_nothing_stays_zero_next_to_a_nan(impl):
    a = _inputs(5)
    a["k"] = poke(a["k"], (0, 20, 0, 0), np.nan)
    out, _ = _against_reference(impl, a, masks.Causal(offset=-4))  # queries 0-3 see no key
    assert (np.asarray(out)[0, :4] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
# cudnn serves few drawn cases (no offsets, segments or sinks): the others are rejected
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(
    sq=st.sampled_from([0, 1, 17]),
    sk=st.sampled_from([1, 20, 33]),
    kind=st.sampled_from(["causal", "window", "full", "segments", "prefix"]),
    where=st.sampled_from(["q", "k", "v", "sinks"]),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    seed=st.integers(0, 2**16),
)
def test_property_non_finite_pattern_matches_the_reference(impl, sq, sk, kind, where, value, seed):
    a = _inputs(seed, sq=sq, sk=sk, h=2, kvh=1)
    rng = np.random.default_rng(seed)
    if a[where].size:
        a[where] = poke(a[where], tuple(int(rng.integers(n)) for n in a[where].shape), value)
    ids = lambda n: jnp.asarray(np.sort(rng.integers(0, 3, (1, n))), jnp.int32)  # noqa: E731
    mask = {
        "causal": masks.Causal(offset=sk - sq),
        "window": masks.SlidingWindow(5, offset=sk - sq),
        "full": masks.Full(),
        "segments": masks.Segments(ids(sq), ids(sk)),
        "prefix": masks.PrefixLM(jnp.asarray([int(rng.integers(0, sk + 1))])),
    }[kind]
    _against_reference(impl, a, mask, drawn=True, sinks=where == "sinks")


def test_the_guards_forward_alone_takes_the_fast_branch_only_where_everything_is_finite():
    # the primal (no gradient): the fast function inside the conditional's first branch
    from axkern.ops.attention.common import where_finite

    ref = functools.partial(attention, mask=masks.Causal(), implementation="reference")

    def fast(q, k, v, sinks=None):  # finite whatever the inputs, and a different function of q
        return ref(jnp.nan_to_num(2 * q), jnp.nan_to_num(k), jnp.nan_to_num(v))

    guarded = jax.jit(functools.partial(where_finite, fast, lambda q, k, v, sinks: ref(q, k, v)))
    a = _inputs(8)
    np.testing.assert_allclose(guarded(a["q"], a["k"], a["v"]), fast(a["q"], a["k"], a["v"]), rtol=1e-6)
    bad = poke(a["q"], (0, 4, 1, 3), np.inf)
    assert_nonfinite_rule(guarded(bad, a["k"], a["v"]), ref(bad, a["k"], a["v"]), "guard primal", rtol=1e-6)


def test_the_cudnn_guard_takes_the_rule_following_path_where_something_is_not_finite():
    """`cudnn` runs cuDNN's kernel behind a guard (`common.where_finite`): where `q`, `k`, `v` or the
    cotangent holds a non-finite value, `xla`'s forward and backward serve instead. Checked
    here with a stand-in for cuDNN that hides non-finite values and computes something else
    (`q` doubled), so each path's outputs and gradients are told apart."""
    from axkern.ops.attention.common import where_finite

    mask = masks.Causal()
    ref = jax.jit(functools.partial(attention, mask=mask, implementation="reference"))

    def hiding(q, k, v, sinks=None):  # finite whatever the inputs, and a different function of q
        return ref(jnp.nan_to_num(2 * q), jnp.nan_to_num(k), jnp.nan_to_num(v))

    guarded = functools.partial(where_finite, hiding, lambda q, k, v, sinks: ref(q, k, v))

    def value_and_grads(f, a, cot):
        out, vjp = jax.vjp(f, a["q"], a["k"], a["v"])
        return out, vjp(cot)

    a = _inputs(6)
    cot = jnp.cos(jnp.arange(24 * 2 * 16, dtype=jnp.float32).reshape(1, 24, 2, 16))
    clean = value_and_grads(hiding, a, cot)
    for f in (guarded, jax.jit(guarded)):  # the guard run eagerly and jitted
        got = value_and_grads(f, a, cot)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(clean[0]), rtol=1e-5, atol=1e-6)
        for g, w in zip(got[1], clean[1], strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    bad = dict(a, k=poke(a["k"], (0, 9, 0, 2), np.nan))
    got, want = value_and_grads(jax.jit(guarded), bad, cot), value_and_grads(ref, bad, cot)
    assert_nonfinite_rule(got[0], want[0], "guard out", rtol=1e-5)
    assert_nonfinite_rule(got[1], want[1], "guard grads", rtol=1e-5)
    assert np.isnan(np.asarray(got[0])[0, 9:]).any() and np.isfinite(np.asarray(got[0])[0, :9]).all()
    bad_cot = poke(cot, (0, 3, 1, 0), np.nan)
    got, want = value_and_grads(jax.jit(guarded), a, bad_cot), value_and_grads(ref, a, bad_cot)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(clean[0]), rtol=1e-5, atol=1e-6)
    assert_nonfinite_rule(got[1], want[1], "guard grads, NaN cotangent", rtol=1e-5)


def test_the_guard_differentiates_a_jitted_call_with_traced_mask_arrays_and_sinks():
    # the mask's arrays (segment ids) and the sinks reach the guard's branches as arguments:
    # `grad` of a jitted call whose ids are traced works (closed over, they would be constants
    # it cannot take), and so does `grad` with respect to the sinks (closed over, a tracer leaks)
    from axkern.ops.attention.common import guarded as _guarded

    a = _inputs(6)
    ids = jnp.array([[0] * 10 + [1] * 14])

    def guarded(q, k, v, sinks, ids):
        def fast(q, k, v, sinks, mask):
            return attention(q, k, v, mask=mask, sinks=sinks, implementation="reference")

        def safe(q, k, v, sinks, mask):
            return attention(q, k, v, mask=mask, sinks=sinks, implementation="xla")

        mask = masks.Causal() & masks.Segments(ids, ids)
        return _guarded(fast, safe, q, k, v, sinks, mask)

    def ref(q, k, v, sinks, ids):
        mask = masks.Causal() & masks.Segments(ids, ids)
        return attention(q, k, v, mask=mask, sinks=sinks, implementation="reference")

    loss = lambda f: lambda q, k, v, s, ids: jnp.sum(jnp.sin(f(q, k, v, s, ids)))  # noqa: E731
    args = (a["q"], a["k"], a["v"], a["sinks"], ids)
    got = jax.grad(jax.jit(loss(guarded)), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    bad = poke(a["v"], (0, 3, 0, 0), np.nan)  # the rule-following branch, ids traced as well
    out = jax.jit(guarded)(a["q"], a["k"], bad, None, ids)
    assert np.isnan(np.asarray(out)[0, 3:10, 0, 0]).all() and np.isfinite(np.asarray(out)[0, 10:]).all()
