"""The reduced loss `fused_cross_entropy_loss` on a TPU: Mosaic kernels for its value and for its
gradients, formed in the forward pass, never a `[tokens, vocab]` array.

**Math.** For `L = scale · sum_{kept i} loss_i` every token's cotangent of its logits is known
once its logsumexp is (`common.py`'s "grad in forward"):
`dz_iv = (g_i · p_iv - a_i [v == label_i] - b_i) · (1 - (z_iv/c)^2)` with `p = exp(z - lse)`,
`g = coef · (1 + 2 w_z lse)`, `a = (1 - eps) coef`, `b = (eps/V) coef`, `coef` the scale on a kept
token (NaN for a kept label outside `[0, V)`, so that its gradients are NaN), 0 on a dropped one.

**Under a gradient** (`jax.custom_vjp`; the backward scales `dx, dw` by the incoming cotangent)
the tokens go in chunks of `chunk_tokens` rows (padded to whole tiles; dropped and padded
rows of `x` zeroed, so a non-finite value there reaches nothing). Per chunk three kernels
(`loss_kernels.py`): `logits` (the statistics, and the chunk's logits held in HBM transposed,
float32 or packed 16-bit), then XLA forms the per-token losses and `g, a, b` (vectors), then `dx`
(tokens outer; it writes the logits' cotangent over them) and `dw` (vocabulary outer, a product
added to a float32 `[V, D]` running sum, the last chunk writing the gradient in `w`'s dtype).
One chunk: no running sum at all.

**Undifferentiated**: the `logits` kernel alone over all tokens, without holding the logits.

**Cost.** `6·N·D·V` MXU FLOPs under a gradient (`2·N·D·V` for the value). HBM traffic per logit:
`w`'s reads in the two tokens-outer kernels (`itemsize·D/block_tokens` bytes each), the held
logit written and read twice (2 or 4 bytes each time: the logit, then its cotangent), `x`'s
reads in `dw` (`itemsize·D/block_vocab`), and the running sum's read and write
(`8·D/chunk_tokens`). Elementwise work: the statistics in `logits` and the cotangent in `dx`.

**Memory** beside the inputs and gradients: the held logits of one chunk
(`chunk_tokens · V · (2 or 4)` bytes) and, with more than one chunk, the float32 `[V, D]`
running sum. The heuristic (`blocks.pallas_tpu_loss_heuristic`) sizes the chunk to the bytes of
`xla`'s logits block.

**Constraints.** `block_tokens` and `block_vocab` multiples of 128 (a smaller problem takes one
tile of its whole size); VMEM within three quarters of the chip's (`blocks.tpu_vmem_bytes`);
float64 and `dw_accumulation` other than "float32" are refused (`Unsupported`: the dispatcher
falls back). Off a TPU the kernels run in interpret mode (`pltpu.InterpretParams`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core import backend
from axkern.core.blocks import cdiv
from axkern.core.op import Implementation, Unsupported

from ..blocks import (
    CrossEntropyBlockSizes,
    pallas_tpu_loss_heuristic,
    pallas_tpu_loss_space,
    pallas_tpu_vmem_bytes,
    tpu_vmem_bytes,
)
from ..common import out_of_range, token_losses
from . import loss_kernels as kernels

__all__ = ["LOSS_IMPLEMENTATION", "loss", "supports", "describe", "tiles", "statistics"]


def supports(spec) -> str | None:
    if spec.dtype == "float64":
        return "float64: Mosaic TPU has no float64 matrix unit"
    return None


@dataclasses.dataclass(frozen=True)
class _Config:
    chunk: int  # token rows whose logits are held at once (a multiple of tiles.block_tokens)
    padded: int  # tokens, padded to whole chunks
    tiles: kernels.Tiles  # of the chunks
    value_tiles: kernels.Tiles  # of the undifferentiated value (all tokens, nothing held)
    logsumexp_weight: float
    label_smoothing: float
    x_dtype: str
    w_dtype: str


def _multiple(name: str, b: int, m: int = 128) -> int:
    if b % m:
        raise Unsupported(f"{name}={b}: the TPU cross-entropy kernels take a multiple of {m}")
    return b


def tiles(
    x, w, block_sizes: CrossEntropyBlockSizes, soft_cap, with_sum, interpret, *, held: bool
) -> kernels.Tiles:
    """The kernels' tiles for `x @ w` at `block_sizes`, checked (`Unsupported` names what does not
    fit): with `held` those of the loss's gradients (the logits held, packed where 16-bit without a
    soft cap), else of the statistics kernel alone over all tokens (the per-token op and the
    undifferentiated loss; a token tile of at most the call's tokens rounded up to 128, the last
    tile's lanes past them not written)."""
    n, d = x.shape
    v = w.shape[1]
    operand = jnp.dtype(jnp.result_type(x, w))
    if operand.itemsize > 4:
        raise Unsupported("float64: Mosaic TPU has no float64 matrix unit")
    packed = held and operand.itemsize == 2 and soft_cap is None
    bt = _multiple("block_tokens", block_sizes.block_tokens)
    bv = v if block_sizes.block_vocab >= v else _multiple("block_vocab", block_sizes.block_vocab)
    need = pallas_tpu_vmem_bytes(bt, bv, d, operand.itemsize, held=held, packed=packed)
    budget = tpu_vmem_bytes(backend.device_kind()) * 3 // 4
    if need > budget and not interpret:
        raise Unsupported(
            f"block_tokens={bt}, block_vocab={bv} at embed={d} need about {need / 2**20:.0f} MiB of VMEM, "
            f"over the {budget / 2**20:.0f} MiB the TPU cross-entropy kernels may take on this chip"
        )
    return kernels.Tiles(
        block_tokens=bt if held else min(bt, cdiv(n, 128) * 128),
        block_vocab=bv,
        vocab=v,
        soft_cap=None if soft_cap is None else float(soft_cap),
        with_sum=bool(with_sum),
        packed=packed,
        operand=operand.name,
        interpret=bool(interpret),
        # the held logits' kernels: their estimate with room to spare; the statistics kernel alone
        # (an estimate of fewer parts): all it may take
        vmem_limit=None if interpret else min(budget, need + need // 4 + (8 << 20)) if held else budget,
    )


def _config(x, w, block_sizes: CrossEntropyBlockSizes, soft_cap, wz, eps, interpret) -> _Config:
    if block_sizes.dw_accumulation not in (None, "float32"):
        raise Unsupported(
            f"dw_accumulation={block_sizes.dw_accumulation!r}: the TPU loss kernels add dw in float32"
        )
    t = tiles(x, w, block_sizes, soft_cap, eps, interpret, held=True)
    n, bt = x.shape[0], t.block_tokens
    if n <= bt:  # one tile of the whole (padded) chunk
        chunk = bt = cdiv(n, 16) * 16
    else:
        chunk = max(bt, _multiple("chunk_tokens", block_sizes.chunk_tokens or bt, bt))
        count = cdiv(n, chunk)  # the chunks evened out, so padding stays under a tile a chunk
        chunk = cdiv(cdiv(n, count), bt) * bt
    return _Config(
        chunk=chunk,
        padded=cdiv(n, chunk) * chunk,
        tiles=dataclasses.replace(t, block_tokens=bt),
        value_tiles=tiles(x, w, block_sizes, soft_cap, eps, interpret, held=False),
        logsumexp_weight=float(wz),
        label_smoothing=float(eps),
        x_dtype=jnp.dtype(x.dtype).name,
        w_dtype=jnp.dtype(w.dtype).name,
    )


def loss(
    x,
    w,
    labels,
    keep,
    scale,
    *,
    block_sizes: CrossEntropyBlockSizes,
    logits_soft_cap=None,
    logsumexp_weight=0.0,
    label_smoothing=0.0,
    interpret=False,
):
    """`scale * sum_{keep} loss_i` (float32) by the TPU kernels, gradients formed in the forward."""
    cfg = _config(x, w, block_sizes, logits_soft_cap, logsumexp_weight, label_smoothing, interpret)
    return _loss(cfg, x, w, labels, keep, jnp.asarray(scale, jnp.float32))


def label_row(labels, vocab):
    """`[1, N]` int32 labels, -1 outside `[0, V)` (such a label matches no column)."""
    inside = (labels >= 0) & (labels < vocab)
    return jnp.where(inside, labels, -1).astype(jnp.int32)[None, :]


def statistics(t: kernels.Tiles, x, w, labels):
    """Per-token `(lse, label_logit, sum_logits)` (float32, `[N]` each) by the statistics kernel at
    tiles `t` (`tiles(..., held=False)`), `x` and `w` cast to its operand dtype first."""
    operand = jnp.dtype(t.operand)
    stats = kernels.logits(t, x.astype(operand), w.astype(operand), label_row(labels, t.vocab), store=False)
    return tuple(s[0] for s in stats)


def _token_losses(cfg: _Config, lse, label_logit, sum_logits, labels, keep, vocab):
    return token_losses(
        lse,
        label_logit,
        sum_logits,
        labels,
        keep,
        vocab,
        logsumexp_weight=cfg.logsumexp_weight,
        label_smoothing=cfg.label_smoothing,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(cfg: _Config, x, w, labels, keep, scale):
    lse, label_logit, sum_logits = statistics(cfg.value_tiles, x, w, labels)
    return scale * jnp.sum(_token_losses(cfg, lse, label_logit, sum_logits, labels, keep, w.shape[1]))


def _chunk(cfg: _Config, x, w, labels, keep, coef, c0, running, final_dtype):
    """One chunk from row `c0`: its `dx` rows, the `dw` sum (`dw` kernel's `running` and
    `final_dtype`), and its share of the loss's sum."""
    t, v, eps, wz = cfg.tiles, w.shape[1], cfg.label_smoothing, cfg.logsumexp_weight
    rows = lambda a, axis=0: lax.dynamic_slice_in_dim(a, c0, cfg.chunk, axis=axis)  # noqa: E731
    xc, lc, kc, cc = rows(x), rows(labels), rows(keep), rows(coef)
    labels_c = rows(label_row(labels, v), 1)
    lse, label_logit, sum_logits, *held = kernels.logits(t, xc, w, labels_c, store=True)
    lse, label_logit, sum_logits = lse[0], label_logit[0], sum_logits[0]
    total = jnp.sum(_token_losses(cfg, lse, label_logit, sum_logits, lc, kc, v))
    g = cc * (1 + 2 * wz * lse) if wz else cc
    zero = jnp.zeros_like(lse)
    per_token = [zero] * kernels.ROWS
    per_token[kernels.LSE], per_token[kernels.G], per_token[kernels.KEEP] = lse, g, kc.astype(jnp.float32)
    per_token[kernels.A], per_token[kernels.B] = (1 - eps) * cc, (eps / v) * cc
    per_token = jnp.stack(per_token)
    dx, dzt = kernels.dx(t, held, per_token, labels_c, w, cfg.x_dtype)
    return dx, kernels.dw(t, dzt, xc, running, final_dtype), total


def _loss_fwd(cfg: _Config, x, w, labels, keep, scale):
    n, d = x.shape
    pad = cfg.padded - n
    operand = cfg.tiles.operand
    # dropped and padded rows of x zeroed: dw's product sums over tokens, and 0 · NaN is NaN
    x = jnp.pad(jnp.where(keep[:, None], x, 0).astype(operand), ((0, pad), (0, 0)))
    coef = jnp.where(keep, scale, 0) * out_of_range(labels, keep, w.shape[1])
    labels, keep, coef = jnp.pad(labels, (0, pad)), jnp.pad(keep, (0, pad)), jnp.pad(coef, (0, pad))
    w_op = w.astype(operand)
    chunks, bc = cfg.padded // cfg.chunk, cfg.chunk
    run = functools.partial(_chunk, cfg, x, w_op, labels, keep, coef)
    if chunks == 1:
        dx, dw, total = run(0, None, cfg.w_dtype)
    else:
        dx0, running, total = run(0, None, None)
        dx = lax.dynamic_update_slice_in_dim(jnp.zeros((cfg.padded, d), cfg.x_dtype), dx0, 0, axis=0)

        def body(c, carry):
            dx, running, total = carry
            dxc, running, part = run(c * bc, running, None)
            return lax.dynamic_update_slice_in_dim(dx, dxc, c * bc, axis=0), running, total + part

        dx, running, total = lax.fori_loop(1, chunks - 1, body, (dx, running, total))
        dxl, dw, part = run((chunks - 1) * bc, running, cfg.w_dtype)
        dx, total = lax.dynamic_update_slice_in_dim(dx, dxl, (chunks - 1) * bc, axis=0), total + part
    return scale * total, (dx[:n], dw, total)


def _loss_bwd(cfg: _Config, residuals, g):
    dx, dw, total = residuals
    scaled = lambda a, dtype: (g * a.astype(jnp.float32)).astype(dtype)  # noqa: E731
    return scaled(dx, cfg.x_dtype), scaled(dw, cfg.w_dtype), None, None, g * total


_loss.defvjp(_loss_fwd, _loss_bwd)


def describe(spec, block_sizes) -> str:
    """`explain`'s backward line: the chunks, the held logits and the dw running sum."""
    n, d, v = spec.dim("tokens"), spec.dim("embed"), spec.dim("vocab")
    bt, chunk = block_sizes.block_tokens, block_sizes.chunk_tokens or block_sizes.block_tokens
    packed = jnp.dtype(spec.dtype).itemsize == 2 and spec.flag("logits_soft_cap", None) is None
    chunk = min(chunk, cdiv(n, bt) * bt) if n > bt else cdiv(n, 16) * 16
    chunks = cdiv(n, chunk)
    held = chunk * v * (2 if packed else 4)
    form = "packed 16-bit exp(z - max)" if packed else "float32"
    running = f", dw summed in a float32 [V, D] buffer ({d * v * 4 / 2**30:.2f} GiB)" if chunks > 1 else ""
    return (
        f"gradients formed in the forward by Mosaic TPU kernels (6·N·D·V FLOPs; the backward scales "
        f"them): {chunks} chunk(s) of {chunk} tokens, each chunk's logits held as {form} "
        f"({held / 2**20:.0f} MiB){running}"
    )


LOSS_IMPLEMENTATION = Implementation(
    "pallas_tpu",
    loss,
    platforms=("tpu",),
    supports=supports,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=pallas_tpu_loss_heuristic,
    space=pallas_tpu_loss_space,
    interpretable=True,
    backward=describe,
)
