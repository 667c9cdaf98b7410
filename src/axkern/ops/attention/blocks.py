"""Block sizes of attention (query rows by key columns per tile), and their heuristic."""

from __future__ import annotations

import dataclasses

from axkern.core.blocks import BlockSizes, next_power_of_2
from axkern.core.op import Spec

__all__ = ["AttentionBlockSizes", "bucket", "heuristic"]


@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes(BlockSizes):
    """`block_q` query positions by `block_kv` key positions per tile; neither needs to divide
    the lengths (the last blocks are padded and masked). `pallas_gpu` also reads `num_warps`
    and `num_stages` (Triton's warps per program and software-pipelining depth; `None`:
    Triton's defaults)."""

    block_q: int = 128
    block_kv: int = 128
    num_warps: int | None = None
    num_stages: int | None = None


def bucket(spec: Spec) -> dict:
    return {k: next_power_of_2(v) for k, v in spec.dims} | {"dtype": spec.dtype}


_LIMIT = {"gpu": 1024, "tpu": 512, "cpu": 128}


def heuristic(spec: Spec) -> AttentionBlockSizes:
    limit = _LIMIT.get(spec.platform, 128)
    return AttentionBlockSizes(
        block_q=min(limit, next_power_of_2(spec.dim("q_len"))),
        block_kv=min(limit, next_power_of_2(spec.dim("kv_len"))),
    )
