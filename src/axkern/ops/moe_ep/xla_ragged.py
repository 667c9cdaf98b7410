"""Expert-parallel transport by `lax.ragged_all_to_all`: each device sends only the rows it routes.

Same slots, same received buffer and the same outputs as `xla` (a capacity factor drops the same
pairs; exact capacity drops none), so a layout from either combines with either. Per device:

- **dispatch.** The sent pairs are packed by destination rank (`counts[r]` rows for rank `r`,
  from `starts[r]`, in slot order) into a `[T·K, D]` send buffer; one `ragged_all_to_all`
  writes source `s`'s rows for rank `r` at slots `s·C ...` of `r`'s `[R·C, D]` receive buffer,
  where `xla`'s dense exchange puts them. The local expert ids travel the same way, then the
  rows are grouped by local expert for `jax.lax.ragged_dot`.
- **combine.** The inverse: each holder sends the outputs of source `s`'s rows back into `s`'s
  packed buffer (at `starts` exchanged by a small `all_to_all`), and each sent pair's row is
  weighted and summed into its token.

Gradients are JAX's: the transpose of a `ragged_all_to_all` is the `ragged_all_to_all` with
sources and destinations swapped, so dispatch's backward is a combine-like exchange and
combine's a dispatch-like one.

**Bytes.** Each exchange moves only the routed rows (at most `T·K·D` elements per device) but
receives into a buffer of `R·C` rows, like `xla`.

Explicit only (`implementation="xla_ragged"`), never in the default order: on GPUs the
exchange ran well below `lax.all_to_all`'s rate (docs/ops/moe_ep.md, "Implementations", has
the figures). XLA:CPU cannot compile `ragged-all-to-all`, so it runs on GPUs and TPUs.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from axkern.core.op import Implementation

from . import common

# The exchange, a module attribute: the CPU tests check the packing and offsets below with a
# dense emulation of its documented semantics in its place.
ragged_all_to_all = lax.ragged_all_to_all

WHY_PLATFORMS = "XLA:CPU cannot compile ragged-all-to-all (use xla there)"


def _packing(dst, sent, ranks):
    """Rows this device sends to each rank (`counts`) and where they start in its packed buffer."""
    counts = jnp.zeros((ranks,), jnp.int32).at[jnp.where(sent, dst, ranks)].add(1, mode="drop")
    return counts, jnp.cumsum(counts) - counts


def dispatch(x, topk_idx, *, num_experts, axis_name, ranks, capacity):
    """`(expert_x [R·C, D], group_sizes [E/R], order [R·C], dst, slot, sent, dropped)`, as `xla`'s."""
    tokens, topk = topk_idx.shape
    pairs = tokens * topk
    local = num_experts // ranks
    dst, slot, sent, expert, valid = common.slots(topk_idx, num_experts, ranks, capacity)
    counts, starts = _packing(dst, sent, ranks)
    where = jnp.where(sent, starts[dst] + slot, pairs)  # out of range: not packed
    rows = jnp.repeat(x, topk, axis=0)  # pair p reads token p // K
    send_x = jnp.zeros((pairs, x.shape[1]), x.dtype).at[where].set(rows, mode="drop")
    send_e = jnp.full((pairs,), -1, jnp.int32).at[where].set(expert, mode="drop")
    me = lax.axis_index(axis_name)
    out_at = jnp.full((ranks,), me * capacity, jnp.int32)  # this device's block of every receiver
    recv_counts = lax.all_to_all(counts, axis_name, 0, 0, tiled=True)
    args = (starts, counts, out_at, recv_counts)
    recv_x = ragged_all_to_all(
        send_x, jnp.zeros((ranks * capacity, x.shape[1]), x.dtype), *args, axis_name=axis_name
    )
    recv_e = ragged_all_to_all(
        send_e, jnp.full((ranks * capacity,), -1, jnp.int32), *args, axis_name=axis_name
    )
    order, group_sizes = common.group_by_expert(recv_e, local)
    dropped = jnp.sum(valid & ~sent) + jnp.sum(~valid)
    shape = (tokens, topk)
    return (
        recv_x[order],
        group_sizes,
        order,
        dst.reshape(shape),
        slot.reshape(shape),
        sent.reshape(shape),
        dropped,
    )


def combine(expert_y, topk_weights, order, dst, slot, sent, *, axis_name, ranks, capacity):
    """`y [T, D']`: each sent pair's expert output back in its source's packed buffer, weighted
    by `topk_weights` and summed per token."""
    tokens, topk = topk_weights.shape
    dst, slot, sent = dst.reshape(-1), slot.reshape(-1), sent.reshape(-1)
    counts, starts = _packing(dst, sent, ranks)
    held = lax.all_to_all(counts, axis_name, 0, 0, tiled=True)  # rows held here from each source
    their_starts = lax.all_to_all(starts, axis_name, 0, 0, tiled=True)  # where each source packed them
    back = jnp.zeros_like(expert_y).at[order].set(expert_y)  # received order: source s at s·C
    block = jnp.arange(ranks, dtype=jnp.int32) * capacity
    packed = ragged_all_to_all(
        back,
        jnp.zeros((tokens * topk, expert_y.shape[1]), expert_y.dtype),
        block,
        held,
        their_starts,
        counts,
        axis_name=axis_name,
    )
    row = (starts[dst] + slot).reshape(tokens, topk)
    return common.weighted_sum(packed, topk_weights, row, sent.reshape(tokens, topk), expert_y.dtype)


DISPATCH_IMPLEMENTATION = Implementation(
    "xla_ragged",
    dispatch,
    platforms=("gpu", "tpu"),
    why_platforms=WHY_PLATFORMS,
    backward="JAX's: the transposed ragged_all_to_all (a combine-like exchange)",
)
COMBINE_IMPLEMENTATION = Implementation(
    "xla_ragged",
    combine,
    platforms=("gpu", "tpu"),
    why_platforms=WHY_PLATFORMS,
    backward="JAX's: the transposed ragged_all_to_all (a dispatch-like exchange)",
)
