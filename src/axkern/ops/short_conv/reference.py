"""The plainest correct form of the short causal convolution: the test oracle, never a default."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def conv(x, weight, bias, segment_ids, initial_state, *, activation=None):
    """`y[b, t] = act(bias + sum_k weight[k] * x[b, t - k])`, taps never crossing a segment boundary.

    `x: [B, S, C]`, `weight: [W, C]`, `bias: [C]`, `segment_ids: [B, S] | None` (a change of id
    starts a segment), `initial_state: [B, W-1, C] | None` (the inputs before position 0, oldest
    first; zeros when None). Computes in
    float32 (float64 for float64 inputs); autodiff for gradients.
    """
    seq, width = x.shape[1], weight.shape[0]
    if initial_state is None:
        initial_state = jnp.zeros((x.shape[0], width - 1, x.shape[2]), x.dtype)
    if segment_ids is not None:  # segments as runs: an id used again after another starts a new one
        change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
        segment_ids = jnp.concatenate([jnp.zeros_like(change[:, :1]), jnp.cumsum(change, axis=1)], axis=1)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xe, se = _extended(x, segment_ids, initial_state)
    out = jnp.broadcast_to(bias.astype(acc), x.shape)
    for k in range(width):
        tap = xe[:, width - 1 - k : width - 1 - k + seq].astype(acc)
        if se is None:
            out = out + weight[k].astype(acc) * tap
            continue
        # a tap of another segment is selected away before and after the product, so that it
        # reaches no gradient either (autodiff would give its weight `0 * g`, NaN for a NaN g)
        same = (se[:, width - 1 - k : width - 1 - k + seq] == segment_ids)[..., None]
        out = out + jnp.where(same, weight[k].astype(acc) * jnp.where(same, tap, 0), 0)
    if activation == "silu":
        out = jax.nn.silu(out)
    return out.astype(x.dtype)


def step(x_t, state, weight, bias, *, activation=None):
    """One decode step as the full convolution over the window `[state, x_t]`, its last output."""
    channels = x_t.shape[1]
    window = jnp.concatenate([state, x_t[:, None].astype(state.dtype)], axis=1)
    b = jnp.zeros((channels,), weight.dtype) if bias is None else bias
    y = conv(window.astype(x_t.dtype), weight, b, None, jnp.zeros_like(state), activation=activation)
    return y[:, -1], window[:, 1:]


def _extended(x, segment_ids, initial_state):
    """`x` with its `W-1` previous inputs prepended, and the segment id of each extended row (the
    state's rows belong to the sequence's first segment). Written here again, not imported from
    `common.py`, so the oracle shares no code with the implementations it checks."""
    xe = jnp.concatenate([initial_state.astype(x.dtype), x], axis=1)
    if segment_ids is None:
        return xe, None
    lead = jnp.broadcast_to(segment_ids[:, :1], (x.shape[0], initial_state.shape[1]))
    return xe, jnp.concatenate([lead, segment_ids], axis=1)
