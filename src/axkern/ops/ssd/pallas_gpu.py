"""Mamba-2 SSD as Pallas GPU (Triton) kernels, forward and backward (`common/kernels.py`).

Vectors (`dt`, `cum`, weights, segment ids) stay `[b, h, L]` (`[b, L]`) and are read as
`[Q]` blocks, broadcast into columns or rows in registers.

**Products**: float32 operands, TF32 tensor cores for bf16 inputs, Triton's exact float32
product for fp16 and float32 inputs (the library's rule for float32; TF32 rounds as coarsely
as fp16, and fp16 missed the oracle rule with it on the H200; slower than `xla`'s exact
products, so the GPU order sends fp16 and float32 to `xla`). Float32 inputs sum each segment's
`sum_{s < r <= t} a_r` on its own (`common/kernels.py`), as the rounding of `cum_t - cum_s` would
put the `A` and `dt_bias` gradients outside the oracle rule (docs/ops/ssd.md, "Accuracy").
The recurrence between chunks and its reverse are kernels (`chunked/pallas_gpu.py`, `GpuLayout.recurrence`). **Constraints**:
`P`, `N` and the chunk powers of two and at least 16 (Triton's `dot` tiles), chunks at most
128 (bf16 inputs) or 64 (fp16 and float32 inputs: shared memory); otherwise the call falls back
with the reason.
"""

from __future__ import annotations

import jax.numpy as jnp

from axkern.core import kernels
from axkern.core.op import Unsupported

from .blocks import GPU_MAX_CHUNK as MAX_CHUNK
from .blocks import GPU_MAX_CHUNK_32BIT as MAX_CHUNK_32BIT
from .blocks import GPU_MIN_DIM as MIN_DIM
from .blocks import refuse_mosaic_gpu_forms
from axkern.ops.chunked import kernels as chunk_kernels
from axkern.ops.chunked.pallas_gpu import GpuLayout


def supports(spec) -> str | None:
    for name in ("head_dim", "state"):
        n = spec.dim(name)
        if n < MIN_DIM or n & (n - 1):
            return f"{name}={n}: the Pallas GPU kernels need a power of two >= {MIN_DIM} (Triton dot tiles)"
    return None


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    refuse_mosaic_gpu_forms(block_sizes)
    q = block_sizes.chunk_size
    if q < MIN_DIM:
        raise Unsupported(f"chunk_size={q} is below {MIN_DIM} (Triton dot tiles)")
    wide = not kernels.tf32_suffices(x.dtype)  # exact float32 products
    if q > (MAX_CHUNK_32BIT if wide else MAX_CHUNK):
        raise Unsupported(
            f"chunk_size={q} with {jnp.dtype(x.dtype).name} inputs: the backward kernel's tiles exceed the "
            f"H200's 227 KiB of shared memory above chunks of {MAX_CHUNK_32BIT if wide else MAX_CHUNK}"
            + (" (float32 products run as three TF32 products, doubling the operand tiles)" if wide else "")
        )
    return chunk_kernels.ssd(
        GpuLayout, x, dt, A, B, C, D, z, segment_ids, initial_state, chunk_size=q, interpret=bool(interpret)
    )
