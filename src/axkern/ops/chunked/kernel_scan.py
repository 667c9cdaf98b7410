"""The chunk scan through a backend's Pallas kernels (`scan`, and SSD's layer on it, `ssd`): the
XLA stage before the kernels (`chunk_weights`), and the `custom_vjp` that runs a `Layout`'s
stages forward and backward (`layout.py`; the kernel bodies in `chunk_state.py` and
`chunk_scan.py`). Not an implementation: each backend supplies its `Layout` subclass.

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

**Grid** `(batch, heads, chunks)` for all four kernels (the TPU layout's `(batch, chunks, heads)`,
a group's heads in turn); each program holds `[Q, P]`, `[Q, N]`,
`[Q, Q]` and `[P, N]` tiles. **Cost.** Per chunk and head `2·Q²·N` (`C B^T`) + `2·Q²·P` (scores
times `x`) + `2·Q·N·P` (incoming state) + `2·Q·P·N` (own state) FLOPs forward, about twice that
backward; bytes: `x`, `B`, `C` once per pass, the `[b, c, h, P, N]` float32 states written and
read; backward also the per-head `dx` (float32, or `x`'s dtype where the layout's kernel
writes it so: Mosaic GPU's), `dB` (written by `chunk_scan_bwd`, read by `chunk_state_bwd`,
which writes `dx` in `x`'s dtype and the summed `dB`) and `dC` (`dB`, `dC`
per group where the kernels sum the groups). Compute
bound for Mamba-2 sizes (`Q = 64..256`, `N = 128`). float32 inputs add `2·Q³` FLOPs forward and
`4·Q³` backward per chunk and head (`chunk_scan._segment_sums`).

`Layout.forward` runs stages 2-4 in turn (a backend may fuse them). **Non-finite input**
(`chunks.guard`'s masks, formed by `chunks.layer` only where an input is not finite): the
kernels take non-finite values as 0 (`x`'s in every kernel that reads it, `Layout.clean_x`; the
small inputs' in XLA); NaN is put where the sequential recurrence is non-finite (never
earlier in time, never in another segment), and the backward runs on numbers only, NaN put on
the gradients of the inputs that reach a non-finite output (`chunks.reached`). Products take float32 operands into float32 (bf16
operands missed the oracle rule): TF32 for bf16 inputs on GPU (`Layout.precision_16bit`), over bf16 halves on a TPU
(`pallas_tpu.TpuLayout.dot`), exact
for fp16 and float32 inputs (`precision_32bit`: TF32 rounds as coarsely as fp16); `x`,
`B`, `C` as `[batch, heads|groups, length, P|N]` (`x` as `[batch, length, heads, P]` where the
layout's kernels take the caller's layout: `Layout.positions_first`; `[batch, heads, P, length]`
where a TPU layout puts the positions on the lanes and its kernels transpose each tile,
`Layout.positions_on_lanes`: the same bytes, without a head dim of 64 padded to 128 lanes).

**Backward** (`custom_vjp` around stages 1-4; `D`, `z`, padding and layout by autodiff):
kernel `chunk_scan_bwd` pulls `dy` back through `y = M (dt ∘ x) + f ∘ (C S_in^T)`, `M = (C B^T)
∘ Λ`: `d(dt∘x) = M^T dy`, `dM = dy (dt∘x)^T`, `d(C B^T) = dM ∘ Λ` (`dC`, `dB`), `dcum =
rowsum(dM ∘ M) - colsum(dM ∘ M)` (float32 inputs: `d a` from `chunk_scan.py`), `df =
rowsum(dy ∘ C S_in^T)`, `dS_in = (f ∘ dy)^T C`. The recurrence runs backwards (the gradients of
each chunk's own state, of the carries, of the initial state); `chunk_state_bwd` pulls those
through `S = (w ∘ x)^T B` and adds `chunk_scan_bwd`'s `d x` (written in `x`'s dtype) and `dB`;
stage 1's VJP gives `d a`, `d s`. `dB`, `dC` per head (`[b, h, L, N]`, float32), summed over
each group's heads in XLA, or by the kernels themselves where the layout says so
(`Layout.sums_groups`, `put_group`: the TPU's). The forward saves the states entering the chunks (`[b, c, h, P, N]`,
float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from axkern.core.op import Unsupported

from .chunks import all_finite, layer, uses_segment_sums

__all__ = ["chunk_weights", "refuse_float64", "scan", "ssd"]


def refuse_float64(**arrays) -> None:
    """`Unsupported`, naming them, where any of `arrays` (by name; None for one not given) is
    float64: the kernels compute in float32 (Triton and Mosaic TPU take no float64 products), and
    their float32 carries would meet float64 values. The dispatcher then tries the next
    implementation (`xla` computes in float64)."""
    wide = [name for name, a in arrays.items() if a is not None and jnp.dtype(a.dtype) == jnp.float64]
    if wide:
        raise Unsupported(
            f"float64 {', '.join(wide)}: the Pallas kernels compute in float32 (Triton and Mosaic TPU "
            "take no float64 products); xla computes in float64"
        )


def chunk_weights(ac, scale, sc):
    """Stage 1 (XLA), from the per-position log-decay `ac` and input scale (`[b, h, c, Q]`):
    `cum`, the end-state weights `w`, the incoming-state weights `f` (all
    `[b, h, c, Q]`) and each chunk's carry of the incoming state `keep` (`[b, h, c]`)."""
    cum = jnp.cumsum(ac, axis=-1)
    seg_before = jnp.concatenate([sc[:, :1, :1], sc[:, :-1, -1:]], axis=1)  # [b, c, 1]
    w = jnp.exp(cum[..., -1:] - cum) * scale * (sc == sc[:, :, -1:])[:, None]
    f = jnp.exp(cum) * (sc == seg_before)[:, None]
    keep = (sc[:, :, -1] == seg_before[..., 0])[:, None] * jnp.exp(cum[..., -1])
    return cum, w, f, keep


def _core_forward(cfg, xt, ac, scale, bt, ct, sc, initial_state, diag, residuals=True):
    layout, q, interpret, products, y_dtype, clean_x, x_finite = cfg
    # float32 operands throughout for now: with bf16 operands in the output's products the
    # gate's gradient (dz, through the pre-gate output) missed the oracle rule in bf16
    mm = jnp.float32
    k = layout(xt, bt, q=q, interpret=interpret, products=products, clean_x=clean_x)
    k.y_dtype = jnp.dtype(y_dtype)
    cum, w, f, keep = chunk_weights(ac, scale, sc)
    sums = uses_segment_sums(products or xt.dtype)
    extra = {} if diag is None else {"diag": diag}
    reports = x_finite and k.reports_x
    y, final, states_in, *seen = k.forward(
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
        **({"seen": True} if reports else {}),
    )
    out = (y.astype(y_dtype), final)
    if x_finite:  # whether every value of `x` is finite: the forward kernel's report, else a read of XLA's
        out += (jnp.isfinite(jnp.sum(seen[0])) if reports else all_finite(xt),)
    return out, states_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, xt, ac, scale, bt, ct, sc, initial_state, diag):
    # nothing differentiates this call: no residuals
    return _core_forward(cfg, xt, ac, scale, bt, ct, sc, initial_state, diag, residuals=False)[0]


def _core_fwd(cfg, xt, ac, scale, bt, ct, sc, initial_state, diag):
    # operands that form their value (`parts_with`: Mamba-3's rotation, `mosaic_gpu/rotation.py`) are
    # formed once here, for these kernels and the backward's (with its angles where the
    # backward's kernels turn the cotangents back)
    layout, interpret = cfg[0], cfg[2]
    angles, kernel = layout.turns_back(), layout.parts_kernel
    formed = (
        bt.parts_with(ct, angles, kernel=kernel, interpret=interpret)  # (q, k: one kernel for both)
        if hasattr(bt, "parts_with") and not layout.takes_rotations
        else (bt, ct)
    )
    out, states_in = _core_forward(cfg, xt, ac, scale, *formed, sc, initial_state, diag)
    return out, (xt, ac, scale, (bt, ct), formed, sc, states_in, diag)


def _core_bwd(cfg, res, cotangents):
    layout, q, interpret, products, _, clean_x, _ = cfg
    xt, ac, scale, operands, (bt, ct), sc, states_in, diag = res
    dy, d_final, *_ = cotangents  # (and `x`'s finiteness, a boolean's)
    pull_b, pull_c = (_pullback(o, f) for o, f in zip(operands, (bt, ct), strict=True))
    k = layout(xt, bt, q=q, interpret=interpret, products=products, clean_x=clean_x)
    col, row = k.from_col, k.from_row  # back to [b, h, c, Q]
    (cum, w, f, keep), pull_weights = jax.vjp(lambda ac, scale: chunk_weights(ac, scale, sc), ac, scale)
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
    if hasattr(operand, "cotangent"):  # (a rotation the kernels took as it is: `g` stays rotated)
        turned = not hasattr(formed, "cotangent") and getattr(formed, "theta", None) is not None

        def pull(g):  # a cotangent the kernels turned back and reduced themselves knows its operand's
            return (
                g.cotangent_of(operand) if hasattr(g, "cotangent_of") else operand.cotangent(g, turned=turned)
            )

        return pull
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
    x_finite=False,
):
    """The chunk scan through `layout`'s kernels (a `Layout` subclass): `x [b, L, H, P]`,
    the per-position log-decay `a` and input scale (`[b, L, H]`, float32), `B, C [b, L, G, N]`
    (`groups_first`: `[b, G, L, N]`, the kernels' own), `seg [b, L]` internal segment ids,
    `initial_state [b, H, P, N]`, all finite. Returns `y [b, L, H, P]` (float32, or `y_dtype`,
    rounded by the kernels where a layout's can) and the final state. The length is padded to a
    multiple of the chunk with `a = scale = 0` rows (the state stays). `products`: the input
    dtype whose path the kernels take (products' precision, decay's form; `x`'s unless given).
    `clean_x`: `x`'s non-finite values taken as 0 by every kernel that reads `x` (`Layout.x_of`;
    no cleaned copy is written, and the backward keeps `x` as it came), their cotangents passed
    on (as `chunks.scrubbed`'s: the caller puts NaN on the gradients the rule asks for). `diag`
    (`[b, L, H]`, finite, where the layout's kernels take it: `Layout.diagonal`): `y_t += diag_t
    (C_t · B_t) x_t`, the diagonal term of `chunk_scan.py`, differentiated like the other inputs. `x_finite`: a third
    result, whether every value of `x` is finite (a boolean), from the forward kernel where it
    reports what it read (`Layout.reports_x`), else from one read of XLA's."""
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
    y, final, *x_ok = _core(
        (layout, q, interpret, *names, bool(clean_x), x_finite),
        padded(x) if first else layout.to_kernel(padded(x)),  # [b, L, h, P] or the layout's own
        per_chunk(a),
        per_chunk(scale),
        rows(B),
        rows(C),
        seg.reshape(batch, chunks, q),
        initial_state.astype(jnp.float32),
        None if diag is None else per_chunk(diag),
    )
    return ((y if first else layout.from_kernel(y))[:, :length], final, *x_ok)


def ssd(layout, x, dt, A, B, C, D, z, segment_ids, initial_state, *, chunk_size, interpret):
    """The SSD layer through the kernels above (`scan` with `a = dt A` and scale `dt`; the
    non-finite guard, `D` and the gate by `chunks.layer`). Without `D` and the gate, `y` leaves
    the scan in `x`'s dtype (one rounding of the float32 result either way)."""
    y_dtype = x.dtype if D is None and z is None else jnp.float32
    scan_fn = functools.partial(_ssd_scan, layout, chunk_size, interpret, y_dtype)
    return layer(scan_fn, x, dt, A, B, C, D, z, segment_ids, initial_state)


def _ssd_scan(
    layout, chunk_size, interpret, y_dtype, x, dt, A, B, C, seg, initial_state, clean_x=False, x_finite=False
):
    kw = dict(chunk_size=chunk_size, interpret=interpret, y_dtype=y_dtype, clean_x=clean_x, x_finite=x_finite)
    return scan(layout, x, dt * A.astype(dt.dtype), dt, B, C, seg, initial_state, **kw)
