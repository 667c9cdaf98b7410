"""Code shared by the fused cross-entropy's implementations: the per-token loss from its three
statistics, and the streaming forward and recomputing backward over logits tiles (never more
than one logits tile alive; `xla` runs them, the Pallas kernels take the backward).

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

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core import backend, kernels
from axkern.core.blocks import for_each_block

from .blocks import stream_tiles


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
        dx_rows = lax.dynamic_slice_in_dim(dx, t0, ts) + mm(dz, wv.T, acc)
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
