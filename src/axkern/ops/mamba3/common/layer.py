"""Mamba-3's layer through a chunk scan (`forward`, which every chunked implementation runs with
its own `Core`): the per-position preparation (angles, rotated `q` and `k`, the trapezoid's
weights), the reduction to the engine's chunk scan, the non-finite guard and the output's
correction, skip, gate and rank collapse.

**The chunked form.** With `c_t = (1 - λ_t) Δ_t` (0 where a segment starts) and
`g_t = h_t + c_{t+1} Σ_r v_{t,r} k_{t,r}ᵀ` (`c` is 0 after the last position),
`g_t = α_t g_{t-1} + (λ_t Δ_t + c_{t+1}) Σ_r v_{t,r} k_{t,r}ᵀ`: SSD with the per-position
log-decay `adt_t` and input scale `s_t = λ_t Δ_t + c_{t+1}`, starting from
`g_{-1} = h_{-1} + c_0 Σ_r v_{-1,r} k_{-1,r}ᵀ` (the initial state's `ssm`, `v` and `k`). Then
`y_{t,r} = g_t q_{t,r} - c_{t+1} Σ_u (q_{t,r} · k_{t,u}) v_{t,u}` (a diagonal correction) and
`h_L = g_L`.

**MIMO on the kernels** (`kernel_core.py`): SSD's Pallas kernels take one input per position, so
each token's `R` inputs run as consecutive positions, the decay on the first; the states are
exact, and the output's missing terms (the same token's later ranks) join the diagonal
correction: `y_{t,r} += s_t Σ_{u > r} (q_{t,r} · k_{t,u}) v_{t,u}`.

**Angles** (`angles.py`). `Θ_t` is a running sum of `π tanh(angles) Δ` inside each segment,
mod 2π: summed inside chunks, carried between chunks by a parallel scan.

**Non-finite input** (`guard`): the chunked terms mix positions in ways the recurrence does not
(`c_{t+1}` reaches `g_t`, cancelled only arithmetically), so they compute on inputs with
non-finite values as 0 and NaN is put where the sequential recurrence is non-finite: a
non-finite `v_{t,r}[p]` reaches row `p` of the state and of `y` from `t` to the end of its
segment, `k_{t,r}[n]` column `n` of the state (so all of `y`), `adt_t` (unless `t` starts a
segment), `dt_t` or `trap_t` the whole head, a non-finite rotated `q_{t,r}` only `y_{t,r}`; the
initial state the first segment. `angles` and `dt` reach `Θ` (and so `q`, `k`) from their position on.
The masks (where `Θ`, `y`, a rotated `q` and the final state are non-finite) come from one
`lax.cond` on the inputs, outside the differentiated program, that computes them only when some
value the recurrence reads may not be finite, one fused read of the inputs deciding (`forward`);
for finite inputs, the common case, its branch writes zeros, `Θ`'s and `y`'s masks as bits
(under `vmap` the condition is batched and both branches run). Every large array is formed
outside it (a conditional's outputs are materialised, XLA copies a branch's result into the
layout the conditional gives it, and the conditional's transpose would instantiate zero
cotangents for outputs the caller drops): the masks' selects fuse into the passes that read
them, and the scan's large inputs are `scrubbed` (0 where non-finite unless all is finite: an
elementwise select, no mask kept).
"""

from __future__ import annotations

import math
import typing

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core import kernels
from axkern.core.compat import vary_like
from axkern.ops.chunked.chunks import all_finite, clean, poison, reaches_bits, scrubbed, segment_starts

from .angles import angle_sums
from .rotation import pair_products, rank_products, rotate, rotated

__all__ = ["Core", "forward"]


class Core(typing.Protocol):
    """A chunk scan: `(x [b, l, R, H, P], a, s [b, l, H], B, C [b, l, R, H, N], seg [b, l],
    initial_state [b, H, P, N]) -> (y [b, l, R, H, P], final_state)` (`chunked.scan`; or
    `kernel_core.kernel_core`, whose `y_{t,r}` holds token `t`'s ranks `u <= r` only and whose `B`, `C` are
    `[b, H, l, R, N]`: a core with `heads_major = True` takes them so)."""

    heads_major: bool  # optional (absent: False): `B`, `C` heads first
    # optional (absent: None): the heads-first rotation's backward (`rotated`'s `backward`)
    rotation_backward: typing.Any
    # optional (absent: False): the call takes `diag=` (`[b, l, H]`) and adds
    # `diag_t (C_t · B_t) x_t` to `y_t` (SISO), so `forward` leaves it the diagonal correction
    diagonal: bool
    x_dtype: typing.Any  # optional (absent: float32 or wider): the dtype the call takes `x` in
    # optional (absent: None): `Θ` heads first from the raw angles (`angle_kernel.angle_thetas`'s
    # arguments and result; a `heads_major` core's), else XLA's `angle_sums`
    angle_kernel: typing.Any
    # optional (absent: False): `B`, `C` are `(k or q [b, l, R, G, N], bias [R, H, N], Θ)`, unrotated
    rotates: bool

    def __call__(self, x, a, s, B, C, seg, initial_state, **diag): ...


def forward(
    core: Core,
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
    angle0,
    ssm0,
    k0,
    v0,
    W_x,
    W_z,
    W_o,
    *,
    chunk_size,
    later_ranks=False,
):
    """Mamba-3 through the chunk scan `core`; the arguments and results of `reference.mamba3`.
    `later_ranks`: `core`'s output `(t, r)` holds the same token's ranks `u <= r` only (as
    `kernel_core`'s), and the correction adds `scale_t Σ_{u > r} (q_{t,r} · k_{t,u}) v_{t,u}`."""
    acc = jnp.promote_types(v.dtype, jnp.float32)
    prec = kernels.products_precision(v.dtype)
    batch, length, heads, _ = v.shape
    groups = q.shape[3]
    mimo = W_x is not None
    heads_major = getattr(core, "heads_major", False)
    rotates = getattr(core, "rotates", False)  # the core turns q, k itself
    rotation_backward = getattr(core, "rotation_backward", None)
    f = lambda a: a.astype(acc)  # noqa: E731
    bad = lambda a: ~jnp.isfinite(a)  # noqa: E731
    by_rank = lambda w: jnp.swapaxes(f(w), 0, 1)  # noqa: E731 - [h, r, ..] -> [r, h, ..]
    seg = segment_starts(segment_ids, batch, length)
    starts = jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    first = seg == 0

    # per-position scalars, [b, l, h]
    adt_, dt_, trap_ = (jnp.swapaxes(f(a), 1, 2) for a in (adt, dt, trap))
    ang = f(angles)
    adt_c, dt_c, lam = clean(adt_), clean(dt_), jax.nn.sigmoid(clean(trap_))

    # the angles, then the rotated q, k from `Θ` as the guard below leaves it
    angle_kernel = getattr(core, "angle_kernel", None) if heads_major else None
    if angle_kernel is not None:  # heads first, [b, h, l, a]
        theta = angle_kernel(angles, clean(f(dt)), clean(f(angle0)), seg)
    else:
        inc = math.pi * jnp.tanh(clean(ang)) * dt_c[..., None]
        theta = angle_sums(inc, clean(f(angle0)), seg, chunk_size)
    v0r = f(v0)[:, None] * by_rank(W_x) if mimo else f(v0)[:, None]  # [b, r, h, p]
    x_dtype = getattr(core, "x_dtype", acc)

    def v_ranks(dtype=acc):  # v ⊙ W_x, [b, l, r, h, p]
        return f(v)[:, :, None] * by_rank(W_x) if mimo else v[:, :, None].astype(dtype)

    # Θ in the layout the rotation writes (`heads_major`: [b, h, l, a], else [b, l, h, a]), so
    # that the rotation reads its angles in its own order and writes its output with no transpose
    own_order = (lambda u: jnp.swapaxes(u, 1, 2)) if heads_major else (lambda u: u)
    theta = theta if angle_kernel is not None else own_order(theta)

    def rotations(theta, last=False):  # the rotated q, k ([b, l, r, h, n]; `heads_major`: [b, h, l, r, n])
        at = slice(length - 1, length) if last else slice(None)  # `last`: the last position only
        if heads_major:  # the small inputs transposed, so that the rotation writes heads first
            th = theta[:, :, at, None]  # [b, h, l, 1, a]
            return tuple(
                rotated(
                    mimo,
                    heads // groups,
                    1,
                    rotation_backward,
                    jnp.transpose(u[:, at], (0, 3, 1, 2, 4)),
                    f(b)[:, None],
                    th,
                )
                for u, b in ((q, q_bias), (k, k_bias))
            )
        th = theta[:, at, None]  # [b, l, 1, h, a]
        return tuple(
            rotated(mimo, heads // groups, 3, None, u[:, at], by_rank(b), th)
            for u, b in ((q, q_bias), (k, k_bias))
        )

    def tokens_major(u):  # a rotated q or k as `rotations` gives it -> [b, l, r, h, n]
        return jnp.transpose(u, (0, 2, 3, 1, 4)) if heads_major else u

    # where the sequential recurrence is non-finite (see the module docstring): the masks run
    # only when some value the recurrence reads may not be finite. The rotated q, k and v ⊙ W_x
    # are bounded from the inputs' sums of magnitudes (one fused read of each input, no
    # prepared array kept for it): |q + q_bias| <= Σ|q| + Σ|q_bias| < 2^126 leaves the rotation
    # (at most twice that) finite, and Σ|v| · Σ|W_x| < 2^126 bounds v ⊙ W_x; a larger or
    # non-finite sum takes the exact masks.
    mass = lambda a: jnp.sum(jnp.abs(lax.stop_gradient(a)), dtype=jnp.float32)  # noqa: E731
    limit = 2.0**126
    finite = (
        all_finite(ang, dt_, angle0, adt_, trap_, v0r, ssm0, k0)
        & (mass(q) + mass(q_bias) < limit)
        & (mass(k) + mass(k_bias) < limit)
        & (mass(v) * (mass(W_x) if mimo else 1) < limit)
    )
    # the trapezoid's weights: c_t on the previous position's input, none at a segment start
    c = jnp.where(starts[..., None], 0, (1 - lam) * dt_c)
    c_next = jnp.concatenate([c[:, 1:], jnp.zeros_like(c[:, :1])], axis=1)
    scale = lam * dt_c + c_next
    einsum = lambda *a: jnp.einsum(*a, precision=prec)  # noqa: E731
    rank = v0r.shape[1]
    # inside `shard_map` both branches must vary over the same mesh axes: those of what they read
    read = (q, k, v, W_x, q_bias, k_bias, theta, ang, angle0, adt_, dt_, trap_, seg, ssm0, v0r, k0)

    # the two large masks, `Θ`'s and `y`'s, leave the conditional as bits along their last axis,
    # 8 to a byte (`jnp.packbits`; unpacked in the selects that read them): the finite branch's
    # zeros are written whole on every call
    bits = lambda shape: (*shape[:-1], -(-shape[-1] // 8))  # noqa: E731

    def no_masks(theta):  # finite inputs: nothing is masked (small zeros)
        packed = (bits(theta.shape), bits((batch, length, heads, v.shape[-1])))
        flags = ((batch, length, rank, heads), ssm0.shape)
        zeros = [jnp.zeros(s, jnp.uint8) for s in packed] + [jnp.zeros(s, bool) for s in flags]
        return vary_like(tuple(zeros), *read)

    def masks(theta):  # where the recurrence is non-finite: `Θ`, `y`, a rotated `q`, the final state
        theta_reach = reaches_bits(bad(ang) | bad(dt_)[..., None], seg)  # (bits: no int32 positions)
        theta_bad = jnp.unpackbits(theta_reach, axis=-1, count=ang.shape[-1]).astype(bool) | (
            first[:, :, None, None] & bad(angle0)[:, None]
        )
        last = seg == seg[:, -1:]
        in_last = lambda a: (a & last.reshape(last.shape + (1,) * (a.ndim - 2))).any(1)  # noqa: E731
        if rotates:  # a few heads at a time: no per-head float32 rotation of every head is formed
            # where the core turns q, k itself (XLA on a TPU wrote them whole, the conditional's
            # largest buffers); elsewhere XLA forms them for the scan anyway
            th = poison(own_order(theta), theta_bad)  # [b, l, h, a]
            q_bad, col_any, col_last = _rotation_masks(
                q, k, by_rank(q_bias), by_rank(k_bias), th, mimo, in_last
            )
        else:
            qr, kr = (tokens_major(u) for u in rotations(poison(theta, own_order(theta_bad))))
            col = bad(kr).any(2)  # [b, l, h, n]
            q_bad, col_any, col_last = bad(qr).any(-1), col.any(-1), in_last(col)
        vr = v_ranks()
        head_bad = bad(trap_) | bad(dt_) | (bad(adt_) & ~starts[..., None])  # [b, l, h]
        row = bad(vr).any(2)  # [b, l, h, p]
        init_row = bad(ssm0).any(-1) | bad(v0r).any(1) | bad(k0).any((1, 3))[..., None]  # [b, h, p]
        y_bits = reaches_bits(row | (head_bad | col_any)[..., None], seg) | jnp.packbits(
            first[:, :, None, None] & init_row[:, None], axis=-1
        )  # [b, l, h, p] as bits
        final_bad = (
            in_last(row)[..., None]
            | col_last[:, :, None, :]
            | in_last(head_bad)[..., None, None]
            | (
                (seg[:, -1] == 0)[:, None, None, None]
                & (bad(ssm0) | bad(v0r).any(1)[..., None] | bad(k0).any(1)[:, :, None, :])
            )
        )
        packed = (jnp.packbits(own_order(theta_bad), axis=-1), y_bits)
        return vary_like((*packed, q_bad, final_bad), *read)

    # one conditional, on small arrays and masks only: every large array is formed outside it
    # (a conditional's outputs are materialised, and XLA copies a branch's result into its
    # layout), the masks' selects fused into the passes that form them
    theta_bad, y_bad, q_bad, final_bad = lax.cond(finite, no_masks, masks, lax.stop_gradient(theta))
    unpack = lambda a, n: jnp.unpackbits(a, axis=-1, count=n).astype(bool)  # noqa: E731
    theta_bad, y_bad = unpack(theta_bad, theta.shape[-1]), unpack(y_bad, v.shape[-1])
    theta = poison(theta, theta_bad)  # `Θ` with its NaNs
    # the scan's inputs with non-finite values as 0: for finite inputs, the rotations as they are
    # and `v` in the dtype the core takes it
    if rotates:  # the core turns them: (unrotated q or k, its bias, Θ [b, h, l, a])
        th = scrubbed(finite, theta)
        qc, kc = ((scrubbed(finite, u), by_rank(b), th) for u, b in ((q, q_bias), (k, k_bias)))
    else:
        qc, kc = (scrubbed(finite, u) for u in rotations(theta))
    vc = scrubbed(finite, v_ranks(x_dtype))
    # a core that takes `x` with non-finite values (`cleans_x`) reads `v` as it is; `vc` (above)
    # then only feeds XLA's correction, into whose pass its select fuses
    vx = v_ranks(x_dtype) if getattr(core, "cleans_x", False) else vc
    s0c, v0c, k0c = clean(f(ssm0)), clean(v0r), clean(f(k0))
    theta_last = theta[:, :, -1] if heads_major else theta[:, -1]  # [b, h, a]
    k_last = rotations(theta, last=True)[1]
    k_last = jnp.swapaxes(k_last[:, :, 0], 1, 2) if heads_major else k_last[:, 0]  # [b, r, h, n]

    g0 = s0c + c[:, 0, :, None, None] * einsum("brhp,brhn->bhpn", v0c, k0c)
    # y_{t,r} -= c_{t+1} Σ_u (q_{t,r} · k_{t,u}) v_{t,u}, and with `later_ranks` += scale_t Σ_{u > r} (..):
    # inside the core where it takes the diagonal term (SISO: `-c_{t+1} (q_t · k_t) v_t`)
    folded = getattr(core, "diagonal", False) and rank == 1
    y, final = core(vx, adt_c, scale, kc, qc, seg, g0, **({"diag": -c_next} if folded else {}))
    if not folded:
        weight = -c_next[:, :, None, None, :]  # [b, l, r, u, h]
        if later_ranks and rank > 1:
            later = jnp.arange(rank)[:, None] < jnp.arange(rank)[None, :]  # [r, u]: u > r
            weight = weight + jnp.where(later[:, :, None], scale[:, :, None, None, :], 0)
        if rank == 1:  # from the unrotated inputs (small), non-finite values as 0 as the scan's
            diag = pair_products(*(scrubbed(finite, u) for u in (q, k, by_rank(q_bias), by_rank(k_bias))))
        else:  # MIMO from the rotated ones (docs/ops/mamba3.md), as one reduction over the state
            diag = rank_products(qc, kc, heads_major)
        diag = diag * weight
        # Σ_u over the few ranks as elementwise terms: XLA fuses them into the passes over `y`
        # (a matrix product of `[r, u] x [u, p]` per position and head would run as a batched GEMM)
        y = y + sum(diag[:, :, :, u, :, None] * vc[:, :, None, u].astype(acc) for u in range(rank))
    # NaN where the recurrence is non-finite
    y = poison(y, y_bad[:, :, None] | q_bad[..., None])
    final = poison(final, final_bad)

    if D is not None:
        y = y + f(D)[:, None] * v_ranks()
    if z is not None:
        y = y * jax.nn.silu(f(z)[:, :, None] * by_rank(W_z) if mimo else f(z)[:, :, None])
    y = jnp.sum(y * by_rank(W_o), axis=2) if mimo else y[:, :, 0]
    return (
        y.astype(v.dtype),
        theta_last.astype(angle0.dtype),
        final.astype(ssm0.dtype),
        k_last.astype(k0.dtype),
        v[:, -1].astype(v0.dtype),
    )


# heads whose rotated q, k the non-finite masks form at once (`_rotation_masks`)
MASK_HEADS = 8


def _rotation_masks(q, k, q_bias, k_bias, theta, mimo, in_last):
    """Where the rotated `q`, `k` are not finite, as the masks need it: `q`'s per output
    (`[b, l, r, h]`: a rotated `q` reaches its own output only), `k`'s per position and head
    (`[b, l, h]`: all of `y` from there) and per state column in the last segment (`[b, h, n]`,
    through `in_last`). `q`, `k [b, l, r, g, n]`, biases `[r, h, n]`, `theta [b, l, h, a]` with
    NaN where `Θ` is. `MASK_HEADS` heads at a time (`lax.map`), so no rotation of every head at
    once is formed."""
    heads, rep = q_bias.shape[1], q_bias.shape[1] // q.shape[3]
    f32 = jnp.float32

    def head(j):
        th = jnp.take(theta, j, axis=2)[:, :, None]  # [b, l, 1, a]
        turned = [
            rotate(jnp.take(u, j // rep, axis=3).astype(f32) + jnp.take(b, j, axis=1).astype(f32), th, mimo)
            for u, b in ((q, q_bias), (k, k_bias))
        ]  # [b, l, r, n] each
        col = ~jnp.isfinite(turned[1]).all(2)  # [b, l, n]
        return ~jnp.isfinite(turned[0]).all(-1), col.any(-1), in_last(col)

    q_bad, col_any, col_last = lax.map(head, jnp.arange(heads), batch_size=min(heads, MASK_HEADS))
    return jnp.moveaxis(q_bad, 0, -1), jnp.moveaxis(col_any, 0, -1), jnp.moveaxis(col_last, 0, 1)
