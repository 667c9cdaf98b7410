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

from axkern.core.control import flat_cond

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
    got = jax.jit(flat_cond, static_argnums=(1, 2))(pred, _transposing, _other, x, y)
    want = lax.cond(pred, _transposing, _other, x, y)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_every_array_crosses_the_compiled_conditional_one_dimensional():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    fn = lambda p, x, s: flat_cond(p, _transposing, _other, x, (s, None))  # noqa: E731
    (line, headers), *rest = _branches(fn, True, x, jnp.float32(0.5))
    assert not rest
    assert _ranks(line.split(" conditional(")[0]) == {1}, line  # the results
    for header in headers:  # each branch's parameters and results
        assert _ranks(header) == {1}, header
    # an array the branches close over crosses 1-D too
    closing = lambda p, x, s: flat_cond(p, lambda: _transposing(x, (s, None)), lambda: _other(x, (s, None)))  # noqa: E731
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
        a, (b, _) = cond(p, _transposing, _other, x, (s, None))
        return jnp.sum(a**2) + b**2

    for p in (True, False):
        got = jax.grad(functools.partial(loss, flat_cond, p), argnums=(0, 1))(x, jnp.float32(0.3))
        want = jax.grad(functools.partial(loss, lax.cond, p), argnums=(0, 1))(x, jnp.float32(0.3))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    preds = jnp.array([True, False])
    xs = jnp.stack([x, x + 1])
    got = jax.vmap(lambda p, x: flat_cond(p, _transposing, _other, x, (jnp.float32(0.5), None)))(preds, xs)
    for i in range(2):
        want = lax.cond(bool(preds[i]), _transposing, _other, xs[i], (jnp.float32(0.5), None))
        np.testing.assert_array_equal(np.asarray(got[0][i]), np.asarray(want[0]))


def test_the_attention_guards_conditionals_take_and_give_one_dimensional_arrays():
    # the guard of `cudnn` and `mosaic_gpu` (`where_finite`), forward and backward, around a stand-in
    # kernel and a fallback that transposes its inputs as `pallas_gpu` does
    from axkern import masks
    from axkern import positional as P
    from axkern.ops.attention.common import where_finite

    ref = functools.partial(P.attention, mask=masks.Causal(), implementation="reference")

    def safe(q, k, v, sinks):
        heads_first = lambda a: jnp.transpose(a, (0, 2, 1, 3))  # noqa: E731
        return heads_first(jnp.tanh(heads_first(ref(q, k, v))))

    guarded = functools.partial(where_finite, lambda q, k, v, sinks: ref(q, k, v), safe)
    q = jnp.sin(jnp.arange(1 * 24 * 2 * 16, dtype=jnp.float32)).reshape(1, 24, 2, 16)
    for fn in (guarded, lambda q, k, v: jax.vjp(guarded, q, k, v)[1](q)):
        conds = [c for c in _branches(fn, q, q, q) if "axkern.attention" not in c[0]]
        assert conds
        for line, headers in conds:
            assert _ranks(line.split(" conditional(")[0]) == {1}, line
            for header in headers:
                assert _ranks(header) == {1}, header
