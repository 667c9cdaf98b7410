"""Fused linear cross-entropy in plain JAX: the streaming statistics (`common.py`: never more
than one logits tile alive) and the reduced loss with its gradients formed in the forward."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core.blocks import for_each_block
from axkern.core.op import Implementation

from .blocks import CrossEntropyBlockSizes, heuristic, loss_heuristic, loss_space, space
from .common import (
    Static,
    acc_dtype,
    mm,
    out_of_range,
    stream_forward,
    stream_stats,
    streaming_config,
    token_losses,
)


def stats(x, w, labels, *, block_sizes: CrossEntropyBlockSizes, logits_soft_cap=None, with_sum=False):
    """Per-token `(lse, label_logit, sum_logits)`, each `[N]` float32 (float64 for float64 inputs)."""
    cfg = Static(
        block_tokens=min(block_sizes.block_tokens, max(1, x.shape[0])),
        block_vocab=min(block_sizes.block_vocab, w.shape[1]),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        with_sum=bool(with_sum),
    )
    return stream_stats(cfg, x, w, labels)


# -- the reduced loss with its gradients formed in the forward ("grad in forward") -------------
#
# For a scalar `L = scale * sum_{kept i} loss_i` every token's cotangents are known once its
# `lse` is: `dL/dz_iv = scale * (p_iv * (1 + 2 w_z lse_i) - (1 - eps) [v == label_i] - eps / V)`
# (times `1 - (z/c)^2` under the soft cap). So the forward of the differentiated loss computes
# each token block's full `[block_tokens, V]` logits once, its lse, and at once `dz`, `dx` rows
# and the block's share of `dw`; the backward only scales `dx, dw` by the incoming cotangent.
# Cost: `6·N·D·V` FLOPs in all (no recomputation). Called without differentiation it is the
# streaming forward above.
#
# Every token block adds a share to every entry of `dw`, so whatever holds the running sum is
# `[D, V]`-sized; its precision decides whether a 16-bit `dw` meets the oracle rule. The
# strategies (`dw_accumulation`, blocks.py):
# - "compensated": the running sum is the gradient itself in w's
#   dtype, `hi`, plus a w-dtype compensation `lo` holding what rounding `hi` dropped. Vocab
#   slabs of `block_vocab` columns go one at a time: the slab's `dz` (from the block's float32
#   logits), its `dx` contribution, its float32 share `x_t^T dz` (`[D, block_vocab]`, the only
#   float32 piece of `dw` alive) and `t = hi + (share + lo)` in float32, then `hi = round(t)`,
#   `lo = round(t - hi)`. Each step's error is a 16-bit rounding of `lo` (2^-16 of `t` in
#   bf16), against the 2^-8 of plain 16-bit accumulation. Temporary: `lo`, `2·D·V` bytes.
# - "compensated_int8": the same with `lo` as an int8 count of 1/256ths of `hi`'s ulp (the
#   same 2^-16 per step: `|t - hi|` is at most half an ulp); temporary `D·V` bytes.
# - "float32" (the default for a 16-bit `w`): a float32 `[D, V]` accumulator, each block's
#   share formed whole (`4·D·V` bytes).
# - "plain": `hi` alone, slab-wise (measurement only: it misses the oracle rule over many
#   token blocks, docs/decisions.md).
# A float32 (or float64) `w` is its own accumulator: slab shares go straight into the gradient.


@dataclasses.dataclass(frozen=True)
class _LossStatic:
    block_tokens: int
    block_vocab: int  # dw slab columns (the slab-wise strategies)
    dw: str  # one of DW_ACCUMULATIONS, or "gradient" (a float32/float64 w)
    soft_cap: float | None
    logsumexp_weight: float
    label_smoothing: float
    w_dtype: str
    # the undifferentiated value's statistics, `(x, w, labels, *, logits_soft_cap, with_sum) ->
    # (lse, label_logit, sum_logits)`; None: this module's streamed tiles
    value_stats: Callable | None = None


def dw_strategy(w_dtype, requested: str | None) -> str:
    """The accumulation that runs for a `w` of `w_dtype` when `requested` (`None`: the
    default): "gradient" for a `w` of 32 bits or more (it is its own accumulator), else the
    request or "float32" (the one timed on a GPU at a model's size, docs/decisions.md)."""
    if jnp.dtype(w_dtype).itemsize >= 4:
        return "gradient"
    return requested or "float32"


def dw_temporary_bytes(strategy: str, embed: int, vocab: int, slab: int, w_dtype) -> int:
    """Bytes the dw accumulation holds beside the gradient: the compensation or the float32
    accumulator (`[D, V]`), and the float32 share of one slab (`[D, slab]`)."""
    w_bytes = jnp.dtype(w_dtype).itemsize
    slab_share = embed * min(slab, vocab) * max(4, w_bytes)
    return {
        "compensated": embed * vocab * w_bytes + slab_share,
        "compensated_int8": embed * vocab + slab_share,
        "float32": embed * vocab * 4,
        "plain": slab_share,
        "gradient": slab_share,
    }[strategy]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


_DW_WORDS = {
    "compensated": "accumulated in w's {w} with a {w} [D, V] compensation (Kahan), {slab}-column slabs",
    "compensated_int8": "accumulated in w's {w} with an int8 [D, V] compensation (Kahan, 1/256ths of an ulp), "
    "{slab}-column slabs",
    "float32": "accumulated in a float32 [D, V] buffer, each block's share formed whole",
    "plain": "accumulated in w's {w} without compensation (measurement only: misses the oracle rule)",
    "gradient": "accumulated in the {w} gradient itself, {slab}-column slabs",
}


def describe_loss(spec, block_sizes) -> str:
    """`explain`'s backward line for the reduced loss: how `dw` is accumulated and the
    temporary memory of one logits block and of that accumulation."""
    tokens, embed, vocab = spec.dim("tokens"), spec.dim("embed"), spec.dim("vocab")
    w_dtype = spec.flag("w_dtype", spec.dtype)
    strategy = dw_strategy(w_dtype, block_sizes.dw_accumulation)
    rows = min(block_sizes.block_tokens, max(1, tokens))
    slab = min(block_sizes.block_vocab, vocab)
    block = rows * vocab * 4 + rows * min(slab, vocab) * 2  # float32 logits block, a slab of dz
    if strategy == "float32":
        block = rows * vocab * (4 + 2)  # and the whole block's dz
    dw_bytes = dw_temporary_bytes(strategy, embed, vocab, slab, w_dtype)
    words = _DW_WORDS[strategy].format(w=jnp.dtype(w_dtype).name, slab=slab)
    return (
        "gradients formed in the forward, one [block_tokens, vocab] logits block at a time "
        f"(6·N·D·V FLOPs; the backward scales them); dw {words}; temporary memory up to "
        f"{_gib(block + dw_bytes)} (logits block {_gib(block)}, dw accumulation {_gib(dw_bytes)})"
    )


def loss(
    x,
    w,
    labels,
    keep,
    scale,
    *,
    block_sizes,
    logits_soft_cap=None,
    logsumexp_weight=0.0,
    label_smoothing=0.0,
    value_stats=None,
):
    """`scale * sum_{keep} loss_i` (float32), gradients for `x` and `w` formed in the forward
    (`dw` accumulated as `block_sizes.dw_accumulation` says). `value_stats`: what computes the
    undifferentiated value's per-token statistics (e.g. the Hopper kernel's, with its own
    tiles) instead of XLA's streamed tiles; the gradients are the same."""
    n = x.shape[0]
    acc = acc_dtype(x, w)
    cfg = _LossStatic(
        block_tokens=min(block_sizes.block_tokens, max(1, n)),
        block_vocab=min(block_sizes.block_vocab, w.shape[1]),
        dw=dw_strategy(w.dtype, block_sizes.dw_accumulation),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        logsumexp_weight=float(logsumexp_weight),
        label_smoothing=float(label_smoothing),
        w_dtype=jnp.dtype(w.dtype).name,
        value_stats=value_stats,
    )
    return _loss(cfg, x, w, labels, keep, jnp.asarray(scale, acc))


def _loss_value(cfg: _LossStatic, x, w, labels, keep):
    # undifferentiated: the streaming forward (or the kernel) with its own tiles, not the loss's block
    with_sum = bool(cfg.label_smoothing)
    if cfg.value_stats is not None:
        lse, label_logit, sum_logits = cfg.value_stats(
            x, w, labels, logits_soft_cap=cfg.soft_cap, with_sum=with_sum
        )
    else:
        stat_cfg = streaming_config(x.shape[0], w.shape[1], cfg.soft_cap, with_sum)
        lse, label_logit, sum_logits = stream_forward(stat_cfg, x, w, labels)[0]
    per = token_losses(
        lse,
        label_logit,
        sum_logits,
        labels,
        keep,
        w.shape[1],
        logsumexp_weight=cfg.logsumexp_weight,
        label_smoothing=cfg.label_smoothing,
    )
    return jnp.sum(per)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(cfg: _LossStatic, x, w, labels, keep, scale):
    return scale * _loss_value(cfg, x, w, labels, keep)


def _ulp_256th(hi, dtype):
    """A power of two per entry, float32: 1/256 of the spacing of `dtype` at `hi` (a value of
    that dtype; built from bits: an exact power of two, where `exp2` need not be)."""
    _, e = jnp.frexp(hi.astype(jnp.float32))  # |hi| = m * 2^e, m in [0.5, 1)
    biased = jnp.clip(e - 1 - jnp.finfo(dtype).nmant - 8 + 127, 1, 254)
    return lax.bitcast_convert_type(biased.astype(jnp.int32) << 23, jnp.float32)


def _compensation(hi, comp):
    """The float32 value of a compensation: `comp` itself, or an int8 count of `hi`'s 256ths."""
    if comp.dtype == jnp.int8:
        return comp.astype(jnp.float32) * _ulp_256th(hi, hi.dtype)
    return comp.astype(jnp.float32)


def _add_compensated(hi, lo, share):
    """`hi + lo + share` as a new `(hi, lo)` pair, `hi` in its dtype and `lo` in its own (w's
    dtype, or int8 256ths of the new `hi`'s ulp), the sum formed in float32. `reduce_precision`
    rounds `hi` where a convert pair f32 -> 16-bit -> f32 could be folded away (XLA's excess
    precision), which would zero the compensation."""
    finfo = jnp.finfo(hi.dtype)
    t = hi.astype(jnp.float32) + (share + _compensation(hi, lo))
    rounded = lax.reduce_precision(t, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
    rest = t - rounded  # exact: at most half an ulp of `rounded`
    if lo.dtype == jnp.int8:
        rest = jnp.clip(jnp.round(rest / _ulp_256th(rounded, hi.dtype)), -127, 127)
    return rounded.astype(hi.dtype), rest.astype(lo.dtype)


def _loss_fwd(cfg: _LossStatic, x, w, labels, keep, scale):
    n, d, v = x.shape[0], x.shape[1], w.shape[1]
    acc = acc_dtype(x, w)
    operand = jnp.result_type(x, w)
    eps, wz = cfg.label_smoothing, cfg.logsumexp_weight

    def cotangent(z, hit, lse, g_lse, coef, kt):
        """`dz` of the columns of `z` (float32) as operands (dropped rows selected away)."""
        dz = g_lse[:, None] * jnp.exp(z - lse[:, None]) - jnp.where(hit, ((1 - eps) * coef)[:, None], 0)
        if eps:
            dz = dz - (eps / v) * coef[:, None]
        if cfg.soft_cap is not None:
            dz = dz * (1 - jnp.square(z / cfg.soft_cap))
        return jnp.where(kt[:, None], dz, 0).astype(operand)

    def block(t0, ts, carry):
        dx, dw, comp, total = carry
        xt = lax.dynamic_slice_in_dim(x, t0, ts, axis=0)
        lt = lax.dynamic_slice_in_dim(labels, t0, ts)
        kt = lax.dynamic_slice_in_dim(keep, t0, ts)
        z = mm(xt, w, acc)
        if cfg.soft_cap is not None:
            z = cfg.soft_cap * jnp.tanh(z / cfg.soft_cap)
        m = lax.stop_gradient(jnp.max(z, axis=1))
        lse = m + jnp.log(jnp.sum(jnp.exp(z - m[:, None]), axis=1))
        hit = lt[:, None] == lax.broadcasted_iota(lt.dtype, (ts, v), 1)
        label_logit = jnp.sum(jnp.where(hit, z, 0), axis=1)
        sum_logits = jnp.sum(z, axis=1) if eps else jnp.zeros_like(lse)
        per = token_losses(lse, label_logit, sum_logits, lt, kt, v, logsumexp_weight=wz, label_smoothing=eps)
        coef = (jnp.where(kt, scale, 0) * out_of_range(lt, kt, v)).astype(acc)
        g_lse = coef * (1 + 2 * wz * lse) if wz else coef
        xk = jnp.where(kt[:, None], xt, 0)  # dropped rows selected away, as in dz
        if cfg.dw == "float32":
            dz = cotangent(z, hit, lse, g_lse, coef, kt)
            dx_rows = mm(dz, w.T, acc)
            dw = dw + mm(xk.T, dz, acc)
        else:

            def slab(v0, vs, c):
                dx_rows, dw, comp = c
                zs = lax.dynamic_slice_in_dim(z, v0, vs, axis=1)
                hit_s = (lt - v0)[:, None] == lax.broadcasted_iota(lt.dtype, (ts, vs), 1)
                dz = cotangent(zs, hit_s, lse, g_lse, coef, kt)
                dx_rows = dx_rows + mm(dz, lax.dynamic_slice_in_dim(w, v0, vs, axis=1).T, acc)
                share = mm(xk.T, dz, acc)  # [D, vs] float32: the only float32 piece of dw
                hi = lax.dynamic_slice_in_dim(dw, v0, vs, axis=1)
                if comp is not None:
                    lo = lax.dynamic_slice_in_dim(comp, v0, vs, axis=1)
                    hi, lo = _add_compensated(hi, lo, share)
                    comp = lax.dynamic_update_slice_in_dim(comp, lo, v0, axis=1)
                else:
                    hi = (hi.astype(acc) + share).astype(dw.dtype)
                return dx_rows, lax.dynamic_update_slice_in_dim(dw, hi, v0, axis=1), comp

            init = (jnp.zeros((ts, d), acc), dw, comp)
            dx_rows, dw, comp = for_each_block(v, cfg.block_vocab, slab, init)
        dx = lax.dynamic_update_slice_in_dim(dx, dx_rows.astype(x.dtype), t0, axis=0)
        return dx, dw, comp, total + jnp.sum(per)

    dw = jnp.zeros((d, v), acc if cfg.dw in ("float32", "gradient") else w.dtype)
    comp = {"compensated": jnp.zeros_like(w), "compensated_int8": jnp.zeros((d, v), jnp.int8)}.get(cfg.dw)
    init = (jnp.zeros_like(x), dw, comp, jnp.zeros((), acc))
    dx, dw, comp, total = for_each_block(n, cfg.block_tokens, block, init)
    return scale * total, (dx, dw, comp, total)


def _loss_bwd(cfg: _LossStatic, residuals, g):
    dx, dw, comp, total = residuals
    scaled = lambda a, dtype: (g * a.astype(g.dtype)).astype(dtype)  # noqa: E731
    if comp is not None:  # hi + lo, rounded once after the scaling
        dw_out = (g * (dw.astype(g.dtype) + _compensation(dw, comp).astype(g.dtype))).astype(cfg.w_dtype)
    else:
        dw_out = scaled(dw, cfg.w_dtype)
    return scaled(dx, dx.dtype), dw_out, None, None, g * total


_loss.defvjp(_loss_fwd, _loss_bwd)


IMPLEMENTATION = Implementation(
    "xla",
    stats,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=heuristic,
    space=space,
    backward="custom_vjp: recomputes each logits tile (streamed, no [tokens, vocab] buffer)",
)

LOSS_IMPLEMENTATION = Implementation(
    "xla",
    loss,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=loss_heuristic,
    space=loss_space,
    backward=describe_loss,  # the dw accumulation and temporary memory of the call
)
