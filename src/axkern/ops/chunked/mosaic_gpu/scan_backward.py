"""Stage 4's backward, the chunk scan's, as a Mosaic GPU kernel: one warpgroup per (batch row,
head, chunk), each result stored and sent out by TMA as soon as it is formed.

**The sums** (those of the Pallas chunk-scan backward, `chunked/chunk_scan.py`): `df` from
`C S_inᵀ`; `C Bᵀ` and its decayed `M` (rows t, columns s); `dM = (dy xᵀ) ∘ dt_s` from `dy`'s two
halves in registers; `dcum`, `dcum_row` the row and column sums of `dM ∘ M`; `Mᵀ dy` from `M`'s
halves stored in shared memory and read transposed, times `dy`'s halves there (three products:
hi·hi, hi·lo, lo·hi), giving `dx` and `ddt`; then the halves of `dg = dM ∘ Λ` and of `f ∘ dy`
take `M`'s and `dy`'s places in shared memory for `dS_in = (f ∘ dy)ᵀ C`, `dC = dg B + (f ∘ dy)
S_in` and `dB = dgᵀ C`. Every float32 operand is taken as its two 16-bit halves (the state's
too), so the products are about as exact as float32 ones, but `(f ∘ dy) S_in`'s two, each
rounded once where `B`, `C` are 16-bit (`body.rounds_once`). A 16-bit cotangent (where the
forward gave `y` in the input dtype) has no low half: its products are left out. Chunks of
`64 r` walk tiles of 64 rows in two phases (`tiled.scan_bwd_tiled`).

**Group sums** (`group_sums`): the kernel adds each head's `dB` and `dC` tile into its group's
rows by TMA reductions (`copy_smem_to_gmem(..., reduction_op="add")`) into zeros it takes as a
ref it writes in place (`tiles.launch`'s `into`), where otherwise it writes `[b, h, L, N]`
float32 per head for XLA to sum; with the lean form, `scores` adds each head's `[Q, Q]` `dg`
instead of `dB` and `dg B`'s share of `dC`, which XLA forms from the sums (`group_scores.py`).
Given the angles (`theta`), `dB` and `dC` leave turned back (`angles.turned_back`).

**The lean form** (`lean`, `lean_reason`: chunks of 64, 16-bit `B`, `C`, no angles, P 64): the
same arithmetic in 108 KiB of shared memory at N 128 (180 whole), two blocks an SM: the state's
high half in its own tile and its low half in `M`'s two `[64, 64]` tiles by 64 of its columns
until `C S_inᵀ` has read it (`C S_inᵀ` over both halves, the low one by blocks of 64 of `C`'s
columns), `dx` out through `x`'s tile (no product reads it after `dM`) and every other result
through the float32 staging tile (`tiles.STAGE`) block by block, each block waiting for the
copy before it (`body.staged`; `P/64 · N/64 + 2 · N/64` copies a block, six at P 64, N 128). Grid, bytes and tensor-core FLOPs as the whole kernel's.

**Cost** per chunk and head (Q = 64), in tensor-core FLOPs: `10·Q²·(N + P) + 10·Q·P·N` (`C Bᵀ`;
`dM` and `Mᵀ dy` with two and three products; `dg B`, `dgᵀ C` with two each; `f∘dy S_in` with
one; `C S_inᵀ`, `dS_in` with two each; a 16-bit cotangent leaves out `dy`'s low half: `dM` one
product, `Mᵀ dy` two), with 16-bit `B`, `C`. Bytes: `x`, `B`, `C` rows once, the float32 state
`P·N·4` read, `dx` written in the input dtype (`x`'s; the chunk-state backward adds its own
to it: one rounding of this share, which kept every gradient inside the oracle rule through
the layer, docs/ops/ssd.md), `dB`, `dC`, `dS_in` float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load

from .angles import check_angles, read_angles, turned_back
from .body import cleaned_rows, copy_chunk_in, decay, halves, pairs, parts_of, products, rounds_once, staged
from .operands import finite_or_zero, operand_parts
from .sizes import check_operands, check_tiles, kernel_tiles
from .tiled import scan_bwd_tiled
from .tiles import CHUNK, batch_folding, blocks_per_sm, dims, launch, plgpu, rows_type

__all__ = ["chunk_scan_bwd", "lean_reason", "lean_shares_an_sm"]


def _scan_bwd_kernel(
    *refs,
    rep,
    dtype,
    add,
    rows_of,
    turns=False,
    tiled=False,
    lean=False,
    dg_sums=False,
    clean_x=False,
    dy_in_dx=False,
):
    """`add`: `dB`, `dC` added by TMA reductions into the head's group's rows (`[b, g, L, N]`)
    rather than stored per head (`dg_sums`, lean and `add` only: `dg` added into its group's
    chunk's `[Q, Q]` in `dB`'s place, `dC` without `dg B`: `group_scores.py`). `turns`: a tenth input, the angles `Θ` (`[b, h, L, A]`,
    float32), by which `dB` and `dC` leave turned back (`angles.turned_back`). `tiled`: a chunk of
    more than 64 positions, by tiles (`tiled.py`). `lean` (16-bit `B`, `C`; neither `turns` nor
    `tiled`; `P` 64): the state's low half in `M`'s tiles until `C S_inᵀ` has read it, `dx`
    out through `x`'s tile and every other result through the float32 staging tile, block by
    block (`tiles.STAGE`, `body.staged`). `clean_x`: `x`'s non-finite values taken as 0, in its tile once copied in and
    where it is read into registers. `dy_in_dx`: `dy`'s ref is `dx`'s (`tiles.launch`'s `over`: a
    16-bit `dy` in `dx`'s buffer), so no block reads its rows of `dy` from memory after writing
    its `dx` there: the whole chunk's kernel reads them once, before any product, and the tiled
    one reads them again from their halves in shared memory (the high half: a 16-bit `dy`'s low
    half is 0)."""
    if tiled:
        kw = dict(rep=rep, dtype=dtype, add=add, rows_of=rows_of, clean_x=clean_x, dy_in_dx=dy_in_dx)
        return scan_bwd_tiled(refs[:-1], refs[-1], **kw)
    dy_ref, x_ref, dt_ref, cum_ref, f_ref, seg_ref, b_ref, c_ref, s_ref, *rest = refs
    theta_ref = rest.pop(0) if turns else None
    dx_ref, ddt_ref, dcum_ref, dcum_row_ref, df_ref, db_ref, dc_ref, ds_ref, scoped = rest
    if lean:
        (c_smem, b_smem, x_smem, sh_smem, ah_smem, al_smem, mh_smem, ml_smem, stage, vec_smem), loaded = (
            scoped
        )
        s_parts = (sh_smem,)
    else:
        (c_smem, b_smem, x_smem, sh_smem, sl_smem, ah_smem, al_smem, mh_smem, ml_smem, *outs), loaded = scoped
        dx_smem, dbc_smem, ds_smem, vec_smem = outs
        s_parts = (sh_smem, sl_smem)
    batch, head, chunk = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("chunks")
    q, p = x_smem.shape
    n = c_smem.shape[-1]
    rows = pl.ds(chunk * q, q)
    group = lax.div(head, jnp.int32(rep))
    cs, bs = parts_of(c_smem), parts_of(b_smem)
    copies = copy_chunk_in(
        (c_ref, cs), (b_ref, bs), (x_ref, x_smem), batch, group, head, rows, rows_of, loaded
    )

    f32, wgmma_layout = jnp.float32, plgpu.Layout.WGMMA
    row, col = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    vec = lambda ref, layout: mosaic_gpu_load(ref.at[batch, head, rows], layout=layout, optimized=False)  # noqa: E731
    cum_t, cum_s, dt_t, dt_s, f_t = (
        vec(cum_ref, row),
        vec(cum_ref, col),
        vec(dt_ref, row),
        vec(dt_ref, col),
        vec(f_ref, row),
    )
    seg_t = mosaic_gpu_load(seg_ref.at[batch, rows], layout=row, optimized=False)
    seg_s = mosaic_gpu_load(seg_ref.at[batch, rows], layout=col, optimized=False)
    dy = mosaic_gpu_load(rows_of(dy_ref, batch, head, rows), layout=wgmma_layout, optimized=False).astype(
        f32
    )  # [Q, P], from float32 or bf16
    # the state and the cotangent as two 16-bit halves in shared memory (every product with
    # a float32 operand takes its halves: bf16x2, or three products when both are float32);
    # the lean form's low half of the state in M's two tiles, by 64 of its columns (`P` 64),
    # until C S_inᵀ has read it
    state = mosaic_gpu_load(s_ref.at[batch, chunk, head], layout=wgmma_layout, optimized=False)
    sh, sl = halves(state, dtype)
    sh_smem[...] = sh
    lows = (mh_smem, ml_smem)[: n // q] if lean else ()
    for j, tile in enumerate(lows):
        tile[...] = sl[:, j * q : (j + 1) * q]
    if not lean:
        sl_smem[...] = sl
    ah_smem[...], al_smem[...] = halves(dy, dtype)
    plgpu.commit_smem()
    for i in range(copies):
        plgpu.barrier_wait(loaded.at[i])
    if clean_x:  # before the products read the tile
        cleaned_rows(x_smem)
        plgpu.commit_smem()

    def put(smem, value, ref, reduction_op=None, turn=None):
        """`value` out through `smem` by TMA (the copy left in flight), turned back by `turn`
        (`cos Θ`, `sin Θ`) where given."""
        smem[...] = value
        if turn is not None:
            turned_back(smem, *turn)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, ref, reduction_op=reduction_op)

    per_group = (batch, group, rows) if add else (batch, head, rows)
    summed = "add" if add else None
    send = staged(stage) if lean else None

    # each result leaves as soon as it is formed (fewer registers live at once): df first
    # C S_inᵀ (the lean form's low half by blocks of 64 of C's columns)
    low = [(cs[0].at[:, pl.ds(j * q, q)], tile, True) for j, tile in enumerate(lows)]
    inc = products((q, p), pairs(cs, s_parts, True) + low)
    vec_smem.at[2][...] = jnp.sum(dy * inc, axis=1)  # df

    # scores and decay, rows t by columns s
    scores = products((q, q), pairs(cs, bs, True))
    lam, on_cols = decay(cum_t, cum_s, seg_t, seg_s)
    m = scores * lam
    mh, ml = halves(m, dtype)
    mh_smem[...], ml_smem[...] = mh, ml
    plgpu.commit_smem()

    # dM = dy (dt ∘ x)ᵀ: dy's halves (registers, formed again here) times xᵀ, scaled by dt per
    # column; a 16-bit dy's low half is 0, so its products are left out (and below)
    wide_dy = jnp.dtype(dy_ref.dtype).itemsize > 2
    dyh, dyl = halves(dy, dtype)
    dm = products((q, q), [(dyh, x_smem, True)] + [(dyl, x_smem, True)] * wide_dy) * on_cols(dt_s)
    e = dm * m
    vec_smem.at[1][...] = jnp.sum(e, axis=1)  # dcum: rows t
    vec_smem.at[3][...] = jnp.sum(e, axis=0)  # dcum_row: columns s
    dg = dm * lam
    if dg_sums:
        send(dg, lambda r, cols: db_ref.at[batch, group, chunk, pl.ds(r, CHUNK), cols], "add")

    # d(dt ∘ x) = Mᵀ dy, rows s: M's halves transposed from shared memory, dy's halves
    m_t = (mh_smem.transpose((1, 0)), ml_smem.transpose((1, 0)))
    low = [(m_t[0], al_smem, False)] * wide_dy
    dxd = products((q, p), [(m_t[0], ah_smem, False), *low, (m_t[1], ah_smem, False)])
    x = mosaic_gpu_load(rows_of(x_ref, batch, head, rows), layout=wgmma_layout, optimized=False).astype(f32)
    x = finite_or_zero(x) if clean_x else x
    vec_smem.at[0][...] = jnp.sum(dxd * x, axis=1)  # ddt
    # dx in the input dtype (the chunk-state backward adds its own to it); the lean form's
    # through x's tile, which no product reads after dM
    dx = (dxd * lax.broadcast_in_dim(dt_t, (q, p), [0])).astype(dx_ref.dtype)
    put(x_smem if lean else dx_smem, dx, rows_of(dx_ref, batch, head, rows))

    # dg's halves take M's place in shared memory and f ∘ dy's take dy's (their products are done)
    if not dg_sums:
        mh_smem[...], ml_smem[...] = halves(dg, dtype)
    ah_smem[...], al_smem[...] = halves(dy * lax.broadcast_in_dim(f_t, (q, p), [0]), dtype)
    plgpu.commit_smem()
    # the angles read while the products below run
    theta = None if theta_ref is None else read_angles(theta_ref, batch, head, rows)
    # dS_in = (f ∘ dy)ᵀ C
    ds = products((p, n), pairs((ah_smem.transpose((1, 0)), al_smem.transpose((1, 0))), cs))
    if lean:
        send(ds, lambda r, cols: ds_ref.at[batch, chunk, head, pl.ds(r, CHUNK), cols])
    else:
        put(ds_smem, ds, ds_ref.at[batch, chunk, head])
    # dC = dg B + (f ∘ dy) S_in (rows t), then dB = dgᵀ C (rows s) through the same staging tile;
    # (f ∘ dy) S_in with both operands rounded once where `rounds_once`
    fs = (
        pairs((ah_smem,), (sh_smem,))
        if rounds_once(len(bs))
        else pairs((ah_smem, al_smem), (sh_smem, sl_smem))
    )
    dc = products((q, n), ([] if dg_sums else pairs((mh_smem, ml_smem), bs)) + fs)
    if lean:
        send(dc, lambda r, cols: dc_ref.at[(*per_group, cols)], summed)
        if not dg_sums:
            db = products((q, n), pairs((mh_smem.transpose((1, 0)), ml_smem.transpose((1, 0))), cs))
            send(db, lambda r, cols: db_ref.at[(*per_group, cols)], summed)
    else:
        turn = None if theta is None else (jnp.cos(theta), jnp.sin(theta))
        put(dbc_smem, dc, dc_ref.at[per_group], summed, turn)
        db = products((q, n), pairs((mh_smem.transpose((1, 0)), ml_smem.transpose((1, 0))), cs))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dC has left the staging tile
        put(dbc_smem, db, db_ref.at[per_group], summed, turn)
    for i, ref in enumerate((ddt_ref, dcum_ref, df_ref, dcum_row_ref)):
        plgpu.copy_smem_to_gmem(vec_smem.at[i], ref.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)


def chunk_scan_bwd(
    dy,
    xt,
    dt,
    cum,
    f,
    seg,
    bt,
    ct,
    states_in,
    *,
    group_sums=False,
    positions_first=False,
    theta=None,
    chunk=CHUNK,
    lean=False,
    scores=False,
    clean_x=False,
):
    """Stage 4's backward by the Mosaic GPU kernel: `(dx [b, h, L, P]` in `x`'s dtype, `ddt,
    dcum, dcum_row, df [b, h, L], dB, dC [b, h, L, N], dS_in [b, c, h, P, N])`, float32, per
    head, from the
    cotangent `dy [b, h, L, P]` (float32, or bf16 where the forward gave `y` so) and
    `chunk_scan`'s arguments (`B`, `C` bf16 or float32, as their `operand_parts`). `dcum` holds each row's sum of `dM ∘ M` and `dcum_row` each
    column's (as `chunked/chunk_scan.py`'s backward). `group_sums`:
    `dB`, `dC` per group (`[b, g, L, N]`), each head's tiles added by TMA reductions (the order
    of the additions, and so the last bits, may vary between runs). `theta` (`[b, h, L, A]`,
    float32, `A` a multiple of 32 at most `N/2`; `B`, `C` the values Mamba-3's rotation turned by it, `operands.RotatedOperand`): `dB`, `dC` leave
    turned back by `-Θ` (the rotation's transpose; per head only). `chunk`: a multiple of 64
    (`dS_in [b, L / chunk, h, P, N]`); above 64 by tiles of 64 rows in two phases (`tiled.py`),
    without `theta`. `lean`: the kernel in less shared memory (`lean_reason`), the same
    arithmetic. `scores` (lean, `group_sums`): `dg` summed per group in `dB`'s place (`[b, g, c,
    Q, Q]`), `dC` without `dg B` (`group_scores.group_scores_grads` forms both). `clean_x`: `x`'s
    non-finite values taken as 0."""
    if scores and not (lean and group_sums):
        raise ValueError("chunk_scan_bwd: scores (dg summed per group) with lean and group_sums only")
    check_angles("chunk_scan_bwd", theta, group_sums, xt, bt, positions_first)
    if theta is not None and chunk != CHUNK:
        raise ValueError(f"chunk_scan_bwd: theta (dB, dC turned back) at chunks of {CHUNK} only, not {chunk}")
    p, n = dims(xt, positions_first)[3], operand_parts(bt)[0].shape[-1]
    reason = lean and lean_reason(len(operand_parts(bt)), chunk, theta is not None, p, n)
    if reason:
        raise ValueError(f"chunk_scan_bwd: lean: {reason}")
    args = (dy, xt, dt, cum, f, seg, bt, ct, states_in) + (() if theta is None else (theta,))
    kw = dict(group_sums=group_sums, positions_first=positions_first, chunk=chunk, lean=lean, scores=scores)
    body = functools.partial(_chunk_scan_bwd, clean_x=clean_x, **kw)
    # outputs written in place (the group sums' zeros, dx over a 16-bit dy) go through
    # `pl.run_state`, which batches only by folding the mapped axis into the batch
    in_place = group_sums or dy.dtype == xt.dtype
    return batch_folding(body)(*args) if in_place else body(*args)


def lean_reason(
    parts: int, chunk: int = CHUNK, turns: bool = False, p: int = CHUNK, n: int = 2 * CHUNK
) -> str | None:
    """Why the lean chunk-scan backward cannot serve (`B`, `C` in `parts` tiles each, chunks of
    `chunk`, `dB`, `dC` turned back by angles, head dim `p`, state `n`), or None: it takes 16-bit
    `B`, `C` (one tile each), chunks of 64, and keeps the state's low half in `M`'s two `[64,
    64]` tiles until `C S_inᵀ` has read it, so `P` 64 and `N` 64 or 128."""
    if parts != 1:
        return "B and C as float32 halves (the lean form takes 16-bit B, C)"
    if chunk != CHUNK:
        return f"chunk_size={chunk}: the lean form runs chunks of {CHUNK}"
    if turns:
        return "theta: the lean form does not turn dB, dC back"
    if p != CHUNK:
        return (
            f"head_dim={p}: the lean form keeps the state's low half in M's tiles, at head_dim {CHUNK} only"
        )
    if n > 2 * CHUNK:
        return (
            f"state={n}: the lean form keeps the state's low half in M's two tiles, at state <= {2 * CHUNK}"
        )
    return None


def lean_shares_an_sm(p: int, n: int) -> bool:
    """Whether two blocks of the lean chunk-scan backward fit a Hopper SM's 228 KiB of shared
    memory (each with the 1 KiB the system keeps a block) at head dim `p` and state `n`, where
    the whole kernel's one does not: at P 64 (84 KiB at N 64, 108 at N 128), which it takes
    alone (`lean_reason`; its tiles would take 116 KiB at P 128)."""
    return lean_reason(1, p=p, n=n) is None and blocks_per_sm(kernel_tiles("scan_bwd_lean", p, n)) >= 2


def _chunk_scan_bwd(*args, group_sums, positions_first, chunk, lean=False, scores=False, clean_x=False):
    dy, xt, dt, cum, f, seg, bt, ct, states_in, *theta = args
    bt, ct = operand_parts(bt), operand_parts(ct)
    check_operands(xt, bt, ct, positions_first=positions_first, chunk=chunk)
    b, h, lp, p = dims(xt, positions_first)
    check_tiles("scan_bwd", p, bt, chunk)
    g, n, f32 = bt[0].shape[1], bt[0].shape[-1], jnp.float32
    vector = jax.ShapeDtypeStruct((b, h, lp), f32)
    states = jax.ShapeDtypeStruct((b, lp // chunk, h, p, n), f32)
    bc = jax.ShapeDtypeStruct((b, g if group_sums else h, lp, n), f32)
    dg = jax.ShapeDtypeStruct((b, g, lp // chunk, chunk, chunk), f32)  # (`scores`: in dB's place)
    out = (
        rows_type(b, h, lp, p, positions_first, xt.dtype),
        vector,
        vector,
        vector,
        vector,
        dg if scores else bc,
        bc,
        states,
    )
    dy = dy if dy.dtype == xt.dtype else dy.astype(f32)  # as the forward gave y: bf16 or float32
    # a 16-bit dy has dx's type: dx is written over it (its buffer dies here), so that the two are
    # one array in memory
    over = {0: 0} if dy.dtype == xt.dtype and dy.shape == out[0].shape else None
    args = [dy, xt, dt, cum, f, seg.astype(jnp.int32), bt, ct, states_in, *theta]
    into = {5: 9, 6: 10} if group_sums else None
    if group_sums:
        args += [jnp.zeros(out[5].shape, f32), jnp.zeros(bc.shape, f32)]
    barrier = plgpu.Barrier(num_barriers=len(bt) + len(ct) + 1)
    kind = "scan_bwd_lean" if lean else "scan_bwd"
    call = launch(
        kind,
        _scan_bwd_kernel,
        out,
        xt,
        bt,
        barrier,
        kernel_tiles(kind, p, n, xt.dtype, f32, len(bt), chunk),
        into=into,
        over=over,
        positions_first=positions_first,
        turns=bool(theta),
        rows=chunk,
        **({"tiled": True} if chunk != CHUNK else {}),
        **({"lean": True} if lean else {}),
        **({"dg_sums": True} if scores else {}),
        **({"clean_x": True} if clean_x else {}),
        **({"dy_in_dx": True} if over else {}),
    )
    return call(*args)
