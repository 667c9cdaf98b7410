"""Mamba-2 SSD on Hopper: the chunk state and the chunk scan's output stage as Pallas Mosaic GPU
kernels, with 16-bit operands into float32 accumulators; the other stages are `pallas_gpu`'s.

**What runs where.** Stages 1 and 3 (weights, the recurrence between chunks) are
`pallas_gpu`'s (`common/kernels.py` has the stages), and so is the whole backward (its kernels
recompute from the inputs and the saved states, not from `y`). Stage 2, each chunk's own state
`(w ∘ x)ᵀ B`, is `_state_kernel` here, and stage 4, the output `y = ((C Bᵀ) ∘ Λ ∘ dt)(x) + f ∘
(C S_inᵀ)` of every chunk, `_scan_kernel`: each one warpgroup per (chunk of 64 positions, head,
batch row), grid `(chunks, heads, batch)`.

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

**Precision** (`benchmarks/ssd_operand_precision.py`, float64 emulation on the CPU, tables in
docs/ops/ssd.md "Accuracy"): `C Bᵀ` and `C S_inᵀ` with 16-bit operands kept `y` and the final
state inside DESIGN.md's rule; `M x` with `M` rounded to bf16 once did not (1.08x the bound),
as two bf16 halves it did (0.13x); the state product likewise (1.25x rounded once, inside as
two halves). `emulate_chunk_state` and `emulate_chunk_scan` are the kernels' arithmetic in XLA
(the same roundings, exact products), which the CPU tests carry through the whole layer and
its gradients against the float64 oracle.

**Constraints**: a Hopper GPU (compute capability 9.x), bf16 inputs (fp16's range could not
hold the 16-bit halves of float32 values such as `M` or the state: fp16 goes to `pallas_gpu`),
chunks of 64, `P` and `N` multiples of 64 up to 256 whose tiles fit shared memory
(`smem_bytes`). Otherwise the call falls back with the reason.

**Interpret mode.** Mosaic GPU's `wgmma` and TMA copies have no CPU interpret rule: CI lowers
the kernels for CUDA (`tests/ops/test_ssd_mosaic_gpu.py`) and runs their emulation; the kernels
themselves are tested on a GPU (`tests/gpu/test_ssd_gpu.py`).

**Cost** per chunk and head: the state `2·2·64·P·N` FLOPs (two halves), the scan `2·64²·N`
(`C Bᵀ`) + `2·2·64²·P` (`M x`, twice) + `2·64·N·P` (`C S_inᵀ`); bytes: `x`, `B`, `C` rows once
a kernel, the float32 state `P·N·4` written (state) and read (scan), `y` float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core import backend
from axkern.core.compat import mosaic_gpu_load
from axkern.core.op import Unsupported

from . import pallas_gpu
from .common import kernels as chunk_kernels

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
    "emulate_chunk_state",
    "emulate_chunk_scan",
    "CHUNK",
    "MosaicLayout",
]

CHUNK = 64  # positions per chunk: one warpgroup's wgmma rows
_HOPPER_KEYS = ("nvidia_h100", "nvidia_h200", "nvidia_h800", "nvidia_gh200")


def _is_hopper(spec) -> bool:
    cc = backend.compute_capability() if backend.platform() == "gpu" else None
    if cc is not None:
        return cc[0] == 9
    return spec.device_key.startswith(_HOPPER_KEYS)


_SMEM = 227 * 1024  # shared memory a Hopper block may take
_SMEM_EXTRA = 1024  # barriers and alignment, rounded up


def smem_bytes(p: int, n: int) -> int:
    """Shared memory of the larger of the two kernels at head dim `p` and state `n` (16-bit
    inputs): the scan's `C`, `B` (`[64, N]`), `x` (`[64, P]`), 16-bit state (`[P, N]`) and
    float32 `y` (`[64, P]`); the state kernel's `B`, the two halves of `w ∘ x` and the float32
    state."""
    scan = 2 * 64 * n * 2 + 64 * p * 2 + p * n * 2 + 64 * p * 4
    state = 64 * n * 2 + 2 * 64 * p * 2 + p * n * 4
    return max(scan, state) + _SMEM_EXTRA


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
    if spec.platform != "gpu" or not _is_hopper(spec):
        return f"the Mosaic GPU scan needs a Hopper GPU (compute capability 9.x), not {spec.device_kind}"
    if spec.dtype != "bfloat16":
        return (
            f"the Mosaic GPU kernels take bf16 inputs, not {spec.dtype} (their 16-bit halves of float32 values "
            "could overflow fp16's range: fp16 goes to pallas_gpu)"
        )
    return _dims_reason(spec.dim("head_dim"), spec.dim("state")) or pallas_gpu.supports(spec)


def _swizzled(shape, dtype):
    """Shared memory as `wgmma` and TMA read it: (8, 128-byte rows) tiles, 128-byte swizzle
    (also for the float32 tiles staged for TMA, against bank conflicts)."""
    cols = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(
        shape, dtype, transforms=(plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(128))
    )


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

    def product(a_smem, b_t_smem):
        def run(acc):
            plgpu.wgmma(acc, a_smem, b_t_smem.transpose((1, 0)))
            plgpu.wgmma_wait(0)
            return acc[...]

        return run

    # C Bᵀ first and its scores built, then C S_inᵀ: fewer registers live at once
    f32 = jnp.float32
    s = pl.run_scoped(product(c_smem, b_smem), plgpu.ACC((q, q), f32))  # [Q, Q]
    shape = (q, q)
    t_idx = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    s_idx = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    on_rows = lambda v: lax.broadcast_in_dim(v, shape, [0])  # noqa: E731
    on_cols = lambda v: lax.broadcast_in_dim(v, shape, [1])  # noqa: E731
    visible = (s_idx <= t_idx) & (on_rows(seg_t) == on_cols(seg_s))
    m = s * jnp.exp(jnp.where(visible, on_rows(cum_t) - on_cols(cum_s), -jnp.inf)) * on_cols(dt_s)
    m_hi = m.astype(dtype)
    m_lo = (m - m_hi.astype(f32)).astype(dtype)
    inc = pl.run_scoped(product(c_smem, s16_smem), plgpu.ACC((q, p), f32))  # [Q, P]

    def scores_times_x(acc_ref):
        plgpu.wgmma(acc_ref, m_hi, x_smem)
        plgpu.wgmma(acc_ref, m_lo, x_smem)

    y = pl.run_state(scores_times_x)(plgpu.ACC.init(inc * lax.broadcast_in_dim(f_t, (q, p), [0])))
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
    xw = x.astype(jnp.float32) * lax.broadcast_in_dim(w, x.shape, [0])
    hi = xw.astype(dtype)
    xh_smem[...] = hi
    xl_smem[...] = (xw - hi.astype(jnp.float32)).astype(dtype)
    plgpu.commit_smem()
    plgpu.barrier_wait(loaded)

    def products(acc_ref):  # (w ∘ x)ᵀ B: [P, N]
        plgpu.wgmma(acc_ref, xh_smem.transpose((1, 0)), b_smem)
        plgpu.wgmma(acc_ref, xl_smem.transpose((1, 0)), b_smem)

    p, n = own_smem.shape
    own_smem[...] = pl.run_state(products)(
        plgpu.ACC.init(plgpu.layout_cast(jnp.zeros((p, n), jnp.float32), plgpu.Layout.WGMMA))
    )
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
            _swizzled((CHUNK, n), dtype),
            _swizzled((CHUNK, p), dtype),
            _swizzled((CHUNK, p), dtype),
            _swizzled((p, n), jnp.float32),
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

    def entry(x_ref, dt_ref, cum_ref, f_ref, seg_ref, b_ref, c_ref, s_ref, y_ref):
        scratch = [
            _swizzled((CHUNK, n), dtype),
            _swizzled((CHUNK, n), dtype),
            _swizzled((CHUNK, p), dtype),
            _swizzled((p, n), dtype),
            _swizzled((CHUNK, p), jnp.float32),
        ]
        pl.run_scoped(
            lambda *scoped: _scan_kernel(
                x_ref,
                dt_ref,
                cum_ref,
                f_ref,
                seg_ref,
                b_ref,
                c_ref,
                s_ref,
                y_ref,
                scoped,
                rep=h // g,
                dtype=dtype,
            ),
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


class MosaicLayout(pallas_gpu.GpuLayout):
    """`pallas_gpu`'s layout and kernels, stages 2 and 4 forward by `chunk_state` and `chunk_scan`."""

    def chunk_state(self, xt, w, bt, *, dtype):
        return chunk_state(xt, self.to_col(w), bt)

    def chunk_scan(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, dtype):
        if sums:
            raise Unsupported("the Mosaic GPU scan takes 16-bit inputs, whose decay is cum_t - cum_s")
        return chunk_scan(
            xt, self.to_col(scale), self.to_col(cum), self.to_col(f), self.to_col(sc), bt, ct, states_in
        )


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    if block_sizes.chunk_size != CHUNK:
        raise Unsupported(f"chunk_size={block_sizes.chunk_size}: the Mosaic GPU scan runs chunks of {CHUNK}")
    if interpret:
        raise Unsupported("the Mosaic GPU scan has no interpret mode (wgmma and TMA copies have no CPU rule)")
    reason = _dims_reason(x.shape[-1], B.shape[-1])
    if reason:
        raise Unsupported(reason)
    return chunk_kernels.ssd(
        MosaicLayout, x, dt, A, B, C, D, z, segment_ids, initial_state, chunk_size=CHUNK, interpret=False
    )
