"""Mamba-3 as Pallas TPU (Mosaic) kernels: SSD's chunk kernels (`chunked/kernels.py`, in
`ssd/pallas_tpu.py`'s layout) with the per-position log-decay `adt` and the trapezoid's input
scale, under the chunked form of `common` (angles, rotations and gate in XLA; SISO's diagonal
correction inside the chunk-scan kernels, `chunked/bodies.py`; MIMO's in XLA).

**MIMO**: each token's `R` inputs run as `kernel_slots(R)` consecutive
positions (`R` rounded up to a power of two; `common.kernel_core`), so a chunk of `chunk_size`
tokens is `chunk_size · kernel_slots(R)` kernel positions. **Constraints**: chunks of a
multiple of 8 positions.

**No TPU is available to this project**: verified in TPU interpret mode (`pltpu.InterpretParams`)
only, so it is in no default order.
"""

from __future__ import annotations

from axkern.core.op import Unsupported
from axkern.ops.ssd.blocks import TPU_MIN_CHUNK as MIN_CHUNK
from axkern.ops.ssd.pallas_tpu import TpuLayout

from .blocks import kernel_slots, refuse_forms
from .common import forward, kernel_core


def mamba3(*args, block_sizes, interpret=False):
    """`reference.mamba3`'s arguments and results, through the TPU chunk kernels."""
    refuse_forms(block_sizes, "pallas_tpu")
    q = block_sizes.chunk_size
    slots = kernel_slots(args[0].shape[2])
    if q * slots < MIN_CHUNK:
        chunk = f"chunk_size={q}" + (f" ({q * slots} positions, {slots} per token)" if slots > 1 else "")
        raise Unsupported(f"{chunk} is below {MIN_CHUNK} (TPU sublanes)")
    dtype, mimo = args[2].dtype, args[16] is not None  # v, W_x
    core = kernel_core(TpuLayout, chunk_size=q, interpret=bool(interpret), dtype=dtype, mimo=mimo)
    return forward(core, *args, chunk_size=q, later_ranks=True)
