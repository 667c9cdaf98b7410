"""Block-sparse ("splash") attention as Mosaic TPU Pallas kernels, forward and backward.

**Verified in TPU interpret mode only** (`pltpu.InterpretParams`): no TPU is available to this
project, so it has not been compiled by Mosaic or timed, and it is in no default order.

**Schedule.** Before tracing, the static mask's `block_kinds` give, for each query block, the
list of its non-empty key blocks (and for each key block, its non-empty query blocks). The
lists are padded to the longest by repeating their last entry and handed to the kernels as
scalar-prefetch tables (`PrefetchScalarGridSpec`): a block spec's index map reads the table,
so grid step `s` of query block `i` fetches key block `table[i, s]`, a repeated index fetches
nothing new, and steps past the list's length compute nothing. Empty tiles therefore cost
neither DMA nor compute; only the longest row's length is paid in (idle) grid steps.

**Forward.** Grid `(batch, heads, q blocks, steps)`; online softmax in VMEM scratch (running
max, sum, float32 accumulator); sinks join the normaliser at the last step; `lse` saved.
**Backward.** `delta = rowsum(dO ∘ O)` in XLA; kernel `dq` with the forward's schedule, kernel
`dk, dv` with the transposed schedule (per key block, over the query blocks that see it),
both recomputing `p = exp(s - lse)` per tile (`pallas_gpu`'s tile math, shared). With GQA the
`dk, dv` kernel writes one slice per query head, summed over each group in XLA; `dsink` in XLA.

**Packed documents.** `Segments(q_ids, kv_ids)`, alone or `&` a static mask, is served too:
the schedule is then computed at run time per batch row (a tile stays in a row's list when
the static mask leaves it non-empty and the id ranges of its query and key blocks overlap),
padded to the static mask's longest list, and the kernels compare the ids inside each tile.

**Constraints.** Static masks, or `Segments` `&` a static mask (`PrefixLM`, `Dense` and other
array masks fall back to `xla`); blocks multiples of 8 (sublanes). On a real TPU blocks of
128 or more keep the MXU busy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from axkern import masks as masks_
from axkern.core.blocks import next_power_of_2
from axkern.core.kernels import dot as _dot
from axkern.core.op import Unsupported

from . import pallas_gpu as tiles
from .blocks import AttentionBlockSizes

SUBLANES = 8


def heuristic(spec) -> AttentionBlockSizes:
    """128x128 tiles (the MXU's), smaller for short sequences, at least 8."""
    pick = lambda n: max(SUBLANES, min(128, next_power_of_2(n)))  # noqa: E731
    return AttentionBlockSizes(block_q=pick(spec.dim("q_len")), block_kv=pick(spec.dim("kv_len")))


def _schedule(kinds, axis, batch, overlap=None):
    """Flattened `[batch, n, steps]` table of each row's non-empty blocks (padded by repeating
    the last), flattened `[batch, n]` counts, and `steps` (the static mask's longest list, at
    least 1). `overlap [batch, nq, nk]` (traced) further empties tiles whose segments differ."""
    nonempty = np.asarray(kinds != masks_.EMPTY)
    if axis == 1:
        nonempty = nonempty.T
    counts = nonempty.sum(1).astype(np.int32)
    steps = max(1, int(counts.max(initial=0)))
    if overlap is None:
        table = np.zeros((nonempty.shape[0], steps), np.int32)
        for r, row in enumerate(nonempty):
            cols = np.flatnonzero(row)
            if cols.size:
                table[r, : cols.size] = cols
                table[r, cols.size :] = cols[-1]
        tile = lambda a: jnp.asarray(np.tile(a.reshape(-1), batch))  # noqa: E731
        return tile(table), tile(counts), steps
    ne = jnp.asarray(nonempty)[None] & (overlap if axis == 0 else jnp.swapaxes(overlap, 1, 2))
    counts = ne.sum(-1).astype(jnp.int32)
    order = jnp.argsort(~ne, axis=-1, stable=True)[..., :steps].astype(jnp.int32)  # non-empty first
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    table = jnp.where(jnp.arange(steps) < counts[..., None], order, last)
    return table.reshape(-1), counts.reshape(-1), steps


def _call(cfg, kernel, grid, in_specs, out_specs, out_shape, scratch, *args):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch
        ),
        out_shape=out_shape,
        interpret=pltpu.InterpretParams() if cfg.interpret else False,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
    )(*args)


def _scores(cfg, q, k, mask, i, j, sk, qid_ref, kid_ref):
    """Scores of tile `(i, j)` and where they are visible (the static mask, the key length and,
    with segments, equal ids)."""
    bq, bk = cfg.block_q, cfg.block_kv
    s, vis = tiles._tile_scores(cfg, q, k, mask, i * bq + jnp.arange(bq), j * bk + jnp.arange(bk), sk)
    if qid_ref is not None:
        vis = vis & (qid_ref[...] == kid_ref[...])  # [bq, 1] == [1, bk]
    return s, vis


def _probs(cfg, q, k, mask, i, j, sk, lse, qid_ref, kid_ref):
    s, vis = _scores(cfg, q, k, mask, i, j, sk, qid_ref, kid_ref)
    finite = lse != -jnp.inf
    p = jnp.where(vis & finite[:, None], jnp.exp(s - jnp.where(finite, lse, 0.0)[:, None]), 0.0)
    return s, p


def _fwd_kernel(
    table_ref, count_ref, q_ref, k_ref, v_ref, sink_ref, *rest, cfg, mask, sk, steps, has_sinks, segments, nq
):
    qid_ref, kid_ref = rest[:2] if segments else (None, None)
    o_ref, lse_ref, m_sc, l_sc, acc_sc = rest[2:] if segments else rest
    b, i, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row = b * nq + i

    @pl.when(s == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(s < count_ref[row])
    def _():
        j = table_ref[row * steps + s]
        sc, vis = _scores(cfg, q_ref[...], k_ref[...], mask, i, j, sk, qid_ref, kid_ref)
        sc = jnp.where(vis, sc, -jnp.inf)
        m = m_sc[...]
        m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(sc - m_safe)
        v = v_ref[...]
        acc_sc[...] = acc_sc[...] * alpha + _dot(p.astype(v.dtype), v)
        l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new

    @pl.when(s == steps - 1)
    def _():
        m, l, acc = m_sc[...], l_sc[...], acc_sc[...]
        if has_sinks:
            sink = sink_ref[...][:, :1]  # [1, 1]
            m_f = jnp.maximum(m, sink)
            alpha = jnp.exp(m - m_f)
            l = l * alpha + jnp.exp(sink - m_f)
            acc = acc * alpha
            m = m_f
        seen = l > 0
        o_ref[...] = jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0).astype(o_ref.dtype)
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        lse_ref[...] = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def _dq_kernel(
    table_ref,
    count_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *rest,
    cfg,
    mask,
    sk,
    steps,
    segments,
    nq,
):
    qid_ref, kid_ref = rest[:2] if segments else (None, None)
    dq_ref, dq_sc = rest[2:] if segments else rest
    b, i, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row = b * nq + i

    @pl.when(s == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(s < count_ref[row])
    def _():
        j = table_ref[row * steps + s]
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        sc, p = _probs(cfg, q, k, mask, i, j, sk, lse_ref[...][:, 0], qid_ref, kid_ref)
        ds = tiles._ds(cfg, sc, p, _dot(do, v, trans_b=True), delta_ref[...][:, 0])
        dq_sc[...] += _dot(ds.astype(k.dtype), k)

    @pl.when(s == steps - 1)
    def _():
        dq_ref[...] = dq_sc[...]


def _dkv_kernel(
    table_ref,
    count_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *rest,
    cfg,
    mask,
    sk,
    steps,
    segments,
    nk,
):
    qid_ref, kid_ref = rest[:2] if segments else (None, None)
    dk_ref, dv_ref, dk_sc, dv_sc = rest[2:] if segments else rest
    b, j, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row = b * nk + j

    @pl.when(s == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(s < count_ref[row])
    def _():
        i = table_ref[row * steps + s]
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        sc, p = _probs(cfg, q, k, mask, i, j, sk, lse_ref[...][:, 0], qid_ref, kid_ref)
        dv_sc[...] += _dot(p.astype(do.dtype), do, trans_a=True)
        ds = tiles._ds(cfg, sc, p, _dot(do, v, trans_b=True), delta_ref[...][:, 0])
        dk_sc[...] += _dot(ds.astype(q.dtype), q, trans_a=True)

    @pl.when(s == steps - 1)
    def _():
        dk_ref[...] = dk_sc[...]
        dv_ref[...] = dv_sc[...]


def _plan(cfg, mask, seg_ids, b, sq, sk, sqp, skp, axis):
    """The schedule for grid rows over q blocks (`axis` 0) or kv blocks (1)."""
    bq, bk = cfg.block_q, cfg.block_kv
    kinds = masks_.static_block_kinds(mask, sq, sk, bq, bk)[0]
    overlap = None if seg_ids is None else tiles.segment_overlap(seg_ids, sqp, skp, bq, bk)
    return _schedule(kinds, axis, b, overlap)


def _id_inputs(seg_ids, sqp, skp, q_index, k_index, bq, bk):
    """Segment-id operands and their block specs (q ids as `[B, Sqp, 1]` columns, kv ids as
    `[B, 1, Skp]` rows), or nothing without segments."""
    if seg_ids is None:
        return [], []
    q_ids, kv_ids = (a[:, :, None] for a in tiles.padded_ids(seg_ids, sqp, skp))
    kv_ids = jnp.swapaxes(kv_ids, 1, 2)
    specs = [
        pl.BlockSpec((None, bq, 1), lambda b_, h_, x, s, t, c: (b_, q_index(b_, x, s, t), 0)),
        pl.BlockSpec((None, 1, bk), lambda b_, h_, x, s, t, c: (b_, 0, k_index(b_, x, s, t))),
    ]
    return [q_ids, kv_ids], specs


def _forward(cfg, q, k, v, sinks, seg_ids, mask):
    qt, kt, vt, (b, sq, sk, h, kvh, sqp, skp) = tiles._layout(q, k, v, cfg)
    g = h // kvh
    bq, bk, d, dv = cfg.block_q, cfg.block_kv, q.shape[3], v.shape[3]
    nq = sqp // bq
    table, counts, steps = _plan(cfg, mask, seg_ids, b, sq, sk, sqp, skp, 0)
    kv_block = lambda b_, i, s, t: t[(b_ * nq + i) * steps + s]  # noqa: E731
    has_sinks = sinks is not None
    sink_arr = jnp.broadcast_to(
        (sinks if has_sinks else jnp.zeros((h,))).astype(jnp.float32)[:, None, None], (h, 1, 128)
    )
    kv = lambda w: pl.BlockSpec(  # noqa: E731
        (None, None, bk, w), lambda b_, h_, i, s, t, c: (b_, h_ // g, kv_block(b_, i, s, t), 0)
    )
    ids, id_specs = _id_inputs(seg_ids, sqp, skp, lambda b_, i, s, t: i, kv_block, bq, bk)
    o, lse = _call(
        cfg,
        functools.partial(
            _fwd_kernel,
            cfg=cfg,
            mask=mask,
            sk=sk,
            steps=steps,
            has_sinks=has_sinks,
            segments=seg_ids is not None,
            nq=nq,
        ),
        (b, h, nq, steps),
        [
            pl.BlockSpec((None, None, bq, d), lambda b_, h_, i, s, t, c: (b_, h_, i, 0)),
            kv(d),
            kv(dv),
            pl.BlockSpec((None, 1, 128), lambda b_, h_, i, s, t, c: (h_, 0, 0)),
            *id_specs,
        ],
        [
            pl.BlockSpec((None, None, bq, dv), lambda b_, h_, i, s, t, c: (b_, h_, i, 0)),
            pl.BlockSpec((None, None, bq, 1), lambda b_, h_, i, s, t, c: (b_, h_, i, 0)),
        ],
        [jax.ShapeDtypeStruct((b, h, sqp, dv), q.dtype), jax.ShapeDtypeStruct((b, h, sqp, 1), jnp.float32)],
        [
            pltpu.VMEM((bq, 1), jnp.float32),
            pltpu.VMEM((bq, 1), jnp.float32),
            pltpu.VMEM((bq, dv), jnp.float32),
        ],
        table,
        counts,
        qt,
        kt,
        vt,
        sink_arr,
        *ids,
    )
    return o, lse


def attention(q, k, v, sinks, mask, *, scale, logits_soft_cap, block_sizes, interpret=False):
    bq, bk = block_sizes.block_q, block_sizes.block_kv
    for name, n in (("block_q", bq), ("block_kv", bk)):
        if n % SUBLANES:
            raise Unsupported(f"{name}={n}: TPU blocks need a multiple of {SUBLANES} (sublanes)")
    segments, static = tiles.split_segments(mask)
    seg_ids = None if segments is None else (segments.q_ids, segments.kv_ids)
    cfg = tiles._Static(
        bq, bk, float(scale), None if logits_soft_cap is None else float(logits_soft_cap), bool(interpret)
    )
    return _attention(cfg, q, k, v, sinks, seg_ids, static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _attention(cfg, q, k, v, sinks, seg_ids, mask):
    o, _ = _forward(cfg, q, k, v, sinks, seg_ids, mask)
    return jnp.swapaxes(o, 1, 2)[:, : q.shape[1]]


def _attention_fwd(cfg, q, k, v, sinks, seg_ids, mask):
    o, lse = _forward(cfg, q, k, v, sinks, seg_ids, mask)
    return jnp.swapaxes(o, 1, 2)[:, : q.shape[1]], (q, k, v, sinks, seg_ids, o, lse)


def _attention_bwd(cfg, mask, res, d_out):
    q, k, v, sinks, seg_ids, o, lse = res
    qt, kt, vt, (b, sq, sk, h, kvh, sqp, skp) = tiles._layout(q, k, v, cfg)
    g = h // kvh
    bq, bk, d, dv = cfg.block_q, cfg.block_kv, q.shape[3], v.shape[3]
    nq, nk = sqp // bq, skp // bk
    segments = seg_ids is not None
    do = jnp.pad(jnp.swapaxes(d_out, 1, 2), [(0, 0), (0, 0), (0, sqp - sq), (0, 0)]).astype(q.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)  # [B, H, Sqp, 1]
    own = lambda n, w: pl.BlockSpec((None, None, n, w), lambda b_, h_, x, s, t, c: (b_, h_, x, 0))  # noqa: E731

    q_table, q_counts, q_steps = _plan(cfg, mask, seg_ids, b, sq, sk, sqp, skp, 0)
    kv_block = lambda b_, i, s, t: t[(b_ * nq + i) * q_steps + s]  # noqa: E731
    kv_of_q = lambda w: pl.BlockSpec(  # noqa: E731
        (None, None, bk, w), lambda b_, h_, i, s, t, c: (b_, h_ // g, kv_block(b_, i, s, t), 0)
    )
    ids, id_specs = _id_inputs(seg_ids, sqp, skp, lambda b_, i, s, t: i, kv_block, bq, bk)
    dq = _call(
        cfg,
        functools.partial(_dq_kernel, cfg=cfg, mask=mask, sk=sk, steps=q_steps, segments=segments, nq=nq),
        (b, h, nq, q_steps),
        [own(bq, d), kv_of_q(d), kv_of_q(dv), own(bq, dv), own(bq, 1), own(bq, 1), *id_specs],
        own(bq, d),
        jax.ShapeDtypeStruct((b, h, sqp, d), jnp.float32),
        [pltpu.VMEM((bq, d), jnp.float32)],
        q_table,
        q_counts,
        qt,
        kt,
        vt,
        do,
        lse,
        delta,
        *ids,
    )

    k_table, k_counts, k_steps = _plan(cfg, mask, seg_ids, b, sq, sk, sqp, skp, 1)
    q_block = lambda b_, j, s, t: t[(b_ * nk + j) * k_steps + s]  # noqa: E731
    q_of_kv = lambda w: pl.BlockSpec(  # noqa: E731
        (None, None, bq, w), lambda b_, h_, j, s, t, c: (b_, h_, q_block(b_, j, s, t), 0)
    )
    kv_own = lambda w: pl.BlockSpec((None, None, bk, w), lambda b_, h_, j, s, t, c: (b_, h_ // g, j, 0))  # noqa: E731
    ids, id_specs = _id_inputs(seg_ids, sqp, skp, q_block, lambda b_, j, s, t: j, bq, bk)
    dk, dvv = _call(
        cfg,
        functools.partial(_dkv_kernel, cfg=cfg, mask=mask, sk=sk, steps=k_steps, segments=segments, nk=nk),
        (b, h, nk, k_steps),
        [q_of_kv(d), kv_own(d), kv_own(dv), q_of_kv(dv), q_of_kv(1), q_of_kv(1), *id_specs],
        [own(bk, d), own(bk, dv)],
        [
            jax.ShapeDtypeStruct((b, h, skp, d), jnp.float32),
            jax.ShapeDtypeStruct((b, h, skp, dv), jnp.float32),
        ],
        [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)],
        k_table,
        k_counts,
        qt,
        kt,
        vt,
        do,
        lse,
        delta,
        *ids,
    )
    per_kv = lambda a: jnp.swapaxes(a.reshape(b, kvh, g, skp, -1).sum(2), 1, 2)[:, :sk]  # noqa: E731
    d_sinks = None
    if sinks is not None:
        lse_ = lse[..., 0]
        finite = lse_ != -jnp.inf
        p_sink = jnp.where(
            finite, jnp.exp(sinks.astype(jnp.float32)[None, :, None] - jnp.where(finite, lse_, 0.0)), 0.0
        )
        d_sinks = (-jnp.sum(p_sink * delta[..., 0], axis=(0, 2))).astype(sinks.dtype)
    return (
        jnp.swapaxes(dq, 1, 2)[:, :sq].astype(q.dtype),
        per_kv(dk).astype(k.dtype),
        per_kv(dvv).astype(v.dtype),
        d_sinks,
        None,
    )


_attention.defvjp(_attention_fwd, _attention_bwd)
