"""Block helpers (blocked loop, tables, validation) and backend facts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axkern.core import backend, blocks
from axkern.ops.fused_cross_entropy import CrossEntropyBlockSizes
from axkern.ops.fused_cross_entropy.api import OP
from axkern.ops.fused_cross_entropy.blocks import bucket, heuristic, loss_heuristic


@given(total=st.integers(0, 40), block=st.integers(1, 17))
def test_for_each_block_visits_every_index_once(total, block):
    sizes = []

    def fn(start, size, carry):
        sizes.append(size)
        assert size == block or size == total % block
        return carry.at[start + jnp.arange(size)].add(1)

    out = blocks.for_each_block(total, block, fn, jnp.zeros(total, jnp.int32))
    assert out.tolist() == [1] * total
    assert all(s <= block for s in sizes)


def test_next_power_of_2():
    assert [blocks.next_power_of_2(n) for n in (0, 1, 2, 3, 4, 5, 128256, 16384)] == [
        1,
        1,
        2,
        4,
        4,
        8,
        131072,
        16384,
    ]


def test_shipped_h200_table_is_found_by_bucket():
    spec = OP.spec({"tokens": 16384, "embed": 4096, "vocab": 128256}, jnp.bfloat16)
    spec = spec.__class__(**{**spec.__dict__, "device_key": "nvidia_h200", "platform": "gpu"})
    entry = blocks.lookup(OP.package, "nvidia_h200", "xla", bucket(spec))
    assert entry == {"block_tokens": 16384, "block_vocab": 4096}
    assert blocks.lookup(OP.package, "nvidia_h200", "reference", bucket(spec)) is None
    assert blocks.lookup(OP.package, "no_such_device", "xla", bucket(spec)) is None
    # one table holds both cross-entropy ops: each finds its own entry
    assert blocks.lookup(OP.package, "nvidia_h200", "xla", bucket(spec), op=OP.name) == entry
    loss = blocks.lookup(OP.package, "nvidia_h200", "xla", bucket(spec), op="fused_cross_entropy_loss")
    assert loss == {
        "block_tokens": 2048,
        "block_vocab": 128256,
        "dw_accumulation": "float32",
    }  # its sweep's best
    tiles = blocks.lookup(OP.package, "nvidia_h200", "pallas_gpu", bucket(spec), op=OP.name)
    assert tiles == {
        "block_tokens": 128,
        "block_vocab": 256,
        "block_embed": 64,
        "num_warps": 8,
        "num_stages": 3,
    }


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("n,v", [(1, 1), (7, 3), (300, 1000), (16384, 128256), (65536, 262144)])
def test_heuristic_is_valid_and_bounded(platform, n, v):
    spec = OP.spec({"tokens": n, "embed": 64, "vocab": v}, jnp.float32)
    spec = spec.__class__(**{**spec.__dict__, "platform": platform})
    bs = heuristic(spec)
    assert bs.validate(spec) is None
    assert 1 <= bs.block_tokens <= n and 1 <= bs.block_vocab <= v
    assert bs.block_tokens * bs.block_vocab * 4 <= 256 << 20


def test_shipped_h200_attention_table_is_found_and_becomes_block_sizes():
    from axkern.ops.attention.api import OP as ATTN
    from axkern.ops.attention.blocks import AttentionBlockSizes
    from axkern.ops.attention.blocks import bucket as attn_bucket

    dims = {"batch": 2, "q_len": 8192, "kv_len": 8192, "heads": 32, "kv_heads": 32, "head_dim": 128}
    spec = ATTN.spec({**dims, "v_dim": 128}, jnp.bfloat16, mask_kind="causal")
    entry = blocks.lookup(ATTN.package, "nvidia_h200", "pallas_gpu", attn_bucket(spec), op=ATTN.name)
    # the per-kernel sweep's fastest forward+backward, each kernel with its own tiles
    sweep = Path(__file__).parents[2] / "benchmarks/results/nvidia_h200/attention/sweep.json"
    rows = [r for r in json.loads(sweep.read_text())["rows"] if r["impl"] == "pallas_gpu" and "ms" in r]
    best = min(rows, key=lambda r: r["ms"])
    fields = [f.name for f in dataclasses.fields(AttentionBlockSizes)]
    assert entry == {k: best[k] for k in fields if best.get(k) is not None}
    bs = AttentionBlockSizes(**entry)
    assert (bs.kernel("fwd").block_q, bs.kernel("dq").block_kv, bs.kernel("dkv").num_stages) == (128, 32, 2)
    assert blocks.lookup(ATTN.package, "nvidia_h200", "xla", attn_bucket(spec), op=ATTN.name) is None


def test_shipped_h200_mosaic_attention_tiles_are_the_forward_sweeps_fastest():
    # per head dim and mask kind: the table's forward tiles are the fastest the sweep measured
    from axkern.ops.attention.api import OP as ATTN
    from axkern.ops.attention.blocks import bucket as attn_bucket

    sweep = Path(__file__).parents[2] / "benchmarks/results/nvidia_h200/attention/sweep_mosaic_forward.json"
    data = json.loads(sweep.read_text())
    kinds = {"causal": "causal", "full": "full", "window1024": "window", "docs1024": "documents"}
    cases = 0
    for case in {r["case"] for r in data["rows"]}:
        mask, heads, d = case.split()
        q_heads, _, kv_heads = heads[1:].partition("/")
        d = int(d[1:])
        dims = {"batch": 2, "q_len": 8192, "kv_len": 8192, "heads": int(q_heads)}
        dims |= {"kv_heads": int(kv_heads or q_heads), "head_dim": d, "v_dim": d}
        spec = ATTN.spec(dims, jnp.bfloat16, mask_kind=kinds[mask])
        entry = blocks.lookup(ATTN.package, "nvidia_h200", "mosaic_gpu", attn_bucket(spec), op=ATTN.name)
        timed = [r for r in data["rows"] if r["case"] == case and "median_ms" in r]
        best = min(timed, key=lambda r: r["median_ms"])
        assert "x".join(str(entry[f]) for f in ("block_q", "block_kv", "num_stages")) == best["tiles"], case
        cases += 1
    assert cases == 8


def test_block_sizes_validation_messages():
    assert CrossEntropyBlockSizes(block_tokens=8, block_vocab=16).validate() is None
    assert "positive int" in CrossEntropyBlockSizes(block_tokens=0).validate()
    assert "positive int" in CrossEntropyBlockSizes(block_vocab=2.5).validate()
    assert str(CrossEntropyBlockSizes(8, 16)) == "CrossEntropyBlockSizes(block_tokens=8, block_vocab=16)"
    # a field of named choices (the reduced loss's dw accumulation) takes one of its strings
    assert CrossEntropyBlockSizes(dw_accumulation="compensated").validate() is None
    why = CrossEntropyBlockSizes(dw_accumulation=2).validate()
    assert why == (
        "CrossEntropyBlockSizes.dw_accumulation must be one of 'compensated', 'compensated_int8', 'float32', "
        "'plain' or None, got 2"
    )


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("n,d,v", [(1, 1, 1), (300, 64, 1000), (16384, 4096, 128256), (16384, 2304, 262144)])
def test_loss_heuristic_rows_and_dw_slab(platform, n, d, v):
    # rows: a float32 [rows, V] block of the platform's budget or D / 2 rows, a power of two;
    # the dw slab: the platform's columns, at most V
    spec = OP.spec({"tokens": n, "embed": d, "vocab": v}, jnp.bfloat16)
    spec = spec.__class__(**{**spec.__dict__, "platform": platform})
    bs = loss_heuristic(spec)
    assert bs.validate(spec) is None and bs.dw_accumulation is None
    slab = {"gpu": 8192, "tpu": 4096, "cpu": 1024}[platform]
    assert bs.block_vocab == min(v, slab)
    budget = {"gpu": 512 << 20, "tpu": 128 << 20, "cpu": 16 << 20}[platform] // (4 * v)
    rows = max(8, 1 << (max(budget, d // 2).bit_length() - 1))
    assert bs.block_tokens == min(n, rows)


@pytest.mark.parametrize(
    "kind,key",
    [
        ("NVIDIA H200", "nvidia_h200"),
        ("NVIDIA H100 80GB HBM3", "nvidia_h100"),
        ("NVIDIA A100-SXM4-80GB", "nvidia_a100"),
        ("TPU v5 lite", "tpu_v5e"),
        ("TPU v5p", "tpu_v5p"),
        ("TPU v4", "tpu_v4"),
        ("cpu", "cpu"),
    ],
)
def test_device_keys(kind, key):
    assert backend.key_for(kind) == key


def test_backend_here():
    assert backend.platform() == "cpu"
    assert backend.device_key() == "cpu"
    assert backend.compute_capability() is None
