"""Named-layer plumbing: axis resolution and the errors users see."""

from __future__ import annotations

import haliax as hax
import jax.numpy as jnp
import numpy as np
import pytest

from axkern.core import named

B, P, E = hax.Axis("batch", 2), hax.Axis("position", 3), hax.Axis("embed", 4)


def arr(*axes):
    return hax.named(
        jnp.arange(np.prod([a.size for a in axes]), dtype=jnp.float32).reshape([a.size for a in axes]), axes
    )


def test_resolve_by_name_or_axis():
    x = arr(B, P, E)
    assert named.resolve("op", "x", x, "embed", "Embed") == E
    assert named.resolve("op", "x", x, E, "Embed") == E


def test_resolve_errors_name_the_axis_and_list_the_present_ones():
    x = arr(B, P, E)
    with pytest.raises(
        ValueError, match=r"op: x has no axis 'embd' \(Embed\); its axes are \(batch=2, position=3, embed=4\)"
    ):
        named.resolve("op", "x", x, "embd", "Embed")
    with pytest.raises(ValueError, match="Embed=.*embed.*has size 4"):
        named.resolve("op", "x", x, hax.Axis("embed", 5), "Embed")
    with pytest.raises(TypeError, match="must be an axis name"):
        named.resolve("op", "x", x, 3, "Embed")


def test_require_named():
    with pytest.raises(TypeError, match="x must be a haliax NamedArray, got ArrayImpl"):
        named.require_named("op", "x", jnp.zeros(3))
    named.require_named("op", "where", None, optional=True)


def test_ordered_and_match_axes():
    x = arr(P, B)
    out = named.match_axes("op", "labels", x, (B, P), "x's batch axes")
    np.testing.assert_array_equal(out, x.array.T)
    with pytest.raises(
        ValueError, match=r"labels's axes \(position=3, batch=2\) must be x's batch axes \(batch=2\)"
    ):
        named.match_axes("op", "labels", x, (B,), "x's batch axes")


def test_broadcast_subset():
    w = arr(P)
    out = named.broadcast_subset("op", "where", w, (B, P), "x's batch axes")
    np.testing.assert_array_equal(out, np.broadcast_to(w.array, (2, 3)))
    with pytest.raises(ValueError, match="must be a subset of"):
        named.broadcast_subset("op", "where", arr(E), (B, P), "x's batch axes")


def test_flatten_roundtrip():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    f = named.flatten(x, 2)
    assert f.shape == (6, 4)
    assert named.unflatten(f, (2, 3)).shape == (2, 3, 4)
    assert named.flatten(x, 1) is x
