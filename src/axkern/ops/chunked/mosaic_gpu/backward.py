"""The Mosaic GPU SSD kernels' backward (the package's docstring has their math and cost): the
chunk scan's and the chunk state's, each with the function that launches it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load

from .angles import _angles, _check_angles, _turned_back
from .kernels import (
    CHUNK,
    _check_operands,
    _check_tiles,
    _copy_chunk_in,
    _decay,
    _dims,
    _halves,
    _launch,
    _part_copies,
    _products,
    _rows_type,
    _tiles,
    blocks_per_sm,
    operand_parts,
    pairs,
    parts_of,
    plgpu,
)
from .tiled import rounds_once, scan_bwd_tiled

__all__ = ["chunk_scan_bwd", "chunk_state_bwd", "lean_reason", "lean_shares_an_sm"]


def _scan_bwd_kernel(*refs, rep, dtype, add, rows_of, turns=False, tiled=False, lean=False, dg_sums=False):
    """`add`: `dB`, `dC` added by TMA reductions into the head's group's rows (`[b, g, L, N]`)
    rather than stored per head (`dg_sums`, lean and `add` only: `dg` added into its group's
    chunk's `[Q, Q]` in `dB`'s place, `dC` without `dg B`: `group_scores.py`). `turns`: a tenth input, the angles `Θ` (`[b, h, L, A]`,
    float32), by which `dB` and `dC` leave turned back (`_turned_back`). `tiled`: a chunk of
    more than 64 positions, by tiles (`tiled.py`). `lean` (16-bit `B`, `C`; neither `turns` nor
    `tiled`; `P` 64): the state's low half in `M`'s tiles until `C S_inᵀ` has read it, and
    every result out through the float32 staging tiles in turn, block by block (`STAGES`,
    `_staged`)."""
    if tiled:
        return scan_bwd_tiled(refs[:-1], refs[-1], rep=rep, dtype=dtype, add=add, rows_of=rows_of)
    dy_ref, x_ref, dt_ref, cum_ref, f_ref, seg_ref, b_ref, c_ref, s_ref, *rest = refs
    theta_ref = rest.pop(0) if turns else None
    dx_ref, ddt_ref, dcum_ref, dcum_row_ref, df_ref, db_ref, dc_ref, ds_ref, scoped = rest
    if lean:
        (c_smem, b_smem, x_smem, sh_smem, ah_smem, al_smem, mh_smem, ml_smem, *stages, vec_smem), loaded = (
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
    copies = _copy_chunk_in(
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
    sh, sl = _halves(state, dtype)
    sh_smem[...] = sh
    lows = (mh_smem, ml_smem)[: n // q] if lean else ()
    for j, tile in enumerate(lows):
        tile[...] = sl[:, j * q : (j + 1) * q]
    if not lean:
        sl_smem[...] = sl
    ah_smem[...], al_smem[...] = _halves(dy, dtype)
    plgpu.commit_smem()
    for i in range(copies):
        plgpu.barrier_wait(loaded.at[i])

    def put(smem, value, ref, reduction_op=None, turn=None):
        """`value` out through `smem` by TMA (the copy left in flight), turned back by `turn`
        (`cos Θ`, `sin Θ`) where given."""
        smem[...] = value
        if turn is not None:
            _turned_back(smem, *turn)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, ref, reduction_op=reduction_op)

    per_group = (batch, group, rows) if add else (batch, head, rows)
    summed = "add" if add else None
    send = _staged(stages) if lean else None

    # each result leaves as soon as it is formed (fewer registers live at once): df first
    # C S_inᵀ (the lean form's low half by blocks of 64 of C's columns)
    low = [(cs[0].at[:, pl.ds(j * q, q)], tile, True) for j, tile in enumerate(lows)]
    inc = _products((q, p), pairs(cs, s_parts, True) + low)
    vec_smem.at[2][...] = jnp.sum(dy * inc, axis=1)  # df

    # scores and decay, rows t by columns s
    scores = _products((q, q), pairs(cs, bs, True))
    decay, on_cols = _decay(cum_t, cum_s, seg_t, seg_s)
    m = scores * decay
    mh, ml = _halves(m, dtype)
    mh_smem[...], ml_smem[...] = mh, ml
    plgpu.commit_smem()

    # dM = dy (dt ∘ x)ᵀ: dy's halves (registers, formed again here) times xᵀ, scaled by dt per
    # column; a 16-bit dy's low half is 0, so its products are left out (and below)
    wide_dy = jnp.dtype(dy_ref.dtype).itemsize > 2
    dyh, dyl = _halves(dy, dtype)
    dm = _products((q, q), [(dyh, x_smem, True)] + [(dyl, x_smem, True)] * wide_dy) * on_cols(dt_s)
    e = dm * m
    vec_smem.at[1][...] = jnp.sum(e, axis=1)  # dcum: rows t
    vec_smem.at[3][...] = jnp.sum(e, axis=0)  # dcum_row: columns s
    dg = dm * decay
    if dg_sums:
        send(dg, lambda r, cols: db_ref.at[batch, group, chunk, pl.ds(r, CHUNK), cols], "add")

    # d(dt ∘ x) = Mᵀ dy, rows s: M's halves transposed from shared memory, dy's halves
    m_t = (mh_smem.transpose((1, 0)), ml_smem.transpose((1, 0)))
    low = [(m_t[0], al_smem, False)] * wide_dy
    dxd = _products((q, p), [(m_t[0], ah_smem, False), *low, (m_t[1], ah_smem, False)])
    x = mosaic_gpu_load(rows_of(x_ref, batch, head, rows), layout=wgmma_layout, optimized=False).astype(f32)
    vec_smem.at[0][...] = jnp.sum(dxd * x, axis=1)  # ddt
    dx = dxd * lax.broadcast_in_dim(dt_t, (q, p), [0])
    if lean:
        send(dx, lambda r, cols: rows_of(dx_ref, batch, head, rows, cols))
    else:
        put(dx_smem, dx, rows_of(dx_ref, batch, head, rows))

    # dg's halves take M's place in shared memory and f ∘ dy's take dy's (their products are done)
    if not dg_sums:
        mh_smem[...], ml_smem[...] = _halves(dg, dtype)
    ah_smem[...], al_smem[...] = _halves(dy * lax.broadcast_in_dim(f_t, (q, p), [0]), dtype)
    plgpu.commit_smem()
    # the angles read while the products below run
    theta = None if theta_ref is None else _angles(theta_ref, batch, head, rows)
    # dS_in = (f ∘ dy)ᵀ C
    ds = _products((p, n), pairs((ah_smem.transpose((1, 0)), al_smem.transpose((1, 0))), cs))
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
    dc = _products((q, n), ([] if dg_sums else pairs((mh_smem, ml_smem), bs)) + fs)
    if lean:
        send(dc, lambda r, cols: dc_ref.at[(*per_group, cols)], summed)
        if not dg_sums:
            db = _products((q, n), pairs((mh_smem.transpose((1, 0)), ml_smem.transpose((1, 0))), cs))
            send(db, lambda r, cols: db_ref.at[(*per_group, cols)], summed)
    else:
        turn = None if theta is None else (jnp.cos(theta), jnp.sin(theta))
        put(dbc_smem, dc, dc_ref.at[per_group], summed, turn)
        db = _products((q, n), pairs((mh_smem.transpose((1, 0)), ml_smem.transpose((1, 0))), cs))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dC has left the staging tile
        put(dbc_smem, db, db_ref.at[per_group], summed, turn)
    for i, ref in enumerate((ddt_ref, dcum_ref, df_ref, dcum_row_ref)):
        plgpu.copy_smem_to_gmem(vec_smem.at[i], ref.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)


def _staged(stages):
    """`send(value, dst, reduction_op=None)`: a result in registers (`[R, C]`, WGMMA layout, `R`
    a multiple of 64, `C` of the tiles' width) out by TMA through the staging tiles `stages`
    (`[64, W]` each) in turn, block by block, `dst(r, cols)` the gmem view of the block at row
    `r` and columns `cols`. Before a tile is written again, the copies but the last `len(stages)
    - 1` have read their tiles (the copy that read it is among them), so that a block's store
    overlaps the copies of the blocks before it; the tiles are free when `send` is made (the
    caller waited) and the last copies left in flight."""
    sent = []
    width = stages[0].shape[1]

    def send(value, dst, reduction_op=None):
        rows, cols = value.shape
        for r in range(0, rows, CHUNK):
            for c in range(0, cols, width):
                tile = stages[len(sent) % len(stages)]
                if len(sent) >= len(stages):
                    plgpu.wait_smem_to_gmem(len(stages) - 1, wait_read_only=True)
                tile[...] = value[r : r + CHUNK, c : c + width]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(tile, dst(r, pl.ds(c, width)), reduction_op=reduction_op)
                sent.append(None)

    return send


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
):
    """Stage 4's backward by the Mosaic GPU kernel: `(dx [b, h, L, P], ddt, dcum, dcum_row, df
    [b, h, L], dB, dC [b, h, L, N], dS_in [b, c, h, P, N])`, float32, per head, from the
    cotangent `dy [b, h, L, P]` (float32, or bf16 where the forward gave `y` so) and
    `chunk_scan`'s arguments (`B`, `C` bf16 or float32, as their `operand_parts`). `dcum` holds each row's sum of `dM ∘ M` and `dcum_row` each
    column's (`common/kernels.py`'s backward). `group_sums`:
    `dB`, `dC` per group (`[b, g, L, N]`), each head's tiles added by TMA reductions (the order
    of the additions, and so the last bits, may vary between runs). `theta` (`[b, h, L, A]`,
    float32, `A` a multiple of 32 at most `N/2`; `B`, `C` the values Mamba-3's rotation turned by it, `rotation.py`): `dB`, `dC` leave
    turned back by `-Θ` (the rotation's transpose; per head only). `chunk`: a multiple of 64
    (`dS_in [b, L / chunk, h, P, N]`); above 64 by tiles of 64 rows in two phases (`tiled.py`),
    without `theta`. `lean`: the kernel in less shared memory (`lean_reason`), the same
    arithmetic. `scores` (lean, `group_sums`): `dg` summed per group in `dB`'s place (`[b, g, c,
    Q, Q]`), `dC` without `dg B` (`group_scores.group_scores_grads` forms both)."""
    if scores and not (lean and group_sums):
        raise ValueError("chunk_scan_bwd: scores (dg summed per group) with lean and group_sums only")
    _check_angles("chunk_scan_bwd", theta, group_sums, xt, bt, positions_first)
    if theta is not None and chunk != CHUNK:
        raise ValueError(f"chunk_scan_bwd: theta (dB, dC turned back) at chunks of {CHUNK} only, not {chunk}")
    p, n = _dims(xt, positions_first)[3], operand_parts(bt)[0].shape[-1]
    reason = lean and lean_reason(len(operand_parts(bt)), chunk, theta is not None, p, n)
    if reason:
        raise ValueError(f"chunk_scan_bwd: lean: {reason}")
    args = (dy, xt, dt, cum, f, seg, bt, ct, states_in) + (() if theta is None else (theta,))
    kw = dict(group_sums=group_sums, positions_first=positions_first, chunk=chunk, lean=lean, scores=scores)
    body = functools.partial(_chunk_scan_bwd, **kw)
    return _batch_folding(body)(*args) if group_sums else body(*args)


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
    return lean_reason(1, p=p, n=n) is None and blocks_per_sm(_tiles("scan_bwd_lean", p, n)) >= 2


def _chunk_scan_bwd(*args, group_sums, positions_first, chunk, lean=False, scores=False):
    dy, xt, dt, cum, f, seg, bt, ct, states_in, *theta = args
    bt, ct = operand_parts(bt), operand_parts(ct)
    _check_operands(xt, bt, ct, positions_first=positions_first, chunk=chunk)
    b, h, lp, p = _dims(xt, positions_first)
    _check_tiles("scan_bwd", p, bt, chunk)
    g, n, f32 = bt[0].shape[1], bt[0].shape[-1], jnp.float32
    vector = jax.ShapeDtypeStruct((b, h, lp), f32)
    states = jax.ShapeDtypeStruct((b, lp // chunk, h, p, n), f32)
    bc = jax.ShapeDtypeStruct((b, g if group_sums else h, lp, n), f32)
    dg = jax.ShapeDtypeStruct((b, g, lp // chunk, chunk, chunk), f32)  # (`scores`: in dB's place)
    out = (
        _rows_type(b, h, lp, p, positions_first),
        vector,
        vector,
        vector,
        vector,
        dg if scores else bc,
        bc,
        states,
    )
    dy = dy if dy.dtype == xt.dtype else dy.astype(f32)  # as the forward gave y: bf16 or float32
    args = [dy, xt, dt, cum, f, seg.astype(jnp.int32), bt, ct, states_in, *theta]
    into = {5: 9, 6: 10} if group_sums else None
    if group_sums:
        args += [jnp.zeros(out[5].shape, f32), jnp.zeros(bc.shape, f32)]
    barrier = plgpu.Barrier(num_barriers=len(bt) + len(ct) + 1)
    launch = _launch(
        "scan_bwd_lean" if lean else "scan_bwd",
        _scan_bwd_kernel,
        out,
        xt,
        bt,
        barrier,
        into=into,
        positions_first=positions_first,
        turns=bool(theta),
        rows=chunk,
        **({"tiled": True} if chunk != CHUNK else {}),
        **({"lean": True} if lean else {}),
        **({"dg_sums": True} if scores else {}),
    )
    return launch(*args)


def _state_bwd_kernel(*refs, rep, dtype, add, rows_of, adds_dx, turns=False, blocks=1):
    """`add`: `dB` added by a TMA reduction into the head's group's rows (`[b, g, L, N]`).
    `adds_dx`: a fifth input, the scan's backward's float32 `dx`, added to this `dx` before it
    is rounded to the output's dtype. `turns`: one more input, the angles `Θ`, by which `dB`
    leaves turned back (`_turned_back`). `blocks`: the blocks a chunk's rows take (chunks of
    `64 · blocks`; each block its 64 rows, the chunk's `dS` read by each: the gradients are row
    by row)."""
    x_ref, w_ref, b_ref, ds_ref, *rest = refs
    dx_in_ref = rest.pop(0) if adds_dx else None
    theta_ref = rest.pop(0) if turns else None
    dx_ref, dw_ref, db_ref, scoped = rest
    (b_smem, dsh_smem, dsl_smem, dx_smem, db_smem, dw_smem), loaded = scoped
    batch, head, block = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("chunks")
    chunk = block if blocks == 1 else lax.div(block, jnp.int32(blocks))
    q = b_smem.shape[1]
    rows = pl.ds(block * q, q)
    bs = parts_of(b_smem)
    copies = _part_copies(b_ref, bs, batch, lax.div(head, jnp.int32(rep)), rows)
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])
    f32, wgmma_layout = jnp.float32, plgpu.Layout.WGMMA
    # dS (float32) as two 16-bit halves in shared memory; w ∘ x's halves in registers
    dsh, dsl = _halves(
        mosaic_gpu_load(ds_ref.at[batch, chunk, head], layout=wgmma_layout, optimized=False), dtype
    )
    dsh_smem[...], dsl_smem[...] = dsh, dsl
    x = mosaic_gpu_load(rows_of(x_ref, batch, head, rows), layout=wgmma_layout, optimized=False).astype(f32)
    w = mosaic_gpu_load(w_ref.at[batch, head, rows], layout=wgmma_layout.reduce(1), optimized=False)
    xw_h, xw_l = _halves(x * lax.broadcast_in_dim(w, x.shape, [0]), dtype)
    plgpu.commit_smem()
    for i in range(len(copies)):
        plgpu.barrier_wait(loaded.at[i])

    staging = (dx_smem, db_smem, dw_smem)
    dx_in = None
    if adds_dx:
        dx_in = mosaic_gpu_load(rows_of(dx_in_ref, batch, head, rows), layout=wgmma_layout, optimized=False)
    theta = None if theta_ref is None else _angles(theta_ref, batch, head, rows)
    _state_grads(bs, (dsh_smem, dsl_smem), x, w, (xw_h, xw_l), staging, dx_in, theta)
    group = lax.div(head, jnp.int32(rep)) if add else head
    dsts = (rows_of(dx_ref, batch, head, rows), db_ref.at[batch, group, rows], dw_ref.at[batch, head, rows])
    _send_state_grads(staging, dsts, add=add)
    plgpu.wait_smem_to_gmem(0)


def _state_grads(bs, ds, x, w, xw, staging, dx_in=None, theta=None):
    """The chunk state's gradients from `dS`'s halves `ds` (shared memory), `B`'s parts `bs`
    (shared memory),
    `x`, `w` and `w ∘ x`'s halves `xw` (registers), into the staging tiles `(dx, dB, dw)`:
    `d(w ∘ x) = B dSᵀ` (rows t), `dx = · w` (plus `dx_in`, float32 registers, if given; in the
    staging tile's dtype), `dw = rowsum(· x)`; `dB = (w ∘ x) dS`, three products of halves (one
    of the high halves where `rounds_once`), turned back by the angles `theta` (registers) where
    given."""
    dx_smem, db_smem, dw_smem = staging
    (q, n), p = bs[0].shape, ds[0].shape[0]
    dxw = _products((q, p), pairs(bs, ds, True))
    dx = dxw * lax.broadcast_in_dim(w, (q, p), [0])
    dx_smem[...] = (dx if dx_in is None else dx + dx_in).astype(dx_smem.dtype)
    dw_smem[...] = jnp.sum(dxw * x, axis=1)
    db_smem[...] = _products((q, n), pairs(xw[:1], ds[:1]) if rounds_once(len(bs)) else pairs(xw, ds))
    if theta is not None:
        _turned_back(db_smem, jnp.cos(theta), jnp.sin(theta))
    plgpu.commit_smem()


def _send_state_grads(staging, dsts, *, add):
    """`(dx, dB, dw)` out of their staging tiles by TMA to `dsts`, `dB` added (`add`: a group's
    rows) or stored (the copies left in flight)."""
    for i, (smem, dst) in enumerate(zip(staging, dsts, strict=True)):
        plgpu.copy_smem_to_gmem(smem, dst, reduction_op="add" if add and i == 1 else None)


def chunk_state_bwd(
    xt, w, bt, d_own, dx_in=None, *, group_sums=False, positions_first=False, theta=None, chunk=CHUNK
):
    """Stage 2's backward by the Mosaic GPU kernel, `dS` (`d_own [b, c, h, P, N]`, float32)
    pulled back through `S = (w ∘ x)ᵀ B`: `(dx [b, h, L, P], dw [b, h, L], dB [b, h, L, N])`,
    float32, per head; `chunk_state`'s other arguments (`B` bf16 or float32). `dx_in` (float32, `x`'s layout; the
    scan's backward's `dx`): added to `dx` in the kernel, which then leaves in `x`'s dtype.
    `group_sums`: `dB` per group (`[b, g, L, N]`) by TMA reductions, as in `chunk_scan_bwd`.
    `theta`: `dB` turned back by `-Θ`, as in `chunk_scan_bwd`. `chunk`: a multiple of 64
    (`d_own [b, L / chunk, h, P, N]`), a block per 64 rows whatever the chunk."""
    _check_angles("chunk_state_bwd", theta, group_sums, xt, bt, positions_first)
    body = functools.partial(
        _chunk_state_bwd,
        group_sums=group_sums,
        positions_first=positions_first,
        turns=theta is not None,
        chunk=chunk,
    )
    args = (xt, w, bt, d_own) + (() if dx_in is None else (dx_in.astype(jnp.float32),))
    args += () if theta is None else (theta,)
    return _batch_folding(body)(*args) if group_sums else body(*args)


def _chunk_state_bwd(xt, w, bt, d_own, *more, group_sums, positions_first, turns, chunk):
    dx_in = more[: len(more) - turns]
    bt = operand_parts(bt)
    _check_operands(xt, bt, positions_first=positions_first, chunk=chunk)
    b, h, lp, p = _dims(xt, positions_first)
    f32, rows = jnp.float32, xt.dtype if dx_in else jnp.float32
    db = jax.ShapeDtypeStruct((b, bt[0].shape[1] if group_sums else h, lp, bt[0].shape[-1]), f32)
    out = (_rows_type(b, h, lp, p, positions_first, rows), jax.ShapeDtypeStruct((b, h, lp), f32), db)
    args = [xt, w, bt, d_own, *more] + ([jnp.zeros(db.shape, f32)] if group_sums else [])
    into = {2: len(args) - 1} if group_sums else None
    kw = dict(into=into, positions_first=positions_first, rows_dtype=rows, adds_dx=bool(dx_in), turns=turns)
    if chunk != CHUNK:
        kw["blocks"] = chunk // CHUNK
    barrier = plgpu.Barrier(num_barriers=len(bt))
    return _launch("state_bwd", _state_bwd_kernel, out, xt, bt, barrier, **kw)(*args)


def _batch_folding(fn):
    """`fn`, whose arrays (arguments and results) all lead with the batch axis, under `vmap` by
    folding the mapped axis into the batch axis: the group sums' `pl.kernel` over refs (for its
    in-place outputs) batches only a mapped axis of size 1, where `plgpu.kernel` batches any."""
    folded = jax.custom_batching.custom_vmap(fn)

    @folded.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [
            a if bat else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, bat in zip(args, in_batched, strict=True)
        ]
        outs = folded(*(a.reshape(axis_size * a.shape[1], *a.shape[2:]) for a in args))
        outs = jax.tree.map(lambda o: o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return folded
