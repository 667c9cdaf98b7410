"""short_conv and the rules of docs/guide.md ("Non-finite values, segments and empty axes"): a
segment starts wherever the id changes, whatever the ids; a non-finite input reaches exactly the
outputs whose taps read it; empty batch and sequence axes give empty results, empty channels a
`ValueError`. Every implementation the registry lists for this machine runs
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
from axkern.positional import short_conv as conv
from axkern.positional import short_conv_step as step
from tests.harness import INTERPRET, implementations_here, serving
from tests.helpers import assert_nonfinite_rule

IMPLS = implementations_here("short_conv", reference=True)


@functools.cache
def _compiled(impl, activation, grads):
    """`(y, final_state)` and, with `grads`, the gradients of a weighted sum of `y` for x, w, s0,
    as one jitted function of `(x, w, segment_ids, s0)`: a case of the same shapes compiles once."""

    def f(x, w, s0, seg):
        y, final = conv(
            x,
            w,
            segment_ids=seg,
            initial_state=s0,
            return_final_state=True,
            activation=activation,
            implementation=impl,
        )
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)), (y, final)

    def run(x, w, seg, s0):
        if not grads:
            return f(x, w, s0, seg)[1]
        g, out = jax.grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, s0, seg)
        return out, g

    return jax.jit(run)


def _run(impl, x, w, seg=None, s0=None, activation="silu", grads=True, drawn=False):
    """`_compiled`'s result; a case `impl` cannot serve is skipped with the reason (`serving`)."""
    with axkern.use(interpret=INTERPRET), serving(impl, drawn=drawn):
        return _compiled(impl, activation, grads)(x, w, seg, s0)


def _inputs(seed, b, l, c, width):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        jax.random.normal(k[0], (b, l, c)),
        jax.random.normal(k[1], (width, c)) / np.sqrt(width),
        jax.random.normal(k[2], (b, width - 1, c)),
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_an_id_used_again_starts_a_new_segment(impl):
    x, w, s0 = _inputs(0, 2, 12, 4, 4)
    reused = jnp.array([[0, 0, 1, 1, 0, 0, 0, 2, 0, 7, 7, 0]] * 2)
    runs = jnp.array([[0, 0, 1, 1, 2, 2, 2, 3, 4, 5, 5, 6]] * 2)
    got, want = _run(impl, x, w, reused, s0, grads=False), _run(impl, x, w, runs, s0, grads=False)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    # the oracle by hand: each segment convolved alone, only the first one from the state
    y = np.asarray(got[0])
    for start, stop in ((0, 2), (2, 4), (4, 7), (7, 8), (8, 9), (9, 11), (11, 12)):
        alone = conv(x[:, start:stop], w, initial_state=s0 if start == 0 else None, activation="silu")
        np.testing.assert_allclose(y[:, start:stop], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_input_reaches_only_the_taps_that_read_it(impl, value):
    x, w, s0 = _inputs(1, 1, 12, 4, 4)
    seg = jnp.array([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0]])
    x = x.at[0, 4, 1].set(value)
    (y, final), grads = _run(impl, x, w, seg, s0)
    want = _run("reference", x, w, seg, s0)
    assert_nonfinite_rule(((y, final), grads), want, impl)
    bad = ~np.isfinite(np.asarray(y))[0]
    assert bad[4:6, 1].all() and not bad[6:, :].any() and not bad[:4].any() and not bad[:, [0, 2, 3]].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_tap_of_another_segment_reaches_no_weight_gradient(impl):
    x, w, s0 = _inputs(3, 1, 6, 4, 3)
    x = x.at[0, 4, 1].set(np.nan)
    seg = jnp.array([[0, 0, 0, 0, 1, 1]])  # the NaN's segment is shorter than the width
    _, (dx, dw, ds0) = _run(impl, x, w, seg, s0)
    dw = np.asarray(dw)  # dw[k]: the taps at lag k
    # lag 2 from positions 4 and 5 reads positions 2 and 3, of the other segment: selected away
    assert np.isnan(dw[:2, 1]).all() and np.isfinite(dw[2]).all()
    assert np.isfinite(np.delete(dw, 1, axis=1)).all()
    assert np.isfinite(np.asarray(dx)[0, :4]).all() and np.isfinite(ds0).all()


@functools.cache
def _with_bias(impl, activation):
    """`y` and the gradients of a weighted sum of `y` for x, w, bias, s0, jitted."""

    def f(x, w, b, s0, seg):
        y = conv(x, w, bias=b, segment_ids=seg, initial_state=s0, activation=activation, implementation=impl)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)), y

    def run(x, w, b, s0, seg):
        g, y = jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True)(x, w, b, s0, seg)
        return y, g

    return jax.jit(run)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("width", [2, 4, 8])
def test_a_non_finite_weight_tap_is_selected_away_where_it_is_masked(impl, width):
    """A NaN in tap 1's weight reaches only the outputs whose tap 1 reads a position of their own
    segment (position 3 starts a segment: its tap 1 is selected away, never multiplied by 0), and
    only the gradients of those outputs' inputs; past the end of the sequence no output exists, so
    the last rows of `dx` take nothing from the NaN tap either."""
    x, b, s0 = jnp.ones((1, 6, 16)), jnp.zeros((16,)), jnp.ones((1, width - 1, 16))
    w = jnp.ones((width, 16)).at[1, 0].set(jnp.nan)
    cases = (
        (jnp.array([[0, 0, 0, 1, 1, 1]]), None),
        (jnp.array([[0, 0, 0, 1, 1, 1]]), "silu"),
        (jnp.array([[0, 0, 0, 1, 1, 2]]), "silu"),  # position 5 alone: its dx reads no output of tap 1
        (None, None),  # dx[5] = w[0] dy[5]: the NaN tap would read an output past the end
    )
    for seg, activation in cases:
        with axkern.use(interpret=INTERPRET), serving(impl):
            got = _with_bias(impl, activation)(x, w, b, s0, seg)
        want = _with_bias("reference", activation)(x, w, b, s0, seg)
        assert_nonfinite_rule(got, want, f"{impl} width {width} {seg} {activation}")
        if seg is not None and activation is None:
            y = np.asarray(got[0])[0, :, 0]
            np.testing.assert_array_equal(np.isnan(y), [1, 1, 1, 0, 1, 1])
            assert y[3] == 1 and np.isfinite(np.asarray(got[0])[..., 1:]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch_and_sequence_give_empty_results(impl):
    for b, l in ((0, 6), (2, 0)):
        x, w, s0 = _inputs(2, b, l, 4, 4)
        (y, final), (dx, dw, ds0) = _run(impl, x, w, None, s0)
        assert y.shape == x.shape and dx.shape == x.shape and not dw.any()
        np.testing.assert_array_equal(final, s0)  # the state passes through
        assert ds0.shape == s0.shape
        if b:
            (y, final), _ = _run(impl, x, w, jnp.zeros((b, 0), jnp.int32), s0)
            assert y.shape == x.shape


def test_empty_channels_are_refused():
    with pytest.raises(ValueError, match="short_conv: channels must be at least 1"):
        conv(jnp.ones((1, 5, 0)), jnp.ones((3, 0)))
    with pytest.raises(ValueError, match="short_conv_step: channels must be at least 1"):
        step(jnp.ones((1, 0)), jnp.ones((1, 2, 0)), jnp.ones((3, 0)))
    y, new = step(jnp.ones((0, 2)), jnp.ones((0, 2, 2)), jnp.ones((3, 2)))
    assert y.shape == (0, 2) and new.shape == (0, 2, 2)


@st.composite
def _case(draw):
    b, l, c, width = (
        draw(st.integers(0, 2)),
        draw(st.integers(0, 9)),
        draw(st.sampled_from([1, 3, 4, 8])),  # multiples of 4: the channel groups of `cuda`
        draw(st.integers(1, 4)),
    )
    seg = draw(st.lists(st.integers(0, 2), min_size=b * l, max_size=b * l))
    cell = st.tuples(st.integers(0, max(b - 1, 0)), st.integers(0, max(l - 1, 0)), st.integers(0, c - 1))
    pokes = (
        draw(st.lists(st.tuples(cell, st.sampled_from([np.nan, np.inf, -np.inf])), max_size=3))
        if b * l
        else []
    )
    return b, l, c, width, seg, pokes, draw(st.integers(0, 2**16)), draw(st.sampled_from([None, "silu"]))


@pytest.mark.parametrize("impl", implementations_here("short_conv"))
# cuda serves whole channel groups only: the other drawn cases are rejected
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(_case())
def test_property_nan_pattern_and_values_match_the_reference(impl, case):
    b, l, c, width, seg, pokes, seed, activation = case
    x, w, s0 = _inputs(seed, b, l, c, width)
    for index, value in pokes:
        x = x.at[index].set(value)
    seg = jnp.asarray(np.array(seg, np.int32).reshape(b, l))
    got = _run(impl, x, w, seg, s0, activation, drawn=True)
    assert_nonfinite_rule(got, _run("reference", x, w, seg, s0, activation), f"{impl} {case}")


def test_named_layer_empty_sequence():
    import haliax as hax

    batch, pos, chan, width = (
        hax.Axis("batch", 2),
        hax.Axis("position", 0),
        hax.Axis("embed", 3),
        hax.Axis("width", 3),
    )
    y = axkern.short_conv(hax.ones((batch, pos, chan)), hax.ones((width, chan)))
    assert y.axes == (batch, pos, chan)
    with pytest.raises(ValueError, match="short_conv: channels must be at least 1"):
        axkern.short_conv(hax.ones((batch, pos.resize(4), chan.resize(0))), hax.ones((width, chan.resize(0))))
