"""The Pallas SSD kernels shared by `pallas_gpu` and `pallas_tpu`: the XLA stages between the
kernels (their bodies in `bodies.py`), the `Layout` that calls them and the `custom_vjp` that
ties them together (not an implementation; each backend supplies a `Layout` and its call
parameters).

The kernels take a per-position log-decay `a_t` and input scale `s_t` (`scan`): SSD gives `a =
dt·A`, `s = dt` (`ssd`), Mamba-3 its decay and the trapezoid's scale (below, `dt`: the scale),
and optionally a diagonal term `d_t (C_t · B_t) x_t` in `y_t` (`scan(..., diag=)`, Mamba-3's
correction).

**Stages** (chunks of `Q` positions; `cum` the running sum of `a` inside a chunk):

1. XLA, `O(B·L·H)`: pad the length to a multiple of `Q` (`a = s = 0` rows leave the state
   alone), `cum`, the weights into the chunk's end state `w_t = exp(cum_{Q-1} - cum_t) dt_t [t in
   the last segment]` and from the incoming state `f_t = exp(cum_t) [t in the segment before]`.
2. Kernel `chunk_state`, one program per (batch, head, chunk): `S_c = (w ∘ x)^T B`, `[P, N]`.
3. `O(L/Q · H·P·N)`: the recurrence over chunk states, giving the state entering every chunk
   and the final state (`Layout.recurrence`: `lax.scan` in XLA; `pallas_gpu` has a kernel).
4. Kernel `chunk_scan`, one program per (batch, head, chunk):
   `y = ((C B^T) ∘ Λ)(dt ∘ x) + f ∘ (C S_in^T)` with `Λ[t, s] = exp(cum_t - cum_s)` for
   `s <= t` in the same segment, else 0. `D` and the `silu(z)` gate in XLA.

**Grid** `(batch, heads, chunks)` for all four kernels; each program holds `[Q, P]`, `[Q, N]`,
`[Q, Q]` and `[P, N]` tiles. **Cost.** Per chunk and head `2·Q²·N` (`C B^T`) + `2·Q²·P` (scores
times `x`) + `2·Q·N·P` (incoming state) + `2·Q·P·N` (own state) FLOPs forward, about twice that
backward; bytes: `x`, `B`, `C` once per pass, the `[b, c, h, P, N]` float32 states written and
read; backward also the per-head float32 `dx`, `dB` (written by `chunk_scan_bwd`, read by
`chunk_state_bwd`, which writes `dx` in `x`'s dtype and the summed `dB`) and `dC`. Compute
bound for Mamba-2 sizes (`Q = 64..256`, `N = 128`). float32 inputs add `2·Q³` FLOPs forward and
`4·Q³` backward per chunk and head (`_segment_sums`).

`Layout.forward` runs stages 2-4 in turn (a backend may fuse them). **Non-finite input**
(`chunks.guard`, through `chunks.layer` only where an input is not finite): the kernels take
non-finite values as 0; NaN is put where the sequential recurrence is non-finite (never
earlier in time, never in another segment). Products take float32 operands into float32 (bf16
operands missed the oracle rule): TF32 for bf16 inputs on GPU (`Layout.precision_16bit`), exact
for fp16 and float32 inputs (`precision_32bit`: TF32 rounds as coarsely as fp16); `x`,
`B`, `C` as `[batch, heads|groups, length, P|N]` (`x` as `[batch, length, heads, P]` where the
layout's kernels take the caller's layout: `Layout.positions_first`).

**Backward** (`custom_vjp` around stages 1-4; `D`, `z`, padding and layout by autodiff):
kernel `chunk_scan_bwd` pulls `dy` back through `y = M (dt ∘ x) + f ∘ (C S_in^T)`, `M = (C B^T)
∘ Λ`: `d(dt∘x) = M^T dy`, `dM = dy (dt∘x)^T`, `d(C B^T) = dM ∘ Λ` (`dC`, `dB`), `dcum =
rowsum(dM ∘ M) - colsum(dM ∘ M)` (float32 inputs: `d a` from `_segment_sums_bwd`), `df =
rowsum(dy ∘ C S_in^T)`, `dS_in = (f ∘ dy)^T C`. The recurrence runs backwards (the gradients of
each chunk's own state, of the carries, of the initial state); `chunk_state_bwd` pulls those
through `S = (w ∘ x)^T B` and adds `chunk_scan_bwd`'s `d x` (written in `x`'s dtype) and `dB`;
stage 1's VJP gives `d a`, `d s`. `dB`, `dC` per head (`[b, h, L, N]`, float32), summed over
each group's heads in XLA. The forward saves the states entering the chunks (`[b, c, h, P, N]`,
float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from axkern.core import kernels

from .bodies import scan_bwd_kernel, scan_kernel, state_bwd_kernel, state_kernel
from .chunks import layer, uses_segment_sums, zeroed
from .chunks import recurrence as _recurrence
from .chunks import recurrence_bwd as _recurrence_bwd


def _weights(ac, scale, sc):
    """Stage 1 (XLA), from the per-position log-decay `ac` and input scale (`[b, h, c, Q]`):
    `cum`, the end-state weights `w`, the incoming-state weights `f` (all
    `[b, h, c, Q]`) and each chunk's carry of the incoming state `keep` (`[b, h, c]`)."""
    cum = jnp.cumsum(ac, axis=-1)
    seg_before = jnp.concatenate([sc[:, :1, :1], sc[:, :-1, -1:]], axis=1)  # [b, c, 1]
    w = jnp.exp(cum[..., -1:] - cum) * scale * (sc == sc[:, :, -1:])[:, None]
    f = jnp.exp(cum) * (sc == seg_before)[:, None]
    keep = (sc[:, :, -1] == seg_before[..., 0])[:, None] * jnp.exp(cum[..., -1])
    return cum, w, f, keep


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
    # the dtype `y` leaves the forward in (set per call): the Pallas kernels here write float32
    # and XLA rounds; a layout may have its kernels write it
    y_dtype = jnp.dtype(jnp.float32)
    # whether `forward`, `chunk_scan` and `chunk_scan_bwd` take the diagonal term (`diag`,
    # `bodies.py`): the Pallas kernels here do; a layout with kernels of its own may not
    diagonal = True

    def __init__(self, xt, bt, *, q, interpret, products=None):
        """`products`: the input dtype whose products' precision the kernels take (`xt`'s unless given)."""
        wide = self.precision_32bit if not interpret else None
        narrow = kernels.tf32_suffices(products or xt.dtype)
        self.precision = self.precision_16bit if narrow else wide
        self.batch, self.heads, self.lp, self.p = xt.shape
        if self.positions_first:
            self.lp, self.heads = self.heads, self.lp
        self.n = bt.shape[-1]
        self.rep = self.heads // bt.shape[1]
        self.q, self.chunks, self.interpret = q, self.lp // q, interpret
        self.grid = (self.batch, self.heads, self.chunks)
        rep = self.rep
        self.rows = lambda d: pl.BlockSpec((1, 1, q, d), lambda b, h, c: (b, h, c, 0))
        self.grouped = lambda d: pl.BlockSpec((1, 1, q, d), lambda b, h, c: (b, h // rep, c, 0))
        self.state = pl.BlockSpec((1, 1, 1, self.p, self.n), lambda b, h, c: (b, c, h, 0, 0))

    def out(self, kind, d=None):
        f32 = jnp.float32
        b, h, lp = self.batch, self.heads, self.lp
        if kind == "rows":
            return self.rows(d), jax.ShapeDtypeStruct((b, h, lp, d), f32)
        if kind == "col":
            return self.col_spec, jax.ShapeDtypeStruct(self.col_shape, f32)
        if kind == "row":
            return self.row_spec, jax.ShapeDtypeStruct(self.row_shape, f32)
        return self.state, jax.ShapeDtypeStruct((b, self.chunks, h, self.p, self.n), f32)

    def call_params(self) -> dict:
        return {"interpret": self.interpret}

    # whether a `B`, `C` formed by Mamba-3's rotation (`mosaic/rotation.py`) is split into its
    # halves by a kernel (`rotated_parts`) rather than in XLA
    parts_kernel = False

    @classmethod
    def turns_back(cls) -> bool:
        """Whether the backward kernels take a `B`, `C` formed by Mamba-3's rotation with its
        angles (`mosaic/rotation.py`, `SplitOperand.theta`) and return `dB`, `dC` turned back."""
        return False

    # stage 3 and its reverse: `lax.scan` in XLA unless a backend has a kernel for them
    @staticmethod
    def recurrence(keep, chunk_states, initial_state):
        return _recurrence(keep, chunk_states, initial_state)

    @staticmethod
    def recurrence_bwd(keep, states_in, d_states_in, d_final):
        return _recurrence_bwd(keep, states_in, d_states_in, d_final)

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
        h, c, Q]` and `B` (the Pallas `_state_kernel` unless a backend has its own)."""
        p, n = self.p, self.n
        return self(
            functools.partial(state_kernel, dtype=dtype),
            [self.rows(p), self.col_spec, self.grouped(n)],
            [self.out("state")],
            xt,
            self.to_col(w),
            bt,
        )

    def chunk_scan(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, dtype, diag=None):
        """Stage 4, `y [b, h, L, P]` float32 from the chunks' inputs (`[b, h, c, Q]` vectors, `sc
        [b, c, Q]`) and the states entering them (the Pallas `scan_kernel` unless a backend has
        its own); `diag` (`[b, h, c, Q]`): the diagonal term's weights."""
        specs, args = self._scan_inputs(xt, scale, cum, ac, f, sc, bt, ct, states_in, sums, diag)
        kernel = functools.partial(scan_kernel, dtype=dtype, sums=sums, diag=diag is not None)
        return self(kernel, specs, [self.out("rows", self.p)], *args)

    def _scan_inputs(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, sums, diag=None):
        """The scan kernels' inputs after `dy` and their specs: `x`; `dt`, `cum` as columns,
        `cum` (or, `sums`, `a`) as a row; `f`; the segment ids both ways; `B`, `C`; the states;
        the diagonal term's weights as a column where given."""
        p, n = self.p, self.n
        specs = [self.rows(p), self.col_spec, self.col_spec, self.row_spec, self.col_spec]
        specs += [self.seg_col_spec, self.seg_row_spec, self.grouped(n), self.grouped(n), self.state]
        cols = [self.to_col(v) for v in (scale, cum)]
        args = [xt, *cols, self.to_row(ac if sums else cum), self.to_col(f), self.to_col(sc), self.to_row(sc)]
        args += [bt, ct, states_in]
        if diag is not None:
            specs, args = specs + [self.col_spec], args + [self.to_col(diag)]
        return specs, args

    def chunk_state_bwd(self, xt, w, bt, d_own, dx_scan, db_scan):
        """Stage 2's backward, `(dx [b, h, L, P], dw, dB [b, h, L, N])` per head in `out`'s
        layouts (the Pallas `state_bwd_kernel` unless a backend has its own): `dx` this stage's
        part plus `dx_scan` (stage 4's) in `x`'s dtype, `dB` plus `db_scan` (stage 4's), `dw`,
        `dB` float32; the Pallas kernel adds both (no float32 `dx` of its own in memory)."""
        p, n = self.p, self.n
        dx_spec, dx_shape = self.out("rows", p)
        return self(
            state_bwd_kernel,
            [self.rows(p), self.col_spec, self.grouped(n), self.state, self.rows(p), self.rows(n)],
            [(dx_spec, jax.ShapeDtypeStruct(dx_shape.shape, xt.dtype)), self.out("col"), self.out("rows", n)],
            xt,
            self.to_col(w),
            bt,
            d_own,
            dx_scan,
            db_scan,
        )

    def chunk_scan_bwd(self, dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, diag=None):
        """Stage 4's backward, `(dx, ddt, dcum, dcum_row, df, dB, dC, dS_in)` per head, float32,
        in `out`'s layouts (the Pallas `scan_bwd_kernel` unless a backend has its own); with
        `diag`, the diagonal term's weights' gradient (a column) follows."""
        p, n = self.p, self.n
        specs, args = self._scan_inputs(xt, scale, cum, ac, f, sc, bt, ct, states_in, sums, diag)
        outs = [self.out("rows", p), self.out("col"), self.out("col"), self.out("row"), self.out("col")]
        outs += [self.out("rows", n), self.out("rows", n), self.out("state")]
        outs += [self.out("col")] if diag is not None else []
        kernel = functools.partial(scan_bwd_kernel, sums=sums, diag=diag is not None)
        return self(kernel, [self.rows(p), *specs], outs, dy.astype(jnp.float32), *args)

    def state_backward(self, xt, w, bt, keep, states_in, d_states_in, d_final, dx_scan, db_scan):
        """Stage 3's and stage 2's backward: the reverse recurrence, then the chunk states'
        backward, `(dx, dw, dB, d keep, d initial state)`, `dx` with `dx_scan` added, in `x`'s
        dtype, `dB` with `db_scan` (a backend may fuse them)."""
        d_own, d_keep, d_init = self.recurrence_bwd(keep, states_in, d_states_in, d_final)
        return (*self.chunk_state_bwd(xt, w, bt, d_own, dx_scan, db_scan), d_keep, d_init)

    def sum_groups(self, db, dc):
        """`dB`, `dC` per group (`[b, g, L, N]`) from the backward kernels' per-head outputs."""
        per_group = lambda a: a.reshape(self.batch, -1, self.rep, self.lp, self.n).sum(2)  # noqa: E731
        return per_group(db), per_group(dc)

    def dot(self, a, b, dtype=None, *, trans_a=False, trans_b=False):
        return kernels.dot(a, b, dtype, trans_a=trans_a, trans_b=trans_b, precision=self.precision)

    def __call__(self, kernel, in_specs, outs, *args):
        specs, shapes = zip(*outs, strict=True)
        single = len(outs) == 1
        return pl.pallas_call(
            functools.partial(kernel, lay=self),
            name=f"axkern_ssd_{getattr(kernel, 'func', kernel).__name__.strip('_')}",
            grid=self.grid,
            in_specs=in_specs,
            out_specs=specs[0] if single else list(specs),
            out_shape=shapes[0] if single else list(shapes),
            **self.call_params(),
        )(*args)


def _core_forward(cfg, xt, ac, scale, bt, ct, sc, initial_state, diag, residuals=True):
    layout, q, interpret, products, y_dtype, clean_x = cfg
    # with nothing to keep for a backward, a layout whose forward kernel zeroes `x`'s non-finite
    # values itself (`cleans_x`) reads `x` as it is, where XLA would write a cleaned copy
    in_kernel = bool(clean_x) and not residuals and getattr(layout, "cleans_x", False)
    xt = zeroed(xt) if clean_x and not in_kernel else xt
    # float32 operands throughout for now: with bf16 operands in the output's products the
    # gate's gradient (dz, through the pre-gate output) missed the oracle rule in bf16
    mm = jnp.float32
    k = layout(xt, bt, q=q, interpret=interpret, products=products)
    k.y_dtype = jnp.dtype(y_dtype)
    cum, w, f, keep = _weights(ac, scale, sc)
    sums = uses_segment_sums(products or xt.dtype)
    extra = {} if diag is None else {"diag": diag}
    y, final, states_in = k.forward(
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
        sums=sums,
        dtype=mm,
        residuals=residuals,
        **extra,
        **({"clean_x": True} if in_kernel else {}),
    )
    return (y.astype(y_dtype), final), states_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, xt, ac, scale, bt, ct, sc, initial_state, diag):
    # nothing differentiates this call: no residuals
    return _core_forward(cfg, xt, ac, scale, bt, ct, sc, initial_state, diag, residuals=False)[0]


def _core_fwd(cfg, xt, ac, scale, bt, ct, sc, initial_state, diag):
    # operands that form their value (`parts_with`: Mamba-3's rotation, `mosaic/rotation.py`) are
    # formed once here, for these kernels and the backward's (with its angles where the
    # backward's kernels turn the cotangents back)
    layout, interpret = cfg[0], cfg[2]
    angles, kernel = layout.turns_back(), layout.parts_kernel
    formed = (
        bt.parts_with(ct, angles, kernel=kernel, interpret=interpret)  # (q, k: one kernel for both)
        if hasattr(bt, "parts_with")
        else (bt, ct)
    )
    if cfg[-1] == "pass":  # the cleaned `x` is the residual (the backward passes its cotangent on)
        xt, cfg = zeroed(xt), (*cfg[:-1], False)
    out, states_in = _core_forward(cfg, xt, ac, scale, *formed, sc, initial_state, diag)
    return out, (xt, ac, scale, (bt, ct), formed, sc, states_in, diag)


def _core_bwd(cfg, res, cotangents):
    layout, q, interpret, products, _, clean_x = cfg
    x_in, ac, scale, operands, (bt, ct), sc, states_in, diag = res
    xt = zeroed(x_in) if clean_x is True else x_in  # ("pass": `x_in` is cleaned already)
    dy, d_final = cotangents
    pull_b, pull_c = (_pullback(o, f) for o, f in zip(operands, (bt, ct), strict=True))
    k = layout(xt, bt, q=q, interpret=interpret, products=products)
    col, row = k.from_col, k.from_row  # back to [b, h, c, Q]
    (cum, w, f, keep), pull_weights = jax.vjp(lambda ac, scale: _weights(ac, scale, sc), ac, scale)
    sums = uses_segment_sums(products or xt.dtype)
    extra = {} if diag is None else {"diag": diag}
    dx_scan, ddt, dcum, dcum_row, df, db_scan, dc, d_states_in, *d_diag = k.chunk_scan_bwd(
        dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, sums=sums, **extra
    )
    dx, dw, db, d_keep, d_init = k.state_backward(
        xt, w, bt, keep, states_in, d_states_in, d_final.astype(jnp.float32), dx_scan, db_scan
    )
    if sums:  # the decay's `d a` straight from the kernel; the weights' `d cum` by autodiff
        da = row(dcum_row)
        d_ac, d_scale = pull_weights((jnp.zeros_like(cum), col(dw), col(df), d_keep))
        d_ac = d_ac + da
    else:
        d_ac, d_scale = pull_weights((col(dcum) - row(dcum_row), col(dw), col(df), d_keep))
    d_scale = d_scale + col(ddt)
    db, dc = k.sum_groups(db, dc)
    if clean_x is True:  # a non-finite input's gradient is NaN (as `chunks.clean`'s)
        dx = jnp.where(jnp.isfinite(x_in), dx, jnp.nan)
    return (
        dx.astype(xt.dtype),
        d_ac.astype(ac.dtype),
        d_scale.astype(scale.dtype),
        pull_b(db),
        pull_c(dc),
        None,
        d_init.astype(jnp.float32),
        None if diag is None else col(d_diag[0]).astype(diag.dtype),
    )


_core.defvjp(_core_fwd, _core_bwd)


def _pullback(operand, formed):
    """The map from `B`'s or `C`'s cotangent (per head or group, float32) to the input's: cast
    to an array's dtype, or an operand's own (`cotangent`: Mamba-3's rotation; turned back
    already where the kernels had its angles, `formed.theta`)."""
    if hasattr(operand, "cotangent"):
        return functools.partial(operand.cotangent, turned=getattr(formed, "theta", None) is not None)
    return lambda d: d.astype(operand.dtype)


def scan(
    layout,
    x,
    a,
    scale,
    B,
    C,
    seg,
    initial_state,
    *,
    chunk_size,
    interpret,
    products=None,
    y_dtype=None,
    clean_x=False,
    groups_first=False,
    diag=None,
):
    """The chunk scan through the kernels above, `layout` a `Layout` subclass: `x [b, L, H, P]`,
    the per-position log-decay `a` and input scale (`[b, L, H]`, float32), `B, C [b, L, G, N]`
    (`groups_first`: `[b, G, L, N]`, the kernels' own), `seg [b, L]` internal segment ids,
    `initial_state [b, H, P, N]`, all finite. Returns `y [b, L, H, P]` (float32, or `y_dtype`,
    rounded by the kernels where a layout's can) and the final state. The length is padded to a
    multiple of the chunk with `a = scale = 0` rows (the state stays). `products`: the input
    dtype whose path the kernels take (products' precision, decay's form; `x`'s unless given).
    `clean_x`: `x`'s non-finite values taken as 0 inside the scan (their gradients NaN), which
    keeps `x` itself, not a cleaned copy, for the backward; `"pass"`: taken as 0 likewise, their
    cotangents passed on (as `chunks.scrubbed`'s), the cleaned copy kept for the backward. Either
    way a call nothing differentiates reads `x` as it is where the layout's forward kernel cleans
    it (`cleans_x`). `diag` (`[b, L, H]`, finite, where
    the layout's kernels take it: `Layout.diagonal`): `y_t += diag_t (C_t · B_t) x_t`, the
    diagonal term of `bodies.py`, differentiated like the other inputs."""
    if diag is not None and not layout.diagonal:
        raise ValueError(f"{layout.__name__}'s kernels take no diagonal term (diag)")
    q = chunk_size
    batch, length, heads, _ = x.shape
    pad = (-length) % q
    widths = lambda v, at: [(0, 0)] * at + [(0, pad)] + [(0, 0)] * (v.ndim - at - 1)  # noqa: E731
    padded = lambda v, at=1: jnp.pad(v, widths(v, at)) if pad else v  # noqa: E731 - x itself when whole

    def rows(v):  # [b, G, L, N]; an operand that pads itself (`RotatedOperand`) as it is
        if hasattr(v, "padded"):
            return v.padded(pad)
        return padded(v, 2) if groups_first else jnp.moveaxis(padded(v), 2, 1)

    chunks = (length + pad) // q
    per_chunk = lambda v: jnp.moveaxis(padded(v), 2, 1).reshape(batch, heads, chunks, q)  # noqa: E731
    seg = jnp.concatenate([seg, jnp.broadcast_to(seg[:, -1:], (batch, pad))], axis=1)
    first = layout.positions_first
    names = (None if d is None else jnp.dtype(d).name for d in (products, y_dtype or jnp.float32))
    y, final = _core(
        (layout, q, interpret, *names, clean_x if clean_x == "pass" else bool(clean_x)),
        padded(x) if first else jnp.moveaxis(padded(x), 2, 1),  # [b, L, h, P] or [b, h, L, P]
        per_chunk(a),
        per_chunk(scale),
        rows(B),
        rows(C),
        seg.reshape(batch, chunks, q),
        initial_state.astype(jnp.float32),
        None if diag is None else per_chunk(diag),
    )
    return (y if first else jnp.moveaxis(y, 1, 2))[:, :length], final


def ssd(layout, x, dt, A, B, C, D, z, segment_ids, initial_state, *, chunk_size, interpret):
    """The SSD layer through the kernels above (`scan` with `a = dt A` and scale `dt`; the
    non-finite guard, `D` and the gate by `chunks.layer`). Without `D` and the gate, `y` leaves
    the scan in `x`'s dtype (one rounding of the float32 result either way)."""
    y_dtype = x.dtype if D is None and z is None else jnp.float32
    scan_fn = functools.partial(_ssd_scan, layout, chunk_size, interpret, y_dtype)
    return layer(scan_fn, x, dt, A, B, C, D, z, segment_ids, initial_state)


def _ssd_scan(layout, chunk_size, interpret, y_dtype, x, dt, A, B, C, seg, initial_state, clean_x=False):
    kw = dict(chunk_size=chunk_size, interpret=interpret, y_dtype=y_dtype, clean_x=clean_x)
    return scan(layout, x, dt * A.astype(dt.dtype), dt, B, C, seg, initial_state, **kw)
