"""The named layer's mechanism: role tables, the errors users see, caller's axis order, sharding rules."""

from __future__ import annotations

import warnings

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import axkern
from axkern.core import named

B, P, E, V = hax.Axis("batch", 2), hax.Axis("position", 4), hax.Axis("embed", 3), hax.Axis("vocab", 8)

ROLES = named.Roles(
    "op",
    {
        "x": named.Arg(("batch", "Pos", "Embed"), describe="batch axes + Pos + Embed"),
        "w": named.Arg(("Embed", "Vocab")),
        "where": named.Arg(("batch", "Pos"), optional=True, subset=True, describe="x's batch axes + Pos"),
        "k": named.Arg(("batch", "KPos"), optional=True),
    },
    fallbacks={"KPos": "Pos"},
)
SEL = dict(Pos="position", Embed="embed", Vocab="vocab", KPos="key_position")


def arr(*axes, dtype=jnp.float32):
    size = int(np.prod([a.size for a in axes]))
    return hax.named(jnp.arange(size, dtype=dtype).reshape([a.size for a in axes]), axes)


def test_resolve_by_name_or_axis():
    x = arr(B, P, E)
    assert named.resolve("op", "x", x, "embed", "Embed") == E
    assert named.resolve("op", "x", x, E, "Embed") == E
    with pytest.raises(
        ValueError, match=r"op: x has no axis 'embd' \(Embed\); its axes are \(batch=2, position=4, embed=3\)"
    ):
        named.resolve("op", "x", x, "embd", "Embed")
    with pytest.raises(ValueError, match="Embed=.*embed.*has size 3"):
        named.resolve("op", "x", x, hax.Axis("embed", 5), "Embed")
    with pytest.raises(TypeError, match="must be an axis name"):
        named.resolve("op", "x", x, 3, "Embed")


def test_bind_resolves_roles_batch_and_canonical_order():
    x = arr(E, P, B)  # any order
    bound = ROLES.bind({"x": x, "w": arr(V, E)}, **SEL)
    assert bound.batch == (B,) and bound.axis("Vocab") == V
    np.testing.assert_array_equal(bound.data("x"), x.rearrange((B, P, E)).array)
    np.testing.assert_array_equal(bound.data("w"), arr(V, E).array.T)
    assert bound.data("where") is None


def test_bind_errors_name_the_argument_and_the_axes():
    with pytest.raises(TypeError, match="op: x must be a haliax NamedArray, got ArrayImpl"):
        ROLES.bind({"x": jnp.zeros(3), "w": arr(E, V)}, **SEL)
    with pytest.raises(TypeError, match="op: w must be a haliax NamedArray, got NoneType"):
        ROLES.bind({"x": arr(B, P, E)}, **SEL)
    with pytest.raises(
        ValueError, match=r"w's axes \(embed=4, vocab=8\) must be Embed \+ Vocab \(embed=3, vocab=8\)"
    ):
        ROLES.bind({"x": arr(B, P, E), "w": arr(hax.Axis("embed", 4), V)}, **SEL)
    with pytest.raises(
        ValueError, match=r"where's axes \(embed=3\) must be a subset of x's batch axes \+ Pos"
    ):
        ROLES.bind({"x": arr(B, P, E), "w": arr(E, V), "where": arr(E)}, **SEL)


def test_subset_arguments_broadcast_and_fallbacks():
    where = arr(P, dtype=jnp.int32)
    bound = ROLES.bind({"x": arr(B, P, E), "w": arr(E, V), "where": where, "k": arr(B, P)}, **SEL)
    np.testing.assert_array_equal(bound.data("where"), np.broadcast_to(where.array, (2, 4)))
    assert bound.axis("KPos") == P  # no key_position on k: it takes Pos's name


def test_run_flattens_batch_and_returns_the_callers_order():
    Micro = hax.Axis("micro", 3)
    x = arr(E, Micro, P, B)
    bound = ROLES.bind({"x": x, "w": arr(E, V)}, **SEL)
    seen = {}

    def body(ctx, xs, ws, where, k):
        seen["shape"] = xs.shape
        return jnp.einsum("bpe,ev->bpv", xs, ws)

    out = bound.run(body, named.Sharding(), named.Out(("batch", "Pos", "Vocab"), like="x"))
    assert seen["shape"] == (6, 4, 3)  # micro and batch flattened, in the caller's order
    assert [a.name for a in out.axes] == ["micro", "position", "batch", "vocab"]
    want = hax.dot(x, arr(E, V), axis="embed")
    np.testing.assert_allclose(out.array, want.rearrange(out.axes).array)


def test_created_axes_take_the_callers_name_and_check_sizes():
    bound = ROLES.bind({"x": arr(B, P, E), "w": arr(E, V)}, **SEL)
    assert bound.create("State", "my_state", 5) == hax.Axis("my_state", 5)
    with pytest.raises(ValueError, match=r"x's axis 'position' \(Pos\) has size 4; it must be 7"):
        bound.create("Pos", "position", 7)


def test_sharding_rule_checks_the_mapping():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rule = named.Sharding(parallel=("Vocab",))
    x, w = arr(B, P, E), arr(E, V)
    body = lambda ctx, xs, ws, where, k: jnp.einsum("bpe,ev->bpv", xs, ws)  # noqa: E731
    out = named.Out(("batch", "Pos", "Vocab"), like="x")
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": "data", "vocab": "data"}):
        with pytest.raises(ValueError, match="axes 'batch' and 'vocab' are both mapped to mesh axis 'data'"):
            ROLES.bind({"x": x, "w": w}, **SEL).run(body, rule, out)
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"vocab": "model"}):
        with pytest.raises(ValueError, match="w's axis vocab=6 is mapped to mesh axis 'model' of size 4"):
            ROLES.bind({"x": x, "w": arr(E, hax.Axis("vocab", 6))}, **SEL).run(
                body, named.Sharding(parallel=("Pos", "Vocab")), out
            )
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": "data", "vocab": "model"}):
        bound = ROLES.bind({"x": x, "w": w}, **SEL)
        assert bound.sharded(rule)
        got = jax.jit(lambda x, w: ROLES.bind({"x": x, "w": w}, **SEL).run(body, rule, out))(x, w)
    np.testing.assert_allclose(got.array, jnp.einsum("bpe,ev->bpv", x.array, w.array))


def test_named_call_lowers_to_the_positional_hlo():
    Pos, Embed, Width = hax.Axis("position", 16), hax.Axis("embed", 8), hax.Axis("width", 4)
    x = hax.random.normal(jax.random.PRNGKey(0), (B, Pos, Embed))
    w = hax.random.normal(jax.random.PRNGKey(1), (Width, Embed))
    named_hlo = jax.jit(lambda x, w: axkern.short_conv(x, w).array).lower(x, w).as_text()
    positional_hlo = jax.jit(axkern.positional.short_conv).lower(x.array, w.array).as_text()
    strip = lambda t: [l for l in t.splitlines() if "module @" not in l and "loc(" not in l]  # noqa: E731, E741
    assert strip(named_hlo) == strip(positional_hlo)


def test_former_spelling_warns_once_and_both_is_an_error():
    named._warned_aliases.clear()
    x = hax.random.normal(jax.random.PRNGKey(0), (B, E))
    w = hax.random.normal(jax.random.PRNGKey(1), (E, V))
    labels = hax.named(jnp.array([1, 2]), (B,))
    with pytest.warns(
        DeprecationWarning, match="logit_soft_cap= is deprecated, use logits_soft_cap="
    ) as record:
        old = axkern.fused_cross_entropy(x, w, labels, logit_soft_cap=2.0)
    assert record[0].filename == __file__  # the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        axkern.fused_cross_entropy(x, w, labels, logit_soft_cap=2.0)  # once per process
    np.testing.assert_allclose(old, axkern.fused_cross_entropy(x, w, labels, logits_soft_cap=2.0))
    with pytest.raises(TypeError, match="pass logits_soft_cap= only"):
        axkern.fused_cross_entropy(x, w, labels, logit_soft_cap=2.0, logits_soft_cap=3.0)


def test_named_and_positional_share_their_defaults():
    x = hax.random.normal(jax.random.PRNGKey(0), (B, P, E))
    w = hax.random.normal(jax.random.PRNGKey(1), (E, V))
    labels = hax.named(jnp.arange(8).reshape(2, 4) % 8, (B, P))
    flat = (x.array.reshape(8, 3), w.array, labels.array.reshape(8))
    np.testing.assert_allclose(
        axkern.fused_cross_entropy(x, w, labels), axkern.positional.fused_cross_entropy(*flat), rtol=1e-6
    )
    per_token, lse = axkern.fused_cross_entropy(x, w, labels, reduction=None, return_lse=True)
    pl, plse = axkern.positional.fused_cross_entropy(*flat, reduction=None, return_lse=True)
    np.testing.assert_allclose(per_token.array.reshape(8), pl, rtol=1e-6)
    np.testing.assert_allclose(lse.array.reshape(8), plse, rtol=1e-6)
    np.testing.assert_allclose(
        axkern.fused_cross_entropy(x, w, labels, reduction=hax.sum), jnp.sum(pl), rtol=1e-6
    )


def test_flatten_roundtrip():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    f = named.flatten(x, 2)
    assert f.shape == (6, 4)
    assert named.unflatten(f, (2, 3)).shape == (2, 3, 4)
    assert named.flatten(x, 1) is x


def test_review_cases_created_sizes_fallback_names_and_where_dtype():
    bound = ROLES.bind({"x": arr(B, P, E), "w": arr(E, V)}, **SEL)
    with pytest.raises(ValueError, match=r"State=.*but the axis the op creates has size 5"):
        bound.create("State", hax.Axis("state", 4), 5)
    with pytest.raises(ValueError, match=r"k has no axis 'key_position' \(KPos\) nor 'position'"):
        ROLES.bind({"x": arr(B, P, E), "w": arr(E, V), "k": arr(B, hax.Axis("other", 4))}, **SEL)
    x = hax.random.normal(jax.random.PRNGKey(0), (B, E))
    w = hax.random.normal(jax.random.PRNGKey(1), (E, V))
    labels = hax.named(jnp.array([1, 2]), (B,))
    with pytest.raises(TypeError, match="where must be a bool array"):
        axkern.fused_cross_entropy(x, w, labels, where=hax.named(jnp.array([1, 0]), (B,)), return_lse=True)


def test_attention_head_dim_selector_as_an_axis_with_a_wider_v():
    Pos, Heads, D, Dv = (
        hax.Axis("position", 8),
        hax.Axis("heads", 2),
        hax.Axis("head_size", 8),
        hax.Axis("head_size", 16),
    )
    q = hax.random.normal(jax.random.PRNGKey(0), (B, Pos, Heads, D))
    v = hax.random.normal(jax.random.PRNGKey(1), (B, Pos, Heads, Dv))
    out = axkern.attention(q, q, v, HeadDim=D)
    assert out.axes == (B, Pos, Heads, Dv)
