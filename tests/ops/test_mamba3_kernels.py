"""mamba3's Pallas kernels (SSD's chunk kernels with a per-position decay and scale) in interpret
mode against the sequential float64 oracle, outputs, final states and every gradient, SISO and
MIMO (each token's ranks as consecutive kernel positions); the calls they refuse, with the
reason; their chunk heuristics. Pairwise cases: interpret mode is slow on a CPU."""

from __future__ import annotations

import jax
import pytest

import axkern
from tests.cases.mamba3 import call, make, run
from tests.harness import check_rule


@pytest.mark.parametrize(
    "impl,dims,dtype,chunk,rank",
    [
        # odd head dim and state (TPU blocks take them whole), 2 groups, chunks of 8
        ("pallas_tpu", (2, 37, 4, 3, 2, 6, 2), "float32", 8, 0),
        # MIMO of rank 1: the halves' rotation pairing
        ("pallas_tpu", (1, 21, 2, 3, 1, 6, 2), "bfloat16", 8, 1),
        # Triton's smallest tiles, P = N = 16, length 37 over chunks of 16
        ("pallas_gpu", (1, 37, 2, 16, 1, 16, 4), "bfloat16", 16, 0),
        # MIMO of rank 2: chunks of 8 tokens (16 kernel positions) over a length of 13, a segment
        # starting inside the first chunk
        ("pallas_tpu", (1, 13, 2, 3, 1, 6, 2), "float32", 8, 2),
        # MIMO of rank 3: 4 positions a token (one of them zero), chunks of 4 tokens = 16 positions,
        # the segment starting at the second chunk
        ("pallas_gpu", (1, 13, 2, 16, 1, 16, 4), "bfloat16", 4, 3),
    ],
    ids=[
        "tpu-siso-float32",
        "tpu-mimo1-bfloat16",
        "gpu-siso-bfloat16",
        "tpu-mimo2-float32",
        "gpu-mimo3-bfloat16",
    ],
)
def test_kernels_against_sequential_oracle(impl, dims, dtype, chunk, rank):
    arrays, seg = make(0, *dims, rank, dtype, segments=True)
    check_rule(
        lambda name, a, **k: run(name, a, seg, chunk if name != "reference" else None),
        impl,
        arrays,
        dtype,
        "mamba3",
        interpret=True,
    )


def test_kernels_refuse_small_tiles_and_chunks_with_the_reason():
    small, _ = make(0, 1, 16, 2, 8, 1, 16, 2, 0, "float32", extras=False)
    with pytest.raises(axkern.Unsupported, match="head_dim=8"):
        call("pallas_gpu", small, chunk_size=16)
    with pytest.raises(axkern.Unsupported, match="chunk_size=4 is below 8"):
        call("pallas_tpu", small, chunk_size=4)
    # MIMO chunks count tokens; a token of rank 2 takes 2 kernel positions
    mimo, _ = make(0, 1, 16, 2, 16, 1, 16, 2, 2, "float32", extras=False)
    with pytest.raises(axkern.Unsupported, match=r"chunk_size=4 \(8 positions, 2 per token\) is below 16"):
        call("pallas_gpu", mimo, chunk_size=4)
    with pytest.raises(
        axkern.Unsupported, match=r"chunk_size=64 \(128 positions, 2 per token\) with float32"
    ):
        call("pallas_gpu", mimo, chunk_size=64)
    with pytest.raises(axkern.Unsupported, match=r"chunk_size=2 \(4 positions, 2 per token\) is below 8"):
        call("pallas_tpu", mimo, chunk_size=2)
    # a token wider than the largest float32 chunk
    wide = jax.ShapeDtypeStruct
    shapes = {
        k: wide(v.shape, v.dtype)
        for k, v in make(0, 1, 4, 1, 16, 1, 16, 0, 65, "float32", extras=False)[0].items()
    }
    with pytest.raises(axkern.Unsupported, match="rank=65: one token takes 128 kernel positions"):
        axkern.explain(lambda a: call("pallas_gpu", a), shapes)


@pytest.mark.parametrize(
    "impl,rank,chunk",
    [
        ("pallas_gpu", 0, 64),
        ("pallas_gpu", 3, 16),  # 4 positions a token: 64 positions
        ("pallas_gpu", 4, 16),
        ("pallas_tpu", 0, 128),
        ("pallas_tpu", 4, 32),  # 128 positions
        ("pallas_tpu", 16, 8),
    ],
)
def test_kernel_heuristics_count_tokens_per_chunk(impl, rank, chunk):
    arrays, _ = make(0, 1, 1024, 1, 16, 1, 16, 0, rank, "bfloat16", extras=False)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
    d = axkern.explain(lambda a: call(impl, a), shapes)
    assert d.implementation == impl and d.block_sizes.chunk_size == chunk
