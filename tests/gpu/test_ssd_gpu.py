"""ssd's pallas_gpu compiled on a real GPU (Pallas Triton) against the oracle rule.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Oracle: `reference` (the
sequential scan) on float32 inputs; the rule's same-dtype reference is `reference` on the
test's dtype. Sizes are a Mamba-2 layer cut down in batch and length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern.positional import ssd
from tests.helpers import assert_oracle_rule
from tests.ops.test_ssd import make, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("dims", [(1, 1000, 8, 64, 1, 128), (2, 512, 4, 32, 2, 64)])  # b, l, h, p, g, n
def test_pallas_gpu_against_oracle(dtype, segments, dims):
    arrays, seg = make(0, *dims, dtype, segments=segments)
    up = {k: v.astype(jnp.float32) for k, v in arrays.items()}
    with jax.default_matmul_precision(
        "highest"
    ):  # the oracle's float32 products exact, whatever XLA's GPU default
        oracle = run("reference", up, seg)
        same = run("reference", arrays, seg)
    got = run("pallas_gpu", arrays, seg, 128 if dtype == "bfloat16" else 64)  # pallas_gpu.MAX_CHUNK*
    assert_oracle_rule(got[0], same[0], oracle[0], dtype, f"ssd pallas_gpu {dtype} y/final")
    assert_oracle_rule(got[1], same[1], oracle[1], dtype, f"ssd pallas_gpu {dtype} grads")


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
