"""short_conv compiled on a real GPU (Pallas Triton, CUDA) against the oracle rule, at real sizes.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Oracle: `reference` in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern.positional import short_conv as conv
from tests.helpers import assert_oracle_rule

pytestmark = pytest.mark.gpu


def _run(impl, x, w, b, seg, s0, cot, activation, block_sizes=None):
    def f(x, w, b, s0):
        y = conv(
            x,
            w,
            bias=b,
            segment_ids=seg,
            initial_state=s0,
            activation=activation,
            implementation=impl,
            block_sizes=block_sizes,
        )
        return jnp.sum(y.astype(jnp.float32) * cot), y

    (_, y), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(x, w, b, s0)
    return y, g


# cuda: channels a multiple of its 16-byte vector; small explicit tiles put halos across tiles
CASES = [
    ("pallas_gpu", 777, "silu", None),
    ("cuda", 776, "silu", None),
    ("cuda", 1024, None, {"block_seq": 8, "block_channels": 1024, "block_seq_backward": 16}),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("impl,channels,activation,blocks", CASES)
def test_gpu_against_oracle(impl, channels, activation, blocks, dtype, width, segments):
    batch, seq = 3, 1000
    ks = jax.random.split(jax.random.PRNGKey(width), 6)
    dt = jnp.dtype(dtype)
    x = jax.random.normal(ks[0], (batch, seq, channels)).astype(dt)
    w = (jax.random.normal(ks[1], (width, channels)) / width**0.5).astype(dt)
    b = jax.random.normal(ks[2], (channels,)).astype(dt)
    s0 = jax.random.normal(ks[3], (batch, width - 1, channels)).astype(dt)
    seg = (
        jnp.cumsum(jax.random.bernoulli(ks[4], 0.05, (batch, seq)), axis=1).astype(jnp.int32)
        if segments
        else None
    )
    cot = jax.random.normal(ks[5], (batch, seq, channels))
    args = (x, w, b, seg, s0, cot, activation)

    def up(a):
        return None if a is None else (a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a)  # noqa: E731

    oracle = _run("reference", *(up(a) for a in args[:6]), activation)
    same = _run("reference", *args)
    got = _run(impl, *args, block_sizes=blocks)
    assert_oracle_rule(got[0], same[0], oracle[0], dtype, f"{impl} y")
    assert_oracle_rule(got[1], same[1], oracle[1], dtype, f"{impl} grads")


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
