"""ssd's `pallas_gpu`, `mosaic_gpu` (Hopper) and `xla` compiled on a real GPU against the oracle rule.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Oracle: `reference` (the
sequential scan) in float64 on the CPU, as DESIGN.md says; the rule's same-dtype reference is
`reference` on the test's dtype (float32 products exact). Sizes are a Mamba-2 layer cut down
in batch and length.
"""

from __future__ import annotations

import functools

import jax
import pytest

import axkern
from axkern.positional import ssd
from tests.cases.ssd import GPU_DIMS, make, run
from tests.harness import check_rule, implementations

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "impl,dtype,segments,dims",
    [
        (i, d, s, dims)
        for i in implementations("ssd", "gpu")
        if i != "mosaic_gpu"  # below: 16-bit inputs and feature dims of multiples of 64 only
        for d in ("bfloat16", "float16", "float32")
        for s in (False, True)
        for dims in GPU_DIMS
    ],
)
def test_on_gpu_against_oracle(impl, dtype, segments, dims):
    arrays, seg = make(0, *dims, dtype, segments=segments)
    # pallas_gpu's largest chunks for bf16 inputs; fp16, float32 (exact products) and xla at 64
    chunk = 128 if dtype == "bfloat16" and impl != "xla" else 64
    check_rule(
        lambda name, a: run(name, a, seg, None if name == "reference" else chunk), impl, arrays, dtype, "ssd"
    )


# the Mosaic scan's cases: a length not a multiple of the chunk, groups 1 and 8, P 64 and 128
MOSAIC_DIMS = [(1, 1500, 8, 64, 1, 128), (2, 512, 8, 128, 8, 64)]


def _hopper() -> bool:
    from axkern.core import backend

    cc = backend.compute_capability() if backend.platform() == "gpu" else None
    return cc is not None and cc[0] == 9


# mosaic_gpu's forms (SSDBlockSizes after the chunk): the forward, where dB and dC are summed,
# who transposes x and y, the state backward, the chunk-scan backward (the default at P 128:
# "default", "deterministic" where XLA_FLAGS asks for deterministic results; "lean_both" with the
# lean chunk-scan backward too, which takes P 64 only: the tests give the others the whole one;
# then three with the fused state backward, whole and over the state's columns (with the group
# sums and without); the last, the default at P 64, with dg summed per group and the lean
# chunk-scan backward, whose dims without it take "default")
FORMS = [
    ("stages",),
    ("fused",),
    ("fused", "kernels", "kernels"),
    ("fused", "kernels", "kernels", None, "lean"),
    ("lean", "kernels", "kernels"),
    ("lean", None, "kernels"),
    ("lean", "kernels", "kernels", None, "lean"),
    ("lean", "kernels", "kernels", "lean"),
    ("lean", "kernels", "kernels", "columns"),
    ("lean", None, "kernels", "columns"),
    ("lean", "scores", "kernels", None, "lean"),
]


def _check_mosaic(arrays, seg, blocks):
    """`mosaic_gpu` in the form `blocks` against the oracle rule (bf16), values and every gradient."""
    check_rule(
        lambda name, a: run(name, a, seg) if name == "reference" else run(name, a, seg, block_sizes=blocks),
        "mosaic_gpu",
        arrays,
        "bfloat16",
        "ssd",
    )


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize(
    "form",
    FORMS,
    ids=[
        "stages",
        "fused",
        "whole",
        "lean",
        "default",
        "deterministic",
        "lean_both",
        "lean_state_backward",
        "state_columns",
        "state_columns_head_sums",
        "group_scores",
    ],
)
@pytest.mark.parametrize("segments,slow", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dims", MOSAIC_DIMS)
def test_mosaic_gpu_against_oracle(segments, slow, dims, form):
    import dataclasses

    from axkern.ops.ssd import SSDBlockSizes

    dtype = "bfloat16"  # fp16 goes to xla (mosaic_gpu.supports says why)
    # values and every gradient, with D, z, dt_bias and an initial state (the final state too);
    # the forward in three stages or fused; `slow`: A / 100, so that a chunk keeps much of the
    # state entering it (at make's decays a chunk of 64 keeps less than 1e-9 of it)
    arrays, seg = make(0, *dims, dtype, segments=segments)
    if slow:
        arrays["A"] = arrays["A"] / 100
    blocks = SSDBlockSizes(64, *form)
    if dims[3] != 64:  # the lean chunk-scan backward takes P 64 only (the default's whole one here)
        sums = "kernels" if blocks.group_sums == "scores" else blocks.group_sums  # (with the lean one only)
        blocks = dataclasses.replace(blocks, scan_backward=None, group_sums=sums)
    _check_mosaic(arrays, seg, blocks)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize(
    "chunk, dims, segments, sums, forward",
    [
        (128, (1, 1500, 8, 64, 1, 128), True, "kernels", "stages"),  # not a multiple of the chunk
        (128, (2, 512, 8, 64, 8, 64), False, None, "stages"),  # groups of one head
        (256, (1, 1500, 4, 64, 2, 64), True, "kernels", "stages"),
        (128, (1, 1500, 8, 64, 1, 128), True, "kernels", "fused"),
        (256, (1, 1500, 4, 64, 2, 64), True, "kernels", "fused"),
        (128, (1, 700, 4, 128, 1, 64), True, "kernels", "fused"),  # P 128 (the scan backward's bf16 dx tile)
    ],
)
def test_mosaic_gpu_at_larger_chunks_against_oracle(chunk, dims, segments, sums, forward):
    # chunks of 128 and 256 (tiles of 64 rows), the forward in three stages or fused: values and
    # every gradient, with D, z, dt_bias and an initial state; A / 100, so that a chunk's early
    # positions reach its late ones and the states carry across chunks
    from axkern.ops.ssd import SSDBlockSizes

    arrays, seg = make(2, *dims, "bfloat16", segments=segments)
    arrays["A"] = arrays["A"] / 100
    blocks = SSDBlockSizes(chunk, forward, sums, "kernels")
    _check_mosaic(arrays, seg, blocks)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("chunk, forward", [(64, "stages"), (64, "fused"), (64, "lean"), (128, "fused")])
@pytest.mark.parametrize("dims", MOSAIC_DIMS)
def test_mosaic_gpu_without_d_and_the_gate_against_oracle(dims, chunk, forward):
    # no D, no gate: the kernels write y in bf16 and the scan's backward writes dx over the bf16
    # cotangent (at chunks of 128 by tiles, its second reads of dy from shared memory); values
    # and every gradient, with segments
    from axkern.ops.ssd import SSDBlockSizes

    arrays, seg = make(1, *dims, "bfloat16", segments=True, extras=False)
    blocks = SSDBlockSizes(chunk, forward, "kernels", "kernels")
    _check_mosaic(arrays, seg, blocks)


@pytest.mark.skipif(not _hopper(), reason="the default order on a Hopper GPU")
def test_default_is_mosaic_gpu_for_bf16_and_xla_for_fp16_on_hopper():
    for dtype, want in (("bfloat16", "mosaic_gpu"), ("float16", "xla")):
        arrays, _ = make(0, 1, 256, 2, 64, 1, 128, dtype, extras=False)
        d = axkern.explain(lambda a: ssd(**a), arrays)
        assert d.implementation == want, (dtype, d)
        if want == "mosaic_gpu":
            assert d.block_sizes.chunk_size == 64
            assert "chunk-scan" in d.backward  # the kernels, forward and backward


def test_explicit_pallas_gpu_is_compiled():
    arrays, _ = make(0, 1, 256, 2, 64, 1, 64, "bfloat16", extras=False)
    d = axkern.explain(lambda a: ssd(**a, implementation="pallas_gpu", chunk_size=64), arrays)
    assert d.implementation == "pallas_gpu" and not d.interpret
    assert jax.jit(lambda a: ssd(**a, implementation="pallas_gpu", chunk_size=64))(arrays).shape == (
        1,
        256,
        2,
        64,
    )


def _kernel_inputs(kernel, b, h, g, chunks, p, n, split=False, chunk=None, slow=False):
    """Random arguments of one Mosaic kernel: bf16 rows, positive steps, decays within each chunk;
    `split`: `B`, `C` float32 (the kernels take them as two bf16 halves, as Mamba-3's `q`, `k`);
    `chunk` positions a chunk (64 where None); `slow`: decays a hundredth as fast, so that a
    chunk's early positions still reach its late ones."""
    import jax.numpy as jnp

    from axkern.ops.chunked import mosaic_gpu

    length = chunks * (chunk or mosaic_gpu.CHUNK)
    k = jax.random.split(jax.random.PRNGKey(7), 8)
    x = jax.random.normal(k[0], (b, h, length, p)).astype(jnp.bfloat16)
    bc = [jax.random.normal(k[i], (b, g, length, n)) for i in (1, 2)]
    bc = bc if split else [v.astype(jnp.bfloat16) for v in bc]
    dt = jax.nn.softplus(jax.random.normal(k[3], (b, h, length)))
    a = -dt * jnp.exp(jax.random.normal(k[4], (h,)))[None, :, None] / (100 if slow else 1)
    cum = jnp.cumsum(a.reshape(b, h, chunks, -1), axis=-1).reshape(b, h, length)
    seg = jnp.cumsum(jax.random.bernoulli(k[5], 0.05, (b, length)), axis=1).astype(jnp.int32)
    states = jax.random.normal(k[6], (b, chunks, h, p, n))
    if kernel == "chunk_state":
        return x, jnp.exp(cum) * dt, bc[0]
    if kernel == "chunk_state_bwd":
        return x, jnp.exp(cum) * dt, bc[0], states
    scan = (x, dt, cum, jnp.exp(cum), seg, bc[0], bc[1], states)
    if kernel == "chunk_scan":
        return scan
    return (jax.random.normal(k[7], (b, h, length, p)), *scan)


def _against_emulation(kernel, args, chunk=None, lean=False, scores=False):
    """One Mosaic kernel (at chunks of `chunk`, 64 where None; `lean`: the lean chunk-scan
    backward; `scores`: with `dg` summed per group, `group_sums`) against its emulation, each
    output within 1e-4 of the emulation's largest magnitude (a 16-bit output, the scan
    backward's `dx`, may also round the other way where the float32 sums differ: one step)."""
    import functools

    from axkern.ops.chunked import mosaic_gpu

    kw, emulated = ({}, {}) if chunk is None else ({"chunk": chunk}, {"q": chunk})
    if lean:  # (the same arithmetic as the whole kernel's)
        kw = kw | {"lean": True}
    if scores:
        kw, emulated = kw | {"scores": True, "group_sums": True}, emulated | {"scores": True}
    got = jax.jit(functools.partial(getattr(mosaic_gpu, kernel), **kw))(*args)
    # the emulation on the CPU: XLA's GPU compiler drops its float32 -> bf16 -> float32 round
    # trips (excess precision), leaving every `lo` half zero
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        emulate = functools.partial(getattr(mosaic_gpu, f"emulate_{kernel}"), **emulated)
        want = jax.jit(emulate)(*jax.device_put(args, cpu))
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        assert (a.shape, a.dtype) == (e.shape, e.dtype), (kernel, i, a.shape, e.shape, a.dtype, e.dtype)
        err = _error(a, e)
        assert err <= 1e-4, (kernel, i, err)


def _error(got, want):
    """`max |got - want|` over `want`'s largest magnitude, less one step of a 16-bit dtype at
    each value (two roundings of float32 sums that differ in their last bits may go either way)."""
    import numpy as np
    from jax import numpy as jnp

    step = 2.0 ** -jnp.finfo(got.dtype).nmant if jnp.dtype(got.dtype).itemsize == 2 else 0.0
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return (np.abs(got - want) - step * np.abs(want)).max() / max(np.abs(want).max(), 1e-30)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize(
    "kernel, chunk, dims",
    [
        (kernel, chunk, dims)
        for kernel in ("chunk_state", "chunk_scan", "chunk_state_bwd", "chunk_scan_bwd")
        for chunk in (128, 256)
        for dims in ((2, 4, 2, 3, 64, 128), (1, 2, 2, 2, 64, 64), (1, 2, 1, 2, 128, 64))
        # the scan's and its backward's tiles exceed shared memory at 256 but at P and N 64
        if not (kernel in ("chunk_scan", "chunk_scan_bwd") and chunk == 256 and max(dims[4:]) > 64)
    ],
)
def test_mosaic_gpu_kernels_at_larger_chunks_equal_their_emulation(kernel, chunk, dims):
    # chunks of 128 and 256: the state kernel's product over the whole chunk, the scan's tiles of
    # 64 rows walking the columns up to the diagonal, its backward's two phases, the state
    # backward's blocks of 64 rows; slow decays, so that every tile below the diagonal carries
    # weight
    _against_emulation(kernel, _kernel_inputs(kernel, *dims, chunk=chunk, slow=True), chunk)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize(
    "chunk, dims, lean",
    [
        (None, (2, 4, 2, 3, 64, 128), False),
        (None, (2, 4, 2, 3, 64, 128), True),
        (128, (2, 4, 2, 3, 64, 128), False),
        (256, (1, 2, 2, 2, 64, 64), False),
    ],
)
def test_mosaic_gpu_scan_backward_writes_dx_over_a_bf16_dy(chunk, dims, lean):
    # a bf16 cotangent has dx's type: the kernel writes dx over it (`tiles.launch`'s `over`),
    # each block reading its rows of dy before writing them, the tiled kernel (chunks of 128,
    # 256) its second reads from shared memory; against the emulation given the same dy
    import functools

    import jax.numpy as jnp

    from axkern.ops.chunked import mosaic_gpu

    dy, *scan = _kernel_inputs("chunk_scan_bwd", *dims, chunk=chunk, slow=True)
    dy = dy.astype(jnp.bfloat16)
    kw = ({} if chunk is None else {"chunk": chunk}) | ({"lean": True} if lean else {})
    got = jax.jit(functools.partial(mosaic_gpu.chunk_scan_bwd, **kw))(dy, *scan)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        emulate = functools.partial(
            mosaic_gpu.emulate_chunk_scan_bwd, **({} if chunk is None else {"q": chunk})
        )
        args = jax.device_put((dy.astype(jnp.float32), *scan), cpu)
        want = jax.jit(emulate)(*args)
    for i, (a, e) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        assert a.shape == e.shape, (i, a.shape, e.shape)
        assert _error(a, e) <= 1e-4, (i, _error(a, e))


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("kernel", ["chunk_state", "chunk_scan", "chunk_state_bwd", "chunk_scan_bwd"])
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 128, 64), (1, 2, 2, 2, 64, 64)])
@pytest.mark.parametrize("split", [False, True])
def test_mosaic_gpu_kernels_equal_their_emulation(kernel, dims, split):
    # each kernel alone against its arithmetic in XLA (the same roundings, exact products): only
    # the order of float32 sums and the approximate exp may differ; a wrong index or layout
    # shows here before it shows in the layer
    _against_emulation(kernel, _kernel_inputs(kernel, *dims, split=split))


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 64, 128), (1, 2, 2, 2, 64, 64)])
@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("scores", [False, True], ids=["whole_sums", "scores"])
def test_mosaic_gpu_lean_scan_backward_equals_its_emulation(dims, slow, scores):
    # the lean chunk-scan backward (every result through the staging tile, `tiles.STAGE`, the
    # state's low half in M's tiles until C S_inᵀ has read it) against its arithmetic in XLA;
    # `scores`: dg summed over each group's heads in dB's place, dC without dg B, per group
    args = _kernel_inputs("chunk_scan_bwd", *dims, slow=slow)
    _against_emulation("chunk_scan_bwd", args, lean=True, scores=scores)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("kernel", ["chunk_state_bwd", "chunk_scan_bwd"])
@pytest.mark.parametrize("dims, angles", [((2, 4, 2, 3, 64, 128), 32), ((1, 3, 1, 2, 64, 128), 64)])
def test_mosaic_gpu_backward_kernels_turn_back_by_the_angles(kernel, dims, angles):
    # given the angles a rotation turned B and C by (Mamba-3's, `operands.py`), the two backward
    # kernels return dB, dC turned back by -Θ: their emulation's, turned in XLA; the other
    # outputs as without the angles (the columns past the angles' pass through)
    import jax.numpy as jnp
    import numpy as np

    from axkern.ops.chunked import mosaic_gpu
    from axkern.ops.chunked.mosaic_gpu.operands import rotate_halves

    args = _kernel_inputs(kernel, *dims, split=True)
    b, h, _, _, _, n = dims
    length = args[0].shape[2]
    theta = jax.random.uniform(jax.random.PRNGKey(3), (b, h, length, angles), maxval=2 * np.pi)
    got = jax.jit(functools.partial(getattr(mosaic_gpu, kernel), theta=theta))(*args)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        want = list(jax.jit(getattr(mosaic_gpu, f"emulate_{kernel}"))(*jax.device_put(args, cpu)))
        th = jnp.pad(jax.device_put(theta, cpu), [(0, 0)] * 3 + [(0, n // 2 - angles)])
        turned = {"chunk_state_bwd": (2,), "chunk_scan_bwd": (5, 6)}[kernel]
        for i in turned:
            want[i] = rotate_halves(want[i], jnp.cos(th), -jnp.sin(th))
    assert len(got) == len(want)
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        err = _error(a, e)
        assert err <= 1e-4, (kernel, i, i in turned, err)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("boundaries", [0.0, 0.003])
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 128, 64), (1, 2, 2, 5, 64, 64)])
@pytest.mark.parametrize("split", [False, True])
def test_mosaic_gpu_fused_forward_equals_the_stages(dims, boundaries, split):
    # the fused kernel against the three stages (chunk state, recurrence, chunk scan) on the same
    # inputs, with slow decays (each chunk keeps 0.1-0.7 of the state entering it) and no or rare
    # segment boundaries, so the carried state matters: the states entering the chunks and the
    # final state against the stages' (only the order of float32 sums differs: the own state is
    # accumulated onto the kept state), y against the chunk scan kernel on the fused states (a
    # one-ulp difference in a state may round its 16-bit copy the other way)
    _fused_against_stages(dims, boundaries, split)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize(
    "chunk, dims, boundaries",
    [
        (128, (2, 4, 2, 3, 64, 128), 0.003),
        (128, (1, 2, 2, 4, 64, 64), 0.0),
        (256, (1, 2, 2, 3, 64, 64), 0.003),
    ],
)
def test_mosaic_gpu_fused_forward_at_larger_chunks_equals_the_stages(chunk, dims, boundaries):
    # chunks of 128 and 256: the fused kernel's tiles of 64 rows (one slot of C's row blocks, each
    # refilled as soon as read; two of B's and x's), against the three stages at the same chunk
    _fused_against_stages(dims, boundaries, False, chunk)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("boundaries, y16", [(0.0, False), (0.003, False), (0.003, True)])
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 2, 128, 64), (1, 2, 2, 5, 64, 64)])
def test_mosaic_gpu_lean_forward_equals_the_stages(dims, boundaries, y16):
    # the lean fused forward (one slot of tiles; the state and y out by 64 x 64 blocks, y through
    # the state's float32 staging tile or, `y16`, its own bf16 one) as the fused one
    _fused_against_stages(dims, boundaries, False, lean=True, y16=y16)


def _fused_against_stages(dims, boundaries, split, chunk=64, lean=False, y16=False):
    import jax.numpy as jnp
    import numpy as np

    from axkern.ops.chunked import mosaic_gpu
    from axkern.ops.chunked.kernel_scan import chunk_weights

    b, h, g, chunks, p, n = dims
    q, length = chunk, chunks * chunk
    k = jax.random.split(jax.random.PRNGKey(11), 7)
    x = jax.random.normal(k[0], (b, h, length, p)).astype(jnp.bfloat16)
    # split: B, C float32, taken as two bf16 halves each (Mamba-3's q, k)
    bt, ct = (jax.random.normal(k[i], (b, g, length, n)) for i in (1, 2))
    bt, ct = (bt, ct) if split else (bt.astype(jnp.bfloat16), ct.astype(jnp.bfloat16))
    dt = jax.nn.softplus(jax.random.normal(k[3], (b, h, length)))
    ac = (-0.01 * dt * jnp.exp(0.3 * jax.random.normal(k[4], (h,)))[None, :, None]).reshape(b, h, chunks, q)
    seg = jnp.cumsum(jax.random.bernoulli(k[5], boundaries, (b, length)), axis=1).astype(jnp.int32)
    s0 = jax.random.normal(k[6], (b, h, p, n))
    cum, w, f, keep = chunk_weights(ac, dt.reshape(b, h, chunks, q), seg.reshape(b, chunks, q))
    assert float(keep.max()) > 0.1  # the carried state matters
    col = lambda a: a.reshape(b, h, -1)  # noqa: E731
    layout = mosaic_gpu.MosaicLayout(x, bt, q=q, interpret=False, products=jnp.bfloat16)
    args = (x, ac, dt.reshape(b, h, chunks, q), cum, w, f, keep, seg.reshape(b, chunks, q), bt, ct, s0)
    _, final_want, states_want = jax.jit(lambda *a: layout.forward(*a, sums=False, dtype=jnp.float32))(*args)
    y_dtype = jnp.bfloat16 if y16 else jnp.float32
    fused = functools.partial(mosaic_gpu.fused_forward, chunk=q, lean=lean, y_dtype=y_dtype)
    y, final, states_in = jax.jit(fused)(x, col(w), dt, col(cum), col(f), keep, seg, bt, ct, s0)
    y_want = jax.jit(functools.partial(mosaic_gpu.chunk_scan, chunk=q))(
        x, dt, col(cum), col(f), seg, bt, ct, states_in
    )

    def close(got, want, tol, what):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert got.shape == want.shape, (what, got.shape, want.shape)
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
        assert err <= tol, (what, err)

    close(states_in, states_want, 1e-5, "states entering the chunks")
    close(final, final_want, 1e-5, "final state")
    # (y in bf16: within one bf16 step of the float32 y rounded)
    close(y, y_want.astype(y_dtype), 2.0**-8 if y16 else 1e-5, "y")


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("where", ["x", "dt", "B", "C", "initial_state"])
def test_mosaic_gpu_non_finite_rule(where):
    # a NaN input takes the guarded layer (finite inputs take the kernels alone): the output and
    # the final state are NaN exactly where the sequential recurrence's are, and close to it
    # elsewhere; every gradient is NaN at least where the recurrence's is (tests/ops/
    # test_ssd_nonfinite.py's rule, there for the kernels in interpret mode)
    import jax.numpy as jnp
    import numpy as np

    from tests.helpers import assert_nonfinite_rule

    arrays, seg = make(0, 1, 300, 4, 64, 1, 128, "bfloat16", extras=False)
    arrays["initial_state"] = jax.random.normal(jax.random.PRNGKey(1), (1, 4, 64, 128))
    index = {"x": (0, 150, 1, 3), "dt": (0, 150, 2), "B": (0, 150, 0, 5), "C": (0, 150, 0, 5)}
    index["initial_state"] = (0, 1, 3, 5)
    arrays[where] = arrays[where].at[index[where]].set(jnp.nan)

    def f(impl):
        def loss(a):
            y, final = ssd(**a, segment_ids=seg, return_final_state=True, implementation=impl)
            cos = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
            return jnp.sum(y.astype(jnp.float32) * cos) + jnp.sum(final), (y, final)

        grads, out = jax.jit(jax.grad(loss, has_aux=True))(arrays)
        return jax.tree.map(lambda v: np.asarray(v, np.float32), (grads, out))

    (got_grads, got), (want_grads, want) = f("mosaic_gpu"), f("reference")
    assert_nonfinite_rule(got, want, f"NaN in {where}: outputs", rtol=0.05)
    for name in sorted(want_grads):
        g, w = got_grads[name], want_grads[name]
        missing = np.isnan(w) & ~np.isnan(g)
        assert not missing.any(), f"d{name}: {missing.sum()} numbers where the recurrence's gradient is NaN"


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize(
    "form",
    [
        ("fused", "kernels"),
        ("stages", "kernels"),
        ("fused", None, "kernels"),
        ("stages", None, "kernels"),
        ("fused", None, None, "lean"),
        ("stages", "kernels", "kernels", "lean"),
    ],
)
@pytest.mark.parametrize("dims", MOSAIC_DIMS)
def test_mosaic_gpu_forms_equal_the_plain_form(dims, form):
    # dB and dC added into each group's rows by the kernels' TMA reductions, x, y, dy, dx read
    # and written in the caller's [b, L, H, P] layout by the kernels, the reverse recurrence and
    # the chunk states' backward as one kernel, against the same forward with XLA's sums and
    # transposes and the state backward in two kernels: the same values up to the order of the
    # float32 additions (dB and dC; d keep's row sums)
    import numpy as np

    from axkern.ops.ssd import SSDBlockSizes

    arrays, seg = make(0, *dims, "bfloat16", segments=True)
    forms = (SSDBlockSizes(64, *form), SSDBlockSizes(64, form[0]))
    got, want = (run("mosaic_gpu", arrays, seg, block_sizes=blocks) for blocks in forms)
    names = sorted(arrays)
    for part, labels in ((0, ["y", "final"]), (1, names)):
        for name, g, w in zip(labels, jax.tree.leaves(got[part]), jax.tree.leaves(want[part]), strict=True):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            # dB, dC: bf16 gradients, whose rounding the order of the sums may move by one step;
            # dx too where the fused state backward leaves its two float32 parts to XLA's sum
            # (the chunk-state backward kernel adds them in registers); the fused state backward
            # sums d keep in another order, which the decay's gradients (A, dt, dt_bias:
            # differences of large sums) carry further
            rtol = 2.0**-7 if name in ("B", "C") or (name == "x" and form[3:] == ("lean",)) else 0.0
            decay = form[3:] == ("lean",) and name in ("A", "dt", "dt_bias")
            atol = (1e-4 if decay else 1e-6) * np.abs(w).max()
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("extras", [False, True])
@pytest.mark.parametrize("dims", MOSAIC_DIMS)
def test_mosaic_gpu_forward_alone_equals_the_differentiated_one(dims, extras):
    # with nothing to differentiate the fused kernel leaves out the entering states' writes
    # (the backward's residual): the same kernel arithmetic as the forward taken under
    # value_and_grad; XLA may fuse the kernel's inputs (softplus of dt, the decays), D and the
    # gate differently in the two programs: the final state within a few float32 steps, y
    # within one bf16 step (`xla` in place of `mosaic_gpu` differs in one value of about a
    # million, one step, or 1e-8 where y nearly cancels)
    import numpy as np

    from axkern.positional import ssd

    arrays, seg = make(0, *dims, "bfloat16", segments=True, extras=extras)

    def forward(arrays):
        kw = dict(arrays)
        args = [kw.pop(k) for k in ("x", "dt", "A", "B", "C")]
        return ssd(
            *args,
            dt_softplus=True,
            segment_ids=seg,
            return_final_state=True,
            implementation="mosaic_gpu",
            **kw,
        )

    alone = jax.jit(forward)(arrays)
    differentiated = run("mosaic_gpu", arrays, seg)[0]
    for name, a, d in zip(("y", "final"), alone, differentiated, strict=True):
        a, d = np.asarray(a, np.float64), np.asarray(d, np.float64)
        rtol, atol = (2.0**-7, 1e-6 * np.abs(d).max()) if name == "y" else (2.0**-20, 0)
        np.testing.assert_allclose(a, d, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.skipif(not _hopper(), reason="the Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("form", ["lean", "columns"])
@pytest.mark.parametrize("group_sums,positions_first", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dims", [(2, 4, 2, 3, 64, 128), (1, 2, 1, 1, 128, 64), (1, 4, 1, 5, 64, 64)])
def test_mosaic_gpu_fused_state_backward_equals_the_two_kernels(dims, group_sums, positions_first, form):
    # the fused kernel (whole, or a block per 64 of the state's columns, adding dx onto a given
    # one) against the reverse recurrence (Triton) and the chunk-state
    # backward (Mosaic) on the same random inputs, with carries of 0.1-0.9 so that the gradient
    # crossing chunk boundaries matters; one chunk, x in the caller's layout, dB summed per group
    import jax.numpy as jnp
    import numpy as np

    from axkern.ops.chunked import mosaic_gpu

    b, h, g, chunks, p, n = dims
    q, length = mosaic_gpu.CHUNK, chunks * mosaic_gpu.CHUNK
    k = jax.random.split(jax.random.PRNGKey(13), 7)
    x = jax.random.normal(k[0], (b, h, length, p)).astype(jnp.bfloat16)
    bt = jax.random.normal(k[1], (b, g, length, n)).astype(jnp.bfloat16)
    w = jax.nn.softplus(jax.random.normal(k[2], (b, h, length)))
    keep = jax.random.uniform(k[3], (b, h, chunks), minval=0.1, maxval=0.9)
    states_in, d_states_in = (jax.random.normal(k[i], (b, chunks, h, p, n)) for i in (4, 5))
    d_final = jax.random.normal(k[6], (b, h, p, n))
    layout = mosaic_gpu.MosaicLayout(x, bt, q=q, interpret=False, products=jnp.bfloat16)

    def two_kernels(x, w, bt, keep, states_in, d_states_in, d_final):
        d_own, d_keep, d_init = layout.recurrence_bwd(keep, states_in, d_states_in, d_final)
        dx, dw, db = mosaic_gpu.chunk_state_bwd(x, w, bt, d_own)
        return dx, dw, db, d_keep, d_init

    want = list(jax.jit(two_kernels)(x, w, bt, keep, states_in, d_states_in, d_final))
    dx_in = jax.random.normal(k[0], (b, h, length, p))
    want[0] = want[0] + dx_in
    xs = jnp.swapaxes(x, 1, 2) if positions_first else x
    kw = dict(columns=n // 64 if form == "columns" else 1)
    fused = jax.jit(
        lambda *a: mosaic_gpu.fused_state_bwd(
            *a, group_sums=group_sums, positions_first=positions_first, **kw
        )
    )
    dx_in = jnp.swapaxes(dx_in, 1, 2) if positions_first else dx_in
    got = list(fused(xs, w, bt, keep, states_in, d_states_in, d_final, dx_in))
    if positions_first:
        got[0] = jnp.swapaxes(got[0], 1, 2)
    if group_sums:
        want[2] = want[2].reshape(b, g, h // g, length, n).sum(2)
    # dB = (w ∘ x) dS takes dS rounded once to bf16 (`body.rounds_once`): the two routes' dS
    # differ in float32's last bits (their recurrences add in other orders), so an element may
    # round the other way and move dB by a bf16 step of one term (measured on the H200: 1.1e-5
    # of dB's largest value); the other gradients take dS as two halves
    bound = {"dB": 1e-4}
    for what, a, e in zip(("dx", "dw", "dB", "d keep", "d initial state"), got, want, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, (what, a.shape, e.shape)
        err = np.abs(a - e).max() / max(np.abs(e).max(), 1e-30)
        assert err <= bound.get(what, 1e-5), (what, err)
