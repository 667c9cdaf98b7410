"""fused_cross_entropy, named layer: axes in any order, errors, transforms, HLO, and sharding."""

from __future__ import annotations

import re

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import axkern
from axkern.positional import fused_cross_entropy
from tests.cases.fused_cross_entropy import make


def ce_positional(*args, **kwargs):
    """Per-token `(loss, lse)`."""
    return fused_cross_entropy(*args, reduction=None, return_lse=True, **kwargs)


Batch, Pos, Embed, Vocab = (
    hax.Axis("batch", 2),
    hax.Axis("position", 12),
    hax.Axis("embed", 16),
    hax.Axis("vocab", 64),
)


def inputs(seed=0, dtype=jnp.float32):
    arrays, _ = make(seed, Batch.size * Pos.size, Embed.size, Vocab.size, dtype)
    x, w, labels = arrays["x"], arrays["w"], arrays["labels"]
    return (
        hax.named(x.reshape(Batch.size, Pos.size, Embed.size), (Batch, Pos, Embed)),
        hax.named(w, (Embed, Vocab)),
        hax.named(labels.reshape(Batch.size, Pos.size), (Batch, Pos)),
    )


def flat(x, w, labels):
    return x.array.reshape(-1, Embed.size), w.array, labels.array.reshape(-1)


def test_matches_positional_with_every_reduction():
    x, w, labels = inputs()
    loss, lse = ce_positional(*flat(x, w, labels))
    np.testing.assert_allclose(axkern.fused_cross_entropy(x, w, labels), loss.mean(), rtol=1e-6)
    np.testing.assert_allclose(
        axkern.fused_cross_entropy(x, w, labels, reduction="sum"), loss.sum(), rtol=1e-6
    )
    per, lse_named = axkern.fused_cross_entropy(x, w, labels, reduction=None, return_lse=True)
    assert per.axes == (Batch, Pos) and lse_named.axes == (Batch, Pos)
    np.testing.assert_allclose(per.array.reshape(-1), loss, rtol=1e-6)
    np.testing.assert_allclose(lse_named.array.reshape(-1), lse, rtol=1e-6)


def test_axis_order_does_not_matter():
    x, w, labels = inputs()
    want = axkern.fused_cross_entropy(x, w, labels, reduction=None)
    got = axkern.fused_cross_entropy(
        x.rearrange((Embed, Pos, Batch)),
        w.rearrange((Vocab, Embed)),
        labels.rearrange((Pos, Batch)),
        reduction=None,
    )
    assert got.axes == (Pos, Batch)  # x's batch axes, in x's order
    np.testing.assert_allclose(got.rearrange((Batch, Pos)).array, want.array, rtol=1e-6)


def test_extra_batch_axes_and_axis_objects():
    x, w, labels = inputs()
    Micro = hax.Axis("micro", 3)
    x3 = hax.named(jnp.stack([x.array] * 3), (Micro, Batch, Pos, Embed))
    l3 = hax.named(jnp.stack([labels.array] * 3), (Micro, Batch, Pos))
    got = axkern.fused_cross_entropy(x3, w, l3, Embed=Embed, Vocab=Vocab, reduction=None)
    assert got.axes == (Micro, Batch, Pos)
    want = axkern.fused_cross_entropy(x, w, labels, reduction=None)
    for i in range(3):
        np.testing.assert_allclose(got.array[i], want.array, rtol=1e-6)


def test_other_axis_names():
    x, w, labels = inputs()
    H, V = hax.Axis("hidden", 16), hax.Axis("tokens_vocab", 64)
    got = axkern.fused_cross_entropy(
        x.rename({"embed": "hidden"}),
        w.rename({"embed": "hidden", "vocab": "tokens_vocab"}),
        labels,
        Embed="hidden",
        Vocab=V,
    )
    np.testing.assert_allclose(got, axkern.fused_cross_entropy(x, w, labels), rtol=1e-6)
    assert H.size == Embed.size


def test_where_over_a_subset_of_batch_axes_and_ignore_index():
    x, w, labels = inputs()
    keep_pos = hax.named(jnp.arange(Pos.size) % 3 != 0, (Pos,))
    labels = labels.at[{"batch": 0, "position": 1}].set(-100)
    per = axkern.fused_cross_entropy(x, w, labels, where=keep_pos, ignore_index=-100, reduction=None)
    keep = np.broadcast_to(np.asarray(keep_pos.array), (2, 12)).copy()
    keep[0, 1] = False
    assert np.all(per.array[~keep] == 0) and np.all(per.array[keep] > 0)
    mean = axkern.fused_cross_entropy(x, w, labels, where=keep_pos, ignore_index=-100)
    np.testing.assert_allclose(mean, per.array.sum() / keep.sum(), rtol=1e-6)
    nothing = hax.named(jnp.zeros(Pos.size, bool), (Pos,))
    assert float(axkern.fused_cross_entropy(x, w, labels, where=nothing)) == 0.0  # mean of no tokens


def test_errors_name_the_axis_and_list_what_is_there():
    x, w, labels = inputs()
    with pytest.raises(
        ValueError, match=r"x has no axis 'embd' \(Embed\); its axes are \(batch=2, position=12, embed=16\)"
    ):
        axkern.fused_cross_entropy(x, w, labels, Embed="embd")
    with pytest.raises(
        ValueError, match=r"lm_head has no axis 'vocabulary' \(Vocab\); its axes are \(embed=16, vocab=64\)"
    ):
        axkern.fused_cross_entropy(x, w, labels, Vocab="vocabulary")
    with pytest.raises(
        ValueError, match=r"labels's axes \(batch=2\) must be x's batch axes \(batch=2, position=12\)"
    ):
        axkern.fused_cross_entropy(x, w, labels["position", 0])
    with pytest.raises(
        ValueError,
        match=r"lm_head's axes \(batch=2, embed=16, vocab=64\) must be Embed \+ Vocab \(embed=16, vocab=64\)",
    ):
        axkern.fused_cross_entropy(x, hax.named(jnp.zeros((2, 16, 64)), (Batch, Embed, Vocab)), labels)
    with pytest.raises(
        ValueError,
        match=r"lm_head's axes \(embed=8, vocab=64\) must be Embed \+ Vocab \(embed=16, vocab=64\)",
    ):
        axkern.fused_cross_entropy(x, hax.named(jnp.zeros((8, 64)), ("embed", "vocab")), labels)
    with pytest.raises(ValueError, match="reduction must be"):
        axkern.fused_cross_entropy(x, w, labels, reduction="max")
    with pytest.raises(ValueError, match="where's axes .* must be a subset"):
        axkern.fused_cross_entropy(x, w, labels, where=hax.named(jnp.ones(16, bool), (Embed,)))
    with pytest.raises(TypeError, match="x must be a haliax NamedArray"):
        axkern.fused_cross_entropy(x.array, w, labels)
    with pytest.raises(Exception, match="labels"):  # jaxtyping: float labels
        axkern.fused_cross_entropy(x, w, hax.named(labels.array.astype(jnp.float32), labels.axes))


def test_jit_grad_filter_jit_and_vmap():
    x, w, labels = inputs()

    def loss(x, w):
        return axkern.fused_cross_entropy(x, w, labels)

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert isinstance(g[0], hax.NamedArray) and g[0].axes == x.axes and g[1].axes == w.axes
    gp = jax.grad(lambda a, b: jnp.mean(ce_positional(a, b, flat(x, w, labels)[2])[0]), argnums=(0, 1))(
        *flat(x, w, labels)[:2]
    )
    np.testing.assert_allclose(g[0].array.reshape(-1, 16), gp[0], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(g[1].array, gp[1], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(eqx.filter_jit(loss)(x, w), loss(x, w), rtol=1e-6)
    value, grads = eqx.filter_value_and_grad(lambda x: loss(x, w))(x)
    assert grads.axes == x.axes
    per_batch = hax.vmap(lambda xb, lb: axkern.fused_cross_entropy(xb, w, lb, reduction="sum"), Batch)(
        x, labels
    )
    np.testing.assert_allclose(
        jnp.asarray(per_batch).sum(), axkern.fused_cross_entropy(x, w, labels, reduction="sum"), rtol=1e-6
    )


def _hlo(lowered) -> str:
    text = lowered.as_text()
    text = re.sub(r"loc\([^)]*\)", "", text)
    text = re.sub(r"#loc\d*( = .*)?", "", text)
    text = re.sub(r"@\w+", "@f", text)
    text = re.sub(r"mhlo\.frontend_attributes = \{[^}]*\}", "", text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


def test_named_call_lowers_to_the_same_hlo_as_the_positional_call():
    x, w, labels = inputs()
    named = jax.jit(lambda x, w, l: axkern.fused_cross_entropy(x, w, l, reduction=None).array)
    positional = jax.jit(lambda x, w, l: ce_positional(x.reshape(-1, 16), w, l.reshape(-1))[0].reshape(2, 12))
    a = _hlo(named.lower(x, w, labels))
    b = _hlo(positional.lower(x.array, w.array, labels.array))
    assert a == b


@pytest.mark.parametrize(
    "mesh_shape,mapping",
    [
        ((8, 1), {"position": "data"}),  # data parallel over one batch axis
        ((2, 4), {"batch": "data", "position": "model"}),  # two batch axes on two mesh axes
        ((1, 8), {"vocab": "model"}),  # vocab parallel
        ((2, 4), {"batch": "data", "vocab": "model"}),  # both
        ((2, 4), {"batch": "data", "vocab": "model", "embed": "model"}),  # a mapped embed is gathered
    ],
)
@pytest.mark.parametrize(
    "options",
    [{}, {"label_smoothing": 0.1, "logsumexp_weight": 1e-2, "logits_soft_cap": 3.0, "ignore_index": -100}],
)
def test_sharded_equals_unsharded(mesh_shape, mapping, options):
    assert len(jax.devices()) >= 8, "conftest asks XLA for 8 host devices"
    x, w, labels = inputs(seed=4)
    Pos8 = hax.Axis("position", 16)
    x = hax.named(jnp.concatenate([x.array, x.array[:, :4]], axis=1), (Batch, Pos8, Embed))
    labels = hax.named(jnp.concatenate([labels.array, labels.array[:, :4]], axis=1), (Batch, Pos8))
    if "ignore_index" in options:
        labels = labels.at[{"batch": 1, "position": 3}].set(-100)

    def f(x, w):
        per, lse = axkern.fused_cross_entropy(x, w, labels, reduction=None, return_lse=True, **options)
        return hax.sum(per).array + 0.1 * hax.sum(lse).array, (per, lse)

    want_val, want_grad = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
        fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
        got_val, got_grad = fn(x, w)
        hlo = fn.lower(x, w).as_text()
    assert "shard_map" in hlo or "sdy.manual_computation" in hlo or "custom_call @Sharding" in hlo
    for a, b in zip(
        jax.tree.leaves((got_val, got_grad)), jax.tree.leaves((want_val, want_grad)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_no_mesh_or_no_mapped_axis_means_no_shard_map():
    x, w, labels = inputs()
    with hax.axis_mapping({"batch": "data"}):  # a mapping but no mesh
        hlo = jax.jit(lambda x, w: axkern.fused_cross_entropy(x, w, labels)).lower(x, w).as_text()
    assert "manual_computation" not in hlo and "shard_map" not in hlo


def test_mapped_axis_must_divide():
    x, w, labels = inputs()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"position": "model"}):
        with pytest.raises(ValueError, match="x's axis position=12 is mapped to mesh axis 'model' of size 8"):
            jax.jit(lambda x, w: axkern.fused_cross_entropy(x, w, labels))(x, w)


def test_explain_named():
    x, w, labels = inputs()
    d = axkern.explain(axkern.fused_cross_entropy, x, w, labels, implementation="reference")
    assert d.implementation == "reference" and d.spec.dim("tokens") == 24
    d = axkern.explain(axkern.fused_cross_entropy, x, w, labels, reduction=None)
    assert d.implementation == "xla" and "fused_cross_entropy: xla" in str(d)
    # a reduced loss runs the op that forms its gradients in the forward ...
    d = axkern.explain(axkern.fused_cross_entropy, x, w, labels)
    assert d.op == "fused_cross_entropy_loss" and d.implementation == "xla"
    with axkern.use(fused_cross_entropy="reference"):
        d = axkern.explain(axkern.fused_cross_entropy, x, w, labels)
    assert d.op == "fused_cross_entropy_loss" and d.implementation == "reference"
    # ... unless the request names an implementation only the per-token op has
    d = axkern.explain(axkern.fused_cross_entropy, x, w, labels, implementation=("pallas_gpu", "xla"))
    assert d.op == "fused_cross_entropy" and d.implementation == "xla"  # in an order: no interpret mode
    assert "runs on gpu, not cpu" in d.rejected[0].reason
    with axkern.use(interpret=True):
        d = axkern.explain(axkern.fused_cross_entropy, x, w, labels, implementation=("pallas_gpu", "xla"))
    assert d.op == "fused_cross_entropy" and d.implementation == "pallas_gpu" and d.interpret
    # pallas_tpu serves both ops: a reduced loss runs the loss's TPU kernels, per-token losses the other
    with axkern.use(fused_cross_entropy="pallas_tpu"), axkern.use(interpret=True):
        d = axkern.explain(axkern.fused_cross_entropy, x, w, labels)
        per_token = axkern.explain(axkern.fused_cross_entropy, x, w, labels, reduction=None)
    assert d.op == "fused_cross_entropy_loss" and d.implementation == "pallas_tpu" and d.interpret
    assert per_token.op == "fused_cross_entropy" and per_token.implementation == "pallas_tpu"


def test_vocab_and_batch_on_the_same_mesh_axis_is_an_error():
    x, w, labels = inputs()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": "data", "vocab": "data"}):
        with pytest.raises(ValueError, match=r"axes 'batch' and 'vocab' are both mapped to mesh axis 'data'"):
            jax.jit(lambda x, w: axkern.fused_cross_entropy(x, w, labels))(x, w)
