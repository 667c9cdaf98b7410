"""mamba3's Pallas kernels (SSD's chunk kernels with a per-position decay and scale) in interpret
mode against the sequential float64 oracle, outputs, final states and every gradient; and the
calls they refuse, with the reason. Pairwise cases: interpret mode is slow on a CPU."""

from __future__ import annotations

import pytest

import axkern
from tests.cases.mamba3 import call, forward, make, run
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
    ],
    ids=["tpu-siso-float32", "tpu-mimo1-bfloat16", "gpu-siso-bfloat16"],
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


def test_kernels_refuse_a_rank_above_one_and_small_tiles_with_the_reason():
    arrays, _ = make(0, 1, 16, 2, 16, 1, 16, 2, 2, "float32", extras=False)
    for impl in ("pallas_tpu", "pallas_gpu"):
        with pytest.raises(axkern.Unsupported, match="rank=2: the chunk kernels take one input per position"):
            call(impl, arrays, chunk_size=16)
    small, _ = make(0, 1, 16, 2, 8, 1, 16, 2, 0, "float32", extras=False)
    with pytest.raises(axkern.Unsupported, match="head_dim=8"):
        call("pallas_gpu", small, chunk_size=16)
    with pytest.raises(axkern.Unsupported, match="chunk_size=4 is below 8"):
        call("pallas_tpu", small, chunk_size=4)
    # the default order (xla) serves the MIMO call
    assert forward(None, arrays, None, 16)[0].shape == arrays["v"].shape
