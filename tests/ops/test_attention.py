"""attention: masks, the xla implementation against the float64 oracle (values and dq, dk, dv,
dsinks), GQA, soft-capping, ragged lengths, fully masked rows, the named layer and bad input."""

from __future__ import annotations

import dataclasses
import re

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import masks
from axkern.positional import attention
from tests.cases.attention import inputs as _inputs
from tests.cases.attention import run as _run
from tests.harness import check_rule, check_rules, jit


def _seg(key, b, n, p=0.15):
    return jnp.cumsum(jax.random.bernoulli(key, p, (b, n)), axis=1).astype(jnp.int32)


def _mask(kind, b, sq, sk):
    seg_q = _seg(jax.random.PRNGKey(11), b, sq)
    seg_k = seg_q if sq == sk else _seg(jax.random.PRNGKey(12), b, sk)
    return {
        "causal": masks.Causal(offset=sk - sq),
        "full": masks.Full(),
        "window": masks.SlidingWindow(7, offset=sk - sq),
        # two-sided: 9 keys before and 9 after the query's own (the aligned position)
        "two-sided window": masks.SlidingWindow(19, offset=sk - sq + 9),
        "segments": masks.Segments(seg_q, seg_k),
        "prefix": masks.PrefixLM(jnp.array([3, 20][:b])),
        "causal&segments": masks.Causal(offset=sk - sq) & masks.Segments(seg_q, seg_k),
        # a window reaching 3 keys ahead (beyond the causal part PrefixLM already holds)
        "window|prefix": masks.SlidingWindow(7, offset=3) | masks.PrefixLM(jnp.array([5, 0][:b])),
        "prefix&segments": masks.PrefixLM(jnp.array([20, 2][:b])) & masks.Segments(seg_q, seg_k),
    }[kind]


def check(arrays, mask, dtype, impl="xla", **kw):
    return check_rule(_run, impl, arrays, dtype, "attention", interpret=True, mask=mask, **kw)


def checks(impls, arrays, mask, dtype, **kw):
    """`check` for several implementations on one case (the oracle evaluated once)."""
    return check_rules(_run, impls, arrays, dtype, "attention", interpret=True, mask=mask, **kw)


MASKS = [
    "causal",
    "full",
    "window",
    "segments",
    "prefix",
    "causal&segments",
    "window|prefix",
    "two-sided window",
    "prefix&segments",
]


# every mask in float32, half of them in bfloat16 too (the masks select the same pairs in
# either dtype; the dtype changes the roundings, which the causal, window, segments and
# combined masks' partial tiles all meet)
XLA_CASES = [(kind, "float32") for kind in MASKS] + [
    (kind, "bfloat16") for kind in ["causal", "window", "causal&segments", "window|prefix"]
]


@pytest.mark.parametrize("kind,dtype", XLA_CASES)
def test_against_float64_oracle(kind, dtype):
    # lengths not multiples of the 16x16 tiles; GQA 2; q length != kv length
    b, sq, sk = 2, 37, 53
    arrays = _inputs(MASKS.index(kind), b, sq, sk, 4, 2, 16, dtype)
    # the soft cap of the Pallas cases below: the same oracle, compiled once
    check(arrays, _mask(kind, b, sq, sk), dtype, sinks=kind != "full", cap=3.0 if "s" in kind else None)


# every mask in float32; bfloat16 where the band (window) and the run-time tile lists
# (causal&segments) make the most tiles partial
KERNEL_CASES = [
    (kind, "float32")
    for kind in ["causal", "full", "window", "segments", "causal&segments", "two-sided window"]
]


@pytest.mark.parametrize(
    "kind,dtype", [*KERNEL_CASES, ("window", "bfloat16"), ("causal&segments", "bfloat16")]
)
def test_pallas_gpu_against_float64_oracle(kind, dtype):
    # interpret mode; 16x16 tiles over lengths 37 and 53; GQA 2; sinks and soft cap
    b, sq, sk = 2, 37, 53
    arrays = _inputs(20 + MASKS.index(kind), b, sq, sk, 4, 2, 16, dtype)
    check(arrays, _mask(kind, b, sq, sk), dtype, impl="pallas_gpu", sinks=kind != "full", cap=3.0)


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu"])
def test_the_sinks_gradient_with_weights_nothing_rounds(impl):
    """bf16 outputs weighed by bf16 weights (tests/cases/attention.py): the cotangent no
    implementation rounds, so the sinks' gradient meets the reference's, which keeps the
    probabilities in float32 beside float32 sinks; summed from the output (`Σ o · dO`, whose
    `p v` rounded them to bf16) it missed the rule here by 3.4x."""
    b, sq, sk = 1, 40, 56
    arrays = _inputs(31, b, sq, sk, 4, 2, 32, "bfloat16")
    kw = dict(sinks=True, cap=30.0, weights="bfloat16", blocks=(16, 16))
    check(arrays, _mask("causal", b, sq, sk), "bfloat16", impl=impl, **kw)
    check(arrays, masks.Causal(offset=-20), "bfloat16", impl=impl, lse=True, **kw)  # rows that see nothing


def test_pallas_gpu_rows_that_see_nothing_and_combined_masks():
    arrays = _inputs(7, 1, 40, 40, 4, 1, 16, "float32")  # MQA
    mask = masks.SlidingWindow(9) | masks.Causal(offset=-20)  # the first rows see only their window
    check(arrays, mask, "float32", impl="pallas_gpu", sinks=False)
    check(arrays, masks.Causal(offset=-8), "float32", impl="pallas_gpu", sinks=False)  # rows 0-7 see nothing


def test_full_tiles_skip_masking_in_the_schedules():
    from axkern.ops.attention import pallas_gpu as pg

    kinds = masks.Causal().block_kinds(64, 64, 16, 16)[0]  # 4x4: FULL below the diagonal
    lo, flo, fhi, hi = (np.asarray(a)[0, :4] for a in pg._bounds(kinds, 0, 1))
    assert lo.tolist() == [0, 0, 0, 0] and hi.tolist() == [1, 2, 3, 4]
    # row 0 has no FULL tile (the run is empty at hi), the others run [0, i) unmasked
    assert flo.tolist() == [1, 0, 0, 0] and fhi.tolist() == [1, 1, 2, 3]
    lo, flo, fhi, hi = (np.asarray(a)[0, :4] for a in pg._bounds(kinds, 1, 1))  # per kv block
    assert lo.tolist() == [0, 1, 2, 3] and hi.tolist() == [4, 4, 4, 4]
    assert flo.tolist() == [1, 2, 3, 4] and fhi.tolist() == [4, 4, 4, 4]
    # packed documents (two of 32 positions) & causal: a tile is full when it is statically
    # FULL and both blocks hold one and the same document; tiles across documents are skipped
    ids = jnp.asarray([[0] * 32 + [1] * 32, [0] * 8 + [1] * 56])
    overlap, uniform = pg._segment_tiles((ids, ids), 64, 64, 16, 16)
    lo, flo, fhi, hi = (np.asarray(a)[:, :4] for a in pg._bounds(kinds, 0, 2, overlap, uniform))
    assert lo[0].tolist() == [0, 0, 2, 2] and hi[0].tolist() == [1, 2, 3, 4]
    assert flo[0].tolist() == [1, 0, 3, 2] and fhi[0].tolist() == [1, 1, 3, 3]
    # the second row's first block holds both documents: never full, always compared
    assert flo[1].tolist() == [1, 2, 1, 1] and fhi[1].tolist() == [1, 2, 2, 3]
    assert pg._first_run(jnp.asarray([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0]], bool))[1].tolist() == [3, 0]
    assert pg._longest_run(np.array([1, 1, 0, 1, 1, 1, 0], bool)) == (3, 6)
    assert pg._longest_run(np.zeros(3, bool)) == (0, 0)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "xla"])
def test_full_tiles_stay_exact(impl):
    # a window whose band holds FULL tiles between partial ones (and causal rows of FULL
    # tiles), in float32 (pallas_tpu: bf16), for every tiled implementation
    # (pallas_gpu's bfloat16 window: test_pallas_gpu_against_float64_oracle)
    # (row blocks 2 and 3 of a window of 40 over 16-tiles: partial, FULL, partial)
    dtype = "bfloat16" if impl == "pallas_tpu" else "float32"
    check(
        _inputs(8, 1, 64, 64, 4, 2, 16, dtype),
        masks.SlidingWindow(40),
        dtype,
        impl=impl,
        sinks=True,
        cap=None,
    )
    check(_inputs(9, 1, 64, 64, 2, 1, 16, "float32"), masks.Causal(), "float32", impl=impl, cap=2.0)
    if impl == "pallas_gpu":  # long packed documents: tiles inside one document run unmasked
        ids = jnp.asarray([[0] * 24 + [1] * 40, [0] * 16 + [1] * 32 + [2] * 16])
        for mask in (masks.Causal() & masks.Segments(ids, ids), masks.Segments(ids, ids)):
            check(_inputs(10, 2, 64, 64, 2, 2, 16, "float32"), mask, "float32", impl="pallas_gpu", cap=2.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["causal&segments", "window"])
def test_pallas_gpu_backward_kernels_take_their_own_blocks(kind, dtype):
    # each kernel its own tiles: the lengths (37, 53) pad to the largest block (32, 64) and
    # every kernel's bounds cover the padded blocks; GQA 2, sinks, soft cap
    blocks = dict(block_q=32, block_kv=16, block_q_dq=16, block_kv_dq=32, block_q_dkv=16, block_kv_dkv=64)
    b, sq, sk = 2, 37, 53
    arrays = _inputs(30 + MASKS.index(kind), b, sq, sk, 4, 2, 16, dtype)
    check(arrays, _mask(kind, b, sq, sk), dtype, impl="pallas_gpu", cap=3.0, blocks=blocks)


@pytest.mark.parametrize("segments", [False, True])
def test_pallas_gpu_backward_blocks_larger_than_the_forwards(segments):
    # lengths 20 and 17 pad to 64 on both axes (the dk/dv kernel's blocks): the key axis is
    # padded too, and the dk/dv kernel's 64-row query tiles hold rows the forward never saw
    blocks = dict(block_q=16, block_kv=16, block_kv_dq=32, block_q_dkv=64, block_kv_dkv=64)
    b, sq, sk = 2, 20, 17
    arrays = _inputs(40 + segments, b, sq, sk, 4, 2, 16, "float32")
    mask = _mask("causal&segments" if segments else "causal", b, sq, sk)
    check(arrays, mask, "float32", impl="pallas_gpu", cap=3.0, blocks=blocks)


def test_attention_block_sizes_per_kernel():
    bs = axkern.AttentionBlockSizes(block_q=64, block_kv=32, num_warps=4, block_kv_dkv=128, num_stages_dq=3)
    assert bs.kernel("fwd") == axkern.AttentionBlockSizes(64, 32, 4, None)
    assert bs.kernel("dq") == axkern.AttentionBlockSizes(64, 32, 4, 3)
    assert bs.kernel("dkv") == axkern.AttentionBlockSizes(64, 128, 4, None)
    with pytest.raises(ValueError, match="'fwd', 'dq' or 'dkv'"):
        bs.kernel("bwd")
    a = _inputs(0, 1, 32, 32, 2, 2, 16, "float32")
    with axkern.use(interpret=True), pytest.raises(axkern.Unsupported, match="block_kv_dq=8"):
        attention(
            a["q"], a["k"], a["v"], implementation="pallas_gpu", block_sizes={"block_q": 16, "block_kv_dq": 8}
        )


def test_pallas_gpu_falls_back_with_the_reason():
    a = _inputs(0, 1, 32, 32, 2, 2, 16, "float32")
    with axkern.use(interpret=True):
        with pytest.raises(axkern.Unsupported, match="static masks and Segments"):
            attention(
                a["q"], a["k"], a["v"], mask=masks.PrefixLM(jnp.asarray([3])), implementation="pallas_gpu"
            )
        with pytest.raises(axkern.Unsupported, match="block_q=8"):
            attention(
                a["q"],
                a["k"],
                a["v"],
                implementation="pallas_gpu",
                block_sizes={"block_q": 8, "block_kv": 16},
            )
    b = _inputs(0, 1, 32, 32, 2, 2, 8, "float32")
    with axkern.use(interpret=True), pytest.raises(axkern.Unsupported, match="head_dim=8"):
        attention(b["q"], b["k"], b["v"], implementation="pallas_gpu")


def test_pallas_gpu_takes_warps_and_stages_and_explain_shows_them():
    a = _inputs(4, 1, 48, 48, 2, 2, 16, "float32")
    bs = axkern.AttentionBlockSizes(block_q=16, block_kv=32, num_warps=8, num_stages=2)
    f = lambda q, k, v, bs: attention(q, k, v, implementation="pallas_gpu", block_sizes=bs)  # noqa: E731
    with axkern.use(interpret=True):
        d = axkern.explain(lambda q, k, v: f(q, k, v, bs), a["q"], a["k"], a["v"])
        got = f(a["q"], a["k"], a["v"], bs)
    assert d.block_sizes == bs and "num_warps=8" in str(d)
    want = attention(a["q"], a["k"], a["v"], implementation="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# bfloat16's window: test_full_tiles_stay_exact
@pytest.mark.parametrize(
    "kind,dtype",
    [
        *KERNEL_CASES,
        ("causal&segments", "bfloat16"),
        ("prefix", "float32"),
        ("window|prefix", "bfloat16"),
        ("prefix&segments", "float32"),
    ],
)
def test_pallas_tpu_against_float64_oracle(kind, dtype):
    # TPU interpret mode; 16x16 tiles over lengths 37 and 53 (block-sparse schedule: causal and
    # window rows have different tile counts; segments' and prefixes' schedules are built at
    # run time per batch row); GQA 2; sinks and soft cap
    b, sq, sk = 2, 37, 53
    arrays = _inputs(30 + MASKS.index(kind), b, sq, sk, 4, 2, 16, dtype)
    check(arrays, _mask(kind, b, sq, sk), dtype, impl="pallas_tpu", sinks=kind != "full", cap=3.0)


def test_pallas_tpu_rows_that_see_nothing_mqa_and_its_schedule():
    from axkern.ops.attention import common as tiles
    from axkern.ops.attention.pallas_tpu import schedules

    arrays = _inputs(8, 1, 40, 40, 4, 1, 16, "float32")  # MQA
    check(
        arrays, masks.SlidingWindow(9) | masks.Causal(offset=-20), "float32", impl="pallas_tpu", sinks=False
    )
    check(
        arrays, masks.Causal(offset=-8), "float32", impl="pallas_tpu", sinks=True
    )  # rows 0-7: only the sink
    # the schedule lists each row's non-empty tiles, padded by repeating the last; the counts
    # are followed by the partial counts (a window of 20 over 16-tiles has no FULL tile)
    kinds = masks.static_block_kinds(masks.SlidingWindow(20), 64, 64, 16, 16)[0]
    table, counts, steps = schedules.schedule(kinds, 0, 1)
    assert steps == 3 and counts.tolist() == [1, 2, 3, 3] * 2  # row 32 sees keys 13..32: blocks 0-2
    assert table.reshape(4, 3).tolist() == [[0, 0, 0], [0, 1, 1], [0, 1, 2], [1, 2, 3]]
    # causal: the partial diagonal tile first, then the FULL ones (no masking work)
    kinds = masks.static_block_kinds(masks.Causal(), 64, 64, 16, 16)[0]
    table, counts, steps = schedules.schedule(kinds, 0, 1)
    assert counts.tolist() == [1, 2, 3, 4] + [1, 1, 1, 1]
    assert table.reshape(4, 4).tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [2, 0, 1, 1], [3, 0, 1, 2]]
    table, counts, steps = schedules.schedule(kinds, 1, 1)  # per kv block: its query blocks
    assert counts.tolist() == [4, 3, 2, 1] + [1, 1, 1, 1]
    assert table.reshape(4, 4).tolist() == [[0, 1, 2, 3], [1, 2, 3, 3], [2, 3, 3, 3], [3, 3, 3, 3]]
    # packed documents: tiles between different documents leave each row's list at run time
    ids = jnp.asarray([[0] * 16 + [1] * 32 + [2] * 16, [0] * 64])
    overlap = tiles.segment_overlap((ids, ids), 64, 64, 16, 16)
    kinds = masks.static_block_kinds(masks.Causal(), 64, 64, 16, 16)[0]
    table, counts, steps = schedules.schedule(kinds, 0, 2, jnp.asarray(kinds != masks.EMPTY)[None] & overlap)
    assert steps == 4 and counts.tolist() == [1, 1, 2, 1, 1, 2, 3, 4] * 2  # all partial: ids compared
    assert table.reshape(2, 4, 4)[0].tolist() == [[0, 0, 0, 0], [1, 1, 1, 1], [1, 2, 2, 2], [3, 3, 3, 3]]
    # a prefix-LM mask: causal's tiles and those below each row's prefix (40 keys: blocks 0-2,
    # 0-1 whole; none), partial first; the counts are followed by the prefix lengths
    cfg = tiles.Static(16, 16, 1.0, None, True)
    arrays = (None, jnp.asarray([40, 0], jnp.int32))
    table, counts, steps = schedules.plan(cfg, masks.Causal(), arrays, 2, 64, 64, 64, 64, 0)
    assert steps == 4
    assert counts.tolist() == [3, 3, 3, 4] + [1, 2, 3, 4] + [1, 1, 1, 1] * 2 + [40, 0]
    assert table.reshape(2, 4, 4)[0].tolist() == [[2, 0, 1, 1], [2, 0, 1, 1], [2, 0, 1, 1], [3, 0, 1, 2]]
    table, counts, steps = schedules.plan(cfg, masks.Causal(), arrays, 2, 64, 64, 64, 64, 1)  # per kv block
    assert counts.tolist() == [4, 4, 4, 1] + [4, 3, 2, 1] + [0, 0, 3, 1] + [1, 1, 1, 1] + [40, 0]
    a = _inputs(0, 1, 32, 32, 2, 2, 16, "float32")
    with axkern.use(interpret=True):
        with pytest.raises(
            axkern.Unsupported,
            match=re.escape("(PrefixLM(prefix_lengths[1]) & SlidingWindow")
            + ".*"
            + re.escape("PrefixLM alone or | a static mask, either & Segments"),
        ):
            attention(
                a["q"],
                a["k"],
                a["v"],
                mask=masks.PrefixLM(jnp.asarray([3])) & masks.SlidingWindow(8),
                implementation="pallas_tpu",
            )
        with pytest.raises(axkern.Unsupported, match="block_q=12: TPU blocks need a multiple of 8"):
            attention(
                a["q"],
                a["k"],
                a["v"],
                implementation="pallas_tpu",
                block_sizes={"block_q": 12, "block_kv": 16},
            )


# GQA ratios 1, 4, 8; the soft cap is a function of each logit, whatever the head grouping
# (GQA 2 without it: test_against_float64_oracle's window, full and prefix)
def test_sinks_gradient_sums_the_unrounded_output():
    # dsink = -sum exp(sink - lse) (out . d_out) over every row: with out rounded to bf16 this
    # case's first head is 4.4e-3 off the oracle where the rule allows 2.9e-3; the forwards
    # keep what the rounding lost for it (head dim 256, 250 rows, window 100, soft cap 8)
    arrays = _inputs(20, 1, 250, 250, 2, 1, 256, "bfloat16")
    checks(
        ["pallas_gpu", "pallas_tpu", "xla"],
        arrays,
        masks.SlidingWindow(100),
        "bfloat16",
        sinks=True,
        cap=8.0,
        blocks=(64, 64),
    )


@pytest.mark.parametrize("kv_heads,cap", [(8, None), (2, 3.0), (1, 3.0)])
def test_gqa_and_soft_cap(kv_heads, cap):
    arrays = _inputs(5, 1, 40, 40, 8, kv_heads, 8, "float32")
    check(arrays, masks.Causal(), "float32", sinks=kv_heads != 2, cap=cap, blocks=(8, 16))


def test_fully_masked_rows_are_zero_not_nan():
    b, s = 1, 24
    arrays = _inputs(6, b, s, s, 2, 2, 8, "float32")
    q_ids = jnp.zeros((b, s), jnp.int32).at[:, :5].set(7)  # queries 0-4 match no key
    mask = masks.Segments(q_ids, jnp.zeros((b, s), jnp.int32))
    for impl in ("xla", "reference"):
        out, grads = _run(impl, arrays, mask, sinks=False)
        assert not any(np.isnan(np.asarray(g)).any() for g in jax.tree.leaves((out, grads)))
        np.testing.assert_array_equal(np.asarray(out[:, :5]), 0.0)
    check(arrays, mask, "float32", sinks=False)


def test_masks_dense_and_block_kinds():
    sq, sk = 10, 13
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    ids = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]])
    cases = {
        "causal": (masks.Causal(offset=3), j <= i + 3),
        "window": (masks.SlidingWindow(3), (j <= i) & (j > i - 3)),
        "full": (masks.Full(), np.ones((sq, sk), bool)),
        "prefix": (masks.PrefixLM(jnp.array([4])), (j <= i) | (j < 4)),
        "segments": (masks.Segments(ids[:, :sq], ids), ids[0, :sq][:, None] == ids[0][None, :]),
    }
    for name, (mask, want) in cases.items():
        np.testing.assert_array_equal(np.asarray(mask.dense(sq, sk))[0], want, err_msg=name)
        combo = mask & masks.Causal()
        np.testing.assert_array_equal(np.asarray(combo.dense(sq, sk))[0], want & (j <= i), err_msg=name)
        kinds = np.asarray(mask.block_kinds(sq, sk, 4, 4))[0]
        padded = np.zeros((12, 16), bool)
        padded[:sq, :sk] = want
        tiles = padded.reshape(3, 4, 4, 4)
        expect = np.where(
            tiles.all((1, 3)), masks.FULL, np.where(tiles.any((1, 3)), masks.PARTIAL, masks.EMPTY)
        )
        np.testing.assert_array_equal(kinds, expect, err_msg=name)
    assert masks.is_static(masks.Causal() & masks.SlidingWindow(2))
    assert not masks.is_static(masks.Causal() & masks.PrefixLM(jnp.array([1])))


def test_static_masks_skip_empty_tiles():
    # causal with 8x8 tiles over 32 positions: 10 of 16 tiles are visited, the 4 diagonal
    # ones with masking work and the 6 below it (FULL) without
    from axkern.ops.attention import xla

    cfg = xla._Static(8, 8, 1.0, None)
    causal = xla._kv_blocks(cfg, masks.Causal(), 32, 32)
    assert [p.tolist() for p, _ in causal] == [[0], [1], [2], [3]]
    assert [f.tolist() for _, f in causal] == [[], [0], [0, 1], [0, 1, 2]]
    window = xla._kv_blocks(cfg, masks.SlidingWindow(8), 32, 32)
    assert sum(len(p) + len(f) for p, f in window) == 7 and not any(len(f) for _, f in window)
    segments = masks.Segments(jnp.zeros((1, 32), jnp.int32), jnp.zeros((1, 32), jnp.int32))
    assert all(len(p) == 4 and not len(f) for p, f in xla._kv_blocks(cfg, segments, 32, 32))


def test_bad_input_names_the_problem():
    a = _inputs(0, 1, 8, 8, 6, 4, 8, "float32")
    with pytest.raises(ValueError, match="heads=6 is not a multiple of kv_heads=4"):
        attention(a["q"], a["k"], a["v"])
    a = _inputs(0, 1, 8, 8, 4, 2, 8, "float32")
    with pytest.raises(ValueError, match="head dim is 8 but k's is 4"):
        attention(a["q"], a["k"][..., :4], a["v"])
    with pytest.raises(ValueError, match="Segments: q_ids is"):
        attention(a["q"], a["k"], a["v"], mask=masks.Segments(jnp.zeros((1, 5), int), jnp.zeros((1, 8), int)))
    with pytest.raises(ValueError, match="batch size 2 differs"):
        attention(a["q"], a["k"], a["v"], mask=masks.PrefixLM(jnp.array([1, 2])))
    with pytest.raises(ValueError, match="size must be a positive int"):
        masks.SlidingWindow(0)


def test_named_layer_matches_positional_and_keeps_axis_order():
    Batch, Pos, KPos = hax.Axis("batch", 2), hax.Axis("position", 24), hax.Axis("key_position", 24)
    Heads, KVHeads, HeadDim = hax.Axis("heads", 4), hax.Axis("kv_heads", 2), hax.Axis("head_size", 8)
    a = _inputs(3, 2, 24, 24, 4, 2, 8, "float32")
    q = hax.named(a["q"], (Batch, Pos, Heads, HeadDim)).rearrange((Heads, Batch, HeadDim, Pos))
    k = hax.named(a["k"], (Batch, KPos, KVHeads, HeadDim))
    v = hax.named(a["v"], (Batch, KPos, KVHeads, HeadDim))
    out = axkern.attention(q, k, v, sinks=hax.named(a["sinks"], (Heads,)))
    assert [ax.name for ax in out.axes] == ["heads", "batch", "head_size", "position"]
    want = attention(a["q"], a["k"], a["v"], sinks=a["sinks"])
    np.testing.assert_allclose(np.asarray(out.rearrange((Batch, Pos, Heads, HeadDim)).array), want, rtol=1e-6)
    # self-attention: k and v on the query position axis, MHA without a KVHeads axis
    kk = hax.named(jnp.repeat(a["k"], 2, axis=2), (Batch, Pos, Heads, HeadDim))
    vv = hax.named(jnp.repeat(a["v"], 2, axis=2), (Batch, Pos, Heads, HeadDim))
    out2 = axkern.attention(q, kk, vv, sinks=hax.named(a["sinks"], (Heads,)))
    np.testing.assert_allclose(
        np.asarray(out2.rearrange((Batch, Pos, Heads, HeadDim)).array), want, rtol=1e-5
    )
    with pytest.raises(ValueError, match="Heads"):
        axkern.attention(q, k, v, Heads="nope")
    with pytest.raises(ValueError, match="batch axes"):
        axkern.attention(q, k.rename({"batch": "other"}), v)
    with pytest.raises(ValueError, match="mask's arrays must lead with q's batch axes"):
        axkern.attention(q, k, v, mask=masks.PrefixLM(jnp.array([1, 2, 3])))


def test_explain_and_jit():
    a = _inputs(1, 1, 64, 64, 4, 4, 16, "bfloat16")
    d = axkern.explain(lambda q, k, v: attention(q, k, v), a["q"], a["k"], a["v"])
    assert d.op == "attention" and d.implementation == "xla" and d.spec.dim("kv_heads") == 4
    mask = masks.Segments(jnp.zeros((1, 64), int), jnp.zeros((1, 64), int)) & masks.Causal()
    f = jax.jit(lambda q, k, v, m: attention(q, k, v, mask=m))
    np.testing.assert_allclose(
        np.asarray(f(a["q"], a["k"], a["v"], mask), np.float32),
        np.asarray(attention(a["q"], a["k"], a["v"], mask=masks.Causal()), np.float32),
        atol=1e-2,
    )


def test_cudnn_says_why_it_cannot_serve():
    a = _inputs(0, 1, 16, 16, 2, 2, 8, "bfloat16")
    with pytest.raises(axkern.Unsupported, match="runs on gpu, not cpu"):
        attention(a["q"], a["k"], a["v"], implementation="cudnn")
    from axkern.ops.attention import OP, cudnn

    def spec(**flags):
        dims = {"batch": 1, "q_len": 16, "kv_len": 16, "heads": 2, "kv_heads": 2, "head_dim": 64, "v_dim": 64}
        base = dict(soft_cap=False, sinks=False, mask="Causal")
        return dataclasses.replace(OP.spec(dims, jnp.bfloat16, **(base | flags)), platform="gpu")

    assert cudnn.supports(spec()) is None
    assert "soft cap" in cudnn.supports(spec(soft_cap=True))
    assert "sinks" in cudnn.supports(spec(sinks=True))
    assert "Segments" in cudnn.supports(spec(mask="Segments"))
    assert cudnn._mask_args(masks.SlidingWindow(128)) == {"is_causal": True, "local_window_size": (127, 0)}
    assert cudnn._mask_args(masks.Causal(offset=3)) is None
    # JAX's own refusal while tracing (here: no cuDNN on this CPU) becomes a reason to move on
    q = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
    with pytest.raises(axkern.Unsupported, match="cudnn'\\) refused: cuDNN is not detected"):
        cudnn.attention(q, q, q, None, masks.Causal(), scale=1.0, logits_soft_cap=None)


@pytest.mark.parametrize(
    "mesh_shape, mapping, kv_heads",
    [
        ((8, 1), {"batch": "data"}, 2),
        ((2, 4), {"batch": "data", "heads": "model", "kv_heads": "model"}, 4),
        ((2, 4), {"batch": "data", "heads": "model"}, 1),  # MQA: the one kv head on every shard
    ],
)
@pytest.mark.parametrize("static", [False, True])
def test_sharded_equals_unsharded(mesh_shape, mapping, kv_heads, static):
    from jax.sharding import Mesh

    Batch, Pos, KPos = hax.Axis("batch", 8), hax.Axis("position", 24), hax.Axis("key_position", 24)
    Heads, KVHeads, HeadDim = hax.Axis("heads", 8), hax.Axis("kv_heads", kv_heads), hax.Axis("head_size", 8)
    a = _inputs(4, 8, 24, 24, 8, kv_heads, 8, "float32")
    q = hax.named(a["q"], (Batch, Pos, Heads, HeadDim))
    k = hax.named(a["k"], (Batch, KPos, KVHeads, HeadDim))
    v = hax.named(a["v"], (Batch, KPos, KVHeads, HeadDim))
    sinks = hax.named(a["sinks"], (Heads,))
    seg = _seg(jax.random.PRNGKey(3), 8, 24)
    # a static mask's tile kinds are constants computed while tracing, inside the shard_map
    mask = masks.Causal() if static else masks.Causal() & masks.Segments(seg, seg)

    def f(q, k, v, sinks):
        out = axkern.attention(
            q, k, v, mask=mask, sinks=sinks, logits_soft_cap=4.0, block_sizes={"block_q": 8, "block_kv": 8}
        )
        return hax.sum(out * out).array, out

    want = jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
        fn = jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))
        got = fn(q, k, v, sinks)
        text = fn.lower(q, k, v, sinks).as_text()
        assert "manual_computation" in text or "shard_map" in text
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_sharding_refuses_kv_heads_mapped_apart_from_heads():
    from jax.sharding import Mesh

    a = _inputs(4, 2, 8, 8, 4, 2, 8, "float32")
    axes = lambda kvh: (hax.Axis("batch", 2), hax.Axis("position", 8), kvh, hax.Axis("head_size", 8))  # noqa: E731
    q = hax.named(a["q"], axes(hax.Axis("heads", 4)))
    k = hax.named(a["k"], axes(hax.Axis("kv_heads", 2)))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"heads": "model"}):
        with pytest.raises(ValueError, match="map both to the same mesh axes"):
            axkern.attention(q, k, k)


def test_haliax_compat_matches_haliax():
    import haliax.nn.attention as hattn

    from axkern.haliax_compat import dot_product_attention

    Batch, Pos, KPos = hax.Axis("batch", 2), hax.Axis("position", 20), hax.Axis("key_position", 20)
    Heads, Key = hax.Axis("heads", 3), hax.Axis("head_size", 8)
    ks = jax.random.split(jax.random.PRNGKey(9), 4)
    q = hax.random.normal(ks[0], (Batch, Pos, Heads, Key))
    k = hax.random.normal(ks[1], (Batch, KPos, Heads, Key))
    v = hax.random.normal(ks[2], (Heads, Batch, KPos, Key))
    causal = hattn.causal_mask(Pos, KPos)
    padding = hax.named(jnp.arange(20)[None, :] < jnp.array([[20], [13]]), (Batch, KPos))  # per-row lengths
    for mask in (None, causal, hax.broadcast_axis(causal, Batch) & padding):
        want = hattn.dot_product_attention(KPos, Key, q, k, v, mask=mask)
        got = dot_product_attention(KPos, Key, q, k, v, mask=mask)
        assert [a.name for a in got.axes] == [a.name for a in want.axes]
        np.testing.assert_allclose(np.asarray(got.array), np.asarray(want.array), rtol=1e-5, atol=1e-5)
    bias = hax.random.normal(ks[3], (Pos, KPos))  # served by haliax itself, with a warning
    with pytest.warns(axkern.FallbackWarning, match="bias given; running haliax.nn.attention") as record:
        got = dot_product_attention(KPos, Key, q, k, v, bias=bias)
    assert record[0].filename == __file__  # the caller's line
    np.testing.assert_array_equal(
        np.asarray(got.array), np.asarray(hattn.dot_product_attention(KPos, Key, q, k, v, bias=bias).array)
    )
    # an axkern mask goes to axkern.attention as it is: its empty tiles are skipped
    want = hattn.dot_product_attention(KPos, Key, q, k, v, mask=causal)
    got = dot_product_attention(KPos, Key, q, k, v, mask=masks.Causal())
    assert [a.name for a in got.axes] == [a.name for a in want.axes]
    np.testing.assert_allclose(np.asarray(got.array), np.asarray(want.array), rtol=1e-5, atol=1e-5)
    d = axkern.explain(lambda *a: dot_product_attention(KPos, Key, *a, mask=masks.Causal()), q, k, v)
    assert d.spec.flag("mask") == "Causal"
    with pytest.raises(ValueError, match="haliax cannot take the axkern mask"):
        dot_product_attention(KPos, Key, q, k, v, mask=masks.Causal(), bias=bias)


def test_masks_take_named_ids_in_any_batch_order():
    Micro, Batch = hax.Axis("micro", 2), hax.Axis("batch", 3)
    Pos, KPos = hax.Axis("position", 16), hax.Axis("key_position", 16)
    Heads, HeadDim = hax.Axis("heads", 2), hax.Axis("head_size", 8)
    a = _inputs(5, 6, 16, 16, 2, 2, 8, "float32")
    q = hax.named(a["q"].reshape(2, 3, 16, 2, 8), (Micro, Batch, Pos, Heads, HeadDim))
    k = hax.named(a["k"].reshape(2, 3, 16, 2, 8), (Micro, Batch, KPos, Heads, HeadDim))
    v = hax.named(a["v"].reshape(2, 3, 16, 2, 8), (Micro, Batch, KPos, Heads, HeadDim))
    seg = _seg(jax.random.PRNGKey(9), 6, 16)
    ids = hax.named(seg.reshape(2, 3, 16), (Micro, Batch, Pos))
    # ids laid out in another batch order than q's, and kv ids on the key axis
    q_ids = ids.rearrange((Pos, Batch, Micro))
    kv_ids = ids.rename({"position": "key_position"}).rearrange((Batch, KPos, Micro))
    mask = masks.Causal() & masks.Segments(q_ids, kv_ids)
    out = axkern.attention(q, k, v, mask=mask)
    want = attention(a["q"], a["k"], a["v"], mask=masks.Causal() & masks.Segments(seg, seg))
    np.testing.assert_allclose(out.array.reshape(6, 16, 2, 8), want, rtol=1e-5, atol=1e-6)
    # ids over a subset of the batch axes broadcast over the others
    shared = hax.named(seg[:3], (Batch, Pos))
    out2 = axkern.attention(q, k, v, mask=masks.Segments(shared, shared.rename({"position": "key_position"})))
    seg2 = jnp.tile(seg[:3], (2, 1))
    want2 = attention(a["q"], a["k"], a["v"], mask=masks.Segments(seg2, seg2))
    np.testing.assert_allclose(out2.array.reshape(6, 16, 2, 8), want2, rtol=1e-5, atol=1e-6)
    prefix = masks.PrefixLM(
        hax.named(jnp.array([[1, 2, 3], [4, 5, 6]]), (Micro, Batch)).rearrange((Batch, Micro))
    )
    out3 = axkern.attention(q, k, v, mask=prefix)
    want3 = attention(a["q"], a["k"], a["v"], mask=masks.PrefixLM(jnp.arange(1, 7)))
    np.testing.assert_allclose(out3.array.reshape(6, 16, 2, 8), want3, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="must carry position"):
        axkern.attention(q, k, v, mask=masks.Segments(ids["position", 0], kv_ids))
    with pytest.raises(TypeError, match="holds NamedArrays; pass it to axkern.attention"):
        attention(a["q"], a["k"], a["v"], mask=mask)
