"""ssd's `pallas_gpu` (and `xla`) compiled on a real GPU against the oracle rule.

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
