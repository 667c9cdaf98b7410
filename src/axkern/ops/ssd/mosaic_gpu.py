"""Mamba-2 SSD on Hopper: the chunk state and the chunk scan, forward and backward, as Pallas
Mosaic GPU kernels, with 16-bit operands into float32 accumulators; the other stages are
`pallas_gpu`'s.

**What runs where.** Stages 1 and 3 (weights, the recurrence between chunks and its reverse)
are XLA's and `pallas_gpu`'s Triton kernels (`common/kernels.py` has the stages,
`common/gpu.py` the recurrence). Stage 2, each chunk's own state `(w ∘ x)ᵀ B`, is
`_state_kernel` here and its backward `_state_bwd_kernel`; stage 4, the output
`y = ((C Bᵀ) ∘ Λ ∘ dt)(x) + f ∘ (C S_inᵀ)` of every chunk, `_scan_kernel` and its backward
`_scan_bwd_kernel`. Each: one warpgroup per (batch row, head, chunk of 64 positions).

**The state kernel.** TMA copies the chunk's `B` rows (`[64, N]`); `x` (`[64, P]`) is read into
registers, scaled by `w` per row and stored as two 16-bit halves (`w ∘ x = hi + lo`, what the
rounding loses as `bf16x2`); two `wgmma`s with the halves transposed as the left operand give
the `[P, N]` float32 state, written back through shared memory by TMA.

**The scan kernel.** TMA copies the chunk's `C` and `B` rows (`[64, N]`, the head's group) and `x`
rows (`[64, P]`) into swizzled shared memory; the state entering the chunk (`[P, N]`, float32)
is read into registers, rounded to the input dtype and stored beside them. Two `wgmma`s:
`s = C Bᵀ` (`[64, 64]`) and `C S_inᵀ` (`[64, P]`), float32 accumulators. In registers,
`M = s ∘ exp(cum_t - cum_s) ∘ dt_s` where `s <= t` in one segment (else 0), split as
`M = M_hi + M_lo`, each in the input dtype (what the rounding of `M` loses, as `bf16x2`); the
accumulator starts at `f_t · (C S_inᵀ)` and takes `M_hi x` and `M_lo x` (two `wgmma`s with
their left operand in registers). `y` (float32) goes back through shared memory by TMA.

**The state's backward**: `d(w ∘ x) = B dSᵀ` (`dS`, float32, as two halves in shared memory),
giving `dx` and `dw`, and `dB = (w ∘ x) dS` (three products: both operands float32).

**The scan's backward** (the Triton `_scan_bwd_kernel`'s sums, `common/kernels.py`), each
result stored and sent out by TMA as soon as it is formed: `df` from `C S_inᵀ`; `C Bᵀ` and its
decayed `M` (rows t, columns s); `dM = (dy xᵀ) ∘ dt_s` from `dy`'s two halves in registers;
`dcum`, `dcum_row` the row and column sums of `dM ∘ M`; `Mᵀ dy` from `M`'s halves stored in
shared memory and read transposed, times `dy`'s halves there (three products: hi·hi, hi·lo,
lo·hi), giving `dx` and `ddt`; then the halves of `dg = dM ∘ Λ` and of `f ∘ dy` take `M`'s and
`dy`'s places in shared memory for `dS_in = (f ∘ dy)ᵀ C`, `dC = dg B + (f ∘ dy) S_in` and
`dB = dgᵀ C`. Every float32 operand is taken as its two 16-bit halves (the state's too), so
the products are about as exact as float32 ones.

**Precision** (`benchmarks/ssd_operand_precision.py`, float64 emulation on the CPU, tables in
docs/ops/ssd.md "Accuracy"): `C Bᵀ` and `C S_inᵀ` with 16-bit operands kept `y` and the final
state inside DESIGN.md's rule; `M x` with `M` rounded to bf16 once did not (1.08x the bound),
as two bf16 halves it did (0.13x); the state product likewise (1.25x rounded once, inside as
two halves). `emulate_chunk_state`, `emulate_chunk_scan` and `emulate_chunk_scan_bwd` are the
kernels' arithmetic in XLA (the same roundings, exact products), which the CPU tests carry
through the whole layer and its gradients against the float64 oracle.

**Constraints**: a Hopper GPU (compute capability 9.x), bf16 inputs (fp16's range could not
hold the 16-bit halves of float32 values such as `M` or the state: fp16 goes to `pallas_gpu`),
chunks of 64, `P` and `N` multiples of 64 whose tiles fit shared memory in all four kernels
(`smem_bytes`: 64 and 64, 64 and 128, 128 and 64). Otherwise the call falls back with the
reason.

**Interpret mode.** Mosaic GPU's `wgmma` and TMA copies have no CPU interpret rule: CI lowers
the kernels for CUDA (`tests/ops/test_ssd_mosaic_gpu.py`) and runs their emulation; the kernels
themselves are tested on a GPU (`tests/gpu/test_ssd_gpu.py`).

**Cost** per chunk and head (Q = 64 positions), in tensor-core FLOPs: the state `4·Q·P·N` (two
halves), its backward `10·Q·P·N`; the scan `2·Q²·N` (`C Bᵀ`) + `4·Q²·P` (`M x`, two halves) + `2·Q·P·N` (`C S_inᵀ`); its
backward `10·Q²·(N + P) + 14·Q·P·N` (`C Bᵀ`; `dM` and `Mᵀ dy` with two and three products;
`dg B`, `dgᵀ C` with two each; `f∘dy S_in` with three; `C S_inᵀ`, `dS_in` with two each).
Bytes: `x`, `B`, `C` rows once a kernel, the float32 state `P·N·4` written (state) and read
(scan, backward), `y`, `dy`, `dx`, `dB`, `dC` float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core import backend
from axkern.core.compat import mosaic_gpu_load
from axkern.core.kernels import swizzled_smem
from axkern.core.op import Unsupported

from .common import kernels as chunk_kernels
from .common.gpu import GpuLayout

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means the kernel cannot serve
    plgpu, _IMPORT_ERROR = None, e

__all__ = [
    "supports",
    "ssd",
    "chunk_state",
    "chunk_scan",
    "chunk_state_bwd",
    "chunk_scan_bwd",
    "emulate_chunk_state",
    "emulate_chunk_state_bwd",
    "emulate_chunk_scan_bwd",
    "emulate_chunk_scan",
    "CHUNK",
    "MosaicLayout",
]

CHUNK = 64  # positions per chunk: one warpgroup's wgmma rows


_SMEM = 227 * 1024  # shared memory a Hopper block may take
_SMEM_EXTRA = 1024 + 2048  # barriers and alignment, rounded up; Mosaic GPU's scratch for cross-warp sums


def smem_bytes(p: int, n: int) -> int:
    """Shared memory of the largest of the four kernels at head dim `p` and state `n` (16-bit
    inputs): the scan's `C`, `B` (`[64, N]`), `x` (`[64, P]`), 16-bit state (`[P, N]`) and
    float32 `y` (`[64, P]`); the state kernel's `B`, the two halves of `w ∘ x` and the float32
    state; the scan backward's `C`, `B`, `x`, the halves of the state, of `dy` and of `M`, and
    its float32 `dx`, `dB` / `dC`, `dS_in` and vectors; the state backward's `B`, the halves of
    `dS`, and its float32 `dx`, `dB`, `dw`."""
    scan = 2 * 64 * n * 2 + 64 * p * 2 + p * n * 2 + 64 * p * 4
    state = 64 * n * 2 + 2 * 64 * p * 2 + p * n * 4
    backward = 2 * 64 * n * 2 + 64 * p * 2 + 2 * p * n * 2 + 2 * 64 * p * 2 + 2 * 64 * 64 * 2
    backward += 64 * p * 4 + 64 * n * 4 + p * n * 4 + 4 * 64 * 4
    state_backward = 64 * n * 2 + 2 * p * n * 2 + 64 * p * 4 + 64 * n * 4 + 64 * 4
    return max(scan, state, backward, state_backward) + _SMEM_EXTRA


def _dims_reason(p: int, n: int) -> str | None:
    for name, d in (("head_dim", p), ("state", n)):
        if d % 64 or d > 256:
            return f"{name}={d}: the Mosaic GPU kernels take multiples of 64 up to 256"
    if smem_bytes(p, n) > _SMEM:
        return (
            f"head_dim={p}, state={n}: the Mosaic GPU kernels would take {smem_bytes(p, n)} bytes of shared "
            f"memory, more than a Hopper block's {_SMEM}"
        )
    return None


def supports(spec) -> str | None:
    if _IMPORT_ERROR is not None:
        return f"jax.experimental.pallas.mosaic_gpu does not import here ({_IMPORT_ERROR})"
    if spec.platform != "gpu" or not backend.is_hopper(spec):
        return f"the Mosaic GPU kernels need a Hopper GPU (compute capability 9.x), not {spec.device_kind}"
    if spec.dtype != "bfloat16":
        return (
            f"the Mosaic GPU kernels take bf16 inputs, not {spec.dtype} (their 16-bit halves of float32 values "
            "could overflow fp16's range: fp16 goes to pallas_gpu)"
        )
    return _dims_reason(spec.dim("head_dim"), spec.dim("state"))


def _scan_kernel(x_ref, dt_ref, cum_ref, f_ref, seg_ref, b_ref, c_ref, s_ref, y_ref, scoped, *, rep, dtype):
    (c_smem, b_smem, x_smem, s16_smem, y_smem), loaded = scoped
    chunk, head, batch = lax.axis_index("chunks"), lax.axis_index("heads"), lax.axis_index("batch")
    q, p = x_smem.shape
    base = chunk * q
    group = lax.div(head, jnp.int32(rep))
    rows = pl.ds(base, q)
    # a barrier per copy (each copy arrives on its barrier once, with its bytes)
    plgpu.copy_gmem_to_smem(c_ref.at[batch, group, rows], c_smem, loaded.at[0])
    plgpu.copy_gmem_to_smem(b_ref.at[batch, group, rows], b_smem, loaded.at[1])
    plgpu.copy_gmem_to_smem(x_ref.at[batch, head, rows], x_smem, loaded.at[2])

    # per position: along the tile's rows (t) or its columns (s)
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    vec = lambda ref, layout: mosaic_gpu_load(ref.at[batch, head, rows], layout=layout, optimized=False)  # noqa: E731
    cum_t, cum_s, dt_s, f_t = vec(cum_ref, row), vec(cum_ref, col), vec(dt_ref, col), vec(f_ref, row)
    seg_t = mosaic_gpu_load(seg_ref.at[batch, rows], layout=row, optimized=False)
    seg_s = mosaic_gpu_load(seg_ref.at[batch, rows], layout=col, optimized=False)
    state = mosaic_gpu_load(s_ref.at[batch, chunk, head], layout=plgpu.Layout.WGMMA, optimized=False)
    s16_smem[...] = state.astype(dtype)  # [P, N]
    plgpu.commit_smem()
    for i in range(3):
        plgpu.barrier_wait(loaded.at[i])

    # C Bᵀ first and its scores built, then C S_inᵀ: fewer registers live at once
    s = _products((q, q), [(c_smem, b_smem, True)])  # [Q, Q]
    shape = (q, q)
    t_idx = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    s_idx = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    on_rows = lambda v: lax.broadcast_in_dim(v, shape, [0])  # noqa: E731
    on_cols = lambda v: lax.broadcast_in_dim(v, shape, [1])  # noqa: E731
    visible = (s_idx <= t_idx) & (on_rows(seg_t) == on_cols(seg_s))
    m = s * jnp.exp(jnp.where(visible, on_rows(cum_t) - on_cols(cum_s), -jnp.inf)) * on_cols(dt_s)
    m_hi, m_lo = _halves(m, dtype)
    inc = _products((q, p), [(c_smem, s16_smem, True)])  # [Q, P]
    y = _products((q, p), [(m_hi, x_smem, False), (m_lo, x_smem, False)])
    y = y + inc * lax.broadcast_in_dim(f_t, (q, p), [0])
    y_smem[...] = y
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(y_smem, y_ref.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)


def _state_kernel(x_ref, w_ref, b_ref, own_ref, scoped, *, rep, dtype):
    (b_smem, xh_smem, xl_smem, own_smem), loaded = scoped
    chunk, head, batch = lax.axis_index("chunks"), lax.axis_index("heads"), lax.axis_index("batch")
    q = b_smem.shape[0]
    rows = pl.ds(chunk * q, q)
    plgpu.copy_gmem_to_smem(b_ref.at[batch, lax.div(head, jnp.int32(rep)), rows], b_smem, loaded)
    # w ∘ x in registers (w per row), as two 16-bit halves in shared memory
    x = mosaic_gpu_load(x_ref.at[batch, head, rows], layout=plgpu.Layout.WGMMA, optimized=False)
    w = mosaic_gpu_load(w_ref.at[batch, head, rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    xh_smem[...], xl_smem[...] = _halves(x.astype(jnp.float32) * lax.broadcast_in_dim(w, x.shape, [0]), dtype)
    plgpu.commit_smem()
    plgpu.barrier_wait(loaded)
    # (w ∘ x)ᵀ B: [P, N]
    pairs = [(xh_smem.transpose((1, 0)), b_smem, False), (xl_smem.transpose((1, 0)), b_smem, False)]
    own_smem[...] = _products(own_smem.shape, pairs)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(own_smem, own_ref.at[batch, chunk, head])
    plgpu.wait_smem_to_gmem(0)


def _check_operands(xt, bt, *rest):
    b, h, lp, p = xt.shape
    if lp % CHUNK:
        raise ValueError(f"length {lp} is not a multiple of the chunk ({CHUNK})")
    reason = _dims_reason(p, bt.shape[-1])
    if reason:
        raise Unsupported(reason)
    if any(a.dtype != jnp.bfloat16 for a in (xt, bt, *rest)):
        dtypes = ", ".join(str(a.dtype) for a in (xt, bt, *rest))
        raise Unsupported(f"x, B, C are {dtypes}: the Mosaic GPU kernels take bf16")


def chunk_state(xt, w, bt):
    """Each chunk's own state `[b, c, h, P, N]` float32, `(w ∘ x)ᵀ B` (`xt [b, h, L, P]`, `bt [b,
    g, L, N]` in one 16-bit dtype, `w [b, h, L]` float32, `L = c · CHUNK`) by the Mosaic GPU
    kernel: `w ∘ x` as two 16-bit halves (`bf16x2`), `B` as it is."""
    _check_operands(xt, bt)
    b, h, lp, p = xt.shape
    g, n = bt.shape[1], bt.shape[-1]
    dtype = xt.dtype

    def entry(x_ref, w_ref, b_ref, own_ref):
        scratch = [
            swizzled_smem((CHUNK, n), dtype),
            swizzled_smem((CHUNK, p), dtype),
            swizzled_smem((CHUNK, p), dtype),
            swizzled_smem((p, n), jnp.float32),
        ]
        pl.run_scoped(
            lambda *scoped: _state_kernel(x_ref, w_ref, b_ref, own_ref, scoped, rep=h // g, dtype=dtype),
            scratch,
            plgpu.Barrier(),
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((b, lp // CHUNK, h, p, n), jnp.float32),
        grid=(b, h, lp // CHUNK),  # the chunks on CUDA's x axis (the others take at most 65535)
        grid_names=("batch", "heads", "chunks"),
        kernel_name="axkern_ssd_mosaic_gpu_state",
    )(xt, w, bt)


def chunk_scan(xt, dt, cum, f, seg, bt, ct, states_in):
    """`y [b, h, L, P]` float32 of the chunks (`xt [b, h, L, P]`, `bt, ct [b, g, L, N]` in one
    16-bit dtype; `dt, cum, f [b, h, L]` float32; `seg [b, L]` int32; `states_in [b, c, h, P, N]`
    float32, `L = c · CHUNK`) by the Mosaic GPU kernel."""
    _check_operands(xt, bt, ct)
    b, h, lp, p = xt.shape
    g, n = bt.shape[1], bt.shape[-1]
    dtype = xt.dtype

    def entry(*refs):
        scratch = [
            swizzled_smem((CHUNK, n), dtype),
            swizzled_smem((CHUNK, n), dtype),
            swizzled_smem((CHUNK, p), dtype),
            swizzled_smem((p, n), dtype),
            swizzled_smem((CHUNK, p), jnp.float32),
        ]
        pl.run_scoped(
            lambda *scoped: _scan_kernel(*refs, scoped, rep=h // g, dtype=dtype),
            scratch,
            plgpu.Barrier(num_barriers=3),
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((b, h, lp, p), jnp.float32),
        grid=(b, h, lp // CHUNK),  # the chunks on CUDA's x axis (the others take at most 65535)
        grid_names=("batch", "heads", "chunks"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="axkern_ssd_mosaic_gpu_scan",
    )(xt, dt, cum, f, seg.astype(jnp.int32), bt, ct, states_in)


def _halves(a, dtype):
    """`a` (float32) as `hi + lo`, both in `dtype`: `lo` what the rounding to `hi` lost."""
    hi = a.astype(dtype)
    return hi, (a - hi.astype(jnp.float32)).astype(dtype)


def _products(shape, pairs):
    """`Σ a @ b` over `pairs` of (left, right, transpose the right?) into a zeroed float32
    accumulator of `shape`, waited for."""

    def run(acc_ref):
        for a, b, trans in pairs:
            plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if trans else b)

    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    return pl.run_state(run)(plgpu.ACC.init(zeros))


def _scan_bwd_kernel(
    dy_ref,
    x_ref,
    dt_ref,
    cum_ref,
    f_ref,
    seg_ref,
    b_ref,
    c_ref,
    s_ref,
    dx_ref,
    ddt_ref,
    dcum_ref,
    dcum_row_ref,
    df_ref,
    db_ref,
    dc_ref,
    ds_ref,
    scoped,
    *,
    rep,
    dtype,
):
    (c_smem, b_smem, x_smem, sh_smem, sl_smem, ah_smem, al_smem, mh_smem, ml_smem, *outs), loaded = scoped
    dx_smem, dbc_smem, ds_smem, vec_smem = outs
    batch, head, chunk = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("chunks")
    q, p = x_smem.shape
    n = c_smem.shape[1]
    rows = pl.ds(chunk * q, q)
    group = lax.div(head, jnp.int32(rep))
    plgpu.copy_gmem_to_smem(c_ref.at[batch, group, rows], c_smem, loaded.at[0])
    plgpu.copy_gmem_to_smem(b_ref.at[batch, group, rows], b_smem, loaded.at[1])
    plgpu.copy_gmem_to_smem(x_ref.at[batch, head, rows], x_smem, loaded.at[2])

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
    dy = mosaic_gpu_load(dy_ref.at[batch, head, rows], layout=wgmma_layout, optimized=False)  # [Q, P] f32
    # the state and the cotangent as two 16-bit halves in shared memory (every product with
    # a float32 operand takes its halves: bf16x2, or three products when both are float32)
    sh, sl = _halves(
        mosaic_gpu_load(s_ref.at[batch, chunk, head], layout=wgmma_layout, optimized=False), dtype
    )
    sh_smem[...], sl_smem[...] = sh, sl
    ah_smem[...], al_smem[...] = _halves(dy, dtype)
    plgpu.commit_smem()
    for i in range(3):
        plgpu.barrier_wait(loaded.at[i])

    def put(smem, value, ref):
        """`value` out through `smem` by TMA (the copy left in flight)."""
        smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, ref)

    # each result leaves as soon as it is formed (fewer registers live at once): df first
    inc = _products((q, p), [(c_smem, sh_smem, True), (c_smem, sl_smem, True)])  # C S_inᵀ
    vec_smem.at[2][...] = jnp.sum(dy * inc, axis=1)  # df

    # scores and decay, rows t by columns s
    scores = _products((q, q), [(c_smem, b_smem, True)])
    shape = (q, q)
    t_idx = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
    s_idx = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)
    on_rows = lambda v: lax.broadcast_in_dim(v, shape, [0])  # noqa: E731
    on_cols = lambda v: lax.broadcast_in_dim(v, shape, [1])  # noqa: E731
    visible = (s_idx <= t_idx) & (on_rows(seg_t) == on_cols(seg_s))
    decay = jnp.exp(jnp.where(visible, on_rows(cum_t) - on_cols(cum_s), -jnp.inf))
    m = scores * decay
    mh, ml = _halves(m, dtype)
    mh_smem[...], ml_smem[...] = mh, ml
    plgpu.commit_smem()

    # dM = dy (dt ∘ x)ᵀ: dy's halves (registers, formed again here) times xᵀ, scaled by dt per column
    dyh, dyl = _halves(dy, dtype)
    dm = _products(shape, [(dyh, x_smem, True), (dyl, x_smem, True)]) * on_cols(dt_s)
    e = dm * m
    vec_smem.at[1][...] = jnp.sum(e, axis=1)  # dcum: rows t
    vec_smem.at[3][...] = jnp.sum(e, axis=0)  # dcum_row: columns s
    dg = dm * decay

    # d(dt ∘ x) = Mᵀ dy, rows s: M's halves transposed from shared memory, dy's halves
    m_t = (mh_smem.transpose((1, 0)), ml_smem.transpose((1, 0)))
    dxd = _products((q, p), [(m_t[0], ah_smem, False), (m_t[0], al_smem, False), (m_t[1], ah_smem, False)])
    x = mosaic_gpu_load(x_ref.at[batch, head, rows], layout=wgmma_layout, optimized=False).astype(f32)
    vec_smem.at[0][...] = jnp.sum(dxd * x, axis=1)  # ddt
    put(dx_smem, dxd * lax.broadcast_in_dim(dt_t, (q, p), [0]), dx_ref.at[batch, head, rows])

    # dg's halves take M's place in shared memory and f ∘ dy's take dy's (their products are done)
    mh_smem[...], ml_smem[...] = _halves(dg, dtype)
    ah_smem[...], al_smem[...] = _halves(dy * lax.broadcast_in_dim(f_t, (q, p), [0]), dtype)
    plgpu.commit_smem()
    # dS_in = (f ∘ dy)ᵀ C
    ds = _products(
        (p, n), [(ah_smem.transpose((1, 0)), c_smem, False), (al_smem.transpose((1, 0)), c_smem, False)]
    )
    put(ds_smem, ds, ds_ref.at[batch, chunk, head])
    # dC = dg B + (f ∘ dy) S_in (rows t), then dB = dgᵀ C (rows s) through the same staging tile
    dc = _products(
        (q, n),
        [
            (mh_smem, b_smem, False),
            (ml_smem, b_smem, False),
            (ah_smem, sh_smem, False),
            (ah_smem, sl_smem, False),
            (al_smem, sh_smem, False),
        ],
    )
    put(dbc_smem, dc, dc_ref.at[batch, head, rows])
    db = _products(
        (q, n), [(mh_smem.transpose((1, 0)), c_smem, False), (ml_smem.transpose((1, 0)), c_smem, False)]
    )
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dC has left the staging tile
    put(dbc_smem, db, db_ref.at[batch, head, rows])
    for i, ref in enumerate((ddt_ref, dcum_ref, df_ref, dcum_row_ref)):
        plgpu.copy_smem_to_gmem(vec_smem.at[i], ref.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)


def chunk_scan_bwd(dy, xt, dt, cum, f, seg, bt, ct, states_in):
    """Stage 4's backward by the Mosaic GPU kernel: `(dx [b, h, L, P], ddt, dcum, dcum_row, df
    [b, h, L], dB, dC [b, h, L, N], dS_in [b, c, h, P, N])`, float32, per head, from the
    cotangent `dy [b, h, L, P]` (float32) and `chunk_scan`'s arguments. `dcum` holds each row's
    sum of `dM ∘ M` and `dcum_row` each column's (`common/kernels.py`'s backward)."""
    _check_operands(xt, bt, ct)
    b, h, lp, p = xt.shape
    g, n = bt.shape[1], bt.shape[-1]
    c = lp // CHUNK
    dtype = xt.dtype
    f32 = jnp.float32

    def entry(*refs):
        scratch = [
            swizzled_smem((CHUNK, n), dtype),  # C
            swizzled_smem((CHUNK, n), dtype),  # B
            swizzled_smem((CHUNK, p), dtype),  # x
            swizzled_smem((p, n), dtype),  # the state's halves
            swizzled_smem((p, n), dtype),
            swizzled_smem((CHUNK, p), dtype),  # dy's halves, then dyf's
            swizzled_smem((CHUNK, p), dtype),
            swizzled_smem((CHUNK, CHUNK), dtype),  # M's halves, then dg's
            swizzled_smem((CHUNK, CHUNK), dtype),
            swizzled_smem((CHUNK, p), f32),  # dx
            swizzled_smem((CHUNK, n), f32),  # dB, then dC
            swizzled_smem((p, n), f32),  # dS_in
            plgpu.SMEM((4, CHUNK), f32),  # ddt, dcum, df, dcum_row
        ]
        pl.run_scoped(
            lambda *scoped: _scan_bwd_kernel(*refs, scoped, rep=h // g, dtype=dtype),
            scratch,
            plgpu.Barrier(num_barriers=3),
        )

    rows = lambda d: jax.ShapeDtypeStruct((b, h, lp, d), f32)  # noqa: E731
    vector = jax.ShapeDtypeStruct((b, h, lp), f32)
    return plgpu.kernel(
        entry,
        out_type=(
            rows(p),
            vector,
            vector,
            vector,
            vector,
            rows(n),
            rows(n),
            jax.ShapeDtypeStruct((b, c, h, p, n), f32),
        ),
        grid=(b, h, c),
        grid_names=("batch", "heads", "chunks"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="axkern_ssd_mosaic_gpu_scan_bwd",
    )(dy.astype(f32), xt, dt, cum, f, seg.astype(jnp.int32), bt, ct, states_in)


def _state_bwd_kernel(x_ref, w_ref, b_ref, ds_ref, dx_ref, dw_ref, db_ref, scoped, *, rep, dtype):
    (b_smem, dsh_smem, dsl_smem, dx_smem, db_smem, dw_smem), loaded = scoped
    batch, head, chunk = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("chunks")
    q, n = b_smem.shape
    p = dsh_smem.shape[0]
    rows = pl.ds(chunk * q, q)
    plgpu.copy_gmem_to_smem(b_ref.at[batch, lax.div(head, jnp.int32(rep)), rows], b_smem, loaded)
    f32, wgmma_layout = jnp.float32, plgpu.Layout.WGMMA
    # dS (float32) as two 16-bit halves in shared memory; w ∘ x's halves in registers
    dsh, dsl = _halves(
        mosaic_gpu_load(ds_ref.at[batch, chunk, head], layout=wgmma_layout, optimized=False), dtype
    )
    dsh_smem[...], dsl_smem[...] = dsh, dsl
    x = mosaic_gpu_load(x_ref.at[batch, head, rows], layout=wgmma_layout, optimized=False).astype(f32)
    w = mosaic_gpu_load(w_ref.at[batch, head, rows], layout=wgmma_layout.reduce(1), optimized=False)
    xw_h, xw_l = _halves(x * lax.broadcast_in_dim(w, x.shape, [0]), dtype)
    plgpu.commit_smem()
    plgpu.barrier_wait(loaded)

    # d(w ∘ x) = B dSᵀ (rows t), stored at once; dB = (w ∘ x) dS, three products (both float32)
    dxw = _products((q, p), [(b_smem, dsh_smem, True), (b_smem, dsl_smem, True)])
    dx_smem[...] = dxw * lax.broadcast_in_dim(w, (q, p), [0])
    dw_smem[...] = jnp.sum(dxw * x, axis=1)
    db_smem[...] = _products(
        (q, n), [(xw_h, dsh_smem, False), (xw_h, dsl_smem, False), (xw_l, dsh_smem, False)]
    )
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dx_smem, dx_ref.at[batch, head, rows])
    plgpu.copy_smem_to_gmem(db_smem, db_ref.at[batch, head, rows])
    plgpu.copy_smem_to_gmem(dw_smem, dw_ref.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)


def chunk_state_bwd(xt, w, bt, d_own):
    """Stage 2's backward by the Mosaic GPU kernel, `dS` (`d_own [b, c, h, P, N]`, float32)
    pulled back through `S = (w ∘ x)ᵀ B`: `(dx [b, h, L, P], dw [b, h, L], dB [b, h, L, N])`,
    float32, per head; `chunk_state`'s other arguments."""
    _check_operands(xt, bt)
    b, h, lp, p = xt.shape
    g, n = bt.shape[1], bt.shape[-1]
    dtype, f32 = xt.dtype, jnp.float32

    def entry(*refs):
        scratch = [
            swizzled_smem((CHUNK, n), dtype),  # B
            swizzled_smem((p, n), dtype),  # dS's halves
            swizzled_smem((p, n), dtype),
            swizzled_smem((CHUNK, p), f32),  # dx
            swizzled_smem((CHUNK, n), f32),  # dB
            plgpu.SMEM((CHUNK,), f32),  # dw
        ]
        pl.run_scoped(
            lambda *scoped: _state_bwd_kernel(*refs, scoped, rep=h // g, dtype=dtype),
            scratch,
            plgpu.Barrier(),
        )

    return plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((b, h, lp, p), f32),
            jax.ShapeDtypeStruct((b, h, lp), f32),
            jax.ShapeDtypeStruct((b, h, lp, n), f32),
        ),
        grid=(b, h, lp // CHUNK),
        grid_names=("batch", "heads", "chunks"),
        kernel_name="axkern_ssd_mosaic_gpu_state_bwd",
    )(xt, w, bt, d_own)


def emulate_chunk_state_bwd(xt, w, bt, d_own):
    """`chunk_state_bwd`'s arithmetic in XLA (`dS` and `w ∘ x` as two halves, three products for
    `dB`, exact products); arguments and results as `chunk_state_bwd`'s."""
    b, h, lp, p = xt.shape
    g = bt.shape[1]
    c = lp // CHUNK
    dtype = xt.dtype
    ein = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    halves = lambda a: (_round(a, dtype), _round(a - _round(a, dtype), dtype))  # noqa: E731
    x = xt.astype(jnp.float32).reshape(b, h, c, CHUNK, p)
    wc = w.reshape(b, h, c, CHUNK)
    bm = jnp.repeat(bt, h // g, axis=1).astype(jnp.float32).reshape(b, h, c, CHUNK, -1)
    dsh, dsl = halves(jnp.moveaxis(d_own, 1, 2))  # [b, h, c, P, N]
    dxw = ein("bhctn,bhcpn->bhctp", bm, dsh) + ein("bhctn,bhcpn->bhctp", bm, dsl)
    xwh, xwl = halves(x * wc[..., None])
    db = sum(ein("bhctp,bhcpn->bhctn", a, r) for a, r in ((xwh, dsh), (xwh, dsl), (xwl, dsh)))
    dx = dxw * wc[..., None]
    dw = (dxw * x).sum(-1)
    return dx.reshape(b, h, lp, p), dw.reshape(b, h, lp), db.reshape(b, h, lp, -1)


def _round(a, dtype):
    return a.astype(dtype).astype(jnp.float32)


def emulate_chunk_scan(xt, dt, cum, f, seg, bt, ct, states_in):
    """`chunk_scan`'s arithmetic in XLA: the same operands rounded to the input dtype (`C`, `B`,
    `x`, the state, and `M` as two halves), products exact in float32. Arguments as
    `chunk_scan`'s; for the CPU tests, which hold it to the oracle rule through the layer."""
    b, h, lp, p = xt.shape
    g = bt.shape[1]
    c = lp // CHUNK
    dtype = xt.dtype
    hi = jax.lax.Precision.HIGHEST
    per = lambda a: a.reshape(*a.shape[:-2], c, CHUNK, a.shape[-1])  # noqa: E731 - [.., c, Q, d]
    heads = lambda a: jnp.repeat(a, h // g, axis=1)  # noqa: E731 - groups -> heads
    x = per(xt).astype(jnp.float32)
    bm, cm = per(heads(bt)).astype(jnp.float32), per(heads(ct)).astype(jnp.float32)
    vec = lambda a: a.reshape(b, h, c, CHUNK)  # noqa: E731
    cum_c, dt_c, f_c = vec(cum), vec(dt), vec(f)
    seg_c = seg.reshape(b, 1, c, CHUNK)
    s = jnp.einsum("bhctn,bhcsn->bhcts", cm, bm, precision=hi)
    t_idx, s_idx = jnp.arange(CHUNK)[:, None], jnp.arange(CHUNK)[None, :]
    visible = (s_idx <= t_idx) & (seg_c[..., :, None] == seg_c[..., None, :])
    m = (
        s
        * jnp.exp(jnp.where(visible, cum_c[..., :, None] - cum_c[..., None, :], -jnp.inf))
        * dt_c[..., None, :]
    )
    m_hi = _round(m, dtype)
    m_lo = _round(m - m_hi, dtype)
    state = _round(jnp.moveaxis(states_in, 1, 2), dtype)  # [b, h, c, P, N]
    inc = jnp.einsum("bhctn,bhcpn->bhctp", cm, state, precision=hi)
    y = f_c[..., None] * inc + jnp.einsum("bhcts,bhcsp->bhctp", m_hi, x, precision=hi)
    y = y + jnp.einsum("bhcts,bhcsp->bhctp", m_lo, x, precision=hi)
    return y.reshape(b, h, lp, p)


def emulate_chunk_state(xt, w, bt):
    """`chunk_state`'s arithmetic in XLA: `w ∘ x` as two halves in the input dtype, products
    exact in float32. Arguments as `chunk_state`'s."""
    b, h, lp, p = xt.shape
    g = bt.shape[1]
    c = lp // CHUNK
    dtype = xt.dtype
    xw = xt.astype(jnp.float32) * w[..., None]
    hi = _round(xw, dtype)
    lo = _round(xw - hi, dtype)
    bm = jnp.repeat(bt, h // g, axis=1).astype(jnp.float32).reshape(b, h, c, CHUNK, -1)
    per = lambda a: a.reshape(b, h, c, CHUNK, p)  # noqa: E731
    prec = jax.lax.Precision.HIGHEST
    own = jnp.einsum("bhctp,bhctn->bhcpn", per(hi), bm, precision=prec)
    own = own + jnp.einsum("bhctp,bhctn->bhcpn", per(lo), bm, precision=prec)
    return jnp.moveaxis(own, 2, 1)  # [b, c, h, P, N]


def emulate_chunk_scan_bwd(dy, xt, dt, cum, f, seg, bt, ct, states_in):
    """`chunk_scan_bwd`'s arithmetic in XLA: every float32 operand as its two halves in the
    input dtype (three products where both operands are float32: hi·hi, hi·lo, lo·hi), `x`,
    `B`, `C` as they are, products exact in float32. Arguments and results as
    `chunk_scan_bwd`'s."""
    b, h, lp, p = xt.shape
    g = bt.shape[1]
    c = lp // CHUNK
    dtype = xt.dtype
    prec = jax.lax.Precision.HIGHEST
    ein = functools.partial(jnp.einsum, precision=prec)
    halves = lambda a: (_round(a, dtype), _round(a - _round(a, dtype), dtype))  # noqa: E731
    per = lambda a: a.reshape(b, h, c, CHUNK, a.shape[-1])  # noqa: E731
    heads = lambda a: per(jnp.repeat(a, h // g, axis=1).astype(jnp.float32))  # noqa: E731
    vec = lambda a: a.reshape(b, h, c, CHUNK)  # noqa: E731
    x, bm, cm, dyc = per(xt.astype(jnp.float32)), heads(bt), heads(ct), per(dy.astype(jnp.float32))
    cum_c, dt_c, f_c = vec(cum), vec(dt), vec(f)
    seg_c = seg.reshape(b, 1, c, CHUNK)
    state = jnp.moveaxis(states_in, 1, 2)  # [b, h, c, P, N]
    sh, sl = halves(state)
    dyh, dyl = halves(dyc)
    t_idx, s_idx = jnp.arange(CHUNK)[:, None], jnp.arange(CHUNK)[None, :]
    visible = (s_idx <= t_idx) & (seg_c[..., :, None] == seg_c[..., None, :])
    decay = jnp.exp(jnp.where(visible, cum_c[..., :, None] - cum_c[..., None, :], -jnp.inf))
    m = ein("bhctn,bhcsn->bhcts", cm, bm) * decay
    mh, ml = halves(m)
    dm = (ein("bhctp,bhcsp->bhcts", dyh, x) + ein("bhctp,bhcsp->bhcts", dyl, x)) * dt_c[..., None, :]
    e = dm * m
    dcum, dcum_row = e.sum(-1), e.sum(-2)
    dg = dm * decay
    mt = lambda a, r: ein("bhcts,bhctp->bhcsp", a, r)  # noqa: E731 - Mᵀ r
    dxd = mt(mh, dyh) + mt(mh, dyl) + mt(ml, dyh)
    dx = dxd * dt_c[..., None]
    ddt = (dxd * x).sum(-1)
    dgh, dgl = halves(dg)
    dyfh, dyfl = halves(dyc * f_c[..., None])
    dc = ein("bhcts,bhcsn->bhctn", dgh, bm) + ein("bhcts,bhcsn->bhctn", dgl, bm)
    for a, r in ((dyfh, sh), (dyfh, sl), (dyfl, sh)):
        dc = dc + ein("bhctp,bhcpn->bhctn", a, r)
    db = ein("bhcts,bhctn->bhcsn", dgh, cm) + ein("bhcts,bhctn->bhcsn", dgl, cm)
    inc = ein("bhctn,bhcpn->bhctp", cm, sh) + ein("bhctn,bhcpn->bhctp", cm, sl)
    df = (dyc * inc).sum(-1)
    ds = ein("bhctp,bhctn->bhcpn", dyfh, cm) + ein("bhctp,bhctn->bhcpn", dyfl, cm)
    rows = lambda a: a.reshape(b, h, lp, a.shape[-1])  # noqa: E731
    flat = lambda a: a.reshape(b, h, lp)  # noqa: E731
    return (
        rows(dx),
        flat(ddt),
        flat(dcum),
        flat(dcum_row),
        flat(df),
        rows(db),
        rows(dc),
        jnp.moveaxis(ds, 2, 1),
    )


class MosaicLayout(GpuLayout):
    """`pallas_gpu`'s layout and recurrence kernels; stages 2 and 4 by `chunk_state`,
    `chunk_scan` and their backward kernels."""

    def chunk_state(self, xt, w, bt, *, dtype):
        return chunk_state(xt, self.to_col(w), bt)

    def chunk_scan(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, dtype):
        if sums:
            raise Unsupported("the Mosaic GPU kernels take 16-bit inputs, whose decay is cum_t - cum_s")
        return chunk_scan(
            xt, self.to_col(scale), self.to_col(cum), self.to_col(f), self.to_col(sc), bt, ct, states_in
        )

    def chunk_state_bwd(self, xt, w, bt, d_own):
        return chunk_state_bwd(xt, self.to_col(w), bt, d_own)

    def chunk_scan_bwd(self, dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums):
        if sums:
            raise Unsupported("the Mosaic GPU kernels take 16-bit inputs, whose decay is cum_t - cum_s")
        to_col = self.to_col
        return chunk_scan_bwd(dy, xt, to_col(scale), to_col(cum), to_col(f), to_col(sc), bt, ct, states_in)


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    if block_sizes.chunk_size != CHUNK:
        raise Unsupported(
            f"chunk_size={block_sizes.chunk_size}: the Mosaic GPU kernels run chunks of {CHUNK}"
        )
    if interpret:
        raise Unsupported(
            "the Mosaic GPU kernels have no interpret mode (wgmma and TMA copies have no CPU rule)"
        )
    reason = _dims_reason(x.shape[-1], B.shape[-1])
    if reason:
        raise Unsupported(reason)
    return chunk_kernels.ssd(
        MosaicLayout, x, dt, A, B, C, D, z, segment_ids, initial_state, chunk_size=CHUNK, interpret=False
    )
