"""Block sizes of the short causal convolution and the heuristic used when no tuned entry matches."""

from __future__ import annotations

import dataclasses

from axkern.core.blocks import BlockSizes, next_power_of_2
from axkern.core.op import Spec

__all__ = ["ConvBlockSizes", "bucket", "cuda_heuristic", "heuristic"]


@dataclasses.dataclass(frozen=True)
class ConvBlockSizes(BlockSizes):
    """A program's tile: `block_seq` positions by `block_channels` channels (powers of two).

    Neither needs to divide the problem: edge tiles are masked.
    """

    block_seq: int = 64
    block_channels: int = 256
    num_warps: int | None = None  # Triton warps per program (pallas_gpu); None: from the tile size
    block_seq_backward: int | None = None  # positions per backward tile (cuda); None: block_seq

    def check(self, spec):
        for name in ("block_seq", "block_channels", "block_seq_backward"):
            v = getattr(self, name)
            if v is None:
                continue
            if v & (v - 1):
                return f"{name}={v} is not a power of two (Pallas tiles need power-of-two sizes)"
        if spec is not None and self.block_seq < spec.dim("width") - 1:
            return f"block_seq={self.block_seq} is shorter than the width - 1 = {spec.dim('width') - 1} halo"
        return None


def bucket(spec: Spec) -> dict:
    return {
        "seq": next_power_of_2(spec.dim("seq")),
        "channels": next_power_of_2(spec.dim("channels")),
        "width": spec.dim("width"),
        "dtype": spec.dtype,
    }


def heuristic(spec: Spec) -> ConvBlockSizes:
    seq, channels, width = spec.dim("seq"), spec.dim("channels"), spec.dim("width")
    if spec.platform == "tpu":  # (8, 128) layout tiles; the halo comes from the previous block
        return ConvBlockSizes(
            block_seq=max(8, min(256, next_power_of_2(seq))), block_channels=128 if channels <= 128 else 256
        )
    # H200 sweep (benchmarks/results/nvidia_h200/short_conv/sweep.json,
    # B=8 S=4096 C=4096 W=4 bf16): 8x256 tiles with one warp had the fastest forward (0.169 ms)
    # and forward+backward, without activation (0.517 ms) and with SiLU (0.901 ms).
    block_seq = max(next_power_of_2(max(width - 1, 1)), min(8, next_power_of_2(seq)))
    block_channels = min(256, next_power_of_2(channels))
    return ConvBlockSizes(block_seq=block_seq, block_channels=block_channels, num_warps=1)


def cuda_heuristic(spec: Spec) -> ConvBlockSizes:
    """CUDA tiles: a thread walks `block_seq` positions forward and `block_seq_backward`
    backward; longer backward tiles make fewer float32 partial sums of dw and dbias."""
    seq = spec.dim("seq")
    return ConvBlockSizes(
        block_seq=max(8, min(128, next_power_of_2(seq))),
        block_channels=1024,
        block_seq_backward=max(8, min(256, next_power_of_2(seq))),
    )
