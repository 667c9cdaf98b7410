"""The tile math and plumbing both Pallas attention backends share (`pallas_gpu`, `pallas_tpu`).

Per tile of `block_q` queries by `block_kv` keys: scores `s = softcap(q k^T · scale)`
(`tile_scores`), where a partial tile is visible (`visible`: the static mask, the key length,
equal segment ids), `p = exp(s - lse)` (`probs`) and `ds = p (dO v^T - delta)` times
`1 - (s/c)^2` under the soft cap (`ds`). Around the kernels: the layout (`q` to
`[B, H, Sq, D]`, `k`, `v` to `[B, KVH, Sk, D]`, lengths padded to whole blocks), the packed-
documents block summaries (`segment_overlap`: id ranges meet; `segment_uniform`: both blocks
hold one id), the `custom_vjp` (`flash_vjp`) and the cotangents from the kernels' outputs
(`finish_grads`: `dq` cut, `dk`, `dv` summed over each GQA group, `dsink`).

Last, the non-finite guard `api.py` puts the `cudnn` and `mosaic_gpu` implementations behind
(`guarded`): their kernels where `q`, `k`, `v` (and the cotangent) are finite, a rule-following
implementation where one is not, chosen on the device (`core.control.flat_cond`: a `lax.cond`
whose arrays cross it 1-D where that moves nothing between devices, so that the fallback's
transposes stay in its branch). Neither kernel follows the non-finite rule alone (a NaN in `v`
reaches, through `p v` with `p = 0`, queries that cannot see its key).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from axkern import masks as masks_
from axkern.core.blocks import cdiv
from axkern.core.control import flat_cond
from axkern.core.kernels import dot as _dot
from axkern.core.kernels import log_refined
from axkern.core.op import Unsupported


@dataclasses.dataclass(frozen=True)
class Static:
    """A call's static configuration, the kernels' closure (block sizes from `AttentionBlockSizes`)."""

    block_q: int
    block_kv: int
    scale: float
    soft_cap: float | None
    interpret: bool
    num_warps: int | None = None  # Triton's (pallas_gpu only; None: its defaults)
    num_stages: int | None = None
    # lengths are padded to multiples of these (0: of block_q, block_kv); pallas_gpu pads to
    # the largest block of its three kernels, so all of them tile the same padded arrays
    pad_q: int = 0
    pad_kv: int = 0
    # pallas_gpu: the `dq` and `dk, dv` kernels' own configurations (None: this one)
    backward: tuple[Static, Static] | None = None

    def kernels(self) -> tuple[Static, Static, Static]:
        """The forward's, the `dq` kernel's and the `dk, dv` kernel's configurations."""
        return (self, *(self.backward or (self, self)))


def refuse_ping_pong(block_sizes, implementation: str) -> None:
    """`Unsupported` when the block sizes set `ping_pong`, a `mosaic_gpu` field that
    `implementation`'s kernels have no use for (rather than ignoring it)."""
    if getattr(block_sizes, "ping_pong", None) is not None:
        raise Unsupported(
            f"ping_pong={block_sizes.ping_pong!r}: the Mosaic GPU forward's field; {implementation} has no ping-pong"
        )


def split_segments(mask):
    """`(segments or None, static part)` for a static mask, `Segments`, or `Segments & static`
    (the masks the Pallas kernels serve); otherwise `Unsupported`."""
    if masks_.is_static(mask):
        return None, mask
    if isinstance(mask, masks_.Segments):
        return mask, masks_.Full()
    if type(mask) is masks_.And:
        for seg, rest in ((mask.a, mask.b), (mask.b, mask.a)):
            if isinstance(seg, masks_.Segments) and masks_.is_static(rest):
                return seg, rest
    raise Unsupported(
        f"{mask!r} holds arrays; the Pallas kernels take static masks and Segments & a static mask"
    )


def pallas_mask(mask) -> bool:
    """Whether the Pallas kernels take the mask (static, `Segments`, `Segments & static`)."""
    try:
        split_segments(mask)
    except Unsupported:
        return False
    return True


def segment_overlap(seg_ids, sqp, skp, bq, bk):
    """`[B, nq, nk]`: whether the id ranges of query block i and key block j overlap (a tile
    whose ranges do not overlap is empty; one whose do is checked inside the tile)."""
    q_lo, q_hi = _id_ranges(seg_ids[0], sqp, bq)
    k_lo, k_hi = _id_ranges(seg_ids[1], skp, bk)
    return (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])


def _id_ranges(ids, padded, block):
    """Each block's smallest and largest id (edge-padded to `padded`), `[B, n]` each."""
    ids = jnp.pad(ids, [(0, 0), (0, padded - ids.shape[1])], mode="edge").reshape(ids.shape[0], -1, block)
    return ids.min(-1), ids.max(-1)


def padded_ids(seg_ids, sqp, skp):
    """Segment ids edge-padded to the padded lengths, int32 `[B, Sqp]` and `[B, Skp]`."""
    pad = lambda a, n: jnp.pad(a, [(0, 0), (0, n - a.shape[1])], mode="edge").astype(jnp.int32)  # noqa: E731
    return pad(seg_ids[0], sqp), pad(seg_ids[1], skp)


def segment_uniform(seg_ids, sqp, skp, bq, bk):
    """`[B, nq, nk]`: whether query block i and key block j hold one and the same id."""
    q_lo, q_hi = _id_ranges(seg_ids[0], sqp, bq)
    k_lo, k_hi = _id_ranges(seg_ids[1], skp, bk)
    same_q, same_k = q_lo == q_hi, k_lo == k_hi
    return same_q[:, :, None] & same_k[:, None, :] & (q_lo[:, :, None] == k_lo[:, None, :])


def tile_scores(cfg, q, k):
    """`softcap(q k^T · scale)`; a non-finite score is NaN before the cap (whose `tanh` would
    turn an infinity finite), so its query's output is NaN."""
    s = _dot(q, k, trans_b=True) * cfg.scale
    s = jnp.where(jnp.isfinite(s), s, jnp.nan)
    if cfg.soft_cap is not None:
        s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
    return s


def visible(mask, qi, kj, sk, ids=None, prefix=None):
    """Where a partial tile is visible: the static mask (or, with a batch row's `prefix` length,
    the keys below it too), the key length and, with segments, equal ids (`ids = (q ids [bq],
    k ids [bk])`)."""
    vis = mask.visible_2d(qi, kj)
    if prefix is not None:
        vis = vis | (kj < prefix)[None, :]
    vis = vis & (kj < sk)[None, :]
    if ids is not None:
        vis = vis & (ids[0][:, None] == ids[1][None, :])
    return vis


def masked_pv(p, v, vis):
    """`p @ v` over a partial tile whose invisible entries of `p` are 0, with those entries
    selected away: a non-finite value in `v` reaches only the rows that see its key (`0 · NaN`
    inside the product would reach every row). The non-finite values are replaced by 0 in the
    product and marked NaN where a visible key holds one (a second, 0/1 product). The test and
    the selections run in float32 and the products' operands keep `v`'s dtype: a TPU without a
    16-bit vector unit (v5e) has no 16-bit finiteness test (Mosaic rejects it)."""
    finite = jnp.isfinite(v.astype(jnp.float32))
    pv = _dot(p.astype(v.dtype), clean(v, finite))
    bad = jnp.where(finite, 0.0, 1.0).astype(v.dtype)
    hit = _dot(jnp.where(vis, 1.0, 0.0).astype(v.dtype), bad) > 0
    return jnp.where(hit, jnp.nan, pv)


def clean(a, finite=None):
    """`a` with its non-finite values replaced by 0 (`finite`: `isfinite(a)`, where known): the
    operand of a backward product over a partial tile, whose invisible entries must not carry a
    NaN across. A visible non-finite `q` or `k` already made its row's scores NaN, so the result
    stays NaN where it should. Tested and selected in float32 (as `masked_pv`), returned in
    `a`'s dtype."""
    wide = a.astype(jnp.float32)
    if finite is None:
        finite = jnp.isfinite(wide)
    return jnp.where(finite, wide, 0.0).astype(a.dtype)


def finish(m, l, acc):
    """`(out, lse)` from a row's running max, sum and accumulator: 0 and `-inf` for a row that
    saw no key (`l == 0`); a NaN sum (a NaN score) stays NaN, never taken for "no key"."""
    seen = l != 0
    out = jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    return out, jnp.where(seen, m_safe + log_refined(jnp.where(seen, l, 1.0)), -jnp.inf)


def padded_rows(a, sq, fill):
    """`a` (`[B, H, Sqp, ...]`) with the padded query rows set to `fill`. The backward takes
    `lse` with them at `-inf` (a padded row sees no key) and `delta` at 0 (the forward's output
    of a padded row may hold a NaN it saw), so a NaN key cannot reach `dk`, `dv` through them."""
    rows = jnp.arange(a.shape[2]).reshape((1, 1, -1) + (1,) * (a.ndim - 3))
    return jnp.where(rows < sq, a, fill)


def seen_rows(vis, lse):
    """A backward tile's visibility `vis` (`[bq, bk]`) without the rows that saw no key (`lse =
    -inf`), the padding rows among them: the mask may call a padding row's keys visible, and
    its `ds = p (dp - delta)` is `0 · dp`, NaN where `v` holds a NaN no real query sees."""
    return vis & (lse != -jnp.inf)[:, None]


def probs(cfg, q, k, lse, vis=None):
    """Scores and probabilities of a tile; `vis` (partial tiles) masks them. A row of a full
    tile sees keys, so its `lse` is finite."""
    s = tile_scores(cfg, q, k)
    if vis is None:
        return s, jnp.exp(s - lse[:, None])
    finite = lse != -jnp.inf
    p = jnp.where(vis & finite[:, None], jnp.exp(s - jnp.where(finite, lse, 0.0)[:, None]), 0.0)
    return s, p


def ds(cfg, s, p, dp, delta, vis=None):
    """`p (dp - delta)` times the soft cap's derivative and the scale; a partial tile's
    invisible entries are selected to 0 (their `dp` holds whatever `v` holds there)."""
    ds = p * (dp - delta[:, None])
    if cfg.soft_cap is not None:
        ds = ds * (1.0 - jnp.square(s / cfg.soft_cap))
    ds = ds * cfg.scale
    return ds if vis is None else jnp.where(vis, ds, 0.0)


def p_dp(p, dp, vis=None, keepdims=True):
    """`Σ_j p_j dp_j` over a tile's keys (`[bq, 1]`, or `[bq]`), with the float32 probabilities:
    the sinks' `delta` (`sink_grad`); a partial tile's invisible entries are selected to 0."""
    pdp = p * dp
    return jnp.sum(pdp if vis is None else jnp.where(vis, pdp, 0.0), axis=1, keepdims=keepdims)


def layout(q, k, v, cfg):
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    mq, mk = cfg.pad_q or cfg.block_q, cfg.pad_kv or cfg.block_kv
    sqp, skp = cdiv(sq, mq) * mq, cdiv(sk, mk) * mk
    tr = lambda a, n: jnp.pad(jnp.swapaxes(a, 1, 2), [(0, 0), (0, 0), (0, n - a.shape[1]), (0, 0)])  # noqa: E731
    return tr(q, sqp), tr(k, skp), tr(v, skp), (b, sq, sk, h, kvh, sqp, skp)


def prepare(mask, block_sizes, scale, logits_soft_cap, interpret, per_kernel=False):
    """`(cfg, segment ids or None, static mask)` for a call (both backends); `per_kernel`
    (pallas_gpu): the backward kernels get their own block sizes (`cfg.backward`) and the
    lengths are padded to the largest block of the three kernels (`math.lcm` of powers of two)."""
    segments, static = split_segments(mask)
    seg_ids = None if segments is None else masks_.int32_ids(segments.q_ids, segments.kv_ids)
    cap = None if logits_soft_cap is None else float(logits_soft_cap)

    def one(bs, **extra):
        return Static(
            bs.block_q, bs.block_kv, float(scale), cap, bool(interpret), bs.num_warps, bs.num_stages, **extra
        )

    if not per_kernel:
        return one(block_sizes), seg_ids, static
    per = [block_sizes.kernel(n) for n in ("fwd", "dq", "dkv")]
    pads = {
        "pad_q": math.lcm(*(b.block_q for b in per)),
        "pad_kv": math.lcm(*(b.block_kv for b in per)),
    }
    backward = tuple(one(b, **pads) for b in per[1:])
    return one(per[0], **pads, backward=backward), seg_ids, static


def flash_vjp(forward, backward):
    """The `custom_vjp` both backends wrap their kernels in: `forward(cfg, q, k, v, sinks,
    seg_ids, mask, *, lo) -> (o [B, H, Sqp, Dv], lse, lo or None)` and `backward(cfg, mask,
    residuals, d_out, d_lse)` (`d_lse` `[B, H, Sqp]` float32, 0 on the padding:
    `lse_cotangent`). The function returns `(out [B, Sq, H, Dv], lse [B, Sq, H])` (`public_lse`).
    `lo`: whether the forward also writes what rounding `o` lost, asked for the residuals when
    there are sinks and `o` has 16 bits (`unrounded`). `seg_ids` is whatever mask arrays the
    backend's kernels take (`pallas_tpu`: the segment ids and the prefix lengths, each or None);
    they get no cotangent."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
    def fn(cfg, q, k, v, sinks, seg_ids, mask):
        o, lse, _ = forward(cfg, q, k, v, sinks, seg_ids, mask, lo=False)
        return jnp.swapaxes(o, 1, 2)[:, : q.shape[1]], public_lse(lse, q.shape[1])

    def fwd(cfg, q, k, v, sinks, seg_ids, mask):
        want_lo = sinks is not None and jnp.dtype(q.dtype).itemsize < 4  # float32 loses nothing
        o, lse, lo = forward(cfg, q, k, v, sinks, seg_ids, mask, lo=want_lo)
        out = (jnp.swapaxes(o, 1, 2)[:, : q.shape[1]], public_lse(lse, q.shape[1]))
        return out, (q, k, v, sinks, seg_ids, o, lse, lo)

    def bwd(cfg, mask, res, cts):
        d_out, d_lse = cts
        return backward(cfg, mask, res, d_out, lse_cotangent(d_lse, res[5].shape[2]))

    fn.defvjp(fwd, bwd)
    return fn


def public_lse(lse, sq):
    """A kernel's `lse` (`[B, H, Sqp]`, or `[B, H, Sqp, 1]`) as the API returns it: `[B, Sq, H]`
    float32, natural log."""
    if lse.ndim == 4:
        lse = lse[..., 0]
    return jnp.swapaxes(lse[:, :, :sq], 1, 2).astype(jnp.float32)


def lse_cotangent(d_lse, rows):
    """The cotangent of `lse` (`[B, Sq, H]`) as the backward kernels' rows take it: `[B, H,
    rows]` float32, 0 on the padding. `lse = log Σ_j exp(s_j)` (the sink's term too) has
    `∂lse/∂s_j = p_j`, so it joins each row's `delta`: `ds = p (dp - (delta - d_lse))`, and the
    sinks' `-Σ exp(sink - lse) (delta - d_lse)`."""
    d = jnp.swapaxes(d_lse.astype(jnp.float32), 1, 2)
    return jnp.pad(d, [(0, 0), (0, 0), (0, rows - d.shape[2])])


def maybe_lse(result, return_lse):
    """`(out, lse)` or `out` alone, as the caller asked."""
    return result if return_lse else result[0]


def unrounded(o, lo):
    """`o + lo` in float32: the output before its rounding to `o`'s dtype, where the forward
    wrote `lo` (with sinks), else `o`. With sinks `mosaic_gpu`'s `dsink = -Σ exp(sink - lse) ·
    delta` sums `delta = Σ_d o · d_out` over every row, and `o`'s rounding alone (2⁻⁹ relative
    per term in bf16) can put that sum off by more than the oracle rule allows (the other
    kernels sum `p_dp` for it); the kernels' gradients, whose `ds = p (dp - delta)` is formed per
    row, take this `delta`."""
    full = o.astype(jnp.float32)
    return full if lo is None else full + lo.astype(jnp.float32)


def rounding_lost(out, dtype):
    """`(out in dtype, what the rounding lost in dtype)` of a float32 tile: their float32 sum is
    `out` to about 16 bits more (`unrounded`)."""
    o = out.astype(dtype)
    return o, (out - o.astype(jnp.float32)).astype(dtype)


def sink_grad(sinks, lse, delta):
    """`dsink = -Σ exp(sink - lse) · delta` over the batch and the rows (`lse`, `delta`
    `[B, H, Sq]`, natural log; a row with `lse = -inf` adds nothing). `delta = Σ_j p_j dp_j`
    over the row's keys, best summed from the float32 probabilities in the backward (`p_dp`):
    `Σ o · dO` takes the output, whose `p v` rounded them to 16 bits, which puts this sum of
    every row off by more than the oracle rule allows against a reference that keeps the
    probabilities in float32, as plain JAX does beside float32 sinks."""
    finite = lse != -jnp.inf
    p_sink = jnp.where(
        finite, jnp.exp(sinks.astype(jnp.float32)[None, :, None] - jnp.where(finite, lse, 0.0)), 0.0
    )
    return (-jnp.einsum("bhq,bhq->h", p_sink, delta, precision=jax.lax.Precision.HIGHEST)).astype(sinks.dtype)


def finish_grads(q, k, v, sinks, dq, dk, dv, lse, pdp, d_lse):
    """The cotangents from the kernels' outputs: `dq [B, H, Sqp, D]` cut and laid out as `q`;
    the per-query-head `dk, dv [B, H, Skp, D]` summed over each group; with sinks `dsink` by
    `sink_grad` from the `dq` kernel's `pdp` (`Σ_j p_j dp_j`, `[B, H, Sqp]`, its padding rows
    dropped) less `lse`'s cotangent `d_lse` (`lse`, `d_lse` `[B, H, Sqp]`); none for the segment
    ids."""
    b, sq, h, _ = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    per_kv = lambda a: jnp.swapaxes(a.reshape(b, kvh, h // kvh, a.shape[2], -1).sum(2), 1, 2)[:, :sk]  # noqa: E731
    d_sinks = None if sinks is None else sink_grad(sinks, lse, padded_rows(pdp, sq, 0.0) - d_lse)
    return (
        jnp.swapaxes(dq, 1, 2)[:, :sq].astype(q.dtype),
        per_kv(dk).astype(k.dtype),
        per_kv(dv).astype(v.dtype),
        d_sinks,
        None,
    )


# -- the non-finite guard ----------------------------------------------------------------------


def guarded(fast, safe, q, k, v, sinks, mask):
    """`fast(q, k, v, sinks, mask)` behind the non-finite guard (`where_finite`), `safe(q, k, v,
    sinks, mask)` (a rule-following implementation) where something is not finite; both return
    `out`, or both `(out, lse)`. The sinks and the mask's arrays pass through as arguments
    (closed over, a traced one would leak out of the guard's `custom_vjp`)."""
    leaves, treedef = jax.tree.flatten(mask)

    def fast_fn(q, k, v, sinks, *leaves):
        return fast(q, k, v, sinks, jax.tree.unflatten(treedef, leaves))

    def safe_fn(q, k, v, sinks, *leaves):
        return safe(q, k, v, sinks, jax.tree.unflatten(treedef, leaves))

    return where_finite(fast_fn, safe_fn, q, k, v, sinks, tuple(leaves))


def all_finite(*arrays) -> jax.Array:
    # one float32 sum per array (x · 0 is NaN exactly where x is not finite), fused into the read
    total = sum(jnp.sum(a * jnp.zeros((), a.dtype), dtype=jnp.float32) for a in arrays)
    return jnp.isfinite(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def where_finite(fast, safe, q, k, v, sinks=None, extra=()):
    """`fast(q, k, v, sinks, *extra)` where `q`, `k`, `v` (and the cotangent) are finite, else
    `safe(q, k, v, sinks, *extra)`. `sinks` (or None) is differentiated like `q`, `k`, `v`;
    `extra`: the mask's arrays (e.g. segment ids; no cotangent). Both are arguments rather than
    closed over, so the guard also runs under `grad` of a jitted call whose mask arrays are
    traced, and under `grad` with respect to the sinks."""
    # the fast kernel runs inside the first branch: its output is the conditional's (a value
    # computed outside and returned by a branch is copied, a whole output's read and write)
    return flat_cond(
        all_finite(q, k, v),
        lambda q, k, v, sinks, extra: fast(q, k, v, sinks, *extra),
        lambda q, k, v, sinks, extra: safe(q, k, v, sinks, *extra),
        q,
        k,
        v,
        sinks,
        extra,
    )


def where_finite_fwd(fast, safe, q, k, v, sinks=None, extra=()):
    ok = all_finite(q, k, v)
    # the fast forward always runs (its residuals are the only ones kept); the other only where
    # an input is not finite
    fast_out, fast_vjp = jax.vjp(lambda q, k, v, s: fast(q, k, v, s, *extra), q, k, v, sinks)
    out = flat_cond(
        ok,
        lambda out, q, k, v, sinks, extra: out,
        lambda out, q, k, v, sinks, extra: safe(q, k, v, sinks, *extra),
        fast_out,
        q,
        k,
        v,
        sinks,
        extra,
    )
    # with `lse` among the outputs, the rows that see nothing (`-inf`): their `lse` cotangent
    # reaches no score, so a NaN there (a z-loss's `2 · lse · 0`) leaves the kernels' backward
    unseen = out[1] == -jnp.inf if isinstance(out, tuple) else None
    return out, (fast_vjp, ok, q, k, v, sinks, extra, unseen)


def where_finite_bwd(fast, safe, res, d_out):
    fast_vjp, ok, q, k, v, sinks, extra, unseen = res
    if unseen is not None:
        d_out = (d_out[0], jnp.where(unseen, 0.0, d_out[1]))

    def recompute(fast_vjp, q, k, v, sinks, extra, d_out):  # a non-finite input or cotangent
        return jax.vjp(lambda q, k, v, s: safe(q, k, v, s, *extra), q, k, v, sinks)[1](d_out)

    def kernels(fast_vjp, q, k, v, sinks, extra, d_out):
        return fast_vjp(d_out)

    # `fast_vjp` (a pytree of the kernels' residuals) crosses the conditional as an operand,
    # so that its arrays go in 1-D too (`flat_cond`)
    for d in jax.tree.leaves(d_out):  # the output's cotangent, and `lse`'s where it is returned
        ok = ok & jnp.isfinite(d).all()
    return (*flat_cond(ok, kernels, recompute, fast_vjp, q, k, v, sinks, extra, d_out), None)


where_finite.defvjp(where_finite_fwd, where_finite_bwd)
