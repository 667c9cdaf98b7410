"""Mamba-3 as Pallas TPU (Mosaic) kernels: SSD's chunk kernels (`ssd/common/kernels.py`, in
`ssd/pallas_tpu.py`'s layout) with the per-position log-decay `adt` and the trapezoid's input
scale, under the chunked form of `common.py` (angles, rotations, correction, gate in XLA).

**Constraints**: one input per position: SISO, or MIMO of rank 1 (a higher rank sums `R` outer
products per position, which the kernels' `[Q, Q]` scores do not hold); chunks a multiple of 8.

**No TPU is available to this project**: verified in TPU interpret mode (`pltpu.InterpretParams`)
only, so it is in no default order.
"""

from __future__ import annotations

from axkern.core.op import Unsupported
from axkern.ops.ssd.blocks import TPU_MIN_CHUNK as MIN_CHUNK
from axkern.ops.ssd.pallas_tpu import TpuLayout

from .common import forward, kernel_core


def supports(spec) -> str | None:
    rank = spec.dim("rank")
    if rank > 1:
        return f"rank={rank}: the chunk kernels take one input per position (SISO or rank 1)"
    return None


def mamba3(*args, block_sizes, interpret=False):
    """`reference.mamba3`'s arguments and results, through the TPU chunk kernels."""
    q = block_sizes.chunk_size
    if q < MIN_CHUNK:
        raise Unsupported(f"chunk_size={q} is below {MIN_CHUNK} (TPU sublanes)")
    core = kernel_core(TpuLayout, chunk_size=q, interpret=bool(interpret), x_dtype=args[2].dtype)
    return forward(core, *args, chunk_size=q)
