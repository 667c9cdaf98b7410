"""The Mosaic GPU SSD kernels' arithmetic in XLA: the same operands rounded as the kernels take
them (`x` as it is, `B`, `C` as their `operand_parts`; a float32 operand as its two 16-bit
halves, three products where both operands are float32; the forward scan's incoming state
rounded once), products
exact in float32. Arguments and results as the kernels' (`state.py`, `scan.py`,
`scan_backward.py`). The CPU tests carry
these through the whole layer against the float64 oracle (the kernels have no CPU interpret
mode) and the GPU tests hold each kernel to its emulation computed on the CPU: XLA's GPU compiler
takes the liberty of dropping a float32 → 16-bit → float32 round trip (excess precision), which
would make every `lo` half zero."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..chunks import zeroed
from ..pallas_gpu import GpuLayout
from .body import rounds_once
from .group_scores import with_group_scores
from .operands import operand_parts, rotate_halves
from .rotation_kernel import padded_angles
from .tiles import CHUNK

__all__ = [
    "emulate_chunk_state",
    "emulate_chunk_scan",
    "emulate_chunk_state_bwd",
    "emulate_chunk_scan_bwd",
    "EmulatedLayout",
    "OPERANDS",
    "ROUNDED_ONCE",
]

_ein = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _round(a, dtype):
    """`a` rounded to `dtype`'s precision, in float32: `reduce_precision`, which XLA keeps where it
    may drop a float32 -> 16-bit -> float32 round trip (`xla_allow_excess_precision`), so the
    emulation rounds alike in every graph it is part of."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(a.astype(jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _halves(a, dtype):
    """`a` as `hi + lo`, each rounded to `dtype` (float32 values)."""
    hi = _round(a, dtype)
    return hi, _round(a - hi, dtype)


class _Chunks:
    """Views of one call's arrays per chunk of `q` positions: rows `[b, h, c, Q, d]` (groups
    repeated over their heads), vectors `[b, h, c, Q]`, states `[b, h, c, P, N]`, and back."""

    def __init__(self, xt, bt, q):
        self.b, self.h, self.lp, self.p = xt.shape
        self.g, self.q, self.c = bt.shape[1], q, self.lp // q

    def rows(self, a):
        return a.astype(jnp.float32).reshape(self.b, self.h, self.c, self.q, a.shape[-1])

    def heads(self, a):
        return self.rows(jnp.repeat(a, self.h // self.g, axis=1))

    def parts(self, a):
        """`B` or `C` as the kernels take it (`operand_parts`): its parts per head, `[b, h, c, Q,
        N]` each."""
        return tuple(self.heads(part) for part in operand_parts(a))

    def vec(self, a):
        return a.reshape(self.b, self.h, self.c, self.q)

    def state(self, a):
        return jnp.moveaxis(a, 1, 2)

    def out_rows(self, a):
        return a.reshape(self.b, self.h, self.lp, a.shape[-1])

    def out_vec(self, a):
        return a.reshape(self.b, self.h, self.lp)

    def decay(self, cum, seg):
        """`Λ[t, s] = exp(cum_t - cum_s)` for `s <= t` in one segment, else 0: `[b, h, c, Q, Q]`."""
        cum_c, seg_c = self.vec(cum), seg.reshape(self.b, 1, self.c, self.q)
        t_idx, s_idx = jnp.arange(self.q)[:, None], jnp.arange(self.q)[None, :]
        visible = (s_idx <= t_idx) & (seg_c[..., :, None] == seg_c[..., None, :])
        return jnp.exp(jnp.where(visible, cum_c[..., :, None] - cum_c[..., None, :], -jnp.inf))


def _sum(spec, left, right):
    """`Σ einsum(spec, a, b)` over every pair of parts but `lo · lo` (`body.pairs`)."""
    return sum(_ein(spec, a, b) for i, a in enumerate(left) for j, b in enumerate(right) if i + j <= 1)


def emulate_chunk_state(xt, w, bt, q=CHUNK):
    """`state.chunk_state`: `(w ∘ x)ᵀ B` with `w ∘ x` as two halves (chunks of `q`)."""
    k = _Chunks(xt, bt, q)
    xw = _halves(k.rows(xt) * k.vec(w)[..., None], xt.dtype)
    return k.state(_sum("bhctp,bhctn->bhcpn", xw, k.parts(bt)))


def emulate_chunk_scan(xt, dt, cum, f, seg, bt, ct, states_in, q=CHUNK):
    """`scan.chunk_scan`: `M = (C Bᵀ) ∘ Λ ∘ dt_s` as two halves times `x`, plus `f ∘ (C S_inᵀ)`
    with the state rounded once."""
    k, dtype = _Chunks(xt, bt, q), xt.dtype
    x, bm, cm = k.rows(xt), k.parts(bt), k.parts(ct)
    m = _sum("bhctn,bhcsn->bhcts", cm, bm) * k.decay(cum, seg) * k.vec(dt)[..., None, :]
    mh, ml = _halves(m, dtype)
    inc = _sum("bhctn,bhcpn->bhctp", cm, (_round(k.state(states_in), dtype),))
    y = k.vec(f)[..., None] * inc + _ein("bhcts,bhcsp->bhctp", mh, x) + _ein("bhcts,bhcsp->bhctp", ml, x)
    return k.out_rows(y)


# The backward's float32 operands, `product:operand` (`benchmarks/diagnostics/ssd_backward_precision.py`
# rounds each once in turn): `dM = (dy xᵀ) ∘ dt`, `Mᵀ dy`, `dg B`, `dgᵀ C`, `(f ∘ dy) S_in`,
# `C S_inᵀ`, `dS_in = (f ∘ dy)ᵀ C`; the chunk state's `B dSᵀ`, `(w ∘ x) dS`.
OPERANDS = ("dM:dy", "Mdy:M", "Mdy:dy", "dgB:dg", "dgC:dg", "fS:fdy", "fS:S", "CS:S", "dS:fdy")
OPERANDS += ("BdS:dS", "wdS:wx", "wdS:dS")
# those the kernels round once where `body.rounds_once` (16-bit `B`, `C`)
ROUNDED_ONCE = frozenset({"fS:fdy", "fS:S", "wdS:wx", "wdS:dS"})


def _once(single, bt) -> frozenset:
    """The operands rounded once: `single`, or (None) the kernels' choice for `B`'s parts."""
    if single is not None:
        return frozenset(single)
    return ROUNDED_ONCE if rounds_once(len(operand_parts(bt))) else frozenset()


def _taken(a, dtype, operand, single):
    """`a` (float32) as the kernel takes it as `operand`: its two halves, or rounded once."""
    hi, lo = _halves(a, dtype)
    return (hi,) if operand in single else (hi, lo)


def emulate_chunk_state_bwd(xt, w, bt, d_own, q=CHUNK, single=None):
    """`state.chunk_state_bwd`: `dS` and `w ∘ x` as two halves, three products for `dB`
    (one, each rounded once, where `body.rounds_once`). `single`: the `OPERANDS` rounded once instead
    (None: the kernels' choice)."""
    k, dtype, one = _Chunks(xt, bt, q), xt.dtype, _once(single, bt)
    x, bm, wc = k.rows(xt), k.parts(bt), k.vec(w)[..., None]
    ds = k.state(d_own)
    dxw = _sum("bhctn,bhcpn->bhctp", bm, _taken(ds, dtype, "BdS:dS", one))
    db = _sum("bhctp,bhcpn->bhctn", _taken(x * wc, dtype, "wdS:wx", one), _taken(ds, dtype, "wdS:dS", one))
    return k.out_rows(dxw * wc), k.out_vec((dxw * x).sum(-1)), k.out_rows(db)


def emulate_chunk_scan_bwd(dy, xt, dt, cum, f, seg, bt, ct, states_in, q=CHUNK, single=None, scores=False):
    """`scan_backward.chunk_scan_bwd`: every float32 operand as its two halves (but `(f ∘
    dy) S_in`'s, each rounded once, where `body.rounds_once`); `dx` in `x`'s dtype. `single`: the `OPERANDS` rounded once instead
    (None: the kernels' choice). `scores`: as `chunk_scan_bwd(..., scores=True)`, `dg` summed per
    group (`[b, g, c, Q, Q]`) in `dB`'s place and `dC` (per group) without `dg B`."""
    k, dtype, one = _Chunks(xt, bt, q), xt.dtype, _once(single, bt)
    x, bm, cm, dyc = k.rows(xt), k.parts(bt), k.parts(ct), k.rows(dy)
    dt_c, f_c = k.vec(dt), k.vec(f)
    state = k.state(states_in)
    decay = k.decay(cum, seg)
    m = _sum("bhctn,bhcsn->bhcts", cm, bm) * decay
    dm = _sum("bhctp,bhcsp->bhcts", _taken(dyc, dtype, "dM:dy", one), (x,)) * dt_c[..., None, :]
    e = dm * m
    mdy = (_taken(m, dtype, "Mdy:M", one), _taken(dyc, dtype, "Mdy:dy", one))
    dxd = _sum("bhcts,bhctp->bhcsp", *mdy)  # Mᵀ dy
    dg, dyf = dm * decay, dyc * f_c[..., None]
    fs = _sum("bhctp,bhcpn->bhctn", _taken(dyf, dtype, "fS:fdy", one), _taken(state, dtype, "fS:S", one))
    if scores:
        per_group = lambda a: a.reshape(k.b, k.g, k.h // k.g, *a.shape[2:]).sum(2)  # noqa: E731
        db, dc = per_group(dg), per_group(fs).reshape(k.b, k.g, k.lp, -1)
    else:
        dc = k.out_rows(_sum("bhcts,bhcsn->bhctn", _taken(dg, dtype, "dgB:dg", one), bm) + fs)
        db = k.out_rows(_sum("bhcts,bhctn->bhcsn", _taken(dg, dtype, "dgC:dg", one), cm))
    inc = _sum("bhctn,bhcpn->bhctp", cm, _taken(state, dtype, "CS:S", one))
    ds = _sum("bhctp,bhctn->bhcpn", _taken(dyf, dtype, "dS:fdy", one), cm)
    return (
        k.out_rows(dxd * dt_c[..., None]).astype(dtype),  # dx in x's dtype, as the kernel writes it
        k.out_vec((dxd * x).sum(-1)),
        k.out_vec(e.sum(-1)),
        k.out_vec(e.sum(-2)),
        k.out_vec((dyc * inc).sum(-1)),
        db,
        dc,
        k.state(ds),
    )


class EmulatedLayout(GpuLayout):
    """`pallas_gpu`'s layout (its recurrence kernels; interpret mode on a CPU) with stages 2 and 4
    as the Mosaic kernels compute them: the whole layer through the kernels' arithmetic, for the
    CPU tests and `benchmarks/diagnostics/mamba3_operand_precision.py`. 16-bit inputs only (no
    `sums`). `single`: the backward's `OPERANDS` rounded once (None: the kernels' choice; a
    subclass sets others, `benchmarks/diagnostics/ssd_backward_precision.py`)."""

    diagonal = False  # as the Mosaic kernels it emulates
    single = None
    group_scores = False  # `dg` summed per group, `dB`, `dC` per group (`group_scores.py`)
    parts_kernel = True  # as `MosaicLayout` (`rotated_parts`, in interpret mode on a CPU)

    @classmethod
    def turns_back(cls) -> bool:  # as the Mosaic kernels (`layout.MosaicLayout`: not with the group sums)
        return not cls.group_scores

    def _x(self, xt):  # as the kernels read it (`clean_x`: non-finite values as 0)
        return zeroed(xt) if self.clean_x else xt

    def chunk_state(self, xt, w, bt, *, dtype):
        xt = self._x(xt)
        return emulate_chunk_state(xt, self.to_col(w), bt, self.q)

    def chunk_state_bwd(self, xt, w, bt, d_own, dx_scan, db_scan):
        dx, dw, db = emulate_chunk_state_bwd(self._x(xt), self.to_col(w), bt, d_own, self.q, self.single)
        db = _turned_back(bt, db)
        if self.group_scores:  # (the scan's dB per group)
            db = db.reshape(self.batch, -1, self.rep, *db.shape[2:]).sum(2)
        return (dx + dx_scan).astype(xt.dtype), dw, db + db_scan

    def chunk_scan(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, dtype):
        assert not sums
        c = self.to_col
        return emulate_chunk_scan(self._x(xt), c(scale), c(cum), c(f), c(sc), bt, ct, states_in, self.q)

    def chunk_scan_bwd(self, dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums):
        assert not sums
        c = self.to_col
        args = (dy, self._x(xt), c(scale), c(cum), c(f), c(sc), bt, ct, states_in, self.q, self.single)
        out = list(emulate_chunk_scan_bwd(*args, scores=self.group_scores))
        if self.group_scores:
            return with_group_scores(out, bt, ct)
        out[5], out[6] = _turned_back(bt, out[5]), _turned_back(ct, out[6])  # dB, dC
        return tuple(out)

    def sum_groups(self, db, dc):
        return (db, dc) if self.group_scores else super().sum_groups(db, dc)


def _turned_back(operand, g):
    """`g` (`dB` or `dC` per head) turned back by `-Θ` where `operand` carries its angles
    (`SplitOperand.theta`), as the backward kernels turn it (`angles.turned_back`)."""
    theta = getattr(operand, "theta", None)
    if theta is None:
        return g
    theta = padded_angles(theta, g.shape[-1] // 2)
    return rotate_halves(g, jnp.cos(theta), -jnp.sin(theta))
