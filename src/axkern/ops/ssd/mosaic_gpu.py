"""Mamba-2 SSD on Hopper: `pallas_gpu`'s chunked layer with the chunk state and the chunk scan,
forward and backward, as Pallas Mosaic GPU kernels (`common/mosaic`: their math, layout, grid,
precision and cost), 16-bit operands into float32 accumulators; the recurrence between chunks
and its reverse are `pallas_gpu`'s Triton kernels. This module is the implementation: what it
serves (`supports`) and the layer in the form `SSDBlockSizes` names (`ssd`); the kernels'
names are re-exported from `common/mosaic` for the tests and benchmarks."""

from __future__ import annotations

from axkern.core.op import Unsupported

from .common import kernels as chunk_kernels
from .common import mosaic
from .common.mosaic import *  # noqa: F403 - the kernels' names, as `mosaic_gpu.<name>`
from .common.mosaic import _IMPORT_ERROR, CHUNK, dims_reason, layout_class, platform_reason  # noqa: F401

__all__ = ["supports", "ssd", *mosaic.__all__]


def supports(spec) -> str | None:
    return platform_reason(spec) or dims_reason(spec.dim("head_dim"), spec.dim("state"))


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    if block_sizes.chunk_size != CHUNK:
        raise Unsupported(
            f"chunk_size={block_sizes.chunk_size}: the Mosaic GPU kernels run chunks of {CHUNK}"
        )
    if interpret:
        raise Unsupported(
            "the Mosaic GPU kernels have no interpret mode (wgmma and TMA copies have no CPU rule)"
        )
    reason = dims_reason(x.shape[-1], B.shape[-1])
    if reason:
        raise Unsupported(reason)
    layout = layout_class(
        block_sizes.forward == "fused",
        block_sizes.group_sums == "kernels",
        block_sizes.transposes == "kernels",
        block_sizes.backward == "fused",
    )
    return chunk_kernels.ssd(
        layout, x, dt, A, B, C, D, z, segment_ids, initial_state, chunk_size=CHUNK, interpret=False
    )
