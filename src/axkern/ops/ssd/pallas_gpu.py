"""Mamba-2 SSD as Pallas GPU (Triton) kernels, forward and backward.

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

All products take float32 operands with float32 accumulation for now (with bf16 operands
the final state and the gate's gradient missed the oracle rule in bf16); decays and weights
are float32. Layout: `x`, `B`, `C` are moved to `[batch, heads|groups, length, P|N]` so a
program's tiles are contiguous rows.

**Backward** (`custom_vjp` around stages 1-4; `D`, `z`, padding and layout by autodiff):
kernel `chunk_scan_bwd` per (batch, head, chunk) pulls `dy` back through
`y = M (dt ∘ x) + f ∘ (C S_in^T)`, `M = (C B^T) ∘ Λ`: `d(dt∘x) = M^T dy`, `dM = dy (dt∘x)^T`,
`d(C B^T) = dM ∘ Λ` (giving `dC`, `dB`), `dcum = rowsum(dM ∘ M) - colsum(dM ∘ M)`,
`df = rowsum(dy ∘ C S_in^T)`, `dS_in = (f ∘ dy)^T C`. The recurrence runs backwards in XLA
(`lax.scan(reverse=True)`: the gradients of each chunk's own state, of the carries and of
the initial state); kernel `chunk_state_bwd` pulls those through `S = (w ∘ x)^T B`; stage
1's VJP turns `dcum`, `dw`, `df` and the carries' gradients into `d dt` and `dA`. `dB` and
`dC` are per head (`[b, h, L, N]`, float32) and summed over each group's heads in XLA.
The forward saves the state entering every chunk (`[b, c, h, P, N]`, float32).

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

from axkern.core.blocks import next_power_of_2
from axkern.core.op import Unsupported

from .blocks import SSDBlockSizes

MIN_DIM = 16


def supports(spec) -> str | None:
    for name in ("head_dim", "state"):
        n = spec.dim(name)
        if n < MIN_DIM or n & (n - 1):
            return f"{name}={n}: the Pallas GPU kernels need a power of two >= {MIN_DIM} (Triton dot tiles)"
    return None


def heuristic(spec) -> SSDBlockSizes:
    """Chunks of 64: a program holds `[Q, Q]` float32 score and decay tiles in registers, which
    at mamba_ssm's 256 would need sub-tiling (not yet written). Untuned: no GPU run yet."""
    return SSDBlockSizes(chunk_size=max(MIN_DIM, min(64, next_power_of_2(spec.dim("length")))))


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


def _decay(cum, seg):
    """`Λ[t, s] = exp(cum_t - cum_s)` for `s <= t` in the same segment, else 0 (`[Q, Q]`)."""
    q = cum.shape[0]
    t = lax.broadcasted_iota(jnp.int32, (q, q), 0)
    s = lax.broadcasted_iota(jnp.int32, (q, q), 1)
    visible = (s <= t) & (seg[:, None] == seg[None, :])
    return jnp.exp(jnp.where(visible, cum[:, None] - cum[None, :], -jnp.inf))


def _scan_kernel(x_ref, dt_ref, cum_ref, f_ref, seg_ref, b_ref, c_ref, s_ref, y_ref, *, dtype):
    x = x_ref[0, 0].astype(jnp.float32)  # [Q, P]
    dt, cum, f = dt_ref[0, 0], cum_ref[0, 0], f_ref[0, 0]  # [Q]
    cm = c_ref[0, 0]  # [Q, N]
    scores = _dot(cm, b_ref[0, 0], dtype, trans_b=True) * _decay(cum, seg_ref[0])  # [Q, Q]
    y = _dot(scores, x * dt[:, None], dtype)
    y = y + f[:, None] * _dot(cm, s_ref[0, 0, 0], dtype, trans_b=True)  # C S_in^T: [Q, P]
    y_ref[0, 0] = y


def _scan_bwd_kernel(
    dy_ref,
    x_ref,
    dt_ref,
    cum_ref,
    f_ref,
    seg_ref,
    b_ref,
    c_ref,
    s_ref,
    dx_ref,
    ddt_ref,
    dcum_ref,
    df_ref,
    db_ref,
    dc_ref,
    ds_ref,
):
    """Pull `dy` back through `y = M (dt ∘ x) + f ∘ (C S^T)` with `M = (C B^T) ∘ Λ`."""
    f32 = jnp.float32
    dy = dy_ref[0, 0]  # [Q, P], float32
    x = x_ref[0, 0].astype(f32)
    dt, cum, f = dt_ref[0, 0], cum_ref[0, 0], f_ref[0, 0]
    bm, cm = b_ref[0, 0].astype(f32), c_ref[0, 0].astype(f32)  # [Q, N]
    state = s_ref[0, 0, 0]  # [P, N]
    decay = _decay(cum, seg_ref[0])
    m = _dot(cm, bm, f32, trans_b=True) * decay  # [Q, Q]
    dxd = _dot(m, dy, f32, trans_a=True)  # d(dt ∘ x): [Q, P]
    dx_ref[0, 0] = dxd * dt[:, None]
    ddt_ref[0, 0] = jnp.sum(dxd * x, axis=1)
    dm = _dot(dy, x * dt[:, None], f32, trans_b=True)  # [Q, Q]
    e = dm * m  # d cum through Λ: rows gain, columns lose
    dcum_ref[0, 0] = jnp.sum(e, axis=1) - jnp.sum(e, axis=0)
    dg = dm * decay  # d(C B^T)
    df_ref[0, 0] = jnp.sum(dy * _dot(cm, state, f32, trans_b=True), axis=1)
    dyf = dy * f[:, None]
    dc_ref[0, 0] = _dot(dg, bm, f32) + _dot(dyf, state, f32)
    db_ref[0, 0] = _dot(dg, cm, f32, trans_a=True)
    ds_ref[0, 0, 0] = _dot(dyf, cm, f32, trans_a=True)  # [P, N]


def _state_bwd_kernel(x_ref, w_ref, b_ref, ds_ref, dx_ref, dw_ref, db_ref):
    """Pull `dS` back through `S = (w ∘ x)^T B`."""
    f32 = jnp.float32
    x = x_ref[0, 0].astype(f32)
    w = w_ref[0, 0]
    bm = b_ref[0, 0].astype(f32)
    ds = ds_ref[0, 0, 0]  # [P, N]
    dxw = _dot(bm, ds, f32, trans_b=True)  # [Q, P]
    dx_ref[0, 0] = dxw * w[:, None]
    dw_ref[0, 0] = jnp.sum(dxw * x, axis=1)
    db_ref[0, 0] = _dot(x * w[:, None], ds, f32)  # [Q, N]


def _weights(dtc, A, sc):
    """Stage 1 (XLA): `cum`, the end-state weights `w`, the incoming-state weights `f` (all
    `[b, h, c, Q]`) and each chunk's carry of the incoming state `keep` (`[b, h, c]`)."""
    cum = jnp.cumsum(dtc * A[None, :, None, None], axis=-1)
    seg_before = jnp.concatenate([sc[:, :1, :1], sc[:, :-1, -1:]], axis=1)  # [b, c, 1]
    w = jnp.exp(cum[..., -1:] - cum) * dtc * (sc == sc[:, :, -1:])[:, None]
    f = jnp.exp(cum) * (sc == seg_before)[:, None]
    keep = (sc[:, :, -1] == seg_before[..., 0])[:, None] * jnp.exp(cum[..., -1])
    return cum, w, f, keep


def _recurrence(keep, chunk_states, initial_state):
    """Stage 3 (XLA): the state entering every chunk (`[b, c, h, P, N]`) and the final state."""

    def step(s, inputs):
        k, own = inputs
        return k[:, :, None, None] * s + own, s

    final, states_in = lax.scan(
        step, initial_state, (jnp.moveaxis(keep, 2, 0), jnp.moveaxis(chunk_states, 1, 0))
    )
    return jnp.moveaxis(states_in, 0, 1), final


def _recurrence_bwd(keep, states_in, d_states_in, d_final):
    """Reverse of `_recurrence`: gradients of the chunk states, the carries and the initial state."""

    def step(g, inputs):
        k, s_in, ds_in = inputs  # [b, h], [b, h, P, N], [b, h, P, N]
        d_keep = jnp.sum(g * s_in, axis=(2, 3))
        return k[:, :, None, None] * g + ds_in, (g, d_keep)

    xs = (jnp.moveaxis(keep, 2, 0), jnp.moveaxis(states_in, 1, 0), jnp.moveaxis(d_states_in, 1, 0))
    d_init, (d_own, d_keep) = lax.scan(step, d_final, xs, reverse=True)
    return jnp.moveaxis(d_own, 0, 1), jnp.moveaxis(d_keep, 0, 2), d_init


class _Calls:
    """The pallas_calls of one problem size: grid (batch, head, chunk) and the BlockSpecs."""

    def __init__(self, xt, bt, *, q, interpret, dtype):
        self.batch, self.heads, self.lp, self.p = xt.shape
        self.n = bt.shape[-1]
        self.rep = self.heads // bt.shape[1]
        self.q, self.chunks, self.interpret, self.dtype = q, self.lp // q, interpret, dtype
        self.grid = (self.batch, self.heads, self.chunks)
        rep = self.rep
        self.rows = lambda d: pl.BlockSpec((1, 1, q, d), lambda b, h, c: (b, h, c, 0))
        self.grouped = lambda d: pl.BlockSpec((1, 1, q, d), lambda b, h, c: (b, h // rep, c, 0))
        self.vec = pl.BlockSpec((1, 1, q), lambda b, h, c: (b, h, c))
        self.seg = pl.BlockSpec((1, q), lambda b, h, c: (b, c))
        self.state = pl.BlockSpec((1, 1, 1, self.p, self.n), lambda b, h, c: (b, c, h, 0, 0))

    def out(self, kind, d=None):
        f32 = jnp.float32
        b, h, lp = self.batch, self.heads, self.lp
        if kind == "rows":
            return self.rows(d), jax.ShapeDtypeStruct((b, h, lp, d), f32)
        if kind == "vec":
            return self.vec, jax.ShapeDtypeStruct((b, h, lp), f32)
        return self.state, jax.ShapeDtypeStruct((b, self.chunks, h, self.p, self.n), f32)

    def __call__(self, kernel, in_specs, outs, *args):
        specs, shapes = zip(*outs, strict=True)
        single = len(outs) == 1
        return pl.pallas_call(
            kernel,
            grid=self.grid,
            in_specs=in_specs,
            out_specs=specs[0] if single else list(specs),
            out_shape=shapes[0] if single else list(shapes),
            interpret=self.interpret,
        )(*args)


def _core_forward(cfg, xt, dtc, A, bt, ct, sc, initial_state):
    q, interpret = cfg
    # float32 operands throughout for now: with bf16 operands in the output's products the
    # gate's gradient (dz, through the pre-gate output) missed the oracle rule in bf16
    mm = jnp.float32
    k = _Calls(xt, bt, q=q, interpret=interpret, dtype=mm)
    p, n = k.p, k.n
    flat = lambda a: a.reshape(k.batch, k.heads, k.lp)  # noqa: E731
    cum, w, f, keep = _weights(dtc, A, sc)
    own = k(
        functools.partial(_state_kernel, dtype=mm),
        [k.rows(p), k.vec, k.grouped(n)],
        [k.out("state")],
        xt,
        flat(w),
        bt,
    )
    states_in, final = _recurrence(keep, own, initial_state)
    y = k(
        functools.partial(_scan_kernel, dtype=mm),
        [k.rows(p), k.vec, k.vec, k.vec, k.seg, k.grouped(n), k.grouped(n), k.state],
        [k.out("rows", p)],
        xt,
        flat(dtc),
        flat(cum),
        flat(f),
        sc.reshape(k.batch, k.lp),
        bt,
        ct,
        states_in,
    )
    return (y, final), states_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, xt, dtc, A, bt, ct, sc, initial_state):
    return _core_forward(cfg, xt, dtc, A, bt, ct, sc, initial_state)[0]


def _core_fwd(cfg, xt, dtc, A, bt, ct, sc, initial_state):
    out, states_in = _core_forward(cfg, xt, dtc, A, bt, ct, sc, initial_state)
    return out, (xt, dtc, A, bt, ct, sc, states_in)


def _core_bwd(cfg, res, cotangents):
    q, interpret = cfg
    xt, dtc, A, bt, ct, sc, states_in = res
    dy, d_final = cotangents
    k = _Calls(xt, bt, q=q, interpret=interpret, dtype=jnp.float32)
    p, n = k.p, k.n
    flat = lambda a: a.reshape(k.batch, k.heads, k.lp)  # noqa: E731
    chunked = lambda a: a.reshape(k.batch, k.heads, k.chunks, q)  # noqa: E731
    (cum, w, f, keep), pull_weights = jax.vjp(lambda dtc, A: _weights(dtc, A, sc), dtc, A)
    dx_scan, ddt, dcum, df, db_scan, dc, d_states_in = k(
        _scan_bwd_kernel,
        [k.rows(p), k.rows(p), k.vec, k.vec, k.vec, k.seg, k.grouped(n), k.grouped(n), k.state],
        [
            k.out("rows", p),
            k.out("vec"),
            k.out("vec"),
            k.out("vec"),
            k.out("rows", n),
            k.out("rows", n),
            k.out("state"),
        ],
        dy.astype(jnp.float32),
        xt,
        flat(dtc),
        flat(cum),
        flat(f),
        sc.reshape(k.batch, k.lp),
        bt,
        ct,
        states_in,
    )
    d_own, d_keep, d_init = _recurrence_bwd(keep, states_in, d_states_in, d_final.astype(jnp.float32))
    dx_state, dw, db_state = k(
        _state_bwd_kernel,
        [k.rows(p), k.vec, k.grouped(n), k.state],
        [k.out("rows", p), k.out("vec"), k.out("rows", n)],
        xt,
        flat(w),
        bt,
        d_own,
    )
    d_dtc, dA = pull_weights((chunked(dcum), chunked(dw), chunked(df), d_keep))
    d_dtc = d_dtc + chunked(ddt)
    per_group = lambda a: a.reshape(k.batch, -1, k.rep, k.lp, n).sum(2)  # noqa: E731 - heads -> groups
    return (
        (dx_scan + dx_state).astype(xt.dtype),
        d_dtc.astype(dtc.dtype),
        dA.astype(A.dtype),
        per_group(db_scan + db_state).astype(bt.dtype),
        per_group(dc).astype(ct.dtype),
        None,
        d_init.astype(jnp.float32),
    )


_core.defvjp(_core_fwd, _core_bwd)


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    q = block_sizes.chunk_size
    if q < MIN_DIM:
        raise Unsupported(f"chunk_size={q} is below {MIN_DIM} (Triton dot tiles)")
    acc = jnp.promote_types(x.dtype, jnp.float32)
    batch, length, heads, _ = x.shape
    pad = (-length) % q
    seg = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    if pad:
        zeros = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        x_p, dt_p, B_p, C_p = zeros(x), zeros(dt), zeros(B), zeros(C)
        seg = jnp.concatenate([seg, jnp.broadcast_to(seg[:, -1:], (batch, pad))], axis=1)
    else:
        x_p, dt_p, B_p, C_p = x, dt, B, C
    chunks = (length + pad) // q
    dtc = jnp.moveaxis(dt_p.astype(acc), 2, 1).reshape(batch, heads, chunks, q)
    y, final = _core(
        (q, bool(interpret)),
        jnp.moveaxis(x_p, 2, 1),  # [b, h, L, P]
        dtc,
        A.astype(acc),
        jnp.moveaxis(B_p, 2, 1),  # [b, g, L, N]
        jnp.moveaxis(C_p, 2, 1),
        seg.reshape(batch, chunks, q),
        initial_state.astype(jnp.float32),
    )
    y = jnp.moveaxis(y, 1, 2)[:, :length]
    if D is not None:
        y = y + x.astype(acc) * (D.astype(acc) if D.ndim == 2 else D.astype(acc)[:, None])
    if z is not None:
        y = y * jax.nn.silu(z.astype(acc))
    return y.astype(x.dtype), final.astype(initial_state.dtype)
