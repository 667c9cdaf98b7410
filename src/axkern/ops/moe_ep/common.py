"""What `xla` and `xla_ragged` share: each routed pair's destination rank and slot, and the
grouping of received rows by local expert."""

from __future__ import annotations

import jax.numpy as jnp


def slots(topk_idx, num_experts, ranks, capacity):
    """Per pair (flattened `t·K + k`): destination rank, slot, whether it is sent, the local expert,
    whether its expert id is in range. A pair's slot is its rank among this device's pairs for the
    same destination (stable by pair); pairs at slot `capacity` and beyond are not sent."""
    e = topk_idx.reshape(-1).astype(jnp.int32)
    local = num_experts // ranks
    valid = (e >= 0) & (e < num_experts)
    dst = jnp.where(valid, e // local, 0)
    onehot = (dst[:, None] == jnp.arange(ranks, dtype=jnp.int32)[None, :]) & valid[:, None]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0, dtype=jnp.int32), dst[:, None], axis=1)[:, 0] - 1
    sent = valid & (slot < capacity)
    return dst, slot, sent, jnp.where(valid, e % local, -1), valid


def group_by_expert(recv_e, local):
    """The order that sorts received rows by local expert (empty slots, id `-1`, last; stable) and
    the rows per local expert."""
    key = jnp.where(recv_e >= 0, recv_e, local)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((local + 1,), jnp.int32).at[key].add(1)[:local]
    return order, group_sizes


def weighted_sum(back, topk_weights, row, sent, dtype):
    """`y[t] = Σ_k w[t, k] · back[row of (t, k)]` over the sent pairs, accumulated in at least
    f32; an unsent pair's term is selected away (never multiplied by zero)."""
    tokens, topk = topk_weights.shape
    idx = jnp.where(sent, row, 0).reshape(-1)
    acc = jnp.promote_types(dtype, jnp.float32)
    vals = back[idx].astype(acc) * topk_weights.reshape(-1, 1).astype(acc)
    vals = jnp.where(sent.reshape(-1, 1), vals, 0)
    return vals.reshape(tokens, topk, back.shape[1]).sum(1).astype(dtype)
