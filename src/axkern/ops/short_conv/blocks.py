"""Block sizes of the short causal convolution: the heuristic used when no tuned entry
matches, and the space of candidates `axkern tune` sweeps for each Pallas kernel."""

from __future__ import annotations

import dataclasses

from axkern.core.blocks import BlockSizes, grid, next_power_of_2
from axkern.core.op import Spec

__all__ = [
    "ConvBlockSizes",
    "bucket",
    "cuda_heuristic",
    "cuda_space",
    "heuristic",
    "pallas_gpu_space",
    "pallas_tpu_space",
]


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
    # GPU: short tiles of 256 channels with one warp (the memory-bound kernel needs many
    # programs, not wide ones; docs/ops/short_conv.md, "Performance", has the sweep)
    block_seq = max(next_power_of_2(max(width - 1, 1)), min(8, next_power_of_2(seq)))
    block_channels = min(256, next_power_of_2(channels))
    return ConvBlockSizes(block_seq=block_seq, block_channels=block_channels, num_warps=1)


def cuda_heuristic(spec: Spec) -> ConvBlockSizes:
    """CUDA tiles: a thread walks `block_seq` positions forward and `block_seq_backward`
    backward; longer backward tiles make fewer float32 partial sums of dw and dbias. The
    kernels do not read `block_channels` (a block is 128 threads of one vector each)."""
    seq = spec.dim("seq")
    return ConvBlockSizes(
        block_seq=max(8, min(128, next_power_of_2(seq))),
        block_channels=1024,
        block_seq_backward=max(8, min(256, next_power_of_2(seq))),
    )


def cuda_space(spec: Spec) -> list[ConvBlockSizes]:
    """Forward tiles of 32 to 256 positions, backward tiles of 64 to 512 (a thread a column)."""
    seq = next_power_of_2(spec.dim("seq"))
    return grid(
        ConvBlockSizes,
        spec,
        first=cuda_heuristic(spec),
        block_seq=[s for s in (32, 64, 128, 256) if s <= max(32, seq)],
        block_channels=(1024,),
        block_seq_backward=[s for s in (64, 128, 256, 512) if s <= max(64, seq)],
    )


def pallas_gpu_space(spec: Spec) -> list[ConvBlockSizes]:
    """Tiles of 8 to 64 positions (at least the halo) by 128 to 512 channels, 1 to 4 warps."""
    seq, channels = next_power_of_2(spec.dim("seq")), next_power_of_2(spec.dim("channels"))
    return grid(
        ConvBlockSizes,
        spec,
        first=heuristic(spec),
        block_seq=[s for s in (8, 16, 32, 64) if s <= max(8, seq)],
        block_channels=[c for c in (128, 256, 512) if c <= max(128, channels)],
        num_warps=(1, 2, 4),
    )


def pallas_tpu_space(spec: Spec) -> list[ConvBlockSizes]:
    """Tiles of 64 to 256 positions by 128 or 256 channels (the (8, 128) layout's multiples)."""
    seq = next_power_of_2(spec.dim("seq"))
    return grid(
        ConvBlockSizes,
        spec,
        first=heuristic(spec),
        block_seq=[s for s in (64, 128, 256) if s <= max(64, seq)],
        block_channels=(128, 256),
    )
