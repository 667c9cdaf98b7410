"""ssd and non-finite input (docs/guide.md, "Non-finite values"): a NaN or an infinity reaches
the outputs from its position to its segment's end, never earlier and never another segment,
in every chunked implementation the registry lists for this machine
(`tests.harness.implementations_here`: Pallas kernels in interpret mode on a CPU, compiled on a
GPU: `AXKERN_TEST_GPU=1`) at every chunk size; and a segment starts wherever the id changes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axkern
from axkern.positional import ssd
from tests.harness import INTERPRET, implementations_here, serving
from tests.helpers import assert_nonfinite_rule, equations, poke

IMPLS = implementations_here("ssd")
NAMES = ("x", "dt", "A", "B", "C", "initial_state")


def _inputs(seed, b=1, l=40, h=2, p=16, g=1, n=16):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    return dict(
        x=jax.random.normal(k[0], (b, l, h, p)),
        dt=jax.nn.softplus(jax.random.normal(k[1], (b, l, h))),
        A=-jnp.exp(jax.random.normal(k[2], (h,))),
        B=jax.random.normal(k[3], (b, l, g, n)),
        C=jax.random.normal(k[4], (b, l, g, n)),
        initial_state=jax.random.normal(k[5], (b, h, p, n)),
    )


@functools.cache
def _compiled(impl, chunk, grads):
    """`(y, final_state)`, or with `grads` the gradients for the six inputs of a weighted sum of
    both, as one jitted function of `(arrays, segment_ids)`: a case of the same shapes compiles once."""

    def f(x, dt, A, B, C, s0, seg):
        y, final = ssd(
            x,
            dt,
            A,
            B,
            C,
            segment_ids=seg,
            initial_state=s0,
            return_final_state=True,
            implementation=impl,
            chunk_size=None if impl == "reference" else chunk,
        )
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))) + jnp.sum(final), (y, final)

    def run(a, seg):
        args = [a[k] for k in NAMES]
        if grads:
            return jax.grad(f, argnums=tuple(range(6)), has_aux=True)(*args, seg)[0]
        return f(*args, seg)[1]

    return jax.jit(run)


def _run(impl, a, seg=None, chunk=None, grads=False, drawn=False):
    """`_compiled`'s result; a case `impl` cannot serve is skipped with the reason (`serving`)."""
    with axkern.use(interpret=INTERPRET), serving(impl, drawn=drawn):
        return _compiled(impl, chunk, grads)(a, seg)


def _forward_matches(impl, a, seg=None, chunks=(16,), drawn=False):
    want = _run("reference", a, seg)
    for chunk in chunks:
        assert_nonfinite_rule(_run(impl, a, seg, chunk, drawn=drawn), want, f"{impl} chunk {chunk}")
    return want


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("where", ["x", "dt", "B"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_value_stays_at_and_after_its_position(impl, where, value):
    a = _inputs(0)
    index = {"x": (0, 10, 1, 3), "dt": (0, 10, 1), "B": (0, 10, 0, 2)}[where]
    a[where] = poke(a[where], index, value)
    y, final = _forward_matches(impl, a)
    bad = ~np.isfinite(np.asarray(y))
    assert not bad[0, :10].any() and bad[0, 10:].any()
    assert np.isfinite(np.asarray(y)[0, :, 0]).all() or where == "B"  # head 0 untouched unless B (shared)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_stays_in_its_segment(impl):
    a = _inputs(1)
    a["x"] = poke(a["x"], (0, 5, 0, 0), np.nan)
    seg = jnp.asarray([[0] * 12 + [1] * 28], jnp.int32)
    y, final = _forward_matches(impl, a, seg, chunks=(16, 32))
    bad = ~np.isfinite(np.asarray(y))[0, :, 0, 0]
    assert not bad[:5].any() and bad[5:12].all() and not bad[12:].any()
    assert np.isfinite(np.asarray(final)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_the_gradients_are_nan_where_the_nan_reaches(impl):
    a = _inputs(2)
    a["x"] = poke(a["x"], (0, 10, 1, 3), np.nan)
    want = _run("reference", a, grads=True)
    got = _run(impl, a, chunk=16, grads=True)
    for g, w in zip(got, want, strict=True):
        # never a number where the exact recurrence's gradient is not one
        assert (~np.isfinite(np.asarray(g)) | np.isfinite(np.asarray(w))).all()
    dA = np.asarray(got[2])
    assert np.isnan(dA[1]) and np.isfinite(dA[0])  # head 0 never sees the NaN


# three packed documents over chunks of 16: chunk 0 holds documents 0 and 1, chunk 2 documents
# 1 and 2; one document holds the non-finite value (the initial state's is the first's)
DOCS = jnp.asarray([[0] * 14 + [1] * 20 + [2] * 14], jnp.int32)
WITH_GATE = NAMES + ("D", "z")


@functools.cache
def _documents(impl):
    """`((y, final), gradients of the seven inputs, D and z)` of a weighted sum of `y` over the
    positions `kept [1, L]` and of the final state where `final_kept`, jitted: the loss of the
    other documents only, or of all of them."""

    def f(args, kept, final_kept):
        x, dt, A, B, C, s0, D, z = args
        y, final = ssd(
            x,
            dt,
            A,
            B,
            C,
            D=D,
            z=z,
            segment_ids=DOCS,
            initial_state=s0,
            return_final_state=True,
            implementation=impl,
            chunk_size=None if impl == "reference" else 16,
        )
        w = jnp.cos(jnp.arange(y.size).reshape(y.shape))
        loss = jnp.sum(jnp.where(kept[:, :, None, None], y * w, 0)) + jnp.sum(jnp.where(final_kept, final, 0))
        return loss, (y, final)

    def run(a, kept, final_kept):
        grads, out = jax.grad(f, has_aux=True)(tuple(a[k] for k in WITH_GATE), kept, final_kept)
        return out, dict(zip(WITH_GATE, grads, strict=True))

    return jax.jit(run)


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
@pytest.mark.parametrize("where", ["x", "dt", "B", "C", "initial_state"])
@pytest.mark.parametrize("loss", ["others", "all"])
def test_a_document_boundary_stops_a_nan_in_the_gradients_too(impl, where, loss):
    """A NaN in one packed document leaves the other documents' outputs and the gradients at
    their positions finite and exact, whether the loss covers the NaN document's outputs or
    only the others': they are those of the same inputs with the NaN replaced by 0 (nothing of
    the other documents depends on it). The per-head `A` and `D` sum over every position: where
    the NaN reaches their terms their gradient is NaN (autodiff's `0 · NaN`, also where the loss
    gives the NaN document's outputs a zero cotangent), elsewhere finite and exact."""
    a = _inputs(5, l=48)
    k = jax.random.split(jax.random.PRNGKey(6), 2)
    a["D"], a["z"] = jax.random.normal(k[0], (2,)), jax.random.normal(k[1], a["x"].shape)
    index = {"x": (0, 20, 1, 3), "dt": (0, 20, 1), "B": (0, 20, 0, 2), "C": (0, 20, 0, 2)}
    index["initial_state"] = (0, 1, 3, 2)
    bad_doc = 0 if where == "initial_state" else 1
    poisoned = dict(a, **{where: poke(a[where], index[where], np.nan)})
    fixed = dict(a, **{where: poke(a[where], index[where], 0.0)})
    others = np.asarray(DOCS[0] != bad_doc)  # [L]
    kept = jnp.asarray(others[None]) if loss == "others" else jnp.ones((1, 48), bool)
    with axkern.use(interpret=INTERPRET), serving(impl):
        (y, final), got = _documents(impl)(poisoned, kept, jnp.asarray(True))
    (y_want, final_want), want = _documents("reference")(fixed, kept, jnp.asarray(True))
    _, exact = _documents("reference")(poisoned, kept, jnp.asarray(True))

    def close(g, w, what):
        g, w = np.asarray(g), np.asarray(w)
        assert np.isfinite(g).all(), f"{impl} {what}: {np.argwhere(~np.isfinite(g))[:4].tolist()}"
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4, err_msg=f"{impl} {what}")

    close(np.asarray(y)[:, others], np.asarray(y_want)[:, others], "y")
    close(final, final_want, "final state")  # in document 2
    for name in ("x", "dt", "B", "C", "z"):  # per position
        close(np.asarray(got[name])[:, others], np.asarray(want[name])[:, others], f"d{name}")
    if bad_doc:
        close(got["initial_state"], want["initial_state"], "d initial_state")
    # the heads whose A, D the NaN reaches (B, C: their group's; D: through `D x` only)
    reached = {"A": [0, 1] if where in ("B", "C") else [1], "D": [1] if where == "x" else []}
    for name, heads in reached.items():
        g, clean_heads = np.asarray(got[name]), [h for h in (0, 1) if h not in heads]
        assert np.isnan(g[heads]).all(), f"{impl} d{name}: {g}"
        close(g[clean_heads], np.asarray(want[name])[clean_heads], f"d{name}{clean_heads}")
    for name, g in got.items():  # never a number where the exact recurrence's gradient is not one
        assert (~np.isfinite(np.asarray(g)) | np.isfinite(np.asarray(exact[name]))).all(), f"{impl} d{name}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunk", [8, 16, 32, 64])
def test_a_reused_segment_id_starts_a_new_segment_at_every_chunk_size(impl, chunk):
    a = _inputs(3, l=48)
    seg = jnp.asarray([[0] * 10 + [1] * 10 + [0] * 28], jnp.int32)  # id 0 again: a third segment
    want = _run("reference", a, seg)
    got = _run(impl, a, seg, chunk)  # pallas_gpu refuses chunks below 16 (Triton dot tiles): a skip
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=3, deadline=None)
@given(
    l=st.sampled_from([1, 23, 40]),
    where=st.sampled_from(["x", "dt", "A", "B", "C", "initial_state"]),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    segments=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_non_finite_pattern_matches_the_reference(impl, l, where, value, segments, seed):
    a = _inputs(seed, l=l, h=2, g=2)
    rng = np.random.default_rng(seed)
    a[where] = poke(a[where], tuple(int(rng.integers(n)) for n in a[where].shape), value)
    seg = jnp.asarray(rng.integers(0, 2, (1, l)), jnp.int32) if segments else None
    _forward_matches(impl, a, seg, chunks=(16,), drawn=True)


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
def test_empty_batch_length_or_heads_give_empty_results(impl):
    for b, l, h in ((0, 16, 2), (1, 0, 2), (1, 16, 0)):
        a = _inputs(0, b=b, l=l, h=h)
        y, final = _run(impl, a, chunk=16)
        assert y.shape == a["x"].shape
        np.testing.assert_array_equal(final, a["initial_state"])  # the state passes through
        grads = _run(impl, a, chunk=16, grads=True)
        assert [g.shape for g in grads] == [a[k].shape for k in NAMES]
        if l == 0 and b:
            assert np.asarray(grads[5]).any()  # the final state is the initial one: its gradient flows


def test_empty_feature_axes_and_bad_options_are_refused():
    a = _inputs(0)
    args = [a[k] for k in ("x", "dt", "A", "B", "C")]
    with pytest.raises(ValueError, match="ssd: head_dim must be at least 1"):
        ssd(a["x"][..., :0], *args[1:])
    with pytest.raises(ValueError, match="ssd: state must be at least 1"):
        ssd(*args[:3], a["B"][..., :0], a["C"][..., :0])
    with pytest.raises(ValueError, match="ssd: groups must be at least 1"):
        ssd(*args[:3], a["B"][:, :, :0], a["C"][:, :, :0])
    for limit in ((1.0, 0.1), (0.0, np.nan)):
        with pytest.raises(ValueError, match="ssd: dt_limit must be"):
            ssd(*args, dt_limit=limit)
    x_t, dt_t, B_t, s = a["x"][:, 0], a["dt"][:, 0], a["B"][:, 0], a["initial_state"]
    with pytest.raises(ValueError, match="ssd_step: dt_limit must be"):
        axkern.positional.ssd_step(x_t, dt_t, a["A"], B_t, B_t, s, dt_limit=(2.0, 1.0))
    with pytest.raises(ValueError, match="ssd_step: heads=2 is not divisible by groups=3"):
        B3 = jnp.ones((1, 3, 16))
        axkern.positional.ssd_step(x_t, dt_t, a["A"], B3, B3, s)
    y, new = axkern.positional.ssd_step(x_t[:0], dt_t[:0], a["A"], B_t[:0], B_t[:0], s[:0])
    assert y.shape == (0, 2, 16) and new.shape == (0, 2, 16, 16)


def _primitives(jaxpr, *, into_conds=True):
    """The primitives of `jaxpr` and its sub-jaxprs (`into_conds=False`: not inside a `cond`)."""
    return {e.primitive.name for e in equations(jaxpr, into_conds=into_conds)}


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "reference"])
def test_the_guard_runs_only_where_an_input_is_not_finite(impl):
    # the guard's masks (a running maximum over the length) and its selects sit in the
    # conditionals' branches for non-finite inputs; the other branches and the rest of the layer
    # have neither (they had cost more than the kernels' forward on a GPU). `xla`'s scan runs
    # between two conditionals (one cleans its inputs, one puts NaN in its outputs), the
    # kernels' inside one
    a = _inputs(0)
    fn = lambda a: ssd(  # noqa: E731
        a["x"],
        a["dt"],
        a["A"],
        a["B"],
        a["C"],
        initial_state=a["initial_state"],
        implementation=impl,
        chunk_size=16,
    )
    with axkern.use(interpret=INTERPRET), serving(impl):
        jaxpr = jax.make_jaxpr(fn)(a).jaxpr
    assert "cummax" not in _primitives(jaxpr, into_conds=False)
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == (2 if impl == "xla" else 1)
    branches = [[_primitives(b.jaxpr) for b in c.params["branches"]] for c in conds]  # false, true
    assert any("cummax" in guarded for guarded, _ in branches)
    for guarded, plain in branches:
        assert "is_finite" in guarded
        assert "cummax" not in plain and "is_finite" not in plain
        if impl == "xla":  # the scan's products outside both
            assert "dot_general" not in guarded and "dot_general" not in plain


def test_the_poisoned_outputs_mask_crosses_a_conditional_as_bits():
    # `poison` keeps its mask for the backward as bits along the last axis: differentiated
    # inside a conditional (as `chunks.layer` runs the guarded branch), the slot the other branch
    # fills with zeros is `uint8 [..., P / 8]`, not a byte a value; the cotangent is NaN exactly
    # where the mask is set, at a last axis not a multiple of 8
    from jax import lax

    from axkern.ops.chunked.chunks import poison

    y = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 20))
    bad = y > 1.5

    def f(y, flag):
        return jnp.sum(lax.cond(flag, lambda y: y * 2, lambda y: poison(y, y > 1.5), y))

    text = jax.jit(jax.grad(f)).lower(y, True).as_text()
    results = [line for line in text.splitlines() if "(tensor<i32>) ->" in line]  # the conditionals'
    assert any("tensor<3x5x3xui8>" in r for r in results) and not any("xi1>" in r for r in results), results
    g = jax.grad(f)(y, False)
    np.testing.assert_array_equal(np.isnan(g), bad)
    np.testing.assert_array_equal(np.asarray(g)[~bad], 1.0)


@settings(max_examples=12, deadline=None)
@given(
    length=st.integers(1, 70),
    width=st.integers(1, 19),
    rate=st.sampled_from([0.0, 0.02, 0.2]),
    boundaries=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_the_packed_reach_equals_the_running_maximums(length, width, rate, boundaries, seed):
    # the guard's large mask as a running OR of bytes inside each segment (`reaches_bits`) is
    # `reaches`' mask packed 8 to a byte, at widths that are not a multiple of 8; as the TPU
    # forms it (the running maximum, packed) too
    from unittest import mock

    from axkern.core import backend
    from axkern.ops.chunked.chunks import reaches, reaches_bits

    rng = np.random.default_rng(seed)
    events = jnp.asarray(rng.random((2, length, 3, width)) < rate)
    seg = jnp.asarray(np.cumsum(rng.random((2, length)) < boundaries, axis=1), jnp.int32)
    want = np.packbits(np.asarray(reaches(events, seg)), axis=-1)
    np.testing.assert_array_equal(np.asarray(reaches_bits(events, seg)), want)
    with mock.patch.object(backend, "platform", lambda: "tpu"):
        np.testing.assert_array_equal(np.asarray(reaches_bits(events, seg)), want)
