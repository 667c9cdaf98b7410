"""Stage 4, each chunk's output `y = ((C Bᵀ) ∘ Λ ∘ dt)(x) + f ∘ (C S_inᵀ)`, as a Mosaic GPU
kernel: one warpgroup per (batch row, head, chunk).

**The kernel.** TMA copies the chunk's `C` and `B` rows (`[64, N]`, the head's group) and `x`
rows (`[64, P]`) into swizzled shared memory; the state entering the chunk (`[P, N]`, float32)
is read into registers, rounded to the input dtype and stored beside them. Two `wgmma`s:
`s = C Bᵀ` (`[64, 64]`) and `C S_inᵀ` (`[64, P]`), float32 accumulators. In registers,
`M = s ∘ exp(cum_t - cum_s) ∘ dt_s` where `s <= t` in one segment (else 0), split as
`M = M_hi + M_lo`, each in the input dtype (what the rounding of `M` loses, as `bf16x2`); the
accumulator starts at `f_t · (C S_inᵀ)` and takes `M_hi x` and `M_lo x` (two `wgmma`s with
their left operand in registers). `y` (float32, or the input dtype where the layer adds no `D`
and gate) goes back through shared memory by TMA. Chunks of `64 r` walk tiles of 64 rows
(`tiled.py`).

**Cost** per chunk and head (Q = 64), in tensor-core FLOPs: `2·Q²·N` (`C Bᵀ`) + `4·Q²·P` (`M x`,
two halves) + `2·Q·P·N` (`C S_inᵀ`), with 16-bit `B`, `C`; bytes: `x`, `B`, `C` rows once, the
float32 state `P·N·4` read, `y` written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load

from .body import cleaned_rows, copy_chunk_in, decay, halves, pairs, parts_of, products
from .operands import operand_parts
from .sizes import check_operands, check_tiles, kernel_tiles
from .tiled import chunk_output_tiled, chunk_tiles, into_rows
from .tiles import CHUNK, dims, launch, plgpu

__all__ = ["chunk_scan", "chunk_output", "scan_vectors"]


def _scan_kernel(
    x_ref,
    dt_ref,
    cum_ref,
    f_ref,
    seg_ref,
    b_ref,
    c_ref,
    s_ref,
    y_ref,
    scoped,
    *,
    rep,
    dtype,
    add,
    rows_of,
    clean_x=False,
):
    """`clean_x`: `x`'s non-finite values taken as 0, in its tile once copied in."""
    (c_smem, b_smem, x_smem, s16_smem, y_smem), loaded = scoped
    chunk, head, batch = lax.axis_index("chunks"), lax.axis_index("heads"), lax.axis_index("batch")
    q, p = x_smem.shape
    base = chunk * q
    group = lax.div(head, jnp.int32(rep))
    rows = pl.ds(base, q)
    cs, bs = parts_of(c_smem), parts_of(b_smem)
    copies = copy_chunk_in(
        (c_ref, cs), (b_ref, bs), (x_ref, x_smem), batch, group, head, rows, rows_of, loaded
    )

    if q == CHUNK:
        vectors = scan_vectors(dt_ref, cum_ref, f_ref, seg_ref, batch, head, rows)
    state = mosaic_gpu_load(s_ref.at[batch, chunk, head], layout=plgpu.Layout.WGMMA, optimized=False)
    s16_smem[...] = state.astype(dtype)  # [P, N]
    plgpu.commit_smem()
    for i in range(copies):
        plgpu.barrier_wait(loaded.at[i])
    if clean_x:
        cleaned_rows(x_smem)
        plgpu.commit_smem()
    if q == CHUNK:
        y_smem[...] = chunk_output(cs, bs, x_smem, s16_smem, *vectors, dtype=dtype).astype(y_smem.dtype)
    else:
        refs, tiles = (dt_ref, cum_ref, f_ref, seg_ref), chunk_tiles(cs, bs, x_smem)
        chunk_output_tiled(tiles, s16_smem, into_rows(y_smem), refs, batch, head, base, dtype=dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(y_smem, rows_of(y_ref, batch, head, rows))
    plgpu.wait_smem_to_gmem(0)


def scan_vectors(dt_ref, cum_ref, f_ref, seg_ref, batch, head, rows):
    """The chunk's per-position vectors the output takes, along the `[Q, Q]` tile's rows (`_t`)
    or columns (`_s`): `cum_t, cum_s, dt_s, f_t, seg_t, seg_s`."""
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    vec = lambda ref, layout: mosaic_gpu_load(ref.at[batch, head, rows], layout=layout, optimized=False)  # noqa: E731
    cum_t, cum_s, dt_s, f_t = vec(cum_ref, row), vec(cum_ref, col), vec(dt_ref, col), vec(f_ref, row)
    seg_t = mosaic_gpu_load(seg_ref.at[batch, rows], layout=row, optimized=False)
    seg_s = mosaic_gpu_load(seg_ref.at[batch, rows], layout=col, optimized=False)
    return cum_t, cum_s, dt_s, f_t, seg_t, seg_s


def chunk_output(
    cs, bs, x_smem, s16_smem, cum_t, cum_s, dt_s, f_t, seg_t, seg_s, *, dtype, scores=None, onto=False
):
    """A chunk's `y` (`[Q, P]` float32) from its tiles in shared memory (`cs`, `bs`: `C` and `B`
    as their parts; `s16_smem` the entering state in 16 bits): `C Bᵀ` (or `scores`, formed
    before) and its decayed scores first, then `C S_inᵀ` (fewer registers live at once), `M x`
    from `M`'s two 16-bit halves (`onto`: accumulated onto `f ∘ (C S_inᵀ)`, one `[Q, P]` float32
    value fewer live)."""
    q, p = x_smem.shape
    s = products((q, q), pairs(cs, bs, True)) if scores is None else scores  # [Q, Q]
    lam, on_cols = decay(cum_t, cum_s, seg_t, seg_s)
    m = s * lam * on_cols(dt_s)
    m_hi, m_lo = halves(m, dtype)
    inc = products((q, p), pairs(cs, (s16_smem,), True))  # [Q, P]
    terms = [(m_hi, x_smem, False), (m_lo, x_smem, False)]
    if onto:
        return products((q, p), terms, acc=inc * lax.broadcast_in_dim(f_t, (q, p), [0]))
    y = products((q, p), terms)
    return y + inc * lax.broadcast_in_dim(f_t, (q, p), [0])


def chunk_scan(
    xt,
    dt,
    cum,
    f,
    seg,
    bt,
    ct,
    states_in,
    *,
    positions_first=False,
    y_dtype=jnp.float32,
    chunk=CHUNK,
    clean_x=False,
):
    """`y [b, h, L, P]` (float32, or rounded to `y_dtype` in the kernel) of the chunks (`xt [b,
    h, L, P]` bf16, `bt, ct [b, g, L, N]` bf16 or float32 (`operand_parts`); `dt, cum, f [b, h,
    L]` float32; `seg [b, L]` int32; `states_in [b, c, h, P, N]` float32, `L = c · chunk`) by the
    Mosaic GPU kernel. `positions_first`: `xt` and `y` are `[b, L, h, P]`. `chunk`: a multiple
    of 64, above 64 by tiles of 64 rows (`tiled.py`). `clean_x`: `x`'s non-finite values taken
    as 0."""
    bt, ct = operand_parts(bt), operand_parts(ct)
    check_operands(xt, bt, ct, positions_first=positions_first, chunk=chunk)
    p, n = dims(xt, positions_first)[3], bt[0].shape[-1]
    check_tiles("scan", p, bt, chunk)
    out = jax.ShapeDtypeStruct(xt.shape, y_dtype)
    barrier = plgpu.Barrier(num_barriers=len(bt) + len(ct) + 1)
    tiles = kernel_tiles("scan", p, n, xt.dtype, y_dtype, len(bt), chunk)
    kw = dict(rows=chunk, positions_first=positions_first) | ({"clean_x": True} if clean_x else {})
    call = launch("scan", _scan_kernel, out, xt, bt, barrier, tiles, **kw)
    return call(xt, dt, cum, f, seg.astype(jnp.int32), bt, ct, states_in)
