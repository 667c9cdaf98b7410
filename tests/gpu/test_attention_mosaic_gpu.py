"""attention's `mosaic_gpu` kernels (Pallas Mosaic GPU, Hopper) on a real GPU: values and gradients
against the float64 oracle by the rule (the Mosaic `dq` and `dk, dv` kernels; at head dim 256
`dq`, then `dv` and `dk` in two launches), its `lse`, rows that see no key, and its refusals in the dispatcher.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu/test_attention_mosaic_gpu.py`. Needs a
GPU of compute capability 9.x; elsewhere these tests are skipped with the reason.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import masks
from axkern.core import backend
from axkern.ops.attention import mosaic_gpu
from axkern.positional import attention
from tests.cases.attention import inputs as _inputs
from tests.cases.attention import run as _run
from tests.harness import check_rule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        jax.default_backend() == "gpu" and (backend.compute_capability() or (0,))[0] != 9,
        reason="the Mosaic GPU kernel needs a Hopper GPU (compute capability 9.x)",
    ),
]


# The float64 oracle materialises `[B, KVH, G, Sq, Sk, D]` on the CPU: sizes stay near 40M of
# those elements (a few seconds each)
def _docs(b, n, *sizes):
    """Segment ids `[b, n]`: documents of `sizes[r]` positions in batch row `r`."""
    return jnp.stack([jnp.arange(n) // sizes[r] for r in range(b)])


_DOCS700 = _docs(2, 700, 150, 256)
_DOCS300 = _docs(1, 300, 70)
CASES = {
    # name: (b, sq, sk, heads, kv_heads, head_dim, dtype, mask, block sizes or None: the heuristic's)
    "causal bf16 d128 gqa2": (1, 384, 384, 2, 1, 128, "bfloat16", masks.Causal(), None),
    "full fp16 d64": (2, 256, 256, 2, 2, 64, "float16", masks.Full(), None),
    "window100 bf16 d256 ragged": (1, 250, 250, 2, 1, 256, "bfloat16", masks.SlidingWindow(100), None),
    "causal+384 bf16 d128 q128 k512": (1, 128, 512, 2, 2, 128, "bfloat16", masks.Causal(offset=384), None),
    "causal&window150 fp16 d64 ragged": (
        1,
        333,
        333,
        4,
        2,
        64,
        "float16",
        masks.Causal() & masks.SlidingWindow(150),
        {"block_q": 64, "block_kv": 64, "num_stages": 3},
    ),
    "causal bf16 d64 gqa4 ragged1000": (1, 1000, 1000, 4, 1, 64, "bfloat16", masks.Causal(), None),
    "window64-lookahead fp16 d128 gqa2 q200 k300": (
        1,
        200,
        300,
        4,
        2,
        128,
        "float16",
        masks.SlidingWindow(64, offset=100),
        {"block_q_dq": 64, "block_kv_dq": 128, "block_q_dkv": 128, "block_kv_dkv": 64},
    ),
    "packed docs causal bf16 d128 gqa2 b2 ragged700": (
        2,
        700,
        700,
        4,
        2,
        128,
        "bfloat16",
        masks.Causal() & masks.Segments(_DOCS700, _DOCS700),
        None,
    ),
    "packed docs fp16 d64 300": (1, 300, 300, 2, 1, 64, "float16", masks.Segments(_DOCS300, _DOCS300), None),
    "packed docs causal bf16 d64 tiles 64x256": (
        1,
        300,
        300,
        2,
        1,
        64,
        "bfloat16",
        masks.Causal() & masks.Segments(_DOCS300, _DOCS300),
        {"block_q": 64, "block_kv": 256, "num_stages": 2},
    ),
    "causal bf16 d128 blocks128x64x3": (
        1,
        384,
        384,
        2,
        1,
        128,
        "bfloat16",
        masks.Causal(),
        {"block_q": 128, "block_kv": 64, "num_stages": 3},
    ),
}


_PREFIX = masks.PrefixLM(jnp.array([70, 200]))
_DOCS260 = _docs(2, 260, 50, 90)
# name: (b, sq, sk, heads, kv_heads, head_dim, dtype, mask, block sizes or None, soft cap, sinks)
MORE_CASES = {
    "prefix-LM bf16 d128 gqa2 b2 ragged300": (2, 300, 300, 4, 2, 128, "bfloat16", _PREFIX, None, None, False),
    "window100 | prefix-LM fp16 d64 b2": (
        2,
        300,
        300,
        2,
        1,
        64,
        "float16",
        masks.SlidingWindow(100) | _PREFIX,
        None,
        None,
        False,
    ),
    "packed docs | window40 bf16 d64 b2 gqa8": (
        2,
        260,
        260,
        8,
        1,
        64,
        "bfloat16",
        masks.Segments(_DOCS260, _DOCS260) | masks.SlidingWindow(40),
        None,
        None,
        False,
    ),
    "causal soft cap 5 sinks bf16 d128 gqa2": (
        1,
        384,
        384,
        4,
        2,
        128,
        "bfloat16",
        masks.Causal(),
        None,
        5.0,
        True,
    ),
    "prefix-LM & docs soft cap 3 fp16 d64": (
        2,
        260,
        260,
        2,
        2,
        64,
        "float16",
        _PREFIX & masks.Segments(_DOCS260, _DOCS260),
        None,
        3.0,
        False,
    ),
    # 8191: no tile divides it, on either side (the oracle stays small with the other side short)
    "causal+8063 bf16 d64 q128 k8191": (
        1,
        128,
        8191,
        1,
        1,
        64,
        "bfloat16",
        masks.Causal(offset=8063),
        None,
        None,
        False,
    ),
    "full fp16 d64 gqa2 q8191 k64": (1, 8191, 64, 2, 1, 64, "float16", masks.Full(), None, None, False),
    # sinks on rows that see no key (the first 20 queries): output 0, lse the sink
    "causal-20 sinks bf16 d64 q100 k140": (
        1,
        100,
        140,
        2,
        1,
        64,
        "bfloat16",
        masks.Causal(offset=-20),
        None,
        None,
        True,
    ),
    # head dim 256, its tiles given (the heuristic's: dq, then dv and dk in two launches)
    "docs causal soft cap 20 bf16 d256 mosaic backward": (
        2,
        700,
        700,
        4,
        2,
        256,
        "bfloat16",
        masks.Causal() & masks.Segments(_DOCS700, _DOCS700),
        {
            "block_q": 64,
            "block_kv": 64,
            "num_stages": 2,
            "block_q_dq": 64,
            "block_kv_dq": 64,
            "num_stages_dq": 1,
            "block_q_dkv": 64,
            "block_kv_dkv": 64,
            "num_stages_dkv": 1,
        },
        20.0,
        False,
    ),
    "window100 soft cap 8 sinks bf16 d256 ragged": (
        1,
        250,
        250,
        2,
        1,
        256,
        "bfloat16",
        masks.SlidingWindow(100),
        None,
        8.0,
        True,
    ),
    # a two-sided window: 32 keys either side of the query's own
    "two-sided window65 bf16 d128 gqa2 ragged333": (
        1,
        333,
        333,
        4,
        2,
        128,
        "bfloat16",
        masks.SlidingWindow(65, offset=32),
        None,
        None,
        False,
    ),
    # the model's head counts: 32 query heads over 8 and over 4 kv heads (short lengths keep the
    # oracle's [B, KVH, G, Sq, Sk, D] near 40M elements)
    "causal bf16 d64 gqa 32/8 ragged130": (
        1,
        130,
        130,
        32,
        8,
        64,
        "bfloat16",
        masks.Causal(),
        None,
        None,
        False,
    ),
    "docs causal sinks fp16 d128 gqa 32/4 96": (
        1,
        96,
        96,
        32,
        4,
        128,
        "float16",
        masks.Causal() & masks.Segments(_docs(1, 96, 40), _docs(1, 96, 40)),
        None,
        None,
        True,
    ),
    # the keys just behind each query and those far behind: a gap of empty tiles between the
    # two parts, which the blocks' tile lists skip (forward, dq, dk/dv; at d64 dq by reductions)
    "window64 | far keys bf16 d128 gqa2 ragged1200": (
        1,
        1200,
        1200,
        4,
        2,
        128,
        "bfloat16",
        masks.SlidingWindow(64) | masks.Causal(offset=-700),
        None,
        None,
        False,
    ),
    "window40 | far keys sinks fp16 d64 900": (
        1,
        900,
        900,
        2,
        1,
        64,
        "float16",
        masks.SlidingWindow(40) | masks.Causal(offset=-500),
        None,
        None,
        True,
    ),
}


def _case(name):
    """A case of `CASES` (no soft cap, no sinks) or `MORE_CASES`, as the latter's 11 fields."""
    return (*CASES[name], None, False) if name in CASES else MORE_CASES[name]


@pytest.mark.parametrize("name", list(CASES) + list(MORE_CASES))
def test_against_oracle(name):
    b, sq, sk, h, kvh, d, dtype, mask, blocks, cap, sinks = _case(name)
    a = _inputs([*CASES, *MORE_CASES].index(name), b, sq, sk, h, kvh, d, dtype)
    check_rule(
        _run, "mosaic_gpu", a, dtype, f"attention {name}", mask=mask, sinks=sinks, cap=cap, blocks=blocks
    )


# return_lse through the dispatcher (the guard passes `lse` and its cotangent): name, case
LSE_CASES = [
    "causal soft cap 5 sinks bf16 d128 gqa2",
    "causal-20 sinks bf16 d64 q100 k140",
    "packed docs | window40 bf16 d64 b2 gqa8",
    "window100 soft cap 8 sinks bf16 d256 ragged",
    "causal bf16 d64 gqa4 ragged1000",
]


@pytest.mark.parametrize("name", LSE_CASES)
def test_lse_against_oracle(name):
    b, sq, sk, h, kvh, d, dtype, mask, blocks, cap, sinks = _case(name)
    a = _inputs(40 + LSE_CASES.index(name), b, sq, sk, h, kvh, d, dtype)
    check_rule(
        _run,
        "mosaic_gpu",
        a,
        dtype,
        f"attention lse {name}",
        mask=mask,
        sinks=sinks,
        cap=cap,
        blocks=blocks,
        lse=True,
    )


def test_lse_and_rows_that_see_no_key():
    # Causal(offset=-100): the first 100 queries see no key (zeros, lse -inf); 1000 queries pad
    # to whole blocks of 128 rows and the keys to whole 128-key tiles
    a = _inputs(9, 1, 1000, 1000, 4, 2, 128, "bfloat16")
    mask = masks.Causal(offset=-100)
    out, lse = jax.jit(
        lambda q, k, v: mosaic_gpu.forward(q, k, v, mask, scale=0.1, block_q=64, block_kv=128, num_stages=2)
    )(a["q"], a["k"], a["v"])
    q, k = (np.asarray(a[n], np.float32) for n in ("q", "k"))
    s = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, axis=2)) * 0.1
    vis = np.asarray(mask.dense(1000, 1000))[:, None]
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = (m + np.log(np.exp(s - np.where(np.isfinite(m), m, 0)).sum(-1, keepdims=True)))[..., 0]
    lse = np.asarray(lse)
    assert lse.shape == (1, 4, 1000) and out.shape == (1, 1000, 4, 128)
    assert np.all(lse[:, :, :100] == -np.inf) and np.all(np.asarray(out)[:, :100] == 0)
    np.testing.assert_allclose(lse[:, :, 100:], want[:, :, 100:], atol=2e-2, rtol=0)
    want_out = attention(a["q"], a["k"], a["v"], mask=mask, scale=0.1, implementation="reference")
    np.testing.assert_allclose(
        np.asarray(out, np.float32)[:, 100:], np.asarray(want_out, np.float32)[:, 100:], atol=3e-2
    )


def test_explain_names_it_and_its_backward_and_it_falls_back_with_reasons():
    a = _inputs(0, 1, 256, 256, 4, 4, 128, "bfloat16")
    att = axkern.positional.attention
    d = axkern.explain(
        lambda q, k, v: att(q, k, v, mask=masks.Causal(), implementation="mosaic_gpu"), a["q"], a["k"], a["v"]
    )
    assert d.implementation == "mosaic_gpu" and "Mosaic GPU kernels: dq (64x128" in d.backward
    assert d.block_sizes.block_q == 64 and d.block_sizes.num_stages == 2
    # after cuDNN in the GPU order: it serves what cuDNN cannot (packed documents here)
    assert axkern.explain(att, a["q"], a["k"], a["v"]).implementation == "cudnn"
    order = ("mosaic_gpu", "pallas_gpu")
    ids = jnp.zeros((1, 256), jnp.int32).at[:, 100:].set(1)
    docs = masks.Causal() & masks.Segments(ids, ids)
    d = axkern.explain(lambda q, k, v: att(q, k, v, mask=docs, implementation=order), a["q"], a["k"], a["v"])
    assert d.implementation == "mosaic_gpu"  # packed documents: its run-time schedule
    dense = masks.Dense(jnp.ones((1, 256, 256), bool))
    to_xla = ("mosaic_gpu", "xla")
    d = axkern.explain(
        lambda q, k, v: att(q, k, v, mask=dense, implementation=to_xla), a["q"], a["k"], a["v"]
    )
    assert d.implementation == "xla" and "Dense" in d.rejected[0].reason, d
    b = _inputs(0, 1, 256, 256, 4, 4, 96, "bfloat16")
    d = axkern.explain(
        lambda q, k, v: att(q, k, v, implementation=("mosaic_gpu", "xla")), b["q"], b["k"], b["v"]
    )
    assert d.implementation == "xla" and "head dims 96" in d.rejected[0].reason
    f = {n: v.astype(jnp.float32) for n, v in a.items()}
    d = axkern.explain(lambda q, k, v: att(q, k, v, implementation=order), f["q"], f["k"], f["v"])
    assert "bf16 or fp16" in d.rejected[0].reason


def test_non_finite_input_goes_to_the_rule_following_implementation():
    # a NaN in v's key 5 reaches only the queries that see key 5 (causal: queries >= 5)
    a = _inputs(2, 1, 256, 256, 2, 2, 64, "bfloat16")
    v = a["v"].at[0, 5, 0, 0].set(jnp.nan)
    out = jax.jit(lambda q, k, v: attention(q, k, v, mask=masks.Causal(), implementation="mosaic_gpu"))(
        a["q"], a["k"], v
    )
    out = np.asarray(out, np.float32)
    assert np.isfinite(out[0, :5]).all() and np.isnan(out[0, 5:, 0, 0]).all()
    assert np.isfinite(out[0, :, 1]).all()  # the other head's kv head holds no NaN


def test_packed_documents_with_traced_ids_differentiate_under_jit():
    # the ids as an argument of the jitted function: grad of it (the mask's arrays reach the
    # custom_vjp and the guard as arguments), against xla in float32
    a = _inputs(3, 1, 256, 256, 2, 1, 64, "bfloat16")
    ids = _docs(1, 256, 100)

    def loss(q, k, v, ids, impl):
        out = attention(q, k, v, mask=masks.Causal() & masks.Segments(ids, ids), implementation=impl)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    args = (a["q"], a["k"], a["v"], ids)
    got = jax.grad(jax.jit(functools.partial(loss, impl="mosaic_gpu")), argnums=(0, 1, 2))(*args)
    f32 = tuple(x.astype(jnp.float32) for x in args[:3]) + (ids,)
    want = jax.grad(functools.partial(loss, impl="xla"), argnums=(0, 1, 2))(*f32)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w)
        assert np.abs(g - w).max() <= 3e-2 * np.abs(w).max(), np.abs(g - w).max()


@pytest.mark.parametrize("mask_name", ["causal", "docs | window", "window | far keys"])
def test_the_overlap_ping_pong_computes_what_the_rendezvous_does(mask_name):
    # the overlap runs the same sums in the same order as the rendezvous (the form the oracle
    # tests above check) a turn later; only a multiply-add contracted otherwise in the running
    # sum could move an output by its rounding
    a = _inputs(11, 2, 700, 700, 4, 2, 128, "bfloat16")
    mask = {
        "causal": masks.Causal(),
        "docs | window": masks.Segments(_DOCS700, _DOCS700) | masks.SlidingWindow(64),
        "window | far keys": masks.SlidingWindow(64) | masks.Causal(offset=-400),  # a tile list
    }[mask_name]

    def run(**flags):
        fn = lambda q, k, v: mosaic_gpu.forward(  # noqa: E731
            q, k, v, mask, scale=0.1, block_q=64, block_kv=128, num_stages=2, **flags
        )
        return jax.jit(fn)(a["q"], a["k"], a["v"])

    (o1, l1), (o2, l2) = run(), run(overlap=True)
    assert bool(jnp.all(jnp.isinf(l1) == jnp.isinf(l2)))
    o1, o2 = np.asarray(o1, np.float32), np.asarray(o2, np.float32)
    assert np.abs(o1 - o2).max() <= 2**-7 * np.abs(o1).max(), np.abs(o1 - o2).max()
    finite = np.isfinite(np.asarray(l1))
    np.testing.assert_allclose(np.asarray(l2)[finite], np.asarray(l1)[finite], rtol=1e-5, atol=1e-5)


# dq by the dk, dv kernel's TMA reductions (`dq_by="reduction"`): GQA, masks, soft cap, sinks,
# fp16, lengths no tile divides
REDUCTION_CASES = [
    "causal bf16 d128 gqa2",
    "causal&window150 fp16 d64 ragged",
    "packed docs causal bf16 d128 gqa2 b2 ragged700",
    "causal soft cap 5 sinks bf16 d128 gqa2",
    "prefix-LM & docs soft cap 3 fp16 d64",
    "packed docs | window40 bf16 d64 b2 gqa8",
    "full fp16 d64 gqa2 q8191 k64",
    "causal-20 sinks bf16 d64 q100 k140",
]


@pytest.mark.parametrize("name", REDUCTION_CASES)
def test_dq_by_reduction_against_oracle(name):
    b, sq, sk, h, kvh, d, dtype, mask, blocks, cap, sinks = _case(name)
    a = _inputs([*CASES, *MORE_CASES].index(name), b, sq, sk, h, kvh, d, dtype)
    blocks = {**(blocks or {}), "dq_by": "reduction"}
    check_rule(
        _run,
        "mosaic_gpu",
        a,
        dtype,
        f"attention {name} dq_by reduction",
        mask=mask,
        sinks=sinks,
        cap=cap,
        blocks=blocks,
    )
