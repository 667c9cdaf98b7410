"""mamba3's implementations compiled on a real GPU against the oracle rule.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Oracle: `reference` (the
sequential scan) in float64 on the CPU; the rule's same-dtype reference is `reference` on the
test's dtype. Sizes are a Mamba-3 layer cut down in batch, length and heads; the length is not a
multiple of the chunk. MIMO of rank 2 on every implementation (chunks of 16 tokens: 32 kernel
positions), and of rank 4 on `pallas_gpu` at the bench's chunk (16 tokens: 64 positions, the
largest chunk of its float32 `x`).
"""

from __future__ import annotations

import jax
import pytest

import axkern
from tests.cases.mamba3 import call, make, run
from tests.harness import check_rule, implementations, serving

pytestmark = pytest.mark.gpu

# b, l, h, p, g, n, n_angles
GPU_DIMS = [(1, 700, 8, 64, 1, 128, 32), (2, 300, 4, 32, 2, 64, 16)]


@pytest.mark.parametrize(
    "impl,dtype,rank,dims",
    [
        (i, d, r, dims)
        for i in implementations("mamba3", "gpu")
        for d in ("bfloat16", "float32")
        for r in (0, 2)
        for dims in GPU_DIMS
    ]
    + [("pallas_gpu", "bfloat16", 4, GPU_DIMS[1])]
    + [("pallas_gpu", "float16", r, GPU_DIMS[0]) for r in (0, 2)],
)
def test_on_gpu_against_oracle(impl, dtype, rank, dims):
    arrays, seg = make(0, *dims, rank, dtype, segments=True)
    chunk = 64 if rank == 0 else 16
    with serving(impl):
        check_rule(
            lambda name, a: run(name, a, seg, None if name == "reference" else chunk),
            impl,
            arrays,
            dtype,
            "mamba3",
        )


def test_explicit_pallas_gpu_is_compiled():
    arrays, _ = make(0, 1, 256, 2, 64, 1, 64, 16, 0, "bfloat16", extras=False)
    d = axkern.explain(lambda a: call("pallas_gpu", a, chunk_size=64), arrays)
    assert d.implementation == "pallas_gpu" and not d.interpret
    y, _ = jax.jit(lambda a: call("pallas_gpu", a, chunk_size=64))(arrays)
    assert y.shape == (1, 256, 2, 64)
