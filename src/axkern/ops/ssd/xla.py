"""Mamba-2 SSD by chunks in plain JAX: quadratic (attention-like) inside a chunk, a recurrence
over chunk states between chunks (`chunked/scan.py`, with `a = dt A` as the per-position
log-decay and `dt` as the input scale). Memory is linear in the length; gradients by autodiff.

**Math.** With `a_t = dt_t A` and `cum` its running sum inside a chunk of `Q` positions,
`y_t = sum_{s <= t, same segment} (C_t · B_s) exp(cum_t - cum_s) dt_s x_s`
`    + [seg_t == seg before the chunk] exp(cum_t) C_t · state_in`,
`state_out = [no reset in the chunk] exp(cum_{Q-1}) state_in
           + sum_{s in the chunk's last segment} exp(cum_{Q-1} - cum_s) dt_s x_s ⊗ B_s`.
The length is padded to a multiple of `Q` with `dt = 0` rows, which leave the state unchanged.

**float32.** `cum_t - cum_s` cancels: its gradient reaches `a_r` as a reverse running sum of
row sums minus column sums, whose rounding adds up over a sequence and can put the `A` and
`dt_bias` gradients outside the oracle rule. For float32 inputs each `sum_{s < r <= t} a_r`
is summed on its own (a `[Q, Q]` running sum per chunk and head, as mamba_ssm's minimal
reference does; docs/ops/ssd.md, "Accuracy", has the errors). 16-bit inputs keep the difference
(their rounding dominates, and it is cheaper). **Products**: exact for every input dtype (TF32,
XLA's GPU default, rounds as coarsely as fp16: docs/ops/ssd.md, "Accuracy", has the cases it
took outside the oracle rule).

**Non-finite input** (`chunks.guard`, through `chunks.layer_around` only where an input is
not finite; the scan outside its two conditionals): the chunks compute on the inputs with
non-finite values as 0 and NaN is put where the sequential recurrence is non-finite, so a NaN
never moves back in time or into another segment through a masked term; backward likewise (the
scan's backward on numbers only, NaN on the gradients of the inputs that reach a non-finite
output: `chunks.reached`).

**Cost.** `O(L·Q·(N + P)·H)` inside chunks and `O(L/Q · H·P·N)` between them.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from axkern.core import kernels
from axkern.core.op import Implementation
from axkern.ops.chunked.chunks import layer_around, skip_and_gate, uses_segment_sums
from axkern.ops.chunked.scan import scan

from .blocks import SSDBlockSizes, heuristic, refuse_mosaic_gpu_forms, space

__all__ = ["IMPLEMENTATION", "ssd", "step"]


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes):
    refuse_mosaic_gpu_forms(block_sizes)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    rep = x.shape[2] // B.shape[2]
    # exact float32 products for every input dtype: XLA's GPU default, TF32, is as coarse as fp16
    # (docs/ops/ssd.md, "Accuracy"); the Pallas kernels serve 16-bit inputs on the GPU first
    prec = lax.Precision.HIGHEST

    def prepare(x, dt, A, B, C, initial_state):  # the scan's inputs in the accumulation dtype
        per_head = lambda a: jnp.repeat(a.astype(acc), rep, axis=2)[:, :, None]  # noqa: E731 - [b, l, 1, h, n]
        dt = dt.astype(acc)
        return (
            x.astype(acc)[:, :, None],
            dt * A.astype(acc),
            dt,
            per_head(B),
            per_head(C),
            initial_state.astype(acc),
        )

    def scan_fn(inputs, seg):
        x, a, dt, B, C, initial_state = inputs
        kw = dict(chunk_size=block_sizes.chunk_size, precision=prec, sums=uses_segment_sums(x.dtype))
        y, final = scan(x, a, dt, B, C, seg, initial_state, **kw)
        return y[:, :, 0], final

    return layer_around(prepare, scan_fn, x, dt, A, B, C, D, z, segment_ids, initial_state)


def step(x_t, dt_t, A, B_t, C_t, state, D, z_t):
    """One recurrence step: `state' = exp(dt A) state + dt x ⊗ B`, `y = state' · C (+ D x) (· silu z)`.

    `dt_t` already biased, soft-plussed and clipped; computes in float32 (float64 for float64).
    """
    acc = jnp.promote_types(x_t.dtype, jnp.float32)
    rep = x_t.shape[1] // B_t.shape[1]
    b = jnp.repeat(B_t.astype(acc), rep, axis=1)  # [batch, heads, state]
    c = jnp.repeat(C_t.astype(acc), rep, axis=1)
    dt = dt_t.astype(acc)
    decay = jnp.exp(dt * A.astype(acc))[..., None, None]
    new = decay * state.astype(acc) + (dt[..., None] * x_t.astype(acc))[..., None] * b[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", new, c, precision=kernels.full_precision(acc))
    y = skip_and_gate(y[:, None], x_t[:, None], D, None if z_t is None else z_t[:, None])[:, 0]
    return y.astype(x_t.dtype), new.astype(state.dtype)


IMPLEMENTATION = Implementation(
    "xla",
    ssd,
    block_sizes=SSDBlockSizes,
    heuristic=heuristic,
    space=space,
    backward="autodiff through the chunked scan (states saved per chunk)",
)
