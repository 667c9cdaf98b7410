"""Chunk size of the Mamba-3 scan: the heuristics, the chunk sizes `axkern tune` sweeps, and the
positions a MIMO token takes in the Pallas kernels."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

from axkern.core.blocks import BlockSizes, grid, next_power_of_2, unique_valid
from axkern.core.op import Spec, Unsupported
from axkern.ops.chunked.pallas_gpu import GPU_MIN_DIM
from axkern.ops.chunked.pallas_tpu import TPU_MIN_CHUNK, lanes_reason, rotation_reason

__all__ = [
    "Mamba3BlockSizes",
    "bucket",
    "heuristic",
    "space",
    "pallas_gpu_heuristic",
    "pallas_tpu_heuristic",
    "mosaic_gpu_heuristic",
    "pallas_tpu_space",
    "kernel_chunks",
    "kernel_slots",
    "refuse_forms",
    "angles_form",
]


@dataclasses.dataclass(frozen=True)
class Mamba3BlockSizes(BlockSizes):
    """`chunk_size`: tokens (sequence positions) per chunk, a power of two; the length need not be
    a multiple. The Pallas kernels run a MIMO token as `kernel_slots(rank)` consecutive positions,
    so their chunks hold `chunk_size · kernel_slots(rank)` positions.

    `rotation_backward` (`pallas_gpu` only): `"xla"` (None means this) turns the rotated `q`,
    `k`'s cotangents back in XLA, `"kernel"` in one Triton kernel that reads each cotangent once
    (`pallas_gpu.rotation_backward`; XLA's where the kernel's tiles do not fit the shapes).

    `forward` (`mosaic_gpu` only): `"fused"` (SSD's fused Mosaic GPU forward, one kernel per
    batch row and head walking its chunks) or `"stages"` (chunk states, recurrence, chunk
    outputs); None means fused.

    `rotation` (`mosaic_gpu`, `pallas_tpu`): on `mosaic_gpu` `"kernel"` (the fused forward turns
    `q`, `k` itself from the unrotated rows per group, the biases and the angles,
    `chunked/mosaic_gpu/operands.py`; a state that is a multiple of 128) or `"xla"` (XLA forms the
    rotated values' halves per head), None meaning the kernel's where it serves; on `pallas_tpu`
    `"kernel"` (every kernel that reads `q` or `k` turns its tiles itself, SISO,
    `chunked/pallas_tpu.py`; the heuristic's where it serves) or `"xla"` (XLA writes the rotated
    values per head); None means XLA's.

    `angles` (`mosaic_gpu`, `pallas_gpu`): `"kernel"` (None means this) forms `Θ` by one Triton
    kernel, forward and backward (`common/angle_kernel.py`), `"xla"` by XLA's passes
    (`common/angles.py`).

    `transposes` (`pallas_tpu` only): `"xla"` (None means this) lays `v` (the kernels' `x`), `y`
    and their gradients out `[b, H, L, P]` for the kernels, `"kernels"` `[b, H, P, L]`, the
    positions on the lanes, each kernel transposing its tiles (`ssd`'s form of that name:
    chunks of a multiple of 128 kernel positions, `chunked/pallas_tpu.py`)."""

    choices: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "rotation_backward": ("xla", "kernel"),
        "forward": ("stages", "fused"),
        "rotation": ("xla", "kernel"),
        "angles": ("kernel", "xla"),
        "transposes": ("xla", "kernels"),
    }

    chunk_size: int = 64
    rotation_backward: str | None = None
    forward: str | None = None
    rotation: str | None = None
    angles: str | None = None
    transposes: str | None = None

    def check(self, spec):
        if self.chunk_size & (self.chunk_size - 1):
            return f"chunk_size={self.chunk_size} is not a power of two"
        return None


# (field, the values only some implementations take (None: any set value), those
# implementations, what they have)
_FORMS = (
    ("rotation_backward", ("kernel",), ("pallas_gpu",), "has the rotation's backward kernel"),
    ("forward", None, ("mosaic_gpu",), "has forward forms"),
    ("rotation", None, ("mosaic_gpu", "pallas_tpu"), "choose where q and k are rotated"),
    ("angles", ("kernel",), ("mosaic_gpu", "pallas_gpu"), "have the angles' kernel"),
    ("transposes", ("kernels",), ("pallas_tpu",), "lays v out with the positions on the lanes"),
)


def angles_form(block_sizes: Mamba3BlockSizes | None) -> str:
    """How a GPU kernel implementation forms `Θ` with these block sizes (`explain`'s words)."""
    if block_sizes is not None and block_sizes.angles == "xla":
        return "Θ by XLA's passes (angles='xla')"
    return "Θ by one Triton kernel, forward and backward (common/angle_kernel.py)"


def refuse_forms(block_sizes: Mamba3BlockSizes, implementation: str) -> None:
    """Refuse the forms of `Mamba3BlockSizes` that only another implementation than
    `implementation` has, by name."""
    for name, values, owners, what in _FORMS:
        value = getattr(block_sizes, name)
        if implementation not in owners and value is not None and (values is None or value in values):
            raise Unsupported(f"{name}={value!r}: only {' and '.join(owners)} {what}")


def bucket(spec: Spec) -> dict:
    return {k: next_power_of_2(v) for k, v in spec.dims} | {"dtype": spec.dtype}


def heuristic(spec: Spec) -> Mamba3BlockSizes:
    """`xla`: chunks of 64 (mamba_ssm's SISO kernels' chunk), fewer for a MIMO rank above 1,
    whose chunk terms grow as `Q² R²`; never above the length's next power of two."""
    rank = spec.dim("rank")
    limit = 64 if rank <= 1 else max(16, 64 // next_power_of_2(rank))
    return Mamba3BlockSizes(chunk_size=min(limit, next_power_of_2(spec.dim("length"))))


def space(spec: Spec) -> list[Mamba3BlockSizes]:
    """`xla`: chunks of 16 to 256 positions."""
    top = max(16, min(256, next_power_of_2(spec.dim("length"))))
    chunks = [q for q in (16, 32, 64, 128, 256) if q <= top]
    return grid(Mamba3BlockSizes, spec, first=heuristic(spec), chunk_size=chunks)


def kernel_slots(rank: int) -> int:
    """The positions the Pallas kernels give each token: one per rank (MIMO runs its `R` inputs
    as consecutive positions), rounded up to a power of two so that a chunk of a power of two
    of tokens is a power of two of positions (Triton's tiles); 1 for SISO."""
    return next_power_of_2(max(rank, 1))


def _kernel_chunk(spec: Spec, positions: int, least: int) -> Mamba3BlockSizes:
    """Chunks of about `positions` kernel positions and at least `least`, in tokens."""
    slots = kernel_slots(spec.dim("rank"))
    tokens = min(max(1, positions // slots), next_power_of_2(spec.dim("length")))
    return Mamba3BlockSizes(chunk_size=max(max(1, least // slots), tokens))


def pallas_gpu_heuristic(spec: Spec) -> Mamba3BlockSizes:
    """Chunks of 64 positions, as `ssd`'s `pallas_gpu` (at least 16: Triton's dot tiles): 64
    tokens for SISO, `64 / kernel_slots(rank)` for MIMO."""
    return _kernel_chunk(spec, 64, GPU_MIN_DIM)


def mosaic_gpu_heuristic(spec: Spec) -> Mamba3BlockSizes:
    """Chunks of 64 tokens, the only size SSD's Mosaic GPU kernels run (one warpgroup's rows;
    SISO only); the forward fused (None)."""
    return Mamba3BlockSizes(chunk_size=64)


def kernel_chunks(spec: Spec, low: int, high: int) -> list[int]:
    """The chunk sizes, in tokens, whose kernel positions (`kernel_slots(rank)` a token) are
    powers of two from `low` to `high`, none beyond the length's next power of two (the
    smallest of them where none fits a short length)."""
    slots = kernel_slots(spec.dim("rank"))
    top = next_power_of_2(spec.dim("length"))
    tokens = [q // slots for q in (8, 16, 32, 64, 128, 256) if low <= q <= high and q >= slots]
    return sorted({t for t in tokens if t <= top} or {min(tokens, default=1)})


def pallas_tpu_space(spec: Spec) -> list[Mamba3BlockSizes]:
    """`pallas_tpu`: the heuristic's form, then chunks of 32 to 256 kernel positions (as
    `ssd`'s), in tokens, with `v`, `y` and their gradients as `[b, H, L, P]` and, at chunks of a
    multiple of 128 positions, as `[b, H, P, L]` (`transposes="kernels"`; a head dim of a
    multiple of 8); then, SISO, each of those with `q`, `k` turned in the kernels
    (`rotation="kernel"`) where that serves (`chunked.pallas_tpu.rotation_reason`), and the
    heuristic's form with XLA's rotation where the heuristic turns them in the kernels."""
    forms = grid(Mamba3BlockSizes, spec, chunk_size=kernel_chunks(spec, 32, 256))
    lanes = [
        dataclasses.replace(bs, transposes="kernels") for bs in forms if _lanes_serve(spec, bs.chunk_size)
    ]
    # q, k turned in the kernels (SISO), on the rows and the lanes, at the chunks where it serves;
    # XLA's rotation named where that is the heuristic's (`rotation="xla"`, timed apart)
    turned = [
        dataclasses.replace(bs, rotation="kernel")
        for bs in [*forms, *lanes]
        if not spec.flag("mimo")
        and rotation_reason(bs.chunk_size, spec.dim("state"), spec.dim("n_angles")) is None
    ]
    best = pallas_tpu_heuristic(spec)
    xla = [dataclasses.replace(best, rotation="xla")] if best.rotation == "kernel" else []
    return unique_valid([best, *forms, *lanes, *turned, *xla], spec)


def _lanes_serve(spec: Spec, chunk: int) -> bool:
    """Whether `pallas_tpu` can lay the positions on the lanes at chunks of `chunk` tokens
    (`chunked.pallas_tpu.lanes_reason`, over their kernel positions)."""
    return lanes_reason(chunk * kernel_slots(spec.dim("rank")), spec.dim("head_dim")) is None


def pallas_tpu_heuristic(spec: Spec) -> Mamba3BlockSizes:
    """Chunks of 256 positions (as `ssd`'s; the fastest of the tuner's chunks on a v5e at the
    2.7B layer's SISO case, and the least memory), at least 8 (the sublanes): 256 tokens for
    SISO, `256 / kernel_slots(rank)` for MIMO. `v`, `y` and their gradients with the positions on
    the lanes (`transposes="kernels"`) where that serves: on a v5e at the 2.7B layer, SISO's
    forward and forward+backward faster than on the rows in one call, with less memory
    forward+backward and a little more forward; MIMO of rank 4's as fast (within the spread of
    two calls) with less memory, forward and forward+backward (docs/tpu.md). SISO with `q`, `k`
    turned inside the kernels (`rotation="kernel"`) where that serves: on a v5e at the 2.7B
    layer faster than XLA's rotation, forward and forward+backward, with about a quarter of its
    memory (docs/tpu.md)."""
    bs = _kernel_chunk(spec, 256, TPU_MIN_CHUNK)
    if _lanes_serve(spec, bs.chunk_size):
        bs = dataclasses.replace(bs, transposes="kernels")
    turns = rotation_reason(bs.chunk_size, spec.dim("state"), spec.dim("n_angles")) is None
    if not spec.flag("mimo") and turns:
        bs = dataclasses.replace(bs, rotation="kernel")
    return bs
