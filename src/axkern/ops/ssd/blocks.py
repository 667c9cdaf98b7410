"""Chunk size of the SSD scan: each implementation's heuristic and the chunk sizes `axkern
tune` sweeps for it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax.numpy as jnp

from axkern.core import backend, kernels
from axkern.core.blocks import BlockSizes, grid, next_power_of_2, unique_valid
from axkern.core.op import Spec, Unsupported
from axkern.ops.chunked.mosaic_gpu import (
    chunk_reason,
    lean_forward_shares_an_sm,
    lean_shares_an_sm,
    lean_state_bwd_shares_an_sm,
)
from axkern.ops.chunked.pallas_gpu import GPU_MAX_CHUNK, GPU_MAX_CHUNK_32BIT, GPU_MIN_DIM
from axkern.ops.chunked.pallas_tpu import TPU_MIN_CHUNK, lanes_reason

__all__ = [
    "SSDBlockSizes",
    "bucket",
    "heuristic",
    "space",
    "mosaic_gpu_heuristic",
    "mosaic_gpu_space",
    "refuse_mosaic_gpu_forms",
    "pallas_gpu_heuristic",
    "pallas_gpu_space",
    "pallas_tpu_heuristic",
    "pallas_tpu_space",
]


@dataclasses.dataclass(frozen=True)
class SSDBlockSizes(BlockSizes):
    """`chunk_size`: positions per chunk (a power of two); the length need not be a multiple.
    `forward` (`mosaic_gpu` only): `"stages"` (the chunk states, the recurrence and the chunk
    outputs as three kernels; None means this) or `"fused"` (one kernel per batch row and head
    walking its chunks, `chunked/mosaic_gpu/forward.py`) or `"lean"` (the fused one in one slot of
    tiles, 99 KiB at P 64, N 128 where the fused one takes 155, so that two blocks share an SM;
    chunks of 64; `chunked/mosaic_gpu/forward_lean.py`). `group_sums` (`mosaic_gpu` and
    `pallas_tpu`): where the backward sums `dB` and `dC` over each group's heads: `"xla"` (the
    kernels write them per head, float32; None means this on `mosaic_gpu`) or `"kernels"` (on
    `mosaic_gpu` the kernels add each head's tiles into the group's rows by TMA reductions, the
    additions' order free; on `pallas_tpu`, where None means this, each head's tiles into its
    group's block while it stays in VMEM, the grid's heads innermost, `chunked/pallas_tpu.py`:
    no per-head arrays either way) or `"scores"` (`mosaic_gpu`, with the lean chunk-scan
    backward: each head's `[Q, Q]` `dg` added into its group's sum in place of `dB` and `dC`'s
    `dg B`, which XLA forms from the sums, `chunked/mosaic_gpu/group_scores.py`). `transposes`
    (`mosaic_gpu` and `pallas_tpu`): `"xla"` (XLA moves `x` to `[b, H, L, P]` for the kernels
    and `y` back; None means this) or `"kernels"` (on `mosaic_gpu` the kernels read `x`, `dy`
    and write `y`, `dx` in the caller's `[b, L, H, P]`, a strided tile per head; on
    `pallas_tpu` XLA lays them out `[b, H, P, L]`, the positions on the lanes, and the kernels
    transpose their `[P, Q]` tiles: chunks of a multiple of 128, `chunked/pallas_tpu.py`).
    `backward` (`mosaic_gpu` only): `"stages"` (the reverse recurrence and the chunk states'
    backward as two kernels; None means this) or `"lean"` (one kernel per batch row and head
    walking its chunks from the last, in one slot of `B` and one staging tile, 99 KiB at P 64, N
    128, so that two blocks share an SM; `chunked/mosaic_gpu/state_backward.py`) or `"columns"`
    (that kernel a block per 64 of the state's columns, adding their parts of `dx` and `dw`: 60
    KiB at P 64, N 128, three blocks an SM, twice the blocks). `scan_backward` (`mosaic_gpu`
    only, chunks of 64): `"whole"` (None means this) or `"lean"` (the chunk-scan backward in 108
    KiB of shared memory at P 64, N 128 rather than 188, so that two blocks share an SM: P 64
    only, the entering state's low half in `M`'s tiles, every result out through one 64 × 64
    float32 staging tile; `chunked/mosaic_gpu/scan_backward.py`)."""

    choices: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "forward": ("stages", "fused", "lean"),
        "group_sums": ("xla", "kernels", "scores"),
        "transposes": ("xla", "kernels"),
        "backward": ("stages", "lean", "columns"),
        "scan_backward": ("whole", "lean"),
    }

    chunk_size: int = 64
    forward: str | None = None
    group_sums: str | None = None
    transposes: str | None = None
    backward: str | None = None
    scan_backward: str | None = None

    def check(self, spec):
        if self.chunk_size & (self.chunk_size - 1):
            return f"chunk_size={self.chunk_size} is not a power of two"
        return None


# `mosaic_gpu`'s forms: the field, its value and what only `mosaic_gpu` does with it
MOSAIC_GPU_FORMS = (
    ("forward", "fused", "has a fused forward"),
    ("forward", "lean", "has a lean fused forward"),
    ("group_sums", "kernels", "sums dB and dC in its kernels (pallas_tpu too)"),
    ("group_sums", "scores", "sums dg in its kernels"),
    ("backward", "lean", "has a fused state backward"),
    ("backward", "columns", "has a fused state backward over the state's columns"),
    ("transposes", "kernels", "transposes x's tiles in its kernels (pallas_tpu too)"),
    ("scan_backward", "lean", "has a lean chunk-scan backward"),
)


def refuse_mosaic_gpu_forms(block_sizes: SSDBlockSizes, allow: tuple = ()) -> None:
    """Refuse `mosaic_gpu`'s forms (`MOSAIC_GPU_FORMS`) but those `allow` names as `(field,
    value)`: an implementation other than `mosaic_gpu` has none of them but its own."""
    for name, value, what in MOSAIC_GPU_FORMS:
        if getattr(block_sizes, name) == value and (name, value) not in allow:
            raise Unsupported(f"{name}={value!r}: only mosaic_gpu {what}")


def bucket(spec: Spec) -> dict:
    return {k: next_power_of_2(v) for k, v in spec.dims} | {"dtype": spec.dtype}


def heuristic(spec: Spec) -> SSDBlockSizes:
    """`xla`: chunks of 256 on GPU (mamba_ssm's choice); 64 elsewhere, which keeps the
    quadratic part of each chunk cheap on a CPU."""
    limit = 256 if spec.platform == "gpu" else 64
    return SSDBlockSizes(chunk_size=min(limit, next_power_of_2(spec.dim("length"))))


def _chunks(spec: Spec, low: int, high: int) -> list[int]:
    top = max(low, min(high, next_power_of_2(spec.dim("length"))))
    return [q for q in (8, 16, 32, 64, 128, 256) if low <= q <= top]


def space(spec: Spec) -> list[SSDBlockSizes]:
    """`xla`: chunks of 16 to 256 positions."""
    return grid(SSDBlockSizes, spec, first=heuristic(spec), chunk_size=_chunks(spec, 16, 256))


def pallas_gpu_heuristic(spec: Spec) -> SSDBlockSizes:
    """Chunks of 64: a program holds `[Q, Q]` float32 score and decay tiles in registers, which
    at mamba_ssm's 256 would need sub-tiling (docs/ops/ssd.md, "Performance", has the times
    of 64 and 128)."""
    return SSDBlockSizes(chunk_size=max(GPU_MIN_DIM, min(64, next_power_of_2(spec.dim("length")))))


def pallas_gpu_space(spec: Spec) -> list[SSDBlockSizes]:
    """Chunks of 16 up to the largest whose backward fits in shared memory (128 for bf16 inputs,
    64 for fp16 and float32: their products are exact)."""
    wide = not kernels.tf32_suffices(spec.dtype)
    high = GPU_MAX_CHUNK_32BIT if wide else GPU_MAX_CHUNK
    return grid(
        SSDBlockSizes, spec, first=pallas_gpu_heuristic(spec), chunk_size=_chunks(spec, GPU_MIN_DIM, high)
    )


def pallas_tpu_heuristic(spec: Spec) -> SSDBlockSizes:
    """Chunks of 256 (two MXU widths: the fastest of the tuner's chunks on a v5e at the 2.7B
    layer, and the least memory, the chunks' states being half those of 128), `dB` and `dC`
    summed over each group's heads in the kernels (`group_sums="kernels"`: less temporary
    memory forward+backward than per-head sums in XLA), and `x`, `y` and their gradients with
    the positions on the lanes (`transposes="kernels"`) where the chunk fills them and the head
    dim is a multiple of 8: faster and leaner than the rows on a v5e at the 2.7B layer, forward
    and forward+backward, in one call (docs/ops/ssd.md has the forms timed)."""
    chunk = max(TPU_MIN_CHUNK, min(256, next_power_of_2(spec.dim("length"))))
    lanes = lanes_reason(chunk, spec.dim("head_dim")) is None
    return SSDBlockSizes(chunk_size=chunk, group_sums="kernels", transposes="kernels" if lanes else None)


def pallas_tpu_space(spec: Spec) -> list[SSDBlockSizes]:
    """The heuristic's form, then chunks of 32 to 256 positions, `dB` and `dC` summed in the
    kernels or in XLA, with `x`, `y` and their gradients as `[b, H, L, P]` and, at chunks of a
    multiple of 128, as `[b, H, P, L]`, the kernels transposing their tiles
    (`transposes="kernels"`; a head dim of a multiple of 8)."""
    forms = grid(
        SSDBlockSizes,
        spec,
        chunk_size=_chunks(spec, 32, 256),
        group_sums=("kernels", "xla"),
    )
    p = spec.dim("head_dim")
    lanes = [
        dataclasses.replace(bs, transposes="kernels") for bs in forms if not lanes_reason(bs.chunk_size, p)
    ]
    return unique_valid([pallas_tpu_heuristic(spec), *forms, *lanes], spec)


def mosaic_gpu_heuristic(spec: Spec) -> SSDBlockSizes:
    """`mosaic_gpu`: chunks of 64 (one warpgroup's rows; larger chunks run the kernels by tiles
    of 64 rows), the lean fused forward (the fused one where two of its blocks would not share
    an SM), `x`, `y` read and written in the caller's layout in the kernels, and the state
    backward as two kernels; at P 64 (`lean_shares_an_sm`) the lean chunk-scan backward with `dg`
    summed over each group's heads (`group_sums="scores"`), else the whole one with `dB` and `dC`
    summed in the kernels (docs/ops/ssd.md, "Performance", and docs/decisions.md have the
    timings behind each choice). The group sums' additions come in any order, so `dB`, `dC` may
    differ in their last bits between runs: where `XLA_FLAGS` asks for deterministic results
    (`backend.deterministic`) XLA sums them, after the whole chunk-scan backward."""
    deterministic = backend.deterministic()
    p, n = spec.dim("head_dim"), spec.dim("state")
    lean = lean_shares_an_sm(p, n) and not deterministic
    return SSDBlockSizes(
        chunk_size=64,
        forward="lean" if lean_forward_shares_an_sm(p, n, jnp.bfloat16) else "fused",
        group_sums="scores" if lean else ("xla" if deterministic else "kernels"),
        transposes="kernels",
        scan_backward="lean" if lean else None,
    )


def mosaic_gpu_space(spec: Spec) -> list[SSDBlockSizes]:
    """The default, then its parts taken back one at a time (the dg sums for the group sums,
    then the lean chunk-scan backward, the lean forward for the fused one), the fused state
    backward added to the default (where two of its blocks share an SM; over the state's columns
    where N > 64 and `XLA_FLAGS` does not ask for deterministic results), the whole kernels'
    form, and the three stages with none of them; then the whole kernels' form and its three
    stages at chunks of 128 and 256 where their tiles fit (`axkern tune` times each)."""
    best, deterministic = mosaic_gpu_heuristic(spec), backend.deterministic()
    sums = "xla" if deterministic else "kernels"
    lean_forward = dataclasses.replace(best, group_sums=sums, scan_backward=None)
    whole = dataclasses.replace(lean_forward, forward="fused")
    p, n = spec.dim("head_dim"), spec.dim("state")
    forms = [
        best,
        dataclasses.replace(best, group_sums=sums),
        lean_forward,
        dataclasses.replace(best, group_sums="xla"),
        dataclasses.replace(best, transposes="xla"),
        *[dataclasses.replace(best, backward="lean")] * lean_state_bwd_shares_an_sm(p, n),
        # (its blocks add their parts of dx and dw in any order: not where results must repeat)
        *[dataclasses.replace(best, backward="columns")] * (n > 64 and not deterministic),
        whole,
        SSDBlockSizes(chunk_size=64, forward="fused"),
        SSDBlockSizes(chunk_size=64, forward="stages"),
    ]
    larger = [q for q in (128, 256) if q <= next_power_of_2(spec.dim("length")) and not chunk_reason(p, n, q)]
    for q in larger:
        forms += [
            dataclasses.replace(whole, chunk_size=q),
            dataclasses.replace(whole, chunk_size=q, forward="stages"),
        ]
    return list(dict.fromkeys(forms))
