"""attention at the edges of its axes and of its masks (docs/guide.md, "Non-finite values, segments
and empty axes"): an empty head axis (kv heads too) gives an empty result and empty gradients in
every implementation, named and positional; offsets and window sizes beyond int32, and mask arrays
of wider integers, give the masks' exact meaning in every implementation (the Pallas kernels in
interpret mode), under `jit` as outside it."""

from __future__ import annotations

import functools

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import masks
from axkern.positional import attention
from tests import helpers
from tests.cases.attention import inputs as _inputs
from tests.harness import implementations_here

IMPLS = implementations_here("attention", reference=True)
# an empty call is answered before any kernel runs: every implementation, also those of a GPU
EVERY_IMPL = list(axkern.core.op.get_op("attention").implementations)


def _grads(fn, q, k, v, sinks):
    def loss(q, k, v, s):
        out, lse = fn(q, k, v, s)
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)[1]


@pytest.mark.parametrize("impl", EVERY_IMPL)
@pytest.mark.parametrize("kv_heads", [0, 2])
def test_empty_heads_give_empty_results_and_gradients(impl, kv_heads):
    q, k = jnp.ones((2, 5, 0, 16)), jnp.ones((2, 7, kv_heads, 16))
    v, sinks = jnp.ones((2, 7, kv_heads, 8)), jnp.ones((0,))
    mask = masks.Causal() & masks.Segments(jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 7), jnp.int32))

    def positional(q, k, v, s):
        return attention(q, k, v, mask=mask, sinks=s, implementation=impl, return_lse=True)

    with axkern.use(interpret=True):
        out, lse = jax.jit(positional)(q, k, v, sinks)
        grads = _grads(positional, q, k, v, sinks)
    assert out.shape == (2, 5, 0, 8) and lse.shape == (2, 5, 0)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, sinks.shape]

    Batch, Pos, KPos = hax.Axis("batch", 2), hax.Axis("position", 5), hax.Axis("key_position", 7)
    Heads, KVHeads = hax.Axis("heads", 0), hax.Axis("kv_heads", kv_heads)
    HeadDim, VDim = hax.Axis("head_size", 16), hax.Axis("head_size", 8)

    def named(q, k, v, s):
        out, lse = axkern.attention(
            hax.named(q, (Batch, Pos, Heads, HeadDim)),
            hax.named(k, (Batch, KPos, KVHeads, HeadDim)),
            hax.named(v, (Batch, KPos, KVHeads, VDim)),
            mask=masks.Causal(),
            sinks=hax.named(s, (Heads,)),
            implementation=impl,
            return_lse=True,
        )
        return out.array, lse.array

    with axkern.use(interpret=True):
        out, lse = jax.jit(named)(q, k, v, sinks)
        grads = _grads(named, q, k, v, sinks)
    assert out.shape == (2, 5, 0, 8) and lse.shape == (2, 5, 0)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, sinks.shape]


def test_kv_heads_zero_with_heads_is_refused():
    q, k = jnp.ones((1, 4, 2, 16)), jnp.ones((1, 4, 0, 16))
    with pytest.raises(ValueError, match="heads=2 is not a multiple of kv_heads=0"):
        attention(q, k, k)


# masks with offsets and window sizes beyond int32 (or at its edge, where `q + offset` wrapped)
# and the small masks of the same meaning over 24 queries and 40 keys
SQ, SK = 24, 40
NONE = masks.Causal(offset=-100)  # no query sees a key
BIG = {
    "causal 2**40": (masks.Causal(offset=2**40), masks.Full()),
    "causal 2**31-1": (masks.Causal(offset=2**31 - 1), masks.Full()),
    "causal -2**40": (masks.Causal(offset=-(2**40)), NONE),
    "causal -2**31-1": (masks.Causal(offset=-(2**31) - 1), NONE),
    "window 2**40": (masks.SlidingWindow(2**40), masks.Causal()),
    "window 2**40 at -3": (masks.SlidingWindow(2**40, offset=-3), masks.Causal(offset=-3)),
    # the query's own key and every key after it
    "window 2**31 at 2**31-1": (
        masks.SlidingWindow(2**31, offset=2**31 - 1),
        masks.SlidingWindow(101, offset=100),
    ),
    "window 4 at 2**40": (masks.SlidingWindow(4, offset=2**40), NONE),
    "window 4 at -2**40": (masks.SlidingWindow(4, offset=-(2**40)), NONE),
    # every key after the query's own
    "window 2**40 at 2**40": (masks.SlidingWindow(2**40, offset=2**40), masks.SlidingWindow(100, offset=100)),
    "window 2**40 & causal 2**40": (
        masks.SlidingWindow(2**40) & masks.Causal(offset=2**40),
        masks.Causal(),
    ),
    "window 4 at 2**40 | causal 5": (
        masks.SlidingWindow(4, offset=2**40) | masks.Causal(offset=5),
        masks.Causal(offset=5),
    ),
}


@pytest.mark.parametrize("case", list(BIG))
def test_offsets_and_windows_beyond_int32_keep_their_meaning_in_the_masks(case):
    from axkern.ops.attention.mosaic_gpu import schedules

    big, small = BIG[case]
    want = np.asarray(small.dense(SQ, SK))
    np.testing.assert_array_equal(np.asarray(big.dense(SQ, SK)), want)
    q, k = jnp.arange(SQ), jnp.arange(SK)
    np.testing.assert_array_equal(np.asarray(jax.jit(big.visible)(q, k)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(big.visible_2d)(q, k)), want[0])
    grid = schedules.grid_visible(big, q[:, None] + 0 * k[None, :], 0 * q[:, None] + k[None, :])
    np.testing.assert_array_equal(np.ones_like(want[0]) if grid is None else np.asarray(grid), want[0])
    for bq, bk in ((8, 8), (16, 8), (8, 16)):
        np.testing.assert_array_equal(
            masks.static_block_kinds(big, SQ, SK, bq, bk), masks.static_block_kinds(small, SQ, SK, bq, bk)
        )
        np.testing.assert_array_equal(
            schedules.mask_schedule(big, SQ, SK, bq, bk), schedules.mask_schedule(small, SQ, SK, bq, bk)
        )
        np.testing.assert_array_equal(
            schedules.key_schedule(big, SQ, SK, bq, bk), schedules.key_schedule(small, SQ, SK, bq, bk)
        )
    with helpers.x64():  # positions in int64
        np.testing.assert_array_equal(np.asarray(big.dense(SQ, SK)), want)


def _out_and_grads(impl, mask, a):
    def loss(q, k, v):
        out = attention(q, k, v, mask=mask, implementation=impl, block_sizes=BLOCKS.get(impl))
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape))), out

    with axkern.use(interpret=True):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            a["q"], a["k"], a["v"]
        )
    return out, grads


BLOCKS = {name: {"block_q": 16, "block_kv": 16} for name in ("xla", "pallas_gpu", "pallas_tpu")}


@functools.cache
def _static_out_and_grads(impl, mask):
    """`_out_and_grads` for a static mask, one jitted function per (implementation, mask): a
    case's reference compiles once for every implementation it is compared with."""
    return jax.jit(lambda q, k, v: _out_and_grads(impl, mask, dict(q=q, k=k, v=v)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "case", ["causal 2**40", "causal 2**31-1", "window 2**40", "window 4 at 2**40", "window 2**40 at 2**40"]
)
def test_offsets_and_windows_beyond_int32_keep_their_meaning_in_attention(impl, case):
    big, small = BIG[case]
    a = _inputs(0, 1, SQ, SK, 2, 1, 16, "float32")
    got = _static_out_and_grads(impl, big)(a["q"], a["k"], a["v"])
    want = _static_out_and_grads("reference", small)(a["q"], a["k"], a["v"])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_a_window_beyond_the_queries_reaches_cudnn_and_tokamax_as_causal():
    from axkern.ops.attention import arg_specs, cudnn

    big = masks.SlidingWindow(2**40)
    assert cudnn._mask_args(big, SQ) == {"is_causal": True}
    assert arg_specs.tokamax_mask(big, SQ) == {"is_causal": True}
    # a window the queries do not outreach keeps its size
    assert cudnn._mask_args(masks.SlidingWindow(SQ - 1), SQ) == {
        "is_causal": True,
        "local_window_size": (SQ - 2, 0),
    }
    # the keywords mean the mask: jax.nn.dot_product_attention's own XLA form against the reference
    a = _inputs(1, 1, SQ, SK, 2, 2, 16, "float32")
    want = attention(a["q"], a["k"], a["v"], mask=big, implementation="reference")
    got = jax.nn.dot_product_attention(
        a["q"], a["k"], a["v"], implementation="xla", **cudnn._mask_args(big, SQ)
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_offsets_and_sizes_are_static_ints_named_when_not():
    assert masks.Causal(offset=np.int64(3)) == masks.Causal(offset=3)
    assert masks.SlidingWindow(np.int32(4), offset=np.int64(-2)) == masks.SlidingWindow(4, offset=-2)
    assert type(masks.Causal(offset=np.int64(3)).offset) is int
    with pytest.raises(ValueError, match="Causal: offset must be a static int, got 1.5"):
        masks.Causal(offset=1.5)
    with pytest.raises(ValueError, match="SlidingWindow: offset must be a static int"):
        masks.SlidingWindow(4, offset="2")
    with pytest.raises(ValueError, match="SlidingWindow: size must be a positive int, got 2.0"):
        masks.SlidingWindow(2.0)

    @jax.jit
    def traced(offset):
        return masks.Causal(offset=offset)

    with pytest.raises(ValueError, match="Causal: offset must be a static int"):
        traced(3)


# mask arrays of wider integers than JAX keeps by default: prefix lengths past int32 (every key
# inside the prefix, or none), document ids that differ only past 32 bits (never one document)
WIDE_IDS = np.array([[0, 0, 0, 2**32, 2**32, 2**32, 2**33, 5] * 5], np.int64)[:, :SK]
NARROW_IDS = np.array([[0, 0, 0, 2, 2, 2, 3, 1] * 5], np.int32)[:, :SK]


def _inside(operands):
    """Which of the SK keys lie inside each row's prefix, by the kernels' int32 prefix lengths."""
    (lengths,) = operands
    assert lengths.dtype == jnp.int32
    return np.arange(SK)[None, :] < np.asarray(lengths)[:, None]


def test_prefix_lengths_beyond_int32_keep_their_meaning():
    from axkern.ops.attention.mosaic_gpu import schedules

    small = masks.PrefixLM(jnp.array([SK, 0, 3]))
    for big in (
        masks.PrefixLM(np.array([2**40, -(2**40), 3], np.int64)),
        masks.PrefixLM([2**40, -(2**40), 3]),
        masks.PrefixLM(np.array([2**63 - 1, 0, 3], np.uint64)),
        masks.PrefixLM(jnp.array([3_000_000_000, 0, 3], jnp.uint32)),  # past int32, which uint32 wraps to
    ):
        np.testing.assert_array_equal(np.asarray(big.dense(SQ, SK)), np.asarray(small.dense(SQ, SK)))
        np.testing.assert_array_equal(
            schedules.device_kinds(big, SQ, SK, 8, 8, 3), schedules.device_kinds(small, SQ, SK, 8, 8, 3)
        )
        np.testing.assert_array_equal(
            _inside(schedules.operands([big], 3, 32, 48)), _inside(schedules.operands([small], 3, 32, 48))
        )
    with helpers.x64():  # traced int64 prefix lengths in the Mosaic GPU kernels' operands and schedules
        big = masks.PrefixLM(jnp.array([2**40, -(2**40), 3], jnp.int64))
        small = masks.PrefixLM(jnp.array([SK, 0, 3], jnp.int32))
        got = jax.jit(lambda m: schedules.device_kinds(m, SQ, SK, 8, 8, 3))(big)
        np.testing.assert_array_equal(got, schedules.device_kinds(small, SQ, SK, 8, 8, 3))
        got = jax.jit(lambda m: schedules.operands([m], 3, 32, 48))(big)
        np.testing.assert_array_equal(_inside(got), _inside(schedules.operands([small], 3, 32, 48)))


@pytest.mark.parametrize("impl", ["xla", "reference", "pallas_tpu"])
def test_prefix_lengths_past_int32_in_uint32_keep_their_meaning_in_attention(impl):
    a = _inputs(3, 2, SQ, SK, 2, 1, 16, "float32")
    want = _out_and_grads("reference", masks.PrefixLM(jnp.array([SK, 3])), a)
    got = jax.jit(lambda p: _out_and_grads(impl, masks.PrefixLM(p), a))(
        jnp.array([3_000_000_000, 3], jnp.uint32)
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_segment_ids_beyond_int32_keep_their_documents_in_the_masks():
    from axkern.ops.attention.mosaic_gpu import schedules

    small = masks.Segments(NARROW_IDS[:, :SQ], NARROW_IDS)
    want = np.asarray(small.dense(SQ, SK))
    for q_ids, kv_ids in ((WIDE_IDS[:, :SQ], WIDE_IDS), (WIDE_IDS[:, :SQ].astype(np.uint64), WIDE_IDS)):
        big = masks.Segments(q_ids, kv_ids)
        np.testing.assert_array_equal(np.asarray(big.dense(SQ, SK)), want)

    @jax.jit
    def traced_and_wide(q_ids):  # a wide host side cannot be renumbered with a traced one
        return masks.Segments(q_ids, WIDE_IDS).kv_ids

    with pytest.raises(ValueError, match="Segments: ids wider than JAX keeps"):
        traced_and_wide(jnp.asarray(NARROW_IDS[:, :SQ]))
    with helpers.x64():  # traced int64 ids in the Mosaic GPU kernels' operands and schedules
        big = masks.Segments(jnp.asarray(WIDE_IDS[:, :SQ]), jnp.asarray(WIDE_IDS))
        got = jax.jit(lambda m: schedules.device_kinds(m, SQ, SK, 8, 8, 1))(big)
        np.testing.assert_array_equal(got, schedules.device_kinds(small, SQ, SK, 8, 8, 1))
        same = lambda q_ids, kv_ids: np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :]  # noqa: E731
        got = jax.jit(lambda m: schedules.operands([m], 1, 32, 48))(big)
        np.testing.assert_array_equal(same(*got), same(*schedules.operands([small], 1, 32, 48)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("x64", [False, True], ids=["ids from numpy", "traced int64 ids"])
def test_segment_ids_beyond_int32_keep_their_documents_in_attention(impl, x64):
    a = _inputs(2, 1, SQ, SK, 2, 1, 16, "float32")
    want = _out_and_grads(
        "reference", masks.Segments(NARROW_IDS[:, :SQ], NARROW_IDS) & masks.Causal(offset=8), a
    )
    if not x64:
        got = _out_and_grads(impl, masks.Segments(WIDE_IDS[:, :SQ], WIDE_IDS) & masks.Causal(offset=8), a)
    else:
        with helpers.x64():

            def run(q_ids, kv_ids):
                return _out_and_grads(impl, masks.Segments(q_ids, kv_ids) & masks.Causal(offset=8), a)

            got = jax.jit(run)(jnp.asarray(WIDE_IDS[:, :SQ]), jnp.asarray(WIDE_IDS))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
