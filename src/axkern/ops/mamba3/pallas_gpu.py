"""Mamba-3 as Pallas GPU (Triton) kernels: SSD's chunk kernels and its recurrence kernels
(`ssd/common/kernels.py`, `ssd/pallas_gpu.py`'s layout) with the per-position log-decay `adt` and
the trapezoid's input scale, under the chunked form of `common.py` (angles, rotations,
correction, gate in XLA).

**Products**: `x` in the inputs' dtype; the rotated `q`, `k` in float32; TF32 tensor cores for
16-bit inputs, exact float32 for float32 inputs, as in `ssd`. **Constraints**: one input per
position (SISO, or MIMO of rank 1); `head_dim`, `state` and the chunk powers of two and at least
16, chunks at most 128 (16-bit inputs) or 64 (float32); otherwise the call falls back with the
reason. Verified in interpret mode on the CPU and compiled against the oracle on an H200
(`tests/gpu/test_mamba3_gpu.py`); not yet timed, so it is in no default order.
"""

from __future__ import annotations

import jax.numpy as jnp

from axkern.core.op import Unsupported
from axkern.ops.ssd.blocks import GPU_MAX_CHUNK as MAX_CHUNK
from axkern.ops.ssd.blocks import GPU_MAX_CHUNK_32BIT as MAX_CHUNK_32BIT
from axkern.ops.ssd.blocks import GPU_MIN_DIM as MIN_DIM
from axkern.ops.ssd.pallas_gpu import GpuLayout

from .common import forward, kernel_core


def supports(spec) -> str | None:
    rank = spec.dim("rank")
    if rank > 1:
        return f"rank={rank}: the chunk kernels take one input per position (SISO or rank 1)"
    for name in ("head_dim", "state"):
        n = spec.dim(name)
        if n < MIN_DIM or n & (n - 1):
            return f"{name}={n}: the Pallas GPU kernels need a power of two >= {MIN_DIM} (Triton dot tiles)"
    return None


def mamba3(*args, block_sizes, interpret=False):
    """`reference.mamba3`'s arguments and results, through the GPU chunk kernels."""
    q = block_sizes.chunk_size
    dtype = args[2].dtype
    if q < MIN_DIM:
        raise Unsupported(f"chunk_size={q} is below {MIN_DIM} (Triton dot tiles)")
    wide = jnp.dtype(dtype).itemsize > 2
    if q > (MAX_CHUNK_32BIT if wide else MAX_CHUNK):
        raise Unsupported(
            f"chunk_size={q} with {jnp.dtype(dtype).name} inputs: the backward kernel's tiles exceed the "
            f"H200's 227 KiB of shared memory above chunks of {MAX_CHUNK_32BIT if wide else MAX_CHUNK}"
        )
    core = kernel_core(GpuLayout, chunk_size=q, interpret=bool(interpret), x_dtype=dtype)
    return forward(core, *args, chunk_size=q)
