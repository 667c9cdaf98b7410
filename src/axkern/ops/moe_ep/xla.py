"""Expert-parallel transport in plain JAX: a fixed-capacity `all_to_all` under `shard_map`.

Per device (one rank of the expert-parallel mesh axis, `R` ranks, `E / R` local experts each):

- **dispatch.** Each routed pair `(t, k)` goes to rank `dst = e // (E / R)` of its expert `e`,
  into slot `slot` = its rank among this device's pairs for `dst` (stable by pair). Pairs with
  `slot >= C` (the capacity per source and destination) are *dropped*: not sent, counted. The
  send buffer `[R, C, D]` holds `x[t]` at `(dst, slot)`, with the local expert id beside it
  (`-1` for an empty slot); one `all_to_all` exchanges rows and ids, and the received `R·C`
  rows are sorted by local expert (empty slots last), ready for `jax.lax.ragged_dot` with the
  per-expert counts.
- **combine.** The expert outputs are put back in received order, sent back by the inverse
  `all_to_all`, and each kept pair's row is weighted and summed into its token.

Gradients are JAX's: the transpose of `all_to_all` is an `all_to_all`, so dispatch's backward
is a combine-like exchange and combine's a dispatch-like one. Masked terms are selected away,
never multiplied by zero.

**Bytes.** Each `all_to_all` moves `R·C·D` elements per device (`(R-1)·C·D` across links);
with a capacity factor `f` that is `f·T·K·D`, with exact capacity (`C = T·K`) `R·T·K·D`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from axkern.core.op import Implementation

from . import common


def dispatch(x, topk_idx, *, num_experts, axis_name, ranks, capacity):
    """`(expert_x [R·C, D], group_sizes [E/R], order [R·C], dst, slot, sent, dropped)`."""
    tokens, topk = topk_idx.shape
    local = num_experts // ranks
    dst, slot, sent, expert, valid = common.slots(topk_idx, num_experts, ranks, capacity)
    where = jnp.where(sent, dst * capacity + slot, ranks * capacity)  # out of range: not written
    rows = jnp.repeat(x, topk, axis=0)  # pair p reads token p // K
    send_x = jnp.zeros((ranks * capacity, x.shape[1]), x.dtype).at[where].set(rows, mode="drop")
    send_e = jnp.full((ranks * capacity,), -1, jnp.int32).at[where].set(expert, mode="drop")
    recv_x = lax.all_to_all(send_x.reshape(ranks, capacity, -1), axis_name, 0, 0)
    recv_e = lax.all_to_all(send_e.reshape(ranks, capacity), axis_name, 0, 0).reshape(-1)
    order, group_sizes = common.group_by_expert(recv_e, local)
    expert_x = recv_x.reshape(ranks * capacity, -1)[order]
    dropped = jnp.sum(valid & ~sent) + jnp.sum(~valid)
    shape = (tokens, topk)
    return expert_x, group_sizes, order, dst.reshape(shape), slot.reshape(shape), sent.reshape(shape), dropped


def combine(expert_y, topk_weights, order, dst, slot, sent, *, axis_name, ranks, capacity):
    """`y [T, D']`: each kept pair's expert output, weighted by `topk_weights`, summed per token."""
    back = jnp.zeros_like(expert_y).at[order].set(expert_y)  # received order
    back = lax.all_to_all(back.reshape(ranks, capacity, -1), axis_name, 0, 0).reshape(ranks * capacity, -1)
    return common.weighted_sum(back, topk_weights, dst * capacity + slot, sent, expert_y.dtype)


DISPATCH_IMPLEMENTATION = Implementation(
    "xla", dispatch, backward="JAX's: the transposed all_to_all (a combine-like exchange)"
)
COMBINE_IMPLEMENTATION = Implementation(
    "xla", combine, backward="JAX's: the transposed all_to_all (a dispatch-like exchange)"
)
