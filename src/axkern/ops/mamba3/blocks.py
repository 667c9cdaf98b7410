"""Chunk size of the Mamba-3 scan: the `xla` heuristic and the chunk sizes `axkern tune` sweeps."""

from __future__ import annotations

import dataclasses

from axkern.core.blocks import BlockSizes, grid, next_power_of_2
from axkern.core.op import Spec

__all__ = [
    "Mamba3BlockSizes",
    "bucket",
    "heuristic",
    "space",
    "pallas_gpu_heuristic",
    "pallas_tpu_heuristic",
]


@dataclasses.dataclass(frozen=True)
class Mamba3BlockSizes(BlockSizes):
    """`chunk_size`: positions per chunk (a power of two); the length need not be a multiple."""

    chunk_size: int = 64

    def check(self, spec):
        if self.chunk_size & (self.chunk_size - 1):
            return f"chunk_size={self.chunk_size} is not a power of two"
        return None


def bucket(spec: Spec) -> dict:
    return {k: next_power_of_2(v) for k, v in spec.dims} | {"dtype": spec.dtype}


def heuristic(spec: Spec) -> Mamba3BlockSizes:
    """`xla`: chunks of 64 (mamba_ssm's SISO kernels' chunk), fewer for a MIMO rank above 1,
    whose chunk terms grow as `Q² R²`; never above the length's next power of two."""
    rank = spec.dim("rank")
    limit = 64 if rank <= 1 else max(16, 64 // next_power_of_2(rank))
    return Mamba3BlockSizes(chunk_size=min(limit, next_power_of_2(spec.dim("length"))))


def space(spec: Spec) -> list[Mamba3BlockSizes]:
    """`xla`: chunks of 16 to 256 positions."""
    top = max(16, min(256, next_power_of_2(spec.dim("length"))))
    chunks = [q for q in (16, 32, 64, 128, 256) if q <= top]
    return grid(Mamba3BlockSizes, spec, first=heuristic(spec), chunk_size=chunks)


def pallas_gpu_heuristic(spec: Spec) -> Mamba3BlockSizes:
    """Chunks of 64, as `ssd`'s `pallas_gpu` (at least 16: Triton's dot tiles)."""
    return Mamba3BlockSizes(chunk_size=max(16, min(64, next_power_of_2(spec.dim("length")))))


def pallas_tpu_heuristic(spec: Spec) -> Mamba3BlockSizes:
    """Chunks of 128 (the MXU's width), at least 8 (the sublanes)."""
    return Mamba3BlockSizes(chunk_size=max(8, min(128, next_power_of_2(spec.dim("length")))))
