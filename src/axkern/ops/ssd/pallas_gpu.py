"""Mamba-2 SSD forward as Pallas GPU (Triton) kernels; the backward recomputes through `xla`.

**Stages** (chunks of `Q` positions; `cum` the running sum of `dt·A` inside a chunk):

1. XLA, `O(B·L·H)`: pad the length to a multiple of `Q` (`dt = 0` rows leave the state
   alone), `cum`, each position's weight into its chunk's end state
   `w_t = exp(cum_{Q-1} - cum_t) dt_t [t in the chunk's last segment]`, and its weight from the
   incoming state `f_t = exp(cum_t) [t in the segment before the chunk]`.
2. Kernel `chunk_state`, one program per (batch, head, chunk): `S_c = (w ∘ x)^T B`, `[P, N]`.
3. XLA, `O(L/Q · H·P·N)`: the recurrence over chunk states (`lax.scan`), giving the state
   entering every chunk and the final state.
4. Kernel `chunk_scan`, one program per (batch, head, chunk):
   `y = ((C B^T) ∘ Λ)(dt ∘ x) + f ∘ (C S_in^T)` with `Λ[t, s] = exp(cum_t - cum_s)` for
   `s <= t` in the same segment, else 0. `D` and the `silu(z)` gate in XLA.

The output's matrix products take the inputs' dtype with float32 accumulation (`float32`
inputs at full precision); the chunk states' product is float32 throughout (the final
state is returned in float32, and bf16-rounded `w ∘ x` missed the oracle rule there);
decays and weights are float32. Layout: `x`, `B`, `C` are moved to
`[batch, heads|groups, length, P|N]` so a program's tiles are contiguous rows.

**Backward.** Not yet a kernel: the `custom_vjp` backward is the VJP of the `xla`
implementation at the same inputs (recomputed), so gradients are exact but cost what `xla`'s
do. Hand-written backward kernels (mamba_ssm has five) are the next step.

**Constraints**: `P`, `N` and the chunk powers of two and at least 16 (Triton's `dot`
tiles); otherwise the call falls back with the reason. Verified in interpret mode only: it has not yet been compiled for or timed on
a GPU, so it is in no default order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.op import Unsupported

from . import xla
from .blocks import SSDBlockSizes

MIN_DIM = 16


def supports(spec) -> str | None:
    for name in ("head_dim", "state"):
        n = spec.dim(name)
        if n < MIN_DIM or n & (n - 1):
            return f"{name}={n}: the Pallas GPU kernels need a power of two >= {MIN_DIM} (Triton dot tiles)"
    return None


def _check_chunk(block_sizes: SSDBlockSizes) -> None:
    q = block_sizes.chunk_size
    if q < MIN_DIM:
        raise Unsupported(f"chunk_size={q} is below {MIN_DIM} (Triton dot tiles)")


def _dot(a, b, dtype, *, trans_a=False, trans_b=False):
    """`a @ b` with operands in `dtype` and float32 accumulation (full precision for float32)."""
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return lax.dot_general(
        a.astype(dtype), b.astype(dtype), dims, precision=precision, preferred_element_type=jnp.float32
    )


def _state_kernel(x_ref, w_ref, b_ref, out_ref, *, dtype):
    x = x_ref[0, 0].astype(jnp.float32)  # [Q, P]
    w = w_ref[0, 0]  # [Q]
    out_ref[0, 0, 0] = _dot(x * w[:, None], b_ref[0, 0], dtype, trans_a=True)  # [P, N]


def _scan_kernel(x_ref, dt_ref, cum_ref, f_ref, seg_ref, b_ref, c_ref, s_ref, y_ref, *, dtype):
    x = x_ref[0, 0].astype(jnp.float32)  # [Q, P]
    dt, cum, f = dt_ref[0, 0], cum_ref[0, 0], f_ref[0, 0]  # [Q]
    seg = seg_ref[0]  # [Q]
    cm = c_ref[0, 0]  # [Q, N]
    q = x.shape[0]
    t = lax.broadcasted_iota(jnp.int32, (q, q), 0)
    s = lax.broadcasted_iota(jnp.int32, (q, q), 1)
    visible = (s <= t) & (seg[:, None] == seg[None, :])
    decay = jnp.exp(jnp.where(visible, cum[:, None] - cum[None, :], -jnp.inf))
    scores = _dot(cm, b_ref[0, 0], dtype, trans_b=True) * decay  # [Q, Q]
    y = _dot(scores, x * dt[:, None], dtype)
    y = y + f[:, None] * _dot(cm, s_ref[0, 0, 0], dtype, trans_b=True)  # C S_in^T: [Q, P]
    y_ref[0, 0] = y.astype(y_ref.dtype)


def _forward(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret):
    q = block_sizes.chunk_size
    acc = jnp.promote_types(x.dtype, jnp.float32)
    mm = jnp.float32 if x.dtype == jnp.float32 else x.dtype  # the dots' operand dtype
    batch, length, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    rep = heads // groups
    pad = (-length) % q
    seg = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    if pad:
        zeros = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        x_p, dt_p, B_p, C_p = zeros(x), zeros(dt), zeros(B), zeros(C)
        seg = jnp.concatenate([seg, jnp.broadcast_to(seg[:, -1:], (batch, pad))], axis=1)
    else:
        x_p, dt_p, B_p, C_p = x, dt, B, C
    lp = length + pad
    chunks = lp // q

    # stage 1: per-position decays and weights, [batch, heads, chunks, Q]
    dtc = jnp.moveaxis(dt_p.astype(acc), 2, 1).reshape(batch, heads, chunks, q)
    cum = jnp.cumsum(dtc * A.astype(acc)[None, :, None, None], axis=-1)
    sc = seg.reshape(batch, chunks, q)
    last = sc[:, :, -1:]
    seg_before = jnp.concatenate([sc[:, :1, :1], sc[:, :-1, -1:]], axis=1)  # [b, c, 1]
    w_end = jnp.exp(cum[..., -1:] - cum) * dtc * (sc == last)[:, None]
    f = jnp.exp(cum) * (sc == seg_before)[:, None]
    keep = (sc[:, :, -1] == seg_before[..., 0])[:, None] * jnp.exp(cum[..., -1])  # [b, h, c]

    xt = jnp.moveaxis(x_p, 2, 1)  # [b, h, L, P]
    bt, ct = jnp.moveaxis(B_p, 2, 1), jnp.moveaxis(C_p, 2, 1)  # [b, g, L, N]
    flat = lambda a: a.reshape(batch, heads, lp)  # noqa: E731
    grid = (batch, heads, chunks)
    rows = lambda d: pl.BlockSpec((1, 1, q, d), lambda b, h, c: (b, h, c, 0))  # noqa: E731
    grouped = lambda d: pl.BlockSpec((1, 1, q, d), lambda b, h, c: (b, h // rep, c, 0))  # noqa: E731
    vec = pl.BlockSpec((1, 1, q), lambda b, h, c: (b, h, c))
    state = pl.BlockSpec((1, 1, 1, p, n), lambda b, h, c: (b, c, h, 0, 0))

    # stage 2: each chunk's own end state
    chunk_states = pl.pallas_call(
        functools.partial(_state_kernel, dtype=jnp.float32),  # the final state is returned in float32
        grid=grid,
        in_specs=[rows(p), vec, grouped(n)],
        out_specs=state,
        out_shape=jax.ShapeDtypeStruct((batch, chunks, heads, p, n), jnp.float32),
        interpret=interpret,
    )(xt, flat(w_end), bt)

    # stage 3: the recurrence between chunks
    def step(s, inputs):
        k, own = inputs
        return k[:, :, None, None] * s + own, s

    final, states_in = lax.scan(
        step, initial_state.astype(jnp.float32), (jnp.moveaxis(keep, 2, 0), jnp.moveaxis(chunk_states, 1, 0))
    )
    states_in = jnp.moveaxis(states_in, 0, 1)  # [b, c, h, P, N]

    # stage 4: outputs
    y = pl.pallas_call(
        functools.partial(_scan_kernel, dtype=mm),
        grid=grid,
        in_specs=[
            rows(p),
            vec,
            vec,
            vec,
            pl.BlockSpec((1, q), lambda b, h, c: (b, c)),
            grouped(n),
            grouped(n),
            state,
        ],
        out_specs=rows(p),
        out_shape=jax.ShapeDtypeStruct((batch, heads, lp, p), acc),
        interpret=interpret,
    )(xt, flat(dtc), flat(cum), flat(f), seg, bt, ct, states_in)
    y = jnp.moveaxis(y, 1, 2)[:, :length]
    if D is not None:
        y = y + x.astype(acc) * (D.astype(acc) if D.ndim == 2 else D.astype(acc)[:, None])
    if z is not None:
        y = y * jax.nn.silu(z.astype(acc))
    return y.astype(x.dtype), final.astype(initial_state.dtype)


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    _check_chunk(block_sizes)
    return _ssd((block_sizes, bool(interpret)), x, dt, A, B, C, D, z, segment_ids, initial_state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ssd(cfg, x, dt, A, B, C, D, z, segment_ids, initial_state):
    block_sizes, interpret = cfg
    return _forward(
        x, dt, A, B, C, D, z, segment_ids, initial_state, block_sizes=block_sizes, interpret=interpret
    )


def _ssd_fwd(cfg, *args):
    return _ssd(cfg, *args), args


def _ssd_bwd(cfg, args, cotangents):
    block_sizes, _ = cfg
    x, dt, A, B, C, D, z, segment_ids, initial_state = args

    def f(x, dt, A, B, C, D, z, initial_state):
        return xla.ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, block_sizes=block_sizes)

    _, pull = jax.vjp(f, x, dt, A, B, C, D, z, initial_state)
    dx, ddt, dA, dB, dC, dD, dz, ds0 = pull(cotangents)
    return dx, ddt, dA, dB, dC, dD, dz, None, ds0


_ssd.defvjp(_ssd_fwd, _ssd_bwd)
