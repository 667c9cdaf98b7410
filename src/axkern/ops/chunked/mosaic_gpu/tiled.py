"""The chunk scan's output and backward for chunks of `Q = 64 r` positions (`r > 1`), by tiles
of 64 rows (one warpgroup's `wgmma` rows): a tile `(i, j)` pairs the chunk's row block `i`
(positions `t`) with its column block `j <= i` (positions `s`); the causal mask acts on the
diagonal tile only, the segments' on every tile. Each tile computes what
`scan.chunk_output` and the chunk-scan backward kernel (`scan_backward.py`) compute
for the whole chunk of 64 (the same roundings, element by element); the float32 sums run in
another order. The fused forward's walk at such chunks (`forward_tiled.py`) forms its output
here too.

**The backward in two phases**, as flash attention's: phase C, for each column block `j`, walks
the row blocks `i >= j` with the tiles transposed (rows `s`, columns `t`: `Mᵀ = (B_j C_iᵀ) ∘ Λᵀ`,
`dMᵀ = (x_j dy_iᵀ) ∘ dt_s`), accumulating `d(dt ∘ x)_j = Σ_i Mᵀ dy_i` and `dB_j = Σ_i dgᵀ C_i`
in registers, with `dcum_row`'s column sums; phase R, for each row block `i`, walks the column
blocks `j <= i`, accumulating `dC_i = Σ_j dg B_j + (f ∘ dy)_i S_in` and `dcum`'s row sums, with
`df`; then `dS_in = (f ∘ dy)ᵀ C` over the whole chunk. The scores and `dM` are formed in both
phases (about a quarter more tensor-core work than one pass), so that no `[Q, Q]` tile and no
partial sum leaves registers. Shared memory: the chunk's `C`, `B`, `x`, `dy`'s halves, the
state's halves, and staging tiles of 64 rows for `dx` (in `x`'s dtype) and for `dB`, `dC`,
`dS_in` in turn.

**Grid and layout** as the whole-chunk kernels': one warpgroup per (batch row, head, chunk of
`Q`), the chunk's rows of `C`, `B` (the head's group), `x` copied whole by TMA; a tile is a row
slice of those tiles; vectors (`dt`, `cum`, `f`, the segment ids) read per tile, per row
(`WGMMA.reduce(1)`) or per column (`reduce(0)`).

**Cost** per chunk and head, `T = 64`, `r = Q / T`, `k = r (r + 1) / 2` tiles on or below the
diagonal, in tensor-core FLOPs (halves counted as products): forward `k (2 T² N + 4 T² P) +
r · 2 T P N` (`C Bᵀ`, `M x`; `C S_inᵀ` per row block); backward `k (4 T² N + 4 T² P (1 + w) +
6 T² P + 8 T² N) + r · 6 T P N + 4 Q P N` (`C Bᵀ` and `dM` in both phases, `w` = 1 for a
float32 cotangent; `Mᵀ dy`; `dgᵀ C`, `dg B`; `C S_inᵀ` and `(f ∘ dy) S_in` per row block;
`dS_in`), against the whole chunk's `Q² (10 N + 10 P) + 10 Q P N`: the quadratic part grows
with `Q` and by the phases' recomputation, while the float32 states between chunks (`P N · 4`
bytes each, written and read by the recurrence) fall as `1 / Q`. Bytes a chunk: `x`, `B`, `C`
rows once (16-bit), `dy` three times (setup, `df`, `f ∘ dy`; the later reads mostly from L2),
the state once, the outputs once.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load

from .body import cleaned_rows, copy_chunk_in, decay, halves, pairs, parts_of, products, rounds_once
from .operands import finite_or_zero
from .tiles import CHUNK, plgpu

__all__ = ["chunk_tiles", "into_rows", "chunk_output_tiled", "scan_bwd_tiled"]


_T = CHUNK  # rows of a tile


def _row_col():
    """The layouts of a per-row and a per-column vector of a tile (`plgpu` is None where Mosaic
    GPU does not import: read at trace time)."""
    return plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)


def _tile(refs, k):
    """Row block `k` of each shared-memory tile in `refs`."""
    return tuple(r.at[pl.ds(k * _T, _T)] for r in refs)


def _load(ref, rows, layout):
    return mosaic_gpu_load(ref.at[rows], layout=layout, optimized=False)


def _plus(total, part):
    """A running sum in registers (the first part as it is: no zeros to lay out)."""
    return part if total is None else total + part


def chunk_tiles(cs, bs, x_smem) -> tuple:
    """Row blocks of a chunk's whole tiles in shared memory: `C`'s and `B`'s (`cs`, `bs`: their
    parts) and `x`'s, as `chunk_output_tiled` takes them."""
    blocks = range(x_smem.shape[0] // _T)
    return (
        [_tile(cs, i) for i in blocks],
        [_tile(bs, j) for j in blocks],
        [_tile((x_smem,), j)[0] for j in blocks],
    )


def into_rows(smem):
    """An `emit` for `chunk_output_tiled` that stores row block `i`'s output into rows `i` of `smem`."""

    def emit(i, y):
        _tile((smem,), i)[0][...] = y.astype(smem.dtype)

    return emit


def chunk_output_tiled(tiles, s16_smem, emit, refs, batch, head, base, *, dtype, ready=None):
    """`scan.chunk_output` of a chunk of `Q = 64 r` positions, row block by row block: for row block
    `i`, `f ∘ (C_i S_inᵀ)` then, for each column block `j <= i`, `M_ij = (C_i B_jᵀ) ∘ Λ_ij ∘ dt_j`
    as two 16-bit halves times `x_j`; `emit(i, y_i)` takes the block's `[64, P]` float32 output.
    `tiles`: the row blocks of `C`, `B` (each as its parts) and `x` (`chunk_tiles`, or a fused
    kernel's tiles of 64 rows); `ready(i)`, where given, runs before row block `i` reads `C_i`.
    `refs`: `dt`, `cum`, `f`, the segment ids; `base` the chunk's first position."""
    dt_ref, cum_ref, f_ref, seg_ref = refs
    c_tiles, b_tiles, x_tiles = tiles
    p = x_tiles[0].shape[-1]
    per_row, per_col = _row_col()
    for i, c_i in enumerate(c_tiles):
        rows_i = pl.ds(base + i * _T, _T)
        cum_t, f_t = (
            _load(cum_ref.at[batch, head], rows_i, per_row),
            _load(f_ref.at[batch, head], rows_i, per_row),
        )
        seg_t = _load(seg_ref.at[batch], rows_i, per_row)
        if ready is not None:
            ready(i)
        y = products((_T, p), pairs(c_i, (s16_smem,), True)) * lax.broadcast_in_dim(f_t, (_T, p), [0])
        for j in range(i + 1):
            rows_j = pl.ds(base + j * _T, _T)
            cum_s, dt_s = (
                _load(cum_ref.at[batch, head], rows_j, per_col),
                _load(dt_ref.at[batch, head], rows_j, per_col),
            )
            seg_s = _load(seg_ref.at[batch], rows_j, per_col)
            s = products((_T, _T), pairs(c_i, b_tiles[j], True))
            lam, on_cols = decay(cum_t, cum_s, seg_t, seg_s, diagonal=i == j)
            m_hi, m_lo = halves(s * lam * on_cols(dt_s), dtype)
            y = products((_T, p), [(m_hi, x_tiles[j], False), (m_lo, x_tiles[j], False)], acc=y)
        emit(i, y)


def _decay_transposed(cum_s, cum_t, seg_s, seg_t, diagonal):
    """`Λᵀ[s, t] = exp(cum_t - cum_s)` for `s <= t` in one segment, else 0 (rows `s` from row
    vectors `_s`, columns `t` from column vectors `_t`), and the broadcast of a per-row vector."""
    shape, layout = (_T, _T), plgpu.Layout.WGMMA
    on_rows = lambda v: lax.broadcast_in_dim(v, shape, [0])  # noqa: E731
    on_cols = lambda v: lax.broadcast_in_dim(v, shape, [1])  # noqa: E731
    visible = on_rows(seg_s) == on_cols(seg_t)
    if diagonal:
        s_idx = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
        t_idx = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
        visible = (s_idx <= t_idx) & visible
    return jnp.exp(jnp.where(visible, on_cols(cum_t) - on_rows(cum_s), -jnp.inf)), on_rows


def scan_bwd_tiled(refs, scoped, *, rep, dtype, add, rows_of, clean_x=False, dy_in_dx=False):
    """The chunk-scan backward kernel's results for a chunk of `Q = 64 r` positions (the module docstring has
    the phases; the grid and the arguments as there, without the angles). `clean_x`: `x`'s
    non-finite values taken as 0. `dy_in_dx`: `dy`'s ref is `dx`'s (a 16-bit `dy`, which phase C
    overwrites with `dx`): phase R reads `dy` from its high half in shared memory, which holds
    it exactly."""
    dy_ref, x_ref, dt_ref, cum_ref, f_ref, seg_ref, b_ref, c_ref, s_ref, *outs = refs
    per_row, per_col = _row_col()
    dx_ref, ddt_ref, dcum_ref, dcum_row_ref, df_ref, db_ref, dc_ref, ds_ref = outs
    (c_smem, b_smem, x_smem, sh_smem, sl_smem, ah_smem, al_smem, dx_smem, dbc_smem, vec_smem), loaded = scoped
    batch, head, chunk = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("chunks")
    (q, p), n = x_smem.shape, c_smem.shape[-1]
    base, group = chunk * q, lax.div(head, jnp.int32(rep))
    rows = pl.ds(base, q)
    cs, bs = parts_of(c_smem), parts_of(b_smem)
    copies = copy_chunk_in(
        (c_ref, cs), (b_ref, bs), (x_ref, x_smem), batch, group, head, rows, rows_of, loaded
    )
    f32, wgmma_layout = jnp.float32, plgpu.Layout.WGMMA
    wide_dy = jnp.dtype(dy_ref.dtype).itemsize > 2
    load_rows = lambda ref, r: mosaic_gpu_load(  # noqa: E731
        rows_of(ref, batch, head, r), layout=wgmma_layout, optimized=False
    ).astype(f32)
    vec = lambda ref, r, layout: _load(ref.at[batch, head], r, layout)  # noqa: E731

    def dy_rows(i, rows_i):  # row block i of dy in registers, float32 (phase R)
        if dy_in_dx:  # (memory holds dx there now)
            return mosaic_gpu_load(_tile((ah_smem,), i)[0], layout=wgmma_layout, optimized=False).astype(f32)
        return load_rows(dy_ref, rows_i)

    seg = lambda r, layout: _load(seg_ref.at[batch], r, layout)  # noqa: E731
    # the state and dy (the whole chunk) as two 16-bit halves in shared memory
    state = mosaic_gpu_load(s_ref.at[batch, chunk, head], layout=wgmma_layout, optimized=False)
    sh_smem[...], sl_smem[...] = halves(state, dtype)
    for i in range(q // _T):
        rows_i = pl.ds(base + i * _T, _T)
        _tile((ah_smem,), i)[0][...], _tile((al_smem,), i)[0][...] = halves(load_rows(dy_ref, rows_i), dtype)
    plgpu.commit_smem()
    for i in range(copies):
        plgpu.barrier_wait(loaded.at[i])
    if clean_x:  # before the products read the tile
        cleaned_rows(x_smem)
        plgpu.commit_smem()

    per_rows = lambda ref, r: ref.at[(batch, group, r) if add else (batch, head, r)]  # noqa: E731
    summed = "add" if add else None

    def put(smem, value, dst, reduction_op=None, allow=0):
        """`value` out through `smem` by TMA, once the copies before but the last `allow` have
        left the staging tiles (phase C alternates two tiles: the last copy read the other)."""
        plgpu.wait_smem_to_gmem(allow, wait_read_only=True)
        smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, dst, reduction_op=reduction_op)

    blocks = q // _T
    db_stage = dbc_smem.at[pl.ds(0, _T)]
    # phase C: column blocks j (positions s), the row blocks i >= j (positions t), tiles transposed
    for j in range(blocks):
        rows_j = pl.ds(base + j * _T, _T)
        cum_s, dt_s, seg_s = vec(cum_ref, rows_j, per_row), vec(dt_ref, rows_j, per_row), seg(rows_j, per_row)
        (x_j,), b_j = _tile((x_smem,), j), _tile(bs, j)
        dxd = db = dcum_row = None
        for i in range(j, blocks):
            rows_i = pl.ds(base + i * _T, _T)
            cum_t, seg_t = vec(cum_ref, rows_i, per_col), seg(rows_i, per_col)
            c_i, (ah_i,), (al_i,) = _tile(cs, i), _tile((ah_smem,), i), _tile((al_smem,), i)
            lam, on_rows = _decay_transposed(cum_s, cum_t, seg_s, seg_t, diagonal=i == j)
            m = products((_T, _T), pairs(b_j, c_i, True)) * lam  # Mᵀ: B_j C_iᵀ
            dm = products((_T, _T), [(x_j, ah_i, True)] + [(x_j, al_i, True)] * wide_dy) * on_rows(dt_s)
            dcum_row = _plus(dcum_row, jnp.sum(dm * m, axis=1))
            dg = halves(dm * lam, dtype)  # dm, lam die here
            mh, ml = halves(m, dtype)  # m dies here
            low = [(mh, al_i, False)] * wide_dy
            dxd = products((_T, p), [(mh, ah_i, False), *low, (ml, ah_i, False)], acc=dxd)
            db = products((_T, n), pairs(dg, c_i), acc=db)
        x = load_rows(x_ref, rows_j)
        x = finite_or_zero(x) if clean_x else x
        vec_smem.at[0, pl.ds(j * _T, _T)][...] = jnp.sum(dxd * x, axis=1)  # ddt
        vec_smem.at[3, pl.ds(j * _T, _T)][...] = dcum_row
        put(
            dx_smem,
            (dxd * lax.broadcast_in_dim(dt_s, (_T, p), [0])).astype(dx_smem.dtype),  # in x's dtype
            rows_of(dx_ref, batch, head, rows_j),
            allow=1,
        )
        put(db_stage, db, per_rows(db_ref, rows_j), summed, allow=1)
    # phase R: row blocks i (positions t), the column blocks j <= i
    for i in range(blocks):
        rows_i = pl.ds(base + i * _T, _T)
        cum_t, f_t, seg_t = vec(cum_ref, rows_i, per_row), vec(f_ref, rows_i, per_row), seg(rows_i, per_row)
        c_i = _tile(cs, i)
        dy = dy_rows(i, rows_i)
        inc = products((_T, p), pairs(c_i, (sh_smem, sl_smem), True))  # C_i S_inᵀ
        vec_smem.at[2, pl.ds(i * _T, _T)][...] = jnp.sum(dy * inc, axis=1)  # df
        (ah_i,), (al_i,) = _tile((ah_smem,), i), _tile((al_smem,), i)  # dy's halves (phase C's)
        dc = dcum = None
        for j in range(i + 1):
            rows_j = pl.ds(base + j * _T, _T)
            cum_s, dt_s, seg_s = (
                vec(cum_ref, rows_j, per_col),
                vec(dt_ref, rows_j, per_col),
                seg(rows_j, per_col),
            )
            (x_j,), b_j = _tile((x_smem,), j), _tile(bs, j)
            lam, on_cols = decay(cum_t, cum_s, seg_t, seg_s, diagonal=i == j)
            m = products((_T, _T), pairs(c_i, b_j, True)) * lam
            dm = products((_T, _T), [(ah_i, x_j, True)] + [(al_i, x_j, True)] * wide_dy) * on_cols(dt_s)
            dcum = _plus(dcum, jnp.sum(dm * m, axis=1))
            dc = products((_T, n), pairs(halves(dm * lam, dtype), b_j), acc=dc)
        fdy = halves(dy_rows(i, rows_i) * lax.broadcast_in_dim(f_t, (_T, p), [0]), dtype)
        once = rounds_once(len(bs))
        dc = products((_T, n), pairs(fdy[:1], (sh_smem,)) if once else pairs(fdy, (sh_smem, sl_smem)), acc=dc)
        vec_smem.at[1, pl.ds(i * _T, _T)][...] = dcum
        put(db_stage, dc, per_rows(dc_ref, rows_i), summed)
        # f ∘ dy's halves take dy's place (phase C, and this row block's dM above, read dy's) for dS_in
        _tile((ah_smem,), i)[0][...], _tile((al_smem,), i)[0][...] = fdy
    plgpu.commit_smem()
    # dS_in = (f ∘ dy)ᵀ C over the whole chunk
    ds = products((p, n), pairs((ah_smem.transpose((1, 0)), al_smem.transpose((1, 0))), cs))
    put(dbc_smem.at[pl.ds(0, p)], ds, ds_ref.at[batch, chunk, head])
    for k, ref in enumerate((ddt_ref, dcum_ref, df_ref, dcum_row_ref)):
        plgpu.copy_smem_to_gmem(vec_smem.at[k], ref.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)
