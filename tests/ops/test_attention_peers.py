"""The bench's peers of attention. tokamax: the masks it takes, and (where tokamax imports) that the
case's `q, k, v` reach tokamax in its layout, forward and backward. JAX's splash attention (the
TPU presets' peers): the masks it takes, the block sizes swept, and in interpret mode its values
equal to ours, also as rows of the bench (its default and the fastest of a sweep)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import masks
from axkern.ops.attention import arg_specs
from axkern.ops.attention.api import attention_positional


def test_masks_map_to_tokamax_keywords_only_where_exact():
    assert arg_specs.tokamax_mask(masks.Full()) == {}
    assert arg_specs.tokamax_mask(masks.Causal()) == {"is_causal": True}
    assert arg_specs.tokamax_mask(masks.SlidingWindow(1024)) == {"local_window_size": (1023, 0)}
    ids = jnp.zeros((2, 8), jnp.int32)
    for mask in (
        masks.Causal(offset=3),
        masks.SlidingWindow(4, offset=1),
        masks.Causal() & masks.Segments(ids, ids),
    ):
        assert isinstance(arg_specs.tokamax_mask(mask), str)


def test_every_case_carries_both_tokamax_peers():
    for c in arg_specs.cases(preset="h200"):
        assert set(arg_specs.TOKAMAX_PEERS) <= set(c.peers)
    docs = next(c for c in arg_specs.cases(preset="h200") if "docs" in c.label)
    assert all(isinstance(docs.peers[name], str) for name in arg_specs.TOKAMAX_PEERS)


@pytest.mark.parametrize("mask", [masks.Causal(), masks.SlidingWindow(5), masks.Full()], ids=repr)
def test_tokamax_xla_equals_axkern_xla_on_the_bench_layout(mask):
    pytest.importorskip("tokamax")
    peer = arg_specs.tokamax_peer("xla", mask)  # the peers' code with tokamax's CPU implementation
    assert callable(peer), peer
    q, k, v = arg_specs.case(2, 24, 4, 2, 16, dtype="float32").make(jax.random.PRNGKey(0))
    ct = jax.random.normal(jax.random.PRNGKey(1), q.shape, q.dtype)

    def ours(q, k, v):
        return attention_positional(q, k, v, mask=mask, implementation="xla")

    got, pull = jax.vjp(jax.jit(peer), q, k, v)
    want, pull_want = jax.vjp(ours, q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(pull(ct), pull_want(ct), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


# -- JAX's splash attention: the TPU presets' peers --------------------------------------------


def test_masks_map_to_splash_only_where_exact():
    ids = jnp.zeros((2, 8), jnp.int32)
    for mask in (
        masks.Causal(),
        masks.SlidingWindow(4, offset=1),
        masks.Full(),
        masks.Causal() & masks.Segments(ids, ids),
    ):
        static, segments = arg_specs.splash_mask(mask)
        assert callable(static) and (segments is None) == ("Segments" not in repr(mask))
    for mask in (
        masks.Causal() | masks.SlidingWindow(4),
        masks.PrefixLM(jnp.ones((2,), jnp.int32)),
        masks.Segments(ids, ids) & masks.Segments(ids, ids),
    ):
        assert isinstance(arg_specs.splash_mask(mask), str)


def test_the_splash_sweep_keeps_sizes_that_divide_the_length(monkeypatch):
    monkeypatch.delenv("AXKERN_SPLASH_SWEEP", raising=False)
    assert [label for label, _ in arg_specs.splash_sweep(8192)] == [
        "q512 kv512",
        "q512 kv1024",
        "q1024 kv512",
        "q1024 kv1024",
    ]
    assert arg_specs.splash_sweep(1536) == [("q512 kv512", (512, 512, 512))]
    monkeypatch.setenv("AXKERN_SPLASH_SWEEP", "128/256/128 256/256")
    assert arg_specs.splash_sweep(256) == [
        ("q128 kv256 kvc128", (128, 256, 128)),
        ("q256 kv256", (256, 256, 256)),
    ]
    for bad in ("128", "128/256/96", "a/b"):
        monkeypatch.setenv("AXKERN_SPLASH_SWEEP", bad)
        with pytest.raises(ValueError, match="splash sweep"):
            arg_specs.splash_sweep(256)


def test_the_tpu_presets_time_splash_default_and_best_against_xla(monkeypatch):
    monkeypatch.delenv("AXKERN_SPLASH_SWEEP", raising=False)
    for preset in ("tpu", "tpu_shapes"):
        for c in arg_specs.cases(preset=preset):
            assert set(c.peers) == {"splash", "splash_best"} and c.reference == "xla"
            assert len(c.peers["splash_best"].variants) == 4
            assert c.flops_forward > 0 and c.bytes_forward > 0 and c.bytes_backward > 0
    q, k, v = arg_specs.case(1, 256, 2, 1, 64, dtype="float32").make(jax.random.PRNGKey(0))
    with pytest.raises(axkern.Unsupported, match="runs on a TPU"):
        arg_specs.splash_peer(masks.Causal())(q, k, v)  # off a TPU, not in interpret mode


def _packed_ids(batch, length):
    """Documents of different lengths in each batch row."""
    return jnp.stack([jnp.arange(length, dtype=jnp.int32) // (100 + 30 * b) for b in range(batch)])


@pytest.mark.parametrize("name", ["causal", "window", "docs"])
def test_splash_in_interpret_mode_equals_axkern_xla(name):
    # the mask mapping's semantics: splash's output equals ours on several blocks of 128, where a
    # window and documents leave blocks empty, partial and full
    batch, length = 2, 256
    mask = {
        "causal": masks.Causal(),
        "window": masks.SlidingWindow(100),
        "docs": masks.Causal() & masks.Segments(_packed_ids(batch, length), _packed_ids(batch, length)),
    }[name]
    q, k, v = arg_specs.case(batch, length, 4, 2, 64, dtype="float32").make(jax.random.PRNGKey(0))
    peer = arg_specs.splash_peer(mask)  # splash's default block sizes: 128
    with axkern.use(interpret=True):
        got = jax.jit(peer)(q, k, v)
    want = attention_positional(q, k, v, mask=mask, implementation="xla")
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_splash_best_is_timed_and_checked_as_a_row_of_the_bench(monkeypatch):
    # the bench's row of splash's fastest sweep entry, forward and backward, checked against xla
    # (GQA, packed documents, a key block of two sub-blocks)
    from axkern.bench import measure

    monkeypatch.setenv("AXKERN_SPLASH_SWEEP", "128/256/128 96/96")
    ids = _packed_ids(1, 256)
    mask = masks.Causal() & masks.Segments(ids, ids)
    c = arg_specs.case(1, 256, 2, 1, 64, dtype="float32", tpu=True)
    c = dataclasses.replace(
        c,
        forward=lambda impl, q, k, v: attention_positional(q, k, v, mask=mask, implementation=impl),
        peers=arg_specs.splash_peers(mask, 256),
    )
    with axkern.use(interpret=True):
        (row,) = measure(c, ["peer:splash_best"], passes=("fwd+bwd",), repeats=1)
    assert row.ms is not None and row.max_rel_error < 1e-5, row
    assert row.note.startswith("q128 kv256 kvc128, fastest of 1: q128 kv256 kvc128 ")  # 96 does not divide


@pytest.mark.parametrize("name", ["causal", "full", "window1024", "docs1024"])
@pytest.mark.parametrize("length", [700, 2500])
def test_the_cases_count_the_visible_pairs_of_their_masks(name, length):
    mask = arg_specs._mask(name, 2, length)
    dense = np.asarray(mask.dense(length, length))
    assert arg_specs.visible_pairs(name, length) == dense.sum() // (2 if mask.batch_size() else 1)


def test_splash_lowers_for_the_tpu_at_the_presets_shape(monkeypatch):
    # the peers as the chip runs them (no interpret mode), forward and backward, lowered for a TPU:
    # B2 S8192 H32 D128, packed documents, splash's default and 1024-blocks
    from axkern.core import backend

    monkeypatch.delenv("AXKERN_SPLASH_SWEEP", raising=False)
    monkeypatch.setattr(backend, "platform", lambda: "tpu")
    (c,) = [c for c in arg_specs.cases(preset="tpu") if "docs1024" in c.label]
    q, k, v = c.shapes()
    for peer in (c.peers["splash"], c.peers["splash_best"].variants["q1024 kv1024"]):
        jax.jit(lambda ct, q, k, v, peer=peer: jax.vjp(peer, q, k, v)[1](ct)).trace(q, q, k, v).lower(
            lowering_platforms=("tpu",)
        )
