"""Plain-JAX pair ordering shared by the MoE implementations (not an implementation)."""

from __future__ import annotations

import jax.numpy as jnp


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
