"""The loss ops (`fused_cross_entropy`, `cross_entropy`) and the rules of docs/guide.md ("Non-finite
values, segments and empty axes"): a kept out-of-range label gives that token a NaN loss and NaN
gradients in every implementation; a non-finite input reaches exactly the outputs and gradients
that depend on it, never a dropped token's (the reference's gradients as well); no token gives
empty results; an empty feature axis is a `ValueError`. Every implementation the registry lists
for this machine runs (`tests.harness.implementations_here`: Pallas kernels in interpret mode on
a CPU, every GPU implementation compiled on a GPU: `AXKERN_TEST_GPU=1`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axkern
from axkern.positional import cross_entropy, fused_cross_entropy
from axkern.positional import fused_cross_entropy_loss as ce_loss
from tests.harness import INTERPRET, implementations_here, serving
from tests.helpers import assert_nonfinite_rule as _nonfinite_rule
from tests.helpers import ce_inputs

# finite values: float32 products on a GPU run as TF32 in XLA (the oracle-rule tests bound them)
RTOL = 1e-4 if INTERPRET else 5e-3


def assert_nonfinite_rule(got, want, what):
    _nonfinite_rule(got, want, what, rtol=RTOL)


FUSED = implementations_here("fused_cross_entropy", reference=True)
PLAIN = implementations_here("cross_entropy", reference=True)


def _nan(a):
    """`a` with every non-finite value NaN: the oracle of gradients, where an infinity's arithmetic
    (`inf - inf`, `0 * inf`) may leave a number in the reference that depends on it."""
    return jnp.where(jnp.isfinite(a), a, jnp.nan)


def _fused_oracle(x, w, labels, reduction, **kw):
    loss = _fused("reference", x, w, labels, reduction, **kw)[0]
    return (loss, *_fused("reference", _nan(x), w, labels, reduction, **kw)[1:])


def _plain_oracle(logits, labels, reduction, **kw):
    loss = _plain("reference", logits, labels, reduction, **kw)[0]
    return loss, _plain("reference", _nan(logits), labels, reduction, **kw)[1]


@functools.cache
def _fused_compiled(impl, reduction, options):
    def run(x, w, labels, where):
        def f(x, w):
            loss = fused_cross_entropy(
                x, w, labels, reduction=reduction, where=where, implementation=impl, **dict(options)
            )
            cot = jnp.cos(jnp.arange(loss.size, dtype=loss.dtype)).reshape(loss.shape) + 2
            return jnp.sum(loss * cot), loss

        (dx, dw), loss = jax.grad(f, argnums=(0, 1), has_aux=True)(x, w)
        return loss, dx, dw

    return jax.jit(run)


@functools.cache
def _plain_compiled(impl, reduction, options):
    def run(logits, labels, where):
        def f(z):
            loss = cross_entropy(
                z, labels, reduction=reduction, where=where, implementation=impl, **dict(options)
            )
            cot = jnp.cos(jnp.arange(loss.size, dtype=loss.dtype)).reshape(loss.shape) + 2
            return jnp.sum(loss * cot), loss

        dz, loss = jax.grad(f, has_aux=True)(logits)
        return loss, dz

    return jax.jit(run)


def _fused(impl, x, w, labels, reduction, *, where=None, drawn=False, **options):
    """(loss, dx, dw): the loss, and the gradients of its sum against a fixed cotangent, jitted (a
    case of the same shapes and options compiles once); a case `impl` cannot serve is skipped with
    the reason (`serving`)."""
    with axkern.use(interpret=INTERPRET), serving(impl, drawn=drawn):
        return _fused_compiled(impl, reduction, tuple(sorted(options.items())))(x, w, labels, where)


def _plain(impl, logits, labels, reduction, *, where=None, drawn=False, **options):
    """(loss, d logits), as `_fused`."""
    with serving(impl, drawn=drawn):
        return _plain_compiled(impl, reduction, tuple(sorted(options.items())))(logits, labels, where)


@pytest.mark.parametrize("reduction", [None, "mean"])
@pytest.mark.parametrize("impl", FUSED)
def test_fused_out_of_range_label_gives_nan_loss_and_gradients_from_that_token(impl, reduction):
    x, w, labels = ce_inputs(jax.random.PRNGKey(0), 8, 16, 40, jnp.float32)
    labels = labels.at[2].set(40).at[5].set(-3)
    loss, dx, dw = _fused(impl, x, w, labels, reduction)
    want = _fused("reference", x, w, labels, reduction)
    assert_nonfinite_rule((loss, dx, dw), want, f"{impl} {reduction}")
    dx = np.asarray(dx)
    assert np.isnan(dx[[2, 5]]).all() and np.isfinite(np.delete(dx, [2, 5], axis=0)).all()
    assert np.isnan(np.asarray(dw)).all()
    # dropped (where false, or the ignore_index) they count for nothing
    loss, dx, dw = _fused(impl, x, w, labels, reduction, where=jnp.arange(8) != 2, ignore_index=-3)
    assert np.isfinite(loss).all() and np.isfinite(dx).all() and np.isfinite(dw).all()
    assert not np.asarray(dx)[[2, 5]].any()


@pytest.mark.parametrize("impl", PLAIN)
def test_plain_out_of_range_label_gives_nan_loss_and_gradient_row(impl):
    logits = jax.random.normal(jax.random.PRNGKey(1), (6, 9))
    labels = jnp.array([0, 9, 3, -1, 8, 2])
    for reduction in (None, "sum"):
        loss, dz = _plain(impl, logits, labels, reduction)
        assert_nonfinite_rule((loss, dz), _plain("reference", logits, labels, reduction), f"{impl}")
        dz = np.asarray(dz)
        assert np.isnan(dz[[1, 3]]).all() and np.isfinite(np.delete(dz, [1, 3], axis=0)).all()
    with pytest.raises(Exception, match=r"label outside \[0, 9\)"):
        jax.block_until_ready(cross_entropy(logits, labels, check_labels=True, implementation=impl))


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_fused_non_finite_dropped_token_reaches_nothing(impl, value):
    x, w, labels = ce_inputs(jax.random.PRNGKey(2), 6, 8, 30, jnp.float32)
    x = x.at[1, 3].set(value).at[4, 0].set(value)
    where = jnp.arange(6) != 1
    for reduction in ("mean", None):
        loss, dx, dw = _fused(impl, x, w, labels, reduction, where=where)
        if impl != "reference":  # the oracle is the reference (on NaN in place of an infinity)
            want = _fused_oracle(x, w, labels, reduction, where=where)
            assert_nonfinite_rule((loss, dx, dw), want, f"{impl} {reduction}")
        dx = np.asarray(dx)
        assert not dx[1].any() and np.isnan(dx[4]).any() and np.isfinite(np.delete(dx, 4, axis=0)).all()
        # the dropped token's row alone non-finite: every result finite
        loss, dx, dw = _fused(impl, x.at[4, 0].set(0.5), w, labels, reduction, where=where)
        assert np.isfinite(loss).all() and np.isfinite(dx).all() and np.isfinite(dw).all()
        assert not np.asarray(dx)[1].any()


@pytest.mark.parametrize("impl", PLAIN)
def test_plain_non_finite_dropped_token_reaches_nothing(impl):
    logits = jax.random.normal(jax.random.PRNGKey(3), (5, 7)).at[1, 2].set(jnp.nan)
    labels, keep = jnp.array([0, 1, 2, 3, 4]), jnp.arange(5) != 1  # token 1: dropped
    # token 3 (kept) non-finite; under the soft cap a NaN, since its tanh takes an infinity to a number
    for reduction, cap, value in (("mean", None, jnp.inf), (None, 3.0, jnp.nan)):
        kw = dict(where=keep, logits_soft_cap=cap)
        logits = logits.at[3, 0].set(value)
        loss, dz = _plain(impl, logits, labels, reduction, **kw)
        if impl != "reference":  # the oracle is the reference (on NaN in place of an infinity)
            want = _plain_oracle(logits, labels, reduction, **kw)
            assert_nonfinite_rule((loss, dz), want, f"{impl} {reduction}")
        dz = np.asarray(dz)
        assert not np.isfinite(loss).all() and not dz[1].any() and np.isnan(dz[3]).any()
        assert np.isfinite(np.delete(dz, 3, axis=0)).all()
        # the dropped token's row alone non-finite: every result finite
        loss, dz = _plain(impl, logits.at[3, 0].set(0.5), labels, reduction, **kw)
        assert np.isfinite(loss).all() and np.isfinite(dz).all() and not np.asarray(dz)[1].any()

    def with_lse(z):  # token 1's lse is reported (NaN); a cotangent of 0 on it reaches nothing either
        out = cross_entropy(z, labels, reduction=None, return_lse=True, where=keep, implementation=impl)
        return jnp.sum(out.loss) + jnp.sum(jnp.where(keep, out.lse, 0)), out.lse

    dz, lse = jax.grad(with_lse, has_aux=True)(logits.at[3, 0].set(0.5))
    assert np.isnan(lse[1]) and np.isfinite(dz).all() and not np.asarray(dz)[1].any()


@pytest.mark.parametrize("reduction", [None, "mean"])
@pytest.mark.parametrize("impl", FUSED)
def test_fused_non_finite_lm_head_reaches_no_dropped_token(impl, reduction):
    """A NaN in `w` reaches every kept token (its column is in every row's lse), so their loss, `dx`
    rows and all of `dw` are NaN; a dropped token's `dx` row stays 0 (`where` false or the
    `ignore_index`), and with every token dropped the loss and both gradients are 0: nothing read w."""
    x, w, labels = ce_inputs(jax.random.PRNGKey(4), 6, 8, 30, jnp.float32)
    w = w.at[3, 7].set(jnp.nan)
    labels = labels.at[4].set(-100)
    where = jnp.arange(6) != 1
    got = _fused(impl, x, w, labels, reduction, where=where, ignore_index=-100)
    assert_nonfinite_rule(
        got, _fused("reference", x, w, labels, reduction, where=where, ignore_index=-100), impl
    )
    loss, dx, dw = (np.asarray(a) for a in got)
    assert not dx[[1, 4]].any() and np.isnan(np.delete(dx, [1, 4], axis=0)).all() and np.isnan(dw).all()
    assert not np.isfinite(loss).all()
    everyone_dropped = (
        (labels, dict(where=jnp.zeros(6, bool))),
        (jnp.full(6, -100), dict(ignore_index=-100)),
        (jnp.where(where, -100, labels), dict(where=where, ignore_index=-100)),  # one, the other
    )
    for tokens, kw in everyone_dropped:
        loss, dx, dw = (np.asarray(a) for a in _fused(impl, x, w, tokens, reduction, **kw))
        assert not loss.any() and not dx.any() and not dw.any(), f"{impl} {reduction} {kw}"


@pytest.mark.parametrize("reduction", [None, "mean"])
@pytest.mark.parametrize("impl", FUSED)
def test_fused_infinite_input_makes_its_dx_row_and_all_of_dw_nan(impl, reduction):
    """An infinity in a kept token's `x` row: that token's loss non-finite, its `dx` row and every
    `dw` entry NaN (each `dw` column takes the token's NaN `dz`), the other `dx` rows finite; the
    reference itself follows the rule (no NaN-for-infinity substitute in the oracle)."""
    x, w, labels = ce_inputs(jax.random.PRNGKey(5), 6, 8, 30, jnp.float32)
    for value in (np.inf, -np.inf):
        bad = x.at[2, 3].set(value)
        got = _fused(impl, bad, w, labels, reduction)
        assert_nonfinite_rule(got, _fused("reference", bad, w, labels, reduction), f"{impl} {value}")
        loss, dx, dw = (np.asarray(a) for a in got)
        assert np.isnan(dx[2]).all() and np.isfinite(np.delete(dx, 2, axis=0)).all(), f"{impl} {value}"
        assert np.isnan(dw).all() and not np.isfinite(loss).all(), f"{impl} {value}"


@pytest.mark.parametrize("impl", PLAIN)
def test_plain_infinite_logit_makes_the_whole_gradient_row_nan(impl):
    """A `+inf` logit: its token's loss and lse non-finite and its whole `d logits` row NaN (not
    autodiff's `[-1, nan, 0, 0]` through `exp(inf - inf)`), in the reference too; the reported lse's
    gradient likewise. A `-inf` logit is an entry of probability 0 in every implementation: the
    lse stays finite (the label's own `-inf` gives an infinite loss)."""
    logits = jax.random.normal(jax.random.PRNGKey(6), (4, 4)).at[1, 1].set(jnp.inf)
    labels = jnp.array([0, 0, 2, 3])
    for reduction, kw in (
        (None, {}),
        ("mean", {}),
        (None, {"label_smoothing": 0.1, "logsumexp_weight": 0.01}),
    ):
        loss, dz = _plain(impl, logits, labels, reduction, **kw)
        if impl != "reference":
            assert_nonfinite_rule((loss, dz), _plain("reference", logits, labels, reduction, **kw), impl)
        dz = np.asarray(dz)
        assert np.isnan(dz[1]).all() and np.isfinite(np.delete(dz, 1, axis=0)).all(), f"{impl} {kw}"
        assert not np.isfinite(loss).all()

    def with_lse(z):
        out = cross_entropy(z, labels, reduction=None, return_lse=True, implementation=impl)
        return jnp.sum(out.lse), out.lse

    dz, lse = jax.grad(with_lse, has_aux=True)(logits)
    assert not np.isfinite(lse[1]) and np.isnan(dz[1]).all() and np.isfinite(np.delete(dz, 1, axis=0)).all()
    masked = logits.at[1, 1].set(-jnp.inf)
    loss, dz = _plain(impl, masked, labels, None)
    assert np.isfinite(loss).all() and np.isfinite(dz).all() and dz[1, 1] == 0
    loss, dz = _plain(impl, masked, labels.at[1].set(1), None)
    assert loss[1] == np.inf and np.isfinite(np.delete(loss, 1)).all()


@pytest.mark.parametrize("impl", FUSED)
def test_fused_no_token_gives_empty_results(impl):
    x, w, labels = jnp.ones((0, 4)), jnp.ones((4, 8)), jnp.zeros((0,), jnp.int32)
    with axkern.use(interpret=INTERPRET):
        loss, lse = fused_cross_entropy(x, w, labels, reduction=None, return_lse=True, implementation=impl)
        assert loss.shape == lse.shape == (0,)
        for reduction in ("mean", "sum"):

            def f(x, w, reduction=reduction):
                return fused_cross_entropy(x, w, labels, reduction=reduction, implementation=impl)

            value, (dx, dw) = jax.value_and_grad(f, argnums=(0, 1))(x, w)
            assert value == 0 and dx.shape == (0, 4) and dw.shape == (4, 8) and not dw.any()


@pytest.mark.parametrize("impl", PLAIN)
def test_no_token_and_empty_feature_axes(impl):
    value, dz = jax.value_and_grad(lambda z: cross_entropy(z, jnp.zeros((0,), int), implementation=impl))(
        jnp.ones((0, 5))
    )
    assert value == 0 and dz.shape == (0, 5)
    assert cross_entropy(jnp.ones((0, 5)), jnp.zeros((0,), int), reduction=None).shape == (0,)
    assert ce_loss(jnp.ones((0, 4)), jnp.ones((4, 8)), jnp.zeros((0,), int), implementation=impl) == 0
    with pytest.raises(ValueError, match="cross_entropy: vocab must be at least 1"):
        cross_entropy(jnp.ones((3, 0)), jnp.zeros((3,), int), implementation=impl)
    for x, w, axis in (
        (jnp.ones((3, 4)), jnp.ones((4, 0)), "vocab"),
        (jnp.ones((3, 0)), jnp.ones((0, 8)), "embed"),
    ):
        for fn in (fused_cross_entropy, ce_loss):
            with pytest.raises(ValueError, match=f"fused_cross_entropy: {axis} must be at least 1"):
                fn(x, w, jnp.zeros((3,), int), implementation=impl)


def test_non_finite_options_are_refused():
    x, w, labels = ce_inputs(jax.random.PRNGKey(0), 4, 8, 10, jnp.float32)
    for weight in (np.nan, np.inf):
        with pytest.raises(ValueError, match="logsumexp_weight must be a finite number"):
            fused_cross_entropy(x, w, labels, logsumexp_weight=weight)
        with pytest.raises(ValueError, match="logsumexp_weight must be a finite number"):
            cross_entropy(x @ w, labels, logsumexp_weight=weight)


@st.composite
def _loss_case(draw):
    n = draw(st.integers(0, 6))
    d = draw(st.integers(1, 4))
    v = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    cells = st.tuples(
        st.integers(0, max(n - 1, 0)), st.integers(0, d - 1), st.sampled_from([np.nan, np.inf, -np.inf])
    )
    pokes = draw(st.lists(cells, max_size=3)) if n else []
    dropped = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    bad_label = draw(st.sampled_from([None, -1, v])) if n else None
    return n, d, v, seed, pokes, dropped, bad_label


def _case_arrays(n, d, v, seed, pokes, dropped, bad_label):
    x, w, labels = ce_inputs(jax.random.PRNGKey(seed), n, d, v, jnp.float32)
    for row, col, value in pokes:
        x = x.at[row, col].set(value)
    if bad_label is not None:
        labels = labels.at[0].set(bad_label)
    return x, w, labels, jnp.asarray(np.array(dropped, bool)).reshape(n) ^ True


@pytest.mark.parametrize("impl", implementations_here("fused_cross_entropy"))
@settings(max_examples=4, deadline=None)
@given(_loss_case(), st.sampled_from(["mean", None]))
def test_fused_property_nan_pattern_and_values_match_the_reference(impl, case, reduction):
    x, w, labels, where = _case_arrays(*case)
    got = _fused(impl, x, w, labels, reduction, where=where, drawn=True)
    want = _fused_oracle(x, w, labels, reduction, where=where)
    assert_nonfinite_rule(got, want, f"{impl} {reduction}")


@pytest.mark.parametrize("impl", implementations_here("cross_entropy"))
@settings(max_examples=6, deadline=None)
@given(_loss_case(), st.sampled_from(["mean", None]))
def test_plain_property_nan_pattern_and_values_match_the_reference(impl, case, reduction):
    x, w, labels, where = _case_arrays(*case)
    logits = x @ w if x.shape[0] else jnp.zeros((0, w.shape[1]))
    got = _plain(impl, logits, labels, reduction, where=where, drawn=True)
    assert_nonfinite_rule(got, _plain_oracle(logits, labels, reduction, where=where), f"{impl} {reduction}")


def test_named_layer_empty_batch_and_feature_axes():
    import haliax as hax

    batch, pos, embed, vocab = (
        hax.Axis("batch", 0),
        hax.Axis("position", 4),
        hax.Axis("embed", 3),
        hax.Axis("vocab", 5),
    )
    x, w, labels = (
        hax.ones((batch, pos, embed)),
        hax.ones((embed, vocab)),
        hax.zeros((batch, pos), dtype=jnp.int32),
    )
    assert axkern.fused_cross_entropy(x, w, labels) == 0
    per_token = axkern.fused_cross_entropy(x, w, labels, reduction=None)
    assert per_token.axes == (batch, pos)
    assert axkern.cross_entropy(hax.ones((batch, pos, vocab)), labels, reduction=None).axes == (batch, pos)
    with pytest.raises(ValueError, match="fused_cross_entropy: vocab must be at least 1"):
        axkern.fused_cross_entropy(
            hax.ones((pos, embed)), hax.ones((embed, vocab.resize(0))), hax.zeros((pos,), dtype=jnp.int32)
        )
