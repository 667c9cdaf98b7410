"""`pallas_tpu`'s tuning space on a TPU v5e, on the CPU in CI (no chip needed): tiles up to 1024
where the kernels' VMEM estimate fits the limit they are compiled with, and the 1024-row and
1024-column tiles lower for the chip, forward and backward (the chip's compiler checks the VMEM
itself: `axkern tune attention --preset tpu` on the chip, benchmarks/tpu.sh's `tune_attention`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern import masks
from axkern.ops.attention.blocks import (
    TPU_VMEM_LIMIT,
    AttentionBlockSizes,
    pallas_tpu_heuristic,
    pallas_tpu_space,
    pallas_tpu_vmem_bytes,
)
from axkern.positional import attention
from tests.tpu_lowering import as_tpu, lower_for_tpu, tpu_custom_calls

S = jax.ShapeDtypeStruct


def _spec(length, heads, kv_heads, head_dim, dtype):
    q = S((2, length, heads, head_dim), dtype)
    k = S((2, length, kv_heads, head_dim), dtype)
    with as_tpu():
        d = axkern.explain(
            lambda q, k, v: attention(q, k, v, mask=masks.Causal(), implementation="pallas_tpu"), q, k, k
        )
    return d.spec


@pytest.mark.parametrize("head_dim,dtype", [(128, "bfloat16"), (128, "float32"), (256, "bfloat16")])
def test_the_space_reaches_1024_where_the_vmem_estimate_fits(head_dim, dtype):
    spec = _spec(8192, 32, 8, head_dim, dtype)
    space = pallas_tpu_space(spec)
    assert space[0] == pallas_tpu_heuristic(spec)
    tiles = {(b.block_q, b.block_kv) for b in space[1:]}
    itemsize = jnp.dtype(dtype).itemsize
    need = lambda q, k: pallas_tpu_vmem_bytes(q, k, head_dim, head_dim, itemsize)  # noqa: E731
    every = {(q, k) for q in (256, 512, 1024) for k in (256, 512, 1024)}
    first = (space[0].block_q, space[0].block_kv)
    assert tiles == {t for t in every if need(*t) <= TPU_VMEM_LIMIT} - {first} | {(128, 128)}
    assert (1024, 512) in tiles
    assert (1024, 1024) in tiles
    if (head_dim, dtype) == (128, "bfloat16"):
        assert first == (512, 1024)


@pytest.mark.parametrize(
    "length,head_dim,dtype,want",
    [
        (8192, 128, "bfloat16", (512, 1024)),
        (8192, 64, "bfloat16", (512, 1024)),
        (8192, 128, "float32", (256, 1024)),  # 512 by 1024 is over the estimate a chip compiled
        (8192, 256, "bfloat16", (256, 1024)),
        (8192, 256, "float32", (256, 512)),
        (1000, 128, "bfloat16", (512, 1024)),  # one tile each way, 24 rows of padding
        (2100, 128, "bfloat16", (256, 256)),  # larger tiles would pad to 2560 or 3072
        (1100, 128, "bfloat16", (256, 256)),
        (600, 128, "bfloat16", (128, 128)),  # 256 would pad to 768 where 128 pads to 640
        (300, 128, "bfloat16", (128, 128)),
        (40, 32, "float32", (64, 64)),
        (5, 32, "float32", (8, 8)),
    ],
)
def test_the_heuristic_takes_the_largest_tiles_that_fit(length, head_dim, dtype, want):
    spec = _spec(length, 8, 2, head_dim, dtype)
    got = pallas_tpu_heuristic(spec)
    assert (got.block_q, got.block_kv) == want
    assert pallas_tpu_vmem_bytes(*want, head_dim, head_dim, jnp.dtype(dtype).itemsize) <= 12.5 * 2**20


def test_a_short_sequence_keeps_tiles_within_its_length():
    space = pallas_tpu_space(_spec(300, 8, 2, 128, "bfloat16"))
    assert {(b.block_q, b.block_kv) for b in space[1:]} <= {
        (q, k) for q in (128, 256, 512) for k in (128, 256, 512)
    }


@pytest.mark.parametrize("block_q,block_kv", [(1024, 512), (512, 1024), (1024, 1024)])
def test_1024_tiles_lower_for_the_chip(block_q, block_kv):
    blocks = AttentionBlockSizes(block_q=block_q, block_kv=block_kv)

    def both(q, k, v):
        f = lambda q, k, v: attention(  # noqa: E731
            q, k, v, mask=masks.Causal(), implementation="pallas_tpu", block_sizes=blocks
        )
        grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
        return f(q, k, v), grads(q, k, v)

    q, kv = S((1, 2048, 4, 128), "bfloat16"), S((1, 2048, 2, 128), "bfloat16")
    kernels = tpu_custom_calls(lower_for_tpu(both, q, kv, kv))
    assert {f"axkern_attention_tpu_{k}_kernel" for k in ("fwd", "dq", "dkv")} <= set(kernels)
