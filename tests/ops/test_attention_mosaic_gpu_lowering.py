"""attention's Mosaic GPU kernels lowered for a CUDA GPU on the CPU (`lowering_platforms=("cuda",)`):
every Pallas-level step of the forward, `dq` and `dk, dv` kernels (shapes, layouts, `wgmma` tiles,
the ring's barriers, the masks' lowered leaves) runs here, so a change that breaks one fails in
CI, not first on a GPU. What only a GPU compile or run checks (registers, shared memory, the
values) is tests/gpu/test_attention_mosaic_gpu.py's; the kernels have no CPU interpret mode."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from axkern import masks
from axkern.ops.attention import OP, mosaic_gpu
from axkern.ops.attention.blocks import AttentionBlockSizes, mosaic_gpu_heuristic, mosaic_gpu_space
from tests.gpu_lowering import lower_for_cuda
from tests.ops.test_attention_mosaic_gpu import _spec

pytestmark = pytest.mark.skipif(
    mosaic_gpu.IMPORT_ERROR is not None, reason=f"Pallas Mosaic GPU: {mosaic_gpu.IMPORT_ERROR}"
)


def _lowered(f, *shapes) -> str:
    """The StableHLO text of `f` lowered for a CUDA GPU."""
    return lower_for_cuda(f, *shapes).as_text()


def _kernels(text: str) -> int:
    return len(re.findall(r"stablehlo.custom_call @mosaic_gpu", text))


def _ids(b, s, cut):
    return jnp.zeros((b, s), jnp.int32).at[:, cut:].set(1)


# name: (batch, q_len, kv_len, heads, kv_heads, head dim, dtype, mask, soft cap, sinks)
CASES = {
    "causal bf16 d64 ragged": (2, 1000, 1000, 4, 2, 64, "bfloat16", masks.Causal(), None, False),
    "full fp16 d128 q<kv": (1, 192, 520, 4, 4, 128, "float16", masks.Full(), None, True),
    "window look-ahead d128": (
        1,
        300,
        300,
        4,
        1,
        128,
        "bfloat16",
        masks.SlidingWindow(50, offset=20),
        30.0,
        False,
    ),
    "documents & causal d64": (2, 700, 700, 4, 2, 64, "bfloat16", "docs", None, True),
    "two-sided window d64": (
        1,
        333,
        333,
        4,
        2,
        64,
        "bfloat16",
        masks.SlidingWindow(65, offset=32),
        None,
        False,
    ),
    "prefix | window, & documents d128": (
        2,
        500,
        500,
        2,
        2,
        128,
        "bfloat16",
        "prefix|window&docs",
        8.0,
        False,
    ),
    # bounds beyond int32, compared with k - q clamped to int32's range
    "window and offset beyond int32 d64": (
        1,
        300,
        300,
        2,
        1,
        64,
        "bfloat16",
        masks.SlidingWindow(2**40, offset=-3) & masks.Causal(offset=2**40),
        None,
        False,
    ),
    # the keys just behind each query and those 700 or more behind: the blocks' tile lists skip
    # the empty key (query) tiles between the two parts
    "window | far keys (a gap) d128": (
        1,
        1200,
        1200,
        4,
        2,
        128,
        "bfloat16",
        masks.SlidingWindow(64) | masks.Causal(offset=-700),
        None,
        True,
    ),
}


def _mask(spec, b, s):
    if spec == "docs":
        ids = _ids(b, s, s // 3)
        return masks.Causal() & masks.Segments(ids, ids)
    if spec == "prefix|window&docs":
        ids = _ids(b, s, s // 2)
        return (masks.PrefixLM(jnp.array([3, 100])[:b]) | masks.SlidingWindow(64)) & masks.Segments(ids, ids)
    return spec


@pytest.mark.parametrize("name", CASES)
def test_forward_and_both_backward_kernels_lower_for_cuda(name):
    b, sq, sk, h, kvh, d, dtype, mask, cap, sinks = CASES[name]
    mask = _mask(mask, b, sq)
    dt = jnp.dtype(dtype)
    q = jax.ShapeDtypeStruct((b, sq, h, d), dt)
    kv = jax.ShapeDtypeStruct((b, sk, kvh, d), dt)
    s = jax.ShapeDtypeStruct((h,), jnp.float32)
    bs = mosaic_gpu_heuristic(_spec(dt, d=d))

    def f(q, k, v, s, do):
        def fn(q, k, v, s):
            return mosaic_gpu.attention(
                q, k, v, s if sinks else None, mask, scale=d**-0.5, logits_soft_cap=cap, block_sizes=bs
            )

        out, vjp = jax.vjp(fn, q, k, v, s)
        return out, vjp(do)

    # forward, dq, dk/dv; at head dim 64 dq comes from the dk/dv kernel's reductions by default
    assert _kernels(_lowered(f, q, kv, kv, s, q)) == (2 if d <= 64 else 3)


@pytest.mark.parametrize("d", [64, 128])
def test_lse_and_its_cotangent_lower_for_cuda(d):
    # return_lse: the same three kernels (two at head dim 64), lse's cotangent joining delta in XLA
    q = jax.ShapeDtypeStruct((1, 300, 4, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 300, 2, d), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((4,), jnp.float32)
    dl = jax.ShapeDtypeStruct((1, 300, 4), jnp.float32)
    bs = mosaic_gpu_heuristic(_spec(jnp.bfloat16, d=d))

    def f(q, k, v, s, do, dl):
        def fn(q, k, v, s):
            return mosaic_gpu.attention(
                q, k, v, s, masks.Causal(), scale=0.1, logits_soft_cap=None, block_sizes=bs, return_lse=True
            )

        (out, lse), vjp = jax.vjp(fn, q, k, v, s)
        return out, lse, vjp((do, dl))

    out = jax.eval_shape(f, q, kv, kv, s, q, dl)
    assert out[1].shape == (1, 300, 4) and out[1].dtype == jnp.float32
    assert _kernels(_lowered(f, q, kv, kv, s, q, dl)) == (2 if d <= 64 else 3)


def test_dq_by_defaults_to_reduction_at_head_dim_64_unless_deterministic(monkeypatch):
    from axkern.ops.attention.blocks import mosaic_gpu_dq_by

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert [mosaic_gpu_dq_by(d) for d in (64, 128, 256)] == ["reduction", "kernel", "kernel"]
    unset, given = AttentionBlockSizes(), AttentionBlockSizes(dq_by="kernel")
    assert mosaic_gpu.dq_by(unset, 64) == "reduction" and mosaic_gpu.dq_by(given, 64) == "kernel"
    line = OP.implementations["mosaic_gpu"].backward
    assert "TMA reductions" in line(_spec(d=64), mosaic_gpu_heuristic(_spec(d=64)))
    assert "TMA reductions" not in line(_spec(d=128), mosaic_gpu_heuristic(_spec(d=128)))
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    assert mosaic_gpu_dq_by(64) == "kernel"
    assert "TMA reductions" not in line(_spec(d=64), mosaic_gpu_heuristic(_spec(d=64)))
    assert "dq_by='reduction' at head dim 256" in mosaic_gpu.check_backward(
        masks.Causal(), AttentionBlockSizes(dq_by="reduction"), 256
    )
    assert AttentionBlockSizes(dq_by="atomics").validate() is not None


@pytest.mark.parametrize(
    "name", ["causal bf16 d64 ragged", "prefix | window, & documents d128", "window | far keys (a gap) d128"]
)
def test_dq_by_reduction_lowers_as_two_kernels(name):
    # dq added by the dk, dv kernel's TMA reductions: no dq kernel (GQA, soft cap, sinks too)
    import dataclasses

    b, sq, sk, h, kvh, d, dtype, mask, cap, sinks = CASES[name]
    mask = _mask(mask, b, sq)
    q = jax.ShapeDtypeStruct((b, sq, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, sk, kvh, d), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((h,), jnp.float32)
    bs = dataclasses.replace(mosaic_gpu_heuristic(_spec(jnp.bfloat16, d=d)), dq_by="reduction")

    def f(q, k, v, s, do):
        fn = lambda q, k, v, s: mosaic_gpu.attention(  # noqa: E731
            q, k, v, s, mask, scale=d**-0.5, logits_soft_cap=cap or 30.0, block_sizes=bs
        )
        out, vjp = jax.vjp(fn, q, k, v, s)
        return vjp(do)

    assert _kernels(_lowered(f, q, kv, kv, s, q)) == 2  # forward, dk/dv with dq (3 by the dq kernel)


@pytest.mark.parametrize("flags", [{}, {"overlap": True}])
def test_the_forward_forms_lower_with_a_tile_list(flags):
    # both ping-pong forms under a mask whose blocks walk a tile list
    q = jax.ShapeDtypeStruct((1, 1200, 2, 128), jnp.bfloat16)
    mask = CASES["window | far keys (a gap) d128"][7]
    assert mosaic_gpu.mask_schedule(mask, 1200, 1200, 64, 128).shape[1] > mosaic_gpu.LIST

    def f(q, k, v):
        return mosaic_gpu.forward(q, k, v, mask, scale=0.1, block_q=64, block_kv=128, num_stages=2, **flags)[
            0
        ]

    assert _kernels(_lowered(f, q, q, q)) == 1


@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_forward_tile_candidate_lowers(d):
    # the tuning space (and so the shipped table's tiles) at each head dim, causal, each tile in
    # the rendezvous and the overlap ping-pong (the candidates that vary the backward alone share
    # one of these forwards)
    spec = _spec(d=d)
    q = jax.ShapeDtypeStruct((1, 512, 2, d), jnp.bfloat16)
    forwards = {(c.block_q, c.block_kv, c.num_stages, c.ping_pong): c for c in mosaic_gpu_space(spec)}
    for c in forwards.values():

        def f(q, k, v, c=c):
            return mosaic_gpu.forward(
                q,
                k,
                v,
                masks.Causal(),
                scale=0.1,
                block_q=c.block_q,
                block_kv=c.block_kv,
                num_stages=c.num_stages,
                **mosaic_gpu.forward_flags(c),
            )[0]

        assert _kernels(_lowered(f, q, q, q)) == 1, c


# backward tilings (block_q, block_kv, stages) of dq and of dk, dv beside the heuristic's
# (64, 64, 2) each, as the H200's backward sweep timed them at head dims 64 and 128
BACKWARD_TILES = [
    ((64, 64, 3), (64, 64, 2)),
    ((64, 128, 2), (64, 64, 2)),
    ((64, 64, 2), (128, 64, 2)),
    ((64, 64, 2), (64, 64, 3)),
    ((64, 128, 2), (128, 64, 2)),
]


def test_backward_tilings_of_the_sweep_lower():
    q = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    for dq, dkv in BACKWARD_TILES:
        bs = AttentionBlockSizes(
            block_q=64,
            block_kv=128,
            num_stages=2,
            block_q_dq=dq[0],
            block_kv_dq=dq[1],
            num_stages_dq=dq[2],
            block_q_dkv=dkv[0],
            block_kv_dkv=dkv[1],
            num_stages_dkv=dkv[2],
        )

        def f(q, k, v, do, bs=bs):
            out, vjp = jax.vjp(
                lambda q, k, v: mosaic_gpu.attention(
                    q, k, v, None, masks.Causal(), scale=0.1, logits_soft_cap=None, block_sizes=bs
                ),
                q,
                k,
                v,
            )
            return vjp(do)

        assert _kernels(_lowered(f, q, q, q, q)) == 3, (dq, dkv)


def test_head_dim_256_backward_lowers_with_the_heuristics_tiles():
    # dq, then dv and dk in two launches (their accumulators together would not fit), one ring
    # stage; explain says so
    spec = _spec(d=256)
    asked = mosaic_gpu_heuristic(spec)
    line = OP.implementations["mosaic_gpu"].backward
    assert "dv, then dk (two launches" in line(spec, asked)
    mask = masks.Causal() & masks.Segments(_ids(2, 300, 100), _ids(2, 300, 100))
    q = jax.ShapeDtypeStruct((2, 300, 4, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 300, 2, 256), jnp.bfloat16)

    def f(q, k, v, do):
        fn = lambda q, k, v: mosaic_gpu.attention(  # noqa: E731
            q, k, v, None, mask, scale=0.0625, logits_soft_cap=20.0, block_sizes=asked
        )
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(do)

    assert _kernels(_lowered(f, q, kv, kv, q)) == 4  # forward, dq, dv, dk


@pytest.mark.parametrize("mask_name", ["causal", "documents | window"])
def test_the_overlap_forward_lowers(mask_name):
    # FA3's overlap inside a warpgroup (the turns on a barrier per warpgroup) beside the default
    # rendezvous, under a static mask and one holding arrays
    q = jax.ShapeDtypeStruct((2, 600, 2, 128), jnp.bfloat16)
    mask = masks.Causal()
    if mask_name != "causal":
        mask = masks.Segments(_ids(2, 600, 250), _ids(2, 600, 250)) | masks.SlidingWindow(64)

    def f(q, k, v):
        tiles = dict(block_q=64, block_kv=128, num_stages=2)
        return mosaic_gpu.forward(q, k, v, mask, scale=0.1, **tiles, overlap=True)

    assert _kernels(_lowered(f, q, q, q)) == 1


def test_pallas_gpu_kernels_lower_as_triton_with_default_tiles():
    # jax 0.10 lowers a `pallas_call` without compiler parameters to Mosaic GPU: the Triton
    # kernels name Triton's parameters even when no warps or stages are set
    from axkern.ops.attention import pallas_gpu

    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    bs = AttentionBlockSizes(block_q=64, block_kv=64)

    def f(q, k, v):
        def fn(q, k, v):
            return pallas_gpu.attention(
                q, k, v, None, masks.Causal(), scale=0.1, logits_soft_cap=None, block_sizes=bs
            )

        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(out)

    text = _lowered(f, q, q, q)
    assert _kernels(text) == 0
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 3  # forward, dq, dk/dv
