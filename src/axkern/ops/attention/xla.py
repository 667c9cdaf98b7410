"""Flash attention in plain JAX: tiles of queries by keys, online softmax, memory linear in length.

**Loop.** Queries are cut into `block_q` rows (a Python loop: each block is its own
computation) and keys into `block_kv` columns (a `lax.scan` per query block over the key
blocks it needs). For a static mask (`Causal`, `SlidingWindow`, `Full` and their
combinations) the key blocks a query block sees are known before tracing, and empty tiles
are never computed; a mask holding arrays (`Segments`, `PrefixLM`) visits every tile. Lengths
are padded to whole blocks; padded keys are invisible, padded queries are dropped.

**Forward.** Per tile `s = softcap(q k^T · scale)`, masked to `-inf` where the tile is
partial (a static mask's `FULL` tiles run a second scan without masking work); running max `m`, sum `l`
and output accumulator (float32) as in FlashAttention; sinks join the normaliser at the end.
Products take the inputs' dtype (probabilities are cast to `v`'s dtype) with float32
accumulation (float32 and fp16 inputs: exact float32 products, not TF32 on a GPU or one bfloat16
pass on a TPU). A query that sees nothing gets 0 and `lse = -inf`. Non-finite values follow
the library's rule (docs/guide.md): a non-finite score makes its query NaN; a partial tile
selects its invisible entries away, so a NaN reaches only the queries that see it.

**Backward** (`jax.custom_vjp`, residuals `q, k, v, out (float32), lse`): recompute each tile,
`p = exp(s - lse)`, `dv += p^T dO`, `ds = p (dO v^T - delta)` with `delta = rowsum(dO ∘ out)`,
times `1 - (s / cap)^2` under the soft cap, `dq += ds k · scale`, `dk += ds^T q · scale`;
`dsink = -sum p_sink · delta` with this `delta` summed as `Σ_j p_j dp_j` in the same tile loop
(`common.sink_grad`). Heads sharing a kv head (GQA) sum into its `dk`, `dv`.

**Cost.** `4·B·H·Sq·Sk·D` FLOPs forward over visible tiles, about 2.5 times that backward;
memory `O(B·H·block_q·block_kv)` per tile plus the float32 `dk`, `dv` accumulators.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from axkern import masks as masks_
from axkern.core import compat
from axkern.core.blocks import cdiv
from axkern.core.kernels import log_refined, products_precision, row_dot
from axkern.core.op import Implementation

from .blocks import AttentionBlockSizes, heuristic, space


@dataclasses.dataclass(frozen=True)
class _Static:
    block_q: int
    block_kv: int
    scale: float
    soft_cap: float | None
    # the products' precision (`products_precision` of the inputs' dtype): float32 and fp16
    # inputs take exact float32 products, not the platform's default (TF32 on a GPU, one
    # bfloat16 pass on a TPU)
    precision: lax.Precision | None = None


def attention(q, k, v, sinks, mask, *, scale, logits_soft_cap, block_sizes, return_lse=False):
    cfg = _Static(
        block_q=min(block_sizes.block_q, q.shape[1]),
        block_kv=min(block_sizes.block_kv, k.shape[1]),
        scale=float(scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        precision=products_precision(jnp.result_type(q.dtype, k.dtype, v.dtype)),
    )
    out, lse = _attention(cfg, q, k, v, sinks, mask)
    return (out, lse) if return_lse else out


def _public_lse(lse):
    """`[B, KVH, G, Sq]` as the API returns it: `[B, Sq, H]`."""
    b, kvh, g, sq = lse.shape
    return jnp.moveaxis(lse.reshape(b, kvh * g, sq), 2, 1)


def _pad(a, axis, to):
    if a.shape[axis] == to:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, to - a.shape[axis])
    return jnp.pad(a, pad)


def _kv_blocks(cfg: _Static, mask, sq, sk):
    """For each query block, `(partial, full)`: the key blocks to visit with masking work and
    the `FULL` ones to visit without (numpy int arrays; a mask holding arrays: all partial)."""
    nq, nk = cdiv(sq, cfg.block_q), cdiv(sk, cfg.block_kv)
    kinds = masks_.static_block_kinds(mask, sq, sk, cfg.block_q, cfg.block_kv)
    if kinds is None:
        return [(np.arange(nk), np.arange(0)) for _ in range(nq)]
    return [
        (np.flatnonzero(kinds[0, i] == masks_.PARTIAL), np.flatnonzero(kinds[0, i] == masks_.FULL))
        for i in range(nq)
    ]


def _scan_tiles(step, carry, blocks):
    """`step(carry, j, masked)` over the partial key blocks, then over the full ones."""
    for js, masked in zip(blocks, (True, False), strict=True):
        if len(js):
            carry, _ = lax.scan(functools.partial(step, masked=masked), carry, jnp.asarray(js, jnp.int32))
    return carry


def _grouped(a, kvh):
    """`[B, S, H, D]` -> `[B, KVH, G, S, D]` (query head h = kv head h // G, member h % G)."""
    b, s, h, d = a.shape
    return a.reshape(b, s, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(a):
    b, kvh, g, s, d = a.shape
    return a.transpose(0, 3, 1, 2, 4).reshape(b, s, kvh * g, d)


def _scores(cfg: _Static, qb, kb):
    """Capped scores `[B, KVH, G, bq, bk]` (float32); a non-finite score is NaN before the cap
    (whose `tanh` would turn an infinity finite)."""
    s = (
        jnp.einsum("bhgqd,bkhd->bhgqk", qb, kb, preferred_element_type=jnp.float32, precision=cfg.precision)
        * cfg.scale
    )
    s = jnp.where(jnp.isfinite(s), s, jnp.nan)
    if cfg.soft_cap is not None:
        s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
    return s


def _visible(mask, qi, kj, sk):
    return (mask.visible(qi, kj) & (kj < sk)[None, None, :])[:, None, None]


def _clean(a):
    return jnp.where(jnp.isfinite(a), a, 0).astype(a.dtype)


def _masked_pv(p, vb, vis, precision):
    """`p @ v` over a partial tile with the invisible entries selected away: a non-finite value
    in `v` reaches only the rows that see its key (`0 · NaN` inside the product would reach
    every row). Only a tile holding a non-finite value pays for the second, 0/1 product that
    marks them."""
    pv = lambda v: jnp.einsum(  # noqa: E731
        "bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision
    )

    def poisoned():
        finite = jnp.isfinite(vb)
        seen = jnp.broadcast_to(vis, p.shape).astype(vb.dtype)
        hit = jnp.einsum(
            "bhgqk,bkhd->bhgqd", seen, (~finite).astype(vb.dtype), preferred_element_type=jnp.float32
        )
        return jnp.where(hit > 0, jnp.nan, pv(jnp.where(finite, vb, 0).astype(vb.dtype)))

    return lax.cond(jnp.all(jnp.isfinite(vb)), lambda: pv(vb), poisoned)


def _forward(cfg: _Static, q, k, v, sinks, mask):
    b, sq, h, _ = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bq, bk = cfg.block_q, cfg.block_kv
    nq, nk = cdiv(sq, bq), cdiv(sk, bk)
    qg = _pad(_grouped(q, kvh), 3, nq * bq)
    kp, vp = _pad(k, 1, nk * bk), _pad(v, 1, nk * bk)
    dv = v.shape[-1]
    outs, lses = [], []
    for i, blocks in enumerate(_kv_blocks(cfg, mask, sq, sk)):
        qb = lax.slice_in_dim(qg, i * bq, (i + 1) * bq, axis=3)
        qi = i * bq + jnp.arange(bq)

        def step(carry, j, qb=qb, qi=qi, *, masked):
            m, l, acc = carry
            kb = lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1)
            vb = lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1)
            s = _scores(cfg, qb, kb)
            if masked:
                vis = _visible(mask, qi, j * bk + jnp.arange(bk), sk)
                s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            if masked:
                pv = _masked_pv(p, vb, vis, cfg.precision)
            else:
                pv = jnp.einsum(
                    "bhgqk,bkhd->bhgqd",
                    p.astype(v.dtype),
                    vb,
                    preferred_element_type=jnp.float32,
                    precision=cfg.precision,
                )
            return (m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv), None

        init = compat.vary_like(
            (
                jnp.full((b, kvh, g, bq), -jnp.inf, jnp.float32),
                jnp.zeros((b, kvh, g, bq), jnp.float32),
                jnp.zeros((b, kvh, g, bq, dv), jnp.float32),
            ),
            q,
            k,
            v,
            mask,
        )
        m, l, acc = _scan_tiles(step, init, blocks)
        if sinks is not None:
            sink = sinks.astype(jnp.float32).reshape(kvh, g)[None, :, :, None]
            m_f = jnp.maximum(m, sink)
            m_f = jnp.where(m_f == -jnp.inf, 0.0, m_f)  # a -inf sink and no key seen: l stays 0
            alpha = jnp.exp(m - m_f)
            l = l * alpha + jnp.exp(sink - m_f)
            acc = acc * alpha[..., None]
            m = m_f
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        seen = l != 0  # 0: no key seen; a NaN sum (a NaN score) stays NaN
        outs.append(jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0))
        lses.append(jnp.where(seen, m_safe + log_refined(jnp.where(seen, l, 1.0)), -jnp.inf))
    out = jnp.concatenate(outs, axis=3)[:, :, :, :sq]
    lse = jnp.concatenate(lses, axis=3)[:, :, :, :sq]
    return out, lse  # [B, KVH, G, Sq, Dv] float32, [B, KVH, G, Sq]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Static, q, k, v, sinks, mask):
    out, lse = _forward(cfg, q, k, v, sinks, mask)
    return _ungrouped(out).astype(q.dtype), _public_lse(lse)


def _attention_fwd(cfg, q, k, v, sinks, mask):
    out, lse = _forward(cfg, q, k, v, sinks, mask)
    return (_ungrouped(out).astype(q.dtype), _public_lse(lse)), (q, k, v, sinks, mask, out, lse)


def _attention_bwd(cfg: _Static, res, cts):
    (d_out, d_lse), (q, k, v, sinks, mask, out, lse) = cts, res
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bq, bk = cfg.block_q, cfg.block_kv
    nq, nk = cdiv(sq, bq), cdiv(sk, bk)
    do = _grouped(d_out, kvh)  # [B, KVH, G, Sq, Dv]
    # `lse`'s cotangent joins delta (`common.lse_cotangent`)
    d_lse = jnp.moveaxis(d_lse.astype(jnp.float32), 1, 2).reshape(lse.shape)
    delta = row_dot(do, out) - d_lse  # [B, KVH, G, Sq]
    qg, do_p = _pad(_grouped(q, kvh), 3, nq * bq), _pad(do, 3, nq * bq)
    delta_p = _pad(delta, 3, nq * bq)
    # padded query rows see no key in the backward (their `lse` is -inf, and a partial tile's
    # `ds` is selected to 0 on such rows): a NaN key cannot reach dk, dv through them
    lse_p = jnp.pad(lse, [(0, 0)] * 3 + [(0, nq * bq - sq)], constant_values=-jnp.inf)
    kp, vp = _pad(k, 1, nk * bk), _pad(v, 1, nk * bk)
    dk, dv = compat.vary_like(
        (jnp.zeros(kp.shape, jnp.float32), jnp.zeros(vp.shape, jnp.float32)), q, k, v, mask, d_out
    )
    dqs, pdps = [], []
    for i, blocks in enumerate(_kv_blocks(cfg, mask, sq, sk)):
        rows = lambda a, i=i: lax.slice_in_dim(a, i * bq, (i + 1) * bq, axis=3)  # noqa: E731
        qb, dob, delta_b, lse_b = rows(qg), rows(do_p), rows(delta_p), rows(lse_p)
        finite = lse_b != -jnp.inf  # -inf: the row saw no key; NaN stays NaN
        lse_b = jnp.where(finite, lse_b, 0.0)
        qi = i * bq + jnp.arange(bq)

        def step(carry, j, qb=qb, dob=dob, delta_b=delta_b, lse_b=lse_b, finite=finite, qi=qi, *, masked):
            dq, dk, dv, pdp = carry
            kb = lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1)
            vb = lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1)
            s = _scores(cfg, qb, kb)
            p = jnp.exp(s - lse_b[..., None])  # a full tile's rows see keys: lse is not -inf
            if masked:
                vis = _visible(mask, qi, j * bk + jnp.arange(bk), sk)
                p = jnp.where(vis & finite[..., None], p, 0.0)
            dv_b = jnp.einsum(
                "bhgqk,bhgqd->bkhd",
                p.astype(v.dtype),
                dob,
                preferred_element_type=jnp.float32,
                precision=cfg.precision,
            )
            dp = jnp.einsum(
                "bhgqd,bkhd->bhgqk", dob, vb, preferred_element_type=jnp.float32, precision=cfg.precision
            )
            if pdp is not None:  # the sinks' `Σ_j p_j dp_j` (`common.sink_grad`)
                pdp = pdp + jnp.sum(jnp.where(vis, p * dp, 0.0) if masked else p * dp, axis=-1)
            ds = p * (dp - delta_b[..., None])
            if cfg.soft_cap is not None:
                ds = ds * (1.0 - jnp.square(s / cfg.soft_cap))
            ds = ds * cfg.scale
            if masked:
                # invisible entries selected away (their dp holds whatever v holds there); a
                # visible non-finite q or k made its row NaN already, so the products' other
                # operand is taken with its non-finite values as 0
                ds = jnp.where(vis & finite[..., None], ds, 0.0)  # padding rows see nothing
                kb, qb = _clean(kb), _clean(qb)
            ds = ds.astype(q.dtype)
            dq = dq + jnp.einsum(
                "bhgqk,bkhd->bhgqd", ds, kb, preferred_element_type=jnp.float32, precision=cfg.precision
            )
            dk_b = jnp.einsum(
                "bhgqk,bhgqd->bkhd", ds, qb, preferred_element_type=jnp.float32, precision=cfg.precision
            )
            add = lambda acc, blk: lax.dynamic_update_slice_in_dim(  # noqa: E731
                acc, lax.dynamic_slice_in_dim(acc, j * bk, bk, axis=1) + blk, j * bk, axis=1
            )
            return (dq, add(dk, dk_b), add(dv, dv_b), pdp), None

        dq0 = compat.vary_like(jnp.zeros((b, kvh, g, bq, d), jnp.float32), q, k, v, mask, d_out)
        pdp0 = (
            None
            if sinks is None
            else compat.vary_like(jnp.zeros((b, kvh, g, bq), jnp.float32), q, k, v, mask, d_out)
        )
        dq_i, dk, dv, pdp_i = _scan_tiles(step, (dq0, dk, dv, pdp0), blocks)
        dqs.append(dq_i)
        pdps.append(pdp_i)
    dq = _ungrouped(jnp.concatenate(dqs, axis=3)[:, :, :, :sq])
    d_sinks = None
    if sinks is not None:
        # `delta` again, as `Σ_j p_j dp_j` over the float32 probabilities: `Σ o · dO` takes the
        # output, whose `p v` rounded them to the inputs' dtype (`common.sink_grad`)
        sink_delta = jnp.concatenate(pdps, axis=3)[:, :, :, :sq] - d_lse
        sink = sinks.astype(jnp.float32).reshape(kvh, g)[None, :, :, None]
        p_sink = jnp.exp(sink - jnp.where(lse == -jnp.inf, 0.0, lse))
        d_sinks = (
            (-jnp.einsum("bhgq,bhgq->hg", p_sink, sink_delta, precision=lax.Precision.HIGHEST))
            .reshape(h)
            .astype(sinks.dtype)
        )
    return (
        dq.astype(q.dtype),
        dk[:, :sk].astype(k.dtype),
        dv[:, :sk].astype(v.dtype),
        d_sinks,
        None,
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


IMPLEMENTATION = Implementation(
    "xla",
    attention,
    block_sizes=AttentionBlockSizes,
    heuristic=heuristic,
    space=space,
    backward="custom_vjp: flash-style recomputation per tile (float32 dk/dv accumulators)",
)
