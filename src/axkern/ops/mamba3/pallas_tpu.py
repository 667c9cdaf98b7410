"""Mamba-3 as Pallas TPU (Mosaic) kernels: the engine's chunk kernels (`chunked/kernel_scan.py`,
in the Mosaic TPU layout `chunked/pallas_tpu.py`) with the per-position log-decay `adt` and the
trapezoid's input scale, under the chunked form of `common/layer.py` (angles, rotations and gate
in XLA; SISO's diagonal correction inside the chunk-scan kernels, `chunked/chunk_scan.py`; MIMO's
in XLA).

**MIMO**: each token's `R` inputs run as `kernel_slots(R)` consecutive positions (`R` rounded up
to a power of two; `common/kernel_core.py`), so a chunk of `chunk_size` tokens is `chunk_size ·
kernel_slots(R)` kernel positions. `Mamba3BlockSizes(transposes="kernels")`: `v`, `y` and their
gradients with the positions on the lanes (`TpuLanesLayout`).

**`Mamba3BlockSizes(rotation="kernel")`** (SISO; the heuristic's where it serves, faster and
far leaner than XLA's rotation on a TPU v5e, docs/ops/mamba3.md): the kernels turn `q` and `k`
themselves, from the unrotated values per group, the biases and the angles
(`common.kernel_core.rotating_core`, `chunked/tpu_rotation.py`), where XLA's rotation writes them
per head in float32 (`[b, H, L, N]` each, kept for the backward and read by every kernel); the
backward kernels turn the cotangents back and sum them over each group's heads themselves, with
the biases' and the angles' gradients. Chunks of a multiple of 128 positions, a state of a
multiple of 16 and angles of a multiple of 8 (`chunked.pallas_tpu.rotation_reason`).

**Constraints**: chunks of a multiple of 8 positions (of 128 with the positions on the lanes).

In CI in TPU interpret mode (`pltpu.InterpretParams`) and lowered for a TPU; compiled on a TPU
v5e it passes `tests/tpu` and is first in mamba3's TPU order (docs/tpu.md, "Measured").
"""

from __future__ import annotations

from axkern.core.op import Implementation, Unsupported
from axkern.ops.chunked.pallas_tpu import TPU_MIN_CHUNK, TpuLanesLayout, TpuLayout, lanes_reason
from axkern.ops.chunked.pallas_tpu import rotation_reason as kernels_rotation_reason

from .blocks import Mamba3BlockSizes, kernel_slots, pallas_tpu_heuristic, pallas_tpu_space, refuse_forms
from .common.kernel_core import kernel_core, refuse_float64, rotating_core
from .common.layer import forward

__all__ = ["IMPLEMENTATION", "mamba3"]


def mamba3(*args, block_sizes, interpret=False):
    """`reference.mamba3`'s arguments and results, through the TPU chunk kernels."""
    refuse_forms(block_sizes, "pallas_tpu")
    refuse_float64(args)
    q = block_sizes.chunk_size
    slots = kernel_slots(args[0].shape[2])
    if q * slots < TPU_MIN_CHUNK:
        chunk = f"chunk_size={q}" + (f" ({q * slots} positions, {slots} per token)" if slots > 1 else "")
        raise Unsupported(f"{chunk} is below {TPU_MIN_CHUNK} (TPU sublanes)")
    layout = TpuLayout
    if block_sizes.transposes == "kernels":
        reason = lanes_reason(q * slots, args[2].shape[-1])  # v's head dim
        if reason:
            raise Unsupported(f"transposes='kernels': chunk_size={q} ({q * slots} positions): {reason}")
        layout = TpuLanesLayout
    dtype, mimo = args[2].dtype, args[16] is not None  # v, W_x
    if block_sizes.rotation == "kernel":
        reason = rotation_reason(mimo, q * slots, args[0].shape[-1], args[8].shape[-1])  # q: N; angles: A
        if reason:
            raise Unsupported(f"rotation='kernel': {reason}")
        core = rotating_core(layout, chunk_size=q, dtype=dtype, interpret=bool(interpret), diagonal=True)
    else:
        core = kernel_core(layout, chunk_size=q, interpret=bool(interpret), dtype=dtype, mimo=mimo)
    return forward(core, *args, chunk_size=q, later_ranks=True)


def rotation_reason(mimo: bool, positions: int, state: int, angles: int) -> str | None:
    """Why the kernels cannot turn `q` and `k` themselves (`rotation="kernel"`), or None."""
    if mimo:
        return "SISO only (MIMO's ranks run as kernel positions, each turned by its token's angles)"
    return kernels_rotation_reason(positions, state, angles)


def describe(spec, block_sizes) -> str:
    """`explain`'s backward line: SSD's backward kernels, and where the positions lie."""
    line = "custom_vjp: SSD's backward kernels"
    if block_sizes is not None and block_sizes.rotation == "kernel":
        line += "; q, k turned inside the kernels, their cotangents turned back and summed per group there"
    if block_sizes is not None and block_sizes.transposes == "kernels":
        line += "; v, dy, dv as [b, H, P, L], the kernels transposing their tiles"
    return line


IMPLEMENTATION = Implementation(
    "pallas_tpu",
    mamba3,
    platforms=("tpu",),
    block_sizes=Mamba3BlockSizes,
    heuristic=pallas_tpu_heuristic,
    space=pallas_tpu_space,
    interpretable=True,
    backward=describe,
)
