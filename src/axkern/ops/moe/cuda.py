"""MoE routing in CUDA (`native/moe/*.cu`) through XLA FFI.

**Routing** (route.cu; `AxkernMoeRoute` runs it alone): a stable counting sort of the `T·K`
pairs by expert id in three small kernels: per-chunk histograms, one block scanning them (a
warp per expert over chunks, then over experts), and one warp per chunk placing its pairs in
order from ids it loaded first (`__match_any_sync` ranks lanes that share an expert). It yields
each pair's row and the group sizes without XLA's argsort.

**Dispatch** (`AxkernMoeDispatch`, scatter.cu): the routing above, then `x[t]` read once and
its bits written to the rows of its `K` pairs (a dropped pair's row is zeros: the kernel tests
the ids, no mask array), one block per token copying 16-byte vectors with streaming stores, in
one handler. On Hopper the kernels after the first are programmatic dependent launches (each
set up while the one before it runs, no launch gap between them). Its backward is
`AxkernMoeGatherSum` with weights 1 and the pairs' validity.

**Combine** (`AxkernMoeGatherSum`): `y[t] = sum_{k valid} w[t, k] · expert_y[rows[t, k]]`,
float32 accumulation. Validity travels beside the weights (a `bool` per pair): a dropped pair
is selected away (its row is not loaded, its weight not read), and every valid pair is
multiplied by its weight, so a routed pair of weight exactly 0 on a NaN row gives NaN, as
`reference` does. A token's `K` rows, weights and validity are read into registers once
and the `K` loads of a vector are issued together. Its backward (`AxkernMoeCombineBwd`)
writes `w[t, k] · dy[t]` to each valid pair's row (zeros to a dropped pair's) and reduces
`<dy[t], expert_y[row]>` for the weights' gradient (0 for a dropped pair) in the same pass
over `expert_y`.

**Grid.** Gather and combine kernels: one block of 128 threads per token (grid-stride, at most 16 blocks
per SM), threads across the row; outputs use streaming stores. **Bound.** Memory: dispatch
reads `T·D` and writes `T·K·D` elements; combine reads `T·K·D` and writes `T·D`. The library
is built by `axkern.core.native` on first use. First in the GPU order (docs/ops/moe.md,
"Performance", has its times beside XLA's).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from axkern.core import native
from axkern.core.blocks import cdiv
from axkern.core.op import Implementation

CHUNK = 1024  # pairs per routing chunk (one warp places them)
MAX_TOPK = 16  # a token's K rows and weights are held in registers (moe.cu)
MAX_EXPERTS = 8192  # the routing kernels keep E+1 int32 counters in shared memory
MAX_PAIRS = 2**31 - 1  # rows, group sizes and the routing's running sums are int32


def supports(spec) -> str | None:
    if spec.dim("topk") > MAX_TOPK:
        return f"the CUDA row kernels hold a token's rows in registers: top-k at most {MAX_TOPK}, not {spec.dim('topk')}"
    if spec.dim("experts") > MAX_EXPERTS:
        return f"the CUDA routing kernels keep per-expert counters in shared memory: at most {MAX_EXPERTS} experts, not {spec.dim('experts')}"
    if spec.dim("tokens") * spec.dim("topk") > MAX_PAIRS:
        return f"the CUDA routing numbers rows in int32: at most {MAX_PAIRS} tokens x top-k pairs"
    return native.unavailable("moe")


def _ids(topk_idx, num_experts):
    """int32 ids with anything outside `[0, E)` mapped to -1 (so a wide id cannot wrap into range)."""
    if topk_idx.dtype == jnp.int32:
        return topk_idx
    return jnp.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx, -1).astype(jnp.int32)


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
        call(_ids(topk_idx, num_experts), num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks))
    )


def layout_supports(spec) -> str | None:
    if spec.dim("ranks") > 64:
        return f"the CUDA layout kernel tracks at most 64 ranks, not {spec.dim('ranks')}"
    return native.unavailable("moe")


def _route_shapes(pairs, num_experts):
    """`rows [T·K]`, `group_sizes [E]` and the routing's int32 workspace."""
    buckets = num_experts + 1
    return (
        jax.ShapeDtypeStruct((pairs,), jnp.int32),
        jax.ShapeDtypeStruct((num_experts,), jnp.int32),
        jax.ShapeDtypeStruct((cdiv(pairs, CHUNK) * buckets + buckets,), jnp.int32),
    )


def _valid(ids, num_experts):
    """The pairs the routing places: ids in `[0, num_experts)`."""
    return (ids >= 0) & (ids < num_experts)


def route(topk_idx, num_experts):
    """`(rows [T·K], group_sizes [E], valid [T·K])` from the CUDA counting sort alone."""
    idx = _ids(topk_idx, num_experts).reshape(-1)
    rows, counts, _ = jax.ffi.ffi_call("AxkernMoeRoute", _route_shapes(idx.shape[0], num_experts))(
        idx, num_experts=np.int64(num_experts), chunk=np.int64(CHUNK)
    )
    return rows, counts, _valid(idx, num_experts)


def _route_and_scatter(x, ids, num_experts):
    """`(out, group_sizes, rows)`: the routing, then `out[rows[p]] = x[p // K]` where
    `0 <= ids[p] < num_experts`, else zeros."""
    out = (
        jax.ShapeDtypeStruct((ids.shape[0], x.shape[1]), x.dtype),
        *_route_shapes(ids.shape[0], num_experts),
    )
    y, rows, counts, _ = jax.ffi.ffi_call("AxkernMoeDispatch", out)(
        x, ids, num_experts=np.int64(num_experts), chunk=np.int64(CHUNK)
    )
    return y, counts, rows


def _gather_sum(y, rows, weights, valid, tokens):
    """`out[t] = sum_{k valid} weights[t, k] · y[rows[t, k]]`: dropped pairs selected away."""
    out = jax.ShapeDtypeStruct((tokens, y.shape[1]), y.dtype)
    return jax.ffi.ffi_call("AxkernMoeGatherSum", out)(y, rows, weights.astype(jnp.float32), valid)


def dispatch(x, topk_idx, *, num_experts):
    return _dispatch(x, _ids(topk_idx, num_experts).reshape(-1), num_experts)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dispatch(x, ids, num_experts):
    return _route_and_scatter(x, ids, num_experts)


def _dispatch_fwd(x, ids, num_experts):
    y, counts, rows = _route_and_scatter(x, ids, num_experts)
    return (y, counts, rows), (rows, ids, x.shape[0])


def _dispatch_bwd(num_experts, res, g):
    rows, ids, tokens = res
    return _gather_sum(g[0], rows, jnp.ones(rows.shape, jnp.float32), _valid(ids, num_experts), tokens), None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def combine(expert_y, topk_weights, topk_idx, rows, *, num_experts):
    valid = ((topk_idx >= 0) & (topk_idx < num_experts)).reshape(-1)
    return _combine(expert_y, topk_weights, rows.astype(jnp.int32), valid)


@jax.custom_vjp
def _combine(expert_y, topk_weights, rows, valid):
    return _gather_sum(expert_y, rows, topk_weights.reshape(-1), valid, topk_weights.shape[0])


def _combine_fwd(expert_y, topk_weights, rows, valid):
    return _combine(expert_y, topk_weights, rows, valid), (expert_y, topk_weights, rows, valid)


def _combine_bwd(res, dy):
    expert_y, topk_weights, rows, valid = res
    out = (
        jax.ShapeDtypeStruct(expert_y.shape, expert_y.dtype),
        jax.ShapeDtypeStruct(rows.shape, jnp.float32),
    )
    # a dropped pair's row of d_expert_y and its weight's gradient come back 0 (selected in the kernel)
    d_expert_y, dw = jax.ffi.ffi_call("AxkernMoeCombineBwd", out)(
        dy.astype(expert_y.dtype), expert_y, rows, topk_weights.reshape(-1).astype(jnp.float32), valid
    )
    return d_expert_y, dw.reshape(topk_weights.shape).astype(topk_weights.dtype), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


LAYOUT_IMPLEMENTATION = Implementation(
    "cuda", layout, platforms=("gpu",), supports=layout_supports, backward="none"
)
DISPATCH_IMPLEMENTATION = Implementation(
    "cuda",
    dispatch,
    platforms=("gpu",),
    supports=supports,
    backward="custom_vjp: the CUDA gather-sum kernel",
)
COMBINE_IMPLEMENTATION = Implementation(
    "cuda",
    combine,
    platforms=("gpu",),
    supports=supports,
    backward="custom_vjp: the CUDA row-gather kernel, weight grads in XLA",
)
