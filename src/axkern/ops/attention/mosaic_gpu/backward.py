"""The backward (`backward`): the `dq` kernel (`backward_dq.py`) and the `dk, dv` kernel
(`backward_dkv.py`) on the forward's residuals, their tiles (`backward_blocks`, `dq_by`), their
checks (`check_backward`) and the operands both read (`backward_operands`); their math, grids
and costs in `__init__`'s docstring."""

from __future__ import annotations

import jax.numpy as jnp

from axkern.core.blocks import cdiv
from axkern.core.op import Unsupported

from ..blocks import (
    MOSAIC_GPU_SMEM,
    mosaic_gpu_backward_tiles,
    mosaic_gpu_dkv_smem_bytes,
    mosaic_gpu_dq_by,
    mosaic_gpu_dq_smem_bytes,
)
from .backward_dkv import launch_dkv
from .backward_dq import launch_dq
from .schedules import COMPUTE_WGS, LIST, lower, operands, schedule_table
from .tiles import LOG2E, KernelConfig, plgpu

BACKWARD_HEAD_DIMS = (64, 128, 256)
# above head dim 128 the dk and dv accumulators together would fill a warpgroup's registers: the
# dk, dv kernel runs twice, once for dv (s, p, dv += pᵀ d_out) and once for dk (s, dp, dk += dsᵀ q)
SPLIT_ABOVE = 128


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


def refuse_backward(mask, block_sizes, d) -> None:
    """`Unsupported` with the reason when the backward kernels cannot serve these block sizes
    (`check_backward` returns it)."""
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


def check_backward(mask, block_sizes, head_dim) -> str | None:
    """Why the backward kernels cannot serve these options, or None."""
    try:
        refuse_backward(mask, block_sizes, head_dim)
    except Unsupported as e:
        return str(e)
    return None


def backward(q, k, v, out, lse, d_out, *, mask, scale, block_sizes, logits_soft_cap=None, d_lse=None):
    """`(dq, dk, dv)` of the forward from its residuals (`out`, `lse` as `forward` returns
    them) and the cotangents `d_out` and `d_lse` (`lse`'s, `[B, Sq, H]`, or None), by the `dq` kernel (key tiles streamed past each query
    block) and the `dk, dv` kernel (query tiles of every query head of the group streamed past
    each key block: the GQA sum stays in registers); with `dq_by="reduction"` the `dk, dv`
    kernel alone, adding each tile's `dq` share into float32 zeros (`backward_dkv.py`)."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    refuse_backward(mask, block_sizes, d)
    (bq1, bk1, st1), (bq2, bk2, st2) = backward_blocks(block_sizes, d)
    mq, mk = max(COMPUTE_WGS * bq1, bq2), max(bk1, COMPUTE_WGS * bk2)
    sqp, skp = cdiv(sq, mq) * mq, cdiv(sk, mk) * mk
    inputs = backward_operands(q, k, v, out, lse, d_out, sqp=sqp, skp=skp, d_lse=d_lse)
    lowered, leaves = lower(mask)
    mask_ops = operands(leaves, b, sqp, skp)
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    params = plgpu.CompilerParams(approx_math=True)
    config = lambda bq, bk, st, table: KernelConfig(  # noqa: E731
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
        dq = launch_dq(config(bq1, bk1, st1, table), lowered, (*inputs, table), mask_ops, params)
    table = schedule_table(mask, sq, sk, bq2, bk2, b, keys=True)
    cfg = config(bq2, bk2, st2, table)
    wants = (("dk", "dv"),) if d <= SPLIT_ABOVE else (("dv",), ("dk",))
    grads = {}
    for want in wants:
        grads |= launch_dkv(cfg, lowered, want, (*inputs, table), mask_ops, params, dq=reduction)
    if reduction:  # the float32 sum of every key block's share
        dq = (grads["dq"] * scale).astype(q.dtype)
    return dq[:, :sq], grads["dk"][:, :sk], grads["dv"][:, :sk]
