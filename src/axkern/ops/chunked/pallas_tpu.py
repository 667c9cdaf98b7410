"""The Pallas TPU (Mosaic) layout of the chunk scan (`TpuLayout`, a `layout.Layout`), shared by
`ssd`'s and `mamba3`'s `pallas_tpu`: the same kernels as the Triton layout, with every
per-position vector in memory as rows `[b, h, chunks, 1, Q]` (blocks `[1, Q]`, Mosaic's block
rule: a block's last two dimensions are multiples of (8, 128) or the array's own), a column
`[Q, 1]` formed from its row inside the kernel (a transpose) and written back as one. In HBM a
TPU array's last dimension fills 128 lanes: a column array `[b, h, L, 1]` would take 128 times
its values' bytes (640 MiB for a float32 vector at the Mamba-2 2.7B layer, L 4096, where its
row form takes 5). `x`, `B`, `C` blocks are `[Q, P]` / `[Q, N]` with `P`, `N` whole.

**Grid** `(batch, chunks, heads)`, heads innermost: a group's heads follow one another, so the
`B` and `C` blocks they share are copied in once, and the backward kernels add each head's `dB`,
`dC` into its group's block while it stays in VMEM (`put_group`; the block is written back when
the group changes), where per-head float32 `[b, h, L, N]` arrays would wait in HBM for XLA's sum
(640 MiB each at the 2.7B layer). Batch and chunks are `parallel`, heads `arbitrary`.
`TpuHeadsLayout` is the other form: the grid `(batch, heads, chunks)`, all `parallel`, `dB` and
`dC` per head for XLA to sum (docs/ops/ssd.md has both timed).

**Products.** The MXU multiplies bf16: Mosaic's float32 product (`HIGHEST`) takes several
passes of it. For bf16 inputs (whose own rounding dominates, as TF32 serves them on GPU)
each float32 operand is split instead into a high and a low bf16 half and the product summed
over the halves but `lo · lo` (`dot`): one pass where both operands are bf16 (`C Bᵀ`), two
where one is, three where neither is, each a bf16 product accumulated in float32 (the scheme
of the Mosaic GPU kernels, `mosaic_gpu/body.py`; about 16 bits of each float32 operand). fp16
and float32 inputs keep `HIGHEST`. Interpret mode computes the same halves (a bf16 product
with float32 accumulation is exact on a CPU, as on the MXU).

**Positions on the lanes** (`PositionsOnLanes`: `TpuLanesLayout`, `TpuHeadsLanesLayout`). `x`,
`y`, `dx`, `dy` as `[b, H, P, L]`, blocks `[P, Q]` that each kernel transposes on reading and
writing, where `[b, H, L, P]` fills a head dim of 64 out to 128 lanes in HBM (twice its
bytes: a float32 `y` or `dx` 640 MiB at the 2.7B layer, L 4096, where its values take 320).
Chunks of a multiple of 128 (the lanes).

**`B`, `C` turned in the kernels** (`takes_rotations`: Mamba-3's rotated, biased `k` and `q` as a
`mosaic_gpu.operands.RotatedOperand`): `tpu_rotation.py` has the tiles, the turn and its
backward; `TpuLayout` launches them (`expand` around every kernel, `put_group` for the turned
back cotangents, its own `chunk_scan_bwd` and `chunk_state_bwd`, whose `dB`, `dC` leave as
`TurnedCotangent`s).

**Constraints**: the chunk a multiple of 8 (`TPU_MIN_CHUNK`, the sublanes). Scores, decays and
their gradients are `[Q, Q]` float32 in VMEM (about 1.3 MiB at `Q = 256`).

Verified in TPU interpret mode (`pltpu.InterpretParams`) and lowered for a TPU in CI, compiled
and run on a TPU v5e (`tests/tpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from axkern.core import kernels

from .chunk_scan import scan_bwd_kernel
from .chunk_state import state_bwd_kernel
from .layout import Layout
from .tpu_rotation import Back, TurnedBack, TurnedCotangent, expand, group_tiles, is_rotation

__all__ = [
    "lanes_reason",
    "rotation_reason",
    "TPU_LANES",
    "TPU_MIN_CHUNK",
    "TpuHeadsLanesLayout",
    "TpuHeadsLayout",
    "TpuLanesLayout",
    "TpuLayout",
]

TPU_MIN_CHUNK = 8  # the sublanes
TPU_LANES = 128


def lanes_reason(positions: int, head_dim: int) -> str | None:
    """Why the positions cannot lie on the lanes (`PositionsOnLanes`) at chunks of `positions`
    and head dim `head_dim`, or None: a chunk fills whole lanes, and the kernels' `[P, Q]` tiles
    transpose whole sublanes."""
    if positions % TPU_LANES:
        return f"the positions fill a tile's {TPU_LANES} lanes (chunks of a multiple of {TPU_LANES})"
    if head_dim % TPU_MIN_CHUNK:
        return f"head_dim={head_dim}: the kernels transpose whole sublanes (a multiple of {TPU_MIN_CHUNK})"
    return None


def rotation_reason(positions: int, state: int, angles: int) -> str | None:
    """Why the kernels cannot turn `B`, `C` themselves (`takes_rotations`, `tpu_rotation.py`) at chunks of
    `positions`, a state of `state` and `angles` angles, or None: `Θ` and `u` enter with the
    positions on the lanes, and the turn slices `[N, Q]` tiles at whole sublanes."""
    if not angles:
        return "no angles: nothing to turn"
    if positions % TPU_LANES:
        return f"the angles' tiles put the positions on the lanes (chunks of a multiple of {TPU_LANES})"
    if state % (2 * TPU_MIN_CHUNK) or angles % TPU_MIN_CHUNK or angles > state // 2:
        return (
            f"state={state}, {angles} angles: the turn slices whole sublanes (the state a multiple of "
            f"{2 * TPU_MIN_CHUNK}, the angles a multiple of {TPU_MIN_CHUNK}, at most half the state)"
        )
    return None


def halves(a) -> tuple:
    """`a` as bf16 parts whose sum is `a` to about 16 bits: itself where it is 16-bit (a bf16
    input's values), else its two halves (`kernels.halves`)."""
    if jnp.dtype(a.dtype).itemsize == 2:
        return (a.astype(jnp.bfloat16),)
    return kernels.halves(a.astype(jnp.float32), jnp.bfloat16)


class TpuLayout(Layout):
    """Every vector as rows `[b, h, chunks, 1, Q]` (blocks `[1, Q]`), segment ids as `[b,
    chunks, 1, Q]`; a column is its row transposed in the kernel. The grid `(batch, chunks,
    heads)`; `dB`, `dC` summed over each group's heads in the kernels."""

    sums_groups = True
    takes_rotations = True

    def __init__(self, xt, bt, *, q, interpret, products=None, clean_x=False):
        super().__init__(xt, bt, q=q, interpret=interpret, products=products, clean_x=clean_x)
        self.halves = kernels.tf32_suffices(products or xt.dtype)
        self.col_spec = self.row_spec = pl.BlockSpec((1, 1, 1, 1, q), lambda b, h, c: (b, h, c, 0, 0))
        self.seg_col_spec = self.seg_row_spec = pl.BlockSpec((1, 1, 1, q), lambda b, h, c: (b, c, 0, 0))
        self.col_shape = self.row_shape = (self.batch, self.heads, self.chunks, 1, q)

    def to_row(self, a):  # [.., c, Q] -> [.., c, 1, Q]
        return a.reshape(*a.shape[:-1], 1, self.q)

    to_col = to_row

    def from_row(self, a):
        return a.reshape(self.batch, self.heads, self.chunks, self.q)

    from_col = from_row

    @staticmethod
    def col(ref):
        return ref[0, 0, 0].T  # [1, Q] -> [Q, 1]

    @staticmethod
    def row(ref):
        return ref[0, 0, 0]

    @staticmethod
    def seg_col(ref):
        return ref[0, 0].T

    @staticmethod
    def seg_row(ref):
        return ref[0, 0]

    @staticmethod
    def put_col(ref, value):
        ref[0, 0, 0] = value.T  # [Q, 1] -> [1, Q]

    @staticmethod
    def put_row(ref, value):
        ref[0, 0, 0] = value

    def put_group(self, ref, value, base_ref=None):
        """Add the head's tile into its group's block (`add_into_group`); a rotation's cotangent
        (`tpu_rotation.TurnedBack`) is turned back first."""
        if isinstance(ref, TurnedBack):
            return ref.put(value, base_ref, self.add_into_group)
        self.add_into_group(ref, value, base_ref, self.rep)

    @staticmethod
    def add_into_group(ref, value, base_ref, rep):
        """Add the head's tile (plus `base_ref`'s where given) into its group's block of `rep`
        heads, which stays in VMEM while the group's heads follow one another (heads innermost in
        the grid): the group's first head writes it."""
        first = lax.rem(pl.program_id(2), rep) == 0

        @pl.when(first)
        def _():
            ref[0, 0] = value if base_ref is None else value + base_ref[0, 0]

        @pl.when(jnp.logical_not(first))
        def _():
            ref[0, 0] += value

    def dot(self, a, b, dtype=None, *, trans_a=False, trans_b=False):
        """`a @ b` in float32: for bf16 inputs over the operands' bf16 halves (`halves`; the
        module's docstring), else as the base layout's."""
        if not self.halves or jnp.dtype(dtype or a.dtype) != jnp.float32:
            return super().dot(a, b, dtype, trans_a=trans_a, trans_b=trans_b)
        pairs = [(x, y) for i, x in enumerate(halves(a)) for j, y in enumerate(halves(b)) if not (i and j)]
        out = None
        for x, y in reversed(pairs):  # the small terms first
            term = kernels.dot(x, y, jnp.bfloat16, trans_a=trans_a, trans_b=trans_b)
            out = term if out is None else out + term
        return out

    def __call__(self, kernel, in_specs, outs, *args):
        """The base launch with the grid `(batch, chunks, heads)`: every block spec's index map
        takes its arguments in that order."""
        kernel, in_specs, outs, args, results = expand(self.q, kernel, in_specs, outs, args)
        turn = lambda spec: pl.BlockSpec(spec.block_shape, lambda b, c, h, f=spec.index_map: f(b, h, c))  # noqa: E731
        outs = [(turn(spec), shape) for spec, shape in outs]
        return results(super().__call__(kernel, [turn(s) for s in in_specs], outs, *args))

    def chunk_scan_bwd(self, dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, diag=None):
        """The base stage, but for rotations (`tpu_rotation.is_rotation`): their `dB`, `dC` as `TurnedCotangent`s,
        turned back and summed per group in the kernel (`tpu_rotation.TurnedBack`)."""
        if not (is_rotation(bt) and is_rotation(ct) and self.sums_groups):
            return super().chunk_scan_bwd(
                dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, sums=sums, diag=diag
            )
        specs, args = self._scan_inputs(xt, scale, cum, ac, f, sc, bt, ct, states_in, sums, diag)
        outs = [self.x_out(), self.out("col"), self.out("col"), self.out("row"), self.out("col")]
        outs += [Back(bt), Back(ct), self.out("state")]
        outs += [self.out("col")] if diag is not None else []
        kernel = functools.partial(scan_bwd_kernel, sums=sums, diag=diag is not None)
        return self(kernel, [self.x_spec(), *specs], outs, dy.astype(jnp.float32), *args)

    def chunk_state_bwd(self, xt, w, bt, d_own, dx_scan, db_scan):
        """The base stage, but where `db_scan` is a `TurnedCotangent` (`chunk_scan_bwd`'s): `dB`
        turned back and added into its `du` per group in the kernel, the partial sums in XLA."""
        if not isinstance(db_scan, TurnedCotangent):
            return super().chunk_state_bwd(xt, w, bt, d_own, dx_scan, db_scan)
        du_spec = group_tiles(self.n, self.q, self.heads // bt.u.shape[1])
        dx, dw, back = self(
            state_bwd_kernel,
            [self.x_spec(), self.col_spec, self.grouped(self.n), self.state, self.x_spec(), du_spec],
            [self.x_out(xt.dtype), self.out("col"), Back(bt)],
            xt,
            self.to_col(w),
            bt,
            d_own,
            dx_scan,
            db_scan.du,
        )
        return dx, dw, back.plus_partials(db_scan)

    def call_params(self) -> dict:
        return {
            "grid": (self.batch, self.chunks, self.heads),
            "interpret": pltpu.InterpretParams() if self.interpret else False,
            "compiler_params": pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")
            ),
        }


class TpuHeadsLayout(TpuLayout):
    """`TpuLayout`'s vectors with the base grid `(batch, heads, chunks)`, every dimension
    `parallel`, and `dB`, `dC` written per head for XLA to sum over each group's heads."""

    sums_groups = False
    put_group = Layout.put_group

    def __call__(self, kernel, in_specs, outs, *args):
        kernel, in_specs, outs, args, results = expand(self.q, kernel, in_specs, outs, args)
        return results(Layout.__call__(self, kernel, in_specs, outs, *args))

    def call_params(self) -> dict:
        return {
            "interpret": pltpu.InterpretParams() if self.interpret else False,
            "compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
        }


class PositionsOnLanes:
    """A TPU layout's `x`, `y`, `dx`, `dy` as `[b, H, P, L]`, blocks `[P, Q]` (a multiple of 128
    positions: the lanes), each tile transposed in the kernel to the bodies' `[Q, P]`."""

    positions_on_lanes = True

    def __init__(self, xt, bt, *, q, interpret, products=None, clean_x=False):
        if q % TPU_LANES:
            raise ValueError(
                f"chunk_size={q}: with the positions on the lanes a chunk is a multiple of {TPU_LANES}"
            )
        super().__init__(xt, bt, q=q, interpret=interpret, products=products, clean_x=clean_x)

    def x_spec(self):
        return pl.BlockSpec((1, 1, self.p, self.q), lambda b, h, c: (b, h, 0, c))

    def x_out(self, dtype=jnp.float32):
        return self.x_spec(), jax.ShapeDtypeStruct((self.batch, self.heads, self.p, self.lp), dtype)

    @staticmethod
    def to_kernel(x):  # [b, L, H, P] -> [b, H, P, L]
        return jnp.transpose(x, (0, 2, 3, 1))

    @staticmethod
    def from_kernel(y):  # [b, H, P, L] -> [b, L, H, P]
        return jnp.transpose(y, (0, 3, 1, 2))

    @staticmethod
    def tile_in(ref):  # [P, Q] -> [Q, P], transposed in float32
        return ref[0, 0].astype(jnp.float32).T

    @staticmethod
    def put_tile(ref, value):
        ref[0, 0] = value.astype(jnp.float32).T.astype(ref.dtype)


class TpuLanesLayout(PositionsOnLanes, TpuLayout):
    """`TpuLayout` with `x`, `y`, `dx`, `dy` laid out positions on the lanes."""


class TpuHeadsLanesLayout(PositionsOnLanes, TpuHeadsLayout):
    """`TpuHeadsLayout` with `x`, `y`, `dx`, `dy` laid out positions on the lanes."""
