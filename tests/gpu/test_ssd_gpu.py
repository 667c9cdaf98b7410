"""ssd's `pallas_gpu` (and `xla`) compiled on a real GPU against the oracle rule.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Oracle: `reference` (the
sequential scan) in float64 on the CPU, as DESIGN.md says; the rule's same-dtype reference is
`reference` on the test's dtype (float32 products exact). Sizes are a Mamba-2 layer cut down
in batch and length.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import axkern
from axkern.positional import ssd
from tests.helpers import assert_oracle_rule, to64, x64
from tests.ops.test_ssd import make, run

pytestmark = pytest.mark.gpu


# float32 at (2, 512, 4, 32, 2, 64), 8 chunks of 64: the `A` and `dt_bias` gradients (sums of
# `d dt` over all positions) missed the bound on the H200 by up to 1.6x, `pallas_gpu` and `xla`
# alike (`git show ad250fb:benchmarks/results/h200/gpu_tests_ssd_f32_f64-oracle_2026-11-30f.log`): the rounding of
# `cum_t - cum_s`. Both now sum each segment on its own for float32 and pass on the H200
# (gpu_tests_ssd_2026-11-30g.log). Length 1500: 24 or 12 chunks, not a power of two (the
# recurrence kernels' all-chunks blocks; they passed at 1000, 16 or 8 chunks).
DIMS = [(1, 1500, 8, 64, 1, 128), (2, 512, 4, 32, 2, 64)]  # b, l, h, p, g, n


@pytest.mark.parametrize(
    "impl,dtype,segments,dims",
    [
        (i, d, s, dims)
        for i in ("pallas_gpu", "xla")
        for d in ("bfloat16", "float32")
        for s in (False, True)
        for dims in DIMS
    ],
)
def test_on_gpu_against_oracle(impl, dtype, segments, dims):
    arrays, seg = make(0, *dims, dtype, segments=segments)
    with x64(), jax.default_device(jax.devices("cpu")[0]):
        oracle = jax.tree.map(
            np.asarray, run("reference", {k: to64(v) for k, v in arrays.items()}, to64(seg))
        )
    with jax.default_matmul_precision("highest"):  # the plain scan's float32 products exact
        same = run("reference", arrays, seg)
    chunk = 64 if dtype == "float32" or impl == "xla" else 128  # pallas_gpu.MAX_CHUNK*
    got = run(impl, arrays, seg, chunk)
    assert_oracle_rule(got[0], same[0], oracle[0], dtype, f"ssd {impl} {dtype} y/final")
    assert_oracle_rule(got[1], same[1], oracle[1], dtype, f"ssd {impl} {dtype} grads")


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
