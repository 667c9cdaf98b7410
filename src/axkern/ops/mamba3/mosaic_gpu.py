"""Mamba-3 SISO on Hopper: SSD's Pallas Mosaic GPU chunk kernels (`chunked/mosaic_gpu`: TMA,
`wgmma` with 16-bit operands into float32 accumulators) under the chunked form of `common`,
with the per-position log-decay `adt` and the trapezoid's input scale (the angles by one Triton
kernel, `common/angle_kernel.py`; rotations, gate and the diagonal correction in XLA, as
`pallas_gpu`).

**`q` and `k` as two bf16 halves.** SSD's kernels take `B` and `C` as bf16 inputs; Mamba-3's are
the rotated, biased `k` and `q`, float32 values. Rounded to bf16 they missed the oracle rule
(docs/ops/mamba3.md, "`q` and `k` as two bf16 halves", has the errors). Here each enters the
kernels as `hi + lo`, two bf16 arrays (`chunked.mosaic_gpu.operand_parts`: `hi` the value
rounded to bf16, `lo` what that lost, rounded), and every product with `B` or `C` takes both:
two `wgmma`s where the other operand is 16-bit, three where it is a float32 value's halves too
(`lo · lo` left out), so the products are about as exact as float32 ones. The halves (`[b, H, L, N]` bf16 each, heads first as the kernels read them)
are formed beside the rotation: in XLA where XLA turns `q`, `k` (`rotation="xla"`, the stages),
else by the kernels below.

**The forward kernel turns `q` and `k` itself** where nothing differentiates the call
(`Mamba3BlockSizes(rotation="kernel")`, None means this where it serves: the fused forward, bf16
`q`, `k`, a state that is a multiple of 128; `rotating_core`): it takes the unrotated `q`, `k` per
group, the biases and the angles (`chunked/mosaic_gpu/operands.py`), and the halves per head never
cross memory. A differentiated call forms them once (the scan's `custom_vjp`), by one Pallas
Triton kernel for both `q` and `k` (`chunked/mosaic_gpu/rotation_kernel.py`: `cos`, `sin` once,
no float32 rotation in memory), runs the same kernels on them and keeps them for the
backward's, whose chunk-scan and chunk-state kernels also take the angles and return `dq`, `dk`
per head turned back (XLA sums them over the heads and forms the angles' gradient).
`rotation="xla"`: XLA's halves and XLA's rotation backward. docs/ops/mamba3.md has the two
forms timed.

**Cost** over SSD's kernels at the same shape: `C Bᵀ` three products where SSD has one, `C S_inᵀ`,
the own state, `dS_in`, `dB`, `dC` and the state's backward twice as many on `B`, `C` (the
package docstring of `chunked/mosaic_gpu` has SSD's); bytes: `B`, `C` per head (`H / G` times SSD's
for `G` groups) and twice as wide.

**Constraints**: a Hopper GPU, bf16 inputs (fp16's range could not hold the halves of float32
values), SISO (MIMO's `v ⊙ W_x` enters the kernels in float32, which SSD's kernels take only as
bf16 `x`), chunks of 64 tokens, head dim and state multiples of 64 whose tiles, with `B`, `C` as
two tiles each, fit shared memory (`chunked.mosaic_gpu.dims_reason(..., parts=2)`: 64 and 64, 64 and
128, 128 and 64). The fused forward by default, the three stages with
`Mamba3BlockSizes(forward="stages")`.

**Interpret mode**: none (Mosaic GPU's `wgmma` and TMA copies have no CPU rule). CI lowers the
layer for CUDA and runs it through the kernels' arithmetic (`chunked.mosaic_gpu.EmulatedLayout`, `B`,
`C` as the same halves) against the float64 oracle; the kernels run on a GPU in
`tests/gpu/test_mamba3_gpu.py`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from axkern.core.blocks import unique_valid
from axkern.core.op import Implementation, Unsupported
from axkern.ops.chunked import mosaic_gpu as kernels

from .blocks import Mamba3BlockSizes, angles_form, mosaic_gpu_heuristic, refuse_forms
from .common.kernel_core import kernel_core
from .common.kernel_core import rotating_core as shared_rotating_core
from .common.layer import forward

CHUNK = kernels.CHUNK
PARTS = 2  # `B`, `C` as two bf16 halves each

_MIMO = (
    "MIMO: v ⊙ W_x enters the kernels in float32 (rounded to bf16 it missed the oracle rule at rank 3); "
    "the Mosaic GPU kernels take x only in bf16"
)


def supports(spec) -> str | None:
    if spec.flag("mimo"):
        return _MIMO
    reason = kernels.platform_reason(spec)  # the import, a Hopper GPU, bf16
    return reason or kernels.dims_reason(spec.dim("head_dim"), spec.dim("state"), PARTS)


def mamba3(*args, block_sizes, interpret=False):
    """`reference.mamba3`'s arguments and results, through SSD's Mosaic GPU chunk kernels."""
    refuse_forms(block_sizes, "mosaic_gpu")
    if interpret:
        raise Unsupported(
            "the Mosaic GPU kernels have no interpret mode (wgmma and TMA copies have no CPU rule)"
        )
    if args[16] is not None:  # W_x
        raise Unsupported(_MIMO)
    if block_sizes.chunk_size != CHUNK:
        raise Unsupported(
            f"chunk_size={block_sizes.chunk_size}: the Mosaic GPU kernels run chunks of {CHUNK}"
        )
    v, q = args[2], args[0]
    if v.dtype != jnp.bfloat16:
        raise Unsupported(f"the Mosaic GPU kernels take bf16 inputs, not {v.dtype}")
    p, n = v.shape[-1], q.shape[-1]
    reason = kernels.dims_reason(p, n, PARTS)
    if reason:
        raise Unsupported(reason)
    # x (v) and y in the caller's [b, L, H, P] (no transposes); dB, dC per head (B, C are per
    # head after the rotation: there are no groups to sum)
    # the fused forward unless the stages are asked for: its tiles fit wherever `dims_reason`
    # admits the sizes (`kernels.fused_fits`, held in tests/ops/test_mamba3_mosaic_gpu.py)
    fused = block_sizes.forward != "stages"
    layout = kernels.layout_class(fused, False, True, False)
    reason = rotation_reason(block_sizes, p, n, fused, q.dtype, args[1].dtype)
    angle_kernel = block_sizes.angles != "xla"
    if reason is None:
        core = rotating_core(layout, v.dtype, angle_kernel=angle_kernel)
        return forward(core, *args, chunk_size=CHUNK, later_ranks=True)
    if block_sizes.rotation == "kernel":
        raise Unsupported(f"rotation='kernel': {reason}")
    core = kernel_core(
        layout,
        chunk_size=CHUNK,
        interpret=False,
        dtype=v.dtype,
        mimo=False,
        diagonal=False,
        angle_kernel=angle_kernel,
    )
    return forward(core, *args, chunk_size=CHUNK, later_ranks=True)


def space(spec) -> list[Mamba3BlockSizes]:
    """The heuristic's form (the fused forward, turning `q` and `k` itself where it serves; `Θ`
    by the Triton kernel), then each of its parts taken back one at a time: the three stages,
    XLA's rotation (where the kernel's would serve), XLA's angles (`axkern tune` times each;
    chunks of 64 only)."""
    best = mosaic_gpu_heuristic(spec)
    p, n, dtype = spec.dim("head_dim"), spec.dim("state"), jnp.dtype(spec.dtype)
    rotates = rotation_reason(best, p, n, best.forward != "stages", dtype) is None
    forms = [
        best,
        dataclasses.replace(best, forward="stages"),
        *[dataclasses.replace(best, rotation="xla")] * rotates,
        dataclasses.replace(best, angles="xla"),
    ]
    return unique_valid(forms, spec)


def describe(spec, block_sizes) -> str:
    """How a call of `spec` forms its forward and gradients (`explain`'s backward line): where `q`,
    `k` are turned, and the backward's kernels."""
    bs = block_sizes or Mamba3BlockSizes(CHUNK)
    fused = bs.forward != "stages"
    reason = rotation_reason(bs, spec.dim("head_dim"), spec.dim("state"), fused, jnp.dtype(spec.dtype))
    where = (
        "the fused forward kernel turns q, k itself where nothing differentiates the call, else one Triton "
        "kernel (rotated_parts) forms their bf16 halves once for the forward's and backward's kernels, and "
        "the backward kernels turn dq, dk back by the angles"
        if reason is None
        else f"XLA forms q, k as two bf16 halves ({reason})"
    )
    return (
        f"custom_vjp: {where}; {angles_form(bs)}; SSD's Mosaic GPU chunk-scan and chunk-state backward "
        "kernels, pallas_gpu's reverse recurrence"
    )


def rotation_reason(block_sizes, p, n, fused, *dtypes) -> str | None:
    """Why `q`, `k` are not turned in the fused forward kernel (`rotating_core`), or None."""
    if block_sizes.rotation == "xla":
        return "rotation='xla' asks for XLA's"
    if not fused:
        return "only the fused forward turns q and k itself"
    if any(d != jnp.bfloat16 for d in dtypes):
        return "the rotating forward takes q and k in bf16"
    return kernels.rotation_reason(p, n)


def rotating_core(layout, dtype, interpret=False, angle_kernel=False):
    """`common.kernel_core.rotating_core` at chunks of 64 whose forward kernel turns `q` and `k`
    itself (`chunked/mosaic_gpu/operands.py`), `x` as it comes (`cleans_x`), the diagonal
    correction in XLA. `interpret`: the layout's Pallas stages (the recurrences) in interpret
    mode (an emulating layout's, on the CPU)."""
    return shared_rotating_core(
        layout, chunk_size=CHUNK, dtype=dtype, interpret=interpret, clean_x=True, angle_kernel=angle_kernel
    )


IMPLEMENTATION = Implementation(
    "mosaic_gpu",
    mamba3,
    platforms=("gpu",),
    supports=supports,
    block_sizes=Mamba3BlockSizes,
    heuristic=mosaic_gpu_heuristic,
    space=space,
    backward=describe,
)
