"""Block sizes of the fused cross-entropy and the heuristic used when no tuned entry matches."""

from __future__ import annotations

import dataclasses

from axkern.core.blocks import BlockSizes, next_power_of_2
from axkern.core.op import Spec

__all__ = [
    "CrossEntropyBlockSizes",
    "bucket",
    "heuristic",
    "loss_heuristic",
    "pallas_gpu_heuristic",
    "pallas_tpu_heuristic",
]

# Bytes of one float32 [block_tokens, block_vocab] logits tile, per platform. On GPU a tile
# this size keeps each matmul large enough to run near the tensor-core ceiling while the
# whole forward+backward stays far below the materialised [tokens, vocab] logits. The H200
# sweep (benchmarks/results/nvidia_h200/fused_cross_entropy/sweep.json) ran fastest
# with the largest tiles: 16384x4096 took 116 ms and 0.58 GiB, 4096x1024 170 ms; 16384x8192
# was 2% faster again but needed 1.6 GiB.
_TILE_BYTES = {"gpu": 256 << 20, "tpu": 64 << 20, "cpu": 8 << 20}
_BLOCK_VOCAB = {"gpu": 4096, "tpu": 2048, "cpu": 1024}


@dataclasses.dataclass(frozen=True)
class CrossEntropyBlockSizes(BlockSizes):
    """Tile of the streamed logits: `block_tokens` rows by `block_vocab` columns.

    Neither needs to divide the problem: a ragged last block is handled without padding.
    The Pallas kernels also read `block_embed` (the reduction step over the embedding),
    `vocab_splits` (programs sharing one token block's vocabulary, their statistics merged
    afterwards; more programs for small token counts), and on GPU `num_warps` and
    `num_stages` (Triton's software pipelining depth). `None` lets the kernel choose.
    """

    block_tokens: int = 1024
    block_vocab: int = 2048
    block_embed: int | None = None
    vocab_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def bucket(spec: Spec) -> dict:
    """Key of a tuned-table entry: each size rounded up to a power of two, and the dtype."""
    return {
        "tokens": next_power_of_2(spec.dim("tokens")),
        "embed": next_power_of_2(spec.dim("embed")),
        "vocab": next_power_of_2(spec.dim("vocab")),
        "dtype": spec.dtype,
    }


def stream_tiles(platform: str, tokens: int, vocab: int) -> CrossEntropyBlockSizes:
    """The streamed logits tile for `platform`: `block_vocab` columns and as many rows as fit
    the platform's float32 tile budget (GPU: `[16384, 4096]`, 256 MiB)."""
    block_vocab = max(1, min(vocab, _BLOCK_VOCAB.get(platform, 1024)))
    budget = _TILE_BYTES.get(platform, 8 << 20) // (4 * block_vocab)
    block_tokens = max(1, min(tokens, max(8, budget)))
    return CrossEntropyBlockSizes(block_tokens=block_tokens, block_vocab=block_vocab)


def heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    return stream_tiles(spec.platform, spec.dim("tokens"), spec.dim("vocab"))


# Bytes of the float32 [block_tokens, vocab] logits block of the reduced loss (whose gradients
# are formed in the forward: the block spans the whole vocabulary), at least. Each block adds
# its share to the float32 [D, V] dw accumulator, a read-modify-write of 8·D·V bytes, so the
# block also grows to D / 2 rows (rounded down to a power of two): the dw traffic stays below
# twice the logits' own, for at most 3·D·V bytes of block (6 bytes a logit: the float32 block
# and its 16-bit dz) beside the 4·D·V-byte accumulator that any such block size needs. On the
# H200 at llama3's size: 512 rows 109.8 ms, 1024 88.5 ms, 2048 (= D / 2) 84.4 ms
# (benchmarks/results/nvidia_h200/fused_cross_entropy_loss/sweep.json).
_LOSS_BLOCK_BYTES = {"gpu": 512 << 20, "tpu": 128 << 20, "cpu": 16 << 20}


def loss_heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    tokens, embed, vocab = spec.dim("tokens"), spec.dim("embed"), spec.dim("vocab")
    rows = max(_LOSS_BLOCK_BYTES.get(spec.platform, 16 << 20) // (4 * vocab), embed // 2)
    rows = max(8, 1 << max(0, rows.bit_length() - 1))  # a power of two, at least 8
    return CrossEntropyBlockSizes(block_tokens=max(1, min(tokens, rows)), block_vocab=vocab)


def pallas_gpu_heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    """Triton GEMM tiles for Hopper: 128 x 256 outputs, 64-deep steps, 8 warps, 3 stages."""
    return CrossEntropyBlockSizes(
        block_tokens=128, block_vocab=256, block_embed=64, num_warps=8, num_stages=3
    )


def pallas_tpu_heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    """MXU-sized tiles whose VMEM footprint (about 6 MiB in bf16) fits every chip's budget."""
    return CrossEntropyBlockSizes(block_tokens=512, block_vocab=1024, block_embed=512)
