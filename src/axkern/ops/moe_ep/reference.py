"""The transport by all-gathers instead of all-to-alls: every device sees every device's pairs and
picks its own. The oracle for `xla` (same slots and grouping, another data path)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _pairs(topk_idx, num_experts, ranks, capacity):
    """Per device and pair: destination rank, slot, whether it fits, the local expert."""
    local = num_experts // ranks
    e = topk_idx.reshape(topk_idx.shape[0], -1).astype(jnp.int32)  # [R, T·K]
    valid = (e >= 0) & (e < num_experts)
    dst = jnp.where(valid, e // local, -1)
    slot = jnp.zeros_like(dst)
    for r in range(ranks):  # a pair's slot: how many earlier pairs of its device go to the same rank
        to_r = dst == r
        slot = jnp.where(to_r, jnp.cumsum(to_r, axis=1) - 1, slot)
    return dst, slot, valid & (slot < capacity), jnp.where(valid, e % local, -1), valid


def dispatch(x, topk_idx, *, num_experts, axis_name, ranks, capacity):
    tokens, topk = topk_idx.shape
    local = num_experts // ranks
    me = lax.axis_index(axis_name)
    xs = lax.all_gather(x, axis_name)  # [R, T, D]
    ids = lax.all_gather(topk_idx, axis_name)  # [R, T, K]
    dst, slot, sent, expert, valid = _pairs(ids, num_experts, ranks, capacity)
    mine = sent & (dst == me)  # [R, T·K]: the pairs each device sends here
    src = jnp.broadcast_to(jnp.arange(ranks)[:, None], mine.shape)
    where = jnp.where(mine, src * capacity + slot, ranks * capacity)
    rows = jnp.repeat(xs, topk, axis=1).reshape(ranks * tokens * topk, -1)
    recv_x = jnp.zeros((ranks * capacity, x.shape[1]), x.dtype).at[where.reshape(-1)].set(rows, mode="drop")
    recv_e = (
        jnp.full((ranks * capacity,), -1, jnp.int32)
        .at[where.reshape(-1)]
        .set(expert.reshape(-1), mode="drop")
    )
    key = jnp.where(recv_e >= 0, recv_e, local)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((local + 1,), jnp.int32).at[key].add(1)[:local]
    own = lambda a: a[me].reshape(tokens, topk)  # noqa: E731
    dropped = jnp.sum(valid[me] & ~sent[me]) + jnp.sum(~valid[me])
    return recv_x[order], group_sizes, order, own(jnp.maximum(dst, 0)), own(slot), own(sent), dropped


def combine(expert_y, topk_weights, order, dst, slot, sent, *, axis_name, ranks, capacity):
    tokens, topk = topk_weights.shape
    me = lax.axis_index(axis_name)
    received = jnp.zeros_like(expert_y).at[order].set(expert_y).reshape(ranks, capacity, -1)
    every = lax.all_gather(received, axis_name)  # [R (holder), R (source), C, D']
    back = every[:, me]  # what each holder computed for this device's pairs
    idx = jnp.where(sent, dst * capacity + slot, 0).reshape(-1)
    acc = jnp.promote_types(expert_y.dtype, jnp.float32)
    vals = back.reshape(ranks * capacity, -1)[idx].astype(acc) * topk_weights.reshape(-1, 1).astype(acc)
    vals = jnp.where(sent.reshape(-1, 1), vals, 0)
    return vals.reshape(tokens, topk, expert_y.shape[1]).sum(1).astype(expert_y.dtype)
