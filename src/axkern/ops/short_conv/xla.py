"""Short causal convolution as a shifted sum in plain JAX, with its own backward.

**Math.** `pre[b, t] = bias + sum_k w[k] * x~[b, t - k]`, `y = act(pre)`, where `x~` is `x`
with the `W-1` state rows prepended and a tap that crosses a segment boundary is selected away
(its product too: never `w[k] * 0`, NaN for a NaN weight).

**Backward** (`jax.custom_vjp`, residuals: the inputs): `g = dy * act'(pre)` (pre recomputed),
`dx~[t - k] += w[k] * g[t]` for each tap (a sum of `W` shifted copies that XLA fuses into
one pass), `dw[k] = sum_{b,t} g[t] * x~[t - k]`, `dbias = sum g`; the first `W-1` rows of
`dx~` are the initial state's gradient. A tap of another segment is selected away in both
sums (never `0 * g`, NaN for a NaN `g`).

**Cost.** Memory bound: the forward reads `x` and writes `y` (`2·B·S·C` elements); XLA fuses
the `W` shifted reads of each pass into one loop over `x`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from axkern.core.op import Implementation

from .common import activate, activation_grad, pre_activation, segment_runs, zero_state


def conv(x, weight, bias, segment_ids, initial_state, *, activation=None):
    initial_state = zero_state(x, weight.shape[0], initial_state)
    return _conv(activation, x, weight, bias, segment_runs(segment_ids), initial_state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(activation, x, weight, bias, segment_ids, initial_state):
    pre, _, _ = pre_activation(x, weight, bias, segment_ids, initial_state)
    return activate(pre, activation).astype(x.dtype)


def _fwd(activation, x, weight, bias, segment_ids, initial_state):
    return _conv(activation, x, weight, bias, segment_ids, initial_state), (
        x,
        weight,
        bias,
        segment_ids,
        initial_state,
    )


def _bwd(activation, residuals, dy):
    x, weight, bias, segment_ids, initial_state = residuals
    width = weight.shape[0]
    pre, taps, same = pre_activation(x, weight, bias, segment_ids, initial_state)
    g = dy.astype(pre.dtype) * activation_grad(pre, activation)
    products = [g * tap if m is None else jnp.where(m, g * tap, 0) for tap, m in zip(taps, same, strict=True)]
    dweight = jnp.stack([jnp.sum(p, axis=(0, 1)) for p in products])
    dbias = jnp.sum(g, axis=(0, 1))
    dxe = 0
    for k in range(width):
        gk = g * weight[k].astype(g.dtype)
        if same[k] is not None:
            gk = jnp.where(same[k], gk, 0)
        dxe = dxe + jnp.pad(gk, ((0, 0), (width - 1 - k, k), (0, 0)))
    dx = dxe[:, width - 1 :].astype(x.dtype)
    dstate = dxe[:, : width - 1].astype(initial_state.dtype)
    return dx, dweight.astype(weight.dtype), dbias.astype(bias.dtype), None, dstate


_conv.defvjp(_fwd, _bwd)


def step(x_t, state, weight, bias, *, activation=None):
    """One decode step: `y_t = act(bias + sum_k w[k] x[t - k])` over the window `[state, x_t]`
    (oldest first), and the window's last `W-1` rows as the new state."""
    acc = jnp.promote_types(x_t.dtype, jnp.float32)
    window = jnp.concatenate([state, x_t[:, None].astype(state.dtype)], axis=1)  # oldest first
    y = jnp.einsum(
        "bwc,wc->bc", window.astype(acc), weight[::-1].astype(acc), precision=jax.lax.Precision.HIGHEST
    )
    if bias is not None:
        y = y + bias.astype(acc)
    if activation == "silu":
        y = jax.nn.silu(y)
    return y.astype(x_t.dtype), window[:, 1:]


IMPLEMENTATION = Implementation("xla", conv, backward="custom_vjp: shifted sums (fused by XLA)")
