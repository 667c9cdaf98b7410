"""MoE routing in CUDA (`axkern/native/moe/*.cu`) through XLA FFI; the pair order is XLA's.

Layout: `AxkernMoeLayout`, one thread per token, a shared-memory histogram per block.

Dispatch: `AxkernMoeGatherRows` copies `x[order[j] // K]` into row `j` (16-byte vectors; a
zero scale drops a row). Its backward is `AxkernMoeGatherSum` with weights `valid`. Combine:
`AxkernMoeGatherSum` (`y[t] = sum_k w[t, k] · expert_y[rows[t, k]]`, float32 accumulation);
its backward is `AxkernMoeGatherRows` with scales `w[order[j]]` plus the weights' gradient in
XLA. The library is built by `axkern.core.native` on first use.

**Grid.** Row kernels: one block of 128 threads per row (grid-stride, at most 8 blocks per
SM), threads across the row. **Bound.** Memory: dispatch reads `T·K` rows of `x` and writes
`T·K·D` elements; combine reads `T·K·D` and writes `T·D`.

!!! warning
    Compiled in CI and loaded by the native loader, but not yet executed on a GPU: not in
    any default order until a GPU run checks it against the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from axkern.core import native
from axkern.core.op import Unsupported

from .routing import inverse, sort_pairs


def supports(spec) -> str | None:
    try:
        native.load("moe")
    except Unsupported as e:
        return str(e)
    return None


def layout(topk_idx, *, num_experts, num_ranks):
    tokens = topk_idx.shape[0]
    out = (
        jax.ShapeDtypeStruct((num_experts,), jnp.int32),
        jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
        jax.ShapeDtypeStruct((tokens, num_ranks), jnp.bool_),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    call = jax.ffi.ffi_call("AxkernMoeLayout", out)
    return tuple(
        call(topk_idx.astype(jnp.int32), num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks))
    )


def layout_supports(spec) -> str | None:
    if spec.dim("ranks") > 64:
        return f"the CUDA layout kernel tracks at most 64 ranks, not {spec.dim('ranks')}"
    return supports(spec)


def _gather_rows(x, src, scale):
    out = jax.ShapeDtypeStruct((src.shape[0], x.shape[1]), x.dtype)
    return jax.ffi.ffi_call("AxkernMoeGatherRows", out)(x, src.astype(jnp.int32), scale.astype(jnp.float32))


def _gather_sum(y, rows, weights, tokens):
    out = jax.ShapeDtypeStruct((tokens, y.shape[1]), y.dtype)
    return jax.ffi.ffi_call("AxkernMoeGatherSum", out)(y, rows.astype(jnp.int32), weights.astype(jnp.float32))


def dispatch(x, topk_idx, *, num_experts):
    order, rows, counts, valid = sort_pairs(topk_idx, num_experts)
    return _dispatch(topk_idx.shape[1], x, order, valid), counts, rows


def _dispatch_impl(topk, x, order, valid):
    return _gather_rows(x, order // topk, valid[order])


_dispatch = jax.custom_vjp(_dispatch_impl, nondiff_argnums=(0,))


def _dispatch_fwd(topk, x, order, valid):
    return _dispatch_impl(topk, x, order, valid), (order, valid, x.shape[0])


def _dispatch_bwd(topk, res, g):
    order, valid, tokens = res
    return _gather_sum(g, inverse(order), valid, tokens), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def combine(expert_y, topk_weights, topk_idx, rows, *, num_experts):
    valid = ((topk_idx >= 0) & (topk_idx < num_experts)).reshape(-1)
    return _combine(expert_y, topk_weights, rows, valid)


@jax.custom_vjp
def _combine(expert_y, topk_weights, rows, valid):
    w = topk_weights.reshape(-1).astype(jnp.float32) * valid
    return _gather_sum(expert_y, rows, w, topk_weights.shape[0])


def _combine_fwd(expert_y, topk_weights, rows, valid):
    return _combine(expert_y, topk_weights, rows, valid), (expert_y, topk_weights, rows, valid)


def _combine_bwd(res, dy):
    expert_y, topk_weights, rows, valid = res
    tokens, topk = topk_weights.shape
    order = inverse(rows)
    w = topk_weights.reshape(-1).astype(jnp.float32) * valid
    d_expert_y = _gather_rows(dy, order // topk, w[order])
    picked = expert_y[rows].astype(jnp.float32).reshape(tokens, topk, -1)
    dw = jnp.einsum("tkd,td->tk", picked, dy.astype(jnp.float32)) * valid.reshape(tokens, topk)
    return d_expert_y, dw.astype(topk_weights.dtype), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)
