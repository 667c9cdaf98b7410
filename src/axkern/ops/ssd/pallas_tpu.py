"""Mamba-2 SSD as Pallas TPU (Mosaic) kernels, forward and backward: the engine's chunk scan
(`chunked/kernel_scan.py`) in the Mosaic TPU layout (`chunked/pallas_tpu.py`, `TpuLayout`: its
vector layout, constraints and VMEM), or with `dB`, `dC` per head for XLA's sum
(`SSDBlockSizes(group_sums="xla")`, `TpuHeadsLayout`). **Constraints**: the chunk a multiple of 8
(sublanes).

In CI in TPU interpret mode (`pltpu.InterpretParams`) and lowered for a TPU; compiled on a TPU
v5e it passes `tests/tpu` and is first in the TPU order (docs/tpu.md, "Measured").
"""

from __future__ import annotations

from axkern.core.op import Implementation, Unsupported
from axkern.ops.chunked import kernel_scan
from axkern.ops.chunked.pallas_tpu import (
    TPU_MIN_CHUNK,
    TpuHeadsLanesLayout,
    TpuHeadsLayout,
    TpuLanesLayout,
    TpuLayout,
    lanes_reason,
)

from .blocks import SSDBlockSizes, pallas_tpu_heuristic, pallas_tpu_space, refuse_mosaic_gpu_forms

__all__ = ["IMPLEMENTATION", "ssd"]


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    refuse_mosaic_gpu_forms(block_sizes, allow=(("group_sums", "kernels"), ("transposes", "kernels")))
    kernel_scan.refuse_float64(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, initial_state=initial_state)
    q = block_sizes.chunk_size
    if q < TPU_MIN_CHUNK:
        raise Unsupported(f"chunk_size={q} is below {TPU_MIN_CHUNK} (TPU sublanes)")
    lanes = block_sizes.transposes == "kernels"
    reason = lanes and lanes_reason(q, x.shape[-1])
    if reason:
        raise Unsupported(f"transposes='kernels': chunk_size={q}: {reason}")
    # (dB, dC summed in VMEM or by XLA) x (positions along the rows or the lanes)
    layouts = {"xla": (TpuHeadsLayout, TpuHeadsLanesLayout)}.get(
        block_sizes.group_sums, (TpuLayout, TpuLanesLayout)
    )
    layout = layouts[lanes]
    return kernel_scan.ssd(
        layout, x, dt, A, B, C, D, z, segment_ids, initial_state, chunk_size=q, interpret=bool(interpret)
    )


def describe(spec, block_sizes) -> str:
    """`explain`'s backward line: where `dB` and `dC` are summed over each group's heads, and
    where the positions lie."""
    if block_sizes is not None and block_sizes.group_sums == "xla":
        line = "custom_vjp: the same backward kernels; dB, dC per head, summed over each group's heads by XLA"
    else:
        line = "custom_vjp: the same backward kernels; dB, dC summed over each group's heads in VMEM by the kernels"
    if block_sizes is not None and block_sizes.transposes == "kernels":
        line += "; x, dy, dx as [b, H, P, L], the kernels transposing their tiles"
    return line


IMPLEMENTATION = Implementation(
    "pallas_tpu",
    ssd,
    platforms=("tpu",),
    block_sizes=SSDBlockSizes,
    heuristic=pallas_tpu_heuristic,
    space=pallas_tpu_space,
    interpretable=True,
    backward=describe,
)
