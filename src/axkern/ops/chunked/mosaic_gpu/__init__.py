"""The chunked engine's stages on Hopper as Pallas Mosaic GPU kernels, 16-bit operands into
float32 accumulators: each chunk's own state and each chunk's output, forward and backward, and
their fused forms; the other stages are `pallas_gpu`'s (shared by `ssd`'s `mosaic_gpu` and
`mamba3`'s, which feed them their `B`, `C` and per-position decay and scale through
`layout.MosaicLayout`).

**What runs where.** Stages 1 and 3 (weights, the recurrence between chunks and its reverse)
are XLA's and `pallas_gpu`'s Triton kernels (`chunked/kernel_scan.py` has the stages,
`chunked/pallas_gpu.py` the recurrence). Stage 2, each chunk's own state `(w ∘ x)ᵀ B`, and its
backward are `state.py`'s kernels; stage 4, the output `y = ((C Bᵀ) ∘ Λ ∘ dt)(x) + f ∘ (C
S_inᵀ)` of every chunk, `scan.py`'s, its backward `scan_backward.py`'s. Each: one
warpgroup per (batch row, head, chunk of 64 positions). Stages 2 to 4 of the forward as one
kernel per (batch row, head) walking its chunks: `forward.py` (in one slot of tiles,
`forward_lean.py`; at larger chunks, `forward_tiled.py`); the reverse recurrence and the chunk
state's backward as one: `state_backward.py`.

**The modules.** `tiles.py`: the Mosaic GPU import, shared-memory tiles and the launch;
`body.py`: the pieces of the kernels' bodies (TMA copies in and out, `wgmma` products over
halves, the decay mask); `sizes.py`: the four per-chunk kernels' tiles and the sizes they take;
`operands.py`: `B`, `C` as the kernels take them (16-bit, float32 halves, a rotation;
`rotation_kernel.py` the Triton kernel forming a rotation's halves); `angles.py`: the backward
kernels' turn of `dB`, `dC` by a rotation's angles; `tiled.py`: the chunk scan at chunks of `64
r` by tiles of 64 rows; `group_scores.py`: `dB` and `dC`'s `dg B` from `dg` summed per group;
`emulate.py`: the kernels' arithmetic in XLA; `layout.py`: the layouts that run them.

**Chunks of `64 r`** (`SSDBlockSizes(chunk_size=128 or 256)`): the state kernel takes the
chunk's rows in one product; the scan kernel, its backward and the fused forward walk tiles of
64 rows (`tiled.py`, `forward_tiled.py`); the state backward runs a block per 64 rows (its
gradients are row by row), each reading its chunk's `dS`. `sizes.chunk_reason` says where the
tiles fit (128 at P 64 with N 64 or 128; 256 at P and N 64). The fused state backward and the
lean forms walk chunks of 64 only.

**`y` in the input dtype.** Without `D` and the gate (`kernel_scan.ssd`), the scan and fused
kernels round `y` to bf16 themselves (`Layout.y_dtype`) and the scan's backward kernel reads the
bf16 cotangent (and leaves out the two products of its low half, which is 0), where otherwise
`y` is float32 for XLA to add `D x` and gate. The chunk-scan backward kernel writes its share
of `dx` in bf16, and the chunk-state backward kernel adds its own to it and writes `dx` in
bf16 (half the bytes of a float32 `dx` between the two, which was live at the backward's peak). With nothing to
differentiate, the fused forward does not write the entering states.

**Precision.** `C Bᵀ` and `C S_inᵀ` take 16-bit operands; `M x`, the state's product and every
backward product with a float32 operand take that operand as two 16-bit halves (`bf16x2`),
except `(f ∘ dy) S_in` and `(w ∘ x) dS`, whose operands are each rounded once where `B`, `C` are
16-bit (`body.rounds_once`). docs/ops/ssd.md ("Accuracy") has the precision sweeps that chose
each rounding. `emulate.py` holds the kernels' arithmetic in XLA (the same roundings, exact
products), which the CPU tests carry through the whole layer and its gradients against the
float64 oracle.

**`B`, `C` in float32** (Mamba-3's rotated `k`, `q`, `mamba3/mosaic_gpu.py`): every kernel
takes them as two bf16 arrays each (`operands.operand_parts`: `hi` rounded, `lo` what that
lost), copied into two tiles, and every product with them runs over both halves (`body.pairs`:
two `wgmma`s where the other operand is 16-bit, three where it is a float32 value's halves,
`lo · lo` left out), so the scan backward's tiles grow by `2·Q·N` 16-bit values (225 KiB at P
64, N 128) and the fused forward's by four (227 KiB there). Or, for the fused forward, as a
`RotatedOperand` (`operands.py`): the unrotated values per group, the biases and the angles,
which the kernel turns and splits itself (212 KiB at P 64, N 128). Given the angles too, the
chunk-scan and chunk-state backward kernels return `dC`, `dB` turned back by `-Θ`
(`angles.turned_back`), so XLA only sums them.

**Constraints**: a Hopper GPU (compute capability 9.x), bf16 inputs (fp16's range could not
hold the 16-bit halves of float32 values such as `M` or the state: fp16 goes to `xla`),
chunks of 64 (or of 128 and 256, above), `P` and `N` multiples of 64 whose tiles fit shared
memory in all four per-chunk kernels (`sizes.dims_reason`: 64 and 64, 64 and 128, 128 and 64).
Otherwise the call falls back with the reason.

**Interpret mode.** Mosaic GPU's `wgmma` and TMA copies have no CPU interpret rule: CI lowers
the kernels for CUDA (`tests/ops/test_ssd_mosaic_gpu.py`), runs their emulation, and runs the
kernels' own bodies through a shim of the Mosaic GPU calls (`tests/ops/test_ssd_mosaic_bodies.py`,
`tests/ops/test_ssd_mosaic_state_backward_body.py`); the kernels themselves are tested on a GPU
(`tests/gpu/test_ssd_gpu.py`).
"""

from __future__ import annotations

from .emulate import (
    EmulatedLayout,
    emulate_chunk_scan,
    emulate_chunk_scan_bwd,
    emulate_chunk_state,
    emulate_chunk_state_bwd,
)
from .forward import fused_fits, fused_forward, fused_smem_bytes, rotation_reason
from .forward_lean import lean_forward_reason, lean_forward_shares_an_sm
from .layout import FusedMosaicLayout, MosaicLayout, layout_class, platform_reason
from .operands import RotatedOperand, SplitOperand, halves_to_pairs, operand_parts, pairs_to_halves
from .rotation_kernel import parts_kernel_reason, rotated_parts
from .scan import chunk_scan
from .scan_backward import chunk_scan_bwd, lean_reason, lean_shares_an_sm
from .sizes import chunk_reason, dims_reason, smem_bytes
from .state import chunk_state, chunk_state_bwd
from .state_backward import fused_state_bwd, fused_state_bwd_smem_bytes, lean_state_bwd_shares_an_sm
from .tiles import CHUNK, IMPORT_ERROR

__all__ = [
    "platform_reason",
    "IMPORT_ERROR",
    "chunk_state",
    "chunk_scan",
    "chunk_state_bwd",
    "chunk_scan_bwd",
    "lean_reason",
    "lean_shares_an_sm",
    "lean_forward_reason",
    "lean_forward_shares_an_sm",
    "emulate_chunk_state",
    "emulate_chunk_scan",
    "emulate_chunk_state_bwd",
    "emulate_chunk_scan_bwd",
    "EmulatedLayout",
    "dims_reason",
    "chunk_reason",
    "smem_bytes",
    "CHUNK",
    "MosaicLayout",
    "FusedMosaicLayout",
    "fused_forward",
    "fused_smem_bytes",
    "fused_state_bwd",
    "fused_state_bwd_smem_bytes",
    "lean_state_bwd_shares_an_sm",
    "fused_fits",
    "layout_class",
    "operand_parts",
    "rotation_reason",
    "RotatedOperand",
    "SplitOperand",
    "pairs_to_halves",
    "halves_to_pairs",
    "parts_kernel_reason",
    "rotated_parts",
]
