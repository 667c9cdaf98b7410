"""Helpers shared by Pallas kernel bodies (GPU and TPU)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = [
    "dot",
    "full_precision",
    "halves",
    "log_refined",
    "products_precision",
    "row_dot",
    "swizzled_smem",
    "tf32_suffices",
]


def full_precision(dtype):
    """The library's rule for products: `HIGHEST` for 32-bit (and wider) float operands (XLA's
    and Triton's GPU default would be TF32), `None` (the default) for 16-bit ones."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def halves(a, dtype):
    """`a` (float32) as `hi + lo`, both in `dtype` (16-bit): `lo` what the rounding to `hi` lost.
    A product over the halves but `lo · lo` is about as exact as a float32 one (the Mosaic GPU
    kernels' and the TPU chunk kernels' scheme)."""
    hi = a.astype(dtype)
    return hi, (a - hi.astype(jnp.float32)).astype(dtype)


def tf32_suffices(dtype) -> bool:
    """Whether float32 products of values computed from inputs of `dtype` may run as TF32 (10
    mantissa bits): for inputs with fewer (bf16's 7), whose own rounding then dominates; not for
    fp16 (TF32's 10, its rounding as coarse as the inputs') or float32."""
    return jnp.finfo(dtype).nmant < 10


def products_precision(dtype):
    """The precision of the float32 products of a computation on inputs of `dtype`: `None` (the
    platform's default, TF32 on GPU) where `tf32_suffices(dtype)`, else `HIGHEST` (exact)."""
    return None if tf32_suffices(dtype) else lax.Precision.HIGHEST


def dot(a, b, dtype=None, *, trans_a=False, trans_b=False, precision=None):
    """`a @ b` (either side transposed) with operands cast to `dtype` (default `a`'s) and float32
    accumulation; float32 operands at full precision (no TF32) unless `precision` says otherwise
    (`lax.Precision.DEFAULT`: TF32 tensor cores on GPU, an order of magnitude faster than
    Triton's exact float32 product)."""
    dtype = jnp.dtype(dtype or a.dtype)
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    if precision is None:
        precision = full_precision(dtype)
    return lax.dot_general(
        a.astype(dtype), b.astype(dtype), dims, precision=precision, preferred_element_type=jnp.float32
    )


def row_dot(a, b, keepdims=False):
    """`Σ a · b` over the last axis in float32 as an explicit product at full precision (e.g.
    attention's `delta = Σ_d o · dO`): a multiply-then-sum is left to the compiler, which may
    form it as a product at the platform's default precision (one bfloat16 pass on a TPU)."""
    out = jnp.einsum(
        "...d,...d->...", a.astype(jnp.float32), b.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )
    return out[..., None] if keepdims else out


def log_refined(x):
    """`log(x)` for a float32 `x` of moderate size (e.g. a row's sum of exponentials, at least
    1), one Newton step `y + x·exp(-y) - 1` on `jnp.log`'s
    `y`: as accurate as the platform's `exp`. A TPU's float32 `log` is far less accurate than its
    `exp` (docs/tpu.md), and a log-sum-exp kept for the backward (`p = exp(s - lse)`) passes its
    error on, as a relative error, to every probability of its row."""
    y = jnp.log(x)
    return y + (x * jnp.exp(-y) - 1.0)


def swizzled_smem(shape, dtype):
    """A Pallas Mosaic GPU shared-memory tile laid out as `wgmma` and TMA read it: tiles of 8 rows
    of 128 bytes (64 16-bit or 32 float32 columns), 128-byte swizzle (float32 tiles staged for
    TMA take it too, against bank conflicts)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cols = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(
        shape, dtype, transforms=(plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(128))
    )
