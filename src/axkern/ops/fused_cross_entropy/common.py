"""The XLA paths the fused cross-entropy's implementations share: the per-token loss from its
three statistics; the streaming forward and recomputing backward over logits tiles (never more
than one logits tile alive; `xla` runs them, the Pallas kernels take the backward); and the
reduced loss with its gradients formed in the forward (`loss`: `xla`'s, and `mosaic_gpu`'s
under a gradient, its value from the kernel).

**Math.** For `z = softcap(x @ w)` (`softcap(z) = c * tanh(z / c)`, or the identity), per token
`lse = logsumexp_v z_v`, `label_logit = z_label`, `sum_logits = sum_v z_v`. The loss is
assembled from these three by the caller (`api.py`), so one kernel serves z-loss, label
smoothing and vocab-parallel sharding (where the three are combined across shards).

**Layout and loop.** `x: [N, D]`, `w: [D, V]`, `labels: [N]` (int, indices into this `w`).
Vocab blocks are the outer loop and token blocks the inner one; each step computes one
`[block_tokens, block_vocab]` float32 tile `z = x_t @ w_v` and folds it into per-token
running statistics (online logsumexp: running max `m` and `s = sum exp(z - m)`). Ragged last
blocks run as one more static step: nothing is padded and no input is copied.

**Backward** (`jax.custom_vjp`, residuals `x, w, labels, lse`): recompute each tile, form
`dz = g_lse * exp(z - lse) + g_label * [v == label] + g_sum` (times `1 - (z/c)^2` under the
soft cap), cast `dz` to the input dtype (bf16 operands for the tensor cores, float32
accumulation), then `dx[t] += dz @ w_v^T` (a float32 `[N, D]` accumulator) and
`dw[:, v] = sum_t x_t^T dz` (a float32 `[D, block_vocab]` accumulator per vocab block).

**Cost.** Forward `2·N·D·V` FLOPs, backward `6·N·D·V` (recompute + two products): `8·N·D·V`
in all against `6·N·D·V` for the materialising form, in exchange for temporary memory of
`O(N·D + block_tokens·block_vocab)` instead of `O(N·V)`. Bytes: `x` once per vocab block
and `w` once per token block.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core import backend, kernels
from axkern.core.blocks import for_each_block

from .blocks import dw_strategy, stream_tiles


def token_losses(lse, label_logit, sum_logits, labels, keep, vocab, *, logsumexp_weight, label_smoothing):
    """Per-token loss from the three statistics: 0 where not `keep`, NaN for a kept label outside `[0, V)`.

    The NaN of such a label multiplies the token's loss (`loss * NaN`, not a NaN constant), so its
    gradients are NaN too: the token's `dx` row and every `dw` entry it reaches, in every
    implementation. A dropped token's loss is selected away (`jnp.where`)."""
    eps = float(label_smoothing)
    out = lse - (1.0 - eps) * label_logit
    if eps:
        out = out - (eps / vocab) * sum_logits
    if logsumexp_weight:
        out = out + float(logsumexp_weight) * jnp.square(lse)
    return jnp.where(keep, out * out_of_range(labels, keep, vocab), 0.0)


def out_of_range(labels, keep, vocab):
    """1 per token, NaN for a kept token whose label is outside `[0, vocab)`."""
    valid = (labels >= 0) & (labels < vocab)
    return jnp.where(valid | ~keep, 1.0, jnp.nan)


@dataclasses.dataclass(frozen=True)
class Static:
    block_tokens: int
    block_vocab: int
    soft_cap: float | None
    with_sum: bool


def acc_dtype(x, w):
    return jnp.promote_types(jnp.result_type(x, w), jnp.float32)


def mm(a, b, acc):
    """`a @ b` accumulated in `acc`; float32 operands at full precision: XLA's default on GPU
    is TF32, and a TF32 recomputation of the logits does not match an exact forward's `lse`
    (`pallas_gpu`): the float32 `dx` would miss the oracle rule."""
    precision = kernels.full_precision(jnp.result_type(a, b))
    return jnp.matmul(a, b, precision=precision, preferred_element_type=acc)


def _tile(cfg: Static, x, w, t0, ts, v0, vs):
    """Rows `[t0, t0+ts)` of x, columns `[v0, v0+vs)` of w, and their capped logits tile."""
    xt = lax.dynamic_slice_in_dim(x, t0, ts, axis=0)
    wv = lax.dynamic_slice_in_dim(w, v0, vs, axis=1)
    z = mm(xt, wv, acc_dtype(x, w))
    if cfg.soft_cap is not None:
        z = cfg.soft_cap * jnp.tanh(z / cfg.soft_cap)
    return xt, wv, z


def _hits(labels, t0, ts, v0, vs):
    local = lax.dynamic_slice_in_dim(labels, t0, ts) - v0
    return local[:, None] == lax.broadcasted_iota(local.dtype, (ts, vs), 1)


def stream_forward(cfg: Static, x, w, labels):
    n, v = x.shape[0], w.shape[1]
    acc = acc_dtype(x, w)
    init = (jnp.full((n,), -jnp.inf, acc), jnp.zeros((n,), acc), jnp.zeros((n,), acc), jnp.zeros((n,), acc))

    def tile(v0, vs, t0, ts, carry):
        m, s, label_logit, sum_logits = carry
        _, _, z = _tile(cfg, x, w, t0, ts, v0, vs)
        rows = lambda a: lax.dynamic_slice_in_dim(a, t0, ts)  # noqa: E731
        put = lambda a, u: lax.dynamic_update_slice_in_dim(a, u, t0, axis=0)  # noqa: E731
        m_old = rows(m)
        m_new = jnp.maximum(m_old, jnp.max(z, axis=1))
        s_new = rows(s) * jnp.exp(m_old - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        ll_new = rows(label_logit) + jnp.sum(jnp.where(_hits(labels, t0, ts, v0, vs), z, 0), axis=1)
        out = (put(m, m_new), put(s, s_new), put(label_logit, ll_new), sum_logits)
        if cfg.with_sum:
            out = out[:3] + (put(sum_logits, rows(sum_logits) + jnp.sum(z, axis=1)),)
        return out

    def vocab_block(v0, vs, carry):
        return for_each_block(n, cfg.block_tokens, lambda t0, ts, c: tile(v0, vs, t0, ts, c), carry)

    m, s, label_logit, sum_logits = for_each_block(v, cfg.block_vocab, vocab_block, init)
    lse = m + jnp.log(s)
    return (lse, label_logit, sum_logits), (x, w, labels, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def stream_stats(cfg: Static, x, w, labels):
    return stream_forward(cfg, x, w, labels)[0]


def stream_backward(cfg: Static, residuals, cotangents):
    x, w, labels, lse = residuals
    g_lse, g_label, g_sum = cotangents
    live = (g_lse != 0) | (g_label != 0)
    if cfg.with_sum:
        live = live | (g_sum != 0)
    n, d, v = x.shape[0], x.shape[1], w.shape[1]
    acc = acc_dtype(x, w)
    operand = jnp.result_type(x, w)

    def tile(v0, vs, t0, ts, carry):
        dx, dw_block = carry
        xt, wv, z = _tile(cfg, x, w, t0, ts, v0, vs)
        rows = lambda a: lax.dynamic_slice_in_dim(a, t0, ts)[:, None]  # noqa: E731
        dz = rows(g_lse) * jnp.exp(z - rows(lse))
        dz = dz + jnp.where(_hits(labels, t0, ts, v0, vs), rows(g_label), 0)
        if cfg.with_sum:
            dz = dz + rows(g_sum)
        if cfg.soft_cap is not None:
            dz = dz * (1 - jnp.square(z / cfg.soft_cap))
        # a row whose cotangents are all 0 (a dropped token) is selected away, in dz and in x,
        # so a non-finite input there never turns into 0 * NaN
        dz = jnp.where(rows(live), dz, 0).astype(operand)
        # and its dx row too: `0 @ w^T` is NaN where w holds a NaN
        dx_rows = lax.dynamic_slice_in_dim(dx, t0, ts) + jnp.where(rows(live), mm(dz, wv.T, acc), 0)
        dx = lax.dynamic_update_slice_in_dim(dx, dx_rows, t0, axis=0)
        dw_block = dw_block + mm(jnp.where(rows(live), xt, 0).T, dz, acc)
        return dx, dw_block

    def vocab_block(v0, vs, carry):
        dx, dw = carry
        dx, dw_block = for_each_block(
            n, cfg.block_tokens, lambda t0, ts, c: tile(v0, vs, t0, ts, c), (dx, jnp.zeros((d, vs), acc))
        )
        return dx, lax.dynamic_update_slice_in_dim(dw, dw_block.astype(w.dtype), v0, axis=1)

    dx, dw = for_each_block(v, cfg.block_vocab, vocab_block, (jnp.zeros((n, d), acc), jnp.zeros_like(w)))
    return dx.astype(x.dtype), dw, None


stream_stats.defvjp(lambda cfg, x, w, labels: stream_forward(cfg, x, w, labels), stream_backward)


def streaming_config(n: int, v: int, soft_cap, with_sum) -> Static:
    """Tiles for this module's forward or backward when another path calls them (the Pallas
    kernels' backward, the reduced loss's undifferentiated value): the platform heuristic's."""
    tiles = stream_tiles(backend.platform(), max(1, n), v)
    return Static(tiles.block_tokens, tiles.block_vocab, soft_cap, with_sum)


def recomputing(forward):
    """`forward(cfg, x, w, labels) -> (lse, label_logit, sum_logits)` (a Pallas kernel; `cfg`
    has `soft_cap` and `with_sum`) wrapped in a `custom_vjp` whose backward is this module's
    recomputation (residuals `x, w, labels, lse`)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def fn(cfg, x, w, labels):
        return forward(cfg, x, w, labels)

    def fwd(cfg, x, w, labels):
        out = forward(cfg, x, w, labels)
        return out, (x, w, labels, out[0])

    def bwd(cfg, residuals, cotangents):
        x, w = residuals[0], residuals[1]
        tiles = streaming_config(x.shape[0], w.shape[1], cfg.soft_cap, cfg.with_sum)
        return stream_backward(tiles, residuals, cotangents)

    fn.defvjp(fwd, bwd)
    return fn


def merge_tiles(m, s, sum_logits=None):
    """`(lse, sum_logits)` per token from a kernel's per-tile statistics, each `[tiles, N]`
    float32: the tile's max `m`, `s = sum exp(z - m)` over its columns, and (or `None`: zeros)
    the sum of its logits. `lse = max_j m_j + log sum_j s_j exp(m_j - max_j m_j)`."""
    top = jnp.max(m, axis=0)
    lse = top + jnp.log(jnp.sum(s * jnp.exp(m - top), axis=0))
    return lse, jnp.zeros_like(lse) if sum_logits is None else jnp.sum(sum_logits, axis=0)


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
        # dropped rows selected away from dx too: `0 @ w^T` is NaN where w holds a NaN
        dx_rows = jnp.where(kt[:, None], dx_rows, 0)
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
