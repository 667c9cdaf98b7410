"""short_conv compiled on a real GPU (every GPU implementation) against the oracle rule, at real sizes.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Oracle: `reference` in float64
on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern.positional import short_conv as conv
from tests.cases.short_conv import GPU_BATCH_SEQ, GPU_CASES, make, run
from tests.harness import check_rule, implementations

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("segments", ["none", "mixed"])
@pytest.mark.parametrize("channels,activation,blocks,may_refuse", GPU_CASES)
@pytest.mark.parametrize("impl", implementations("short_conv", "gpu"))
def test_gpu_against_oracle(impl, channels, activation, blocks, may_refuse, dtype, width, segments):
    arrays = make(width, *GPU_BATCH_SEQ, channels, width, dtype, segments=segments)
    try:
        decision = axkern.explain(conv, arrays["x"], arrays["w"], activation=activation, implementation=impl)
    except axkern.Unsupported as refusal:
        assert may_refuse, f"{impl} refuses {channels} channels: {refusal}"
        assert f"channels ({channels}) must be a multiple of" in str(refusal)
        return
    assert decision.implementation == impl and not decision.interpret
    what = f"short_conv C={channels} W={width} {segments}"
    check_rule(run, impl, arrays, dtype, what, activation=activation, block_sizes=blocks)


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("segments", ["none", "mixed"])
@pytest.mark.parametrize("impl", implementations("short_conv", "gpu"))
def test_gpu_without_state_or_bias(impl, segments, weight_dtype):
    """No initial state (the CUDA kernels then read none: zeros before position 0) and no bias,
    bf16 x with a float32 or bf16 weight (read as it is)."""
    arrays = make(11, *GPU_BATCH_SEQ, 776, 4, "bfloat16", segments=segments, state=False, bias=False)
    arrays["w"] = arrays["w"].astype(weight_dtype)
    what = f"short_conv without state or bias, {weight_dtype} weight, {segments}"
    check_rule(run, impl, arrays, "bfloat16", what, activation="silu")


def test_gpu_order():
    x = jax.ShapeDtypeStruct((8, 4096, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 4096), jnp.bfloat16)
    assert axkern.explain(conv, x, w).implementation == "cuda"
    d = axkern.explain(lambda x, w: conv(x, w, activation="silu"), x, w)
    assert d.implementation == "cuda" and not d.interpret
    # channels that are not a multiple of the 16-byte vector: pallas_gpu, compiled
    x, w = jax.ShapeDtypeStruct((2, 64, 777), jnp.bfloat16), jax.ShapeDtypeStruct((4, 777), jnp.bfloat16)
    d = axkern.explain(conv, x, w)
    assert d.implementation == "pallas_gpu" and not d.interpret
    assert any("multiple of 8" in r.reason for r in d.rejected)
