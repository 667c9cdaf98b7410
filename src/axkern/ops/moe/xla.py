"""MoE routing in plain JAX: a stable argsort by expert, gathers both ways, no scatter.

**Math.** Pairs `p = t * K + k` are sorted by expert id (invalid ids, outside `[0, E)`, sort
last and are dropped): `order[j]` is the pair at output row `j`, `rows = order^-1` the row of
each pair. Dispatch gathers `expert_x[j] = x[order[j] // K]` (zero for dropped pairs); its
backward gathers back and sums over `k`: `dx[t] = sum_k d_expert_x[rows[t, k]]`. Combine
gathers `y[t] = sum_k w[t, k] · expert_y[rows[t, k]]`; its backward is a dispatch-like gather
`d_expert_y[j] = w[order[j]] · dy[order[j] // K]` and `dw[t, k] = <dy[t], expert_y[rows[t, k]]>`.

**Cost.** Memory bound: dispatch reads `x` K times over and writes `T·K·D`; the sort is over
`T·K` keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from axkern.core.op import Implementation


def sort_pairs(topk_idx, num_experts):
    """`(order, rows, counts, valid)` for the `T·K` pairs, expert-major and stable by pair.

    `order[j]` is the pair at output row `j`, `rows = order^-1` each pair's row, `counts` the
    routed pairs per expert; invalid ids (outside `[0, E)`) sort last and are not counted.
    """
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    order = jnp.argsort(jnp.where(valid, flat, num_experts), stable=True).astype(jnp.int32)
    rows = inverse(order)
    counts = jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, flat, 0)].add(valid.astype(jnp.int32))
    return order, rows, counts, valid


def inverse(permutation):
    return (
        jnp.zeros_like(permutation)
        .at[permutation]
        .set(jnp.arange(permutation.shape[0], dtype=permutation.dtype))
    )


def layout(topk_idx, *, num_experts, num_ranks):
    per_rank = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    safe = jnp.where(valid, topk_idx, 0)
    per_expert = (
        jnp.zeros((num_experts,), jnp.int32).at[safe.reshape(-1)].add(valid.reshape(-1).astype(jnp.int32))
    )
    rank = jnp.where(valid, safe // per_rank, num_ranks)  # num_ranks: a dropped pair's non-rank
    in_rank = (
        jnp.zeros((topk_idx.shape[0], num_ranks + 1), bool)
        .at[jnp.arange(topk_idx.shape[0])[:, None], rank]
        .set(True)
    )
    in_rank = in_rank[:, :num_ranks]
    return per_expert, in_rank.sum(0).astype(jnp.int32), in_rank, (~valid).sum().astype(jnp.int32)


def dispatch(x, topk_idx, *, num_experts):
    order, rows, counts, valid = sort_pairs(topk_idx, num_experts)
    return _dispatch(topk_idx.shape[1], x, order, valid), counts, rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(topk, x, order, valid):
    return jnp.where(valid[order][:, None], x[order // topk], 0)  # selected: a NaN row stays out


def _dispatch_fwd(topk, x, order, valid):
    return _dispatch(topk, x, order, valid), (order, valid, x.shape[0])


def _dispatch_bwd(topk, res, g):
    order, valid, tokens = res
    rows = inverse(order)
    acc = jnp.promote_types(g.dtype, jnp.float32)
    back = jnp.where(valid[:, None], g[rows].astype(acc), 0).reshape(tokens, topk, g.shape[1]).sum(1)
    return back.astype(g.dtype), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def combine(expert_y, topk_weights, topk_idx, rows, *, num_experts):
    valid = ((topk_idx >= 0) & (topk_idx < num_experts)).reshape(-1)
    return _combine(expert_y, topk_weights, rows, valid)


@jax.custom_vjp
def _combine(expert_y, topk_weights, rows, valid):
    tokens, topk = topk_weights.shape
    acc = jnp.promote_types(expert_y.dtype, jnp.float32)
    # dropped pairs are selected away: a non-finite weight or row of theirs reaches nothing
    picked = jnp.where(
        valid[:, None], expert_y[rows].astype(acc) * topk_weights.reshape(-1, 1).astype(acc), 0
    )
    return picked.reshape(tokens, topk, expert_y.shape[1]).sum(1).astype(expert_y.dtype)


def _combine_fwd(expert_y, topk_weights, rows, valid):
    return _combine(expert_y, topk_weights, rows, valid), (expert_y, topk_weights, rows, valid)


def _combine_bwd(res, dy):
    expert_y, topk_weights, rows, valid = res
    tokens, topk = topk_weights.shape
    acc = jnp.promote_types(expert_y.dtype, jnp.float32)
    order = inverse(rows)
    w = topk_weights.reshape(-1).astype(acc)
    d_expert_y = jnp.where(valid[order][:, None], dy[order // topk].astype(acc) * w[order][:, None], 0)
    d_expert_y = d_expert_y.astype(expert_y.dtype)
    picked = jnp.where(valid[:, None], expert_y[rows].astype(acc), 0).reshape(tokens, topk, expert_y.shape[1])
    dw = jnp.where(
        valid.reshape(tokens, topk),
        jnp.einsum("tkd,td->tk", picked, dy.astype(acc), precision=jax.lax.Precision.HIGHEST),
        0,
    )
    return d_expert_y, dw.astype(topk_weights.dtype), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


LAYOUT_IMPLEMENTATION = Implementation("xla", layout, backward="none (integer outputs)")
DISPATCH_IMPLEMENTATION = Implementation(
    "xla", dispatch, backward="custom_vjp: gather back and sum over top-k"
)
COMBINE_IMPLEMENTATION = Implementation(
    "xla", combine, backward="custom_vjp: dispatch-like gather + weight grads"
)
