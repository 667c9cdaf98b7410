"""fused_cross_entropy's Mosaic GPU kernel, everything around it on the CPU.

The kernel (`ops/fused_cross_entropy/mosaic_gpu.py`) has no CPU interpret mode (wgmma and TMA
copies have no CPU rule): here its outputs come from `emulate_tile_stats`, and the rest of the
path runs as on the device: token rows padded to a CTA tile, the columns past the last whole
vocab tile, the label's logit, the merge of the tiles, the recomputing backward, the reduced
loss's value, the refusals and the dispatch. tests/gpu/test_fused_cross_entropy_gpu.py runs the
kernel itself against the oracle on a Hopper GPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import CrossEntropyBlockSizes
from axkern.core.op import Unsupported
from axkern.ops.fused_cross_entropy import common, mosaic_gpu, reference
from axkern.ops.fused_cross_entropy.blocks import mosaic_gpu_heuristic, mosaic_gpu_space
from tests.cases.fused_cross_entropy import make
from tests.gpu_lowering import lower_for_cuda
from tests.harness import check_rules, jit

TILES = CrossEntropyBlockSizes(block_tokens=128, block_vocab=64, block_embed=32, num_stages=3)


def run_stats(impl, arrays, *, soft_cap=None, with_sum=False, block_sizes=TILES):
    """The op's per-token `(loss, lse)` from `(lse, label_logit, sum_logits)` (label smoothing
    0.1 when `with_sum`) and the gradients of `<cot[0], loss> + <cot[1], lse>` w.r.t. x and w:
    `reference`'s statistics, or the kernel's path with its emulated outputs."""

    def f(x, w, labels, cot):
        if impl == "reference":
            lse, ll, sm = reference.stats(x, w, labels, logits_soft_cap=soft_cap, with_sum=with_sum)
        else:
            lse, ll, sm = mosaic_gpu.stats(
                x,
                w,
                labels,
                block_sizes=block_sizes,
                logits_soft_cap=soft_cap,
                with_sum=with_sum,
                emulate=True,
            )
        eps = 0.1 if with_sum else 0.0
        loss = lse - (1 - eps) * ll - (eps / w.shape[1]) * sm
        return jnp.sum(loss * cot[0]) + jnp.sum(lse * cot[1]), (loss, lse)

    args = (arrays["x"], arrays["w"], arrays["labels"], arrays["cot"])
    (_, out), grads = jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(*args)
    return out, grads


# token counts that are no multiple of the CTA tile (128 rows); vocabularies with and without
# columns past the last whole vocab tile, and one smaller than a tile (no kernel tile at all)
@pytest.mark.parametrize(
    "n,d,v,soft_cap,with_sum,block_vocab",
    [
        (300, 64, 1088, None, False, 128),
        (128, 96, 640, 20.0, True, 64),
        (77, 32, 64, None, True, 128),
        (257, 64, 192, 5.0, False, 128),
    ],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kernel_path_against_oracle(n, d, v, soft_cap, with_sum, block_vocab, dtype):
    arrays, _ = make(0, n, d, v, dtype, logit_scale=4.0)
    bs = CrossEntropyBlockSizes(block_tokens=128, block_vocab=block_vocab, block_embed=32, num_stages=3)
    kw = dict(soft_cap=soft_cap, with_sum=with_sum, block_sizes=bs)
    check_rules(run_stats, ["mosaic_gpu"], arrays, dtype, f"mosaic_gpu stats N={n} V={v}", **kw)


def test_labels_outside_the_vocabulary_give_a_zero_label_logit():
    arrays, _ = make(1, 130, 32, 192, "bfloat16")  # one vocab tile of 128 and a tail of 64 columns
    labels = (
        arrays["labels"]
        .at[:4]
        .set(jnp.array([-1, 192, -100, 300]))
        .at[4:8]
        .set(jnp.array([191, 128, 127, 0]))
    )
    bs = CrossEntropyBlockSizes(block_tokens=128, block_vocab=128, block_embed=32, num_stages=3)
    _, ll, _ = mosaic_gpu.stats(arrays["x"], arrays["w"], labels, block_sizes=bs, emulate=True)
    assert np.all(np.asarray(ll[:4]) == 0.0)
    want = reference.stats(arrays["x"], arrays["w"], labels)[1]
    np.testing.assert_allclose(np.asarray(ll[4:]), np.asarray(want[4:]), rtol=1e-5, atol=1e-5)


def test_non_finite_rows_stay_in_their_rows():
    arrays, _ = make(2, 200, 32, 320, "bfloat16")
    x = arrays["x"].at[5, 3].set(jnp.nan).at[150, 0].set(jnp.inf)
    lse, _, _ = mosaic_gpu.stats(x, arrays["w"], arrays["labels"], block_sizes=TILES, emulate=True)
    bad = ~np.isfinite(np.asarray(lse))
    assert bad[5] and bad[150] and bad.sum() == 2


def test_reduced_loss_value_through_the_kernel_path():
    arrays, _ = make(3, 300, 64, 1088, "bfloat16", logit_scale=4.0)
    keep = jnp.arange(300) % 5 != 0
    args = (arrays["x"], arrays["w"], arrays["labels"], keep, 1.0 / 240)
    kw = dict(logits_soft_cap=30.0, label_smoothing=0.1, logsumexp_weight=1e-4)
    bs = CrossEntropyBlockSizes(block_tokens=64, block_vocab=256)
    streamed = common.loss(*args, block_sizes=bs, **kw)
    kernel = common.loss(*args, block_sizes=bs, value_stats=mosaic_gpu.emulated_value_stats, **kw)
    want = reference.loss(*args, **kw)
    assert abs(float(kernel) - float(want)) <= 2e-6 * abs(float(want)) + 1e-6
    assert abs(float(kernel) - float(streamed)) <= 2e-6 * abs(float(want)) + 1e-6
    # the gradients are formed by the same XLA path whichever computes the value
    g_kernel = jax.grad(
        lambda x, w: common.loss(
            x, w, *args[2:], block_sizes=bs, value_stats=mosaic_gpu.emulated_value_stats, **kw
        ),
        (0, 1),
    )
    g_stream = jax.grad(lambda x, w: common.loss(x, w, *args[2:], block_sizes=bs, **kw), (0, 1))
    for a, b in zip(g_kernel(*args[:2]), g_stream(*args[:2]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_block_sizes_the_kernel_refuses():
    x = jnp.zeros((256, 128), jnp.bfloat16)
    w = jnp.zeros((128, 512), jnp.bfloat16)
    labels = jnp.zeros((256,), jnp.int32)

    def refused(bs, x=x, w=w):
        with pytest.raises(Unsupported) as e:
            mosaic_gpu.stats(x, w, labels, block_sizes=bs, emulate=True)
        return str(e.value)

    assert "128 or 256 rows" in refused(CrossEntropyBlockSizes(block_tokens=64, block_vocab=128))
    assert "64, 128 or 256 vocab columns" in refused(
        CrossEntropyBlockSizes(block_tokens=256, block_vocab=512)
    )
    assert "ring holds 2 to 6" in refused(
        CrossEntropyBlockSizes(block_tokens=256, block_vocab=128, num_stages=8)
    )
    assert "shared memory" in refused(
        CrossEntropyBlockSizes(block_tokens=256, block_vocab=128, block_embed=64, num_stages=6)
    )
    assert "registers" in refused(CrossEntropyBlockSizes(block_tokens=256, block_vocab=256, num_stages=3))
    assert "bf16 or fp16" in refused(TILES, x=x.astype(jnp.float32), w=w.astype(jnp.float32))
    assert "embedding 64 at a time" in refused(
        CrossEntropyBlockSizes(block_tokens=256, block_vocab=128, block_embed=64), x=x[:, :96], w=w[:96]
    )
    assert "multiple of 64" in refused(TILES, w=w[:, :504])


@pytest.mark.skipif(mosaic_gpu._IMPORT_ERROR is not None, reason="Pallas Mosaic GPU does not import")
@pytest.mark.parametrize(
    "cc,dtype,vocab,order,loss_order",
    [
        ((9, 0), jnp.bfloat16, 128256, ("mosaic_gpu", "pallas_gpu", "xla"), ("mosaic_gpu", "xla")),
        ((9, 0), jnp.float16, 32000, ("mosaic_gpu", "pallas_gpu", "xla"), ("mosaic_gpu", "xla")),
        ((8, 0), jnp.bfloat16, 128256, ("pallas_gpu", "xla"), ("xla",)),  # not a Hopper GPU
        ((9, 0), jnp.float32, 128256, ("pallas_gpu", "xla"), ("xla",)),
        ((9, 0), jnp.bfloat16, 50257, ("pallas_gpu", "xla"), ("xla",)),  # no TMA tiling of w
    ],
)
def test_gpu_order_lists_the_kernel_only_where_it_serves(monkeypatch, cc, dtype, vocab, order, loss_order):
    from axkern.core import backend
    from axkern.ops.fused_cross_entropy import api

    monkeypatch.setattr(backend, "platform", lambda: "gpu")
    monkeypatch.setattr(backend, "compute_capability", lambda: cc)
    monkeypatch.setattr(backend, "device_kind", lambda: "NVIDIA H200" if cc[0] == 9 else "NVIDIA A100")
    for op, want in ((api.OP, order), (api.LOSS_OP, loss_order)):
        spec = op.spec({"tokens": 1024, "embed": 4096, "vocab": vocab}, dtype, with_sum=False)
        assert spec.platform == "gpu"
        assert op.default_order["gpu"](spec) == want


def test_heuristic_and_space_fit_shared_memory():
    spec = axkern.core.op.get_op("fused_cross_entropy").spec(
        {"tokens": 16384, "embed": 4096, "vocab": 128256}, jnp.bfloat16
    )
    first = mosaic_gpu_heuristic(spec)
    assert mosaic_gpu_space(spec)[0] == first
    for bs in mosaic_gpu_space(spec):
        need = mosaic_gpu.smem_bytes(bs.block_tokens // 2, bs.block_vocab, bs.block_embed, bs.num_stages)
        assert need <= mosaic_gpu.SMEM_LIMIT, bs
    # of 8: 256 x 256 (a 128 x 256 accumulator a warpgroup) takes more registers than it has
    assert len(mosaic_gpu_space(spec)) == 6
    assert mosaic_gpu.smem_bytes(128, 128, 64, 4) == 4 * (256 * 64 + 64 * 128) * 2 + 3 * 2 * 128 * 4 + 1024


def test_cpu_dispatch_says_why_the_kernel_is_skipped():
    x = jax.ShapeDtypeStruct((512, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 1024), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((512,), jnp.int32)
    for op in (axkern.positional.fused_cross_entropy, axkern.positional.fused_cross_entropy_loss):
        with pytest.raises(Exception, match="Hopper|gpu"):
            axkern.explain(op, x, w, labels, implementation="mosaic_gpu")
        assert axkern.explain(op, x, w, labels).implementation == "xla"


def _lowered(n, d, v, dtype, soft_cap, with_sum, block_sizes) -> str:
    """The StableHLO text of the kernel's path lowered for a CUDA GPU on this machine."""
    shapes = (
        jax.ShapeDtypeStruct((n, d), dtype),
        jax.ShapeDtypeStruct((d, v), dtype),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )

    def f(x, w, labels):
        return mosaic_gpu.stats(
            x, w, labels, block_sizes=block_sizes, logits_soft_cap=soft_cap, with_sum=with_sum
        )

    return lower_for_cuda(f, *shapes).as_text()


@pytest.mark.skipif(mosaic_gpu._IMPORT_ERROR is not None, reason="Pallas Mosaic GPU does not import")
@pytest.mark.parametrize(
    "n,d,v,dtype,soft_cap,with_sum,tiles",
    [
        # the heuristic's tiles, a vocabulary tail
        (1000, 512, 4160, jnp.bfloat16, None, False, (256, 128, 64, 4)),
        (777, 1536, 50304, jnp.float16, 30.0, True, (128, 256, 64, 3)),
    ],
)
def test_kernel_lowers_for_a_cuda_gpu(monkeypatch, n, d, v, dtype, soft_cap, with_sum, tiles):
    monkeypatch.setattr(mosaic_gpu, "_sm_count", lambda: 132)  # no GPU here to ask
    bt, bv, bd, stages = tiles
    bs = CrossEntropyBlockSizes(block_tokens=bt, block_vocab=bv, block_embed=bd, num_stages=stages)
    text = _lowered(n, d, v, dtype, soft_cap, with_sum, bs)
    assert len(re.findall(r"stablehlo.custom_call @mosaic_gpu", text)) == 1
