"""The backward's `dk, dv` kernel and its launch (`launch_dkv`): per block of key tiles, the query
tiles, `d_out` tiles, `lse` and `delta` rows of every query head of the group streamed past two
compute warpgroups, each holding its key and value tiles (the GQA sum stays in registers); with
`dq_by="reduction"` it also adds each tile's `dq` share into float32 zeros by TMA reductions. Its
math, grid and cost in `__init__`'s docstring."""

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
    table_reader,
    tile_of,
    times,
    warpgroup_bounds,
)

DQ_COLS = 64  # dq_by="reduction": the columns of one dq product and TMA reduction


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    sched_ref,
    mask_refs,
    dk_ref,
    dv_ref,
    dq_ref,
    scoped,
    *,
    cfg,
    mask,
    dtype,
    want,
):
    """`want`: the gradients this launch forms, `("dk", "dv")`, or one of them (`SPLIT_ABOVE`);
    `dk_ref`, `dv_ref` are the outputs of those (the other None). `dq_ref` (float32 `[B, Sqp, H,
    D]`, zeros to start, or None): each step's `dq` share `dsᵀ k` added to it by a TMA reduction
    (`dq_by="reduction"`), `ds` staged in shared memory for that product's transposed operand."""
    bq, bk, stages, groups = cfg.block_q, cfg.block_kv, cfg.stages, cfg.groups
    d = k_ref.shape[-1]
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
    cta = lax.axis_index("kv_seq")  # causal: the first key blocks see the most queries
    wg = lax.axis_index("wg")
    (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *dq_tiles), (kv_loaded, loaded), consumed = (
        scoped
    )
    at = table_reader(sched_ref, batch, cfg)
    clo, chi = at(cta, CTA_LO), at(cta, CTA_HI)
    tile = tile_of(at, cta, cfg)  # the query tile of step t
    g = jnp.int32(groups)
    # the ring's items: step clo + u // groups (query tile `tile` of it) of the group's query
    # head u % groups

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
        ds_smem, dq_smem = (t.at[wg] for t in dq_tiles) if dq_ref is not None else (None, None)
        lo, flo, fhi, hi = warpgroup_bounds(at, cta, wg)
        kv_base = (cta * COMPUTE_WGS + wg) * bk
        tile_mask = TileMask(mask, mask_refs, batch, kv_base, bk, keys_first=True)
        rows = (batch, pl.ds(kv_base, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, kv_loaded.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, kv_loaded.at[wg])
        plgpu.barrier_wait(kv_loaded.at[wg])
        column = plgpu.Layout.WGMMA.reduce(0)
        item = lambda t: (t - clo) * g  # noqa: E731 - the first ring item of query tile t

        def accumulate(dk_acc, dv_acc):
            def step(u, carry, masked):
                slot = lax.rem(u, jnp.int32(stages))
                q_base = tile(clo + lax.div(u, g)) * bq  # (read before the step's wait)
                plgpu.barrier_wait(loaded.at[slot])

                def s_product(acc):
                    plgpu.wgmma(acc, k_smem, q_smem.at[slot].transpose((1, 0)))
                    return acc[...]

                s = pl.run_scoped(s_product, plgpu.ACC((bk, bq), jnp.float32))  # keys by queries
                lse = mosaic_gpu_load(lse_smem.at[slot], layout=column)
                delta = mosaic_gpu_load(delta_smem.at[slot], layout=column) if "dk" in want else None
                s, c, tanh = base2_scores(s, cfg)
                if masked:
                    grid = functools.partial(iota, (bk, bq))
                    vis = tile_mask.visible(q_base + grid(1), kv_base + grid(0), q_base, bq)
                    if vis is not None:
                        s = jnp.where(vis, s, -jnp.inf)
                bcast = lambda x: lax.broadcast_in_dim(x, s.shape, [1])  # noqa: E731
                p = jnp.exp2(times(s, c) - bcast(lse))
                if "dk" not in want:  # dv alone
                    plgpu.wgmma(dv_acc, p.astype(dtype), do_smem.at[slot])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[slot])
                    return carry

                def dp_product(acc):
                    plgpu.wgmma(acc, v_smem, do_smem.at[slot].transpose((1, 0)))
                    if "dv" in want:
                        plgpu.wgmma(dv_acc, p.astype(dtype), do_smem.at[slot])
                        return plgpu.wgmma_accumulator_load(acc, wait_n=1)
                    return plgpu.wgmma_accumulator_load(acc, wait_n=0)

                dp = pl.run_scoped(dp_product, plgpu.ACC((bk, bq), jnp.float32))
                ds = p * (dp - bcast(delta))
                ds = (ds if tanh is None else ds * (1.0 - tanh * tanh)).astype(dtype)
                if dq_ref is None:
                    plgpu.wgmma(dk_acc, ds, q_smem.at[slot])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[slot])
                    return carry
                ds_smem[...] = ds
                plgpu.commit_smem()
                head = kv_head * g + lax.rem(u, g)
                # the dq share [bq, d] = dsᵀ k by column chunks of DQ_COLS (its accumulator
                # beside dk's and dv's in registers), each chunk's staging tile in turn
                for c in range(d // DQ_COLS):
                    cols = pl.ds(c * DQ_COLS, DQ_COLS)

                    def dq_product(acc, c=c, cols=cols):
                        if c == 0:  # dk += ds q beside the first
                            plgpu.wgmma(dk_acc, ds, q_smem.at[slot])
                        plgpu.wgmma(acc, ds_smem.transpose((1, 0)), k_smem.at[:, cols])
                        return plgpu.wgmma_accumulator_load(acc, wait_n=0)

                    dq = pl.run_scoped(dq_product, plgpu.ACC((bq, DQ_COLS), jnp.float32))
                    if c == 0:
                        plgpu.barrier_arrive(consumed.at[slot])
                    # this chunk's tile is free once the previous step's copy of it has read it
                    plgpu.wait_smem_to_gmem(d // DQ_COLS - 1, wait_read_only=True)
                    dq_smem.at[c][...] = dq
                    plgpu.commit_smem()
                    dst = dq_ref.at[batch, pl.ds(q_base, bq), head, cols]
                    plgpu.copy_smem_to_gmem(dq_smem.at[c], dst, reduction_op="add")
                return carry

            def release(u, carry):  # a query tile only the other warpgroup needs
                slot = lax.rem(u, jnp.int32(stages))
                plgpu.barrier_wait(loaded.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])
                return carry

            lax.fori_loop(item(clo), item(lo), release, None)
            lax.fori_loop(item(lo), item(flo), functools.partial(step, masked=True), None)
            lax.fori_loop(item(flo), item(fhi), functools.partial(step, masked=False), None)
            lax.fori_loop(item(fhi), item(hi), functools.partial(step, masked=True), None)
            lax.fori_loop(item(hi), item(chi), release, None)
            return tuple(a[...] for a in (dk_acc, dv_acc) if a is not None)

        acc = plgpu.ACC((bk, d), jnp.float32)
        if want == ("dk", "dv"):
            dk, dv = pl.run_scoped(accumulate, acc, acc)
        elif want == ("dk",):
            (dk,), dv = pl.run_scoped(lambda a: accumulate(a, None), acc), None
        else:
            dk, (dv,) = None, pl.run_scoped(lambda a: accumulate(None, a), acc)
        # the key and value tiles are done with: they stage the gradients out
        if dk is not None:
            k_smem[...] = (dk * cfg.scale).astype(dtype)
        if dv is not None:
            v_smem[...] = dv.astype(dtype)
        plgpu.commit_smem()
        for grad, smem, out in ((dk, k_smem, dk_ref), (dv, v_smem, dv_ref)):
            if grad is not None:
                plgpu.copy_smem_to_gmem(smem, out.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        @pl.loop(0, (chi - clo) * g)
        def _(u):
            slot = lax.rem(u, jnp.int32(stages))
            t, head = tile(clo + lax.div(u, g)), kv_head * g + lax.rem(u, g)
            rows, cols = (batch, pl.ds(t * bq, bq), head), (batch, head, pl.ds(t * bq, bq))

            @pl.when(u >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[cols], lse_smem.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[cols], delta_smem.at[slot], loaded.at[slot])


def launch_dkv(cfg, lowered, want, inputs, mask_ops, params, dq=False) -> dict:
    """The `dk, dv` kernel for the gradients of `want` (one launch), `{name: gradient}`; with `dq`
    also `"dq"`, float32 and unscaled, the kernel's TMA reductions into zeros (`pl.kernel` over
    refs, as `plgpu.kernel` takes no aliases)."""
    b, skp, kvh, d = inputs[1].shape
    sqp, h = inputs[0].shape[1], inputs[0].shape[2]
    dt = inputs[1].dtype
    bq2, bk2, st2 = cfg.block_q, cfg.block_kv, cfg.stages
    table = inputs[-1]
    body = functools.partial(_kernel, cfg=cfg, mask=lowered, dtype=dt, want=want)
    names = want + (("dq",) if dq else ())
    n = len(names)
    extra = [
        swizzled_smem((COMPUTE_WGS, bk2, bq2), dt),
        swizzled_smem((COMPUTE_WGS, d // DQ_COLS, bq2, DQ_COLS), jnp.float32),
    ]

    def dkv_entry(*refs):  # 7 inputs, the mask's operands, the gradients of `names`
        outs = dict(zip(names, refs[-n:], strict=True))
        grads = (outs.get("dk"), outs.get("dv"), outs.get("dq"))
        pl.run_scoped(
            lambda *scoped: body(*refs[:7], tuple(refs[7:-n]), *grads, scoped),
            [
                swizzled_smem((COMPUTE_WGS, bk2, d), dt),
                swizzled_smem((COMPUTE_WGS, bk2, d), dt),
                swizzled_smem((st2, bq2, d), dt),
                swizzled_smem((st2, bq2, d), dt),
                plgpu.SMEM((st2, bq2), jnp.float32),
                plgpu.SMEM((st2, bq2), jnp.float32),
                *(extra if dq else []),
            ],
            (
                plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),
                plgpu.Barrier(num_arrivals=4, num_barriers=st2),
            ),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=st2),
            collective_axes="wg",
        )

    kv_shape = jax.ShapeDtypeStruct((b, skp, kvh, d), dt)
    kernel_name = (
        "axkern_attention_mosaic_gpu_" + ("dkv" if len(want) == 2 else want[0]) + ("_dq" if dq else "")
    )
    mesh = dict(
        grid=(kvh, table.shape[-2], b),
        grid_names=("heads", "kv_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
    )
    if not dq:
        outs = plgpu.kernel(
            dkv_entry, out_type=[kv_shape] * n, compiler_params=params, kernel_name=kernel_name, **mesh
        )(*inputs, *mask_ops)
        return dict(zip(names, outs, strict=True))
    launch = pl.kernel(
        dkv_entry,
        out_type=(),
        mesh=plgpu.Mesh(kernel_name=kernel_name, **mesh),
        compiler_params=params,
        name=kernel_name,
    )
    first = (*(lax.empty(kv_shape.shape, dt) for _ in want), jnp.zeros((b, sqp, h, d), jnp.float32))
    outs = pl.run_state(lambda refs: launch(*inputs, *mask_ops, *refs))(first)
    return dict(zip(names, outs, strict=True))
