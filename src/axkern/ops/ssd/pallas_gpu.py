"""Mamba-2 SSD as Pallas GPU (Triton) kernels, forward and backward: the engine's chunk scan
(`chunked/kernel_scan.py`) in the Triton layout (`chunked/pallas_gpu.py`, `GpuLayout`: vectors as
`[b, h, L]` blocks, the recurrence between chunks and its reverse as kernels).

**Products**: float32 operands, TF32 tensor cores for bf16 inputs, Triton's exact float32
product for fp16 and float32 inputs (the library's rule for float32: TF32 rounds as coarsely
as fp16; docs/ops/ssd.md, "Accuracy", and "Performance" for why the GPU order sends fp16 and
float32 to `xla`). Float32 inputs sum each segment's `sum_{s < r <= t} a_r` on its own
(`chunked/chunk_scan.py`), as the rounding of `cum_t - cum_s` would put the `A` and `dt_bias`
gradients outside the oracle rule. **Constraints**: `P`, `N` and the chunk powers of two and at
least 16 (Triton's `dot` tiles), chunks at most 128 (bf16 inputs) or 64 (fp16 and float32
inputs: shared memory); otherwise the call falls back with the reason.
"""

from __future__ import annotations

import jax.numpy as jnp

from axkern.core import kernels
from axkern.core.op import Implementation, Unsupported
from axkern.ops.chunked import kernel_scan
from axkern.ops.chunked.pallas_gpu import GPU_MAX_CHUNK, GPU_MAX_CHUNK_32BIT, GPU_MIN_DIM, GpuLayout

from .blocks import SSDBlockSizes, pallas_gpu_heuristic, pallas_gpu_space, refuse_mosaic_gpu_forms

__all__ = ["IMPLEMENTATION", "ssd", "supports"]


def supports(spec) -> str | None:
    for name in ("head_dim", "state"):
        n = spec.dim(name)
        if n < GPU_MIN_DIM or n & (n - 1):
            return (
                f"{name}={n}: the Pallas GPU kernels need a power of two >= {GPU_MIN_DIM} (Triton dot tiles)"
            )
    return None


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    refuse_mosaic_gpu_forms(block_sizes)
    kernel_scan.refuse_float64(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, initial_state=initial_state)
    q = block_sizes.chunk_size
    if q < GPU_MIN_DIM:
        raise Unsupported(f"chunk_size={q} is below {GPU_MIN_DIM} (Triton dot tiles)")
    wide = not kernels.tf32_suffices(x.dtype)  # exact float32 products
    high = GPU_MAX_CHUNK_32BIT if wide else GPU_MAX_CHUNK
    if q > high:
        raise Unsupported(
            f"chunk_size={q} with {jnp.dtype(x.dtype).name} inputs: the backward kernel's tiles exceed a "
            f"Hopper block's 227 KiB of shared memory above chunks of {high}"
            + (" (float32 products run as three TF32 products, doubling the operand tiles)" if wide else "")
        )
    return kernel_scan.ssd(
        GpuLayout, x, dt, A, B, C, D, z, segment_ids, initial_state, chunk_size=q, interpret=bool(interpret)
    )


IMPLEMENTATION = Implementation(
    "pallas_gpu",
    ssd,
    platforms=("gpu",),
    supports=supports,
    block_sizes=SSDBlockSizes,
    heuristic=pallas_gpu_heuristic,
    space=pallas_gpu_space,
    interpretable=True,
    backward="custom_vjp: chunk-scan and chunk-state backward kernels, the reverse recurrence as a kernel",
)
