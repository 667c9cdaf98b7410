"""The exact sequential Mamba-2 recurrence with `lax.scan`, in float32 (float64 for float64): the oracle.

Per head `h` (group `g = h // (H / G)`):
`state_t = exp(dt_t A_h) · state_{t-1} + dt_t · x_t ⊗ B_t` (`[P, N]`), `y_t = state_t · C_t + D ⊙ x_t`,
and `y_t *= silu(z_t)` when `z` is given. A new segment starts from a zero state; only the
sequence's first segment continues from `initial_state`. A segment starts wherever the id
changes (an id used again later starts another segment). A non-finite value reaches what the
recurrence carries it to: the state from its position to its segment's end, never earlier.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state):
    """`(y [b, l, h, p], final_state [b, h, p, n])`; `dt` already biased, soft-plussed and clipped."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    heads = x.shape[2]
    groups = B.shape[2]
    rep = heads // groups
    Bh = jnp.repeat(B.astype(acc), rep, axis=2)  # [b, l, h, n]
    Ch = jnp.repeat(C.astype(acc), rep, axis=2)
    seg = jnp.zeros(x.shape[:2], jnp.int32) if segment_ids is None else segment_ids
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    keep = seg == prev  # False where a new segment starts (never at t = 0)
    # a non-finite A is NaN (an A of -inf would otherwise forget the state exactly)
    A = A.astype(acc) + jnp.where(jnp.isfinite(A), 0, jnp.nan)

    def step(state, inputs):
        x_t, dt_t, b_t, c_t, keep_t = inputs
        decay = jnp.exp(dt_t * A)[..., None, None]  # [b, h, 1, 1]
        # a new segment selects the old state away (0 · NaN would carry a NaN across), before
        # the decay multiplies it too: the decay's gradient, `d state · old state`, then takes
        # no NaN from another segment's state
        kept = keep_t[:, None, None, None]
        state = (
            jnp.where(kept, decay * jnp.where(kept, state, 0), 0)
            + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
        )
        y_t = jnp.einsum("bhpn,bhn->bhp", state, c_t)
        return state, y_t

    xs = (x.astype(acc), dt.astype(acc), Bh, Ch, keep)
    xs = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), xs)
    state0 = initial_state.astype(acc)
    final, y = lax.scan(step, state0, xs)
    y = jnp.moveaxis(y, 0, 1)
    return _skip_and_gate(y.astype(acc), x, D, z).astype(x.dtype), final.astype(initial_state.dtype)


def step(x_t, dt_t, A, B_t, C_t, state, D, z_t):
    """One decode step as the sequential scan over a sequence of length 1."""
    z = None if z_t is None else z_t[:, None]
    y, final = ssd(x_t[:, None], dt_t[:, None], A, B_t[:, None], C_t[:, None], D, z, None, state)
    return y[:, 0], final


def _skip_and_gate(y, x, D, z):
    """`(y + D x) · silu(z)`, each part only when given, in `y`'s (float32) dtype. Written here
    again, not imported from the engine (`chunked/chunks.py`), so the oracle shares no code with the implementations."""
    acc = y.dtype
    if D is not None:
        y = y + x.astype(acc) * (D.astype(acc) if D.ndim == 2 else D.astype(acc)[:, None])
    if z is not None:
        y = y * jax.nn.silu(z.astype(acc))
    return y
