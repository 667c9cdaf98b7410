"""The fused cross-entropy statistics on a TPU: a Mosaic kernel, no logits in HBM.

The per-token op runs the reduced loss's statistics kernel (`loss_kernels.logits` without holding
the logits; `loss.py` runs the same kernel for the undifferentiated loss) over all tokens: grid
`(token tiles, vocabulary tiles)`, the vocabulary sequential ("arbitrary"); a `[bt, D]` block of
`x` meets a `[D, bv]` block of `w` in one float32 product (the whole embedding a step), transposed
to `[bv, bt]` so that each token's running statistics (max, sum of exponentials, label logit,
logit sum) are lane vectors; the last vocabulary tile writes `lse`, the label's logit and the
logit sum. Ragged edges are masked in the kernel (columns past the vocabulary do not count; a
ragged last token tile's extra lanes are not written), so nothing is padded (`x` and `w` of two
dtypes are cast to the wider one first). Labels
outside `[0, V)` match no column (their label logit is 0; `common.py` decides their loss).

In CI in TPU interpret mode (`pltpu.InterpretParams`, out-of-bounds reads of ragged edge blocks
uninitialised, as on the chip) and lowered for a TPU; on a TPU v5e it passes `tests/tpu` (docs/tpu.md,
"Measured"). A call its `supports()` or tile checks refuse falls back to `xla`.

**Backward: recomputation in XLA** (`common.recomputing`), as `pallas_gpu`. The reduced loss under
`jax.grad` forms its gradients in the forward with kernels of its own (`fused_cross_entropy_loss`).

**Cost.** `2·N·D·V` FLOPs (compute bound at real sizes); bytes: `x` once, `w` once per token
tile, three float32 values per token out.

**Tiles.** `block_tokens` a multiple of 128 (fewer tokens take one tile of them rounded up to
128), `block_vocab` a multiple of 128 or at least the vocabulary (one tile of it); VMEM
(`blocks.pallas_tpu_stats_vmem_bytes`: two buffers of each input block, the per-token rows and
the float32 temporaries) within three quarters of the chip's, else `Unsupported` with the
figures.
"""

from __future__ import annotations

from axkern.core.op import Implementation

from .. import common
from ..blocks import CrossEntropyBlockSizes, pallas_tpu_heuristic, pallas_tpu_space
from .loss import LOSS_IMPLEMENTATION as LOSS_IMPLEMENTATION  # the reduced loss (loss.py)
from .loss import statistics, supports, tiles  # the same refusal for both ops: no float64 on the matrix unit


def stats(
    x,
    w,
    labels,
    *,
    block_sizes: CrossEntropyBlockSizes,
    logits_soft_cap=None,
    with_sum=False,
    interpret=False,
):
    """Per-token `(lse, label_logit, sum_logits)` (float32) by the Mosaic kernel; backward in XLA."""
    t = tiles(x, w, block_sizes, logits_soft_cap, with_sum, interpret, held=False)
    return _stats(t, x, w, labels)


_stats = common.recomputing(statistics)


IMPLEMENTATION = Implementation(
    "pallas_tpu",
    stats,
    platforms=("tpu",),
    supports=supports,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=pallas_tpu_heuristic,
    space=pallas_tpu_space,
    interpretable=True,
    backward="custom_vjp: recomputes the logits in XLA (streamed tiles, as xla)",
)
