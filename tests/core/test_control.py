"""`core.control.flat_cond`: `lax.cond`'s values, gradients and batching, with every array crossing
the conditional 1-D in the compiled program (what keeps a branch's layouts inside it)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from axkern.core import compat
from axkern.core.control import arrays_are_local, flat_cond

SHAPE = re.compile(r"\b(?:pred|s32|u32|f16|bf16|f32|f64)\[([\d,]*)\]")


def _branches(fn, *args):
    """Each conditional of `fn`'s CPU-compiled program: its line and its branch computations'
    headers (parameters and results)."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    headers = {m.group(1): m.group(0) for m in re.finditer(r"^%?([\w.\-]+) \(.*\) -> .*\{$", hlo, re.M)}
    found = []
    for line in hlo.splitlines():
        if " conditional(" not in line:
            continue
        names = re.search(r"branch_computations=\{([^}]*)\}", line).group(1)
        found.append((line, [headers[n.strip().lstrip("%")] for n in names.split(",")]))
    return found


def _ranks(text):
    return {len([d for d in m.split(",") if d]) for m in SHAPE.findall(text)}


def _transposing(x, y):
    return jnp.transpose(x, (1, 0, 2)) * 2, (y[0] + 1, None)


def _other(x, y):
    return jnp.transpose(x, (1, 0, 2)) - 1, (jnp.sin(y[0]), None)


@pytest.mark.parametrize("pred", [True, False])
def test_flat_cond_gives_lax_conds_values(pred):
    x = jnp.arange(24.0).reshape(2, 3, 4)
    y = (jnp.float32(0.5), None)
    got = jax.jit(lambda p, x, y: flat_cond(p, _transposing, _other, x, y, flatten=True))(pred, x, y)
    want = lax.cond(pred, _transposing, _other, x, y)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_every_array_crosses_the_compiled_conditional_one_dimensional():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    fn = lambda p, x, s: flat_cond(p, _transposing, _other, x, (s, None), flatten=True)  # noqa: E731
    (line, headers), *rest = _branches(fn, True, x, jnp.float32(0.5))
    assert not rest
    assert _ranks(line.split(" conditional(")[0]) == {1}, line  # the results
    for header in headers:  # each branch's parameters and results
        assert _ranks(header) == {1}, header
    # an array the branches close over crosses 1-D too
    closing = lambda p, x, s: flat_cond(  # noqa: E731
        p, lambda: _transposing(x, (s, None)), lambda: _other(x, (s, None)), flatten=True
    )
    (line, headers), *_ = _branches(closing, True, x, jnp.float32(0.5))
    assert _ranks(line.split(" conditional(")[0]) == {1}, line
    for header in headers:
        assert _ranks(header) == {1}, header
    np.testing.assert_array_equal(
        np.asarray(jax.jit(closing)(False, x, jnp.float32(0.5))[0]), np.asarray(_other(x, (0.5, None))[0])
    )
    # and without flat_cond the same branches take the 3-D array (what the test would catch)
    plain = lambda p, x, s: lax.cond(p, _transposing, _other, x, (s, None))  # noqa: E731
    (_, plain_headers), *_ = _branches(plain, True, x, jnp.float32(0.5))
    assert 3 in _ranks(plain_headers[0])


def test_flat_cond_differentiates_and_batches_as_lax_cond():
    x = jnp.sin(jnp.arange(24.0)).reshape(2, 3, 4)

    def loss(cond, p, x, s):
        a, (b, _) = cond(p, _transposing, _other, x, (s, None))  # flat_cond: flatten=True below
        return jnp.sum(a**2) + b**2

    for p in (True, False):
        flat = functools.partial(flat_cond, flatten=True)
        got = jax.grad(functools.partial(loss, flat, p), argnums=(0, 1))(x, jnp.float32(0.3))
        want = jax.grad(functools.partial(loss, lax.cond, p), argnums=(0, 1))(x, jnp.float32(0.3))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    preds = jnp.array([True, False])
    xs = jnp.stack([x, x + 1])
    got = jax.vmap(
        lambda p, x: flat_cond(p, _transposing, _other, x, (jnp.float32(0.5), None), flatten=True)
    )(preds, xs)
    for i in range(2):
        want = lax.cond(bool(preds[i]), _transposing, _other, xs[i], (jnp.float32(0.5), None))
        np.testing.assert_array_equal(np.asarray(got[0][i]), np.asarray(want[0]))


def test_the_attention_guards_conditionals_take_and_give_one_dimensional_arrays():
    # the guard of `cudnn` and `mosaic_gpu` (`where_finite`), forward and backward, around a stand-in
    # kernel and a fallback that transposes its inputs as `pallas_gpu` does
    from axkern import masks, positional
    from axkern.ops.attention.common import where_finite

    ref = functools.partial(positional.attention, mask=masks.Causal(), implementation="reference")

    def safe(q, k, v, sinks):
        heads_first = lambda a: jnp.transpose(a, (0, 2, 1, 3))  # noqa: E731
        return heads_first(jnp.tanh(heads_first(ref(q, k, v))))

    guarded = functools.partial(where_finite, lambda q, k, v, sinks: ref(q, k, v), safe)
    q = jnp.sin(jnp.arange(1 * 24 * 2 * 16, dtype=jnp.float32)).reshape(1, 24, 2, 16)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    local = lambda f: compat.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())  # noqa: E731 - flattening is local
    for fn in (guarded, lambda q, k, v: jax.vjp(guarded, q, k, v)[1](q)):
        conds = [c for c in _branches(local(fn), q, q, q) if "axkern.attention" not in c[0]]
        assert conds
        for line, headers in conds:
            assert _ranks(line.split(" conditional(")[0]) == {1}, line
            for header in headers:
                assert _ranks(header) == {1}, header


def test_it_flattens_only_where_arrays_are_local():
    # the tests run on 8 CPU devices: under plain jit an array may be sharded (flattening it
    # would gather it), so the default is lax.cond; inside shard_map over every mesh axis each
    # array is one device's block, and it flattens, operands of different varying axes included
    assert jax.device_count() > 1 and not arrays_are_local()
    x = jnp.arange(24.0).reshape(2, 3, 4)
    (_, headers), *_ = _branches(
        lambda p, x: flat_cond(p, _transposing, _other, x, (x[0, 0, 0], None)), True, x
    )
    assert 3 in _ranks(headers[0])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    seen = []

    def body(p, x, w):  # x varies over a and b, w over b only
        seen.append(arrays_are_local())
        return flat_cond(p, lambda x, w: (x * 2, w * 3), lambda x, w: (x - 1, w + 1), x, w)

    run = compat.shard_map(
        body, mesh=mesh, in_specs=(P(), P("a", None, "b"), P("b")), out_specs=(P("a", None, "b"), P("b"))
    )
    xs, ws = jnp.arange(4.0 * 3 * 8).reshape(4, 3, 8), jnp.arange(8.0)
    for p in (True, False):
        got = jax.jit(run)(p, xs, ws)
        want = (xs * 2, ws * 3) if p else (xs - 1, ws + 1)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert seen and all(seen)
    grads = jax.grad(lambda x, w: sum(jnp.sum(o) for o in run(True, x, w)), argnums=(0, 1))(xs, ws)
    np.testing.assert_allclose(np.asarray(grads[0]), 2.0)
    np.testing.assert_allclose(np.asarray(grads[1]), 3.0)


def test_branches_of_different_shapes_are_refused():
    x = jnp.zeros((2, 3))
    with pytest.raises(TypeError, match="branches give different results"):
        flat_cond(True, lambda x: x, lambda x: x.T, x, flatten=True)


def test_the_attention_guard_differentiates_inside_shard_map_with_heads_and_sinks_sharded():
    # as the named layer calls it under an axis mapping: q, k, v split over batch and heads,
    # the sinks over heads (operands varying over different mesh axes), and MQA's shared k, v
    from axkern import masks, positional
    from axkern.ops.attention.common import where_finite

    def ref(q, k, v, sinks):
        return positional.attention(q, k, v, mask=masks.Causal(), sinks=sinks, implementation="reference")

    guarded = functools.partial(where_finite, ref, ref)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("d", "m"))
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, 12, 4, 8))
    sinks = jax.random.normal(keys[3], (4,))
    for kv_heads, kv_spec in ((4, P("d", None, "m", None)), (1, P("d", None, None, None))):
        k, v = (jax.random.normal(kk, (2, 12, kv_heads, 8)) for kk in keys[1:3])
        specs = (P("d", None, "m", None), kv_spec, kv_spec, P("m"))
        sharded = compat.shard_map(guarded, mesh=mesh, in_specs=specs, out_specs=P("d", None, "m", None))
        loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
        got = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
        want = jax.value_and_grad(loss(ref), argnums=(0, 1, 2, 3))(q, k, v, sinks)
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
        for g, w in zip(got[1], want[1], strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
