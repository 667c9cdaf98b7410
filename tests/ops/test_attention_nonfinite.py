"""attention and non-finite input (docs/guide.md, "Non-finite values"): a NaN or an infinity in
`q`, `k`, `v`, `sinks` or the scale reaches exactly the outputs and gradients that depend on it,
respecting the mask, in every implementation (Pallas kernels in interpret mode on a CPU, compiled on a GPU: `AXKERN_TEST_GPU=1`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axkern
from axkern import masks
from axkern.positional import attention
from tests.helpers import assert_nonfinite_rule, poke

# on a GPU (AXKERN_TEST_GPU=1) the GPU kernels run compiled; elsewhere in interpret mode
INTERPRET = jax.default_backend() != "gpu"
# finite values: float32 products on a GPU run as TF32 in XLA (the oracle-rule tests bound them)
RTOL = 1e-4 if INTERPRET else 5e-3

IMPLS = ["xla", "pallas_gpu", "pallas_tpu"]


def _inputs(seed, b=1, sq=24, sk=24, h=2, kvh=1, d=16):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return dict(
        q=jax.random.normal(k[0], (b, sq, h, d)),
        k=jax.random.normal(k[1], (b, sk, kvh, d)),
        v=jax.random.normal(k[2], (b, sk, kvh, d)),
        sinks=jax.random.normal(k[3], (h,)),
    )


def _run(impl, a, mask, *, sinks=False, scale=None, cap=None):
    blocks = {"block_q": 16, "block_kv": 16} if impl != "reference" else None

    def f(q, k, v, s):
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
        return jnp.sum(o * cot), o

    with axkern.use(interpret=INTERPRET):
        (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(
            a["q"], a["k"], a["v"], a["sinks"]
        )
    return out, grads if sinks else grads[:3]


def _against_reference(a, mask, impls=IMPLS, **kw):
    want = _run("reference", a, mask, **kw)
    for impl in impls:
        got = _run(impl, a, mask, **kw)
        assert_nonfinite_rule(got[0], want[0], f"{impl} out", rtol=RTOL)
        assert_nonfinite_rule(got[1], want[1], f"{impl} grads", rtol=RTOL)
    return want


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_q_or_k_gives_nan_not_zero(value):
    a = _inputs(0)
    a["q"] = poke(a["q"], (0, 5, 1, 3), value)  # query 5, head 1
    out, grads = _against_reference(a, masks.Causal())
    out = np.asarray(out)
    assert np.isnan(out[0, 5, 1]).all() and np.isfinite(np.delete(out[0, :, 1], 5, axis=0)).all()
    assert np.isfinite(out[0, :, 0]).all()
    a = _inputs(1)
    a["k"] = poke(a["k"], (0, 9, 0, 2), value)  # key 9: queries 9.. see it
    out, _ = _against_reference(a, masks.Causal())
    assert np.isfinite(np.asarray(out)[0, :9]).all() and (~np.isfinite(np.asarray(out)[0, 9:])).all()


def test_a_non_finite_scale_or_cap_is_refused_and_a_nan_sink_gives_nan():
    a = _inputs(2)
    for kw in ({"scale": float("nan")}, {"scale": float("inf")}, {"logits_soft_cap": float("inf")}):
        with pytest.raises(ValueError, match="scale|logits_soft_cap"):
            attention(a["q"], a["k"], a["v"], **kw)
    a["sinks"] = poke(a["sinks"], 1, np.nan)
    out, _ = _against_reference(a, masks.Causal(), sinks=True)
    assert np.isnan(np.asarray(out)[..., 1, :]).all() and np.isfinite(np.asarray(out)[..., 0, :]).all()


def test_a_soft_cap_does_not_hide_an_infinity():
    a = _inputs(3)
    a["q"] = poke(a["q"], (0, 4, 0, 0), np.inf)
    out, _ = _against_reference(a, masks.Causal(), cap=5.0)
    assert np.isnan(np.asarray(out)[0, 4, 0]).all()


def test_a_nan_in_v_reaches_only_the_queries_that_see_it():
    a = _inputs(4)
    a["v"] = poke(a["v"], (0, 6, 0, 3), np.nan)  # key 6, feature 3
    out, grads = _against_reference(a, masks.Causal())
    out = np.asarray(out)
    assert np.isfinite(out[0, :6]).all()
    assert np.isnan(out[0, 6:, :, 3]).all() and np.isfinite(np.delete(out[0, 6:], 3, axis=-1)).all()
    dq, dk, dv = (np.asarray(g) for g in grads)
    assert np.isfinite(dq[0, :6]).all() and np.isnan(dq[0, 6:]).all()
    assert np.isfinite(dv).all()  # d out / d v does not involve v
    # a window hides key 6 from queries past 6 + 3 as well
    _against_reference(a, masks.SlidingWindow(4))


def test_a_row_that_sees_nothing_stays_zero_next_to_a_nan():
    a = _inputs(5)
    a["k"] = poke(a["k"], (0, 20, 0, 0), np.nan)
    out, _ = _against_reference(a, masks.Causal(offset=-4))  # queries 0-3 see no key
    assert (np.asarray(out)[0, :4] == 0).all()


@given(
    sq=st.sampled_from([0, 1, 17]),
    sk=st.sampled_from([1, 20, 33]),
    kind=st.sampled_from(["causal", "window", "full", "segments"]),
    where=st.sampled_from(["q", "k", "v", "sinks"]),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    seed=st.integers(0, 2**16),
)
def test_property_non_finite_pattern_matches_the_reference(sq, sk, kind, where, value, seed):
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
    }[kind]
    impls = ["xla", "pallas_gpu"] if kind != "segments" else ["xla"]
    _against_reference(a, mask, impls=impls, sinks=where == "sinks")
