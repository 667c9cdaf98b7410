"""The forward kernel (`forward`): grid, ring, ping-pong and math in `__init__`'s docstring."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core.blocks import cdiv
from axkern.core.kernels import swizzled_smem
from axkern.core.op import Unsupported

from .. import common
from ..blocks import MOSAIC_GPU_SMEM, mosaic_gpu_smem_bytes
from .schedules import COMPUTE_WGS, CTA_HI, CTA_LO, LIST, lower, operands, schedule_table
from .tiles import (
    LOG2E,
    NAMED_BARRIER_BASE,
    NAMED_BARRIERS,
    NAMED_RELEASE_BASE,
    TileMask,
    _Cfg,
    _entry_of,
    _iota,
    _stream_kv,
    base2_scores,
    named_barrier,
    pl,
    plgpu,
    tile_of,
    times,
    warpgroup_bounds,
)


def _check_blocks(block_q, block_kv, stages, d):
    if block_q not in (64, 128):
        raise Unsupported(f"block_q={block_q}: the Mosaic GPU kernel takes 64 or 128 rows per warpgroup")
    if block_kv not in (64, 128, 256):
        raise Unsupported(f"block_kv={block_kv}: the Mosaic GPU kernel takes 64, 128 or 256")
    # one stage would deadlock here (unlike the backward kernels): a warpgroup waiting for a value
    # tile the producer cannot load until the other, itself waiting its turn, releases the slot
    if not 2 <= stages <= 4:
        raise Unsupported(f"num_stages={stages}: the Mosaic GPU kernel's ring holds 2 to 4 tiles")
    need = mosaic_gpu_smem_bytes(block_q, block_kv, stages, d)
    if need > MOSAIC_GPU_SMEM:
        raise Unsupported(
            f"block_q={block_q}, block_kv={block_kv}, num_stages={stages} at head dim {d} need {need} bytes "
            f"of shared memory, more than {MOSAIC_GPU_SMEM}"
        )


def _check(mask, block_q, block_kv, stages, d):
    """`Unsupported` for block sizes or a mask the kernel cannot take."""
    _check_blocks(block_q, block_kv, stages, d)
    lower(mask)  # raises for a mask the kernels cannot evaluate on a tile


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    sched_ref,
    sinks_ref,
    mask_refs,
    out_ref,
    lse_ref,
    lo_ref,
    scoped,
    *,
    cfg,
    mask,
    dtype,
    handoff,
    nan_scores,
    named_barriers=False,
    named_releases=False,
    lean=False,
    overlap=False,
):
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
    d = q_ref.shape[-1]
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    cta = cfg.blocks - 1 - lax.axis_index("q_seq")  # heaviest causal rows first
    wg = lax.axis_index("wg")
    (qo_smem2, k_smem, v_smem, lse_smem2), loaded, consumed, sched_barrier = scoped
    k_loaded, v_loaded, q_loaded = loaded
    k_consumed, v_consumed = consumed
    at = _entry_of(sched_ref, batch, cfg)
    clo, chi = at(cta, CTA_LO), at(cta, CTA_HI)
    tile = tile_of(at, cta, cfg)  # the key tile of step t (the loops below run over steps)
    slot_of = lambda t: lax.rem(t - clo, jnp.int32(stages))  # noqa: E731

    # The ping-pong between the two compute warpgroups, in one of two forms. Rendezvous (JAX's
    # kernel): one barrier both warpgroups arrive at and wait on, after issuing `q kᵀ` and before
    # `p v`. Handoff (FA3's, tokamax's; `handoff=True`): a barrier per warpgroup; after issuing
    # `q kᵀ` a warpgroup only signals the other's (it goes on to its softmax at once), and before
    # `p v` it waits on its own, which the other signals after issuing its `q kᵀ`. Every
    # warpgroup walks the same tiles `[clo, chi)` (its own or released), so the signals pair up,
    # and a warpgroup is never more than one signal ahead of the other's waits (which the
    # handoff on hardware named barriers, `named_barriers`, needs: an arrive there is counted,
    # not queued).
    def rendezvous():
        plgpu.barrier_arrive(sched_barrier)
        plgpu.barrier_wait(sched_barrier)

    def signal():  # after issuing q kᵀ
        if named_barriers:
            named_barrier("arrive", NAMED_BARRIER_BASE + 1 - wg, threads=COMPUTE_WGS * 128)
        elif handoff:
            plgpu.barrier_arrive(sched_barrier.at[1 - wg])
        else:
            rendezvous()

    def wait_own():  # the handoff: until the other warpgroup has signalled this one
        if named_barriers:
            named_barrier("sync", NAMED_BARRIER_BASE + wg, threads=COMPUTE_WGS * 128)
        else:
            plgpu.barrier_wait(sched_barrier.at[wg])

    def await_turn(slot):  # before p v: its value tile, and the tensor cores ours again
        if not handoff:
            plgpu.barrier_arrive(sched_barrier)
        plgpu.barrier_wait(v_loaded.at[slot])
        if handoff:
            wait_own()
        else:
            plgpu.barrier_wait(sched_barrier)

    def free(which, slot):  # this warpgroup is done with the slot's key (0) or value (1) tile
        if named_releases:
            index = NAMED_RELEASE_BASE + which * stages + slot
            named_barrier("arrive", index, threads=COMPUTE_WGS * 128 + 128)
        else:
            plgpu.barrier_arrive((k_consumed, v_consumed)[which].at[slot])

    def skip_turn():  # a step's pair where a warpgroup runs no products (a released tile)
        if handoff:
            signal()
            wait_own()
        else:
            rendezvous()
            rendezvous()

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
        lo, flo, fhi, hi = warpgroup_bounds(at, cta, wg)
        q_base = (cta * COMPUTE_WGS + wg) * bq
        tile_mask = TileMask(mask, mask_refs, batch, q_base, bq)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), head], qo_smem, q_loaded.at[wg])
        plgpu.barrier_wait(q_loaded.at[wg])
        row = plgpu.Layout.WGMMA.reduce(1)
        m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row)
        l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row)
        acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)

        def wait_next(t):  # each step starts with its key tile waited for
            @pl.when(t + 1 < chi)
            def _():
                plgpu.barrier_wait(k_loaded.at[slot_of(t + 1)])

        @pl.when(chi > clo)
        def _():
            plgpu.barrier_wait(k_loaded.at[0])

        if handoff:  # the first turn is warpgroup 0's
            pl.when(wg == 1)(wait_own)
        else:
            pl.when(wg == 1)(rendezvous)

        def key_offset(t, masked):  # a masked step's first key, read before its scores wait
            return tile(t) * bk if masked else None

        def probs(s, m_i, k0, masked):
            """`(m_new, alpha, p)` of the scores `s` (float32, unscaled) of the tile whose keys
            start at `k0`: the new running max, the factor that rescales what came before, the
            probabilities in base 2."""
            if nan_scores:  # a non-finite score is NaN (before a soft cap's tanh): its row's output is
                s = jnp.where(jnp.abs(s) < jnp.inf, s, jnp.nan)
            s, c, _ = base2_scores(s, cfg)  # s · c in base-2 units
            if masked:
                iota = functools.partial(_iota, (bq, bk))
                qi, kj = q_base + iota(0), k0 + iota(1)
                vis = tile_mask.visible(qi, kj, k0, bk, cfg.sk if cfg.sk % bk else None)
                if vis is not None:
                    s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m_i, times(s.max(axis=1), c))
            # a row that has seen no key yet keeps m = -inf; only masked tiles can leave it so
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(times(s, c) - lax.broadcast_in_dim(m_use, s.shape, [0]))
            return m_new, alpha, p

        def scores(slot):
            """`q kᵀ` of the key tile in `slot` alone (the other warpgroup signalled once it is
            issued), then the slot's key tile released."""

            def qk_product(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                signal()
                return acc_ref[...]

            s = pl.run_scoped(qk_product, plgpu.ACC((bq, bk), jnp.float32))
            free(0, slot)
            return s

        def step(t, carry, masked):
            acc, m_i, l_i = carry
            slot, k0 = slot_of(t), key_offset(t, masked)
            m_new, alpha, p = probs(scores(slot), m_i, k0, masked)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha
            p16 = p.astype(dtype)

            def end_softmax():
                await_turn(slot)

            if d <= 128:  # this order measured faster in JAX's kernel for small head dims
                l_i = l_i + p.sum(axis=1)
                acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                end_softmax()
            else:
                end_softmax()
                l_i = l_i + p.sum(axis=1)

            def pv_product(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                wait_next(t)

            acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
            free(1, slot)
            return acc, m_new, l_i

        def release(t, carry):  # a tile only the other warpgroup needs: keep the ring turning
            slot = slot_of(t)
            free(0, slot)
            plgpu.barrier_wait(v_loaded.at[slot])
            free(1, slot)
            skip_turn()
            wait_next(t)
            return carry

        # `overlap` (FA3's overlap inside a warpgroup, with the handoff): a turn issues tile t's
        # q kᵀ and then the previous tile's p v, signals the other warpgroup, waits for q kᵀ
        # alone and runs tile t's softmax while p v still runs; the accumulator is rescaled once
        # that p v is done, tile t's value tile is waited for (its p v is next turn's) and the
        # warpgroup waits for its next turn: each tile's turn a signal then a wait, as the
        # default's, and the same sums in the same order, one turn later. The first computed
        # tile's turn has q kᵀ alone (masked: it may be a full tile); one more turn after the
        # computed tiles runs the last p v (every warpgroup takes it, so both walk the same
        # number of turns), before the released tiles after them, as the producer may need
        # that value tile's slot for one of theirs.
        def first_turn(carry):
            acc, m_i, l_i, p16 = carry
            slot, k0 = slot_of(lo), key_offset(lo, True)
            m_new, alpha, p = probs(scores(slot), m_i, k0, True)  # (the accumulator is still zeros)
            plgpu.barrier_wait(v_loaded.at[slot])
            wait_next(lo)
            wait_own()
            return acc, m_new, l_i * alpha + p.sum(axis=1), p.astype(dtype)

        def ostep(t, carry, masked):
            acc, m_i, l_i, p16 = carry
            slot, pslot, k0 = slot_of(t), slot_of(t - 1), key_offset(t, masked)

            def body(refs):
                acc_ref, m_ref, l_ref, p_ref, alpha_ref = refs

                def products(s_ref):
                    plgpu.wgmma(s_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(acc_ref, p16, v_smem.at[pslot])
                    signal()
                    return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # q kᵀ only

                s = pl.run_scoped(products, plgpu.ACC((bq, bk), jnp.float32))
                free(0, slot)
                m_new, alpha, p = probs(s, m_i, k0, masked)
                m_ref[...] = m_new
                l_ref[...] = l_i * alpha + p.sum(axis=1)
                p_ref[...] = p.astype(dtype)
                alpha_ref[...] = alpha

            acc, m_new, l_i, p16, alpha = pl.run_state(body)((plgpu.ACC.init(acc), m_i, l_i, p16, m_i))
            free(1, pslot)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_loaded.at[slot])  # this tile's values, multiplied next turn
            wait_next(t)
            wait_own()
            return acc, m_new, l_i, p16

        def last_turn(carry):
            acc, m_i, l_i, p16 = carry
            pslot = slot_of(hi - 1)

            def with_pv(acc):
                def body(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[pslot])
                    signal()

                acc = pl.run_state(body)(plgpu.ACC.init(acc))
                free(1, pslot)
                return acc

            def without(acc):
                signal()
                return acc

            acc = lax.cond(hi > lo, with_pv, without, acc)
            wait_own()
            return acc, m_i, l_i

        lax.fori_loop(clo, lo, release, None)
        if overlap:
            zeros16 = plgpu.layout_cast(jnp.zeros((bq, bk), dtype), plgpu.Layout.WGMMA)
            carry = lax.cond(hi > lo, first_turn, lambda c: c, (acc, m_i, l_i, zeros16))
            after = lo + 1  # the tiles after the first: [lo + 1, flo), then the full run, then the rest
            carry = lax.fori_loop(after, flo, functools.partial(ostep, masked=True), carry)
            carry = lax.fori_loop(jnp.maximum(flo, after), fhi, functools.partial(ostep, masked=False), carry)
            carry = lax.fori_loop(jnp.maximum(fhi, after), hi, functools.partial(ostep, masked=True), carry)
            carry = last_turn(carry)
        else:
            carry = (acc, m_i, l_i)
            carry = lax.fori_loop(lo, flo, functools.partial(step, masked=True), carry)
            carry = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), carry)
        lax.fori_loop(hi, chi, release, None)
        acc, m_i, l_i = carry
        pl.when(wg == 0)(signal)  # warpgroup 1's last turn
        if cfg.sinks:  # one more logit in the denominator, with no value
            sink = sinks_ref[head] * LOG2E
            m_f = jnp.maximum(m_i, sink)
            m_f = jnp.where(m_f == -jnp.inf, 0.0, m_f)
            alpha = jnp.exp2(m_i - m_f)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + jnp.exp2(sink - m_f)
            m_i = m_f

        # a row that saw no key (and no sink) has l = 0: output 0, lse -inf; with `nan_scores` a
        # NaN sum stays NaN in both (without, the guard keeps non-finite scores away)
        seen = l_i != 0.0 if nan_scores else l_i > 0.0  # (!= is true for NaN)
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
        acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        lse = jnp.where(seen, m_i * math.log(2.0) + jnp.log(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        if lo_ref is not None:  # what rounding lost: `out + lo` is the output to about 16 bits more
            out, lo = common.rounding_lost(acc, dtype)
        else:
            out = acc.astype(dtype)
        qo_smem[...] = out
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_base, bq), head])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_base, bq)])
        # `lean`: wait only for the copies to have read shared memory (all the tile's reuse and
        # the block's exit need), not for their writes to land
        plgpu.wait_smem_to_gmem(0, wait_read_only=lean)
        if lo_ref is not None:  # through the same tile, once the output has left it
            qo_smem[...] = lo
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, lo_ref.at[batch, pl.ds(q_base, bq), head])
            plgpu.wait_smem_to_gmem(0, wait_read_only=lean)

    ring = (k_smem, v_smem, (k_loaded, v_loaded), (k_consumed, v_consumed))
    pl.when(wg == COMPUTE_WGS)(
        functools.partial(
            _stream_kv, cfg, (batch, head, clo, chi, tile), k_ref, v_ref, *ring, named_releases=named_releases
        )
    )


def forward(
    q,
    k,
    v,
    mask,
    *,
    scale,
    block_q,
    block_kv,
    num_stages,
    sinks=None,
    logits_soft_cap=None,
    handoff=False,
    nan_scores=False,
    named_barriers=False,
    named_releases=False,
    lean=False,
    overlap=False,
    out_lo=False,
    q_major=False,
):
    """`(out [B, Sq, H, D], lse [B, H, Sq] float32)` of the Mosaic GPU kernel; `sinks [H]`
    join the denominator (and `lse`). `out_lo=True` adds a third output, `lo [B, Sq, H, D]`:
    the float32 output less `out`, in `out`'s dtype (for the sinks' cotangent, whose sum over
    the rows of `out · d_out` the rounding of `out` alone would put off by about 2⁻⁹ relative
    per term). The forms (the package's docstring has their timings): `handoff`, the compute
    warpgroups' ping-pong as FA3's handoff rather than JAX's rendezvous (`_kernel`); `overlap`
    (with `handoff`), FA3's softmax of one tile under the previous tile's `p v` in the same warpgroup;
    `nan_scores`, every visible score that is not finite made NaN, so its row's output and
    `lse` are NaN (the part of the non-finite rule that `q` and `k` need: a non-finite `v` of a
    masked key still reaches rows through `0 · NaN`, so the guard stays); `named_barriers`
    (with `handoff`), the handoff's signals on hardware named barriers (`bar.arrive` /
    `bar.sync`, as tokamax's kernel) rather than shared-memory mbarriers; `named_releases`, the
    ring's slots released to the producer on named barriers too (`tiles._stream_kv`); `lean`,
    the epilogue waiting only for its copies to have read shared memory and no shared memory
    kept for cross-warp reductions (the forward's are within a warp); `q_major`, the grid's query
    blocks launched fastest rather than its heads (docs/ops/attention.md has its timing)."""
    if (named_barriers or overlap) and not handoff:
        raise ValueError(
            "named_barriers=True and overlap=True are forms of the handoff: pass handoff=True too"
        )
    if named_releases and NAMED_RELEASE_BASE + 2 * num_stages > NAMED_BARRIERS:
        raise ValueError(
            f"named_releases=True takes at most {(NAMED_BARRIERS - NAMED_RELEASE_BASE) // 2} stages"
        )
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    _check(mask, block_q, block_kv, num_stages, d)
    lowered, leaves = lower(mask)
    sqp, skp = cdiv(sq, COMPUTE_WGS * block_q) * COMPUTE_WGS * block_q, cdiv(sk, block_kv) * block_kv
    table = schedule_table(mask, sq, sk, block_q, block_kv, b)
    mask_ops = operands(leaves, b, sqp, skp)
    sink_arr = jnp.zeros((h,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    pad = lambda a, n: a if a.shape[1] == n else jnp.pad(a, [(0, 0), (0, n - a.shape[1]), (0, 0), (0, 0)])  # noqa: E731
    qp, kp, vp = pad(q, sqp), pad(k, skp), pad(v, skp)
    blocks = sqp // (COMPUTE_WGS * block_q)
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    cfg = _Cfg(
        block_q,
        block_kv,
        num_stages,
        float(scale),
        sq,
        sk,
        h // kvh,
        blocks,
        bool(leaves),
        cap,
        sinks is not None,
        tiles=table.shape[-1] > LIST,
    )
    body = functools.partial(
        _kernel,
        cfg=cfg,
        mask=lowered,
        dtype=q.dtype,
        handoff=handoff,
        nan_scores=nan_scores,
        named_barriers=named_barriers,
        named_releases=named_releases,
        lean=lean,
        overlap=overlap,
    )

    def entry(*refs):
        *refs, out_ref, lse_ref, lo_ref = refs if out_lo else (*refs, None)
        q_ref, k_ref, v_ref, sched_ref, sinks_ref, *mask_refs = refs
        scratch = [
            swizzled_smem((COMPUTE_WGS, block_q, d), q.dtype),
            swizzled_smem((num_stages, block_kv, d), q.dtype),
            swizzled_smem((num_stages, block_kv, d), q.dtype),
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
        ]
        pl.run_scoped(
            lambda *scoped: body(
                q_ref, k_ref, v_ref, sched_ref, sinks_ref, tuple(mask_refs), out_ref, lse_ref, lo_ref, scoped
            ),
            scratch,
            (
                plgpu.Barrier(num_barriers=num_stages),
                plgpu.Barrier(num_barriers=num_stages),
                plgpu.Barrier(num_barriers=COMPUTE_WGS),
            ),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=num_stages),) * 2,
            plgpu.Barrier(num_barriers=COMPUTE_WGS) if handoff else plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    out_type = [jax.ShapeDtypeStruct((b, sqp, h, d), q.dtype), jax.ShapeDtypeStruct((b, h, sqp), jnp.float32)]
    outs = plgpu.kernel(
        entry,
        out_type=out_type + out_type[:1] if out_lo else out_type,
        # the grid's first axis is the one the GPU launches fastest: heads, or (`q_major`) query
        # blocks, so that the blocks running at once share a head's keys and values in L2 (not
        # faster on the H200: docs/ops/attention.md)
        grid=(blocks, h, b) if q_major else (h, blocks, b),
        grid_names=("q_seq", "heads", "batch") if q_major else ("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **({"reduction_scratch_bytes": 0} if lean else {})
        ),
        kernel_name="axkern_attention_mosaic_gpu_fwd",
    )(qp, kp, vp, table, sink_arr, *mask_ops)
    out, lse, *lo = outs
    return (out[:, :sq], lse[:, :, :sq], *(a[:, :sq] for a in lo))
