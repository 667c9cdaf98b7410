"""mamba3 and non-finite input (docs/guide.md, "Non-finite values"): a NaN or an infinity reaches
the outputs the sequential recurrence carries it to (from its position to its segment's end,
never earlier, never another segment), in every chunked implementation the registry lists for
this machine; gradients are never a number where the recurrence's gradient is not one."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axkern
from axkern.ops.mamba3.blocks import Mamba3BlockSizes
from tests.cases.mamba3 import call, make
from tests.harness import INTERPRET, implementations_here, serving
from tests.helpers import assert_nonfinite_rule, equations, poke, to64, x64

IMPLS = implementations_here("mamba3")
# finite values: float32 products are exact on the CPU, TF32 (XLA's default) on a GPU
RTOL = 1e-4 if INTERPRET else 5e-3


def _inputs(seed, rank=0, l=24):  # noqa: E741
    # head dim and state 16: the smallest that every kernel takes
    return make(seed, 1, l, 2, 16, 2 if not rank else 1, 16, 2, rank, "float32", segments=False)[0]


@functools.cache
def _compiled(impl, grads):
    """`(y, final_state)`, or with `grads` the gradients of a weighted sum of both, as one jitted
    function of `(arrays, segment_ids)`: a case of the same shapes compiles once."""

    def f(a, seg):
        y, final = call(impl, a, seg, None if impl == "reference" else 16)
        loss = jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))) + sum(jnp.sum(s) for s in final)
        return loss, (y, tuple(final))

    if grads:
        return jax.jit(lambda a, seg: jax.grad(f, has_aux=True)(a, seg)[0])
    return jax.jit(lambda a, seg: f(a, seg)[1])


def _run(impl, a, seg, grads=False, drawn=False):
    with axkern.use(interpret=INTERPRET), serving(impl, drawn=drawn):
        return _compiled(impl, grads)(a, seg)


def _zero_segments(a):
    return jnp.zeros(a["v"].shape[:2], jnp.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("where", ["v", "k", "q", "dt", "adt", "trap", "angles"])
def test_a_non_finite_value_stays_at_and_after_its_position(impl, where):
    a = _inputs(0)
    index = {
        "v": (0, 10, 1, 3),
        "k": (0, 10, 0, 5),
        "q": (0, 10, 1, 0),
        "angles": (0, 10, 1, 1),
    }.get(where, (0, 1, 10))  # adt, dt, trap: [batch, heads, length]
    a[where] = poke(a[where], index, np.inf if where in ("v", "trap") else np.nan)
    seg = _zero_segments(a)
    want = _run("reference", a, seg)
    assert_nonfinite_rule(_run(impl, a, seg), want, f"{impl} {where}", rtol=RTOL)
    bad = ~np.isfinite(np.asarray(want[0]))
    assert not bad[0, :10].any() and bad[0, 10].any()
    if where != "q":  # q reaches its own position only
        assert bad[0, 11:].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_stays_in_its_segment_and_the_gradients_are_never_a_number_where_it_reaches(impl):
    # (they may be NaN in more places: a NaN cotangent meets the masked terms' zeros in the
    # chunks' products)
    a = _inputs(1)
    a["v"] = poke(a["v"], (0, 5, 0, 0), np.nan)
    seg = jnp.asarray([[0] * 12 + [1] * 12], jnp.int32)
    y, final = _run(impl, a, seg)
    assert_nonfinite_rule((y, final), _run("reference", a, seg), rtol=RTOL)
    bad = ~np.isfinite(np.asarray(y))[0, :, 0, 0]
    assert not bad[:5].any() and bad[5:12].all() and not bad[12:].any()
    got, want = _run(impl, a, seg, grads=True), _run("reference", a, seg, grads=True)
    for name in want:
        g, w = np.asarray(got[name]), np.asarray(want[name])
        assert (~np.isfinite(g) | np.isfinite(w)).all(), name  # never a number where the recurrence has none
    assert np.isnan(np.asarray(got["v"])[0, 5, 0, 0])


NAMES = ["q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z"]
NAMES += ["angle_state", "ssm_state", "k_state", "v_state"]


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=3, deadline=None)  # each example compiles four programs
@given(
    rank=st.sampled_from([0, 1, 2]),
    where=st.sampled_from(NAMES + ["W_x", "W_z", "W_o"]),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    segments=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_non_finite_pattern_matches_the_reference(impl, rank, where, value, segments, seed):
    a = _inputs(seed, rank)
    if where not in a:  # a MIMO weight drawn for a SISO case
        where = "v"
    rng = np.random.default_rng(seed)
    a[where] = poke(a[where], tuple(int(rng.integers(n)) for n in a[where].shape), value)
    seg = (
        jnp.asarray(np.cumsum(rng.random((1, 24)) < 0.15, axis=1), jnp.int32)
        if segments
        else _zero_segments(a)
    )
    want = _run("reference", a, seg)
    assert_nonfinite_rule(_run(impl, a, seg, drawn=True), want, f"{impl} {where}", rtol=RTOL)
    got, want = _run(impl, a, seg, grads=True), _run("reference", a, seg, grads=True)
    for name in want:
        assert (~np.isfinite(np.asarray(got[name])) | np.isfinite(np.asarray(want[name]))).all(), name


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "reference"])
def test_the_guard_runs_only_where_an_input_is_not_finite(impl):
    # one conditional forms the masks (its branch for finite inputs only boolean zeros) from the
    # inputs, outside the differentiated program; every large array is formed outside it: the
    # only finiteness tests as large as v outside it are the scan's inputs' selects (`scrubbed`,
    # an elementwise select that fuses into the pass forming its input), and the scan runs
    # outside it
    a, _ = make(0, 1, 32, 2, 16, 1, 16, 2, 0, "float32", segments=False)
    with axkern.use(interpret=INTERPRET), serving(impl):
        jaxpr = jax.make_jaxpr(lambda a: call(impl, a, None, 8))(a).jaxpr
    size = lambda e: max(v.aval.size for v in e.invars)  # noqa: E731
    tests = lambda eqns: [size(e) for e in eqns if e.primitive.name == "is_finite"]  # noqa: E731

    def bodies(e):  # a custom_vjp's own equations
        return list(equations(e.params["call_jaxpr"].jaxpr)) if "custom_vjp" in e.primitive.name else []

    def is_scrub(e):  # `scrubbed`: a select of its input by its finiteness and a scalar, nothing more
        names = {s.primitive.name for s in bodies(e)}
        allowed = {"is_finite", "or", "select_n", "broadcast_in_dim", "convert_element_type", "jit", "pjit"}
        return "_scrubbed_bwd" in str(e.params.get("bwd")) and names <= allowed

    outside = list(equations(jaxpr, into_conds=False))
    scrubs = [e for e in outside if is_scrub(e)]
    inside_scrubs = {id(s) for e in scrubs for s in bodies(e)}
    # the rotated q and k, and v; the rest the correction's unrotated q, k and biases (no head axis)
    large = [e for e in scrubs if size(e) >= a["v"].size]
    assert len(large) == 3
    assert all(size(e) <= a["q"].size for e in scrubs if e not in large)
    others = [e for e in outside if id(e) not in inside_scrubs]
    assert max(tests(others)) < a["v"].size
    conds = [e for e in outside if e.primitive.name == "cond"]
    assert len(conds) == 1

    def scans(eqns):  # the chunk scan: its kernels, or a custom_vjp holding products
        return [
            e
            for e in eqns
            if e.primitive.name == "pallas_call"
            or (
                "custom_vjp" in e.primitive.name
                and any(s.primitive.name == "dot_general" for s in equations(e.params["call_jaxpr"].jaxpr))
            )
        ]

    assert scans(outside)
    (cond,) = conds
    guarded, plain = (list(equations(b.jaxpr)) for b in cond.params["branches"])  # false, true
    assert max(tests(guarded)) >= a["v"].size and not tests(plain)
    assert not scans(guarded + plain)
    # the branch for finite inputs forms zeros of masks only (boolean, or bits packed 8 to a byte):
    # no operand passed out, no float
    j = cond.params["branches"][1].jaxpr
    assert all(v.aval.dtype in (jnp.bool_, jnp.uint8) and v not in j.invars for v in j.outvars)
    assert sum(v.aval.size for v in j.outvars) < a["v"].size  # the large masks packed
    # and no gradient flows through the conditional: it reads the inputs as constants
    with axkern.use(interpret=INTERPRET), serving(impl):
        grad = jax.make_jaxpr(jax.grad(lambda a: jnp.sum(call(impl, a, None, 8)[0])))(a).jaxpr
    assert (
        len([e for e in equations(grad, into_conds=False, into_kernels=False) if e.primitive.name == "cond"])
        == 1
    )


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_the_kernels_refuse_float64_with_the_reason(impl):
    # (as ssd's) the Pallas kernels compute in float32: a float64 input (with x64 on) is refused,
    # naming the inputs, so that a list of implementations falls back to xla (float64)
    a = _inputs(0)
    with x64(), axkern.use(interpret=True):
        wide = jax.tree.map(jnp.asarray, to64(a))
        with pytest.raises(axkern.Unsupported, match=f"'{impl}' cannot serve this call: float64 q, k, v"):
            call(impl, wide, None, 16)
        with pytest.raises(axkern.Unsupported, match="float64 k: the Pallas kernels compute in float32"):
            call(impl, dict(a, k=wide["k"]), None, 16)
        d = axkern.explain(lambda a: call((impl, "xla"), a, None, 16), wide)
        assert d.implementation == "xla" and "float64" in d.rejected[0].reason
        y, _ = call((impl, "xla"), wide, None, 16)
    assert y.dtype == jnp.float64


@pytest.mark.parametrize("where", ["v", "k", "q", "angles"])
def test_q_and_k_turned_in_the_tpu_kernels_keep_the_rule(where):
    # `rotation="kernel"` (pallas_tpu, interpret mode): the masks of the rotated q, k formed a few
    # heads at a time (`layer._rotation_masks`); two groups of two heads, 8 of the 8 pairs turned,
    # chunks of 128 over 150 positions; values, final states and the gradients' pattern
    a = make(1, 1, 150, 4, 16, 2, 16, 8, 0, "float32", segments=False)[0]
    index = {"v": (0, 130, 1, 3), "k": (0, 130, 1, 5), "q": (0, 10, 0, 9), "angles": (0, 10, 3, 7)}[where]
    a[where] = poke(a[where], index, np.inf if where == "v" else np.nan)
    seg = _zero_segments(a)
    blocks = Mamba3BlockSizes(128, rotation="kernel")

    def f(a, seg, impl):
        y, final = call(impl, a, seg, None if impl == "reference" else blocks)
        loss = jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))) + sum(jnp.sum(s) for s in final)
        return loss, (y, tuple(final))

    with axkern.use(interpret=True):
        got = jax.jit(lambda a, seg: f(a, seg, "pallas_tpu")[1])(a, seg)
        got_grads = jax.jit(lambda a, seg: jax.grad(lambda a: f(a, seg, "pallas_tpu"), has_aux=True)(a)[0])(
            a, seg
        )
    want = jax.jit(lambda a, seg: f(a, seg, "reference")[1])(a, seg)
    want_grads = jax.jit(lambda a, seg: jax.grad(lambda a: f(a, seg, "reference"), has_aux=True)(a)[0])(
        a, seg
    )
    assert_nonfinite_rule(got, want, f"pallas_tpu rotation=kernel {where}", rtol=1e-4)
    assert np.isnan(np.asarray(want[0])).any() or np.isinf(np.asarray(want[0])).any()
    for name in want_grads:  # never a number where the recurrence has none (NaN may reach further)
        g, w = np.asarray(got_grads[name]), np.asarray(want_grads[name])
        assert (~np.isfinite(g) | np.isfinite(w)).all(), name
