"""The plainest correct MoE routing: counting sort through one-hot cumulative sums. The test oracle.

Pairs `(t, k)` are ordered token-major (`p = t * K + k`). A pair is *valid* when its expert id
is in `[0, E)`; invalid pairs are dropped: counted, never routed.
"""

from __future__ import annotations

import jax.numpy as jnp


def positions(topk_idx, num_experts):
    """Output row of every pair (expert-major, stable by pair), and the per-expert counts.

    Invalid pairs get rows after all valid ones, in pair order.
    """
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    onehot = (flat[:, None] == jnp.arange(num_experts)[None, :]) & valid[:, None]
    counts = onehot.sum(0).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    rank_in_expert = (jnp.cumsum(onehot, axis=0) - 1) * onehot  # position among earlier pairs of its expert
    row_valid = (starts[None, :] * onehot + rank_in_expert).sum(1)
    n_valid = counts.sum()
    row_invalid = n_valid + jnp.cumsum(~valid) - 1
    return jnp.where(valid, row_valid, row_invalid).astype(jnp.int32), counts, valid


def layout(topk_idx, *, num_experts, num_ranks):
    per_rank = num_experts // num_ranks
    flat_valid = (topk_idx >= 0) & (topk_idx < num_experts)
    onehot = (topk_idx[..., None] == jnp.arange(num_experts)) & flat_valid[..., None]  # [T, K, E]
    tokens_per_expert = onehot.sum((0, 1)).astype(jnp.int32)
    rank_of = jnp.where(flat_valid, topk_idx // per_rank, -1)
    in_rank = (rank_of[..., None] == jnp.arange(num_ranks)).any(1)  # [T, R]
    return tokens_per_expert, in_rank.sum(0).astype(jnp.int32), in_rank, (~flat_valid).sum().astype(jnp.int32)


def dispatch(x, topk_idx, *, num_experts):
    """`(expert_x [T*K, D], group_sizes [E], rows [T*K])`: dropped pairs' rows are zero, at the end."""
    tokens, topk = topk_idx.shape
    rows, counts, valid = positions(topk_idx, num_experts)
    src = jnp.where(valid[:, None], jnp.repeat(x, topk, axis=0), 0)
    out = jnp.zeros((tokens * topk, x.shape[1]), x.dtype).at[rows].set(src)
    return out, counts, rows


def combine(expert_y, topk_weights, topk_idx, rows, *, num_experts):
    """`y[t] = sum_k w[t, k] * expert_y[row(t, k)]` over valid pairs, accumulated in float32."""
    tokens, topk = topk_weights.shape
    valid = ((topk_idx >= 0) & (topk_idx < num_experts)).reshape(-1)
    acc = jnp.promote_types(expert_y.dtype, jnp.float32)
    picked = expert_y[rows].astype(acc) * topk_weights.reshape(-1, 1).astype(acc)
    picked = jnp.where(valid[:, None], picked, 0)  # dropped pairs selected away
    return picked.reshape(tokens, topk, expert_y.shape[1]).sum(1).astype(expert_y.dtype)
