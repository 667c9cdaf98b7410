"""mamba3's Pallas kernels (SSD's chunk kernels with a per-position decay and scale) in interpret
mode against the sequential float64 oracle, outputs, final states and every gradient, SISO and
MIMO (each token's ranks as consecutive kernel positions); the calls they refuse, with the
reason; their chunk heuristics. Pairwise cases: interpret mode is slow on a CPU."""

from __future__ import annotations

import jax
import pytest

import axkern
from axkern.bench import tune
from axkern.ops.mamba3.api import OP
from axkern.ops.mamba3.blocks import Mamba3BlockSizes
from tests.cases.mamba3 import call, make, run
from tests.harness import check_rule


@pytest.mark.parametrize(
    "impl,dims,dtype,chunk,rank",
    [
        # odd head dim and state (TPU blocks take them whole), 2 groups, chunks of 8
        ("pallas_tpu", (2, 37, 4, 3, 2, 6, 2), "float32", 8, 0),
        # MIMO of rank 1: the halves' rotation pairing
        ("pallas_tpu", (1, 21, 2, 3, 1, 6, 2), "bfloat16", 8, 1),
        # Triton's smallest tiles, P = N = 16, length 36 over chunks of 16, the rotation's
        # backward as its kernel (blocks of 4 positions)
        ("pallas_gpu", (1, 36, 2, 16, 1, 16, 4), "bfloat16", Mamba3BlockSizes(16, "kernel"), 0),
        # MIMO of rank 2: chunks of 8 tokens (16 kernel positions) over a length of 13, a segment
        # starting inside the first chunk
        ("pallas_tpu", (1, 13, 2, 3, 1, 6, 2), "float32", 8, 2),
        # MIMO of rank 3: 4 positions a token (one of them zero), chunks of 4 tokens = 16 positions,
        # the segment starting at the second chunk
        ("pallas_gpu", (1, 13, 2, 16, 1, 16, 4), "bfloat16", 4, 3),
        # the positions on the lanes (`transposes="kernels"`): SISO over chunks of 128 and a part,
        # MIMO of rank 2 over chunks of 64 tokens (128 positions)
        ("pallas_tpu", (1, 300, 2, 64, 1, 16, 4), "bfloat16", Mamba3BlockSizes(128, transposes="kernels"), 0),
        ("pallas_tpu", (1, 150, 2, 64, 1, 16, 4), "float32", Mamba3BlockSizes(64, transposes="kernels"), 2),
        # MIMO of rank 4 (the 2.7B preset's) in bf16: chunks of 4 tokens (16 positions), segments
        ("pallas_tpu", (1, 19, 2, 8, 1, 8, 2), "bfloat16", 4, 4),
        # q, k turned in the kernels (`rotation="kernel"`): bf16 with the positions on the lanes over
        # chunks of 128 and a part, 8 of the state's 16 pairs turned; float32 on the rows with two
        # groups of two heads, every pair turned
        (
            "pallas_tpu",
            (1, 300, 2, 64, 1, 32, 8),
            "bfloat16",
            Mamba3BlockSizes(128, rotation="kernel", transposes="kernels"),
            0,
        ),
        ("pallas_tpu", (2, 150, 4, 8, 2, 16, 8), "float32", Mamba3BlockSizes(128, rotation="kernel"), 0),
    ],
    ids=[
        "tpu-siso-float32",
        "tpu-mimo1-bfloat16",
        "gpu-siso-bfloat16",
        "tpu-mimo2-float32",
        "gpu-mimo3-bfloat16",
        "tpu-lanes-siso-bfloat16",
        "tpu-lanes-mimo2-float32",
        "tpu-mimo4-bfloat16",
        "tpu-rotating-lanes-siso-bfloat16",
        "tpu-rotating-siso-float32",
    ],
)
def test_kernels_against_sequential_oracle(impl, dims, dtype, chunk, rank):
    arrays, seg = make(0, *dims, rank, dtype, segments=True)
    check_rule(
        lambda name, a, **k: run(name, a, seg, chunk if name != "reference" else None),
        impl,
        arrays,
        dtype,
        "mamba3",
        interpret=True,
    )


def test_kernels_refuse_small_tiles_and_chunks_with_the_reason():
    small, _ = make(0, 1, 16, 2, 8, 1, 16, 2, 0, "float32", extras=False)
    with pytest.raises(axkern.Unsupported, match="head_dim=8"):
        call("pallas_gpu", small, chunk_size=16)
    with pytest.raises(axkern.Unsupported, match="chunk_size=4 is below 8"):
        call("pallas_tpu", small, chunk_size=4)
    # MIMO chunks count tokens; a token of rank 2 takes 2 kernel positions
    mimo, _ = make(0, 1, 16, 2, 16, 1, 16, 2, 2, "float32", extras=False)
    with pytest.raises(axkern.Unsupported, match=r"chunk_size=4 \(8 positions, 2 per token\) is below 16"):
        call("pallas_gpu", mimo, chunk_size=4)
    with pytest.raises(
        axkern.Unsupported, match=r"chunk_size=64 \(128 positions, 2 per token\) with float32"
    ):
        call("pallas_gpu", mimo, chunk_size=64)
    with pytest.raises(axkern.Unsupported, match=r"chunk_size=2 \(4 positions, 2 per token\) is below 8"):
        call("pallas_tpu", mimo, chunk_size=2)
    # the positions on the lanes: pallas_tpu's, in chunks that fill them
    with pytest.raises(axkern.Unsupported, match=r"transposes='kernels': chunk_size=4 \(8 positions\)"):
        run("pallas_tpu", mimo, None, Mamba3BlockSizes(4, transposes="kernels"))
    with pytest.raises(axkern.Unsupported, match="transposes='kernels': only pallas_tpu"):
        run("xla", mimo, None, Mamba3BlockSizes(4, transposes="kernels"))
    # the rotation's backward kernel is pallas_gpu's own
    for impl in ("xla", "pallas_tpu"):
        with pytest.raises(axkern.Unsupported, match="rotation_backward='kernel': only pallas_gpu"):
            call(impl, small, chunk_size=Mamba3BlockSizes(16, "kernel"))
    # a token wider than the largest float32 chunk
    wide = jax.ShapeDtypeStruct
    shapes = {
        k: wide(v.shape, v.dtype)
        for k, v in make(0, 1, 4, 1, 16, 1, 16, 0, 65, "float32", extras=False)[0].items()
    }
    with pytest.raises(axkern.Unsupported, match="rank=65: one token takes 128 kernel positions"):
        axkern.explain(lambda a: call("pallas_gpu", a), shapes)


@pytest.mark.parametrize(
    "impl,rank,chunk",
    [
        ("pallas_gpu", 0, 64),
        ("pallas_gpu", 3, 16),  # 4 positions a token: 64 positions
        ("pallas_gpu", 4, 16),
        ("pallas_tpu", 0, 256),
        ("pallas_tpu", 4, 64),  # 256 positions
        ("pallas_tpu", 16, 16),
    ],
)
def test_kernel_heuristics_count_tokens_per_chunk(impl, rank, chunk):
    arrays, _ = make(0, 1, 1024, 1, 16, 1, 16, 0, rank, "bfloat16", extras=False)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
    d = axkern.explain(lambda a: call(impl, a), shapes)
    assert d.implementation == impl and d.block_sizes.chunk_size == chunk


def _spec(length, rank, dtype="bfloat16", state=128):
    dims = dict(batch=1, length=length, heads=8, head_dim=64, groups=1, state=state, rank=rank, n_angles=32)
    return OP.spec(dims, dtype, segments=False, mimo=rank > 0)


@pytest.mark.parametrize(
    "impl,rank,dtype,chunks",
    [
        ("pallas_gpu", 0, "bfloat16", [16, 32, 64, 128]),  # up to 128 positions for a bf16 x
        ("pallas_gpu", 4, "bfloat16", [4, 8, 16]),  # a float32 x (MIMO): up to 64 positions
        ("pallas_gpu", 0, "float32", [16, 32, 64]),
        ("pallas_tpu", 0, "bfloat16", [32, 64, 128, 256]),
        ("pallas_tpu", 4, "bfloat16", [8, 16, 32, 64]),
        ("mosaic_gpu", 0, "bfloat16", [64]),
    ],
)
def test_each_kernel_implementation_declares_a_space_the_tuner_walks(impl, rank, dtype, chunks):
    # `axkern tune mamba3` times each candidate: the heuristic's first, then the chunks in tokens
    # (`kernel_slots(rank)` positions a token) and the forms the implementation keeps
    spec = _spec(4096, rank, dtype)
    imp = OP.implementations[impl]
    got = tune.candidates(imp, spec)
    assert got[0] == imp.heuristic(spec) and len(set(got)) == len(got)
    assert sorted({bs.chunk_size for bs in got}) == chunks
    fields = ("forward", "rotation", "angles", "rotation_backward", "transposes")
    forms = {(f, getattr(bs, f)) for bs in got for f in fields}
    want = {
        "pallas_gpu": {("rotation_backward", "kernel"), ("angles", "xla")},
        # q, k turned in the kernels (the heuristic's), and XLA's rotation apart: SISO only
        "pallas_tpu": {("transposes", "kernels")}
        | ({("rotation", "kernel"), ("rotation", "xla")} if rank == 0 else set()),
        "mosaic_gpu": {("forward", "stages"), ("rotation", "xla"), ("angles", "xla")},
    }[impl]
    assert want <= forms and all(v is None for f, v in forms - want)
    # the positions on the lanes only where a chunk's positions fill them
    slots = 4 if rank == 4 else 1
    assert all(bs.chunk_size * slots % 128 == 0 for bs in got if "kernel" in (bs.transposes, bs.rotation))
    if impl == "mosaic_gpu":  # a state of 64: the kernel cannot turn q, k, so no XLA rotation to time apart
        assert all(bs.rotation is None for bs in tune.candidates(imp, _spec(4096, 0, state=64)))
    # a short sequence keeps the chunks within its next power of two
    assert max(bs.chunk_size for bs in tune.candidates(imp, _spec(40, rank, dtype))) <= max(64, chunks[0])


@pytest.mark.parametrize(
    "halves,rank,groups,heads,length,n,a",
    [
        (False, 1, 2, 4, 12, 16, 4),  # SISO pairs, two groups, blocks of 4 positions
        (True, 4, 1, 2, 8, 16, 4),  # MIMO halves, rank 4: blocks of 8 positions (32 rows)
        (False, 1, 1, 2, 16, 16, 8),  # every column rotated (none passes through)
    ],
)
def test_the_rotation_backward_kernel_equals_xlas(halves, rank, groups, heads, length, n, a):
    # `pallas_gpu.rotation_backward` (interpret mode) against `common.rotation.rotated`'s XLA backward:
    # the turned-back cotangent summed over heads (`du`, bf16) and positions (`dbias`), and `dΘ`
    import importlib

    import jax.numpy as jnp
    import numpy as np

    rotation = importlib.import_module("axkern.ops.mamba3.common.rotation")
    pg = importlib.import_module("axkern.ops.mamba3.pallas_gpu")
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    u = jax.random.normal(k[0], (2, groups, length, rank, n)).astype(jnp.bfloat16)
    bias = jax.random.normal(k[1], (heads, 1, rank, n))
    theta = 3 * jax.random.normal(k[2], (2, heads, length, 1, a))
    g = jax.random.normal(k[3], (2, heads, length, rank, n))
    got = pg.rotation_backward(halves, u, bias, theta, g, interpret=True)
    _, pull = jax.vjp(lambda *v: rotation.rotated(halves, heads // groups, 1, None, *v), u, bias, theta)
    want = pull(g)
    for x, y in zip(got, want, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2e-6, atol=2e-5)


def test_the_rotation_backward_kernel_leaves_other_shapes_to_xla():
    import importlib

    import jax.numpy as jnp

    pg = importlib.import_module("axkern.ops.mamba3.pallas_gpu")

    def call(rank, length, n, a, halves=False):  # traced only: `None` or the gradients' shapes
        shapes = [(1, 1, length, rank, n), (2, 1, rank, n), (1, 2, length, 1, a), (1, 2, length, rank, n)]
        args = [
            jax.ShapeDtypeStruct(s, d)
            for s, d in zip(shapes, [jnp.bfloat16] + [jnp.float32] * 3, strict=True)
        ]
        return jax.eval_shape(lambda *x: pg.rotation_backward(halves, *x), *args)

    assert call(1, 12, 16, 4) is not None
    assert call(1, 13, 16, 4) is None  # no block of 4 or more positions divides the length
    assert call(3, 12, 16, 4) is None  # rank 3: rows of a block not a power of two
    assert call(1, 12, 16, 3) is None  # 3 angles
    assert call(2, 12, 16, 4, halves=True) is not None
    assert call(2, 12, 16, 2, halves=True) is None  # 6 columns of each half pass through


@pytest.mark.parametrize("layout_name", ["TpuLayout", "TpuHeadsLayout", "TpuLanesLayout"])
def test_tpu_kernels_turn_rotations_as_xla_does(layout_name):
    # the chunk scan with `B`, `C` as rotations the TPU kernels turn (`takes_rotations`; interpret
    # mode), against the same scan on XLA's rotated values: outputs and the gradients of `u`, the
    # biases and `Θ` (the kernels' `TurnedCotangent` where they sum the groups, XLA's turn back of
    # per-head cotangents in `TpuHeadsLayout`); two groups of two heads, 8 of 16 pairs turned
    import jax.numpy as jnp

    from axkern.ops.chunked import kernel_scan
    from axkern.ops.chunked import pallas_tpu as tpu
    from axkern.ops.chunked.mosaic_gpu.operands import RotatedOperand

    layout = getattr(tpu, layout_name)
    b, l, h, g, p, n, a = 1, 200, 4, 2, 8, 32, 8  # noqa: E741
    ks = jax.random.split(jax.random.PRNGKey(3), 8)
    x = jax.random.normal(ks[0], (b, l, h, p))
    adt = -jax.nn.softplus(jax.random.normal(ks[1], (b, l, h)))
    scale = jax.nn.softplus(jax.random.normal(ks[2], (b, l, h)))
    u = [jax.random.normal(k, (b, g, l, n)) for k in ks[3:5]]
    bias = [0.5 * jax.random.normal(k, (h, n)) for k in ks[5:7]]
    theta = 3 * jax.random.normal(ks[7], (b, h, l, a))
    seg = jnp.zeros((b, l), jnp.int32)
    s0 = jnp.zeros((b, h, p, n))

    def loss(turned, x, uk, uq, bk, bq, theta):
        rk, rq = (
            RotatedOperand(uk, bk, theta, same_angles=True),
            RotatedOperand(uq, bq, theta, same_angles=True),
        )
        ops = (rk, rq) if turned else (rk.value(), rq.value())
        y, final = kernel_scan.scan(
            layout, x, adt, scale, *ops, seg, s0, chunk_size=128, interpret=True, groups_first=True
        )
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(final**2)

    grads = [jax.grad(loss, argnums=tuple(range(1, 7)))(t, x, *u, *bias, theta) for t in (True, False)]
    for got, want in zip(*grads, strict=True):
        assert jnp.allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want)))), float(
            jnp.max(jnp.abs(got - want))
        )
