"""SSD's chunk state and chunk scan on Hopper, forward and backward, as Pallas Mosaic GPU
kernels, with 16-bit operands into float32 accumulators; the other stages are `pallas_gpu`'s
(shared by `ssd`'s `mosaic_gpu` and `mamba3`'s, which feed them their `B`, `C` and
per-position decay and scale through `MosaicLayout`).

**What runs where.** Stages 1 and 3 (weights, the recurrence between chunks and its reverse)
are XLA's and `pallas_gpu`'s Triton kernels (`common/kernels.py` has the stages,
`chunked/pallas_gpu.py` the recurrence). Stage 2, each chunk's own state `(w ∘ x)ᵀ B`, is
`_state_kernel` in `kernels.py` and its backward `_state_bwd_kernel` in `backward.py`; stage
4, the output `y = ((C Bᵀ) ∘ Λ ∘ dt)(x) + f ∘ (C S_inᵀ)` of every chunk, `_scan_kernel` and its
backward `_scan_bwd_kernel`. Each: one warpgroup per (batch row, head, chunk of 64 positions).

**Chunks of `64 r`** (`chunk=` of the four kernels and the fused forward;
`SSDBlockSizes(chunk_size=128 or 256)`): the state kernel takes the chunk's rows in one product;
the scan kernel, its backward and the fused forward walk tiles of 64 rows (`tiled.py`: the
causal mask on the diagonal tile only, the segments' on every tile; the backward in two phases;
the fused forward's shared memory in tiles of 64 rows, `C`'s refilled row block by row block);
the state backward runs a block per 64 rows (its gradients are row by row), each reading its
chunk's `dS`. At chunks of 64 the kernels are the same as before (their lowered text
identical). `chunk_reason` says where the tiles fit (128 at P 64 with N 64 or 128; 256 at P and
N 64). The fused state backward walks chunks of 64 only. Lowered for CUDA on the CPU; the tiles' algebra mirrored in XLA against
the emulation; the kernels' own bodies run on the CPU through a shim of the Mosaic GPU calls
(`tests/ops/test_ssd_mosaic_bodies.py`: values against the emulation, and layouts, commits, waits
and in-flight stores checked); on the H200 they equal their emulation; not yet timed, so the
default stays at 64.

**The fused forward** (`SSDBlockSizes(forward="fused")`, `forward.py`): stages 2 to 4 as one
kernel per (batch row, head) walking its chunks, the state carried in registers, so the own
states never cross memory; the default in its lean form (below; `blocks.mosaic_gpu_heuristic`
has the timing), `forward="stages"` the three stages.

**Group sums** (`SSDBlockSizes(group_sums="kernels")`): the two backward kernels add each
head's `dB` (and `dC`) tile into its group's rows by TMA reductions (`copy_smem_to_gmem(...,
reduction_op="add")`) into zeros the kernel takes as a ref it writes in place (`pl.run_state`
over `pl.kernel`, as `plgpu.kernel` takes no aliases), where otherwise they write `[b, h, L,
N]` float32 per head for XLA to sum; with the lean chunk-scan backward, `group_sums="scores"`
adds each head's `[Q, Q]` `dg` instead of `dB` and `dg B`'s share of `dC`, which XLA forms
from the sums (`group_scores.py`). **Transposes** (`SSDBlockSizes(transposes="kernels")`):
the kernels read `x`, `dy` and write `y`, `dx` as `[b, L, h, P]`, the caller's layout
(`kernels._indexer`: a strided tile per head, which TMA copies and loads take as they take a
contiguous one), where XLA otherwise moves them to `[b, h, L, P]` and back. **The fused state backward**
(`SSDBlockSizes(backward="fused")`, `state_backward.py`): the reverse recurrence and the chunk
states' backward as one kernel per (batch row, head) walking its chunks from the last, the
state's gradient in registers; `backward="lean"` the same in one slot of `B` and one staging
tile, so that two blocks share an SM. The group sums and the transposes are the default (XLA
sums where `XLA_FLAGS` asks for deterministic results, `backend.deterministic`); the fused
state backward, no faster on the H200, is in the tuning space only (`blocks.mosaic_gpu_heuristic`
has the timings), the lean one and its form over the state's columns (`backward="columns"`)
too (1.04x and 0.99x the two kernels' forward+backward on an H100).

**`y` in the input dtype.** Without `D` and the gate (`common/kernels.ssd`), the scan and
fused kernels round `y` to bf16 themselves (`Layout.y_dtype`) and the scan's backward kernel
reads the bf16 cotangent (and leaves out the two products of its low half, which is 0), where
otherwise `y` is float32 for XLA to add `D x` and gate. The chunk-state backward kernel adds
the chunk-scan backward's float32 `dx` to its own and writes `dx` in bf16 (`chunk_state_bwd`'s
`dx_in`; the fused state backward leaves the sum to XLA). With nothing to differentiate, the
fused forward does not write the entering states (`forward.py`).

**The state kernel.** TMA copies the chunk's `B` rows (`[64, N]`); `x` (`[64, P]`) is read into
registers, scaled by `w` per row and stored as two 16-bit halves (`w ∘ x = hi + lo`, what the
rounding loses as `bf16x2`); two `wgmma`s with the halves transposed as the left operand give
the `[P, N]` float32 state, written back through shared memory by TMA.

**The scan kernel.** TMA copies the chunk's `C` and `B` rows (`[64, N]`, the head's group) and `x`
rows (`[64, P]`) into swizzled shared memory; the state entering the chunk (`[P, N]`, float32)
is read into registers, rounded to the input dtype and stored beside them. Two `wgmma`s:
`s = C Bᵀ` (`[64, 64]`) and `C S_inᵀ` (`[64, P]`), float32 accumulators. In registers,
`M = s ∘ exp(cum_t - cum_s) ∘ dt_s` where `s <= t` in one segment (else 0), split as
`M = M_hi + M_lo`, each in the input dtype (what the rounding of `M` loses, as `bf16x2`); the
accumulator starts at `f_t · (C S_inᵀ)` and takes `M_hi x` and `M_lo x` (two `wgmma`s with
their left operand in registers). `y` (float32) goes back through shared memory by TMA.

**The state's backward**: `d(w ∘ x) = B dSᵀ` (`dS`, float32, as two halves in shared memory),
giving `dx` and `dw`, and `dB = (w ∘ x) dS` (three products: both operands float32; one of
their high halves where `B`, `C` are 16-bit: Precision, below).

**The scan's backward** (the Triton `_scan_bwd_kernel`'s sums, `common/kernels.py`), each
result stored and sent out by TMA as soon as it is formed: `df` from `C S_inᵀ`; `C Bᵀ` and its
decayed `M` (rows t, columns s); `dM = (dy xᵀ) ∘ dt_s` from `dy`'s two halves in registers;
`dcum`, `dcum_row` the row and column sums of `dM ∘ M`; `Mᵀ dy` from `M`'s halves stored in
shared memory and read transposed, times `dy`'s halves there (three products: hi·hi, hi·lo,
lo·hi), giving `dx` and `ddt`; then the halves of `dg = dM ∘ Λ` and of `f ∘ dy` take `M`'s and
`dy`'s places in shared memory for `dS_in = (f ∘ dy)ᵀ C`, `dC = dg B + (f ∘ dy) S_in` and
`dB = dgᵀ C`. Every float32 operand is taken as its two 16-bit halves (the state's too), so
the products are about as exact as float32 ones (but `(f ∘ dy) S_in`'s two, each rounded
once where `B`, `C` are 16-bit: Precision, below).

**The lean scan backward** (`SSDBlockSizes(scan_backward="lean")`, `backward.lean_reason`:
chunks of 64, 16-bit `B`, `C`, no angles, P 64): the same kernel and arithmetic in 108 KiB of
shared memory at N 128 (188 whole), two blocks an SM: the state's high half in its own tile and
its low half in `M`'s two `[64, 64]` tiles by 64 of its columns until `C S_inᵀ` has read it
(`C S_inᵀ` over both halves, the low one by blocks of 64 of `C`'s columns), every result out
through the float32 staging tiles in turn, block by block (`kernels.STAGES`: one `[64, 64]`,
each block waiting for the copy before it; `backward._staged` takes two `[64, 32]` as well;
`P/64 · (1 + N/64) + 2 · N/64` copies a block with the one, seven at P 64, N 128). Grid, bytes and tensor-core FLOPs as the whole
kernel's. (Rounding the state once in `C S_inᵀ` instead, one tile and one product fewer, took
`d dt_bias` to 1.19x its bound over 32 chunks: `benchmarks/ssd_backward_precision.py --cases
long --lean`.) The fused forward likewise (`SSDBlockSizes(forward="lean")`, `forward_lean.py`): one
slot of tiles, the entering state out through the staging tiles, 99 KiB at P 64, N 128 (155
fused). The lean forward is the default (two of its blocks share an SM at the three sizes),
and at P 64 the lean chunk-scan backward with `dg` summed per group (`blocks.mosaic_gpu_heuristic`
has the timings).

**Precision** (`benchmarks/ssd_operand_precision.py`, float64 emulation on the CPU, tables in
docs/ops/ssd.md "Accuracy"): `C Bᵀ` and `C S_inᵀ` with 16-bit operands kept `y` and the final
state inside DESIGN.md's rule; `M x` with `M` rounded to bf16 once did not (1.08x the bound),
as two bf16 halves it did (0.13x); the state product likewise (1.25x rounded once, inside as
two halves). In the backward (`benchmarks/ssd_backward_precision.py`, the whole layer's
gradients through the kernels' emulation, chunks of 64 and 128, six cases), rounding once `M`
or `dy` in `Mᵀ dy` took the gradients to 3.4x and 2.9x the bound, `f ∘ dy` in `dS_in` to 1.5x,
`dS` in `B dSᵀ` to 0.68x, `dy` in `dM` to 0.98x; rounding once both operands of `(f ∘ dy) S_in`
and of the state backward's `(w ∘ x) dS` kept every gradient within 0.49x of the bound (0.41x
with every operand as halves), and saves `4·Q·P·N` tensor-core FLOPs in each kernel: so the
kernels do where `B`, `C` are 16-bit (`tiled.rounds_once`). Mamba-3's float32 `B`, `C` (its
rotated `k`, `q`) keep every half: there the second took `dk` to 0.93x the bound. `emulate.py` holds the kernels' arithmetic in XLA (the same roundings, exact
products), which the CPU tests carry through the whole layer and its gradients against the
float64 oracle.

**`B`, `C` in float32** (Mamba-3's rotated `k`, `q`, `mamba3/mosaic_gpu.py`): every kernel
takes them as two bf16 arrays each (`operand_parts`: `hi` rounded, `lo` what that lost), copied
into two tiles, and every product with them runs over both halves (`kernels.pairs`: two `wgmma`s
where the other operand is 16-bit, three where it is a float32 value's halves, `lo · lo` left
out), so the scan backward's tiles grow by `2·Q·N` 16-bit values (225 KiB at P 64, N 128) and
the fused forward's by four (227 KiB there). Or, for the fused forward, as a `RotatedOperand`
(`rotation.py`): the unrotated values per group, the biases and the angles, which the kernel
turns and splits itself (one slot of `B`'s and `C`'s halves, the unrotated rows and angles
copied in beside them: 212 KiB at P 64, N 128). Given the angles too (`theta`, `[b, h, L, A]`
float32, `A` a multiple of 32; `rotation.SplitOperand.theta` in the layer), the chunk-scan and
chunk-state backward kernels return `dC`, `dB` turned back by `-Θ` (`angles._turned_back`: in
the staging tile before its copy out; the angles read into registers while the last products
run; per chunk and head `2·Q·A` special-function results, `4·Q·A` more bytes read and no
more written), so XLA only sums them.

**Constraints**: a Hopper GPU (compute capability 9.x), bf16 inputs (fp16's range could not
hold the 16-bit halves of float32 values such as `M` or the state: fp16 goes to `xla`),
chunks of 64 (or of 128 and 256, above), `P` and `N` multiples of 64 whose tiles fit shared memory in all four kernels
(`kernels.smem_bytes`: 64 and 64, 64 and 128, 128 and 64). Otherwise the call falls back with the
reason.

**Interpret mode.** Mosaic GPU's `wgmma` and TMA copies have no CPU interpret rule: CI lowers
the kernels for CUDA (`tests/ops/test_ssd_mosaic_gpu.py`) and runs their emulation; the kernels
themselves are tested on a GPU (`tests/gpu/test_ssd_gpu.py`).

**Cost** per chunk and head (Q = 64 positions), in tensor-core FLOPs: the state `4·Q·P·N` (two
halves), its backward `6·Q·P·N` (`B dSᵀ` with two products, `(w ∘ x) dS` with one); the scan
`2·Q²·N` (`C Bᵀ`) + `4·Q²·P` (`M x`, two halves) + `2·Q·P·N` (`C S_inᵀ`); its backward
`10·Q²·(N + P) + 10·Q·P·N` (`C Bᵀ`; `dM` and `Mᵀ dy` with two and three products; `dg B`,
`dgᵀ C` with two each; `f∘dy S_in` with one; `C S_inᵀ`, `dS_in` with two each; a 16-bit
cotangent leaves out `dy`'s low half: `dM` one product, `Mᵀ dy` two), with 16-bit `B`, `C`.
Bytes: `x`, `B`, `C` rows once a kernel, the float32 state `P·N·4` written (state) and read
(scan, backward), `y`, `dy`, `dx`, `dB`, `dC` float32.
"""

from __future__ import annotations

import functools

from axkern.core import backend
from axkern.core.op import Unsupported

from ..pallas_gpu import GpuLayout
from .backward import chunk_scan_bwd, chunk_state_bwd, lean_reason, lean_shares_an_sm
from .emulate import (
    EmulatedLayout,
    emulate_chunk_scan,
    emulate_chunk_scan_bwd,
    emulate_chunk_state,
    emulate_chunk_state_bwd,
)
from .forward import fused_fits, fused_forward, fused_smem_bytes, rotation_reason
from .forward_lean import lean_forward_reason, lean_forward_shares_an_sm
from .group_scores import with_group_scores
from .kernels import (
    _IMPORT_ERROR,
    CHUNK,
    chunk_reason,
    chunk_scan,
    chunk_state,
    dims_reason,
    operand_parts,
    smem_bytes,
)
from .rotation import RotatedOperand, halves_to_pairs, pairs_to_halves, parts_kernel_reason, rotated_parts
from .state_backward import fused_state_bwd, fused_state_bwd_smem_bytes, lean_state_bwd_shares_an_sm

__all__ = [
    "platform_reason",
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
    "pairs_to_halves",
    "halves_to_pairs",
    "parts_kernel_reason",
    "rotated_parts",
]


def platform_reason(spec) -> str | None:
    """Why the kernels cannot serve a call of `spec` on this platform and dtype (the import, a
    Hopper GPU, bf16 inputs), or None."""
    if _IMPORT_ERROR is not None:
        return f"jax.experimental.pallas.mosaic_gpu does not import here ({_IMPORT_ERROR})"
    if spec.platform != "gpu" or not backend.is_hopper(spec):
        return f"the Mosaic GPU kernels need a Hopper GPU (compute capability 9.x), not {spec.device_kind}"
    if spec.dtype != "bfloat16":
        return (
            f"the Mosaic GPU kernels take bf16 inputs, not {spec.dtype} (their 16-bit halves of float32 values "
            "could overflow fp16's range: fp16 goes to xla)"
        )
    return None


class MosaicLayout(GpuLayout):
    """`pallas_gpu`'s layout and recurrence kernels; stages 2 and 4 by `chunk_state`,
    `chunk_scan` and their backward kernels."""

    diagonal = False  # the Mosaic chunk-scan kernels take no diagonal term
    parts_kernel = True  # Mamba-3's halves by `rotation.rotated_parts`

    def chunk_state(self, xt, w, bt, *, dtype):
        return chunk_state(xt, self.to_col(w), bt, positions_first=self.positions_first, chunk=self.q)

    def chunk_scan(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, dtype):
        if sums:
            raise Unsupported("the Mosaic GPU kernels take 16-bit inputs, whose decay is cum_t - cum_s")
        c = self.to_col
        args = (xt, c(scale), c(cum), c(f), c(sc), bt, ct, states_in)
        return chunk_scan(*args, positions_first=self.positions_first, y_dtype=self.y_dtype, chunk=self.q)

    def chunk_state_bwd(self, xt, w, bt, d_own, dx_scan, db_scan):
        kw = dict(group_sums=self.group_sums, positions_first=self.positions_first, theta=_angles(bt))
        # dx_scan added in the kernel; db_scan here (per head, or per group with `group_sums`)
        dx, dw, db = chunk_state_bwd(xt, self.to_col(w), bt, d_own, dx_scan, chunk=self.q, **kw)
        return dx, dw, db + db_scan

    def chunk_scan_bwd(self, dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums):
        if sums:
            raise Unsupported("the Mosaic GPU kernels take 16-bit inputs, whose decay is cum_t - cum_s")
        c = self.to_col
        args = (dy, xt, c(scale), c(cum), c(f), c(sc), bt, ct, states_in)
        kw = dict(group_sums=self.group_sums, positions_first=self.positions_first, theta=_angles(bt))
        out = chunk_scan_bwd(
            *args, chunk=self.q, lean=self.lean_scan_backward, scores=self.group_scores, **kw
        )
        return with_group_scores(out, bt, ct) if self.group_scores else out

    # `dB`, `dC` summed over each group's heads in XLA, or (`group_sums`) in the kernels, or
    # (`group_scores` too) `dC`'s `(f ∘ dy) S_in` and `dg` in the kernels (`group_scores.py`)
    group_sums = False
    group_scores = False
    # the reverse recurrence and the chunk states' backward as one kernel
    fused_backward = False
    # the chunk-scan backward in less shared memory (`backward.lean_reason`)
    lean_scan_backward = False
    # the fused state backward in less shared memory (`state_backward.py`), a block per
    # `N / state_columns` of the state's columns
    lean_state_backward = False
    state_columns = 1

    @classmethod
    def turns_back(cls) -> bool:
        """Whether the backward kernels take `B`, `C` formed by a rotation with its angles
        (`rotation.SplitOperand.theta`) and return `dB`, `dC` turned back: per head, in the
        chunk-scan and chunk-state backward kernels."""
        return not (cls.group_sums or cls.fused_backward)

    def state_backward(self, xt, w, bt, keep, states_in, d_states_in, d_final, dx_scan, db_scan):
        if not self.fused_backward:
            return super().state_backward(xt, w, bt, keep, states_in, d_states_in, d_final, dx_scan, db_scan)
        kw = dict(group_sums=self.group_sums, positions_first=self.positions_first)
        kw |= dict(lean=self.lean_state_backward, columns=self.state_columns)
        args = (xt, self.to_col(w), bt, keep, states_in, d_states_in, d_final, dx_scan)
        dx, dw, db, *rest = fused_state_bwd(*args, **kw)  # (dx_scan added to dx)
        return (dx.astype(xt.dtype), dw, db + db_scan, *rest)

    def sum_groups(self, db, dc):
        return (db, dc) if self.group_sums else super().sum_groups(db, dc)


def _angles(operand):
    """The angles a `SplitOperand` carries for the backward kernels to turn by, or None."""
    return getattr(operand, "theta", None)


class FusedMosaicLayout(MosaicLayout):
    """`MosaicLayout` with stages 2 to 4 of the forward as one kernel (`forward.py`), which zeroes
    `x`'s non-finite values itself where asked (`clean_x`)."""

    cleans_x = True
    # the fused forward in one slot of tiles (`forward_lean.py`)
    lean_forward = False

    def forward(
        self,
        xt,
        ac,
        scale,
        cum,
        w,
        f,
        keep,
        sc,
        bt,
        ct,
        initial_state,
        *,
        sums,
        dtype,
        residuals=True,
        clean_x=False,
    ):
        if sums:
            raise Unsupported("the Mosaic GPU kernels take 16-bit inputs, whose decay is cum_t - cum_s")
        c = self.to_col
        args = (xt, c(w), c(scale), c(cum), c(f), keep, c(sc), bt, ct, initial_state)
        return fused_forward(
            *args,
            positions_first=self.positions_first,
            y_dtype=self.y_dtype,
            states=residuals,
            clean_x=clean_x,
            chunk=self.q,
            lean=self.lean_forward,
        )


@functools.cache
def layout_class(
    fused: bool,
    group_sums: bool,
    positions_first: bool,
    fused_backward: bool,
    lean_scan_backward: bool = False,
    lean_forward: bool = False,
    lean_state_backward: bool = False,
    state_columns: int = 1,
    group_scores: bool = False,
) -> type[MosaicLayout]:
    """The layout for the forward's form, where `dB`, `dC` are summed, how `x`, `y` are laid out,
    the state backward's form (`B`, `C` may enter its kernels as bf16 or float32,
    `operand_parts`), whether the chunk-scan backward is the lean one, (`fused`) whether the
    fused forward is and (`fused_backward`) whether the fused state backward is (lean, over
    `state_columns` blocks of the state's columns); `group_scores`: `dg` summed per group."""
    base = FusedMosaicLayout if fused else MosaicLayout
    flags = {
        "group_sums": group_sums,
        "positions_first": positions_first,
        "fused_backward": fused_backward,
        "lean_scan_backward": lean_scan_backward,
        "lean_forward": lean_forward,
        "lean_state_backward": lean_state_backward,
        "state_columns": state_columns > 1,
        "group_scores": group_scores,
    }
    if not any(flags.values()):
        return base
    words = (
        "GroupSums",
        "PositionsFirst",
        "FusedBackward",
        "LeanScanBackward",
        "LeanForward",
        "LeanStateBackward",
        f"StateColumns{state_columns}",
        "GroupScores",
    )
    name = base.__name__ + "".join(w for w, on in zip(words, flags.values(), strict=True) if on)
    return type(name, (base,), flags | {"state_columns": state_columns})
