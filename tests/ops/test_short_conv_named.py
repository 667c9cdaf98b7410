"""short_conv, named layer: axes in any order, errors naming axes and sizes, decode steps, sharding."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import axkern
from axkern.positional import short_conv as conv_positional
from tests.cases.short_conv import make

Batch, Pos, Chan, Width = (
    hax.Axis("batch", 2),
    hax.Axis("position", 32),
    hax.Axis("embed", 12),
    hax.Axis("width", 4),
)
State = hax.Axis("conv_state", 3)


def inputs(seed=0):
    a = make(seed, Batch.size, Pos.size, Chan.size, Width.size, "float32")
    x = hax.named(a["x"], (Batch, Pos, Chan))
    w = hax.named(a["w"], (Width, Chan))
    b = hax.named(a["b"], (Chan,))
    seg = hax.named(a["seg"], (Batch, Pos))
    s0 = hax.named(a["s0"], (Batch, State, Chan))
    return x, w, b, seg, s0


def test_matches_positional_and_keeps_axis_order():
    x, w, b, seg, s0 = inputs()
    y, fin = axkern.short_conv(x, w, bias=b, segment_ids=seg, initial_state=s0, return_final_state=True)
    want, want_fin = conv_positional(
        x.array, w.array, bias=b.array, segment_ids=seg.array, initial_state=s0.array, return_final_state=True
    )
    assert y.axes == x.axes and fin.axes == (Batch, State, Chan)
    np.testing.assert_allclose(y.array, want, rtol=1e-6)
    np.testing.assert_allclose(fin.array, want_fin)
    y2 = axkern.short_conv(
        x.rearrange((Chan, Batch, Pos)),
        w.rearrange((Chan, Width)),
        bias=b,
        segment_ids=seg.rearrange((Pos, Batch)),
        initial_state=s0.rearrange((Chan, State, Batch)),
    )
    assert y2.axes == (Chan, Batch, Pos)
    np.testing.assert_allclose(y2.rearrange(x.axes).array, want, rtol=1e-6)


def test_no_batch_axes_and_two_batch_axes():
    x, w, *_ = inputs()
    y = axkern.short_conv(x["batch", 0], w)
    np.testing.assert_allclose(y.array, conv_positional(x.array[:1], w.array)[0], rtol=1e-6)
    Micro = hax.Axis("micro", 3)
    x3 = hax.named(jnp.stack([x.array] * 3), (Micro, Batch, Pos, Chan))
    y3 = axkern.short_conv(x3, w, activation="silu")
    np.testing.assert_allclose(y3.array[1], axkern.short_conv(x, w, activation="silu").array, rtol=1e-6)


def test_errors_name_axes_and_sizes():
    x, w, b, seg, s0 = inputs()
    with pytest.raises(
        ValueError, match=r"x has no axis 'pos' \(Pos\); its axes are \(batch=2, position=32, embed=12\)"
    ):
        axkern.short_conv(x, w, Pos="pos")
    with pytest.raises(ValueError, match="width must be in 1..8, got 9"):
        axkern.short_conv(x, hax.zeros((hax.Axis("width", 9), Chan)))
    with pytest.raises(
        ValueError, match=r"weight's axes \(width=4, embed=5\) must be Width \+ Channel \(width=4, embed=12\)"
    ):
        axkern.short_conv(x, hax.zeros((Width, hax.Axis("embed", 5))))
    with pytest.raises(
        ValueError,
        match=r"segment_ids's axes \(batch=2\) must be x's batch axes \+ Pos \(batch=2, position=32\)",
    ):
        axkern.short_conv(x, w, segment_ids=seg["position", 0])
    with pytest.raises(
        ValueError,
        match=r"initial_state's axis 'conv_state' \(ConvState\) has size 2; it must be 3",
    ):
        axkern.short_conv(x, w, initial_state=s0["conv_state", 1:])


def test_grad_through_named():
    x, w, b, seg, s0 = inputs()
    g = jax.jit(
        jax.grad(
            lambda x, w, s0: hax.sum(axkern.short_conv(x, w, initial_state=s0) ** 2).array, argnums=(0, 1, 2)
        )
    )(x, w, s0)
    assert g[0].axes == x.axes and g[1].axes == w.axes and g[2].axes == s0.axes


def test_named_step_chain():
    x, w, b, _, s0 = inputs()
    full = axkern.short_conv(x, w, bias=b, initial_state=s0, activation="silu")
    state = s0
    for t in range(5):
        y_t, state = axkern.short_conv_step(x["position", t], state, w, bias=b, activation="silu")
        assert y_t.axes == (Batch, Chan) and state.axes == (Batch, State, Chan)
        np.testing.assert_allclose(y_t.array, full["position", t].array, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "mesh_shape,mapping",
    [
        ((2, 4), {"batch": "data"}),  # data parallel
        ((1, 8), {"position": "model"}),  # sequence parallel, halo by ppermute
        ((2, 4), {"embed": "model"}),  # channel parallel
        ((2, 4), {"batch": "data", "position": "model"}),  # both
    ],
)
@pytest.mark.parametrize("with_segments", [False, True])
def test_sharded_equals_unsharded(mesh_shape, mapping, with_segments):
    x, w, b, seg, s0 = inputs(seed=3)
    seg = seg if with_segments else None

    def f(x, w, b, s0):
        y, fin = axkern.short_conv(
            x, w, bias=b, segment_ids=seg, initial_state=s0, activation="silu", return_final_state=True
        )
        return hax.sum(y * y).array + hax.sum(fin * fin).array, (y, fin)

    want = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(x, w, b, s0)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
        fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))
        got = fn(x, w, b, s0)
        hlo = fn.lower(x, w, b, s0).as_text()
    assert "manual_computation" in hlo or "shard_map" in hlo
    if "position" in mapping:
        assert "collective_permute" in hlo or "collective-permute" in hlo
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=2e-5, atol=2e-5)


def test_sequence_shards_shorter_than_the_halo_are_refused():
    x, w, *_ = inputs()
    x = x["position", :16]
    w8 = hax.random.normal(jax.random.PRNGKey(0), (hax.Axis("width", 8), Chan))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"position": "model"}):
        with pytest.raises(
            ValueError, match="leaves 2 positions per shard, fewer than the width - 1 = 7 halo"
        ):
            axkern.short_conv(x, w8)


def test_sequence_parallel_halo_stops_at_an_id_change():
    # shard 2 (positions 8..11) receives positions 5, 6, 7 (ids 0, 1, 1) and starts with id 0:
    # position 5 holds the same id but an earlier segment, so no halo row is read
    x, w, b, _, s0 = inputs(seed=4)
    ids = np.zeros((Batch.size, Pos.size), np.int32)
    ids[:, 6:8] = 1
    ids[:, 20:23] = 2
    runs = np.concatenate(
        [np.zeros((Batch.size, 1), np.int32), np.cumsum(np.diff(ids, axis=1) != 0, axis=1)], 1
    )

    def f(x, w, s0, ids=ids):
        seg = hax.named(jnp.asarray(ids), (Batch, Pos))
        y, fin = axkern.short_conv(x, w, bias=b, segment_ids=seg, initial_state=s0, return_final_state=True)
        return hax.sum(y * y).array + hax.sum(fin * fin).array, (y, fin)

    # the same segments numbered by runs, unsharded
    want = jax.value_and_grad(lambda x, w, s0: f(x, w, s0, runs), argnums=(0, 1, 2), has_aux=True)(x, w, s0)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"position": "model"}):
        got = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(x, w, s0)
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=2e-5, atol=2e-5)
