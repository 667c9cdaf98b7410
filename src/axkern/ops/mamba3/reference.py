"""The exact sequential Mamba-3 recurrence with `lax.scan`, in float32 (float64 for float64): the oracle.

Per head `h` (group `g = h // (H / G)`), with `λ_t = sigmoid(trap_t)`, `α_t = exp(adt_t)`:
`Θ_t = (Θ_{t-1} + π tanh(angles_t) Δ_t) mod 2π`; `q_t = R(Θ_t)(q_t + q_bias)`,
`k_t = R(Θ_t)(k_t + k_bias)` (pairs `(2i, 2i+1)`, or `(i, i + N/2)` for MIMO, for `i < n_angles`);
`h_t = α_t h_{t-1} + (1 - λ_t) Δ_t α_t Σ_r v_{t-1,r} k_{t-1,r}ᵀ + λ_t Δ_t Σ_r v_{t,r} k_{t,r}ᵀ`;
`y_{t,r} = h_t q_{t,r} + D v_{t,r}`, times `silu(z_t ⊙ W_z[r])` when `z` is given, and the output
`Σ_r W_o[r] ⊙ y_{t,r}` (SISO: `R = 1`, `v_t = x_t`, no weights). MIMO: `v_{t,r} = x_t ⊙ W_x[r]`.

A new segment starts from a zero state (angle, `h`, previous `k` and `v`), selected away, never
multiplied by 0; only the sequence's first segment continues from the initial state. A
non-finite `adt`, `trap` or `angles` is NaN (their `exp`, `sigmoid` and `tanh` would make an
infinity finite). A non-finite value reaches what the recurrence carries it to, never earlier.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _nan_if_not_finite(a):
    return a + jnp.where(jnp.isfinite(a), 0, jnp.nan).astype(a.dtype)


def _rotate(u, theta, halves):
    """`u [.., N]` rotated by `theta [.., A]` on its first `A` pairs."""
    n, a = u.shape[-1], theta.shape[-1]
    if a == 0:
        return u
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    if halves:
        u0, u1 = u[..., :a], u[..., n // 2 : n // 2 + a]
        r0, r1 = u0 * cos - u1 * sin, u0 * sin + u1 * cos
        return jnp.concatenate([r0, u[..., a : n // 2], r1, u[..., n // 2 + a :]], axis=-1)
    u0, u1 = u[..., 0 : 2 * a : 2], u[..., 1 : 2 * a : 2]
    r = jnp.stack([u0 * cos - u1 * sin, u0 * sin + u1 * cos], axis=-1).reshape(*u.shape[:-1], 2 * a)
    return jnp.concatenate([r, u[..., 2 * a :]], axis=-1)


def mamba3(
    q,
    k,
    v,
    adt,
    dt,
    trap,
    q_bias,
    k_bias,
    angles,
    D,
    z,
    segment_ids,
    angle_state,
    ssm_state,
    k_state,
    v_state,
    W_x,
    W_z,
    W_o,
):
    """`(y [b, l, h, p], angle [b, h, a], ssm [b, h, p, n], k [b, r, h, n], v [b, h, p])`.

    `q, k [b, l, r, g, n]`, `v, z [b, l, h, p]`, `adt, dt, trap [b, h, l]`, `q_bias, k_bias
    [h, r, n]`, `angles [b, l, h, a]`, `D [h]`; MIMO when `W_x, W_z, W_o [h, r, p]` are given.
    """
    acc = jnp.promote_types(v.dtype, jnp.float32)
    batch, length, heads, head_dim = v.shape
    rank, groups = q.shape[2], q.shape[3]
    mimo = W_x is not None
    f = lambda a: None if a is None else a.astype(acc)  # noqa: E731
    per_head = lambda a: jnp.repeat(f(a), heads // groups, axis=3)  # noqa: E731 - [b, l, r, h, n]
    qh = per_head(q) + jnp.swapaxes(f(q_bias), 0, 1)
    kh = per_head(k) + jnp.swapaxes(f(k_bias), 0, 1)
    wx = jnp.ones((rank, heads, head_dim), acc) if not mimo else jnp.swapaxes(f(W_x), 0, 1)  # [r, h, p]
    seg = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    keep = seg == prev  # False where a new segment starts (never at t = 0)
    lam = jax.nn.sigmoid(_nan_if_not_finite(f(trap)))
    alpha = jnp.exp(_nan_if_not_finite(f(adt)))
    turn = jnp.tanh(_nan_if_not_finite(f(angles)))
    t_major = lambda a: jnp.moveaxis(a, -1, 0)  # noqa: E731 - [b, h, l] -> [l, b, h]
    l_major = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731 - [b, l, ..] -> [l, b, ..]

    def step(carry, inputs):
        q_t, k_t, x_t, alpha_t, dt_t, lam_t, turn_t, keep_t = inputs
        kept = keep_t[:, None, None]
        # a new segment selects the old state away (0 · NaN would carry a NaN across), before its
        # products too, so that their gradients are not 0 · NaN either
        theta, h, k_prev, x_prev = (
            jnp.where(keep_t.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0) for a in carry
        )
        theta = theta + jnp.pi * turn_t * dt_t[..., None]
        theta = jnp.mod(theta, 2 * jnp.pi)
        q_t = _rotate(q_t, theta[:, None], mimo)  # [b, r, h, n]
        k_t = _rotate(k_t, theta[:, None], mimo)
        v_prev = x_prev[:, None] * wx  # [b, r, h, p]
        v_t = x_t[:, None] * wx
        beta = ((1 - lam_t) * dt_t * alpha_t)[..., None, None]
        gamma = (lam_t * dt_t)[..., None, None]
        carried = alpha_t[..., None, None] * h + beta * jnp.einsum("brhp,brhn->bhpn", v_prev, k_prev)
        h = jnp.where(kept[..., None], carried, 0) + gamma * jnp.einsum("brhp,brhn->bhpn", v_t, k_t)
        y_t = jnp.einsum("bhpn,brhn->brhp", h, q_t)
        if D is not None:
            y_t = y_t + f(D)[:, None] * v_t
        return (theta, h, k_t, x_t), y_t

    carry0 = (f(angle_state), f(ssm_state), f(k_state), f(v_state))
    xs = (
        l_major(qh),
        l_major(kh),
        l_major(f(v)),
        t_major(alpha),
        t_major(f(dt)),
        t_major(lam),
        l_major(turn),
        l_major(keep),
    )
    (theta, h, k_last, x_last), y = lax.scan(step, carry0, xs)
    y = jnp.moveaxis(y, 0, 1)  # [b, l, r, h, p]
    if z is not None:
        wz = jnp.ones((rank, heads, head_dim), acc) if not mimo else jnp.swapaxes(f(W_z), 0, 1)
        y = y * jax.nn.silu(f(z)[:, :, None] * wz)
    y = jnp.sum(y * jnp.swapaxes(f(W_o), 0, 1), axis=2) if mimo else y[:, :, 0]
    finals = (theta, h, k_last, x_last)
    inits = (angle_state, ssm_state, k_state, v_state)
    return (y.astype(v.dtype), *(a.astype(s.dtype) for a, s in zip(finals, inits, strict=True)))


def step(
    q_t, k_t, v_t, adt_t, dt_t, trap_t, q_bias, k_bias, angles_t, D, z_t, angle, ssm, k, v, W_x, W_z, W_o
):
    """One decode step as the sequential scan over a sequence of length 1."""
    z = None if z_t is None else z_t[:, None]
    y, *states = mamba3(
        q_t[:, None],
        k_t[:, None],
        v_t[:, None],
        adt_t[..., None],
        dt_t[..., None],
        trap_t[..., None],
        q_bias,
        k_bias,
        angles_t[:, None],
        D,
        z,
        None,
        angle,
        ssm,
        k,
        v,
        W_x,
        W_z,
        W_o,
    )
    return (y[:, 0], *states)
