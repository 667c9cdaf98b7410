"""The rotation of Mamba-3's `q` and `k` by the angles `Θ` (`rotate`), the same as a `custom_vjp`
with the biases added and the groups repeated to heads, whose backward turns the cotangent back
(`rotated`), and the products of rotated pairs the diagonal correction takes (`pair_products`
from the unrotated vectors, `rank_products` from the rotated ones)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["pair_products", "rank_products", "rotate", "rotated"]


def rotate(u, theta, halves):
    """`u [.., N]` rotated by `theta [.., A]` on its first `A` pairs: `(2i, 2i+1)` (SISO) or
    `(i, i + N/2)` (`halves`, MIMO).

    `u` is viewed as pairs on an axis of two (`[2, N/2]` for `halves`, `[N/2, 2]` otherwise), so
    each element's partner is the same pair's other one (that axis reversed) and the rotation is
    one elementwise expression over all of `u` (no slices and no concatenation to materialise);
    the pairs past `A` pass through as they are."""
    n, a = u.shape[-1], theta.shape[-1]
    if a == 0:
        return u
    pairs = n // 2
    widen = [(0, 0)] * (theta.ndim - 1) + [(0, pairs - a)]  # the pairs past `A`: cos 1, sin 0
    cos = jnp.pad(jnp.cos(theta), widen, constant_values=1)  # [.., N/2], each angle's once
    sin = jnp.pad(jnp.sin(theta), widen)
    sign = jnp.array([-1, 1], sin.dtype)  # the pair's first element takes -sin, the second +sin
    rotated = jnp.arange(pairs) < a
    if halves:
        x = u.reshape(*u.shape[:-1], 2, pairs)
        cos, sin, rotated = cos[..., None, :], sin[..., None, :] * sign[:, None], rotated[None, :]
    else:
        x = u.reshape(*u.shape[:-1], pairs, 2)
        cos, sin, rotated = cos[..., :, None], sin[..., :, None] * sign, rotated[:, None]
    partner = jnp.flip(x, axis=-2 if halves else -1)
    return jnp.where(rotated, x * cos + partner * sin, x).reshape(u.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def rotated(halves, repeat, axis, backward, u, bias, theta):
    """`rotate(u + bias, theta, halves)` with `u` repeated `repeat` times over its groups (axis
    `axis`, to heads) in `bias`'s dtype: `u [b, l, r, g, n]`, `bias [r, h, n]`, `theta [b, l, 1,
    h, a]` (axis 3), or heads first, `u [b, g, l, r, n]`, `bias [h, 1, r, n]`, `theta [b, h, l,
    1, a]` (axis 1). The backward keeps only the arguments (`u` in its own dtype) and turns the
    cotangent back by `-theta`, rather than autodiff's float32 pieces of `u + bias`: in XLA, or
    (heads first) through `backward(halves, u, bias, theta, g)` where it returns the three
    gradients rather than `None` (a kernel that cannot serve these shapes)."""
    return rotate(_biased(repeat, axis, u, bias), theta, halves)


def _biased(repeat, axis, u, bias):
    return jnp.repeat(u.astype(bias.dtype), repeat, axis=axis) + bias


def _rotated_fwd(halves, repeat, axis, backward, u, bias, theta):
    return rotated(halves, repeat, axis, backward, u, bias, theta), (u, bias, theta)


def _rotated_bwd(halves, repeat, axis, backward, res, g):
    u, bias, theta = res
    grads = backward(halves, u, bias, theta, g) if backward is not None and axis == 1 else None
    if grads is not None:
        return grads
    w, pull = jax.vjp(functools.partial(_biased, repeat, axis), u, bias)
    # a pair (x0, x1) turns to (x0 cos - x1 sin, x0 sin + x1 cos): its transpose is the turn by
    # -theta, and d/dtheta is g · (-r1, r0) for the rotated pair (r0, r1) = R w, which equals
    # (R^T g) · (-w1, w0): the turned-back cotangent (needed anyway) against the unrotated pair
    a, pairs = theta.shape[-1], w.shape[-1] // 2
    if a == 0:
        return (*pull(g), jnp.zeros_like(theta))
    back = rotate(g, -theta, halves)
    axis = -2 if halves else -1  # the pair's axis in the view
    wv, bv = (x.reshape(*x.shape[:-1], *((2, pairs) if halves else (pairs, 2))) for x in (w, back))
    w0, w1, b0, b1 = (jnp.take(x, i, axis=axis) for x in (wv, bv) for i in (0, 1))
    d_theta = (b1 * w0 - b0 * w1)[..., :a]
    broadcast = tuple(i for i, n in enumerate(theta.shape) if n == 1 < d_theta.shape[i])
    d_theta = jnp.sum(d_theta, axis=broadcast, keepdims=True)
    return (*pull(back), d_theta.astype(theta.dtype))


rotated.defvjp(_rotated_fwd, _rotated_bwd)


def pair_products(q, k, q_bias, k_bias):
    """`(q_{t,r} · k_{t,u})` of the rotated vectors, `[b, l, r, u, h]` float32, from the unrotated
    ones: `q`, `k [b, l, r, g, n]`, biases `[r, h, n]`. Position `t`'s `q` and `k` turn by the
    same `Θ_t` and a rotation keeps dot products, so `(R a) · (R b) = a · b` with `a`, `b` the
    biased vectors, where the rotated vectors would be read back from memory."""
    b, l, r, g, n = q.shape
    heads = q_bias.shape[1]
    acc = q_bias.dtype
    per_group = lambda bias: bias.reshape(r, g, heads // g, n)  # noqa: E731
    out = _pairs(q.astype(acc), k.astype(acc), per_group(q_bias), per_group(k_bias))
    return out.reshape(b, l, r, r, heads)


def rank_products(qc, kc, heads_major):
    """`(q_{t,r} · k_{t,u})`, `[b, l, r, u, h]`, of the rotated `qc`, `kc` (`[b, l, r, h, n]`, or
    `[b, h, l, r, n]` with `heads_major`): products and a sum over the state in float32, one
    reduction that reads each rotated vector once where it lies (a matrix product per position
    and head would be a batched GEMM of `[r, n] x [n, u]` tiles, which XLA fed with transposed
    copies)."""
    if heads_major:  # [b, h, l, r, u] -> [b, l, r, u, h]
        out = jnp.sum(qc[:, :, :, :, None] * kc[:, :, :, None], axis=-1)
        return jnp.transpose(out, (0, 2, 3, 4, 1))
    return jnp.sum(qc[:, :, :, None] * kc[:, :, None], axis=-1)  # [b, l, r, u, h]


def _ein(spec, *a):
    """`jnp.einsum` with exact float32 products (no TF32): this file's small sums."""
    return jnp.einsum(spec, *a, precision=lax.Precision.HIGHEST)


@jax.custom_vjp
def _pairs(q, k, bq, bk):
    """`Σ_n (q + bq)(k + bk)`, `[b, l, r, u, g, j]`, from `q`, `k [b, l, r, g, n]` and `bq`, `bk
    [r, g, j, n]` (head `g · J + j`), expanded as `q·k + q·bk + bq·k + bq·bk`: matrix products
    over the state of the positions' `[.., n]` rows with the heads' biases (`[n, j]`), never a
    reduction over a `[b, l, h, n]` broadcast (docs/ops/mamba3.md has what one cost). Its
    backward expands them likewise."""
    return (
        _ein("blrgn,blugn->blrug", q, k)[..., None]
        + _ein("blrgn,ugjn->blrugj", q, bk)
        + _ein("rgjn,blugn->blrugj", bq, k)
        + _ein("rgjn,ugjn->rugj", bq, bk)
    )


def _pairs_fwd(q, k, bq, bk):
    return _pairs(q, k, bq, bk), (q, k, bq, bk)


def _pairs_bwd(res, d):  # d [b, l, r, u, g, j]
    q, k, bq, bk = res
    dq = _ein("blrug,blugn->blrgn", d.sum(-1), k) + _ein("blrugj,ugjn->blrgn", d, bk)
    dk = _ein("blrug,blrgn->blugn", d.sum(-1), q) + _ein("blrugj,rgjn->blugn", d, bq)
    dbq = _ein("blrugj,blugn->rgjn", d, k) + _ein("rugj,ugjn->rgjn", d.sum((0, 1)), bk)
    dbk = _ein("blrugj,blrgn->ugjn", d, q) + _ein("rugj,rgjn->ugjn", d.sum((0, 1)), bq)
    return dq, dk, dbq, dbk


_pairs.defvjp(_pairs_fwd, _pairs_bwd)
