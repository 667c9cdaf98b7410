"""The Mosaic GPU layouts of the chunked engine: `pallas_gpu`'s layout (`GpuLayout`: its stages
in XLA, its recurrence kernels in Triton) with stages 2 and 4, forward and backward, as the
Mosaic GPU kernels (`MosaicLayout`), or stages 2 to 4 of the forward as one kernel
(`FusedMosaicLayout`); `layout_class` names the one for a call's form; `platform_reason` says
where none can serve."""

from __future__ import annotations

import functools

from axkern.core import backend
from axkern.core.op import Unsupported

from ..pallas_gpu import GpuLayout
from .forward import fused_forward
from .group_scores import with_group_scores
from .scan import chunk_scan
from .scan_backward import chunk_scan_bwd
from .state import chunk_state, chunk_state_bwd
from .state_backward import fused_state_bwd
from .tiles import IMPORT_ERROR

__all__ = ["platform_reason", "MosaicLayout", "FusedMosaicLayout", "layout_class"]

_SUMS = "the Mosaic GPU kernels take 16-bit inputs, whose decay is cum_t - cum_s"


def platform_reason(spec) -> str | None:
    """Why the kernels cannot serve a call of `spec` on this platform and dtype (the import, a
    Hopper GPU, bf16 inputs), or None."""
    if IMPORT_ERROR is not None:
        return f"jax.experimental.pallas.mosaic_gpu does not import here ({IMPORT_ERROR})"
    if spec.platform != "gpu" or not backend.is_hopper(spec):
        return f"the Mosaic GPU kernels need a Hopper GPU (compute capability 9.x), not {spec.device_kind}"
    if spec.dtype != "bfloat16":
        return (
            f"the Mosaic GPU kernels take bf16 inputs, not {spec.dtype} (their 16-bit halves of float32 values "
            "could overflow fp16's range: fp16 goes to xla)"
        )
    return None


def _angles(operand):
    """The angles a `SplitOperand` carries for the backward kernels to turn by, or None."""
    return getattr(operand, "theta", None)


class MosaicLayout(GpuLayout):
    """`pallas_gpu`'s layout and recurrence kernels; stages 2 and 4 by `chunk_state`,
    `chunk_scan` and their backward kernels."""

    diagonal = False  # the Mosaic chunk-scan kernels take no diagonal term
    parts_kernel = True  # Mamba-3's halves by `rotation_kernel.rotated_parts`

    def chunk_state(self, xt, w, bt, *, dtype):
        kw = dict(positions_first=self.positions_first, chunk=self.q, clean_x=self.clean_x)
        return chunk_state(xt, self.to_col(w), bt, **kw)

    def chunk_scan(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, dtype):
        if sums:
            raise Unsupported(_SUMS)
        c = self.to_col
        args = (xt, c(scale), c(cum), c(f), c(sc), bt, ct, states_in)
        kw = dict(
            positions_first=self.positions_first, y_dtype=self.y_dtype, chunk=self.q, clean_x=self.clean_x
        )
        return chunk_scan(*args, **kw)

    def chunk_state_bwd(self, xt, w, bt, d_own, dx_scan, db_scan):
        kw = dict(group_sums=self.group_sums, positions_first=self.positions_first, theta=_angles(bt))
        kw["clean_x"] = self.clean_x
        # dx_scan added in the kernel; db_scan here (per head, or per group with `group_sums`)
        dx, dw, db = chunk_state_bwd(xt, self.to_col(w), bt, d_own, dx_scan, chunk=self.q, **kw)
        return dx, dw, db + db_scan

    def chunk_scan_bwd(self, dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums):
        if sums:
            raise Unsupported(_SUMS)
        c = self.to_col
        args = (dy, xt, c(scale), c(cum), c(f), c(sc), bt, ct, states_in)
        kw = dict(group_sums=self.group_sums, positions_first=self.positions_first, theta=_angles(bt))
        kw["clean_x"] = self.clean_x
        out = chunk_scan_bwd(
            *args, chunk=self.q, lean=self.lean_scan_backward, scores=self.group_scores, **kw
        )
        return with_group_scores(out, bt, ct) if self.group_scores else out

    # `dB`, `dC` summed over each group's heads in XLA, or (`group_sums`) in the kernels, or
    # (`group_scores` too) `dC`'s `(f ∘ dy) S_in` and `dg` in the kernels (`group_scores.py`)
    group_sums = False
    group_scores = False
    # the reverse recurrence and the chunk states' backward as one kernel (`state_backward.py`),
    # a block per `N / state_columns` of the state's columns
    fused_backward = False
    state_columns = 1
    # the chunk-scan backward in less shared memory (`scan_backward.lean_reason`)
    lean_scan_backward = False

    @classmethod
    def turns_back(cls) -> bool:
        """Whether the backward kernels take `B`, `C` formed by a rotation with its angles
        (`operands.SplitOperand.theta`) and return `dB`, `dC` turned back: per head, in the
        chunk-scan and chunk-state backward kernels."""
        return not (cls.group_sums or cls.fused_backward)

    def state_backward(self, xt, w, bt, keep, states_in, d_states_in, d_final, dx_scan, db_scan):
        if not self.fused_backward:
            return super().state_backward(xt, w, bt, keep, states_in, d_states_in, d_final, dx_scan, db_scan)
        kw = dict(
            group_sums=self.group_sums,
            positions_first=self.positions_first,
            columns=self.state_columns,
            clean_x=self.clean_x,
        )
        args = (xt, self.to_col(w), bt, keep, states_in, d_states_in, d_final, dx_scan)
        dx, dw, db, *rest = fused_state_bwd(*args, **kw)  # (dx_scan added to dx)
        return (dx.astype(xt.dtype), dw, db + db_scan, *rest)

    def sum_groups(self, db, dc):
        return (db, dc) if self.group_sums else super().sum_groups(db, dc)


class FusedMosaicLayout(MosaicLayout):
    """`MosaicLayout` with stages 2 to 4 of the forward as one kernel (`forward.py`), which reports
    what it read of `x` where asked (`reports_x`)."""

    reports_x = True

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
        seen=False,
    ):
        if sums:
            raise Unsupported(_SUMS)
        c = self.to_col
        args = (xt, c(w), c(scale), c(cum), c(f), keep, c(sc), bt, ct, initial_state)
        return fused_forward(
            *args,
            positions_first=self.positions_first,
            y_dtype=self.y_dtype,
            states=residuals,
            clean_x=self.clean_x,
            chunk=self.q,
            lean=self.lean_forward,
            seen=seen,
        )


@functools.cache
def layout_class(
    fused: bool,
    group_sums: bool,
    positions_first: bool,
    fused_backward: bool,
    lean_scan_backward: bool = False,
    lean_forward: bool = False,
    state_columns: int = 1,
    group_scores: bool = False,
) -> type[MosaicLayout]:
    """The layout for the forward's form, where `dB`, `dC` are summed, how `x`, `y` are laid out,
    the state backward's form (`B`, `C` may enter its kernels as bf16 or float32,
    `operand_parts`), whether the chunk-scan backward is the lean one, (`fused`) whether the
    fused forward is and (`fused_backward`) whether the fused state backward runs (over
    `state_columns` blocks of the state's columns); `group_scores`: `dg` summed per group."""
    base = FusedMosaicLayout if fused else MosaicLayout
    flags = {
        "group_sums": group_sums,
        "positions_first": positions_first,
        "fused_backward": fused_backward,
        "lean_scan_backward": lean_scan_backward,
        "lean_forward": lean_forward,
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
        f"StateColumns{state_columns}",
        "GroupScores",
    )
    name = base.__name__ + "".join(w for w, on in zip(words, flags.values(), strict=True) if on)
    return type(name, (base,), flags | {"state_columns": state_columns})
