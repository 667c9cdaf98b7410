"""ssd `mosaic_gpu`: its state and scan kernels and their backward kernels lower for CUDA (they
have no CPU interpret mode: they run in tests/gpu), their arithmetic (`emulate_chunk_state`,
`emulate_chunk_scan` and their `_bwd`: the kernels' 16-bit roundings, exact products)
carried through the whole layer holds the oracle rule for the output, the final state
and every gradient, and the dispatcher skips it off Hopper with the reason."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern.ops.chunked import kernel_scan
from axkern.ops.chunked import mosaic_gpu as engine
from axkern.ops.chunked.mosaic_gpu import forward as mosaic_forward
from axkern.ops.chunked.mosaic_gpu import sizes, tiles
from axkern.ops.chunked.mosaic_gpu.forward_lean import lean_forward_tiles
from axkern.ops.ssd import OP, SSDBlockSizes, mosaic_gpu
from axkern.ops.ssd.api import prepared_dt
from tests.cases.ssd import make, run
from tests.gpu_lowering import lower_for_cuda
from tests.harness import check_rule, jit
from tests.helpers import equations

needs_mosaic = pytest.mark.skipif(
    engine.IMPORT_ERROR is not None, reason=f"Pallas Mosaic GPU: {engine.IMPORT_ERROR}"
)


def _kernel_args(kernel, b, h, g, chunks, p, n):
    """Shapes of one Mosaic kernel's arguments (bf16 rows, float32 vectors and states)."""
    length, f32, bf16, S = chunks * engine.CHUNK, jnp.float32, jnp.bfloat16, jax.ShapeDtypeStruct
    x, vector, bc = S((b, h, length, p), bf16), S((b, h, length), f32), S((b, g, length, n), bf16)
    states, dy = S((b, chunks, h, p, n), f32), S((b, h, length, p), f32)
    if kernel == "fused_forward":  # x, w, dt, cum, f, keep, seg, B, C, the initial state
        seg, keep = S((b, length), jnp.int32), S((b, h, chunks), f32)
        return (x, vector, vector, vector, vector, keep, seg, bc, bc, S((b, h, p, n), f32))
    if kernel in ("chunk_state", "chunk_state_bwd"):
        return (x, vector, bc) + ((states,) if kernel == "chunk_state_bwd" else ())
    scan = (x, vector, vector, vector, S((b, length), jnp.int32), bc, bc, states)
    return scan if kernel == "chunk_scan" else (dy, *scan)


def _kernels(text):
    return len(re.findall(r"stablehlo.custom_call @mosaic_gpu", text))


@needs_mosaic
@pytest.mark.parametrize(
    "kernel", ["chunk_state", "chunk_scan", "chunk_state_bwd", "chunk_scan_bwd", "fused_forward"]
)
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 128, 64), (1, 2, 2, 1, 64, 64)])
def test_each_kernel_lowers_for_cuda(kernel, dims):
    # batch, heads, groups, chunks, head dim, state: the sizes the kernels serve
    fn = getattr(engine, kernel)
    text = lower_for_cuda(fn, *_kernel_args(kernel, *dims)).as_text()
    assert _kernels(text) == 1


@needs_mosaic
@pytest.mark.parametrize("chunk", [128, 256])
@pytest.mark.parametrize(
    "kernel", ["chunk_state", "chunk_scan", "chunk_state_bwd", "chunk_scan_bwd", "fused_forward"]
)
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 128, 64), (1, 2, 2, 1, 64, 64)])
def test_the_kernels_lower_at_larger_chunks(kernel, chunk, dims):
    # chunks of 128 and 256 positions (the scan, its backward and the fused forward by tiles of 64
    # rows, the state backward by blocks of 64 rows): one kernel, the chunk's states `[b, L /
    # chunk, h, P, N]`; a kernel whose tiles would exceed shared memory is refused with the sizes
    # (the scan's, its backward's and the fused forward's at 256 but at P and N 64)
    b, h, g, c, p, n = dims
    args = list(_kernel_args(kernel, b, h, g, c * chunk // engine.CHUNK, p, n))
    states = jax.ShapeDtypeStruct((b, c, h, p, n), jnp.float32)
    if kernel == "fused_forward":  # a carry per chunk
        args[5] = jax.ShapeDtypeStruct((b, h, c), jnp.float32)
    elif kernel != "chunk_state":
        args[{"chunk_state_bwd": 3, "chunk_scan": 7, "chunk_scan_bwd": 8}[kernel]] = states
    fn = functools.partial(getattr(engine, kernel), chunk=chunk)
    too_big = kernel in ("chunk_scan", "chunk_scan_bwd", "fused_forward") and chunk == 256 and max(p, n) > 64
    if too_big:
        with pytest.raises(axkern.Unsupported, match=f"chunk={chunk}.*shared memory"):
            jax.eval_shape(fn, *args)
        return
    outs = jax.eval_shape(fn, *args)
    if kernel == "chunk_state":
        assert outs.shape == states.shape
    if kernel in ("chunk_scan_bwd", "fused_forward"):
        assert outs[{"chunk_scan_bwd": 7, "fused_forward": 2}[kernel]].shape == states.shape  # dS_in, S_in
    text = lower_for_cuda(fn, *args).as_text()
    assert _kernels(text) == 1


@needs_mosaic
def test_a_chunk_not_a_multiple_of_64_is_refused():
    args = _kernel_args("chunk_state", 1, 2, 1, 3, 64, 64)
    with pytest.raises(ValueError, match="chunk=96"):
        engine.chunk_state(*args, chunk=96)


@needs_mosaic
@pytest.mark.parametrize("group_sums", [False, True])
@pytest.mark.parametrize("positions_first", [False, True])
@pytest.mark.parametrize("dx_dtype", ["bfloat16", "float32"])
def test_the_state_backward_kernel_adds_the_scans_dx(group_sums, positions_first, dx_dtype):
    # dx_in (x's layout; bf16 as the chunk-scan backward writes it, or float32) added in the
    # kernel, dx out in dx_in's dtype over dx_in's buffer (aliased); under vmap too
    b, h, g, chunks, p, n = 2, 4, 2, 3, 64, 128
    xt, w, bt, d_own = _kernel_args("chunk_state_bwd", b, h, g, chunks, p, n)
    if positions_first:
        xt = jax.ShapeDtypeStruct((b, chunks * engine.CHUNK, h, p), xt.dtype)
    dx_in = jax.ShapeDtypeStruct(xt.shape, jnp.dtype(dx_dtype))
    kw = dict(group_sums=group_sums, positions_first=positions_first)
    fn = lambda *a: engine.chunk_state_bwd(*a, **kw)  # noqa: E731
    dx, dw, db = jax.eval_shape(fn, xt, w, bt, d_own, dx_in)
    assert (dx.shape, dx.dtype, dw.dtype) == (xt.shape, dx_in.dtype, jnp.float32)
    assert jax.eval_shape(fn, xt, w, bt, d_own)[0].dtype == jnp.float32
    with pytest.raises(ValueError, match="dx_in is float16"):
        fn(xt, w, bt, d_own, jax.ShapeDtypeStruct(xt.shape, jnp.float16))
    text = lower_for_cuda(fn, xt, w, bt, d_own, dx_in).as_text()
    assert _kernels(text) == 1
    # dx (and dB with the group sums) written over its input's buffer; dw allocated
    assert text.count("stablehlo.output_operand_alias<") == 3
    assert text.count("@AllocateBuffer") == 2 - group_sums
    stacked = [jax.ShapeDtypeStruct((3, *a.shape), a.dtype) for a in (xt, w, bt, d_own, dx_in)]
    text = lower_for_cuda(jax.vmap(fn), *stacked).as_text()
    assert _kernels(text) == 1


@needs_mosaic
@pytest.mark.parametrize("group_sums", [False, True])
@pytest.mark.parametrize("chunk", [64, 128])
@pytest.mark.parametrize("dy_dtype", ["bfloat16", "float32"])
def test_the_scan_backward_writes_dx_over_a_16_bit_cotangent(group_sums, chunk, dy_dtype):
    # a bf16 dy has dx's type: the kernel's dx output is dy's buffer (aliased, `tiles.launch`'s
    # `over`), so the two are one array in memory; a float32 dy gets dx a buffer of its own. The
    # kernel's eight outputs are buffers it allocates but those aliased (dx; dB, dC with the
    # group sums, into zeros)
    args = list(_kernel_args("chunk_scan_bwd", 2, 4, 2, 2, 64, 128))
    args[0] = jax.ShapeDtypeStruct(args[0].shape, jnp.dtype(dy_dtype))
    fn = lambda *a: engine.chunk_scan_bwd(*a, group_sums=group_sums, chunk=chunk)  # noqa: E731
    text = lower_for_cuda(fn, *args).as_text()
    assert _kernels(text) == 1
    aliased = (dy_dtype == "bfloat16") + 2 * group_sums
    assert text.count("@AllocateBuffer") == (8 - aliased if aliased else 0)
    assert (text.count("stablehlo.output_operand_alias<") > 0) == bool(aliased)
    # under vmap (the mapped axis folded into the batch where outputs are written in place)
    stacked = [jax.ShapeDtypeStruct((3, *a.shape), a.dtype) for a in args]
    assert _kernels(lower_for_cuda(jax.vmap(fn), *stacked).as_text()) == 1


@needs_mosaic
@pytest.mark.parametrize("kernel", ["chunk_state_bwd", "chunk_scan_bwd"])
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 128, 64)])
def test_the_backward_kernels_lower_with_group_sums(kernel, dims):
    # dB (and dC) added into each group's rows: the outputs are [b, g, L, N], the buffers of the
    # zeros passed in; every output is a buffer the kernel writes in place (aliased), the others
    # allocated uninitialised
    fn = functools.partial(getattr(engine, kernel), group_sums=True)
    args = _kernel_args(kernel, *dims)
    b, h, g, chunks, p, n = dims
    outs = jax.eval_shape(fn, *args)
    assert outs[2 if kernel == "chunk_state_bwd" else 5].shape == (b, g, chunks * engine.CHUNK, n)
    text = lower_for_cuda(fn, *args).as_text()
    assert _kernels(text) == 1
    added = 1 if kernel == "chunk_state_bwd" else 2
    assert text.count("stablehlo.output_operand_alias<") == len(outs)
    assert text.count("@AllocateBuffer") == len(outs) - added


@needs_mosaic
@pytest.mark.parametrize(
    "kernel", ["chunk_state", "chunk_scan", "chunk_state_bwd", "chunk_scan_bwd", "fused_forward"]
)
def test_each_kernel_lowers_with_positions_first(kernel):
    # x (dy, y, dx) as [b, L, h, P]: the outputs in that layout, the same one kernel
    b, h, g, chunks, p, n = 2, 4, 2, 3, 64, 128
    args = list(_kernel_args(kernel, b, h, g, chunks, p, n))
    i = 1 if kernel == "chunk_scan_bwd" else 0  # x; dy before it in the scan's backward
    swap = lambda a: jax.ShapeDtypeStruct((a.shape[0], a.shape[2], a.shape[1], a.shape[3]), a.dtype)  # noqa: E731
    args[i] = swap(args[i])
    if kernel == "chunk_scan_bwd":
        args[0] = swap(args[0])
    fn = functools.partial(getattr(engine, kernel), positions_first=True)
    outs = jax.eval_shape(fn, *args)
    rows = (b, chunks * engine.CHUNK, h, p)
    if kernel in ("chunk_scan", "fused_forward", "chunk_state_bwd", "chunk_scan_bwd"):
        assert (outs if kernel == "chunk_scan" else outs[0]).shape == rows
    text = lower_for_cuda(fn, *args).as_text()
    assert _kernels(text) == 1


@needs_mosaic
@pytest.mark.parametrize(
    # every pair of the three choices' values (the whole product lowers alike: 8 forms of 4 s)
    "forward,group_sums,backward,scan_backward",
    [
        ("stages", None, None, None),
        ("stages", "kernels", "lean", None),
        ("fused", None, "lean", "lean"),
        ("fused", "kernels", None, None),
        ("fused", "kernels", None, "lean"),
        ("lean", None, None, "lean"),
        ("lean", "kernels", "lean", None),
        ("lean", None, "lean", None),
        ("lean", "kernels", "columns", None),
        ("lean", "scores", None, "lean"),
    ],
)
def test_the_layer_lowers_in_every_form(forward, group_sums, backward, scan_backward):
    # with x, y transposed by the kernels, XLA's graph has fewer transposes (the moves of x in
    # and of y out, forward and backward); the forward's Mosaic kernels (three stages: the chunk
    # state and scan, the recurrence being Triton's; or the fused one) and the backward's (chunk
    # state and scan), once each: the non-finite guard's conditional forms masks only
    arrays, seg = make(0, 1, 200, 4, 64, 2, 128, "bfloat16")

    def text(transposes):
        def f(a):
            dt = prepared_dt(a["dt"], a["dt_bias"], True, None)
            blocks = SSDBlockSizes(64, forward, group_sums, transposes, backward, scan_backward)
            y, final = mosaic_gpu.ssd(
                a["x"], dt, a["A"], a["B"], a["C"], a["D"], a["z"], seg, a["initial_state"], block_sizes=blocks
            )  # fmt: skip
            return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

        return lower_for_cuda(jax.grad(f), arrays).as_text()

    plain, moved = text(None), text("kernels")
    assert _kernels(plain) == _kernels(moved) == (4 if forward == "stages" else 3)

    assert moved.count("stablehlo.transpose") < plain.count("stablehlo.transpose")
    # the fused state backward takes the place of the reverse recurrence's Triton kernel
    assert ("axkern_ssd_gpu_recurrence_bwd" in plain) == (backward is None)
    if group_sums is None:  # (the kernels' names show where no output is added into)
        assert ("axkern_ssd_mosaic_gpu_scan_bwd_lean" in plain) == (scan_backward == "lean")
        assert ("axkern_ssd_mosaic_gpu_state_bwd_fused_lean" in plain) == (backward == "lean")
    assert ("axkern_ssd_mosaic_gpu_forward_lean" in plain) == (forward == "lean")


LEAN_WHOLE = ("scan_bwd_lean", "scan_bwd")


@needs_mosaic
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 128, 64), (1, 2, 2, 1, 64, 64)])
@pytest.mark.parametrize("states", [False, True])
def test_the_lean_forward_lowers_in_less_shared_memory(dims, states):
    # one kernel with the fused forward's outputs; its tiles 99 KiB at P 64, N 128 with bf16 y
    # (91 with float32 y, sharing the state's staging tile) where the fused one's take 155 (163):
    # two blocks an SM at the three sizes (at P and N 64 the fused one's two as well); refused
    # with float32 B, C
    args = _kernel_args("fused_forward", *dims)
    fn = functools.partial(engine.fused_forward, states=states, y_dtype=jnp.bfloat16)
    fused, lean = (jax.eval_shape(functools.partial(fn, lean=v), *args) for v in (False, True))
    assert fused == lean
    text = lower_for_cuda(functools.partial(fn, lean=True), *args).as_text()
    assert _kernels(text) == 1 and "axkern_ssd_mosaic_gpu_forward_lean" in text
    p, n = dims[-2:]
    for y_dtype in (jnp.bfloat16, jnp.float32):
        lean_bytes = tiles.tile_bytes(lean_forward_tiles(p, n, y_dtype=y_dtype))
        fused_bytes = tiles.tile_bytes(mosaic_forward._tiles(p, n, y_dtype=y_dtype))
        assert lean_bytes < fused_bytes
        assert (2 * (fused_bytes + 1024) > 228 * 1024) == ((p, n) != (64, 64))  # the fused one's one block
        assert engine.lean_forward_shares_an_sm(p, n, y_dtype)
    wide = list(args)
    wide[7] = jax.ShapeDtypeStruct(args[7].shape, jnp.float32)
    with pytest.raises(axkern.Unsupported, match="lean fused forward: B and C as float32 halves"):
        jax.eval_shape(functools.partial(fn, lean=True), *wide)


@needs_mosaic
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 128, 64), (1, 2, 2, 1, 64, 64)])
@pytest.mark.parametrize("group_sums", [False, True])
def test_the_lean_scan_backward_lowers_in_less_shared_memory(dims, group_sums):
    # one kernel, the same outputs as the whole kernel's; its tiles 108 KiB at P 64, N 128 (two
    # blocks an SM) where the whole kernel's take 188; refused with float32 B, C (their halves)
    # and at P 128 (the state's low half kept in M's 64 x 64 tiles)
    args = _kernel_args("chunk_scan_bwd", *dims)
    if dims[4] != 64:
        with pytest.raises(ValueError, match="lean: head_dim=128"):
            jax.eval_shape(functools.partial(engine.chunk_scan_bwd, group_sums=group_sums, lean=True), *args)
        assert not engine.lean_shares_an_sm(*dims[4:])
        return
    fn = functools.partial(engine.chunk_scan_bwd, group_sums=group_sums)
    whole, lean = (jax.eval_shape(functools.partial(fn, lean=v), *args) for v in (False, True))
    assert whole == lean
    text = lower_for_cuda(functools.partial(fn, lean=True), *args).as_text()
    assert _kernels(text) == 1
    # (the kernel's name shows in the text where no output is added into: `plgpu.kernel`)
    assert group_sums or "axkern_ssd_mosaic_gpu_scan_bwd_lean" in text
    p, n = dims[-2:]
    lean_bytes, whole_bytes = (tiles.tile_bytes(sizes.kernel_tiles(k, p, n)) for k in LEAN_WHOLE)
    assert lean_bytes < whole_bytes
    # two blocks in an H200 SM's 228 KiB (each with 1 KiB the system keeps; P 64 here); one
    # block of the whole kernel
    assert (2 * (lean_bytes + 1024) <= 228 * 1024) == (p == 64) == engine.lean_shares_an_sm(p, n)
    assert 2 * (whole_bytes + 1024) > 228 * 1024
    assert (p, n) != (64, 128) or (lean_bytes, whole_bytes) == (108 * 1024, 180 * 1024)
    wide = list(args)
    wide[6] = jax.ShapeDtypeStruct(args[6].shape, jnp.float32)
    with pytest.raises(ValueError, match="lean: B and C as float32 halves"):
        jax.eval_shape(functools.partial(fn, lean=True), *wide)


@needs_mosaic
@pytest.mark.parametrize(
    # the three stages and the fused forward at each chunk, the group sums by XLA or the kernels
    "chunk, state, forward, group_sums",
    [
        (128, 128, "stages", None),
        (128, 128, "fused", "kernels"),
        (256, 64, "stages", "kernels"),
        (256, 64, "fused", "kernels"),
    ],
)
def test_the_layer_lowers_at_larger_chunks(chunk, state, forward, group_sums):
    # the forward (three stages, or fused) and the backward's kernels at chunks of 128 and 256
    # through the layer (a length not a multiple of the chunk, groups, the caller's layout): the
    # same kernels as at 64, the recurrence's Triton kernels over half or a quarter of the chunks
    arrays, seg = make(0, 1, 300, 4, 64, 2, state, "bfloat16")

    def f(a):
        dt = prepared_dt(a["dt"], a["dt_bias"], True, None)
        blocks = SSDBlockSizes(chunk, forward, group_sums, "kernels")
        y, final = mosaic_gpu.ssd(
            a["x"], dt, a["A"], a["B"], a["C"], a["D"], a["z"], seg, a["initial_state"], block_sizes=blocks
        )  # fmt: skip
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

    text = lower_for_cuda(jax.grad(f), arrays).as_text()
    assert _kernels(text) == (4 if forward == "stages" else 3)
    assert "axkern_ssd_gpu_recurrence_bwd" in text


@needs_mosaic
@pytest.mark.parametrize("form", ["lean", "columns"])
@pytest.mark.parametrize("group_sums", [False, True])
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 128, 64), (1, 2, 2, 1, 64, 64)])
def test_the_fused_state_backward_lowers(dims, group_sums, form):
    # the reverse recurrence and the chunk states' backward as one kernel: dx, dw, dB (per head
    # or per group), d keep [b, h, c], the initial state's gradient; in one slot of B and one
    # staging tile, two blocks an SM; over the state's columns, a block per 64 of them adding its
    # parts of dx (onto a given one) and dw
    b, h, g, chunks, p, n = dims
    columns = n // 64 if form == "columns" else 1
    x, w, bt, states = _kernel_args("chunk_state_bwd", *dims)
    keep = jax.ShapeDtypeStruct((b, h, chunks), jnp.float32)
    final = jax.ShapeDtypeStruct((b, h, p, n), jnp.float32)
    dx_in = jax.ShapeDtypeStruct((b, h, chunks * 64, p), jnp.float32)
    args = (x, w, bt, keep, states, states, final, dx_in)
    fn = functools.partial(engine.fused_state_bwd, group_sums=group_sums, columns=columns)
    shapes = [o.shape for o in jax.eval_shape(fn, *args)]
    length = chunks * engine.CHUNK
    db = (b, g if group_sums else h, length, n)
    assert shapes == [(b, h, length, p), (b, h, length), db, (b, h, chunks), (b, h, p, n)]
    text = lower_for_cuda(fn, *args).as_text()
    assert _kernels(text) == 1
    if not group_sums and columns == 1:  # (the kernels' names show where no output is added into)
        assert "axkern_ssd_mosaic_gpu_state_bwd_fused_lean" in text
    assert engine.fused_state_bwd_smem_bytes(p, n, columns) <= 227 * 1024
    assert engine.lean_state_bwd_shares_an_sm(p, n, columns)


@needs_mosaic
@pytest.mark.parametrize(
    "group_sums,transposes,backward,scan_backward,gated",
    [
        (None, None, None, None, True),
        ("kernels", None, None, None, True),
        ("kernels", "kernels", "lean", None, True),
        (None, None, "columns", None, True),  # (dx, dw added into: folded too)
        ("scores", "kernels", "lean", "lean", True),
        # without D and the gate the cotangent is bf16 and dx written over it: folded too
        (None, None, None, None, False),
        (None, "kernels", None, None, False),
    ],
)
def test_the_layer_lowers_under_vmap(group_sums, transposes, backward, scan_backward, gated):
    # the group sums' pallas_call has no batching rule in Mosaic GPU: the mapped axis is folded
    # into the kernels' batch axis (plgpu.kernel batches by itself)
    arrays, seg = make(0, 1, 128, 4, 64, 2, 128, "bfloat16")
    blocks = SSDBlockSizes(64, "fused", group_sums, transposes, backward, scan_backward)

    def f(a):
        dt = prepared_dt(a["dt"], a["dt_bias"], True, None)
        D, z = (a["D"], a["z"]) if gated else (None, None)
        y, final = mosaic_gpu.ssd(
            a["x"], dt, a["A"], a["B"], a["C"], D, z, seg, a["initial_state"], block_sizes=blocks
        )  # fmt: skip
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

    stacked = jax.tree.map(lambda v: jnp.stack([v, v, v]), arrays)
    text = lower_for_cuda(jax.vmap(jax.grad(f)), stacked).as_text()
    assert _kernels(text) == 3


@needs_mosaic
@pytest.mark.parametrize("forward", ["stages", "fused"])
def test_without_d_and_the_gate_y_leaves_the_kernels_in_the_input_dtype(forward):
    # one rounding of the float32 result either way: the kernels write y in bf16 (no float32 y
    # for XLA to round) and the backward kernel reads the bf16 cotangent as it comes (no float32
    # copy); the state backward's kernel adds the scan backward's float32 dx to its own and
    # writes dx in bf16
    arrays, seg = make(0, 1, 256, 4, 64, 2, 128, "bfloat16", extras=False)
    blocks = SSDBlockSizes(64, forward=forward, group_sums="kernels", transposes="kernels")

    def y(a):
        dt = prepared_dt(a["dt"], None, True, None)
        s0 = jnp.zeros((1, 4, 64, 128), jnp.float32)
        args = (a["x"], dt, a["A"], a["B"], a["C"], None, None, seg, s0)
        return mosaic_gpu.ssd(*args, block_sizes=blocks)[0]

    def converts(fn, src, dst):
        text = lower_for_cuda(fn, arrays).as_text()
        return len(
            re.findall(
                rf"stablehlo.convert %\S+ : \(tensor<1x256x4x64x{src}>\) -> tensor<1x256x4x64x{dst}>", text
            )
        )

    assert jax.eval_shape(y, arrays).dtype == jnp.bfloat16
    assert converts(y, "f32", "bf16") == 0
    # the loss's own: y up, its cotangent down; and, where the forward is the three stages,
    # XLA's read of x to check it (a walking forward kernel reports what it read instead)
    grad = jax.grad(lambda a: jnp.sum(y(a).astype(jnp.float32) ** 2))
    assert converts(grad, "bf16", "f32") == (2 if forward == "stages" else 1)
    assert converts(grad, "f32", "bf16") == 1


@needs_mosaic
def test_the_forward_alone_writes_no_entering_states():
    # the states entering the chunks are the backward's residual: with nothing to differentiate
    # the fused kernel does not write them
    arrays, seg = make(0, 1, 320, 4, 64, 2, 128, "bfloat16", extras=False)
    blocks = SSDBlockSizes(64, forward="fused", group_sums="kernels", transposes="kernels")
    states = "tensor<1x5x4x64x128xf32>"  # batch, chunks, heads, P, N

    def y(a):
        dt = prepared_dt(a["dt"], None, True, None)
        s0 = jnp.zeros((1, 4, 64, 128), jnp.float32)
        args = (a["x"], dt, a["A"], a["B"], a["C"], None, None, seg, s0)
        return mosaic_gpu.ssd(*args, block_sizes=blocks)[0]

    def text(fn):
        return lower_for_cuda(fn, arrays).as_text()

    forward = text(y)
    grad = text(jax.grad(lambda a: jnp.sum(y(a).astype(jnp.float32))))
    assert _kernels(forward) == 1 and states not in forward
    assert states in grad


@needs_mosaic
def test_the_guards_conditional_forms_masks_only():
    # the scan runs outside the non-finite guard's conditional, on x as it came (its kernels take
    # x's non-finite values as 0): the conditional's outputs are masks (bits and booleans), no
    # kernel runs inside it, and nothing x-sized is formed from x for the scan
    arrays, seg = make(0, 1, 256, 4, 64, 2, 128, "bfloat16", extras=False)
    blocks = SSDBlockSizes(64, forward="fused", group_sums="kernels", transposes="kernels")

    def y(x):
        dt = prepared_dt(arrays["dt"], None, True, None)
        s0 = jnp.zeros((1, 4, 64, 128), jnp.float32)
        args = (x, dt, arrays["A"], arrays["B"], arrays["C"], None, None, seg, s0)
        return mosaic_gpu.ssd(*args, block_sizes=blocks)[0]

    x = arrays["x"]
    jaxpr = jax.make_jaxpr(lambda x: jax.vjp(y, x))(x).jaxpr
    every = list(equations(jaxpr, into_conds=False))
    masks = jnp.dtype(jnp.uint8)
    (cond,) = [e for e in every if e.primitive.name == "cond" and masks in {v.aval.dtype for v in e.outvars}]
    assert {jnp.dtype(v.aval.dtype) for v in cond.outvars} <= {masks, jnp.dtype(bool)}
    kernels = ("mpmd_map", "pallas_call")  # (a Mosaic GPU kernel's primitive; the Triton recurrence's)
    assert any(e.primitive.name in kernels for e in every)
    for branch in cond.params["branches"]:
        assert not [e for e in equations(branch.jaxpr) if e.primitive.name in kernels]
    # no cleaned copy of x: the one select into an array of x's shape and dtype puts y's NaN
    x_like = (x.shape, jnp.dtype(x.dtype))
    formed = [e for e in every if e.primitive.name == "select_n"]
    assert len([e for e in formed if (e.outvars[0].aval.shape, e.outvars[0].aval.dtype) == x_like]) == 1


@functools.cache
def _emulated_runner(names, chunk=engine.CHUNK, layout=engine.EmulatedLayout, call=None):
    """The layer's outputs and every gradient of a loss of them (jitted `(arrays, seg)`), through
    `layout`'s kernels, or `call(args)` where given (`ssd`'s positional arguments). One jitted
    function per arguments: the cases of the same shapes compile it once."""

    def f(seg, *vals):
        a = dict(zip(names, vals, strict=True))
        dt = prepared_dt(a["dt"], a.get("dt_bias"), True, None)
        s0 = a.get("initial_state")
        if s0 is None:
            s0 = jnp.zeros(
                (*a["x"].shape[:1], a["x"].shape[2], a["x"].shape[3], a["B"].shape[3]), jnp.float32
            )
        args = (a["x"], dt, a["A"], a["B"], a["C"], a.get("D"), a.get("z"), seg, s0)
        if call is not None:
            y, final = call(args)
        else:
            y, final = kernel_scan.ssd(layout, *args, chunk_size=chunk, interpret=True)
        cot = jnp.round(64 * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))) / 64
        return jnp.sum(y.astype(jnp.float32) * cot) + jnp.sum(jnp.sin(final.astype(jnp.float32))), (y, final)

    def g(arrays, seg):
        (_, out), grads = jax.value_and_grad(f, argnums=tuple(range(1, len(names) + 1)), has_aux=True)(
            seg, *[arrays[k] for k in names]
        )
        return out, grads

    return jit(g)


@pytest.mark.parametrize(
    "dtype, dims, segments, extras, seed",
    [
        ("bfloat16", (1, 150, 4, 64, 2, 64), True, True, 3),  # a length not a multiple of the chunk, groups
        ("bfloat16", (2, 128, 2, 128, 1, 64), False, True, 3),
        ("bfloat16", (1, 192, 2, 64, 1, 64), None, True, 3),  # A / 100: the state carried across chunks
        ("bfloat16", (1, 150, 4, 64, 2, 64), True, False, 3),  # no D, gate: y leaves the scan in bf16
        # 32 chunks at the 2.7B layer's P and N, A / 100: with the state rounded once in C S_inᵀ
        # too (one tile of it in the lean chunk-scan backward's shared memory, not two), d dt_bias
        # reached 1.19x its bound here (`ssd_backward_precision.py --cases long --lean`)
        ("bfloat16", (1, 2048, 2, 64, 1, 128), None, True, 5),
    ],
)
def test_the_kernels_arithmetic_holds_the_oracle_rule_through_the_layer(dtype, dims, segments, extras, seed):
    # y (through D and the silu(z) gate, so dz sees the kernel's rounding), the final state and
    # every gradient (x, dt, A, B, C, D, z, dt_bias, the initial state) against the float64 oracle
    # (the lean chunk-scan backward's arithmetic is the whole kernel's)
    arrays, seg = make(seed, *dims, dtype, segments=bool(segments), extras=extras)
    if segments is None:
        arrays["A"] = arrays["A"] / 100
    names = tuple(sorted(arrays))
    emulated = _emulated_runner(names)

    def runner(name, a, **_):
        if name == "reference":
            return run("reference", a, seg)
        return emulated(a, seg)

    check_rule(runner, "emulated mosaic_gpu", arrays, dtype, "ssd")


class _ScoresLayout(engine.EmulatedLayout):
    group_scores = True


@pytest.mark.parametrize(
    "dims, segments, extras",
    [
        ((1, 150, 4, 64, 2, 64), True, True),  # groups of two heads, segments, a partial chunk
        ((1, 192, 4, 64, 1, 128), None, True),  # one group of four, A / 100
        ((1, 150, 4, 64, 2, 64), True, False),  # no D, gate
    ],
)
def test_the_group_scores_arithmetic_holds_the_oracle_rule_through_the_layer(dims, segments, extras):
    # `group_sums="scores"`: dg summed over each group's heads, dB = Σdgᵀ C and dC's Σdg B by XLA
    # in float32; values and every gradient against the float64 oracle
    arrays, seg = make(3, *dims, "bfloat16", segments=bool(segments), extras=extras)
    if segments is None:
        arrays["A"] = arrays["A"] / 100
    names = tuple(sorted(arrays))
    emulated = _emulated_runner(names, layout=_ScoresLayout)

    def runner(name, a, **_):
        return run("reference", a, seg) if name == "reference" else emulated(a, seg)

    check_rule(runner, "emulated mosaic_gpu (group scores)", arrays, "bfloat16", "ssd")
    # the two layouts' gradients of B and C differ (exact products of the sums against halves of
    # each head's) and agree within bf16's step
    whole, scores = (
        _emulated_runner(names, layout=k)(arrays, seg)[1] for k in (engine.EmulatedLayout, _ScoresLayout)
    )
    for name in ("B", "C"):
        i = names.index(name)
        a, e = (np.asarray(v[i], np.float64) for v in (scores, whole))
        assert 0 < np.abs(a - e).max() <= 2.0**-7 * np.abs(e).max(), name


@pytest.mark.parametrize(
    "chunk, dims, segments, extras",
    [
        # two and a half chunks of 256 (padded), segments, groups: at both chunks
        (128, (1, 600, 4, 64, 2, 64), True, True),
        (256, (1, 600, 4, 64, 2, 64), True, True),
        (256, (1, 512, 2, 64, 1, 64), None, True),  # A / 100: the state carried across chunks
        (128, (1, 600, 2, 64, 1, 64), True, False),  # no D, gate: y leaves the scan in bf16
    ],
)
def test_the_kernels_arithmetic_at_larger_chunks_holds_the_oracle_rule(chunk, dims, segments, extras):
    # the 16-bit operands' roundings (M, dS, dy, w ∘ x as halves; the entering state rounded once)
    # over chunks of 128 and 256 positions: values, final state and every gradient (dA and
    # dt_bias sum the decay's gradient over a whole chunk) against the float64 oracle; what the
    # Mosaic kernels would compute at those chunks, were they tiled to them
    arrays, seg = make(5, *dims, "bfloat16", segments=bool(segments), extras=extras)
    if segments is None:
        arrays["A"] = arrays["A"] / 100
    names = tuple(sorted(arrays))
    emulated = _emulated_runner(names, chunk)

    def runner(name, a, **_):
        if name == "reference":
            return run("reference", a, seg)
        return emulated(a, seg)

    check_rule(runner, f"emulated mosaic_gpu chunk {chunk}", arrays, "bfloat16", "ssd")


def _h200_spec(head_dim, state):
    """A bf16 call's spec as the dispatcher sees it on an H200 (and `spec` on the CPU here)."""
    dims = {"batch": 1, "length": 256, "heads": 4, "head_dim": head_dim, "groups": 1, "state": state}
    spec = OP.spec(dims, "bfloat16", segments=False)
    return spec, dataclasses.replace(
        spec, platform="gpu", device_key="nvidia_h200", device_kind="NVIDIA H200"
    )


def test_dispatch_skips_it_off_hopper_with_the_reason():
    spec, gpu = _h200_spec(64, 128)
    if engine.IMPORT_ERROR is None:
        assert mosaic_gpu.supports(gpu) is None
    assert "Hopper" in mosaic_gpu.supports(
        dataclasses.replace(gpu, device_key="nvidia_a100", device_kind="A100")
    )
    assert "take bf16" in mosaic_gpu.supports(dataclasses.replace(gpu, dtype="float32"))
    assert "fp16's range" in mosaic_gpu.supports(dataclasses.replace(gpu, dtype="float16"))
    assert "shared memory" in mosaic_gpu.supports(_h200_spec(256, 256)[1])
    # the head dims and states that fit: the four kernels' tiles (the scan backward's are the largest)
    sizes = (64, 128, 192, 256)
    fits = {(p, n) for p in sizes for n in sizes if engine.dims_reason(p, n) is None}
    assert fits == {(64, 64), (64, 128), (128, 64)}
    assert "head_dim=32" in mosaic_gpu.supports(_h200_spec(32, 128)[1])
    # first in the GPU order for 16-bit inputs; chunks not a multiple of 64, and the fused state
    # backward above 64, it refuses (the call falls back)
    assert OP.default_order["gpu"](gpu)[0] == "mosaic_gpu"
    with pytest.raises(axkern.Unsupported, match="chunk_size=96"):
        mosaic_gpu.ssd(*[None] * 9, block_sizes=SSDBlockSizes(chunk_size=96))
    for form in ("lean", "columns"):
        with pytest.raises(axkern.Unsupported, match="chunk_size=128: the fused state backward"):
            mosaic_gpu.ssd(*[None] * 9, block_sizes=SSDBlockSizes(chunk_size=128, backward=form))
    assert engine.chunk_reason(64, 128, 128) is None and engine.chunk_reason(64, 64, 256) is None
    # where the three stages' tiles fit at a larger chunk, the fused forward's do too
    for (p, n), q in itertools.product(fits, (128, 256)):
        if engine.chunk_reason(p, n, q) is None:
            assert engine.fused_fits(p, n, chunk=q), (p, n, q)
    assert not engine.fused_fits(64, 128, chunk=256)
    assert engine.chunk_reason(128, 64, 128) is None  # (the scan backward's dx tile in bf16)
    assert "scan kernel's tiles" in engine.chunk_reason(64, 128, 256)
    assert "scan_bwd kernel's tiles" in engine.chunk_reason(64, 128, 256, kinds=("scan_bwd",))
    # the fused forward: mosaic_gpu's tuning space holds it; the others refuse it, and an unknown
    # form is refused by name
    assert SSDBlockSizes(chunk_size=64, forward="fused") in OP.implementations["mosaic_gpu"].space(gpu)
    arrays, _ = make(0, 1, 64, 2, 16, 1, 16, "float32", extras=False)
    for impl in ("xla", "pallas_gpu"):
        with pytest.raises(axkern.Unsupported, match="only mosaic_gpu has a fused forward"):
            axkern.positional.ssd(
                **arrays, implementation=impl, block_sizes=SSDBlockSizes(16, forward="fused")
            )
    assert "forward must be one of" in SSDBlockSizes(64, forward="one").validate(spec)
    # dB and dC summed in the kernels: mosaic_gpu only (the others refuse it by name)
    for impl in ("xla", "pallas_gpu"):
        with pytest.raises(axkern.Unsupported, match="only mosaic_gpu sums dB and dC"):
            axkern.positional.ssd(
                **arrays, implementation=impl, block_sizes=SSDBlockSizes(16, group_sums="kernels")
            )
    assert "group_sums must be one of" in SSDBlockSizes(64, group_sums="atomic").validate(spec)
    assert "backward must be one of" in SSDBlockSizes(64, backward="fused").validate(spec)
    for impl in ("xla", "pallas_gpu"):
        with pytest.raises(axkern.Unsupported, match="only mosaic_gpu has a fused state backward"):
            axkern.positional.ssd(
                **arrays, implementation=impl, block_sizes=SSDBlockSizes(16, backward="lean")
            )
        with pytest.raises(axkern.Unsupported, match="only mosaic_gpu transposes x's tiles in its kernels"):
            axkern.positional.ssd(
                **arrays, implementation=impl, block_sizes=SSDBlockSizes(16, transposes="kernels")
            )
        with pytest.raises(axkern.Unsupported, match="only mosaic_gpu has a lean chunk-scan backward"):
            axkern.positional.ssd(
                **arrays, implementation=impl, block_sizes=SSDBlockSizes(16, scan_backward="lean")
            )
        with pytest.raises(axkern.Unsupported, match="only mosaic_gpu has a lean fused forward"):
            axkern.positional.ssd(
                **arrays, implementation=impl, block_sizes=SSDBlockSizes(16, forward="lean")
            )
    with pytest.raises(axkern.Unsupported, match="forward='lean': chunk_size=128"):
        mosaic_gpu.ssd(*[None] * 9, block_sizes=SSDBlockSizes(chunk_size=128, forward="lean"))
    assert "float32 halves" in engine.lean_forward_reason(2)
    assert "rotations" in engine.lean_forward_reason(1, 64, True)
    # the lean chunk-scan backward: chunks of 64 only, 16-bit B and C, no angles, P 64
    x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(axkern.Unsupported, match="scan_backward='lean': chunk_size=128"):
        mosaic_gpu.ssd(x, *[None] * 8, block_sizes=SSDBlockSizes(chunk_size=128, scan_backward="lean"))
    with pytest.raises(axkern.Unsupported, match="scan_backward='lean': head_dim=128"):
        mosaic_gpu.ssd(
            jnp.zeros((1, 128, 1, 128)), *[None] * 8, block_sizes=SSDBlockSizes(64, scan_backward="lean")
        )
    assert "float32 halves" in engine.lean_reason(2)
    assert "theta" in engine.lean_reason(1, 64, True)
    assert engine.lean_reason(1, 64, False, 64) is None
    assert "state=256" in engine.lean_reason(1, 64, False, 64, 256)
    assert "scan_backward must be one of" in SSDBlockSizes(64, scan_backward="thin").validate(spec)
    assert engine.fused_smem_bytes(128, 64) <= 227 * 1024
    # explain names the kernels of the form chosen
    kernels = OP.implementations["mosaic_gpu"].backward
    assert "chunk-state and chunk-scan kernels" in kernels(gpu, SSDBlockSizes(64, forward="stages"))
    assert "one fused Mosaic GPU kernel" in kernels(gpu, SSDBlockSizes(64, forward="fused"))
    every = kernels(gpu, SSDBlockSizes(64, "fused", "kernels", "kernels", "lean"))
    assert "fused Mosaic GPU kernel for the reverse recurrence" in every and "reverse recurrence" in every
    assert "summed over heads in the kernels" in every and "caller's layout" in every
    assert "pallas_gpu's reverse recurrence" not in every
    assert "chunks of 64;" in every and "chunks of 128, by tiles of 64 rows" in kernels(
        gpu, SSDBlockSizes(128, forward="stages")
    )
    assert "lean chunk-scan backward" in kernels(gpu, SSDBlockSizes(64, scan_backward="lean"))
    assert "lean" not in every
    assert "one slot of tiles" in kernels(gpu, SSDBlockSizes(64, forward="lean"))
    lean_state = kernels(gpu, SSDBlockSizes(64, backward="lean"))
    assert "reverse recurrence and the chunk-state backward in one slot of B" in lean_state
    assert "a block per 64 of the state's columns" in kernels(gpu, SSDBlockSizes(64, backward="columns"))
    assert "dg and dC's (f ∘ dy) S_in summed over heads" in kernels(
        gpu, SSDBlockSizes(64, group_sums="scores", scan_backward="lean")
    )
    with pytest.raises(axkern.Unsupported, match="group_sums='scores': with the lean chunk-scan backward"):
        mosaic_gpu.ssd(x, *[None] * 8, block_sizes=SSDBlockSizes(64, group_sums="scores"))


def test_the_default_form_and_the_deterministic_flags(monkeypatch):
    # the lean fused forward, x, y read and written in place in the kernels; at P 64 the lean
    # chunk-scan backward with dg summed per group, else the whole one with dB and dC summed in
    # the kernels; where XLA_FLAGS asks for run-to-run identical results, the whole one with the
    # sums by XLA
    _, gpu = _h200_spec(64, 128)
    heuristic, space = (getattr(OP.implementations["mosaic_gpu"], k) for k in ("heuristic", "space"))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    whole = SSDBlockSizes(64, forward="fused", group_sums="kernels", transposes="kernels")
    lean_forward = dataclasses.replace(whole, forward="lean")
    default = dataclasses.replace(lean_forward, group_sums="scores", scan_backward="lean")
    assert heuristic(gpu) == default
    forms = space(gpu)
    assert forms[0] == default and len(set(forms)) == len(forms) == 12
    assert SSDBlockSizes(64, forward="stages") in forms
    # the dg sums taken back (dB, dC summed in the kernels), then the lean chunk-scan backward,
    # then the lean forward (the whole kernels' form); the fused state backward with the default
    for form in (dataclasses.replace(default, group_sums="kernels"), lean_forward, whole):
        assert form in forms, form
    for state_backward in ("lean", "columns"):  # (over the state's columns where N > 64)
        assert dataclasses.replace(default, backward=state_backward) in forms
    assert dataclasses.replace(default, backward="columns") not in space(_h200_spec(128, 64)[1])
    assert all(f.group_sums != "scores" or f.scan_backward == "lean" for f in forms)
    # the whole kernels' form and its three stages at chunks of 128 (at P 64, N 128 the scan's
    # tiles at 256 exceed shared memory; the lean kernels run chunks of 64)
    assert forms[-2:] == [dataclasses.replace(whole, chunk_size=128, forward=f) for f in ("fused", "stages")]
    assert all(f.chunk_size == 64 for f in forms if "lean" in (f.forward, f.scan_backward))
    # at P 128 the lean forward with the whole chunk-scan backward (the lean one takes P 64)
    p128 = space(_h200_spec(128, 64)[1])
    assert heuristic(_h200_spec(128, 64)[1]) == lean_forward
    assert whole in p128 and all(f.scan_backward is None for f in p128)
    assert heuristic(_h200_spec(64, 64)[1]) == default
    for flags in (
        "--xla_gpu_deterministic_ops=true",
        "--xla_dump_to=/tmp --xla_gpu_exclude_nondeterministic_ops",
    ):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert heuristic(gpu) == dataclasses.replace(lean_forward, group_sums="xla"), flags
        assert all(f.group_sums not in ("kernels", "scores") for f in space(gpu)), flags
        assert all(f.backward != "columns" for f in space(gpu)), flags  # (its dx, dw sums)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=True")
    assert heuristic(gpu).group_sums == "xla"
    for flags in ("--xla_gpu_deterministic_ops=false", "--xla_gpu_deterministic_ops_x=true"):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert heuristic(gpu) == default, flags


@pytest.mark.parametrize(
    "angles, dtype, group_sums, message",
    [
        (16, jnp.float32, False, "multiple of 32"),
        (96, jnp.float32, False, "at most state/2 = 64"),
        (32, jnp.bfloat16, False, "must be float32"),
        (32, jnp.float32, True, "with group_sums"),
        ((1, 2, 64, 32), jnp.float32, False, r"\[1, 2, 128, A\]"),
    ],
)
def test_the_backward_kernels_refuse_angles_they_cannot_turn_by(angles, dtype, group_sums, message):
    # the angles a rotation turned B and C by (Mamba-3's): whole float32 tiles of the state's
    # first half, per head; refused by name before anything is traced for the GPU
    b, h, length, p, n = 1, 2, 128, 64, 128
    x = jnp.zeros((b, h, length, p), jnp.bfloat16)
    vec = jnp.zeros((b, h, length), jnp.float32)
    bc = jnp.zeros((b, 1, length, n), jnp.float32)
    states = jnp.zeros((b, length // 64, h, p, n), jnp.float32)
    shape = angles if isinstance(angles, tuple) else (b, h, length, angles)
    theta = jnp.zeros(shape, dtype)
    kw = dict(theta=theta, group_sums=group_sums)
    with pytest.raises(ValueError, match=message):
        engine.chunk_scan_bwd(x, x, vec, vec, vec, vec[:, 0], bc, bc, states, **kw)
    with pytest.raises(ValueError, match=message):
        engine.chunk_state_bwd(x, vec, bc, states, **kw)


def _block(a, i, *, t):
    return a[i * t : (i + 1) * t]


def _tile_decay(cum, seg, i, j, *, t):
    """`Λ` of tile `(i, j)`: rows of block `i`, columns of block `j`; causal on the diagonal."""
    vis = _block(seg, i, t=t)[:, None] == _block(seg, j, t=t)[None, :]
    if i == j:
        vis &= jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    diff = _block(cum, i, t=t)[:, None] - _block(cum, j, t=t)[None, :]
    return jnp.exp(jnp.where(vis, diff, -jnp.inf))


def _tiled_mirror(dy, xt, dt, cum, f, seg, bt, ct, states_in, q):
    """`tiled.py`'s forward and two-phase backward in XLA, tile for tile (one chunk of `q`
    positions at a time, tiles of 64, the same 16-bit halves, exact products): `(y, dx, ddt,
    dcum, dcum_row, df, dB, dC, dS_in)` as the emulation gives them. One batch row, head and
    group per call (the test loops)."""
    e = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    bf = jnp.bfloat16

    def halves(a):
        hi = a.astype(bf).astype(jnp.float32)
        return hi, (a - hi).astype(bf).astype(jnp.float32)

    t, f32 = 64, jnp.float32
    x, b, c, dyf = (a.astype(f32) for a in (xt, bt, ct, dy))
    out = {k: [] for k in ("y", "dx", "ddt", "dcum", "dcum_row", "df", "db", "dc", "ds")}
    for k in range(x.shape[0] // q):
        sl = slice(k * q, (k + 1) * q)
        xk, bk, ck, dyk, cumk, dtk, fk, segk = x[sl], b[sl], c[sl], dyf[sl], cum[sl], dt[sl], f[sl], seg[sl]
        s_in = states_in[k]
        blk = functools.partial(_block, t=t)
        decay = functools.partial(_tile_decay, cumk, segk, t=t)

        r = q // t
        s16 = s_in.astype(bf).astype(f32)
        sh, sl_ = halves(s_in)
        ah, al = halves(dyk)
        y, dx, ddt, dcr, dcum, df, db, dc = ([None] * r for _ in range(8))
        for i in range(r):
            yi = blk(fk, i)[:, None] * e("tn,pn->tp", blk(ck, i), s16)
            for j in range(i + 1):
                m = e("tn,sn->ts", blk(ck, i), blk(bk, j)) * decay(i, j) * blk(dtk, j)[None, :]
                mh, ml = halves(m)
                yi = yi + e("ts,sp->tp", mh, blk(xk, j)) + e("ts,sp->tp", ml, blk(xk, j))
            y[i] = yi
        for j in range(r):  # phase C, tiles transposed: rows s (block j), columns t (block i)
            dxd, dbj, dcrj = 0, 0, 0
            for i in range(j, r):
                mt = e("sn,tn->st", blk(bk, j), blk(ck, i)) * decay(i, j).T
                mh, ml = halves(mt)
                dxd = dxd + e("st,tp->sp", mh, blk(ah, i)) + e("st,tp->sp", mh, blk(al, i))
                dxd = dxd + e("st,tp->sp", ml, blk(ah, i))
                dmt = e("sp,tp->st", blk(xk, j), blk(ah, i)) + e("sp,tp->st", blk(xk, j), blk(al, i))
                dmt = dmt * blk(dtk, j)[:, None]
                dcrj = dcrj + (dmt * mt).sum(1)
                gh, gl = halves(dmt * decay(i, j).T)
                dbj = dbj + e("st,tn->sn", gh, blk(ck, i)) + e("st,tn->sn", gl, blk(ck, i))
            ddt[j], dcr[j] = (dxd * blk(xk, j)).sum(1), dcrj
            dx[j], db[j] = (dxd * blk(dtk, j)[:, None]).astype(bf), dbj  # dx in x's dtype
        for i in range(r):  # phase R
            inc = e("tn,pn->tp", blk(ck, i), sh) + e("tn,pn->tp", blk(ck, i), sl_)
            df[i] = (blk(dyk, i) * inc).sum(1)
            dyh, dyl = halves(blk(dyk, i))
            fh, fl = halves(blk(dyk, i) * blk(fk, i)[:, None])
            dci = e("tp,pn->tn", fh, sh)  # rounded once: 16-bit B, C (`body.rounds_once`)
            dcumi = 0
            for j in range(i + 1):
                m = e("tn,sn->ts", blk(ck, i), blk(bk, j)) * decay(i, j)
                dm = (e("tp,sp->ts", dyh, blk(xk, j)) + e("tp,sp->ts", dyl, blk(xk, j))) * blk(dtk, j)[
                    None, :
                ]
                dcumi = dcumi + (dm * m).sum(1)
                gh, gl = halves(dm * decay(i, j))
                dci = dci + e("ts,sn->tn", gh, blk(bk, j)) + e("ts,sn->tn", gl, blk(bk, j))
            dcum[i], dc[i] = dcumi, dci
        fdh, fdl = halves(dyk * fk[:, None])
        out["ds"].append(e("tp,tn->pn", fdh, ck) + e("tp,tn->pn", fdl, ck))
        names = ("y", "dx", "ddt", "dcum", "dcum_row", "df", "db", "dc")
        for name, v in zip(names, (y, dx, ddt, dcum, dcr, df, db, dc), strict=True):
            out[name].append(jnp.concatenate(v))
    return {k: jnp.concatenate(v) if k != "ds" else jnp.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("q", [128, 256])
def test_the_tiled_kernels_algebra_equals_the_whole_chunk_emulation(q):
    # the tiles' loops (the causal mask on the diagonal tile only, the segments' on every tile,
    # the backward's transposed phase) as `tiled.py` walks them, against the emulation of the
    # whole chunk at once; slow decays and segment boundaries inside and between tiles, so that
    # every tile carries weight
    from axkern.ops.chunked.mosaic_gpu import emulate

    length, p, n = 2 * q, 64, 64
    k = jax.random.split(jax.random.PRNGKey(11), 8)
    x = jax.random.normal(k[0], (1, 1, length, p)).astype(jnp.bfloat16)
    b, c = (jax.random.normal(k[i], (1, 1, length, n)).astype(jnp.bfloat16) for i in (1, 2))
    dt = jax.nn.softplus(jax.random.normal(k[3], (1, 1, length)))
    a = -dt * 0.01
    cum = jnp.cumsum(a.reshape(1, 1, 2, q), axis=-1).reshape(1, 1, length)
    ids = jnp.zeros((1, length), jnp.int32).at[:, 63:].add(1).at[:, 64 + 100 :].add(1).at[:, q + 30 :].add(1)
    states = jax.random.normal(k[6], (1, 2, 1, p, n))
    dy = jax.random.normal(k[7], (1, 1, length, p))
    f = jnp.exp(cum)
    y_want = emulate.emulate_chunk_scan(x, dt, cum, f, ids, b, c, states, q)
    want = emulate.emulate_chunk_scan_bwd(dy, x, dt, cum, f, ids, b, c, states, q)
    got = _tiled_mirror(
        dy[0, 0], x[0, 0], dt[0, 0], cum[0, 0], f[0, 0], ids[0], b[0, 0], c[0, 0], states[0, :, 0], q
    )
    names = ("dx", "ddt", "dcum", "dcum_row", "df", "db", "dc")
    pairs_ = [("y", y_want[0, 0])] + [(nm, w[0, 0]) for nm, w in zip(names, want[:7], strict=True)]
    pairs_.append(("ds", want[7][0, :, 0]))
    for name, w in pairs_:
        g, w = got[name].astype(jnp.float32), w.astype(jnp.float32)
        # dx, rounded to bf16 by both, may round the other way where its float32 sums differ
        err = float((jnp.abs(g - w) - (2**-7 * jnp.abs(w) if name == "dx" else 0)).max() / jnp.abs(w).max())
        assert err <= 1e-5, (name, err)
