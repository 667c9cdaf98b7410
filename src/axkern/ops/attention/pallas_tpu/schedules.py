"""The block schedules of the Pallas TPU attention kernels: per grid row (a query block forward
and in the `dq` pass, a key block in the `dk, dv` pass) the list of its non-empty tiles, partial
ones first, as the scalar-prefetch tables the block specs' index maps read. Static masks give
them before tracing; packed documents and prefix lengths at run time, per batch row."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from axkern import masks as masks_

from .. import common as tiles


def schedule(kinds, axis, batch, nonempty=None, full=None):
    """Flattened `[batch, n, steps]` table of each row's non-empty blocks, partial ones first,
    then `FULL` ones (padded by repeating the last), the flattened `[batch, n]` counts followed
    by the counts of partial blocks (`2·batch·n` int32: a row's steps past its partial count
    run without masking work), and `steps` (the longest list `kinds` allows, at least 1).
    `nonempty [batch, nq, nk]` (traced, within `kinds`' non-empty tiles) replaces `kinds`' at run
    time, and `full` (traced, or None: every tile partial) says which of those need no masking."""
    kinds = np.asarray(kinds)
    if axis == 1:
        kinds = kinds.T
    counts = (kinds != masks_.EMPTY).sum(1).astype(np.int32)
    steps = max(1, int(counts.max(initial=0)))
    if nonempty is None:
        table = np.zeros((kinds.shape[0], steps), np.int32)
        for r, row in enumerate(kinds):
            cols = np.concatenate([np.flatnonzero(row == masks_.PARTIAL), np.flatnonzero(row == masks_.FULL)])
            if cols.size:
                table[r, : cols.size] = cols
                table[r, cols.size :] = cols[-1]
        partial = (kinds == masks_.PARTIAL).sum(1).astype(np.int32)
        tile = lambda a: np.tile(a.reshape(-1), batch)  # noqa: E731
        return jnp.asarray(tile(table)), jnp.asarray(np.concatenate([tile(counts), tile(partial)])), steps
    ne = nonempty if axis == 0 else jnp.swapaxes(nonempty, 1, 2)
    part = ne if full is None else ne & ~(full if axis == 0 else jnp.swapaxes(full, 1, 2))
    counts = ne.sum(-1).astype(jnp.int32)
    rank = jnp.where(part, 0, jnp.where(ne, 1, 2))  # partial, then full, then empty
    order = jnp.argsort(rank, axis=-1, stable=True)[..., :steps].astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    table = jnp.where(jnp.arange(steps) < counts[..., None], order, last)
    return (
        table.reshape(-1),
        jnp.concatenate([counts.reshape(-1), part.sum(-1).astype(jnp.int32).reshape(-1)]),
        steps,
    )


def plan(cfg, mask, arrays, b, sq, sk, sqp, skp, axis):
    """The schedule for grid rows over q blocks (`axis` 0) or kv blocks (1); with a prefix the
    counts are followed by each batch row's prefix length (`[B]` int32, the kernels read it)."""
    bq, bk = cfg.block_q, cfg.block_kv
    seg_ids, prefix = arrays
    kinds = masks_.static_block_kinds(mask, sq, sk, bq, bk)[0]
    if prefix is None:
        if seg_ids is None:
            return schedule(kinds, axis, b)
        # with packed documents every tile is partial (ids are compared)
        overlap = tiles.segment_overlap(seg_ids, sqp, skp, bq, bk)
        return schedule(kinds, axis, b, jnp.asarray(kinds != masks_.EMPTY)[None] & overlap)
    # `mask | keys below the prefix`: the static mask's tiles, and those whose first key lies
    # below the row's prefix; full where the static mask's are, or where every key of the tile
    # lies below the prefix and within the keys (and every query within the queries)
    nq, nk = kinds.shape
    first = jnp.arange(nk) * bk
    some = first[None, :] < prefix[:, None]  # [B, nk]
    every = (first + bk)[None, :] <= jnp.minimum(prefix, sk)[:, None]
    queries_whole = jnp.asarray((np.arange(nq) + 1) * bq <= sq)[None, :, None]
    nonempty = jnp.asarray(kinds != masks_.EMPTY)[None] | some[:, None, :]
    full = jnp.asarray(kinds == masks_.FULL)[None] | (every[:, None, :] & queries_whole)
    if seg_ids is not None:  # and packed documents: their overlap, every tile partial
        nonempty, full = nonempty & tiles.segment_overlap(seg_ids, sqp, skp, bq, bk), None
    table, counts, steps = schedule(np.ones_like(kinds), axis, b, nonempty, full)
    return table, jnp.concatenate([counts, prefix]), steps


def split_prefix(mask):
    """`(static mask, int32 prefix lengths)` for `PrefixLM` alone or `|` a static mask (the
    prefix's keys join the static mask's `Causal()`), and `(Segments & static mask, lengths)`
    for either `&` `Segments`; else `(mask, None)`."""
    if type(mask) is masks_.And:
        for seg, rest in ((mask.a, mask.b), (mask.b, mask.a)):
            if isinstance(seg, masks_.Segments):
                static, prefix = split_prefix(rest)
                if prefix is not None:
                    return seg & static, prefix
    parts = [mask] if isinstance(mask, masks_.PrefixLM) else []
    if type(mask) is masks_.Or:
        for pre, rest in ((mask.a, mask.b), (mask.b, mask.a)):
            if isinstance(pre, masks_.PrefixLM) and masks_.is_static(rest):
                parts = [pre, rest]
                break
    if not parts:
        return mask, None
    static = masks_.Causal() if len(parts) == 1 else masks_.Causal() | parts[1]
    return static, masks_.int32_lengths(parts[0].prefix_lengths)
