"""Mamba-3 as Pallas GPU (Triton) kernels: the engine's chunk kernels and recurrence kernels
(`chunked/kernel_scan.py`, in the Triton layout `chunked/pallas_gpu.py`) with the per-position
log-decay `adt` and the trapezoid's input scale, under the chunked form of `common/layer.py` (the
angles by one Triton kernel, `common/angle_kernel.py`; rotations, gate and the diagonal
correction in XLA: the kernels can take SISO's as their diagonal term, `chunked/chunk_scan.py`,
which docs/ops/mamba3.md shows costs the backward kernel more than XLA's pass).

**Products**: `x` in the inputs' dtype (SISO: `v`) or float32 (MIMO: `v ⊙ W_x`); the rotated
`q`, `k` in float32, heads first (the kernels' layout, `common/kernel_core.py`); TF32 tensor
cores for bf16 inputs, exact float32 for fp16 and float32 inputs, as in `ssd`. **MIMO**: each
token's `R` inputs run as `kernel_slots(R)` consecutive positions (`R` rounded up to a power of
two; `common/kernel_core.py`), so a chunk of `chunk_size` tokens is `chunk_size ·
kernel_slots(R)` kernel positions and costs about that many SISO positions. **Constraints**:
`head_dim`, `state` and the chunk powers of two and at least 16 (the chunk in positions), chunks
of at most 128 positions for a bf16 `x`, 64 for fp16 and float32 ones (float32 inputs, MIMO);
otherwise the call falls back with the reason. On GPU second for bf16 inputs, behind
`mosaic_gpu` (Hopper, SISO), ahead of `xla` (docs/ops/mamba3.md has the times and the GPU tests
behind this). **Rotation backward**: `Mamba3BlockSizes(rotation_backward="kernel")` turns the
rotated `q`, `k`'s cotangents back in one Triton kernel (`rotation_backward`) rather than XLA's
three reductions; opt-in (docs/ops/mamba3.md has its time against XLA's).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from axkern.core import kernels
from axkern.core.blocks import grid, unique_valid
from axkern.core.op import Implementation, Unsupported
from axkern.ops.chunked.pallas_gpu import GPU_MAX_CHUNK, GPU_MAX_CHUNK_32BIT, GPU_MIN_DIM, GpuLayout

from .blocks import (
    Mamba3BlockSizes,
    angles_form,
    kernel_chunks,
    kernel_slots,
    pallas_gpu_heuristic,
    refuse_forms,
)
from .common.kernel_core import kernel_core, kernel_x_dtype, refuse_float64
from .common.layer import forward

__all__ = ["IMPLEMENTATION", "mamba3", "rotation_backward", "supports"]

_ROWS = 32  # rows (token, rank) of `q` or `k` a rotation-backward program turns back per head


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _columns(halves: bool, n: int, a: int):
    """The state's columns as Triton slices: each rotated pair's first and second elements
    (`(i, i + N/2)` for `halves`, else `(2i, 2i+1)`), then the columns that pass through."""
    if halves:
        pairs, rest = (pl.ds(0, a), pl.ds(n // 2, a)), n // 2 - a
        return pairs, [pl.ds(a, rest), pl.ds(n // 2 + a, rest)] if rest else []
    pairs, rest = (pl.ds(0, a, stride=2), pl.ds(1, a, stride=2)), n - 2 * a
    return pairs, [pl.ds(2 * a, rest)] if rest else []


def _rotation_bwd_kernel(
    g_ref, u_ref, bias_ref, th_ref, du_ref, db_ref, dth_ref, *, heads, rank, tokens, halves
):
    """One (batch, group, `tokens` positions) block: for each of the group's `heads`, the
    cotangent `g` of the rotated `u + bias` turned back by `-Θ` (`back`), summed over the heads
    into `du` (in `u`'s dtype), over this block's rows into `db`, and `dΘ = Σ_r back_1 w_0 -
    back_0 w_1` against the unrotated pair `w = u + bias`. Blocks: `g [heads, tokens·rank, N]`
    (rows `(t, r)`, rank `r` every `rank`-th row), `u`, `du [tokens·rank, N]`, `bias`, `db
    [heads, rank, N]`, `Θ`, `dΘ [heads, tokens, A]`."""
    n, a = u_ref.shape[-1], th_ref.shape[-1]
    (c0, c1), rest = _columns(halves, n, a)
    cols = (c0, c1, *rest)
    rows = [pl.ds(r, tokens, stride=rank) if rank > 1 else pl.ds(0, tokens) for r in range(rank)]
    f32 = jnp.float32
    u = [(u_ref[rows[r], c0].astype(f32), u_ref[rows[r], c1].astype(f32)) for r in range(rank)]

    def head(j, acc):
        th = th_ref[j]  # [tokens, A]
        cos, sin = jnp.cos(th), jnp.sin(th)
        d_th = jnp.zeros_like(th)
        out = []
        for r in range(rank):
            g0, g1 = g_ref[j, rows[r], c0], g_ref[j, rows[r], c1]
            back0, back1 = g0 * cos + g1 * sin, g1 * cos - g0 * sin  # the turn by -Θ
            w0 = u[r][0] + bias_ref[j, pl.ds(r, 1), c0]
            w1 = u[r][1] + bias_ref[j, pl.ds(r, 1), c1]
            d_th = d_th + back1 * w0 - back0 * w1
            pieces = (back0, back1, *(g_ref[j, rows[r], c] for c in rest))
            for c, piece in zip(cols, pieces, strict=True):
                db_ref[j, pl.ds(r, 1), c] = jnp.sum(piece, axis=0, keepdims=True)
            out.append(tuple(x + piece for x, piece in zip(acc[r], pieces, strict=True)))
        dth_ref[j] = d_th
        return tuple(out)

    zeros = tuple(tuple(jnp.zeros((tokens, c.size), f32) for c in cols) for _ in range(rank))
    acc = lax.fori_loop(0, heads, head, zeros)
    for r in range(rank):
        for c, x in zip(cols, acc[r], strict=True):
            du_ref[rows[r], c] = x.astype(du_ref.dtype)


def rotation_backward(halves, u, bias, theta, g, *, interpret=False):
    """`common.rotation.rotated`'s heads-first backward as one Triton kernel: `u [b, G, L, R, N]`, `bias
    [H, 1, R, N]`, `theta [b, H, L, 1, A]`, `g [b, H, L, R, N]` float32 -> `(du, dbias, dtheta)`
    with `back = R(-Θ) g`: `du = Σ_{heads of the group} back` (in `u`'s dtype), `dbias = Σ_{b, L}
    back`, `dΘ_i = Σ_r back_{i,1} w_{i,0} - back_{i,0} w_{i,1}` for `w = u + bias`. Grid `(b, G,
    L / T)` with `T = 32 / R` positions a program (halved until it divides `L`), each program
    looping over the group's heads; the bias sums go out per program (`[b, L / T, H, R, N]`,
    float32) and XLA adds them. Memory bound: it reads `g` once (`4·b·H·L·R·N` bytes, where XLA's
    backward reads it once for each of the three gradients), `u`, `Θ`, and writes `du`, `dΘ` and
    the bias sums, for about 10 FLOPs per element of `g`. `None` where the kernel's Triton tiles do
    not fit the shapes (`A` and the columns that pass through, `R` and `T` powers of two, `T >=
    4`): the caller then runs XLA's."""
    batch, groups, length, rank, n = u.shape
    heads, a = bias.shape[0], theta.shape[-1]
    rest = (n // 2 - a) if halves else (n - 2 * a)
    tokens = _ROWS // rank if _pow2(rank) and rank <= _ROWS else 0
    while tokens > 1 and length % tokens:
        tokens //= 2
    if not (_pow2(a) and (rest == 0 or _pow2(rest)) and tokens >= 4):
        return None
    per = heads // groups
    blocks = length // tokens
    rows = tokens * rank
    f32 = jnp.float32
    du, db, dth = pl.pallas_call(
        functools.partial(_rotation_bwd_kernel, heads=per, rank=rank, tokens=tokens, halves=halves),
        name="axkern_mamba3_rotation_bwd",
        grid=(batch, groups, blocks),
        in_specs=[
            pl.BlockSpec((None, per, rows, n), lambda b, g, t: (b, g, t, 0)),
            pl.BlockSpec((None, None, rows, n), lambda b, g, t: (b, g, t, 0)),
            pl.BlockSpec((per, rank, n), lambda b, g, t: (g, 0, 0)),
            pl.BlockSpec((None, per, tokens, a), lambda b, g, t: (b, g, t, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, rows, n), lambda b, g, t: (b, g, t, 0)),
            pl.BlockSpec((None, None, per, rank, n), lambda b, g, t: (b, t, g, 0, 0)),
            pl.BlockSpec((None, per, tokens, a), lambda b, g, t: (b, g, t, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, groups, length * rank, n), u.dtype),
            jax.ShapeDtypeStruct((batch, blocks, heads, rank, n), f32),
            jax.ShapeDtypeStruct((batch, heads, length, a), f32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(),
    )(
        g.reshape(batch, heads, length * rank, n),
        u.reshape(batch, groups, length * rank, n),
        bias.reshape(heads, rank, n),
        theta.reshape(batch, heads, length, a),
    )
    return (
        du.reshape(u.shape),
        db.sum((0, 1)).reshape(bias.shape).astype(bias.dtype),
        dth.reshape(theta.shape).astype(theta.dtype),
    )


# one object per mode: `common.rotation.rotated` takes it as a static (hashed) argument
_ROTATION_BACKWARD = {i: functools.partial(rotation_backward, interpret=i) for i in (False, True)}


def _max_chunk(dtype, mimo) -> int:
    """The largest chunk, in kernel positions, for `x` of `kernel_x_dtype(dtype, mimo)` and the
    products' precision (exact for fp16 and float32 inputs)."""
    wide = kernel_x_dtype(dtype, mimo).itemsize > 2 or not kernels.tf32_suffices(dtype)
    return GPU_MAX_CHUNK_32BIT if wide else GPU_MAX_CHUNK


def supports(spec) -> str | None:
    for name in ("head_dim", "state"):
        n = spec.dim(name)
        if n < GPU_MIN_DIM or n & (n - 1):
            return (
                f"{name}={n}: the Pallas GPU kernels need a power of two >= {GPU_MIN_DIM} (Triton dot tiles)"
            )
    rank, mimo = spec.dim("rank"), bool(spec.flag("mimo"))
    if kernel_slots(rank) > _max_chunk(spec.dtype, mimo):
        return (
            f"rank={rank}: one token takes {kernel_slots(rank)} kernel positions, more than the largest "
            f"chunk ({_max_chunk(spec.dtype, mimo)} positions)"
        )
    return None


def space(spec) -> list[Mamba3BlockSizes]:
    """Chunks of 16 kernel positions up to the largest whose backward fits shared memory
    (`_max_chunk`), in tokens; then, at the heuristic's chunk, the rotation's backward kernel and
    XLA's angles (`axkern tune` times each)."""
    best = pallas_gpu_heuristic(spec)
    chunks = kernel_chunks(spec, GPU_MIN_DIM, _max_chunk(spec.dtype, spec.flag("mimo")))
    forms = [dataclasses.replace(best, rotation_backward="kernel"), dataclasses.replace(best, angles="xla")]
    return grid(Mamba3BlockSizes, spec, first=best, chunk_size=chunks) + unique_valid(forms, spec)


def mamba3(*args, block_sizes, interpret=False):
    """`reference.mamba3`'s arguments and results, through the GPU chunk kernels."""
    refuse_forms(block_sizes, "pallas_gpu")
    refuse_float64(args)
    q = block_sizes.chunk_size
    dtype, mimo = args[2].dtype, args[16] is not None  # v, W_x
    slots = kernel_slots(args[0].shape[2])
    chunk = f"chunk_size={q}" + (f" ({q * slots} positions, {slots} per token)" if slots > 1 else "")
    if q * slots < GPU_MIN_DIM:
        raise Unsupported(f"{chunk} is below {GPU_MIN_DIM} (Triton dot tiles)")
    high = _max_chunk(dtype, mimo)
    if q * slots > high:
        x = f"{kernel_x_dtype(dtype, mimo).name} x" + (" (MIMO)" if mimo else "")
        raise Unsupported(
            f"{chunk} with {x}: the backward kernel's tiles exceed a Hopper block's 227 KiB of "
            f"shared memory above chunks of {high} positions"
        )
    # the diagonal correction in XLA, not in the kernels (`diagonal=False`): the Triton backward
    # kernel's share of it costs more than XLA's pass (docs/ops/mamba3.md)
    core = kernel_core(
        GpuLayout,
        chunk_size=q,
        interpret=bool(interpret),
        dtype=dtype,
        mimo=mimo,
        diagonal=False,
        # XLA's by default: the kernel is no faster than XLA's reductions for SISO
        # (docs/ops/mamba3.md)
        rotation_backward=(
            _ROTATION_BACKWARD[bool(interpret)] if block_sizes.rotation_backward == "kernel" else None
        ),
        angle_kernel=block_sizes.angles != "xla",
    )
    return forward(core, *args, chunk_size=q, later_ranks=True)


IMPLEMENTATION = Implementation(
    "pallas_gpu",
    mamba3,
    platforms=("gpu",),
    supports=supports,
    block_sizes=Mamba3BlockSizes,
    heuristic=pallas_gpu_heuristic,
    space=space,
    interpretable=True,
    backward=lambda spec, block_sizes: (
        f"custom_vjp: SSD's chunk-scan, chunk-state and recurrence backward kernels; {angles_form(block_sizes)}"
    ),
)
