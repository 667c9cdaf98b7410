"""Plain-JAX shifted-sum math shared by the short_conv implementations (not an implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axkern.core import compat


def acc_dtype(x):
    return jnp.promote_types(x.dtype, jnp.float32)


def segment_runs(segment_ids):
    """Each position's segment as the number of id changes before it (int32), so that taps compare
    runs, not ids: an id used again after another starts a new segment. None stays None."""
    if segment_ids is None:
        return None
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = jnp.zeros((segment_ids.shape[0], 1), jnp.int32)
    return jnp.concatenate([first, jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def zero_state(x, width, initial_state):
    """The initial state, zeros where none was given (implementations receive `None` then),
    varying over `x`'s manual mesh axes inside `shard_map` as the dispatcher's inputs do."""
    if initial_state is None:
        return compat.match_vma(x, jnp.zeros((x.shape[0], width - 1, x.shape[2]), x.dtype))[1]
    return initial_state


def extended(x, segment_ids, initial_state):
    """`x` with its `W-1` previous inputs prepended, and the segment id of each extended row.

    The state's rows belong to the first segment of the sequence (a packed batch continues
    only its first document from the state).
    """
    xe = jnp.concatenate([initial_state.astype(x.dtype), x], axis=1)
    if segment_ids is None:
        return xe, None
    lead = jnp.broadcast_to(segment_ids[:, :1], (x.shape[0], initial_state.shape[1]))
    return xe, jnp.concatenate([lead, segment_ids], axis=1)


def taps(x, segment_ids, initial_state, width):
    """The `W` shifted inputs, tap `k` holding `x~[t - k]` in float32 (zero where it would read
    another segment), and for each tap whether it stays in `t`'s segment (None without segments)."""
    seq = x.shape[1]
    xe, se = extended(x, segment_ids, initial_state)
    out, same = [], []
    for k in range(width):
        tap = xe[:, width - 1 - k : width - 1 - k + seq].astype(acc_dtype(x))
        keep = None if se is None else (se[:, width - 1 - k : width - 1 - k + seq] == segment_ids)[..., None]
        out.append(tap if keep is None else jnp.where(keep, tap, 0))
        same.append(keep)
    return out, same


def pre_activation(x, weight, bias, segment_ids, initial_state):
    """`bias + sum_k w[k] * x~[t - k]` in float32, a tap of another segment selected away from
    the sum (never `w[k] * 0`, NaN for a NaN weight), and the taps and masks it used."""
    ts, same = taps(x, segment_ids, initial_state, weight.shape[0])
    out = bias.astype(acc_dtype(x))
    for k, (tap, keep) in enumerate(zip(ts, same, strict=True)):
        term = weight[k].astype(acc_dtype(x)) * tap
        out = out + (term if keep is None else jnp.where(keep, term, 0))
    return out, ts, same


def activate(pre, activation, sigmoid=jax.nn.sigmoid):
    # silu written out (not jax.nn.silu, a custom_jvp): the same expression lowers in every kernel
    return pre * sigmoid(pre) if activation == "silu" else pre


def activation_grad(pre, activation, sigmoid=jax.nn.sigmoid):
    if activation == "silu":
        s = sigmoid(pre)
        return s * (1 + pre * (1 - s))
    return 1.0


def state_grad(x, weight, bias, segment_ids, initial_state, dy, activation):
    """Gradient of the initial state: only outputs at positions `< W-1` read it, so the
    convolution of the first `W-1` positions alone gives it (a few rows of work)."""
    width_1 = initial_state.shape[1]
    if width_1 == 0:
        return jnp.zeros_like(initial_state)
    head = slice(0, min(width_1, x.shape[1]))
    seg = None if segment_ids is None else segment_ids[:, head]

    def f(state):
        pre, _, _ = pre_activation(x[:, head], weight, bias, seg, state)
        return activate(pre, activation)

    _, vjp = jax.vjp(f, initial_state.astype(acc_dtype(x)))
    return vjp(dy[:, head].astype(acc_dtype(x)))[0].astype(initial_state.dtype)
