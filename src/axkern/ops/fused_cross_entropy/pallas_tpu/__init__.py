"""The fused cross-entropy statistics as a Mosaic TPU Pallas kernel: no logits in HBM.

In CI in TPU interpret mode (`pltpu.InterpretParams`, out-of-bounds reads of ragged edge
blocks uninitialised, as on the chip) and lowered for a TPU; compiled on a TPU v5e it passes
`tests/tpu` and is first in the TPU order (docs/tpu.md, "Measured"); a call its `supports()` or
block checks refuse falls back to `xla`.

**Kernel.** Grid `(token blocks, vocab blocks, embed blocks)`, the last two sequential
("arbitrary"). Blocks `x[i, k]` (`block_tokens x block_embed`) and `w[k, j]`
(`block_embed x block_vocab`) are multiplied into a float32 VMEM accumulator; at the last
embed step the `[block_tokens, block_vocab]` logits tile is soft-capped and folded into
per-row running statistics held in VMEM (max, sum of exponentials, label logit, sum of
logits); at the last vocab block the row block's `lse`, label logit and logit sum are
written. Ragged edges are masked in the kernel (columns past the vocabulary do not count;
embedding columns past `D` are zeroed in both operands), so nothing is padded or copied.

**Backward: recomputation in XLA** (`common.recomputing`), as `pallas_gpu`: a Pallas `dx` would
need a `[block_tokens, D]` float32 accumulator per row block. The reduced loss under
`jax.grad` forms its gradients in the forward (`fused_cross_entropy_loss`).

**Cost.** `2·N·D·V` FLOPs (compute bound at real sizes); bytes: `x` once per vocab block, `w`
once per token block, three float32 values per token out.

**VMEM.** Two buffers of each input block plus the accumulator and the statistics:
`2·(bt·bd + bd·bv)·itemsize + 4·bt·bv + 4·4·bt` bytes; `supports()` refuses sizes over
the chip's scoped budget and names the numbers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from axkern.core.blocks import cdiv
from axkern.core.kernels import dot as _dot
from axkern.core.op import Implementation, Unsupported

from .. import common
from ..blocks import CrossEntropyBlockSizes, pallas_tpu_heuristic, pallas_tpu_space
from .loss import LOSS_IMPLEMENTATION as LOSS_IMPLEMENTATION  # the reduced loss (loss.py)
from .loss import supports  # the same refusal for both ops: no float64 on the matrix unit

VMEM_BUDGET = 16 << 20  # the scoped VMEM Mosaic grants a kernel by default (v4/v5e; v5p/v6e have more)


def vmem_bytes(bt: int, bv: int, bd: int, itemsize: int) -> int:
    return 2 * (bt * bd + bd * bv) * itemsize + 4 * bt * bv + 4 * 4 * bt


def _block_ok(name: str, b: int, full: int, multiple: int) -> str | None:
    if b == full or b % multiple == 0:
        return None
    return f"{name}={b}: TPU blocks must be a multiple of {multiple} or the whole dimension ({full})"


def _sizes(x, w, block_sizes: CrossEntropyBlockSizes) -> tuple[int, int, int]:
    n, d = x.shape
    v = w.shape[1]
    bt = min(block_sizes.block_tokens, cdiv(n, 8) * 8)
    bv = min(block_sizes.block_vocab, cdiv(v, 128) * 128)
    bd = block_sizes.block_embed or 512
    bd = d if bd >= d else bd
    for reason in (
        _block_ok("block_tokens", bt, n, 8),
        _block_ok("block_vocab", bv, v, 128),
        _block_ok("block_embed", bd, d, 128),
    ):
        if reason:
            raise Unsupported(reason)
    need = vmem_bytes(bt, bv, bd, jnp.dtype(jnp.result_type(x, w)).itemsize)
    if need > VMEM_BUDGET:
        raise Unsupported(
            f"block_tokens={bt}, block_vocab={bv}, block_embed={bd} need {need / 2**20:.1f} MiB of VMEM "
            f"(two buffers of each input block, a float32 tile and the row statistics); the budget is "
            f"{VMEM_BUDGET / 2**20:.0f} MiB"
        )
    return bt, bv, bd


@dataclasses.dataclass(frozen=True)
class _Static:
    block_tokens: int
    block_vocab: int
    block_embed: int
    soft_cap: float | None
    with_sum: bool
    interpret: bool


def _kernel(labels_ref, x_ref, w_ref, lse_ref, ll_ref, sum_ref, acc, m, s, ll, sm, *, cfg: _Static, d, v):
    j, k = pl.program_id(1), pl.program_id(2)
    nj, nk = pl.num_programs(1), pl.num_programs(2)
    bt, bv, bd = cfg.block_tokens, cfg.block_vocab, cfg.block_embed

    @pl.when((j == 0) & (k == 0))
    def _():
        m[...] = jnp.full(m.shape, -jnp.inf, jnp.float32)
        s[...] = jnp.zeros(s.shape, jnp.float32)
        ll[...] = jnp.zeros(ll.shape, jnp.float32)
        sm[...] = jnp.zeros(sm.shape, jnp.float32)

    @pl.when(k == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    xa, wb = x_ref[...], w_ref[...]
    if d % bd:  # the last embed block reads past D: zero those columns of x and rows of w
        kx = k * bd + jax.lax.broadcasted_iota(jnp.int32, (bt, bd), 1)
        kw = k * bd + jax.lax.broadcasted_iota(jnp.int32, (bd, bv), 0)
        xa = jnp.where(kx < d, xa, 0)
        wb = jnp.where(kw < d, wb, 0)
    acc[...] += _dot(xa, wb)

    @pl.when(k == nk - 1)
    def _():
        z = acc[...]
        if cfg.soft_cap is not None:
            z = cfg.soft_cap * jnp.tanh(z / cfg.soft_cap)
        cols = j * bv + jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
        ok = cols < v
        zm = jnp.where(ok, z, -jnp.inf)
        m_old = m[...]
        m_new = jnp.maximum(m_old, jnp.max(zm, axis=1, keepdims=True))
        s[...] = s[...] * jnp.exp(m_old - m_new) + jnp.sum(jnp.exp(zm - m_new), axis=1, keepdims=True)
        m[...] = m_new
        ll[...] += jnp.sum(jnp.where(cols == labels_ref[...], z, 0.0), axis=1, keepdims=True)
        if cfg.with_sum:
            sm[...] += jnp.sum(jnp.where(ok, z, 0.0), axis=1, keepdims=True)

        @pl.when(j == nj - 1)
        def _():
            lse_ref[...] = m[...] + jnp.log(s[...])
            ll_ref[...] = ll[...]
            sum_ref[...] = sm[...]


def _forward(cfg: _Static, x, w, labels):
    n, d = x.shape
    v = w.shape[1]
    bt, bv, bd = cfg.block_tokens, cfg.block_vocab, cfg.block_embed
    col = jax.ShapeDtypeStruct((n, 1), jnp.float32)
    row_block = pl.BlockSpec((bt, 1), lambda i, j, k: (i, 0))
    lse, ll, sm = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, d=d, v=v),
        name="axkern_fused_cross_entropy_tpu_forward",
        grid=(cdiv(n, bt), cdiv(v, bv), cdiv(d, bd)),
        in_specs=[
            row_block,
            pl.BlockSpec((bt, bd), lambda i, j, k: (i, k)),
            pl.BlockSpec((bd, bv), lambda i, j, k: (k, j)),
        ],
        out_specs=[row_block] * 3,
        out_shape=[col] * 3,
        scratch_shapes=[pltpu.VMEM((bt, bv), jnp.float32)] + [pltpu.VMEM((bt, 1), jnp.float32)] * 4,
        interpret=pltpu.InterpretParams(out_of_bounds_reads="uninitialized") if cfg.interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
    )(labels.astype(jnp.int32)[:, None], x, w)
    return lse[:, 0], ll[:, 0], sm[:, 0]


def stats(
    x,
    w,
    labels,
    *,
    block_sizes: CrossEntropyBlockSizes,
    logits_soft_cap=None,
    with_sum=False,
    interpret=False,
):
    """Per-token `(lse, label_logit, sum_logits)` (float32) by the Mosaic kernel; backward in XLA."""
    bt, bv, bd = _sizes(x, w, block_sizes)
    cfg = _Static(
        bt,
        bv,
        bd,
        None if logits_soft_cap is None else float(logits_soft_cap),
        bool(with_sum),
        bool(interpret),
    )
    return _stats(cfg, x, w, labels)


_stats = common.recomputing(_forward)


IMPLEMENTATION = Implementation(
    "pallas_tpu",
    stats,
    platforms=("tpu",),
    supports=supports,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=pallas_tpu_heuristic,
    space=pallas_tpu_space,
    interpretable=True,
    backward="custom_vjp: recomputes the logits in XLA (streamed tiles, as xla)",
)
