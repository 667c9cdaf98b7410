"""Mamba-2 SSD on Hopper: `pallas_gpu`'s chunked layer with the chunk state and the chunk scan,
forward and backward, as Pallas Mosaic GPU kernels (`chunked/mosaic_gpu`: their math, layout, grid,
precision and cost), 16-bit operands into float32 accumulators; the recurrence between chunks
and its reverse are `pallas_gpu`'s Triton kernels. This module is the implementation: what it
serves (`supports`) and the layer in the form `SSDBlockSizes` names (`ssd`); the kernels'
names are re-exported from `chunked/mosaic_gpu` for the tests and benchmarks."""

from __future__ import annotations

from axkern.core.op import Unsupported

from axkern.ops.chunked import kernels as chunk_kernels
from axkern.ops.chunked import mosaic_gpu as mosaic
from axkern.ops.chunked.mosaic_gpu import *  # noqa: F403 - the kernels' names, as `mosaic_gpu.<name>`
from axkern.ops.chunked.mosaic_gpu import (  # noqa: F401
    _IMPORT_ERROR,
    CHUNK,
    chunk_reason,
    dims_reason,
    layout_class,
    lean_forward_reason,
    lean_reason,
    platform_reason,
)

__all__ = ["supports", "ssd", *mosaic.__all__]


def supports(spec) -> str | None:
    return platform_reason(spec) or dims_reason(spec.dim("head_dim"), spec.dim("state"))


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    chunk = block_sizes.chunk_size
    lean = block_sizes.scan_backward == "lean"
    reason = lean and lean_reason(1, chunk, p=x.shape[-1])  # (`ssd`'s B, C are 16-bit here)
    if reason:
        raise Unsupported(f"scan_backward='lean': {reason}")
    if block_sizes.group_sums == "scores" and not lean:
        raise Unsupported(
            "group_sums='scores': with the lean chunk-scan backward only (scan_backward='lean')"
        )
    lean_forward = block_sizes.forward == "lean"
    reason = lean_forward and lean_forward_reason(1, chunk)  # (`ssd`'s B, C are 16-bit here)
    if reason:
        raise Unsupported(f"forward='lean': {reason}")
    if chunk != CHUNK:
        # above 64: the kernels by tiles of 64 rows (`chunked/mosaic_gpu/tiled.py`); the fused state
        # backward walks chunks of 64 only
        if chunk % CHUNK or chunk < CHUNK:
            raise Unsupported(
                f"chunk_size={chunk}: the Mosaic GPU kernels run chunks of a multiple of {CHUNK}"
            )
        if block_sizes.backward in ("fused", "lean", "columns"):
            raise Unsupported(
                f"chunk_size={chunk}: the fused state backward runs chunks of {CHUNK} "
                "(backward='stages' takes larger chunks)"
            )
        # (where the three stages' tiles fit, the fused forward's do: `fused_forward` checks)
        reason = chunk_reason(x.shape[-1], B.shape[-1], chunk)
        if reason:
            raise Unsupported(reason)
    if interpret:
        raise Unsupported(
            "the Mosaic GPU kernels have no interpret mode (wgmma and TMA copies have no CPU rule)"
        )
    reason = dims_reason(x.shape[-1], B.shape[-1])
    if reason:
        raise Unsupported(reason)
    layout = layout_class(
        block_sizes.forward in ("fused", "lean"),
        block_sizes.group_sums in ("kernels", "scores"),
        block_sizes.transposes == "kernels",
        block_sizes.backward in ("fused", "lean", "columns"),
        lean,
        lean_forward,
        block_sizes.backward in ("lean", "columns"),
        B.shape[-1] // CHUNK if block_sizes.backward == "columns" else 1,
        block_sizes.group_sums == "scores",
    )
    return chunk_kernels.ssd(
        layout, x, dt, A, B, C, D, z, segment_ids, initial_state, chunk_size=chunk, interpret=False
    )
