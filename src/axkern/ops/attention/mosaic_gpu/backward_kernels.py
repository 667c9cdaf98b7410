"""The backward kernels: the `dq` kernel and the `dk, dv` kernel, their checks and the operands
both read (`backward_operands`); launched by `backward_launch.py`; their math, grids and costs in
`__init__`'s docstring."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from axkern.core.compat import mosaic_gpu_load
from axkern.core.op import Unsupported

from ..blocks import (
    MOSAIC_GPU_SMEM,
    mosaic_gpu_backward_tiles,
    mosaic_gpu_dkv_smem_bytes,
    mosaic_gpu_dq_by,
    mosaic_gpu_dq_smem_bytes,
)
from .schedules import COMPUTE_WGS, CTA_HI, CTA_LO, lower
from .tiles import (
    LOG2E,
    TileMask,
    _entry_of,
    _iota,
    _stream_kv,
    base2_scores,
    pl,
    plgpu,
    tile_of,
    times,
    warpgroup_bounds,
)

BACKWARD_HEAD_DIMS = (64, 128, 256)
# above head dim 128 the dk and dv accumulators together would fill a warpgroup's registers: the
# dk, dv kernel runs twice, once for dv (s, p, dv += pᵀ d_out) and once for dk (s, dp, dk += dsᵀ q)
SPLIT_ABOVE = 128
DQ_COLS = 64  # dq_by="reduction": the columns of one dq product and TMA reduction


def backward_blocks(block_sizes, head_dim: int = 128) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """`((block_q, block_kv, num_stages) of dq, (block_q, block_kv, num_stages) of dk, dv)`:
    the `*_dq`, `*_dkv` fields, each left `None` taken from `mosaic_gpu_backward_tiles` (the
    heuristic's); any other value is checked as given."""
    defaults = mosaic_gpu_backward_tiles(head_dim)

    def pick(name, i, f):
        value = getattr(block_sizes, f"{f}_{name}", None)
        return defaults[name][i] if value is None else value

    return tuple(
        tuple(pick(name, i, f) for i, f in enumerate(("block_q", "block_kv", "num_stages")))
        for name in ("dq", "dkv")
    )


def dq_by(block_sizes, head_dim: int) -> str:
    """How the backward forms `dq` (`AttentionBlockSizes.dq_by`; `None`: `mosaic_gpu_dq_by`'s)."""
    return getattr(block_sizes, "dq_by", None) or mosaic_gpu_dq_by(head_dim)


def _check_backward(mask, block_sizes, d):
    if d not in BACKWARD_HEAD_DIMS:
        raise Unsupported(f"head dim {d}: the Mosaic GPU backward kernels take {BACKWARD_HEAD_DIMS}")
    (bq1, bk1, st1), (bq2, bk2, st2) = backward_blocks(block_sizes, d)
    # (a product's contraction runs over whole 128-byte swizzle rows: 64 16-bit elements)
    if bq1 != 64 or bk1 not in (64, 128):
        raise Unsupported(
            f"dq tiles {bq1}x{bk1}: the Mosaic GPU dq kernel takes 64 query rows by 64 or 128 keys"
        )
    if bk2 != 64 or bq2 not in (64, 128):
        raise Unsupported(
            f"dk, dv tiles {bq2}x{bk2}: the Mosaic GPU kernel takes 64 or 128 query rows by 64 keys"
        )
    for name in ("dq", "dkv"):
        if getattr(block_sizes, f"num_warps_{name}", None) is not None:
            raise Unsupported(
                f"num_warps_{name}: the Mosaic GPU kernels run two compute warpgroups and a producer, "
                "not a number of warps (that field is pallas_gpu's)"
            )
    reduction = dq_by(block_sizes, d) == "reduction"
    if reduction and d > SPLIT_ABOVE:
        raise Unsupported(
            f"dq_by='reduction' at head dim {d}: the dk, dv kernel adds dq's tiles up to head dim {SPLIT_ABOVE}"
        )
    low = 1 if d > SPLIT_ABOVE else 2  # one stage: where two do not fit shared memory (head dim 256)
    for name, stages in (("dq", st1), ("dkv", st2)):
        if not low <= stages <= 4:
            raise Unsupported(
                f"num_stages_{name}={stages}: the Mosaic GPU ring holds {low} to 4 tiles at head dim {d}"
            )
    for name, need in (
        ("dq", mosaic_gpu_dq_smem_bytes(bq1, bk1, st1, d)),
        ("dk, dv", mosaic_gpu_dkv_smem_bytes(bq2, bk2, st2, d, dq=reduction)),
    ):
        if need > MOSAIC_GPU_SMEM:
            raise Unsupported(f"the Mosaic GPU {name} kernel's tiles need {need} bytes of shared memory")
    lower(mask)


def backward_operands(q, k, v, out, lse, d_out, *, sqp, skp, d_lse=None):
    """What both backward kernels read: `q`, `d_out` padded to `sqp` rows and `k`, `v` to `skp`
    (zeros), `lse` in base-2 units with `+inf` for rows that saw no key and for the padding
    (so every `p = exp2(s · scale · log2 e - lse2)` there is 0), and `delta = Σ_d out · d_out`
    less `lse`'s cotangent `d_lse` (`[B, Sq, H]` or None: `common.lse_cotangent`; float32, 0 on
    the padding), `[B, H, sqp]` each."""
    sq = q.shape[1]
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - jnp.swapaxes(d_lse.astype(jnp.float32), 1, 2)
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * LOG2E)
    rows = lambda a, n: jnp.pad(a, [(0, 0), (0, n - a.shape[1]), (0, 0), (0, 0)])  # noqa: E731
    cols = lambda a, value: jnp.pad(a, [(0, 0), (0, 0), (0, sqp - sq)], constant_values=value)  # noqa: E731
    return (
        rows(q, sqp),
        rows(k, skp),
        rows(v, skp),
        rows(d_out, sqp),
        cols(lse2, jnp.inf),
        cols(delta, 0.0),
    )


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, sched_ref, mask_refs, dq_ref, scoped, *, cfg, mask, dtype
):
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
    d = q_ref.shape[-1]
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    cta = cfg.blocks - 1 - lax.axis_index("q_seq")  # heaviest causal rows first
    wg = lax.axis_index("wg")
    (q_smem2, do_smem2, k_smem, v_smem), (k_loaded, v_loaded, qd_loaded), (k_consumed, v_consumed) = scoped
    at = _entry_of(sched_ref, batch, cfg)
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
                iota = functools.partial(_iota, (bq, bk))
                key_len = cfg.sk if cfg.sk % bk else None
                vis = tile_mask.visible(q_base + iota(0), k0 + iota(1), k0, bk, key_len)
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
        functools.partial(_stream_kv, cfg, (batch, head, clo, chi, tile), k_ref, v_ref, *ring)
    )


def _dkv_kernel(
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
    at = _entry_of(sched_ref, batch, cfg)
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
                    iota = functools.partial(_iota, (bk, bq))
                    vis = tile_mask.visible(q_base + iota(1), kv_base + iota(0), q_base, bq)
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


def check_backward(mask, block_sizes, head_dim) -> str | None:
    """Why the backward kernels cannot serve these options, or None."""
    try:
        _check_backward(mask, block_sizes, head_dim)
    except Unsupported as e:
        return str(e)
    return None
