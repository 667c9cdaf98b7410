"""Block-sparse ("splash") attention as Mosaic TPU Pallas kernels, forward and backward.

Its values are checked in TPU interpret mode (`pltpu.InterpretParams`), its lowering for a TPU
v5e in CI (tests/test_tpu_lowering.py), and compiled on a TPU v5e by `tests/tpu`; it is first in
attention's TPU order (docs/tpu.md, "Measured"). The kernels' elementwise work
is float32 (a v5e has no 16-bit vector unit: Mosaic refuses a bfloat16 finiteness test), their
products take `q`, `k`, `v`'s dtype with float32 accumulation, float32 ones at full precision.

**Schedule.** Before tracing, the static mask's `block_kinds` give, for each query block, the
list of its non-empty key blocks (and for each key block, its non-empty query blocks). The
lists are padded to the longest by repeating their last entry and handed to the kernels as
scalar-prefetch tables (`PrefetchScalarGridSpec`): a block spec's index map reads the table,
so grid step `s` of query block `i` fetches key block `table[i, s]`, a repeated index fetches
nothing new, and steps past the list's length compute nothing. Empty tiles therefore cost
neither DMA nor compute; only the longest row's length is paid in (idle) grid steps. Each list
holds its partial tiles first, then its `FULL` ones, and a second count table says where
masking work stops (with packed documents every tile is partial: ids are compared).

**Forward.** Grid `(batch, heads, q blocks, steps)`; online softmax in VMEM scratch (running
max, sum, float32 accumulator); sinks join the normaliser at the last step; `lse` saved
(with sinks, for the residuals, also what rounding `O` lost: `common.unrounded`).
**Backward.** `delta = rowsum(dO ∘ O)` in XLA (`O` unrounded with sinks); kernel `dq` with the
forward's schedule, kernel `dk, dv` with the transposed schedule (per key block, over the query
blocks that see it), both recomputing `p = exp(s - lse)` per tile (`pallas_gpu`'s tile math,
shared). With GQA the `dk, dv` kernel writes one slice per query head, summed over each group
in XLA; `dsink` in XLA, its `delta` summed as `Σ_j p_j dp_j` by the `dq` kernel
(`common.sink_grad`).

**Cost.** Compute bound: `4·B·H·D` FLOPs per visible (query, key) pair forward, about 2.5
times that backward (both backward kernels recompute the scores); bytes: `q`, `o` once per
head, a `k`, `v` block per non-empty tile (double-buffered DMA; a repeated index fetches
nothing), float32 `dk`, `dv` per query head before the group sum. The schedule tables live in
SMEM: `B·n·steps` int32 each, and the counts `2·B·n` (with a prefix `+ B`).

**Packed documents.** `Segments(q_ids, kv_ids)`, alone or `&` a static mask, is served too:
the schedule is then computed at run time per batch row (a tile stays in a row's list when
the static mask leaves it non-empty and the id ranges of its query and key blocks overlap),
padded to the static mask's longest list, and the kernels compare the ids inside each tile.

**Prefix-LM.** `PrefixLM(lengths)` is `Causal() | keys below the row's prefix`; alone or `|` a
static mask, the static part is that mask `| Causal()` and the schedule is built at run time:
a row's tiles are the static part's and those whose first key lies below its prefix, the ones
wholly below it (and within both lengths) need no masking, and every row may take all the
blocks. The prefix lengths follow the counts in the scalar-prefetch table; a partial tile
shows its keys below the row's prefix too. `& Segments` keeps the tiles whose id ranges
overlap, all of them partial (ids compared).

**Constraints.** Static masks, `Segments` `&` a static mask, `PrefixLM` alone or `|` a static
mask, either `&` `Segments` (`Dense` and other array masks fall back to `xla`); blocks
multiples of 8 (sublanes). On a real TPU blocks of 128 or more keep the MXU busy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from axkern.core.kernels import dot as _dot
from axkern.core.kernels import row_dot
from axkern.core.op import Implementation, Unsupported

from .. import common as tiles
from ..blocks import TPU_SUBLANES as SUBLANES
from ..blocks import AttentionBlockSizes, pallas_tpu_heuristic, pallas_tpu_space, pallas_tpu_vmem_limit
from .rows import as_rows, column, id_inputs, own_block, row_spec
from .schedules import plan, split_prefix


def _tile_steps(count_ref, row, rows, s, update):
    """Run `update(masked)` at grid step `s` of `row`: masked while `s` is below the row's
    partial count, unmasked after it, nothing past the row's count."""
    count, partial = count_ref[row], count_ref[rows + row]

    @pl.when(s < partial)
    def _():
        update(True)

    @pl.when((s >= partial) & (s < count))
    def _():
        update(False)


def _call(cfg, kernel, grid, in_specs, out_specs, out_shape, scratch, *args):
    return pl.pallas_call(
        kernel,
        name=f"axkern_attention_tpu_{getattr(kernel, 'func', kernel).__name__.strip('_')}",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch
        ),
        out_shape=out_shape,
        interpret=pltpu.InterpretParams() if cfg.interpret else False,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=None if cfg.interpret else pallas_tpu_vmem_limit(),
        ),
    )(*args)


def _tile(i, j, cfg, qid_ref, kid_ref):
    """Query and key indices of tile `(i, j)`, and its segment ids (`[bq]`, `[bk]`) or None."""
    bq, bk = cfg.block_q, cfg.block_kv
    ids = None if qid_ref is None else (column(qid_ref), kid_ref[...][0])
    return i * bq + jnp.arange(bq), j * bk + jnp.arange(bk), ids


def _fwd_kernel(
    table_ref,
    count_ref,
    q_ref,
    k_ref,
    v_ref,
    sink_ref,
    *rest,
    cfg,
    mask,
    sk,
    steps,
    has_sinks,
    segments,
    prefix,
    nq,
    rows,
):
    qid_ref, kid_ref = rest[:2] if segments else (None, None)
    o_ref, lse_ref, *lo_ref, m_sc, l_sc, acc_sc = rest[2:] if segments else rest
    b, i, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row = b * nq + i
    pre = count_ref[2 * rows + b] if prefix else None  # the row's prefix length

    @pl.when(s == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def update(masked):
        j = table_ref[row * steps + s]
        sc = tiles.tile_scores(cfg, q_ref[...], k_ref[...])
        if masked:
            qi, kj, ids = _tile(i, j, cfg, qid_ref, kid_ref)
            vis = tiles.visible(mask, qi, kj, sk, ids, pre)
            sc = jnp.where(vis, sc, -jnp.inf)
        m = m_sc[...]
        m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(sc - m_safe)
        v = v_ref[...]
        pv = tiles.masked_pv(p, v, vis) if masked else _dot(p.astype(v.dtype), v)
        acc_sc[...] = acc_sc[...] * alpha + pv
        l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new

    _tile_steps(count_ref, row, rows, s, update)

    @pl.when(s == steps - 1)
    def _():
        m, l, acc = m_sc[...], l_sc[...], acc_sc[...]
        if has_sinks:
            sink = sink_ref[...][:, :1]  # [1, 1]
            m_f = jnp.maximum(m, sink)
            m_f = jnp.where(m_f == -jnp.inf, 0.0, m_f)  # a -inf sink and no key seen: l stays 0
            alpha = jnp.exp(m - m_f)
            l = l * alpha + jnp.exp(sink - m_f)
            acc = acc * alpha
            m = m_f
        out, lse = tiles.finish(m, l, acc)
        o, lo = tiles.rounding_lost(out, o_ref.dtype)
        o_ref[...] = o
        lse_ref[...] = lse.T  # [bq, 1] -> the row in memory
        if lo_ref:
            lo_ref[0][...] = lo


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
    prefix,
    nq,
    rows,
    has_sinks,
):
    qid_ref, kid_ref = rest[:2] if segments else (None, None)
    rest = rest[2:] if segments else rest
    # with sinks also `Σ_j p_j dp_j` per row (`common.p_dp`), in a second output and scratch
    (dq_ref, pdp_ref, dq_sc, pdp_sc) = rest if has_sinks else (rest[0], None, rest[1], None)
    b, i, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row = b * nq + i
    pre = count_ref[2 * rows + b] if prefix else None  # the row's prefix length

    @pl.when(s == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)
        if has_sinks:
            pdp_sc[...] = jnp.zeros(pdp_sc.shape, jnp.float32)

    def update(masked):
        j = table_ref[row * steps + s]
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        vis = None
        if masked:
            qi, kj, ids = _tile(i, j, cfg, qid_ref, kid_ref)
            vis = tiles.seen_rows(tiles.visible(mask, qi, kj, sk, ids, pre), column(lse_ref))
        sc, p = tiles.probs(cfg, q, k, column(lse_ref), vis)
        dp = _dot(do, v, trans_b=True)
        if has_sinks:
            pdp_sc[...] += tiles.p_dp(p, dp, vis)
        ds = tiles.ds(cfg, sc, p, dp, column(delta_ref), vis)
        dq_sc[...] += _dot(ds.astype(k.dtype), tiles.clean(k) if masked else k)

    _tile_steps(count_ref, row, rows, s, update)

    @pl.when(s == steps - 1)
    def _():
        dq_ref[...] = dq_sc[...]
        if has_sinks:
            pdp_ref[...] = pdp_sc[...].T


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
    prefix,
    nk,
    rows,
):
    qid_ref, kid_ref = rest[:2] if segments else (None, None)
    dk_ref, dv_ref, dk_sc, dv_sc = rest[2:] if segments else rest
    b, j, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row = b * nk + j
    pre = count_ref[2 * rows + b] if prefix else None

    @pl.when(s == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def update(masked):
        i = table_ref[row * steps + s]
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        vis = None
        if masked:
            qi, kj, ids = _tile(i, j, cfg, qid_ref, kid_ref)
            vis = tiles.seen_rows(tiles.visible(mask, qi, kj, sk, ids, pre), column(lse_ref))
        sc, p = tiles.probs(cfg, q, k, column(lse_ref), vis)
        dv_sc[...] += _dot(p.astype(do.dtype), do, trans_a=True)
        ds = tiles.ds(cfg, sc, p, _dot(do, v, trans_b=True), column(delta_ref), vis)
        dk_sc[...] += _dot(ds.astype(q.dtype), tiles.clean(q) if masked else q, trans_a=True)

    _tile_steps(count_ref, row, rows, s, update)

    @pl.when(s == steps - 1)
    def _():
        dk_ref[...] = dk_sc[...]
        dv_ref[...] = dv_sc[...]


def _forward(cfg, q, k, v, sinks, arrays, mask, *, lo=False):
    qt, kt, vt, (b, sq, sk, h, kvh, sqp, skp) = tiles.layout(q, k, v, cfg)
    g = h // kvh
    bq, bk, d, dv = cfg.block_q, cfg.block_kv, q.shape[3], v.shape[3]
    nq = sqp // bq
    seg_ids = arrays[0]
    table, counts, steps = plan(cfg, mask, arrays, b, sq, sk, sqp, skp, 0)
    kv_block = lambda b_, i, s, t: t[(b_ * nq + i) * steps + s]  # noqa: E731
    has_sinks = sinks is not None
    sink_arr = jnp.broadcast_to(
        (sinks if has_sinks else jnp.zeros((h,))).astype(jnp.float32)[:, None, None], (h, 1, 128)
    )
    kv = lambda w: pl.BlockSpec(  # noqa: E731
        (None, None, bk, w), lambda b_, h_, i, s, t, c: (b_, h_ // g, kv_block(b_, i, s, t), 0)
    )
    ids, id_specs = id_inputs(seg_ids, sqp, skp, lambda b_, i, s, t: i, kv_block, bq, bk)
    o_spec = pl.BlockSpec((None, None, bq, dv), lambda b_, h_, i, s, t, c: (b_, h_, i, 0))
    o_shape = jax.ShapeDtypeStruct((b, h, sqp, dv), q.dtype)
    o, lse, *lo_out = _call(
        cfg,
        functools.partial(
            _fwd_kernel,
            cfg=cfg,
            mask=mask,
            sk=sk,
            steps=steps,
            has_sinks=has_sinks,
            segments=seg_ids is not None,
            prefix=arrays[1] is not None,
            nq=nq,
            rows=b * nq,
        ),
        (b, h, nq, steps),
        [
            pl.BlockSpec((None, None, bq, d), lambda b_, h_, i, s, t, c: (b_, h_, i, 0)),
            kv(d),
            kv(dv),
            pl.BlockSpec((None, 1, 128), lambda b_, h_, i, s, t, c: (h_, 0, 0)),
            *id_specs,
        ],
        [o_spec, row_spec(bq, own_block)] + [o_spec] * lo,
        [o_shape, jax.ShapeDtypeStruct((b, h, nq, 1, bq), jnp.float32)] + [o_shape] * lo,
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
    return o, lse.reshape(b, h, sqp), (lo_out[0] if lo else None)


def attention(
    q, k, v, sinks, mask, *, scale, logits_soft_cap, block_sizes, interpret=False, return_lse=False
):
    tiles.refuse_ping_pong(block_sizes, "pallas_tpu")
    for name, n in (("block_q", block_sizes.block_q), ("block_kv", block_sizes.block_kv)):
        if n % SUBLANES:
            raise Unsupported(f"{name}={n}: TPU blocks need a multiple of {SUBLANES} (sublanes)")
    static, prefix = split_prefix(mask)
    try:
        cfg, seg_ids, static = tiles.prepare(static, block_sizes, scale, logits_soft_cap, interpret)
    except Unsupported:
        raise Unsupported(
            f"{mask!r} holds arrays; pallas_tpu takes static masks, Segments & a static mask, and "
            "PrefixLM alone or | a static mask, either & Segments"
        ) from None
    return tiles.maybe_lse(_attention(cfg, q, k, v, sinks, (seg_ids, prefix), static), return_lse)


def _attention_bwd(cfg, mask, res, d_out, d_lse):
    q, k, v, sinks, arrays, o, lse, lo = res
    seg_ids, prefix = arrays[0], arrays[1] is not None
    qt, kt, vt, (b, sq, sk, h, kvh, sqp, skp) = tiles.layout(q, k, v, cfg)
    lse = tiles.padded_rows(lse, sq, -jnp.inf)
    g = h // kvh
    bq, bk, d, dv = cfg.block_q, cfg.block_kv, q.shape[3], v.shape[3]
    nq, nk = sqp // bq, skp // bk
    segments = seg_ids is not None
    do = jnp.pad(jnp.swapaxes(d_out, 1, 2), [(0, 0), (0, 0), (0, sqp - sq), (0, 0)]).astype(q.dtype)
    delta = row_dot(do, tiles.unrounded(o, lo))  # [B, H, Sqp]
    delta = tiles.padded_rows(delta, sq, 0.0) - d_lse  # `lse`'s cotangent joins delta
    lse_rows, delta = as_rows(lse, bq), as_rows(delta, bq)
    own = lambda n, w: pl.BlockSpec((None, None, n, w), lambda b_, h_, x, s, t, c: (b_, h_, x, 0))  # noqa: E731

    q_table, q_counts, q_steps = plan(cfg, mask, arrays, b, sq, sk, sqp, skp, 0)
    kv_block = lambda b_, i, s, t: t[(b_ * nq + i) * q_steps + s]  # noqa: E731
    kv_of_q = lambda w: pl.BlockSpec(  # noqa: E731
        (None, None, bk, w), lambda b_, h_, i, s, t, c: (b_, h_ // g, kv_block(b_, i, s, t), 0)
    )
    ids, id_specs = id_inputs(seg_ids, sqp, skp, lambda b_, i, s, t: i, kv_block, bq, bk)
    has_sinks = sinks is not None
    row = jax.ShapeDtypeStruct((b, h, nq, 1, bq), jnp.float32)
    dq, *pdp = _call(
        cfg,
        functools.partial(
            _dq_kernel,
            cfg=cfg,
            mask=mask,
            sk=sk,
            steps=q_steps,
            segments=segments,
            prefix=prefix,
            nq=nq,
            rows=b * nq,
            has_sinks=has_sinks,
        ),
        (b, h, nq, q_steps),
        [
            own(bq, d),
            kv_of_q(d),
            kv_of_q(dv),
            own(bq, dv),
            row_spec(bq, own_block),
            row_spec(bq, own_block),
        ]
        + id_specs,
        [own(bq, d)] + [row_spec(bq, own_block)] * has_sinks,
        [jax.ShapeDtypeStruct((b, h, sqp, d), jnp.float32)] + [row] * has_sinks,
        [pltpu.VMEM((bq, d), jnp.float32)] + [pltpu.VMEM((bq, 1), jnp.float32)] * has_sinks,
        q_table,
        q_counts,
        qt,
        kt,
        vt,
        do,
        lse_rows,
        delta,
        *ids,
    )

    k_table, k_counts, k_steps = plan(cfg, mask, arrays, b, sq, sk, sqp, skp, 1)
    q_block = lambda b_, j, s, t: t[(b_ * nk + j) * k_steps + s]  # noqa: E731
    q_of_kv = lambda w: pl.BlockSpec(  # noqa: E731
        (None, None, bq, w), lambda b_, h_, j, s, t, c: (b_, h_, q_block(b_, j, s, t), 0)
    )
    kv_own = lambda w: pl.BlockSpec((None, None, bk, w), lambda b_, h_, j, s, t, c: (b_, h_ // g, j, 0))  # noqa: E731
    ids, id_specs = id_inputs(seg_ids, sqp, skp, q_block, lambda b_, j, s, t: j, bq, bk)
    dk, dvv = _call(
        cfg,
        functools.partial(
            _dkv_kernel,
            cfg=cfg,
            mask=mask,
            sk=sk,
            steps=k_steps,
            segments=segments,
            prefix=prefix,
            nk=nk,
            rows=b * nk,
        ),
        (b, h, nk, k_steps),
        [q_of_kv(d), kv_own(d), kv_own(dv), q_of_kv(dv), row_spec(bq, q_block), row_spec(bq, q_block)]
        + id_specs,
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
        lse_rows,
        delta,
        *ids,
    )
    pdp = pdp[0].reshape(b, h, sqp) if has_sinks else None
    return tiles.finish_grads(q, k, v, sinks, dq, dk, dvv, lse, pdp, d_lse)


_attention = tiles.flash_vjp(_forward, _attention_bwd)


IMPLEMENTATION = Implementation(
    "pallas_tpu",
    attention,
    platforms=("tpu",),
    block_sizes=AttentionBlockSizes,
    heuristic=pallas_tpu_heuristic,
    space=pallas_tpu_space,
    interpretable=True,
    backward="custom_vjp: block-sparse Pallas dq and dk/dv kernels",
)
