"""fused_cross_entropy_loss `pallas_tpu` (the reduced loss's Mosaic TPU kernels): values and
gradients against the float64 oracle in interpret mode (every option, float32 and bfloat16, both
forms of the held logits, one to three chunks, ragged vocabulary tiles and token counts), the
refusals, the heuristic's sizes, and the kernels lowered for a TPU v5e at Llama-3's sizes.

Non-finite inputs: tests/ops/test_loss_numerics.py runs `pallas_tpu` for the reduced loss too (a
reduced `fused_cross_entropy` call that names it runs this op)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import CrossEntropyBlockSizes
from axkern.ops.fused_cross_entropy import blocks
from axkern.ops.fused_cross_entropy.api import LOSS_OP
from axkern.positional import fused_cross_entropy_loss as ce_loss
from tests.cases.fused_cross_entropy import OPTIONS, make, run_loss
from tests.harness import check_rule, jit
from tests.helpers import assert_nonfinite_rule, x64
from tests.tpu_lowering import as_tpu, lower_for_tpu, matmuls, mosaic_kernels, tpu_custom_calls

KERNELS = {"axkern_fused_cross_entropy_tpu_stats"} | {
    f"axkern_fused_cross_entropy_loss_tpu_{k}" for k in ("logits", "dx", "dw")
}

# every option but the soft cap: bfloat16 then holds the logits packed
UNCAPPED = {k: v for k, v in OPTIONS["all"].items() if k != "logits_soft_cap"}

# (dtype, options, reduction, n, d, v, chunk): tiles of 128 tokens by 128 columns. A vocabulary
# of 130, 200 or 300 ends in a ragged tile; 300 tokens in chunks of 128 are three chunks (the
# middle one in the loop), 200 two; 70 tokens take one tile of the padded chunk; an embedding
# of 640 is two slices of the dx and dw products (the second ragged). bfloat16
# without a soft cap holds the logits packed, float32 or a soft cap holds them in float32
CASES = [
    ("float32", "all", "mean", 300, 40, 200, 128),
    ("bfloat16", "plain", "sum", 300, 40, 130, 128),
    ("bfloat16", "all", "mean", 200, 24, 300, 128),
    ("bfloat16", "uncapped", "sum", 70, 640, 130, None),
]


@pytest.mark.parametrize("dtype,option,reduction,n,d,v,chunk", CASES)
def test_against_oracle(dtype, option, reduction, n, d, v, chunk):
    seed = CASES.index((dtype, option, reduction, n, d, v, chunk))
    arrays, options = make(seed, n, d, v, dtype, UNCAPPED if option == "uncapped" else OPTIONS[option])
    bs = CrossEntropyBlockSizes(block_tokens=128, block_vocab=128, chunk_tokens=chunk)
    what = f"fused_cross_entropy_loss pallas_tpu N={n} D={d} V={v} {option} {reduction}"
    kw = dict(reduction=reduction, options=options, block_sizes=bs)
    value, (dx, dw) = check_rule(run_loss, "pallas_tpu", arrays, dtype, what, interpret=True, **kw)
    assert value.dtype == jnp.float32 and dx.dtype == jnp.dtype(dtype) and dw.dtype == jnp.dtype(dtype)
    # undifferentiated, the value comes from the statistics kernel alone
    with axkern.use(interpret=True):
        primal = ce_loss(
            arrays["x"],
            arrays["w"],
            arrays["labels"],
            reduction=reduction,
            where=arrays.get("where"),
            implementation="pallas_tpu",
            block_sizes=bs,
            **options,
        )
    np.testing.assert_allclose(primal, value, rtol=1e-5)


def test_mixed_dtypes_and_a_gradient_cotangent():
    # bf16 hidden states with a float32 head: float32 products, dx in bf16 and dw in float32; the
    # loss scaled by 3 scales both gradients. A vocabulary under a tile: one tile of its size
    arrays, _ = make(9, 70, 24, 100, "float32")
    x, w, labels = arrays["x"].astype(jnp.bfloat16), arrays["w"], arrays["labels"]

    def grads(impl):
        def f(x, w):
            return 3.0 * ce_loss(x, w, labels, implementation=impl)

        return jit(jax.grad(f, argnums=(0, 1)))(x, w)

    with axkern.use(interpret=True):
        dx, dw = grads("pallas_tpu")
    rdx, rdw = grads("reference")
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(dw), np.asarray(rdw), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(rdx, np.float32), rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # the logits held in float32, packed
def test_non_finite_values_over_chunks_reach_what_they_reach_in_the_reference(dtype):
    # three chunks: a NaN in a dropped token's row (chunk 0) reaches nothing; an infinity in a
    # kept token's row (chunk 1) makes its dx row, every dw entry and the loss non-finite
    arrays, _ = make(7, 300, 24, 130, dtype)
    x = arrays["x"].at[5, 3].set(jnp.nan).at[200, 0].set(jnp.inf)
    where = jnp.arange(300) % 7 != 5
    bs = CrossEntropyBlockSizes(block_tokens=128, block_vocab=128, chunk_tokens=128)

    def run(impl, x):
        def f(x, w):
            return ce_loss(x, w, arrays["labels"], where=where, implementation=impl, block_sizes=bs)

        return jit(jax.value_and_grad(f, argnums=(0, 1)))(x, arrays["w"])

    with axkern.use(interpret=True):
        loss, (dx, dw) = run("pallas_tpu", x)
    want = run("reference", jnp.where(jnp.isfinite(x), x, jnp.nan))
    rtol = 1e-4 if dtype == "float32" else 3e-2  # the finite values: bf16 roundings apart
    assert_nonfinite_rule((loss, dx, dw), (want[0], *want[1]), f"pallas_tpu over chunks {dtype}", rtol=rtol)
    dx = np.asarray(dx)
    assert not dx[5].any() and np.isnan(dx[200]).all() and np.isfinite(np.delete(dx, 200, axis=0)).all()
    assert np.isnan(np.asarray(dw)).all() and np.isnan(loss)


def test_refusals_name_the_problem():
    x, w, labels = jnp.zeros((300, 16)), jnp.zeros((16, 300)), jnp.zeros(300, jnp.int32)

    def call(**bs):
        with axkern.use(interpret=True):
            return ce_loss(x, w, labels, implementation="pallas_tpu", block_sizes=bs)

    with pytest.raises(
        axkern.Unsupported, match="block_tokens=100: the TPU cross-entropy kernels take a multiple of 128"
    ):
        call(block_tokens=100, block_vocab=128)
    with pytest.raises(
        axkern.Unsupported, match="block_vocab=200: the TPU cross-entropy kernels take a multiple of 128"
    ):
        call(block_tokens=128, block_vocab=200)
    with pytest.raises(
        axkern.Unsupported, match="chunk_tokens=200: the TPU cross-entropy kernels take a multiple of 128"
    ):
        call(block_tokens=128, block_vocab=128, chunk_tokens=200)
    with pytest.raises(
        axkern.Unsupported, match="dw_accumulation='compensated': the TPU loss kernels add dw in float32"
    ):
        call(block_tokens=128, block_vocab=128, dw_accumulation="compensated")
    # on the chip, blocks over its VMEM are refused with the figures
    big = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
    with pytest.raises(axkern.Unsupported, match=r"need about \d+ MiB of VMEM, over the 96 MiB"):
        lower_for_tpu(
            lambda x, w, l: ce_loss(
                x, w, l, implementation="pallas_tpu", block_sizes=dict(block_tokens=2048, block_vocab=2048)
            ),
            big,
            jax.ShapeDtypeStruct((8192, 32000), jnp.bfloat16),
            jax.ShapeDtypeStruct((4096,), jnp.int32),
        )
    # float64 falls back, saying why
    with x64(), axkern.use(interpret=True):
        d = axkern.explain(
            lambda *a: ce_loss(*a, implementation=("pallas_tpu", "xla")),
            x.astype(jnp.float64),
            w.astype(jnp.float64),
            labels,
        )
    assert d.implementation == "xla" and "float64" in d.rejected[0].reason


# (tokens, embed, vocab, dtype, soft cap, chunks the heuristic takes)
HEURISTIC_CASES = [
    (8192, 4096, 128256, "bfloat16", None),  # Llama 3
    (8192, 2304, 262144, "bfloat16", None),  # Gemma
    (8192, 4096, 128256, "float32", None),
    (8192, 2304, 256000, "bfloat16", 30.0),  # Gemma 2, its soft cap
]


@pytest.mark.parametrize("n,d,v,dtype,cap", HEURISTIC_CASES)
def test_heuristic_fits_the_chip_and_holds_no_more_than_xla(n, d, v, dtype, cap):
    with as_tpu():
        spec = LOSS_OP.spec(
            {"tokens": n, "embed": d, "vocab": v}, dtype, logits_soft_cap=cap, with_sum=False, w_dtype=dtype
        )
    bs = blocks.pallas_tpu_loss_heuristic(spec)
    packed = blocks.pallas_tpu_loss_packed(spec)
    assert packed == (dtype == "bfloat16" and cap is None)
    assert bs.block_tokens % 128 == 0 and bs.block_vocab % 128 == 0 and bs.chunk_tokens % bs.block_tokens == 0
    need = blocks.pallas_tpu_loss_vmem_bytes(
        bs.block_tokens, bs.block_vocab, d, jnp.dtype(dtype).itemsize, packed
    )
    assert need <= blocks.tpu_vmem_bytes("TPU v5 lite") * 3 // 4
    # the held logits of a chunk take no more than xla's logits block
    assert bs.chunk_tokens * v * (2 if packed else 4) <= blocks.loss_heuristic(spec).block_tokens * v * 4
    space = blocks.pallas_tpu_loss_space(spec)
    assert space[0] == bs and len(space) > 1
    # the per-token op's statistics kernel, alone, takes the same tiles (those timed on the chip)
    # and fits with room to spare
    per_token = blocks.pallas_tpu_heuristic(spec)
    assert (per_token.block_tokens, per_token.block_vocab, per_token.chunk_tokens) == (
        bs.block_tokens,
        bs.block_vocab,
        None,
    )
    stats = blocks.pallas_tpu_stats_vmem_bytes(bs.block_tokens, bs.block_vocab, d, jnp.dtype(dtype).itemsize)
    assert stats < need
    assert blocks.pallas_tpu_space(spec)[0] == per_token and len(blocks.pallas_tpu_space(spec)) > 1


def test_explain_on_a_tpu_puts_the_kernels_first_and_describes_them():
    shapes = (
        jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((4096, 128256), jnp.bfloat16),
        jax.ShapeDtypeStruct((8192,), jnp.int32),
    )
    with as_tpu():
        default = axkern.explain(ce_loss, *shapes)
        kernel = axkern.explain(lambda *a: ce_loss(*a, implementation="pallas_tpu"), *shapes)
    assert default.implementation == "pallas_tpu" and not default.rejected
    assert kernel.backward == default.backward
    assert kernel.implementation == "pallas_tpu" and not kernel.interpret
    assert "2 chunk(s) of 4096 tokens" in kernel.backward and "packed 16-bit" in kernel.backward
    assert "float32 [V, D] buffer" in kernel.backward


# Lowered for a TPU v5e at Llama-3's and Gemma's sizes: forward and backward (and the
# undifferentiated value), three chunks (a middle one in the loop) in both forms of the held
# logits, and the heuristic's blocks
CAPPED = {"logits_soft_cap": 30.0, "logsumexp_weight": 1e-4, "label_smoothing": 0.1, "ignore_index": -100}
THREE_CHUNKS = dict(block_tokens=512, block_vocab=512, chunk_tokens=512)
# (tokens, embed, vocab, dtype, options, block sizes: None for the heuristic's on the chip)
LOWERINGS = {
    "bf16 packed, three chunks": (1536, 4096, 128256, "bfloat16", {}, THREE_CHUNKS),
    "f32, three chunks": (1536, 4096, 128256, "float32", {}, THREE_CHUNKS),
    "bf16 all options, three chunks": (1536, 4096, 128256, "bfloat16", CAPPED, THREE_CHUNKS),
    "llama3 N8192 bf16, the heuristic's": (8192, 4096, 128256, "bfloat16", {}, None),
    "gemma N8192 bf16, the heuristic's": (8192, 2304, 262144, "bfloat16", {}, None),
}


@pytest.mark.parametrize("case", list(LOWERINGS))
def test_lowers_for_a_tpu(case):
    n, d, v, dtype, options, bs = LOWERINGS[case]

    def fn(x, w, labels):
        def f(x, w):
            return ce_loss(x, w, labels, implementation="pallas_tpu", block_sizes=bs, **options)

        return f(x, w), jax.grad(f, argnums=(0, 1))(x, w)

    shapes = (
        jax.ShapeDtypeStruct((n, d), dtype),
        jax.ShapeDtypeStruct((d, v), dtype),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    lowered = lower_for_tpu(fn, *shapes)
    assert set(tpu_custom_calls(lowered)) == set(KERNELS)
    # 16-bit inputs: every product on 16-bit operands; float32 ones at full precision
    for name, module in mosaic_kernels(lowered):
        for lhs, rhs, precision in matmuls(module):
            if dtype == "bfloat16":
                assert (lhs, rhs) == ("bf16", "bf16"), f"{name}: a {lhs} x {rhs} product"
            else:
                assert precision == "fp32", f"{name}: a {lhs} x {rhs} product at {precision}"
    # nothing of [tokens, vocab] in float32: the largest arrays are the held logits (packed
    # 16-bit, or a chunk's in float32) and the dw sum
    vocabs = "|".join(str(-(-v // tile) * tile) for tile in (1, 512, 1024))  # V, in whole tiles
    assert not re.search(rf"\b({n}x({vocabs})|({vocabs})x{n})xf32", lowered.as_text())
