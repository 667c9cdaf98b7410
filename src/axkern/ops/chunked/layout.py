"""`Layout`: how a backend runs the stages of the Pallas chunk scan (`kernel_scan.py` has the
stages, their math and the `custom_vjp` that ties them). The base class holds what every
backend shares: the grid `(batch, heads, chunks)`, the block specs of `x`, `B`, `C` and the
states, each stage as a `pallas_call` of the bodies in `chunk_state.py` and `chunk_scan.py`, and
the recurrence between chunks as `lax.scan`. A subclass says how the per-position vectors are
laid out (`pallas_gpu.GpuLayout` for Triton, `pallas_tpu.TpuLayout` for Mosaic TPU) and may
replace any stage with kernels of its own (`mosaic_gpu.MosaicLayout`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from axkern.core import kernels

from . import chunks as chunk_pieces
from .chunk_scan import scan_bwd_kernel, scan_kernel
from .chunk_state import state_bwd_kernel, state_kernel

__all__ = ["Layout"]


class Layout:
    """How a backend lays out the per-position vectors. Shared: grid (batch, head, chunk); `x`,
    `y` as `[b, h, L, P]`, `B`, `C` as `[b, g, L, N]`, states `[b, c, h, P, N]`. A vector
    (`dt`, `cum`, weights, segment ids, their gradients) is read as a column `[Q, 1]` or a
    row `[1, Q]`; `to_col`/`to_row` lay out a `[b, h, L]` (or `[b, L]` for segment ids) array
    for that, `from_col`/`from_row` undo it for outputs. Subclasses fill in the specs."""

    # precision of the float32 products for bf16 inputs and for the others (fp16, float32:
    # TF32 would be as coarse as fp16) when compiled (None: exact float32); interpret mode always
    # computes exact products (XLA on CPU has no TF32)
    precision_16bit = None
    precision_32bit = None
    # `x` and `y` (and their gradients) as `[b, L, H, P]`, the caller's layout, rather than
    # `[b, H, L, P]`: for kernels that index them so (no transposes around them); the Pallas
    # specs here (`rows`, `out("rows")`) take `[b, H, L, P]`, so a layout that sets this
    # replaces every stage that uses them (`mosaic_gpu`'s does)
    positions_first = False
    # `x`, `y` (and their gradients) as `[b, H, P, L]`, the positions along the last axis (a
    # TPU's lanes), each kernel transposing its `[P, Q]` tiles (`tile_in`, `put_tile`), rather
    # than `[b, H, L, P]`: `pallas_tpu.PositionsOnLanes`
    positions_on_lanes = False
    # the dtype `y` leaves the forward in (set per call): the Pallas kernels here write float32
    # and XLA rounds; a layout may have its kernels write it
    y_dtype = jnp.dtype(jnp.float32)
    # whether `forward(..., seen=True)` returns a fourth result, `[b, h, L]` float32: each position's
    # `x` times 0 summed over its row, as the kernel read it (NaN where a value is not finite),
    # so that no pass of XLA's reads `x` to check it (`mosaic_gpu`'s walking forwards do)
    reports_x = False
    # whether `forward`, `chunk_scan` and `chunk_scan_bwd` take the diagonal term (`diag`,
    # `chunk_scan.py`): the Pallas kernels here do; a layout with kernels of its own may not
    diagonal = True

    def __init__(self, xt, bt, *, q, interpret, products=None, clean_x=False):
        """`products`: the input dtype whose products' precision the kernels take (`xt`'s unless
        given). `clean_x`: every kernel that reads `x` takes its non-finite values as 0 (`x_of`;
        a layout with kernels of its own passes it to them)."""
        self.clean_x = clean_x
        wide = self.precision_32bit if not interpret else None
        narrow = kernels.tf32_suffices(products or xt.dtype)
        self.precision = self.precision_16bit if narrow else wide
        self.batch, self.heads, self.lp, self.p = xt.shape
        if self.positions_first:
            self.lp, self.heads = self.heads, self.lp
        elif self.positions_on_lanes:
            self.lp, self.p = self.p, self.lp
        self.n = bt.shape[-1]
        self.rep = self.heads // bt.shape[1]
        self.q, self.chunks, self.interpret = q, self.lp // q, interpret
        self.grid = (self.batch, self.heads, self.chunks)
        rep = self.rep
        self.rows = lambda d: pl.BlockSpec((1, 1, q, d), lambda b, h, c: (b, h, c, 0))
        self.grouped = lambda d: pl.BlockSpec((1, 1, q, d), lambda b, h, c: (b, h // rep, c, 0))
        self.state = pl.BlockSpec((1, 1, 1, self.p, self.n), lambda b, h, c: (b, c, h, 0, 0))

    def x_spec(self):
        """The block of `x`, `y`, `dx`, `dy` (`[Q, P]` tiles of `[b, H, L, P]`)."""
        return self.rows(self.p)

    def x_out(self, dtype=jnp.float32):
        """`(spec, shape)` of an output laid out as `x` (`y`, `dx`)."""
        return self.x_spec(), jax.ShapeDtypeStruct((self.batch, self.heads, self.lp, self.p), dtype)

    @staticmethod
    def to_kernel(x):
        """`x [b, L, H, P]` (`dy` alike) as the kernels take it: `[b, H, L, P]`."""
        return jnp.moveaxis(x, 2, 1)

    @staticmethod
    def from_kernel(y):
        """`y` from the kernels' layout back to `[b, L, H, P]`."""
        return jnp.moveaxis(y, 1, 2)

    @staticmethod
    def tile_in(ref):
        """A program's `[Q, P]` tile of an array laid out as `x`."""
        return ref[0, 0]

    @staticmethod
    def put_tile(ref, value):
        """Write a program's `[Q, P]` tile of an array laid out as `x`, in the array's dtype."""
        ref[0, 0] = value.astype(ref.dtype)

    def x_of(self, x_ref):
        """A program's `x` tile, float32, its non-finite values as 0 where `clean_x`."""
        x = self.tile_in(x_ref).astype(jnp.float32)
        # |x| <= the largest float32 is false for inf and NaN alike (a comparison every backend lowers)
        return jnp.where(jnp.abs(x) <= jnp.finfo(jnp.float32).max, x, 0.0) if self.clean_x else x

    # whether the backward kernels add each head's `dB`, `dC` into its group's rows themselves
    # (`put_group`, `out("group_rows")`), rather than write them per head for `sum_groups`
    sums_groups = False

    def out(self, kind, d=None):
        f32 = jnp.float32
        b, h, lp = self.batch, self.heads, self.lp
        if kind == "rows":
            return self.rows(d), jax.ShapeDtypeStruct((b, h, lp, d), f32)
        if kind == "group_rows":  # `dB`, `dC`: per group where the kernels sum them, else per head
            if self.sums_groups:
                return self.grouped(d), jax.ShapeDtypeStruct((b, h // self.rep, lp, d), f32)
            return self.out("rows", d)
        if kind == "col":
            return self.col_spec, jax.ShapeDtypeStruct(self.col_shape, f32)
        if kind == "row":
            return self.row_spec, jax.ShapeDtypeStruct(self.row_shape, f32)
        return self.state, jax.ShapeDtypeStruct((b, self.chunks, h, self.p, self.n), f32)

    def call_params(self) -> dict:
        return {"interpret": self.interpret}

    def put_group(self, ref, value, base_ref=None):
        """Write a program's `dB` or `dC` tile (`[Q, N]`, plus `base_ref`'s tile where given): per
        head here; a layout whose kernels sum the groups (`sums_groups`) adds it to its group's."""
        ref[0, 0] = value if base_ref is None else value + base_ref[0, 0]

    # whether a `B`, `C` formed by Mamba-3's rotation (`mosaic_gpu/rotation.py`) is split into its
    # halves by a kernel (`rotated_parts`) rather than in XLA
    parts_kernel = False
    # whether the kernels take such a rotation as it is and turn its tiles themselves, forward and
    # backward, their `dB`, `dC` per head and rotated (`pallas_tpu.TpuLayout`'s)
    takes_rotations = False

    @classmethod
    def turns_back(cls) -> bool:
        """Whether the backward kernels take a `B`, `C` formed by Mamba-3's rotation with its
        angles (`mosaic_gpu/rotation.py`, `SplitOperand.theta`) and return `dB`, `dC` turned back."""
        return False

    # stage 3 and its reverse: `lax.scan` in XLA unless a backend has a kernel for them
    @staticmethod
    def recurrence(keep, chunk_states, initial_state):
        return chunk_pieces.recurrence(keep, chunk_states, initial_state)

    @staticmethod
    def recurrence_bwd(keep, states_in, d_states_in, d_final):
        return chunk_pieces.recurrence_bwd(keep, states_in, d_states_in, d_final)

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
        **diag,
    ):
        """Stages 2 to 4 in turn: `(y, final state, the states entering the chunks)`;
        `residuals=False`: the last (the backward's residual) may be None where a layout need
        not form them. `diag=` (`[b, h, c, Q]`, where given): the diagonal term's weights."""
        states_in, final = self.recurrence(keep, self.chunk_state(xt, w, bt, dtype=dtype), initial_state)
        y = self.chunk_scan(xt, scale, cum, ac, f, sc, bt, ct, states_in, sums=sums, dtype=dtype, **diag)
        return y, final, states_in

    def chunk_state(self, xt, w, bt, *, dtype):
        """Stage 2, each chunk's own state `[b, c, h, P, N]` float32 from `x`, the weights `w [b,
        h, c, Q]` and `B` (`chunk_state.state_kernel` unless a backend has its own)."""
        n = self.n
        return self(
            functools.partial(state_kernel, dtype=dtype),
            [self.x_spec(), self.col_spec, self.grouped(n)],
            [self.out("state")],
            xt,
            self.to_col(w),
            bt,
        )

    def chunk_scan(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, dtype, diag=None):
        """Stage 4, `y [b, h, L, P]` float32 from the chunks' inputs (`[b, h, c, Q]` vectors, `sc
        [b, c, Q]`) and the states entering them (`chunk_scan.scan_kernel` unless a backend has
        its own); `diag` (`[b, h, c, Q]`): the diagonal term's weights."""
        specs, args = self._scan_inputs(xt, scale, cum, ac, f, sc, bt, ct, states_in, sums, diag)
        kernel = functools.partial(scan_kernel, dtype=dtype, sums=sums, diag=diag is not None)
        return self(kernel, specs, [self.x_out()], *args)

    def _scan_inputs(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, sums, diag=None):
        """The scan kernels' inputs after `dy` and their specs: `x`; `dt`, `cum` as columns,
        `cum` (or, `sums`, `a`) as a row; `f`; the segment ids both ways; `B`, `C`; the states;
        the diagonal term's weights as a column where given."""
        n = self.n
        specs = [self.x_spec(), self.col_spec, self.col_spec, self.row_spec, self.col_spec]
        specs += [self.seg_col_spec, self.seg_row_spec, self.grouped(n), self.grouped(n), self.state]
        cols = [self.to_col(v) for v in (scale, cum)]
        args = [xt, *cols, self.to_row(ac if sums else cum), self.to_col(f), self.to_col(sc), self.to_row(sc)]
        args += [bt, ct, states_in]
        if diag is not None:
            specs, args = specs + [self.col_spec], args + [self.to_col(diag)]
        return specs, args

    def chunk_state_bwd(self, xt, w, bt, d_own, dx_scan, db_scan):
        """Stage 2's backward, `(dx [b, h, L, P], dw, dB [b, h, L, N])` per head in `out`'s
        layouts (`chunk_state.state_bwd_kernel` unless a backend has its own): `dx` this stage's
        part plus `dx_scan` (stage 4's) in `x`'s dtype, `dB` plus `db_scan` (stage 4's), `dw`,
        `dB` float32; the Pallas kernel adds both (no float32 `dx` of its own in memory)."""
        n = self.n
        return self(
            state_bwd_kernel,
            [
                self.x_spec(),
                self.col_spec,
                self.grouped(n),
                self.state,
                self.x_spec(),
                self.out("group_rows", n)[0],
            ],
            [
                self.x_out(xt.dtype),
                self.out("col"),
                self.out("group_rows", n),
            ],
            xt,
            self.to_col(w),
            bt,
            d_own,
            dx_scan,
            db_scan,
        )

    def chunk_scan_bwd(self, dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, diag=None):
        """Stage 4's backward, `(dx, ddt, dcum, dcum_row, df, dB, dC, dS_in)` per head, float32,
        in `out`'s layouts (`chunk_scan.scan_bwd_kernel` unless a backend has its own); with
        `diag`, the diagonal term's weights' gradient (a column) follows."""
        n = self.n
        specs, args = self._scan_inputs(xt, scale, cum, ac, f, sc, bt, ct, states_in, sums, diag)
        outs = [self.x_out(), self.out("col"), self.out("col"), self.out("row"), self.out("col")]
        outs += [self.out("group_rows", n), self.out("group_rows", n), self.out("state")]
        outs += [self.out("col")] if diag is not None else []
        kernel = functools.partial(scan_bwd_kernel, sums=sums, diag=diag is not None)
        return self(kernel, [self.x_spec(), *specs], outs, dy.astype(jnp.float32), *args)

    def state_backward(self, xt, w, bt, keep, states_in, d_states_in, d_final, dx_scan, db_scan):
        """Stage 3's and stage 2's backward: the reverse recurrence, then the chunk states'
        backward, `(dx, dw, dB, d keep, d initial state)`, `dx` with `dx_scan` added, in `x`'s
        dtype, `dB` with `db_scan` (a backend may fuse them)."""
        d_own, d_keep, d_init = self.recurrence_bwd(keep, states_in, d_states_in, d_final)
        return (*self.chunk_state_bwd(xt, w, bt, d_own, dx_scan, db_scan), d_keep, d_init)

    def sum_groups(self, db, dc):
        """`dB`, `dC` per group (`[b, g, L, N]`) from the backward kernels' per-head outputs
        (their own where the kernels sum the groups)."""
        if self.sums_groups:
            return db, dc
        per_group = lambda a: a.reshape(self.batch, -1, self.rep, self.lp, self.n).sum(2)  # noqa: E731
        return per_group(db), per_group(dc)

    def dot(self, a, b, dtype=None, *, trans_a=False, trans_b=False):
        return kernels.dot(a, b, dtype, trans_a=trans_a, trans_b=trans_b, precision=self.precision)

    def __call__(self, kernel, in_specs, outs, *args):
        specs, shapes = zip(*outs, strict=True)
        single = len(outs) == 1
        params = {"grid": self.grid, **self.call_params()}  # (a layout may order the grid its own way)
        return pl.pallas_call(
            functools.partial(kernel, lay=self),
            name=f"axkern_ssd_{getattr(kernel, 'func', kernel).__name__.strip('_')}",
            in_specs=in_specs,
            out_specs=specs[0] if single else list(specs),
            out_shape=shapes[0] if single else list(shapes),
            **params,
        )(*args)
