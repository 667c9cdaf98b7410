"""The chunked SSD scan in plain JAX, shared by the `xla` implementations of `ssd` and `mamba3`
(not an implementation): a per-position log-decay `a_t`, a per-position input scale `s_t` and
`R` inputs per position (a rank axis),

`state_t = exp(a_t) state_{t-1} + s_t sum_r x_{t,r} ⊗ B_{t,r}`, `y_{t,r} = state_t · C_{t,r}`,

per head, a new segment starting from a zero state. Mamba-2 is `a = dt A`, `s = dt`, `R = 1`;
Mamba-3 gives its own decay, its trapezoid's scale and, for MIMO, its rank.

**Math** (chunks of `Q` positions, `cum` the running sum of `a` inside a chunk):
`y_{t,r} = sum_{s <= t, same segment} sum_u (C_{t,r} · B_{s,u}) exp(cum_t - cum_s) s_s x_{s,u}`
`        + [seg_t == seg before the chunk] exp(cum_t) C_{t,r} · state_in`,
`state_out = [no reset in the chunk] exp(cum_{Q-1}) state_in
           + sum_{s in the chunk's last segment} exp(cum_{Q-1} - cum_s) s_s sum_u x_{s,u} ⊗ B_{s,u}`.
The length is padded to a multiple of `Q` with zero rows (`a = s = 0`: the state is unchanged).

**float32** (`sums`): each `sum_{s < r <= t} a_r` is summed on its own rather than as the
difference `cum_t - cum_s`, whose rounding reaches the decay's gradient as a difference of large
sums (docs/ops/ssd.md, "Accuracy").

Two forms: `scan` (autodiff through it: the backward keeps every chunk's `[Q, Q]` terms) and
`scan_recompute`, a `custom_vjp` that saves only the inputs and the state entering each chunk
(`[b, c, h, P, N]`) and recomputes each chunk's terms in the backward.

Inputs are finite (`chunks.guard` or the op's own guard cleans them first), in the accumulation
dtype: `x [b, L, R, H, P]`, `a, s [b, L, H]`, `B, C [b, L, R, H, N]` (per head),
`seg [b, L]` internal segment ids (`chunks.segment_starts`), `initial_state [b, H, P, N]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .chunks import recurrence, recurrence_bwd


def _to_chunks(a, q):
    """`[b, L, ...]` zero-padded to a multiple of `q` and split: `[b, L/q, q, ...]`."""
    pad = (-a.shape[1]) % q
    if pad:
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    return a.reshape(a.shape[0], a.shape[1] // q, q, *a.shape[2:])


def _seg_chunks(seg, q):
    """Segment ids split into chunks, the padding continuing the last segment."""
    pad = (-seg.shape[1]) % q
    if pad:
        seg = jnp.concatenate([seg, jnp.broadcast_to(seg[:, -1:], (seg.shape[0], pad))], axis=1)
    return seg.reshape(seg.shape[0], -1, q)


def _seg_before(sc):
    """The segment of the position just before each chunk (the first chunk's own): `[b, c]`."""
    return jnp.concatenate([sc[:, :1, 0], sc[:, :-1, -1]], axis=1)


def _states(xc, ac, sc_, Bc, segc, *, precision):
    """Each chunk's own contribution to the state at its end (`[b, c, H, P, N]`) and its carry of
    the incoming state (`[b, H, c]`: `exp(sum a)`, 0 when a segment starts inside)."""
    cum = jnp.cumsum(ac, axis=2)  # [b, c, q, h]
    to_end = jnp.exp(cum[:, :, -1:, :] - cum) * (segc == segc[:, :, -1:])[..., None]
    own = jnp.einsum("bcsh,bcsuhp,bcsuhn->bchpn", to_end * sc_, xc, Bc, precision=precision)
    keep = (segc[:, :, -1] == _seg_before(segc)).astype(ac.dtype)[..., None] * jnp.exp(cum[:, :, -1, :])
    return own, jnp.moveaxis(keep, 1, 2)


def _outputs(xc, ac, sc_, Bc, Cc, segc, states_in, *, precision, sums):
    """`y [b, c, q, R, H, P]`: each chunk's own positions plus the state entering it."""
    einsum = functools.partial(jnp.einsum, precision=precision)
    q = ac.shape[2]
    cum = jnp.cumsum(ac, axis=2)  # [b, c, q, h]
    t_idx = jnp.arange(q)
    causal = t_idx[:, None] >= t_idx[None, :]
    same = (segc[:, :, :, None] == segc[:, :, None, :]) & causal  # [b, c, t, s]
    if not sums:  # the difference of running sums
        diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [b, c, t, s, h]
    else:  # each sum_{s < r <= t} a_r on its own (see the module docstring)
        later = jnp.where((t_idx[:, None] > t_idx[None, :])[None, None, :, :, None], ac[:, :, :, None, :], 0)
        diff = jnp.cumsum(later, axis=2)  # [b, c, t, s, h]
    decay = jnp.exp(jnp.where(same[..., None], diff, -jnp.inf))
    cb = einsum("bctrhn,bcsuhn->bctrsuh", Cc, Bc)
    y = einsum("bctrsuh,bcsh,bcsuhp->bctrhp", cb * decay[:, :, :, None, :, None, :], sc_, xc)
    from_state = jnp.exp(cum) * (segc == _seg_before(segc)[:, :, None])[..., None]  # [b, c, q, h]
    return y + einsum("bctrhn,bchpn->bctrhp", Cc, states_in) * from_state[:, :, :, None, :, None]


def _chunked(x, a, s, B, C, seg, q):
    return tuple(_to_chunks(v, q) for v in (x, a, s, B, C)) + (_seg_chunks(seg, q),)


def _unchunk(y, length):
    return y.reshape(y.shape[0], -1, *y.shape[3:])[:, :length]


def scan(x, a, s, B, C, seg, initial_state, *, chunk_size, precision, sums):
    """`(y [b, L, R, H, P], final_state [b, H, P, N])`; gradients by autodiff."""
    xc, ac, sc_, Bc, Cc, segc = _chunked(x, a, s, B, C, seg, chunk_size)
    own, keep = _states(xc, ac, sc_, Bc, segc, precision=precision)
    states_in, final = recurrence(keep, own, initial_state)
    y = _outputs(xc, ac, sc_, Bc, Cc, segc, states_in, precision=precision, sums=sums)
    return _unchunk(y, x.shape[1]), final


def scan_recompute(x, a, s, B, C, seg, initial_state, *, chunk_size, precision, sums):
    """`scan` with a `custom_vjp` whose backward recomputes each chunk's terms from the inputs and
    the saved states entering the chunks."""
    y, final = _core((precision, sums), *_chunked(x, a, s, B, C, seg, chunk_size), initial_state)
    return _unchunk(y, x.shape[1]), final


def _core_forward(cfg, xc, ac, sc_, Bc, Cc, segc, initial_state):
    precision, sums = cfg
    own, keep = _states(xc, ac, sc_, Bc, segc, precision=precision)
    states_in, final = recurrence(keep, own, initial_state)
    y = _outputs(xc, ac, sc_, Bc, Cc, segc, states_in, precision=precision, sums=sums)
    return (y, final), states_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, xc, ac, sc_, Bc, Cc, segc, initial_state):
    return _core_forward(cfg, xc, ac, sc_, Bc, Cc, segc, initial_state)[0]


def _core_fwd(cfg, xc, ac, sc_, Bc, Cc, segc, initial_state):
    out, states_in = _core_forward(cfg, xc, ac, sc_, Bc, Cc, segc, initial_state)
    return out, (xc, ac, sc_, Bc, Cc, segc, states_in)


def _core_bwd(cfg, res, cotangents):
    """Pull `dy` through the outputs (`d states_in` among the results), run the recurrence
    backwards, and pull the chunk states' and carries' gradients through `_states`."""
    precision, sums = cfg
    xc, ac, sc_, Bc, Cc, segc, states_in = res
    dy, d_final = cotangents

    def outputs(xc, ac, sc_, Bc, Cc, states_in):
        return _outputs(xc, ac, sc_, Bc, Cc, segc, states_in, precision=precision, sums=sums)

    def states(xc, ac, sc_, Bc):
        return _states(xc, ac, sc_, Bc, segc, precision=precision)

    _, pull_y = jax.vjp(outputs, xc, ac, sc_, Bc, Cc, states_in)
    dx, da, ds, dB, dC, d_states_in = pull_y(dy)
    (_, keep), pull_states = jax.vjp(states, xc, ac, sc_, Bc)
    d_own, d_keep, d_init = recurrence_bwd(keep, states_in, d_states_in, d_final)
    dx2, da2, ds2, dB2 = pull_states((d_own, d_keep))
    return dx + dx2, da + da2, ds + ds2, dB + dB2, dC, None, d_init


_core.defvjp(_core_fwd, _core_bwd)
