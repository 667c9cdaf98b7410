"""Mamba-3 as Pallas GPU (Triton) kernels: SSD's chunk kernels and its recurrence kernels
(`ssd/common/kernels.py`, `ssd/common/gpu.py`'s layout) with the per-position log-decay `adt` and
the trapezoid's input scale, under the chunked form of `common.py` (angles, rotations and gate
and the diagonal correction in XLA: the kernels can take SISO's as their diagonal term,
`ssd/common/bodies.py`, which on the H200 cost the backward kernel more than XLA's pass).

**Products**: `x` in the inputs' dtype (SISO: `v`) or float32 (MIMO: `v ⊙ W_x`); the rotated
`q`, `k` in float32, heads first (the kernels' layout, `common.kernel_core`); TF32 tensor cores for bf16 inputs, exact float32 for fp16 and float32 inputs, as in
`ssd`. **MIMO**: each token's `R` inputs run as `kernel_slots(R)` consecutive positions (`R`
rounded up to a power of two; `common.kernel_core`), so a chunk of `chunk_size` tokens is
`chunk_size · kernel_slots(R)` kernel positions and costs about that many SISO positions.
**Constraints**: `head_dim`, `state` and the chunk powers of two and at least 16 (the chunk in
positions), chunks of at most 128 positions for a bf16 `x`, 64 for fp16 and float32 ones (float32
inputs, MIMO); otherwise the call falls back with the reason. Verified in interpret mode on the
CPU and compiled against the oracle on an H200, SISO and MIMO (`tests/gpu/test_mamba3_gpu.py`;
fp16 too); timed there behind mamba_ssm's
kernels (docs/ops/mamba3.md), so it is in no default order.
"""

from __future__ import annotations

from axkern.core import kernels
from axkern.core.op import Unsupported
from axkern.ops.ssd.blocks import GPU_MAX_CHUNK as MAX_CHUNK
from axkern.ops.ssd.blocks import GPU_MAX_CHUNK_32BIT as MAX_CHUNK_32BIT
from axkern.ops.ssd.blocks import GPU_MIN_DIM as MIN_DIM
from axkern.ops.ssd.common.gpu import GpuLayout

from .blocks import kernel_slots
from .common import forward, kernel_core, kernel_x_dtype


def _max_chunk(dtype, mimo) -> int:
    """The largest chunk, in kernel positions, for `x` of `kernel_x_dtype(dtype, mimo)` and the
    products' precision (exact for fp16 and float32 inputs)."""
    wide = kernel_x_dtype(dtype, mimo).itemsize > 2 or not kernels.tf32_suffices(dtype)
    return MAX_CHUNK_32BIT if wide else MAX_CHUNK


def supports(spec) -> str | None:
    for name in ("head_dim", "state"):
        n = spec.dim(name)
        if n < MIN_DIM or n & (n - 1):
            return f"{name}={n}: the Pallas GPU kernels need a power of two >= {MIN_DIM} (Triton dot tiles)"
    rank, mimo = spec.dim("rank"), bool(spec.flag("mimo"))
    if kernel_slots(rank) > _max_chunk(spec.dtype, mimo):
        return (
            f"rank={rank}: one token takes {kernel_slots(rank)} kernel positions, more than the largest "
            f"chunk ({_max_chunk(spec.dtype, mimo)} positions)"
        )
    return None


def mamba3(*args, block_sizes, interpret=False):
    """`reference.mamba3`'s arguments and results, through the GPU chunk kernels."""
    q = block_sizes.chunk_size
    dtype, mimo = args[2].dtype, args[16] is not None  # v, W_x
    slots = kernel_slots(args[0].shape[2])
    chunk = f"chunk_size={q}" + (f" ({q * slots} positions, {slots} per token)" if slots > 1 else "")
    if q * slots < MIN_DIM:
        raise Unsupported(f"{chunk} is below {MIN_DIM} (Triton dot tiles)")
    high = _max_chunk(dtype, mimo)
    if q * slots > high:
        x = f"{kernel_x_dtype(dtype, mimo).name} x" + (" (MIMO)" if mimo else "")
        raise Unsupported(
            f"{chunk} with {x}: the backward kernel's tiles exceed the H200's 227 KiB of shared "
            f"memory above chunks of {high} positions"
        )
    # the diagonal correction in XLA, not in the kernels (`diagonal=False`): on the H200 the
    # Triton backward kernel's share of it cost more than XLA's pass (docs/ops/mamba3.md)
    core = kernel_core(
        GpuLayout, chunk_size=q, interpret=bool(interpret), dtype=dtype, mimo=mimo, diagonal=False
    )
    return forward(core, *args, chunk_size=q, later_ranks=True)
