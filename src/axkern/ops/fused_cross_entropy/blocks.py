"""Block sizes of the fused cross-entropy and the heuristic used when no tuned entry matches."""

from __future__ import annotations

import dataclasses

from axkern.core.blocks import BlockSizes, next_power_of_2
from axkern.core.op import Spec

__all__ = ["CrossEntropyBlockSizes", "bucket", "heuristic"]

# Bytes of one float32 [block_tokens, block_vocab] logits tile, per platform. On GPU a tile
# this size keeps each matmul large enough to run near the tensor-core ceiling while the
# whole forward+backward stays far below the materialised [tokens, vocab] logits. The H200
# sweep (benchmarks/results/h200/fused_cross_entropy_xla_sweep_2026-11-29.json) ran fastest
# with the largest tiles: 16384x4096 took 116 ms and 0.58 GiB, 4096x1024 170 ms; 16384x8192
# was 2% faster again but needed 1.6 GiB.
_TILE_BYTES = {"gpu": 256 << 20, "tpu": 64 << 20, "cpu": 8 << 20}
_BLOCK_VOCAB = {"gpu": 4096, "tpu": 2048, "cpu": 1024}


@dataclasses.dataclass(frozen=True)
class CrossEntropyBlockSizes(BlockSizes):
    """Tile of the streamed logits: `block_tokens` rows by `block_vocab` columns.

    Neither needs to divide the problem: a ragged last block is handled without padding.
    """

    block_tokens: int = 1024
    block_vocab: int = 2048


def bucket(spec: Spec) -> dict:
    """Key of a tuned-table entry: each size rounded up to a power of two, and the dtype."""
    return {
        "tokens": next_power_of_2(spec.dim("tokens")),
        "embed": next_power_of_2(spec.dim("embed")),
        "vocab": next_power_of_2(spec.dim("vocab")),
        "dtype": spec.dtype,
    }


def heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    tokens, vocab = spec.dim("tokens"), spec.dim("vocab")
    block_vocab = max(1, min(vocab, _BLOCK_VOCAB.get(spec.platform, 1024)))
    budget = _TILE_BYTES.get(spec.platform, 8 << 20) // (4 * block_vocab)
    block_tokens = max(1, min(tokens, max(8, budget)))
    return CrossEntropyBlockSizes(block_tokens=block_tokens, block_vocab=block_vocab)
