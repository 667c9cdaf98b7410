"""Mamba-2 SSD on Hopper: `pallas_gpu`'s chunked layer with the chunk state and the chunk scan,
forward and backward, as Pallas Mosaic GPU kernels (`chunked/mosaic_gpu`: their math, layout, grid,
precision and cost), 16-bit operands into float32 accumulators; the recurrence between chunks
and its reverse are `pallas_gpu`'s Triton kernels. This module is the implementation: what it
serves (`supports`), the layer in the form `SSDBlockSizes` names (`ssd`), and what `explain`
says of each form (`describe`)."""

from __future__ import annotations

from axkern.core.op import Implementation, Unsupported
from axkern.ops.chunked import kernel_scan
from axkern.ops.chunked import mosaic_gpu as engine

from .blocks import SSDBlockSizes, mosaic_gpu_heuristic, mosaic_gpu_space

__all__ = ["supports", "ssd", "describe", "IMPLEMENTATION"]

_FUSED_BACKWARD = ("lean", "columns")  # the forms of `backward` that fuse the state backward


def supports(spec) -> str | None:
    return engine.platform_reason(spec) or engine.dims_reason(spec.dim("head_dim"), spec.dim("state"))


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    chunk = block_sizes.chunk_size
    lean = block_sizes.scan_backward == "lean"
    reason = lean and engine.lean_reason(1, chunk, p=x.shape[-1])  # (`ssd`'s B, C are 16-bit here)
    if reason:
        raise Unsupported(f"scan_backward='lean': {reason}")
    if block_sizes.group_sums == "scores" and not lean:
        raise Unsupported(
            "group_sums='scores': with the lean chunk-scan backward only (scan_backward='lean')"
        )
    lean_forward = block_sizes.forward == "lean"
    reason = lean_forward and engine.lean_forward_reason(1, chunk)  # (`ssd`'s B, C are 16-bit here)
    if reason:
        raise Unsupported(f"forward='lean': {reason}")
    fused_backward = block_sizes.backward in _FUSED_BACKWARD
    if chunk != engine.CHUNK:
        # above 64: the kernels by tiles of 64 rows (`chunked/mosaic_gpu/tiled.py`); the fused state
        # backward walks chunks of 64 only
        if chunk % engine.CHUNK or chunk < engine.CHUNK:
            raise Unsupported(
                f"chunk_size={chunk}: the Mosaic GPU kernels run chunks of a multiple of {engine.CHUNK}"
            )
        if fused_backward:
            raise Unsupported(
                f"chunk_size={chunk}: the fused state backward runs chunks of {engine.CHUNK} "
                "(backward='stages' takes larger chunks)"
            )
        # (where the three stages' tiles fit, the fused forward's do: `fused_forward` checks)
        reason = engine.chunk_reason(x.shape[-1], B.shape[-1], chunk)
        if reason:
            raise Unsupported(reason)
    if interpret:
        raise Unsupported(
            "the Mosaic GPU kernels have no interpret mode (wgmma and TMA copies have no CPU rule)"
        )
    reason = engine.dims_reason(x.shape[-1], B.shape[-1])
    if reason:
        raise Unsupported(reason)
    layout = engine.layout_class(
        block_sizes.forward in ("fused", "lean"),
        block_sizes.group_sums in ("kernels", "scores"),
        block_sizes.transposes == "kernels",
        fused_backward,
        lean,
        lean_forward,
        B.shape[-1] // engine.CHUNK if block_sizes.backward == "columns" else 1,
        block_sizes.group_sums == "scores",
    )
    return kernel_scan.ssd(
        layout, x, dt, A, B, C, D, z, segment_ids, initial_state, chunk_size=chunk, interpret=False
    )


def describe(spec, block_sizes) -> str:
    """`mosaic_gpu`'s kernels, forward and backward, for `explain`."""
    bs = block_sizes or SSDBlockSizes()
    forward = (
        "one fused Mosaic GPU kernel (chunk states, recurrence, chunk outputs)"
        if bs.forward in ("fused", "lean")
        else "Mosaic GPU chunk-state and chunk-scan kernels, pallas_gpu's recurrence between them"
    )
    forward += " in one slot of tiles (two blocks an SM)" * (bs.forward == "lean")
    backward = (
        "Mosaic GPU chunk-scan backward kernel, one fused Mosaic GPU kernel for the reverse recurrence and the "
        "chunk-state backward"
        if bs.backward in _FUSED_BACKWARD
        else "Mosaic GPU chunk-scan and chunk-state backward kernels, pallas_gpu's reverse recurrence"
    )
    backward += " in one slot of B (two blocks an SM)" * (bs.backward == "lean")
    backward += " in one slot of B, a block per 64 of the state's columns" * (bs.backward == "columns")
    extras = [("dB, dC summed over heads in the kernels", bs.group_sums == "kernels")]
    scores = "dg and dC's (f ∘ dy) S_in summed over heads in the kernels, dB and dC's dg B from the sums"
    extras += [(scores, bs.group_sums == "scores")]
    extras += [("x, y in the caller's layout in the kernels", bs.transposes == "kernels")]
    extras += [("the lean chunk-scan backward (two blocks an SM)", bs.scan_backward == "lean")]
    notes = "".join(f"; {text}" for text, on in extras if on)
    tiles = ", by tiles of 64 rows" if bs.chunk_size > 64 else ""
    return f"custom_vjp: {backward} (forward: {forward}; chunks of {bs.chunk_size}{tiles}{notes})"


IMPLEMENTATION = Implementation(
    "mosaic_gpu",
    ssd,
    platforms=("gpu",),
    supports=supports,
    block_sizes=SSDBlockSizes,
    heuristic=mosaic_gpu_heuristic,
    space=mosaic_gpu_space,
    backward=describe,
)
