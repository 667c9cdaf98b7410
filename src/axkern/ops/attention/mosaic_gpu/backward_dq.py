"""The backward's `dq` kernel and its launch (`launch_dq`): per block of query tiles, key and value
tiles streamed past two compute warpgroups, each holding its query and `d_out` tiles; its math,
grid and cost in `__init__`'s docstring."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core.compat import mosaic_gpu_load
from axkern.core.kernels import swizzled_smem

from .schedules import COMPUTE_WGS, CTA_HI, CTA_LO
from .tiles import (
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


def _kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sched_ref, mask_refs, dq_ref, scoped, *, cfg, mask, dtype
):
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
    d = q_ref.shape[-1]
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    cta = cfg.blocks - 1 - lax.axis_index("q_seq")  # heaviest causal rows first
    wg = lax.axis_index("wg")
    (q_smem2, do_smem2, k_smem, v_smem), (k_loaded, v_loaded, qd_loaded), (k_consumed, v_consumed) = scoped
    at = table_reader(sched_ref, batch, cfg)
    clo, chi = at(cta, CTA_LO), at(cta, CTA_HI)
    tile = tile_of(at, cta, cfg)  # the key tile of step t
    slot_of = lambda t: lax.rem(t - clo, jnp.int32(stages))  # noqa: E731

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        lo, flo, fhi, hi = warpgroup_bounds(at, cta, wg)
        q_base = (cta * COMPUTE_WGS + wg) * bq
        tile_mask = TileMask(mask, mask_refs, batch, q_base, bq)
        rows = (batch, pl.ds(q_base, bq), head)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, qd_loaded.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, qd_loaded.at[wg])
        row = plgpu.Layout.WGMMA.reduce(1)
        lse = mosaic_gpu_load(lse_ref.at[batch, head, pl.ds(q_base, bq)], layout=row, optimized=False)
        delta = mosaic_gpu_load(delta_ref.at[batch, head, pl.ds(q_base, bq)], layout=row, optimized=False)
        plgpu.barrier_wait(qd_loaded.at[wg])

        def step(t, dq, masked):
            slot, k0 = slot_of(t), tile(t) * bk  # (the step's key tile read before its waits)
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])

            def products(dp_acc, s_acc):
                plgpu.wgmma(dp_acc, do_smem, v_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma(s_acc, q_smem, k_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma_wait(1)
                plgpu.barrier_arrive(v_consumed.at[slot])
                return dp_acc[...], s_acc[...]

            acc = plgpu.ACC((bq, bk), jnp.float32)
            dp, s = pl.run_scoped(products, acc, acc)
            s, c, tanh = base2_scores(s, cfg)
            if masked:
                grid = functools.partial(iota, (bq, bk))
                key_len = cfg.sk if cfg.sk % bk else None
                vis = tile_mask.visible(q_base + grid(0), k0 + grid(1), k0, bk, key_len)
                if vis is not None:
                    s = jnp.where(vis, s, -jnp.inf)
            bcast = lambda x: lax.broadcast_in_dim(x, s.shape, [0])  # noqa: E731
            p = jnp.exp2(times(s, c) - bcast(lse))
            ds = p * (dp - bcast(delta))
            ds = (ds if tanh is None else ds * (1.0 - tanh * tanh)).astype(dtype)

            def dq_product(acc_ref):
                plgpu.wgmma(acc_ref, ds, k_smem.at[slot])

            dq = pl.run_state(dq_product)(plgpu.ACC.init(dq))
            plgpu.barrier_arrive(k_consumed.at[slot])
            return dq

        def release(t, carry):  # a tile only the other warpgroup needs
            slot = slot_of(t)
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            return carry

        dq = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
        lax.fori_loop(clo, lo, release, None)
        dq = lax.fori_loop(lo, flo, functools.partial(step, masked=True), dq)
        dq = lax.fori_loop(flo, fhi, functools.partial(step, masked=False), dq)
        dq = lax.fori_loop(fhi, hi, functools.partial(step, masked=True), dq)
        lax.fori_loop(hi, chi, release, None)
        q_smem[...] = (dq * cfg.scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    ring = (k_smem, v_smem, (k_loaded, v_loaded), (k_consumed, v_consumed))
    pl.when(wg == COMPUTE_WGS)(
        functools.partial(stream_kv, cfg, (batch, head, clo, chi, tile), k_ref, v_ref, *ring)
    )


def launch_dq(cfg, lowered, inputs, mask_ops, params):
    """The `dq` kernel (`[B, Sqp, H, D]` in the input dtype) on `backward.backward_operands`' six
    arrays and the schedule (`inputs`), the lowered mask and its operands."""
    b, sqp, h, d = inputs[0].shape
    dt = inputs[0].dtype
    bq1, bk1, st1 = cfg.block_q, cfg.block_kv, cfg.stages
    body = functools.partial(_kernel, cfg=cfg, mask=lowered, dtype=dt)

    def dq_entry(*refs):  # 7 inputs, the mask's operands, dq
        pl.run_scoped(
            lambda *scoped: body(*refs[:7], tuple(refs[7:-1]), refs[-1], scoped),
            [
                swizzled_smem((COMPUTE_WGS, bq1, d), dt),
                swizzled_smem((COMPUTE_WGS, bq1, d), dt),
                swizzled_smem((st1, bk1, d), dt),
                swizzled_smem((st1, bk1, d), dt),
            ],
            (
                plgpu.Barrier(num_barriers=st1),
                plgpu.Barrier(num_barriers=st1),
                plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),
            ),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=st1),) * 2,
            collective_axes="wg",
        )

    return plgpu.kernel(
        dq_entry,
        out_type=jax.ShapeDtypeStruct((b, sqp, h, d), dt),
        grid=(h, inputs[-1].shape[-2], b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=params,
        kernel_name="axkern_attention_mosaic_gpu_dq",
    )(*inputs, *mask_ops)
