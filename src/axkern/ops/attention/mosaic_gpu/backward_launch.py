"""The backward's launches (`backward`): the `dq` kernel and the `dk, dv` kernel of
`backward_kernels.py` on the forward's residuals, their shared memory and outputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core.blocks import cdiv
from axkern.core.kernels import swizzled_smem

from .backward_kernels import (
    DQ_COLS,
    SPLIT_ABOVE,
    _check_backward,
    _dkv_kernel,
    _dq_kernel,
    backward_blocks,
    backward_operands,
    dq_by,
)
from .schedules import COMPUTE_WGS, LIST, lower, operands, schedule_table
from .tiles import _Cfg, pl, plgpu


def backward(q, k, v, out, lse, d_out, *, mask, scale, block_sizes, logits_soft_cap=None, d_lse=None):
    """`(dq, dk, dv)` of the forward from its residuals (`out`, `lse` as `forward` returns
    them) and the cotangents `d_out` and `d_lse` (`lse`'s, `[B, Sq, H]`, or None), by the `dq` kernel (key tiles streamed past each query
    block) and the `dk, dv` kernel (query tiles of every query head of the group streamed past
    each key block: the GQA sum stays in registers); with `dq_by="reduction"` the `dk, dv`
    kernel alone, adding each tile's `dq` share into float32 zeros (`_dkv_kernel`)."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    _check_backward(mask, block_sizes, d)
    (bq1, bk1, st1), (bq2, bk2, st2) = backward_blocks(block_sizes, d)
    mq, mk = max(COMPUTE_WGS * bq1, bq2), max(bk1, COMPUTE_WGS * bk2)
    sqp, skp = cdiv(sq, mq) * mq, cdiv(sk, mk) * mk
    inputs = backward_operands(q, k, v, out, lse, d_out, sqp=sqp, skp=skp, d_lse=d_lse)
    lowered, leaves = lower(mask)
    mask_ops = operands(leaves, b, sqp, skp)
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    params = plgpu.CompilerParams(approx_math=True)
    config = lambda bq, bk, st, table: _Cfg(  # noqa: E731
        bq,
        bk,
        st,
        float(scale),
        sq,
        sk,
        h // kvh,
        table.shape[-2],
        bool(leaves),
        cap,
        tiles=table.shape[-1] > LIST,
    )
    reduction = dq_by(block_sizes, d) == "reduction"
    if not reduction:
        table = schedule_table(mask, sq, sk, bq1, bk1, b)
        dq = _dq_launch(config(bq1, bk1, st1, table), lowered, (*inputs, table), mask_ops, params)
    table = schedule_table(mask, sq, sk, bq2, bk2, b, keys=True)
    cfg = config(bq2, bk2, st2, table)
    wants = (("dk", "dv"),) if d <= SPLIT_ABOVE else (("dv",), ("dk",))
    grads = {}
    for want in wants:
        grads |= _dkv_launch(cfg, lowered, want, (*inputs, table), mask_ops, params, dq=reduction)
    if reduction:  # the float32 sum of every key block's share
        dq = (grads["dq"] * scale).astype(q.dtype)
    return dq[:, :sq], grads["dk"][:, :sk], grads["dv"][:, :sk]


def _dq_launch(cfg, lowered, inputs, mask_ops, params):
    """The `dq` kernel (`[B, Sqp, H, D]` in the input dtype) on `backward_operands`' six arrays
    and the schedule."""
    b, sqp, h, d = inputs[0].shape
    dt = inputs[0].dtype
    bq1, bk1, st1 = cfg.block_q, cfg.block_kv, cfg.stages
    body = functools.partial(_dq_kernel, cfg=cfg, mask=lowered, dtype=dt)

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


def _dkv_launch(cfg, lowered, want, inputs, mask_ops, params, dq=False) -> dict:
    """The `dk, dv` kernel for the gradients of `want` (one launch), `{name: gradient}`; with `dq`
    also `"dq"`, float32 and unscaled, the kernel's TMA reductions into zeros (`pl.kernel` over
    refs, as `plgpu.kernel` takes no aliases)."""
    b, skp, kvh, d = inputs[1].shape
    sqp, h = inputs[0].shape[1], inputs[0].shape[2]
    dt = inputs[1].dtype
    bq2, bk2, st2 = cfg.block_q, cfg.block_kv, cfg.stages
    table = inputs[-1]
    body = functools.partial(_dkv_kernel, cfg=cfg, mask=lowered, dtype=dt, want=want)
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
