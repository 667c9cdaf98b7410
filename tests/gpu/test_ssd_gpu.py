"""ssd's `pallas_gpu`, `mosaic_gpu` (Hopper) and `xla` compiled on a real GPU against the oracle rule.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Oracle: `reference` (the
sequential scan) in float64 on the CPU, as DESIGN.md says; the rule's same-dtype reference is
`reference` on the test's dtype (float32 products exact). Sizes are a Mamba-2 layer cut down
in batch and length.
"""

from __future__ import annotations

import jax
import pytest

import axkern
from axkern.positional import ssd
from tests.cases.ssd import GPU_DIMS, make, run
from tests.harness import check_rule, implementations

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "impl,dtype,segments,dims",
    [
        (i, d, s, dims)
        for i in implementations("ssd", "gpu")
        if i != "mosaic_gpu"  # below: 16-bit inputs and feature dims of multiples of 64 only
        for d in ("bfloat16", "float32")
        for s in (False, True)
        for dims in GPU_DIMS
    ],
)
def test_on_gpu_against_oracle(impl, dtype, segments, dims):
    arrays, seg = make(0, *dims, dtype, segments=segments)
    # pallas_gpu's largest chunks for 16-bit inputs; float32 and xla at 64
    chunk = 64 if dtype == "float32" or impl == "xla" else 128
    check_rule(
        lambda name, a: run(name, a, seg, None if name == "reference" else chunk), impl, arrays, dtype, "ssd"
    )


# the Mosaic scan's cases: a length not a multiple of the chunk, groups 1 and 8, P 64 and 128
MOSAIC_DIMS = [(1, 1500, 8, 64, 1, 128), (2, 512, 8, 128, 8, 64)]


def _hopper() -> bool:
    from axkern.core import backend

    cc = backend.compute_capability() if backend.platform() == "gpu" else None
    return cc is not None and cc[0] == 9


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU scan needs a Hopper GPU")
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("dims", MOSAIC_DIMS)
def test_mosaic_gpu_against_oracle(segments, dims):
    dtype = "bfloat16"  # fp16 goes to pallas_gpu (mosaic_gpu.supports says why)
    # values and every gradient, with D, z, dt_bias and an initial state (the final state too)
    arrays, seg = make(0, *dims, dtype, segments=segments)
    check_rule(
        lambda name, a: run(name, a, seg, None if name == "reference" else 64),
        "mosaic_gpu",
        arrays,
        dtype,
        "ssd",
    )


def test_explicit_pallas_gpu_is_compiled():
    arrays, _ = make(0, 1, 256, 2, 64, 1, 64, "bfloat16", extras=False)
    d = axkern.explain(lambda a: ssd(**a, implementation="pallas_gpu", chunk_size=64), arrays)
    assert d.implementation == "pallas_gpu" and not d.interpret
    assert jax.jit(lambda a: ssd(**a, implementation="pallas_gpu", chunk_size=64))(arrays).shape == (
        1,
        256,
        2,
        64,
    )
