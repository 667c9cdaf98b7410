"""Flash attention as Pallas GPU (Triton) kernels, forward and backward, with static masks.

**Layout.** `q` to `[B, H, Sq, D]`, `k`, `v` to `[B, KVH, Sk, D]`, each length padded to whole
blocks (padded keys invisible, padded queries dropped). Grid `(B, H, q blocks)` forward and
for `dq`, `(B, H, kv blocks)` for `dk`, `dv`.

**Tiles.** A program loops only over the tiles its mask leaves non-empty: the bounds come from
the mask's `block_kinds`, computed before tracing (static masks: `Causal`, `SlidingWindow`,
`Full` and their `&`/`|`), so causal programs stop at the diagonal and sliding-window ones
start at the band. Masking work only where a tile is partial: each program's longest run of
`FULL` tiles (all of a causal row but the diagonal, the inside of a window's band) loops
without it, the tiles before and after that run apply `visible_2d` on the tile's indices.
With packed documents a statically `FULL` tile stays full when its query and key blocks lie
in one and the same document (the first such run of each program; ids computed per batch row
at run time); other tiles compare the ids.

**Forward.** Online softmax (running max and sum in float32); products in the inputs' dtype
with float32 accumulation (full precision for float32); sinks join the normaliser at the end;
`lse` saved (with sinks also what rounding `O` lost, `common.unrounded`). **Backward.**
`delta = rowsum(dO ∘ O)` in XLA; kernel `dq` (per q block, over its kv tiles; with sinks also
`Σ_j p_j dp_j` per row, the sinks' `delta`: `common.sink_grad`) and kernel `dk, dv` (per kv
block, over the q tiles that see it) recompute `p = exp(s - lse)`; `ds = p (dO v^T - delta)`,
times `1 - (s/c)^2` under the soft cap. With GQA the `dk`, `dv` kernel writes one slice per
query head, summed over each group in XLA; `dsink` in XLA.

**Cost.** Compute bound: `4·B·H·D` FLOPs per visible (query, key) pair forward, about 2.5
times that backward (the scores are recomputed in both backward kernels); bytes: `q`, `o` once,
`k`, `v` once per q block that sees them (L2 serves the rest), float32 `dk`, `dv` per query
head before the group sum.

**Packed documents.** `Segments`, alone or `&` a static mask: each batch row's tile bounds
come at run time from the static mask's block kinds and the id ranges of the query and key
blocks (a tile whose ranges do not overlap is skipped), and the ids are compared inside each
tile. The bounds are one contiguous range per block row, so documents keep the skipping exact
when their ids increase along the sequence.

**Constraints** (`supports` or an `Unsupported` at the call): head dims powers of two >= 16,
blocks powers of two >= 16 (Triton tiles), static masks or `Segments` `&` a static mask
(`PrefixLM`, `Dense` fall back to `xla`). Block sizes: `block_q`, `block_kv`, and Triton's
`num_warps`, `num_stages` (`None`: Triton's defaults) for the forward, and the same four of
each backward kernel (`*_dq`, `*_dkv`; `None`: the forward's); the lengths are padded to the
largest block of the three.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from axkern import masks as masks_
from axkern.core.blocks import next_power_of_2
from axkern.core.kernels import dot as _dot
from axkern.core.kernels import row_dot
from axkern.core.op import Implementation, Unsupported

from . import common as tiles
from .blocks import GPU_MIN_BLOCK as MIN
from .blocks import AttentionBlockSizes, pallas_gpu_heuristic, pallas_gpu_space


def supports(spec) -> str | None:
    for name in ("head_dim", "v_dim"):
        n = spec.dim(name)
        if n < MIN or n & (n - 1):
            return f"{name}={n}: the Pallas GPU kernels need a power of two >= {MIN} (Triton tiles)"
    return None


def _kinds(mask, sq, sk, sqp, skp, bq, bk):
    """The static mask's block kinds `[sqp / bq, skp / bk]`: the blocks past the lengths'
    own (the lengths are padded to the largest block of the three kernels) are `EMPTY`."""
    kinds = np.asarray(masks_.static_block_kinds(mask, sq, sk, bq, bk)[0])
    shape = (sqp // bq, skp // bk)
    return np.pad(
        kinds, [(0, shape[0] - kinds.shape[0]), (0, shape[1] - kinds.shape[1])], constant_values=masks_.EMPTY
    )


def _bounds(kinds, axis, batch, overlap=None, uniform=None):
    """For each batch row and each block along `axis` of the `[nq, nk]` kinds, the first and
    one-past-last non-empty block of the other axis (both 0 when none), and inside them the
    longest run of `FULL` blocks, `[flo, fhi)` (`flo == fhi == hi` when none): four `[B, n]`
    tables padded to a power-of-two length. With segments (traced `[B, nq, nk]` masks)
    `overlap` empties more tiles and `uniform` (both blocks in one document) leaves a static
    `FULL` tile full; the run is then the first one."""
    kinds = np.asarray(kinds)
    if axis == 1:
        kinds = kinds.T
    nonempty = jnp.asarray(kinds != masks_.EMPTY)[None]
    if overlap is not None:
        nonempty = nonempty & (jnp.swapaxes(overlap, 1, 2) if axis == 1 else overlap)
    nonempty = jnp.broadcast_to(nonempty, (batch,) + nonempty.shape[1:])
    n, m = nonempty.shape[1:]
    any_ = nonempty.any(2)
    lo = jnp.where(any_, jnp.argmax(nonempty, 2), 0)
    hi = jnp.where(any_, m - jnp.argmax(nonempty[:, :, ::-1], 2), 0)
    if overlap is None:
        runs = np.array([_longest_run(row == masks_.FULL) for row in kinds])  # [n, 2], static
        flo = jnp.broadcast_to(jnp.asarray(runs[:, 0])[None], (batch, n))
        fhi = jnp.broadcast_to(jnp.asarray(runs[:, 1])[None], (batch, n))
    else:  # packed documents: FULL where both blocks lie in one and the same document
        full = jnp.asarray(kinds == masks_.FULL)[None] & (
            jnp.swapaxes(uniform, 1, 2) if axis == 1 else uniform
        )
        flo, fhi = _first_run(full)
    flo, fhi = jnp.where(fhi > flo, flo, hi), jnp.where(fhi > flo, fhi, hi)
    size = next_power_of_2(n)
    pad = lambda a: jnp.pad(a, [(0, 0), (0, size - n)]).astype(jnp.int32)  # noqa: E731
    return pad(lo), pad(flo), pad(fhi), pad(hi)


def _first_run(flags):
    """`(start, stop)` of the first run of True along the last axis of a traced bool array
    (`start == stop` when none)."""
    m = flags.shape[-1]
    start = jnp.argmax(flags, -1)
    after = jnp.arange(m) >= start[..., None]
    run = jnp.cumprod(jnp.where(after, flags, True), axis=-1).astype(bool) & after
    return start, start + run.sum(-1)


def _longest_run(flags):
    """`(start, stop)` of the longest run of True in a 1-D bool array (`(0, 0)` when none)."""
    best, start = (0, 0), None
    for i, f in enumerate(list(flags) + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            best = max(best, (start, i), key=lambda r: r[1] - r[0])
            start = None
    return best


def _three_loops(bounds, row, body, init):
    """`body(j, carry, masked)` over `[lo, hi)` of `row` (`bounds`: the refs of `_bounds`' four
    tables): masked tiles before and after the `FULL` run `[flo, fhi)`, which runs without
    masking work."""
    lo, flo, fhi, hi = (ref[row] for ref in bounds)
    carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), init)
    carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


def _trailing_refs(rest, segments):
    """A kernel's refs after its inputs: the four bound tables (lo, flo, fhi, hi), the segment
    ids of the query and key blocks (`(None, None)` without segments), and the outputs."""
    bounds, rest = rest[:4], rest[4:]
    return bounds, (rest[:2] if segments else (None, None)), (rest[2:] if segments else rest)


def _fwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    sinks_ref,
    *rest,
    cfg,
    mask,
    sk,
    has_sinks,
    segments,
):
    bounds, (qid_ref, kid_ref), (o_ref, lse_ref, *lo_ref) = _trailing_refs(rest, segments)
    i = pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_kv
    q = q_ref[...]
    qi = i * bq + jnp.arange(bq)

    def body(j, carry, masked):
        m, l, acc = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = tiles.tile_scores(cfg, q, k)
        if masked:
            ids = (qid_ref[...], kid_ref[pl.ds(j * bk, bk)]) if segments else None
            vis = tiles.visible(mask, qi, j * bk + jnp.arange(bk), sk, ids)
            s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        pv = tiles.masked_pv(p, v, vis) if masked else _dot(p.astype(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, o_ref.shape[-1]), jnp.float32),
    )
    m, l, acc = _three_loops(bounds, i, body, init)
    if has_sinks:
        sink = sinks_ref[pl.program_id(1)]
        m_f = jnp.maximum(m, sink)
        m_f = jnp.where(m_f == -jnp.inf, 0.0, m_f)  # a -inf sink and no key seen: l stays 0
        alpha = jnp.exp(m - m_f)
        l = l * alpha + jnp.exp(sink - m_f)
        acc = acc * alpha[:, None]
        m = m_f
    out, lse = tiles.finish(m[:, None], l[:, None], acc)
    o, lo = tiles.rounding_lost(out, o_ref.dtype)
    o_ref[...] = o
    lse_ref[...] = lse[:, 0]
    if lo_ref:
        lo_ref[0][...] = lo


def _dq_kernel(
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
    segments,
    has_sinks,
):
    # with sinks also `Σ_j p_j dp_j` per row (`common.p_dp`), a second output
    bounds, (qid_ref, kid_ref), (dq_ref, *pdp_ref) = _trailing_refs(rest, segments)
    i = pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_kv
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    qi = i * bq + jnp.arange(bq)

    def body(j, carry, masked):
        dq, pdp = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        vis = None
        if masked:
            ids = (qid_ref[...], kid_ref[pl.ds(j * bk, bk)]) if segments else None
            vis = tiles.seen_rows(tiles.visible(mask, qi, j * bk + jnp.arange(bk), sk, ids), lse)
        s, p = tiles.probs(cfg, q, k, lse, vis)
        dp = _dot(do, v, trans_b=True)
        if has_sinks:
            pdp = pdp + tiles.p_dp(p, dp, vis, keepdims=False)
        ds = tiles.ds(cfg, s, p, dp, delta, vis)
        return dq + _dot(ds.astype(k.dtype), tiles.clean(k) if masked else k), pdp

    zero = jnp.zeros(dq_ref.shape, jnp.float32), jnp.zeros((bq,), jnp.float32)  # pdp: 0 without sinks
    dq, pdp = _three_loops(bounds, i, body, zero)
    dq_ref[...] = dq
    for ref in pdp_ref:  # with sinks
        ref[...] = pdp


def _dkv_kernel(
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
    segments,
):
    bounds, (qid_ref, kid_ref), (dk_ref, dv_ref) = _trailing_refs(rest, segments)
    j = pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_kv
    k, v = k_ref[...], v_ref[...]
    kj = j * bk + jnp.arange(bk)

    def body(i, carry, masked):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q, do, lse, delta = q_ref[rows, :], do_ref[rows, :], lse_ref[rows], delta_ref[rows]
        vis = None
        if masked:
            ids = (qid_ref[rows], kid_ref[...]) if segments else None
            vis = tiles.seen_rows(tiles.visible(mask, i * bq + jnp.arange(bq), kj, sk, ids), lse)
        s, p = tiles.probs(cfg, q, k, lse, vis)
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        ds = tiles.ds(cfg, s, p, _dot(do, v, trans_b=True), delta, vis)
        return dk + _dot(ds.astype(q.dtype), tiles.clean(q) if masked else q, trans_a=True), dv

    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = _three_loops(bounds, j, body, init)
    dk_ref[...], dv_ref[...] = dk, dv


def _call(cfg, kernel, grid, in_specs, out_specs, out_shape, *args):
    tuned = {k: v for k, v in (("num_warps", cfg.num_warps), ("num_stages", cfg.num_stages)) if v is not None}
    return pl.pallas_call(
        kernel,
        name=f"axkern_attention_gpu_{getattr(kernel, 'func', kernel).__name__.strip('_')}",
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(**tuned),  # Triton named: jax 0.10's default is Mosaic GPU
        interpret=cfg.interpret,
    )(*args)


def _block(shape, index):
    return pl.BlockSpec(shape, index)


def _segment_tiles(seg_ids, sqp, skp, bq, bk):
    """`(overlap, uniform)` of the segment ids' blocks, or `(None, None)` without segments."""
    if seg_ids is None:
        return None, None
    return tiles.segment_overlap(seg_ids, sqp, skp, bq, bk), tiles.segment_uniform(seg_ids, sqp, skp, bq, bk)


def _tile_bounds(mask, seg_ids, sq, sk, sqp, skp, bq, bk, axis, batch):
    """`_bounds` of one kernel's `bq` x `bk` tiles along `axis`, with the segments' overlap and
    uniformity when there are segment ids."""
    overlap, uniform = _segment_tiles(seg_ids, sqp, skp, bq, bk)
    return _bounds(_kinds(mask, sq, sk, sqp, skp, bq, bk), axis, batch, overlap, uniform)


def _segment_inputs(seg_ids, sqp, skp, q_block, k_block):
    """Segment-id operands and their block specs (`q_block`, `k_block`: (shape, index map)),
    or nothing without segments."""
    if seg_ids is None:
        return [], []
    q_ids, kv_ids = tiles.padded_ids(seg_ids, sqp, skp)
    return [q_ids, kv_ids], [_block(*q_block), _block(*k_block)]


def _forward(cfg, q, k, v, sinks, seg_ids, mask, *, lo=False):
    qt, kt, vt, (b, sq, sk, h, kvh, sqp, skp) = tiles.layout(q, k, v, cfg)
    g = h // kvh
    bq, bk, d, dv = cfg.block_q, cfg.block_kv, q.shape[3], v.shape[3]
    segments = seg_ids is not None
    bounds = _tile_bounds(mask, seg_ids, sq, sk, sqp, skp, bq, bk, 0, b)
    nb = bounds[0].shape[1]
    has_sinks = sinks is not None
    sink_arr = (sinks if has_sinks else jnp.zeros((h,))).astype(jnp.float32)
    sink_arr = jnp.pad(sink_arr, (0, next_power_of_2(h) - h))
    ids, id_specs = _segment_inputs(
        seg_ids,
        sqp,
        skp,
        ((None, bq), lambda b_, h_, i: (b_, i)),
        ((None, skp), lambda b_, h_, i: (b_, 0)),
    )
    o_spec = _block((None, None, bq, dv), lambda b_, h_, i: (b_, h_, i, 0))
    o_shape = jax.ShapeDtypeStruct((b, h, sqp, dv), q.dtype)
    o, lse, *lo_out = _call(
        cfg,
        functools.partial(_fwd_kernel, cfg=cfg, mask=mask, sk=sk, has_sinks=has_sinks, segments=segments),
        (b, h, sqp // bq),
        [
            _block((None, None, bq, d), lambda b_, h_, i: (b_, h_, i, 0)),
            _block((None, None, skp, d), lambda b_, h_, i: (b_, h_ // g, 0, 0)),
            _block((None, None, skp, dv), lambda b_, h_, i: (b_, h_ // g, 0, 0)),
            _block((sink_arr.shape[0],), lambda b_, h_, i: (0,)),
            *[_block((None, nb), lambda b_, h_, i: (b_, 0))] * 4,
            *id_specs,
        ],
        [o_spec, _block((None, None, bq), lambda b_, h_, i: (b_, h_, i))] + [o_spec] * lo,
        [o_shape, jax.ShapeDtypeStruct((b, h, sqp), jnp.float32)] + [o_shape] * lo,
        qt,
        kt,
        vt,
        sink_arr,
        *bounds,
        *ids,
    )
    return o, lse, (lo_out[0] if lo else None)


def _check_blocks(block_sizes, kernels=("fwd", "dq", "dkv")):
    for kernel in kernels:
        bs, suffix = block_sizes.kernel(kernel), "" if kernel == "fwd" else f"_{kernel}"
        for name, n in (("block_q", bs.block_q), ("block_kv", bs.block_kv)):
            if n < MIN or n & (n - 1):
                raise Unsupported(f"{name}{suffix}={n}: Triton tiles need a power of two >= {MIN}")


def attention(
    q, k, v, sinks, mask, *, scale, logits_soft_cap, block_sizes, interpret=False, return_lse=False
):
    tiles.refuse_ping_pong(block_sizes, "pallas_gpu")
    _check_blocks(block_sizes)
    cfg, seg_ids, static = tiles.prepare(
        mask, block_sizes, scale, logits_soft_cap, interpret, per_kernel=True
    )
    return tiles.maybe_lse(_attention(cfg, q, k, v, sinks, seg_ids, static), return_lse)


def _attention_bwd(cfg, mask, res, d_out, d_lse):
    q, k, v, sinks, seg_ids, o, lse, lo = res
    qt, kt, vt, (b, sq, sk, h, kvh, sqp, skp) = tiles.layout(q, k, v, cfg)
    lse = tiles.padded_rows(lse, sq, -jnp.inf)
    g = h // kvh
    d, dv = q.shape[3], v.shape[3]
    segments = seg_ids is not None
    do = jnp.pad(jnp.swapaxes(d_out, 1, 2), [(0, 0), (0, 0), (0, sqp - sq), (0, 0)]).astype(q.dtype)
    delta = row_dot(do, tiles.unrounded(o, lo))  # [B, H, Sqp]
    delta = tiles.padded_rows(delta, sq, 0.0) - d_lse  # `lse`'s cotangent joins delta
    _, cq, ckv = cfg.kernels()  # the dq kernel's and the dk, dv kernel's own blocks
    bq, bk = cq.block_q, cq.block_kv
    q_bounds = _tile_bounds(mask, seg_ids, sq, sk, sqp, skp, bq, bk, 0, b)
    row = lambda n, w: _block((None, None, n, w), lambda b_, h_, x: (b_, h_, x, 0))  # noqa: E731
    whole = lambda n, w, div=1: _block((None, None, n, w), lambda b_, h_, x: (b_, h_ // div, 0, 0))  # noqa: E731
    vec_row = _block((None, None, bq), lambda b_, h_, x: (b_, h_, x))
    vec_whole = _block((None, None, sqp), lambda b_, h_, x: (b_, h_, 0))
    table = lambda a: _block((None, a.shape[1]), lambda b_, h_, x: (b_, 0))  # noqa: E731
    ids, id_specs = _segment_inputs(
        seg_ids,
        sqp,
        skp,
        ((None, bq), lambda b_, h_, i: (b_, i)),
        ((None, skp), lambda b_, h_, i: (b_, 0)),
    )
    has_sinks = sinks is not None
    dq, *pdp = _call(
        cq,
        functools.partial(_dq_kernel, cfg=cq, mask=mask, sk=sk, segments=segments, has_sinks=has_sinks),
        (b, h, sqp // bq),
        [
            row(bq, d),
            whole(skp, d, g),
            whole(skp, dv, g),
            row(bq, dv),
            vec_row,
            vec_row,
            *map(table, q_bounds),
            *id_specs,
        ],
        [row(bq, d)] + [vec_row] * has_sinks,
        [jax.ShapeDtypeStruct((b, h, sqp, d), jnp.float32)]
        + [jax.ShapeDtypeStruct((b, h, sqp), jnp.float32)] * has_sinks,
        qt,
        kt,
        vt,
        do,
        lse,
        delta,
        *q_bounds,
        *ids,
    )
    bq, bk = ckv.block_q, ckv.block_kv
    k_bounds = _tile_bounds(mask, seg_ids, sq, sk, sqp, skp, bq, bk, 1, b)
    kv_row = lambda w: _block((None, None, bk, w), lambda b_, h_, x: (b_, h_ // g, x, 0))  # noqa: E731
    out_row = lambda w: _block((None, None, bk, w), lambda b_, h_, x: (b_, h_, x, 0))  # noqa: E731
    ids, id_specs = _segment_inputs(
        seg_ids,
        sqp,
        skp,
        ((None, sqp), lambda b_, h_, j: (b_, 0)),
        ((None, bk), lambda b_, h_, j: (b_, j)),
    )
    dk, dvv = _call(
        ckv,
        functools.partial(_dkv_kernel, cfg=ckv, mask=mask, sk=sk, segments=segments),
        (b, h, skp // bk),
        [
            whole(sqp, d),
            kv_row(d),
            kv_row(dv),
            whole(sqp, dv),
            vec_whole,
            vec_whole,
            *map(table, k_bounds),
            *id_specs,
        ],
        [out_row(d), out_row(dv)],
        [
            jax.ShapeDtypeStruct((b, h, skp, d), jnp.float32),
            jax.ShapeDtypeStruct((b, h, skp, dv), jnp.float32),
        ],
        qt,
        kt,
        vt,
        do,
        lse,
        delta,
        *k_bounds,
        *ids,
    )
    return tiles.finish_grads(q, k, v, sinks, dq, dk, dvv, lse, pdp[0] if has_sinks else None, d_lse)


_attention = tiles.flash_vjp(_forward, _attention_bwd)


IMPLEMENTATION = Implementation(
    "pallas_gpu",
    attention,
    platforms=("gpu",),
    supports=supports,
    block_sizes=AttentionBlockSizes,
    heuristic=pallas_gpu_heuristic,
    space=pallas_gpu_space,
    interpretable=True,
    backward="custom_vjp: Pallas dq and dk/dv kernels, each with its own tiles",
)
