"""Expert-parallel transport in CUDA (`native/moe_ep/ep.cu`) through XLA FFI, for one process
driving every GPU of the mesh: each GPU's call writes its rows straight into the GPUs that
hold their experts and reads the expert outputs back from them, over NVLink by peer access.

Per device, inside `shard_map` over the experts' mesh axis, with the slots of `xla` (the same
pairs sent, the same capacity, the same outputs, so a layout from either combines with either):

- **dispatch.** XLA forms each pair's destination, slot and its place among this device's
  pairs for the same (destination, local expert), and the counts per (destination, local
  expert). One FFI call then, on each GPU: publishes its counts and the addresses of its
  output buffers to every rank of the axis (a write into each rank's control block, then a
  device-side barrier); works out from every rank's counts where its rows start at each
  destination, in the destination's expert-grouped order; writes each sent pair's row of `x`
  there and the pair's received slot into the destination's `order`; fills its own empty rows
  with zeros and the order of its empty slots; and meets the other ranks at a second barrier
  before XLA reads the outputs. The result is `xla`'s `expert_x`, `group_sizes` and `order`,
  without a send buffer or an `all_to_all`, and with the pairs sorted on the sending side (their
  places among their destination's pairs for the same expert) rather than the received rows.
- **combine.** Each holder inverts its `order` (the received slot → its row); each source
  reads, for each of its sent pairs, the row's place from the holder, then the row itself, and
  sums its token's weighted rows (float32 accumulation).
- **gradients.** Dispatch's backward is the combine's gather with unit weights; combine's
  writes `w · dy[t]` into each pair's row at its holder (the holder zeroes the rows nobody
  sent) and reads the row back for the weight's gradient, in one pass.

**Buffers and barriers.** The GPUs' own buffers are XLA's (inputs and outputs of each call),
reached by peer access, which the first call enables between every pair of the mesh's GPUs;
a small control block per GPU (about 1 MB: barrier counts, published addresses and counts) is
allocated once per process and reused by every call. No host synchronisation: each call is a
few kernels on the GPU's own stream, two of them one-block barriers; the library's kernels are
loaded on each GPU before its first barrier (a lazily loaded kernel's first launch could wait for
a GPU held by a spinning barrier). A barrier that waits a minute traps (the GPU's context is then
lost) rather than hanging. The mesh (its GPUs' ordinals and shape) is read when the call is
lowered inside `shard_map`, so each GPU's handler finds its rank and its peers itself.

**Constraints** (`supports`): one process driving all of the mesh's devices (`jax.process_count()
== 1`), XLA's default allocator (not `cuda_async`), at most 64 ranks, 4096 experts, top-k 16,
rows of f32, bf16 or f16 (the gathers' element types; the dispatch's backward is one). Inside
`shard_map` over a mesh of devices only: under `vmap` or outside `shard_map` the call is an
error that says so.

Explicit only (`implementation="cuda"`), in no default order, until it has run across two or
more GPUs (docs/ops/moe_ep.md, "The CUDA transport", says where it has run).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from axkern.core import compat, native
from axkern.core.op import Implementation

from . import common

MAX_RANKS = 64  # the kernels' team table (ep.cu kMaxRanks)
MAX_EXPERTS = 4096  # counts one rank publishes (ep.cu kMaxExperts)
MAX_TOPK = 16  # a token's pairs are held in registers
MAX_ROWS = 2**31 - 1  # rows and slots are int32

WHY_PLATFORMS = "a CUDA transport between the GPUs of one process"
DTYPES = ("float32", "bfloat16", "float16")


def supports(spec) -> str | None:
    if jax.process_count() != 1:
        return (
            f"the CUDA transport reaches peers by peer access within one process; this run has "
            f"{jax.process_count()} processes (use xla)"
        )
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "cuda_async":
        return (
            "XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async: peer access does not reach a memory pool's "
            "allocations, which the CUDA transport reads and writes (use the default allocator)"
        )
    if spec.dtype not in DTYPES:
        return f"the CUDA gathers sum rows of {', '.join(DTYPES)}, not {spec.dtype}"
    if spec.dim("ranks") > MAX_RANKS:
        return f"the CUDA transport's team holds at most {MAX_RANKS} ranks, not {spec.dim('ranks')}"
    if dict(spec.dims).get("experts", 0) > MAX_EXPERTS:
        return f"the CUDA transport publishes at most {MAX_EXPERTS} counts a rank, not {spec.dim('experts')} experts"
    if spec.dim("topk") > MAX_TOPK:
        return f"the CUDA gather holds a token's pairs in registers: top-k at most {MAX_TOPK}, not {spec.dim('topk')}"
    if (
        spec.dim("ranks") * spec.dim("capacity") > MAX_ROWS
        or spec.dim("tokens") * spec.dim("topk") > MAX_ROWS
    ):
        return "the CUDA transport numbers rows and pairs in int32"
    return native.unavailable("moe_ep")


# -- one FFI call with the mesh it was lowered for ------------------------------------------------

_call = Primitive("axkern_moe_ep_call")
_call.multiple_results = True


def _abstract(*args, target, outs, axis_name, attrs):
    return compat.ffi_result_avals(target, args, outs)


def _lowering(ctx, *args, target, outs, axis_name, attrs):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    devices = getattr(mesh, "devices", None)
    if devices is None or axis_name not in mesh.axis_names:
        raise ValueError(
            f"{target}: the CUDA transport runs inside shard_map over a mesh of devices with the axis "
            f"{axis_name!r} (one mesh axis name)"
        )
    devices = np.asarray(devices)
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True)
    return rule(
        ctx,
        *args,
        mesh_ordinals=np.array([d.local_hardware_id for d in devices.flat], np.int64),
        mesh_shape=np.array(devices.shape, np.int64),
        axis=np.int64(list(mesh.axis_names).index(axis_name)),
        **dict(attrs),
    )


def _no_batching(args, dims, *, target, **_):
    raise ValueError(f"{target}: the CUDA transport does not run under vmap (call it inside shard_map)")


def _no_eager(*args, target, **_):
    raise ValueError(f"{target}: the CUDA transport runs inside shard_map over a mesh of devices")


_call.def_abstract_eval(_abstract)
_call.def_impl(_no_eager)
batching.primitive_batchers[_call] = _no_batching
mlir.register_lowering(_call, _lowering, platform="cuda")


def _ffi(target, outs, axis_name, *args, **attrs):
    outs = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs)
    attrs = tuple(sorted((k, np.int64(v)) for k, v in attrs.items()))
    args = compat.vary_like(args, *args)  # every operand varies over the same manual axes
    return _call.bind(*args, target=target, outs=outs, axis_name=axis_name, attrs=attrs)


def _gather_sum(y, order, w, dst, slot, sent, tokens, axis_name, capacity):
    """`out [T, D]`: each token's sent pairs' rows from their holders, weighted and summed."""
    outs = (jax.ShapeDtypeStruct((tokens, y.shape[1]), y.dtype), jax.ShapeDtypeStruct(order.shape, jnp.int32))
    out, _ = _ffi("AxkernEpGatherSum", outs, axis_name, y, order, w, dst, slot, sent, capacity=capacity)
    return out


# -- dispatch ------------------------------------------------------------------------------------


def _within(key, counts):
    """Each pair's place among the pairs of the same `key` before it (stable by pair); `counts`
    the pairs of each key."""
    order = jnp.argsort(key, stable=True)
    starts = jnp.cumsum(counts) - counts
    place = jnp.arange(key.shape[0], dtype=jnp.int32) - starts[key[order]]
    return jnp.zeros_like(key).at[order].set(place)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _dispatch_rows(x, dst, slot, sent, expert, within, counts, axis_name, ranks, capacity):
    outs = (
        jax.ShapeDtypeStruct((ranks * capacity, x.shape[1]), x.dtype),
        jax.ShapeDtypeStruct((ranks * capacity,), jnp.int32),
        jax.ShapeDtypeStruct((counts.shape[0] // ranks,), jnp.int32),
    )
    args = (x, dst, slot, sent, expert, within, counts)
    expert_x, order, group_sizes = _ffi("AxkernEpDispatch", outs, axis_name, *args, capacity=capacity)
    return expert_x, order, group_sizes


def _dispatch_rows_fwd(x, dst, slot, sent, expert, within, counts, axis_name, ranks, capacity):
    out = _dispatch_rows(x, dst, slot, sent, expert, within, counts, axis_name, ranks, capacity)
    return out, (out[1], dst, slot, sent, x.shape[0])


def _dispatch_rows_bwd(axis_name, ranks, capacity, res, g):
    order, dst, slot, sent, tokens = res
    ones = jnp.ones(dst.shape, jnp.float32)
    dx = _gather_sum(g[0], order, ones, dst, slot, sent, tokens, axis_name, capacity)
    return (dx, None, None, None, None, None, None)


_dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


def dispatch(x, topk_idx, *, num_experts, axis_name, ranks, capacity):
    """`(expert_x [R·C, D], group_sizes [E/R], order [R·C], dst, slot, sent, dropped)`, as `xla`'s."""
    tokens, topk = topk_idx.shape
    local = num_experts // ranks
    x, topk_idx = compat.match_vma(x, topk_idx)  # a replicated x's gradient: the cast's psum
    dst, slot, sent, expert, valid = common.slots(topk_idx, num_experts, ranks, capacity)
    key = jnp.where(sent, dst * local + expert, num_experts)  # (destination, local expert); unsent last
    counts = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)
    within = _within(key, counts)
    expert_x, order, group_sizes = _dispatch_rows(
        x,
        dst,
        slot,
        sent,
        jnp.where(sent, expert, 0),
        within,
        counts[:num_experts],
        axis_name,
        ranks,
        capacity,
    )
    dropped = jnp.sum(valid & ~sent) + jnp.sum(~valid)
    shape = (tokens, topk)
    return expert_x, group_sizes, order, dst.reshape(shape), slot.reshape(shape), sent.reshape(shape), dropped


# -- combine -------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _combine(expert_y, w, order, dst, slot, sent, axis_name, ranks, capacity):
    return _gather_sum(expert_y, order, w, dst, slot, sent, w.shape[0], axis_name, capacity)


def _combine_fwd(expert_y, w, order, dst, slot, sent, axis_name, ranks, capacity):
    y = _combine(expert_y, w, order, dst, slot, sent, axis_name, ranks, capacity)
    return y, (expert_y, w, order, dst, slot, sent)


def _combine_bwd(axis_name, ranks, capacity, res, dy):
    expert_y, w, order, dst, slot, sent = res
    sends = jnp.zeros((ranks + 1,), jnp.int32).at[jnp.where(sent, dst, ranks)].add(1)[:ranks]
    outs = (
        jax.ShapeDtypeStruct(expert_y.shape, expert_y.dtype),
        jax.ShapeDtypeStruct(w.shape, jnp.float32),
        jax.ShapeDtypeStruct(order.shape, jnp.int32),
    )
    args = (dy.astype(expert_y.dtype), expert_y, order, w, dst, slot, sent, sends)
    d_y, dw, _ = _ffi("AxkernEpCombineBwd", outs, axis_name, *args, capacity=capacity)
    return (d_y, dw, None, None, None, None)


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(expert_y, topk_weights, order, dst, slot, sent, *, axis_name, ranks, capacity):
    """`y [T, D']`: each sent pair's expert output, weighted by `topk_weights`, summed per token."""
    expert_y, topk_weights, order, dst, slot, sent = compat.match_vma(
        expert_y, topk_weights, order, dst, slot, sent
    )
    w = topk_weights.astype(jnp.float32)
    return _combine(expert_y, w, order, dst, slot, sent, axis_name, ranks, capacity)


DISPATCH_IMPLEMENTATION = Implementation(
    "cuda",
    dispatch,
    platforms=("gpu",),
    supports=supports,
    why_platforms=WHY_PLATFORMS,
    backward="its own: a combine-like pass of the CUDA transport",
)
COMBINE_IMPLEMENTATION = Implementation(
    "cuda",
    combine,
    platforms=("gpu",),
    supports=supports,
    why_platforms=WHY_PLATFORMS,
    backward="its own: a dispatch-like pass of the CUDA transport",
)
