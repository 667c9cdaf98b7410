"""Chunk size of the SSD scan, and its heuristic."""

from __future__ import annotations

import dataclasses

from axkern.core.blocks import BlockSizes, next_power_of_2
from axkern.core.op import Spec

__all__ = ["SSDBlockSizes", "bucket", "heuristic"]


@dataclasses.dataclass(frozen=True)
class SSDBlockSizes(BlockSizes):
    """`chunk_size`: positions per chunk (a power of two); the length need not be a multiple."""

    chunk_size: int = 64

    def check(self, spec):
        if self.chunk_size & (self.chunk_size - 1):
            return f"chunk_size={self.chunk_size} is not a power of two"
        return None


def bucket(spec: Spec) -> dict:
    return {k: next_power_of_2(v) for k, v in spec.dims} | {"dtype": spec.dtype}


def heuristic(spec: Spec) -> SSDBlockSizes:
    # 256 is mamba_ssm's choice on GPU; small chunks keep the CPU's quadratic part cheap
    limit = 256 if spec.platform == "gpu" else 64
    return SSDBlockSizes(chunk_size=min(limit, next_power_of_2(spec.dim("length"))))
