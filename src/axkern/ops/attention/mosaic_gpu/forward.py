"""The forward kernel and its launch (`forward`): grid, ring, ping-pong and math in `__init__`'s
docstring; `check_tiles` refuses the tiles it cannot take."""

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
    KernelConfig,
    TileMask,
    base2_scores,
    iota,
    pl,
    plgpu,
    stream_kv,
    table_reader,
    tile_of,
    times,
    warpgroup_bounds,
)


def check_tiles(block_q, block_kv, stages, d):
    """`Unsupported` for forward tiles the kernel cannot take, or that outgrow shared memory."""
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
    overlap,
):
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
    d = q_ref.shape[-1]
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    cta = cfg.blocks - 1 - lax.axis_index("q_seq")  # heaviest causal rows first
    wg = lax.axis_index("wg")
    (qo_smem2, k_smem, v_smem, lse_smem2), loaded, consumed, sched_barrier = scoped
    k_loaded, v_loaded, q_loaded = loaded
    k_consumed, v_consumed = consumed
    at = table_reader(sched_ref, batch, cfg)
    clo, chi = at(cta, CTA_LO), at(cta, CTA_HI)
    tile = tile_of(at, cta, cfg)  # the key tile of step t (the loops below run over steps)
    slot_of = lambda t: lax.rem(t - clo, jnp.int32(stages))  # noqa: E731

    # The ping-pong between the two compute warpgroups, in one of two forms. Rendezvous (JAX's
    # kernel): one barrier both warpgroups arrive at and wait on, after issuing `q kᵀ` and before
    # `p v`. The overlap (FA3's; `overlap=True`) hands the tensor cores over on a barrier per
    # warpgroup: after issuing its products a warpgroup only signals the other's (it goes on to
    # its softmax at once), and before its next products it waits on its own, which the other
    # signals after issuing its own. Every warpgroup walks the same tiles `[clo, chi)` (its own
    # or released), so the signals pair up.
    def rendezvous():
        plgpu.barrier_arrive(sched_barrier)
        plgpu.barrier_wait(sched_barrier)

    def signal():  # after issuing q kᵀ
        if overlap:
            plgpu.barrier_arrive(sched_barrier.at[1 - wg])
        else:
            rendezvous()

    def wait_own():  # the overlap's handoff: until the other warpgroup has signalled this one
        plgpu.barrier_wait(sched_barrier.at[wg])

    def await_turn(slot):  # the rendezvous, before p v: its value tile, and the tensor cores ours again
        plgpu.barrier_arrive(sched_barrier)
        plgpu.barrier_wait(v_loaded.at[slot])
        plgpu.barrier_wait(sched_barrier)

    def free(which, slot):  # this warpgroup is done with the slot's key (0) or value (1) tile
        plgpu.barrier_arrive((k_consumed, v_consumed)[which].at[slot])

    def skip_turn():  # a step's pair where a warpgroup runs no products (a released tile)
        if overlap:
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

        if overlap:  # the first turn is warpgroup 0's
            pl.when(wg == 1)(wait_own)
        else:
            pl.when(wg == 1)(rendezvous)

        def key_offset(t, masked):  # a masked step's first key, read before its scores wait
            return tile(t) * bk if masked else None

        def probs(s, m_i, k0, masked):
            """`(m_new, alpha, p)` of the scores `s` (float32, unscaled) of the tile whose keys
            start at `k0`: the new running max, the factor that rescales what came before, the
            probabilities in base 2."""
            s, c, _ = base2_scores(s, cfg)  # s · c in base-2 units
            if masked:
                grid = functools.partial(iota, (bq, bk))
                qi, kj = q_base + grid(0), k0 + grid(1)
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

            if d <= 128:  # the row sum before the wait for small head dims (as JAX's kernel)
                l_i = l_i + p.sum(axis=1)
                acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                await_turn(slot)
            else:
                await_turn(slot)
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

        # `overlap` (FA3's overlap inside a warpgroup): a turn issues tile t's
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

        # a row that saw no key (and no sink) has l = 0: output 0, lse -inf (the guard keeps
        # non-finite scores away)
        seen = l_i > 0.0
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
        plgpu.wait_smem_to_gmem(0)
        if lo_ref is not None:  # through the same tile, once the output has left it
            qo_smem[...] = lo
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, lo_ref.at[batch, pl.ds(q_base, bq), head])
            plgpu.wait_smem_to_gmem(0)

    ring = (k_smem, v_smem, (k_loaded, v_loaded), (k_consumed, v_consumed))
    pl.when(wg == COMPUTE_WGS)(
        functools.partial(stream_kv, cfg, (batch, head, clo, chi, tile), k_ref, v_ref, *ring)
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
    overlap=False,
    out_lo=False,
):
    """`(out [B, Sq, H, D], lse [B, H, Sq] float32)` of the Mosaic GPU kernel; `sinks [H]`
    join the denominator (and `lse`). `out_lo=True` adds a third output, `lo [B, Sq, H, D]`:
    the float32 output less `out`, in `out`'s dtype (for the sinks' cotangent, whose sum over
    the rows of `out · d_out` the rounding of `out` alone would put off by about 2⁻⁹ relative
    per term). `overlap`: the compute warpgroups' ping-pong as FA3's overlap (a tile's softmax
    under the previous tile's `p v`, the tensor cores handed over on a barrier per warpgroup)
    rather than JAX's rendezvous (`AttentionBlockSizes.ping_pong`)."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    check_tiles(block_q, block_kv, num_stages, d)
    lowered, leaves = lower(mask)  # raises for a mask the kernels cannot evaluate on a tile
    sqp, skp = cdiv(sq, COMPUTE_WGS * block_q) * COMPUTE_WGS * block_q, cdiv(sk, block_kv) * block_kv
    table = schedule_table(mask, sq, sk, block_q, block_kv, b)
    mask_ops = operands(leaves, b, sqp, skp)
    sink_arr = jnp.zeros((h,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    pad = lambda a, n: a if a.shape[1] == n else jnp.pad(a, [(0, 0), (0, n - a.shape[1]), (0, 0), (0, 0)])  # noqa: E731
    qp, kp, vp = pad(q, sqp), pad(k, skp), pad(v, skp)
    blocks = sqp // (COMPUTE_WGS * block_q)
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    cfg = KernelConfig(
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
            plgpu.Barrier(num_barriers=COMPUTE_WGS) if overlap else plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    out_type = [jax.ShapeDtypeStruct((b, sqp, h, d), q.dtype), jax.ShapeDtypeStruct((b, h, sqp), jnp.float32)]
    outs = plgpu.kernel(
        entry,
        out_type=out_type + out_type[:1] if out_lo else out_type,
        # the grid's first axis is the one the GPU launches fastest: the blocks running at once
        # spread over the heads
        grid=(h, blocks, b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="axkern_attention_mosaic_gpu_fwd",
    )(qp, kp, vp, table, sink_arr, *mask_ops)
    out, lse, *lo = outs
    return (out[:, :sq], lse[:, :, :sq], *(a[:, :sq] for a in lo))
