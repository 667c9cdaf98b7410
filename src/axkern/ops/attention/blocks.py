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
    Triton's defaults), and gives each backward kernel its own four: `*_dq` for the kernel
    that walks key tiles per query block (`dq`), `*_dkv` for the one that walks query tiles
    per key block (`dk`, `dv`); a `None` there takes the forward's value. `pallas_tpu`, `xla`
    use `block_q`, `block_kv` for every pass."""

    block_q: int = 128
    block_kv: int = 128
    num_warps: int | None = None
    num_stages: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    num_warps_dq: int | None = None
    num_stages_dq: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    num_warps_dkv: int | None = None
    num_stages_dkv: int | None = None

    def kernel(self, name: str) -> AttentionBlockSizes:
        """The forward's four fields for kernel `name` (`"fwd"`, `"dq"` or `"dkv"`), a `None`
        of a backward kernel filled from the forward's."""
        if name not in ("fwd", "dq", "dkv"):
            raise ValueError(f"kernel must be 'fwd', 'dq' or 'dkv', got {name!r}")
        base = {f: getattr(self, f) for f in _PER_KERNEL}
        own = {} if name == "fwd" else {f: getattr(self, f"{f}_{name}") for f in _PER_KERNEL}
        return AttentionBlockSizes(**{f: base[f] if own.get(f) is None else own[f] for f in _PER_KERNEL})


_PER_KERNEL = ("block_q", "block_kv", "num_warps", "num_stages")


def bucket(spec: Spec) -> dict:
    return {k: next_power_of_2(v) for k, v in spec.dims} | {"dtype": spec.dtype}


_LIMIT = {"gpu": 1024, "tpu": 512, "cpu": 128}


def heuristic(spec: Spec) -> AttentionBlockSizes:
    limit = _LIMIT.get(spec.platform, 128)
    return AttentionBlockSizes(
        block_q=min(limit, next_power_of_2(spec.dim("q_len"))),
        block_kv=min(limit, next_power_of_2(spec.dim("kv_len"))),
    )
