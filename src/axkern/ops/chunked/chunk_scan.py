"""Stage 4 of the Pallas chunk scan as kernel bodies: each chunk's outputs `y` (`scan_kernel`) and
their backward (`scan_bwd_kernel`), one program per (batch, head, chunk) (`kernel_scan.py` has
the math, the grid and the FLOPs and bytes that bound them; `layout.py` launches them). Shared by
the Triton and TPU layouts through a `Layout` (`lay`: how each reads and writes its per-position
vectors and takes its products).

**Diagonal term** (`diag`, optional): the chunk scan adds `d_t (C_t · B_t) x_t` to `y_t`, a
per-position weight on the score of a position with itself, beside the decayed scores' own
diagonal (`s_t (C_t · B_t) x_t`). Mamba-3's diagonal correction is one (`d = -c_{t+1}`); in the
kernels `C_t · B_t` is the decayed scores' diagonal (`_diagonal`, from the same product) and its
gradient joins `d(C Bᵀ)` on the diagonal, so the term costs a `[Q, P]` scaling forward and a
`[Q, P]` row product backward, where XLA would read the per-head `B`, `C` and `y` once more
forward and their gradients backward; no `[Q, N]` elementwise work sits beside the products
(docs/ops/mamba3.md has what such work cost the Triton backward kernel).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from axkern.core import kernels


def _positions(q):
    """The row and column index of every entry of a `[Q, Q]` tile (rows `t`, columns `s`)."""
    return lax.broadcasted_iota(jnp.int32, (q, q), 0), lax.broadcasted_iota(jnp.int32, (q, q), 1)


def _decay(cum_col, cum_row, seg_col, seg_row, sums=None):
    """`Λ[t, s] = exp(cum_t - cum_s)` for `s <= t` in the same segment, else 0 (`[Q, Q]`);
    `sums` (float32 inputs) replaces the difference by `_segment_sums`."""
    t, s = _positions(cum_col.shape[0])
    visible = (s <= t) & (seg_col == seg_row)
    return jnp.exp(jnp.where(visible, cum_col - cum_row if sums is None else sums, -jnp.inf))


def _chunk_decay(lay, cum_ref, cum_row_ref, seg_ref, seg_row_ref, sums):
    """The chunk's `Λ` from the scan kernels' refs: `cum` as a column and (`sums`: `a`) as a row."""
    seg = (lay.seg_col(seg_ref), lay.seg_row(seg_row_ref))
    if sums:
        return _decay(lay.col(cum_ref), 0.0, *seg, _segment_sums(lay.row(cum_row_ref), lay.q))
    return _decay(lay.col(cum_ref), lay.row(cum_row_ref), *seg)


def _triangles(q):
    """`[r <= t]` (rows t, columns r) and `[r > s]` (rows r, columns s), float32 `[Q, Q]`."""
    i, j = _positions(q)
    return (j <= i).astype(jnp.float32), (i > j).astype(jnp.float32)


def _segment_sums(a_row, q):
    """`sum_{s < r <= t} a_r` for every `(t, s)`, each summed on its own: `([r <= t] ∘ a) [r > s]`,
    an exact float32 product. `cum_t - cum_s` cancels, and the rounding of its gradient, a
    difference of large sums, put float32 `A` / `dt_bias` gradients outside the oracle rule."""
    upto, after = _triangles(q)
    return kernels.dot(upto * a_row.reshape(1, q), after, jnp.float32, precision=lax.Precision.HIGHEST)


def _segment_sums_bwd(e, q):
    """`d a_r = sum_{t >= r > s} e[t, s]` from `e = d sums` (`[Q, Q]`), as a row `[1, Q]`."""
    upto, after = _triangles(q)
    g = kernels.dot(e, after, jnp.float32, trans_b=True, precision=lax.Precision.HIGHEST)  # [t, r]
    return jnp.sum(g * upto, axis=0, keepdims=True)


def scan_kernel(
    x_ref,
    dt_ref,
    cum_ref,
    cum_row_ref,
    f_ref,
    seg_ref,
    seg_row_ref,
    b_ref,
    c_ref,
    s_ref,
    *rest,
    lay,
    dtype,
    sums,
    diag=False,
):
    """`sums`: `cum_row_ref` holds `a = dt A` (float32 inputs: `_segment_sums`), not `cum`.
    `diag`: `rest` is `(diag_ref, y_ref)`, the diagonal term's weights as a column, else `(y_ref,)`."""
    *diag_ref, y_ref = rest
    x = lay.x_of(x_ref)  # [Q, P]
    dt, f = lay.col(dt_ref), lay.col(f_ref)  # [Q, 1]
    decay = _chunk_decay(lay, cum_ref, cum_row_ref, seg_ref, seg_row_ref, sums)
    cm, bm = c_ref[0, 0], b_ref[0, 0]  # [Q, N] each
    scores = lay.dot(cm, bm, dtype, trans_b=True) * decay  # [Q, Q]
    y = lay.dot(scores, x * dt, dtype)
    if diag:  # + d_t (C_t · B_t) x_t
        y = y + lay.col(diag_ref[0]) * _diagonal(scores) * x
    lay.put_tile(y_ref, y + f * lay.dot(cm, s_ref[0, 0, 0], dtype, trans_b=True))  # + f ∘ C S_in^T: [Q, P]


def _eye(q):
    t, s = _positions(q)
    return t == s


def _diagonal(m):
    """`m[t, t]` as a column `[Q, 1]`: of the decayed scores, `C_t · B_t` (`Λ[t, t]` is 1), from
    the same product as the other scores (the diagonal term and the decayed scores' own diagonal
    then round alike), with no `[Q, N]` elementwise work beside the products."""
    return jnp.sum(jnp.where(_eye(m.shape[0]), m, 0.0), axis=1, keepdims=True)


def scan_bwd_kernel(
    dy_ref,
    x_ref,
    dt_ref,
    cum_ref,
    cum_row_ref,
    f_ref,
    seg_ref,
    seg_row_ref,
    b_ref,
    c_ref,
    s_ref,
    *rest,
    lay,
    sums,
    diag=False,
):
    """Pull `dy` back through `y = M (dt ∘ x) + f ∘ (C S^T)` with `M = (C B^T) ∘ Λ`. With
    `sums` (`cum_row_ref` holds `a`), `dcum_row_ref` gets `d a` and `dcum_ref` zeros. `diag`:
    `rest` starts with the diagonal term's weights (`diag_ref`, a column) and ends with their
    gradient (`ddiag_ref`), through `y_t += d_t (C_t · B_t) x_t`."""
    diag_ref, rest = (rest[0], rest[1:]) if diag else (None, rest)
    dx_ref, ddt_ref, dcum_ref, dcum_row_ref, df_ref, db_ref, dc_ref, ds_ref, *ddiag_ref = rest
    f32 = jnp.float32
    dy = lay.tile_in(dy_ref)  # [Q, P], float32
    x = lay.x_of(x_ref)
    dt, f = lay.col(dt_ref), lay.col(f_ref)  # [Q, 1]
    bm, cm = b_ref[0, 0].astype(f32), c_ref[0, 0].astype(f32)  # [Q, N]
    state = s_ref[0, 0, 0]  # [P, N]
    decay = _chunk_decay(lay, cum_ref, cum_row_ref, seg_ref, seg_row_ref, sums)
    m = lay.dot(cm, bm, f32, trans_b=True) * decay  # [Q, Q]
    dxd = lay.dot(m, dy, f32, trans_a=True)  # d(dt ∘ x): [Q, P]
    dx = dxd * dt
    if diag:
        d, self_scores = lay.col(diag_ref), _diagonal(m)  # [Q, 1] each
        dyx = jnp.sum(dy * x, axis=1, keepdims=True)  # dy_t · x_t
        dx = dx + (d * self_scores) * dy
        lay.put_col(ddiag_ref[0], self_scores * dyx)
        d_self = d * dyx  # d(C_t · B_t): joins d(C B^T) on its diagonal below
    lay.put_tile(dx_ref, dx)
    lay.put_col(ddt_ref, jnp.sum(dxd * x, axis=1, keepdims=True))
    dm = lay.dot(dy, x * dt, f32, trans_b=True)  # [Q, Q]
    e = dm * m  # d log Λ
    if sums:
        lay.put_col(dcum_ref, jnp.zeros((lay.q, 1), f32))
        lay.put_row(dcum_row_ref, _segment_sums_bwd(e, lay.q))
    else:  # d cum through Λ: rows gain (here), columns lose (summed in XLA)
        lay.put_col(dcum_ref, jnp.sum(e, axis=1, keepdims=True))
        lay.put_row(dcum_row_ref, jnp.sum(e, axis=0, keepdims=True))
    dg = dm * decay  # d(C B^T)
    if diag:
        dg = dg + jnp.where(_eye(lay.q), d_self, 0.0)
    lay.put_col(df_ref, jnp.sum(dy * lay.dot(cm, state, f32, trans_b=True), axis=1, keepdims=True))
    dyf = dy * f
    dc, db = lay.dot(dg, bm, f32) + lay.dot(dyf, state, f32), lay.dot(dg, cm, f32, trans_a=True)
    lay.put_group(dc_ref, dc)
    lay.put_group(db_ref, db)
    ds_ref[0, 0, 0] = lay.dot(dyf, cm, f32, trans_a=True)  # [P, N]
