"""fused_cross_entropy compiled on a real GPU, at real sizes, against the oracle rule.

Run on a GPU machine with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. The oracle
is the `reference` implementation in float32 at `precision=HIGHEST` (true float32 products,
no TF32) on the device, as DESIGN.md allows where float64 on the CPU would take too long
(`[tokens, vocab]` logits of 8192 x 128256).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import CrossEntropyBlockSizes
from axkern.core.backend import compute_capability
from axkern.core.op import Unsupported
from axkern.ops.fused_cross_entropy import mosaic_gpu
from axkern.positional import fused_cross_entropy
from axkern.positional import fused_cross_entropy_loss as ce_loss
from tests.cases.fused_cross_entropy import GPU_CASES, make, run, run_loss
from tests.harness import check_rule, implementations, oracle
from tests.helpers import assert_oracle_rule


def ce(*args, **kwargs):
    """Per-token `(loss, lse)`."""
    return fused_cross_entropy(*args, reduction=None, return_lse=True, **kwargs)


pytestmark = pytest.mark.gpu


def mosaic_gpu_refusal(impl, d, v, dtype) -> str | None:
    """What `mosaic_gpu` says when it cannot take these sizes or this dtype, else None."""
    if impl != "mosaic_gpu":
        return None
    if dtype not in ("bfloat16", "float16"):
        return "bf16 or fp16"
    if v % 64:
        return "multiple of 64"
    return "embedding 64 at a time" if d % 64 else None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("n,d,v,options", GPU_CASES)
@pytest.mark.parametrize("impl", implementations("fused_cross_entropy", "gpu"))
def test_on_gpu_against_oracle(impl, n, d, v, options, dtype):
    assert jax.devices()[0].platform == "gpu"
    arrays, options = make(n, n, d, v, dtype, options, logit_scale=4.0)
    what = f"fused_cross_entropy N={n}"
    refusal = mosaic_gpu_refusal(impl, d, v, dtype)
    if refusal:  # the kernel says why it cannot serve, and a call naming it alone raises that
        with pytest.raises(Unsupported, match=refusal):
            run(impl, arrays, options=options)
        return
    check_rule(run, impl, arrays, dtype, what, oracle_dtype="float32", options=options)


# a 16-bit w with each dw accumulation that meets the rule (the default: float32); a float32
# w is its own accumulator whatever is asked
LOSS_DW = [
    ("bfloat16", None),
    ("bfloat16", "compensated"),
    ("bfloat16", "compensated_int8"),
    ("float32", None),
]


@pytest.mark.parametrize("dtype,dw", LOSS_DW)
@pytest.mark.parametrize("n,d,v,options", GPU_CASES[1:])  # the last: dw accumulated over 8 token blocks
@pytest.mark.parametrize("impl", implementations("fused_cross_entropy_loss", "gpu"))
def test_loss_gradients_in_forward_on_gpu_against_oracle(impl, n, d, v, options, dtype, dw):
    arrays, options = make(n + 1, n, d, v, dtype, options, logit_scale=4.0)
    what = f"fused_cross_entropy_loss N={n} dw={dw}"
    block_sizes = axkern.CrossEntropyBlockSizes(block_tokens=1024, block_vocab=8192, dw_accumulation=dw)
    kw = dict(oracle_dtype="float32", options=options, block_sizes=block_sizes)
    refusal = mosaic_gpu_refusal(impl, d, v, dtype)
    if refusal:
        with pytest.raises(Unsupported, match=refusal):
            run_loss(impl, arrays, **{k: kw[k] for k in ("options", "block_sizes")})
        return
    check_rule(run_loss, impl, arrays, dtype, what, **kw)


def test_h200_table_and_memory_at_llama3_size():
    n, d, v = 16384, 4096, 128256
    shapes = (
        jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    decision = axkern.explain(ce, *shapes)
    hopper = (compute_capability() or (0,))[0] == 9
    assert decision.implementation == ("mosaic_gpu" if hopper else "pallas_gpu")
    if decision.spec.device_key == "nvidia_h200":
        assert decision.block_source == "heuristic"  # the table holds no mosaic_gpu entry
    grad = jax.jit(jax.grad(lambda x, w, l: jnp.mean(ce(x, w, l)[0]), argnums=(0, 1)))
    temp = grad.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 1.5 * 2**30, f"temporary memory {temp / 2**30:.2f} GiB"
    # the reduced loss: one float32 [block_tokens, V] logits block and, by dw accumulation, its
    # 16-bit dz and the float32 [D, V] accumulator, or a slab of dz, the bf16 or int8 [D, V]
    # compensation and a float32 [D, block_vocab] share; and slack
    for dw in ("float32", "compensated", "compensated_int8"):
        bs = dict(block_tokens=2048, block_vocab=8192, dw_accumulation=dw)
        grad = jax.jit(jax.grad(lambda x, w, l, bs=bs: ce_loss(x, w, l, block_sizes=bs), argnums=(0, 1)))
        temp = grad.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
        print(f"loss dw={dw} block_tokens=2048: temporary memory {temp / 2**30:.3f} GiB")
        if dw == "float32":
            budget = 2048 * v * 6 + d * v * 4
        else:
            compensation = d * v * (2 if dw == "compensated" else 1)
            budget = 2048 * v * 4 + 2048 * 8192 * 2 + compensation + d * 8192 * 4
        assert temp <= 1.25 * budget, f"dw={dw}: temporary memory {temp / 2**30:.2f} GiB"


# the kernel alone against its emulation on the same device: tokens that fill no whole CTA tile,
# a vocabulary with columns past the last whole tile, fp16, the soft cap, the logit sums and the
# label's logit picked in the epilogue (labels outside the vocabulary and in the tail among them)
@pytest.mark.parametrize(
    "n,d,v,dtype,soft_cap,with_sum,block_sizes",
    [
        (1000, 512, 4160, "bfloat16", None, False, (256, 128, 64, 4)),
        (4096, 2048, 32000, "bfloat16", 30.0, True, (256, 128, 64, 4)),
        (777, 1536, 50304, "float16", None, True, (128, 256, 64, 3)),
        (2048, 4096, 128256, "bfloat16", None, False, (256, 128, 64, 3)),
    ],
)
def test_mosaic_gpu_kernel_matches_its_emulation(n, d, v, dtype, soft_cap, with_sum, block_sizes):
    bt, bv, bd, stages = block_sizes
    bs = CrossEntropyBlockSizes(block_tokens=bt, block_vocab=bv, block_embed=bd, num_stages=stages)
    arrays, _ = make(n, n, d, v, dtype, logit_scale=4.0)
    x, w = arrays["x"], arrays["w"]
    cfg = mosaic_gpu.kernel_config(x, w, bs, soft_cap, with_sum, False)
    rows = -(-n // bt) * bt
    xp = jnp.pad(x, ((0, rows - n), (0, 0)))
    n_tiles = mosaic_gpu.kernel_tiles(cfg, v)
    labels = (
        jnp.pad(arrays["labels"], (0, rows - n), constant_values=-1).at[:3].set(jnp.array([-1, v, v - 1]))
    )
    got = jax.jit(lambda x, w, l: mosaic_gpu.tile_stats(cfg, x, w, n_tiles, l))(xp, w, labels)
    want = jax.jit(lambda x, w, l: mosaic_gpu.emulate_tile_stats(cfg, x, w, n_tiles, l))(xp, w, labels)
    names = ["max", "sum exp"] + (["sum"] if with_sum else []) + ["label logit"]
    assert len(got) == len(want) == len(names)
    for name, g, e in zip(names, got, want, strict=True):
        g, e = np.asarray(g), np.asarray(e)
        scale = np.abs(e).max()
        err = np.abs(g - e).max()
        # the products summed in another order than XLA's: |dz| of order 1e-6 |z|, which exp carries
        assert err <= 1e-4 * scale, f"{name}: max error {err:.3e} (scale {scale:.3e})"


@pytest.mark.parametrize("n,d,v,options", GPU_CASES[::2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_loss_value_by_the_mosaic_gpu_kernel_against_oracle(n, d, v, options, dtype):
    arrays, options = make(n, n, d, v, dtype, options, logit_scale=4.0)

    def value(impl, arrays):
        f = jax.jit(lambda x, w, labels: ce_loss(x, w, labels, implementation=impl, **options))
        return (f(arrays["x"], arrays["w"], arrays["labels"]),)

    want = oracle(value, arrays, dtype="float32")
    same = value("reference", arrays)
    assert_oracle_rule(value("mosaic_gpu", arrays), same, want, dtype, f"loss value N={n} mosaic_gpu {dtype}")
