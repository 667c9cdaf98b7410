"""Every Pallas TPU kernel lowered for a TPU v5e on the CPU (`tests.tpu_lowering`), at model
shapes, in bfloat16 and float32, its forward and its backward, with the block sizes the
dispatcher picks on the chip: a kernel body that breaks a Mosaic rule (an op the chip's vector
unit lacks for a dtype, a block shape it cannot tile) fails here, in CI, not first on a TPU.
Lowering only: nothing is compiled or run (interpret mode checks the values: tests/ops; the chip
checks both: tests/tpu)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from axkern import masks
from axkern.ops.mamba3.blocks import Mamba3BlockSizes
from axkern.ops.ssd.blocks import SSDBlockSizes
from axkern.positional import attention, fused_cross_entropy, mamba3, short_conv, ssd
from tests.tpu_lowering import lane_sparse_arrays, lower_for_tpu, matmuls, mosaic_kernels

DTYPES = ["bfloat16", "float32"]
S = jax.ShapeDtypeStruct


def _lower_value_and_grad(fn, args, wrt):
    """Lower `fn(*args)` beside the gradient of its outputs' sum with respect to `args[i]` for
    `i` in `wrt` (the forward as called alone, and the forward that keeps residuals with the
    backward); the names of the Mosaic kernels it calls. Every product of a float32 operand in
    them is at full precision (the library's rule, `core.kernels.full_precision`)."""

    def both(*args):
        def loss(*diff):
            full = list(args)
            for i, d in zip(wrt, diff, strict=True):
                full[i] = d
            return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(fn(*full)))

        return fn(*args), jax.grad(loss, argnums=tuple(range(len(wrt))))(*(args[i] for i in wrt))

    lowered = lower_for_tpu(both, *args)
    # no kernel reads or writes a column array: its last dimension would fill 128 lanes in memory
    assert not lane_sparse_arrays(lowered), lane_sparse_arrays(lowered)
    kernels = mosaic_kernels(lowered)
    for name, module in kernels:
        for lhs, rhs, precision in matmuls(module):
            assert "f32" not in (lhs, rhs) or precision == "fp32", (
                f"{name}: a {lhs} x {rhs} product at {precision}"
            )
    return {name for name, _ in kernels}


# -- attention ------------------------------------------------------------------------------------


def _ids(b, s):
    # three packed documents a row (traced: the schedule is built on the device)
    return jnp.minimum(jnp.arange(s)[None, :] // (s // 3 + 5), 2) * jnp.ones((b, 1), jnp.int32)


# name: (q_len, kv_len, heads, kv_heads, head dim, mask, soft cap, sinks, return_lse)
ATTENTION = {
    "causal d128 gqa4": (2048, 2048, 8, 2, 128, masks.Causal(), None, False, False),
    "full d128": (2048, 2048, 8, 8, 128, masks.Full(), None, False, False),
    "window 256 d128": (2048, 2048, 8, 2, 128, masks.SlidingWindow(256), None, False, False),
    "documents & causal d128": (2048, 2048, 8, 2, 128, "documents", None, False, False),
    "documents alone, soft cap, sinks d128": (2048, 2048, 8, 2, 128, "documents only", 30.0, True, False),
    "causal, sinks, lse d128": (2048, 2048, 8, 2, 128, masks.Causal(), None, True, True),
    # a block-sparse pattern: a window with a look-ahead or a causal band at a distance
    "window look-ahead | band d128": (
        2048,
        2048,
        8,
        2,
        128,
        masks.SlidingWindow(200, offset=64) | masks.Causal(offset=-1024),
        None,
        False,
        False,
    ),
    "prefix-LM, sinks d128": (2048, 2048, 8, 2, 128, "prefix", None, True, False),
    "window | prefix-LM d128": (2048, 2048, 8, 2, 128, "window | prefix", None, False, False),
    "prefix-LM & documents d128": (2048, 2048, 8, 2, 128, "prefix & documents", None, False, False),
    "soft cap q<kv d64 mqa": (512, 768, 8, 1, 64, masks.Full(), 30.0, False, False),
    "causal ragged d64": (1000, 1000, 8, 2, 64, masks.Causal(), 50.0, True, True),
    "causal d256": (2048, 2048, 4, 2, 256, masks.Causal(), None, False, False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTENTION))
def test_attention(case, dtype):
    sq, sk, h, kvh, d, mask, cap, with_sinks, lse = ATTENTION[case]
    b = 1
    args = [S((b, sq, h, d), dtype), S((b, sk, kvh, d), dtype), S((b, sk, kvh, d), dtype), S((h,), "float32")]
    wrt = (0, 1, 2, 3) if with_sinks else (0, 1, 2)

    def fn(q, k, v, sinks):
        m = mask
        if isinstance(mask, str) and "prefix" in mask:  # traced prefix lengths
            m = masks.PrefixLM(jnp.full((b,), sq // 3, jnp.int32) + jnp.arange(b, dtype=jnp.int32))
            if mask == "window | prefix":
                m = masks.SlidingWindow(256) | m
            elif mask == "prefix & documents":
                m = m & masks.Segments(_ids(b, sq), _ids(b, sk))
        elif isinstance(mask, str):
            ids = masks.Segments(_ids(b, sq), _ids(b, sk))
            m = ids if mask == "documents only" else ids & masks.Causal()
        return attention(
            q,
            k,
            v,
            mask=m,
            logits_soft_cap=cap,
            sinks=sinks if with_sinks else None,
            return_lse=lse,
            implementation="pallas_tpu",
        )

    kernels = {f"axkern_attention_tpu_{k}_kernel" for k in ("fwd", "dq", "dkv")}
    assert _lower_value_and_grad(fn, args, wrt) == kernels


# -- short_conv, fused_cross_entropy, ssd, mamba3 ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_short_conv(dtype):
    b, s, c, w = 1, 2048, 4096, 4
    args = [S((b, s, c), dtype), S((w, c), dtype), S((c,), dtype)]

    def fn(x, weight, bias):
        ids = jnp.arange(s)[None, :] // 700 * jnp.ones((b, 1), jnp.int32)
        return short_conv(
            x, weight, bias=bias, segment_ids=ids, activation="silu", implementation="pallas_tpu"
        )

    kernels = {f"axkern_short_conv_tpu_{k}" for k in ("forward", "activation_grad", "backward")}
    assert _lower_value_and_grad(fn, args, (0, 1, 2)) == kernels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", ["plain", "soft cap, z-loss, smoothing, ignore_index"])
def test_fused_cross_entropy(dtype, options):
    n, d, v = 2048, 4096, 32000
    kw = {}
    if options != "plain":
        kw = dict(logits_soft_cap=30.0, logsumexp_weight=1e-4, label_smoothing=0.1, ignore_index=-100)
    args = [S((n, d), dtype), S((d, v), dtype), S((n,), "int32")]

    def fn(x, w, labels):
        return fused_cross_entropy(x, w, labels, reduction=None, implementation="pallas_tpu", **kw)

    # the backward recomputes the logits in XLA
    assert _lower_value_and_grad(fn, args, (0, 1)) == {"axkern_fused_cross_entropy_tpu_stats"}


@pytest.mark.parametrize("n", [300, 50])
def test_fused_cross_entropy_fewer_tokens_than_a_tile(n):
    """One token tile, its lanes a multiple of 128, over fewer tokens (the last lanes unwritten)."""
    d, v = 512, 8192
    args = [S((n, d), "bfloat16"), S((d, v), "bfloat16"), S((n,), "int32")]

    def fn(x, w, labels):
        return fused_cross_entropy(x, w, labels, reduction=None, implementation="pallas_tpu")

    assert _lower_value_and_grad(fn, args, (0, 1)) == {"axkern_fused_cross_entropy_tpu_stats"}


SSD_KERNELS = {f"axkern_ssd_{k}_kernel" for k in ("state", "scan", "state_bwd", "scan_bwd")}


@pytest.mark.parametrize(
    "dtype,blocks",
    [(d, None) for d in DTYPES]
    + [
        ("bfloat16", SSDBlockSizes(128, group_sums="xla")),
        ("bfloat16", SSDBlockSizes(256, group_sums="kernels")),
    ],
    ids=str,
)  # the default (the positions on the lanes) in every dtype; the per-head form (`TpuHeadsLayout`)
# and the positions on the rows in one: the same kernel bodies
def test_ssd(dtype, blocks):
    b, l, h, p, g, n = 1, 2048, 8, 64, 2, 128  # noqa: E741
    args = [
        S((b, l, h, p), dtype),
        S((b, l, h), "float32"),
        S((h,), "float32"),
        S((b, l, g, n), dtype),
        S((b, l, g, n), dtype),
        S((h,), "float32"),
        S((b, l, h, p), dtype),
        S((h,), "float32"),
    ]

    def fn(x, dt, A, B, C, D, z, dt_bias):
        ids = jnp.arange(l)[None, :] // 700 * jnp.ones((b, 1), jnp.int32)
        return ssd(
            x,
            dt,
            A,
            B,
            C,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=True,
            segment_ids=ids,
            implementation="pallas_tpu",
            block_sizes=blocks,
        )

    assert _lower_value_and_grad(fn, args, tuple(range(8))) == SSD_KERNELS


@pytest.mark.parametrize("dtype,group_sums", [("bfloat16", "kernels"), ("float32", "xla")])
def test_ssd_with_the_positions_on_the_lanes(dtype, group_sums):
    # `transposes="kernels"`: x, y, dx, dy as [b, H, P, L], blocks [P, Q] transposed in the kernels
    b, l, h, p, g, n = 1, 2048, 8, 64, 2, 128  # noqa: E741
    args = [S((b, l, h, p), dtype), S((b, l, h), "float32"), S((h,), "float32")]
    args += [S((b, l, g, n), dtype)] * 2
    blocks = SSDBlockSizes(256, group_sums=group_sums, transposes="kernels")

    def fn(x, dt, A, B, C):
        return ssd(x, dt, A, B, C, implementation="pallas_tpu", block_sizes=blocks)

    assert _lower_value_and_grad(fn, args, tuple(range(5))) == SSD_KERNELS


@pytest.mark.parametrize("transposes", ["xla", "kernels"])
def test_ssd_lowers_under_vmap(transposes):
    # a mapped axis becomes the kernels' first grid axis, parallel, in both layouts (TPU interpret
    # mode cannot run the batched grid: its randomised grid order takes the unbatched semantics)
    b, l, h, p, g, n = 1, 1024, 8, 64, 1, 128  # noqa: E741 - chunks of 256: 4
    args = [S((3, b, l, h, p), "bfloat16"), S((3, b, l, h), "float32")]
    args += [S((3, b, l, g, n), "bfloat16")] * 2
    blocks = SSDBlockSizes(256, transposes=transposes)

    def loss(x, dt, B, C):
        y = ssd(x, dt, -jnp.ones((h,)), B, C, implementation="pallas_tpu", block_sizes=blocks)
        return jnp.sum(y.astype(jnp.float32))

    kernels = mosaic_kernels(lower_for_tpu(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))), *args))
    assert {name for name, _ in kernels} == SSD_KERNELS
    for name, module in kernels:
        bounds = re.search(r"iteration_bounds = array<i64: ([0-9, ]+)>", module).group(1)
        assert tuple(int(v) for v in bounds.split(",")) == (3, b, l // 256, h), (name, bounds)
        assert re.findall(r"dimension_semantics<(\w+)>", module)[0] == "parallel", name


@pytest.mark.parametrize(
    "group_sums,grid,semantics",
    [(None, (1, 16, 8), "parallel parallel arbitrary"), ("xla", (1, 8, 16), "parallel parallel parallel")],
)
def test_ssd_group_sums_forms_take_their_grids(group_sums, grid, semantics):
    # the default (dB, dC summed over a group's heads in VMEM) runs heads innermost, the heads
    # axis `arbitrary`; `group_sums="xla"` (`TpuHeadsLayout`) chunks innermost, all parallel
    b, l, h, p, g, n = 1, 2048, 8, 64, 2, 128  # noqa: E741 - chunks of 128: 16
    args = [S((b, l, h, p), "bfloat16"), S((b, l, h), "float32"), S((h,), "float32")]
    args += [S((b, l, g, n), "bfloat16")] * 2
    blocks = SSDBlockSizes(128, group_sums=group_sums)

    def fn(x, dt, A, B, C):
        return ssd(x, dt, A, B, C, implementation="pallas_tpu", block_sizes=blocks)

    kernels = mosaic_kernels(lower_for_tpu(fn, *args))
    assert {name for name, _ in kernels} == {"axkern_ssd_state_kernel", "axkern_ssd_scan_kernel"}
    for name, module in kernels:
        bounds = re.search(r"iteration_bounds = array<i64: ([0-9, ]+)>", module).group(1)
        assert tuple(int(v) for v in bounds.split(",")) == grid, (name, bounds)
        assert re.findall(r"dimension_semantics<(\w+)>", module) == semantics.split(), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rank,lanes,rotation",
    # q, k turned in the kernels: SISO only
    [(0, False, "xla"), (0, True, "xla"), (0, True, "kernel"), (4, False, "xla"), (4, True, "xla")],
    ids=["0", "0-lanes", "0-lanes-rotating", "4", "4-lanes"],
)
def test_mamba3(dtype, rank, lanes, rotation):
    b, l, h, p, n, g, a = 1, 2048, 8, 64, 128, 1, 16  # noqa: E741
    qk = (b, l, g, n) if not rank else (b, l, rank, g, n)
    bias = (h, n) if not rank else (h, rank, n)
    args = [
        S(qk, dtype),
        S(qk, dtype),
        S((b, l, h, p), dtype),
        *(S((b, h, l), "float32") for _ in range(3)),
        S(bias, "float32"),
        S(bias, "float32"),
        S((b, l, h, a), "float32"),
        S((h,), "float32"),
        S((b, l, h, p), dtype),
        *((S((h, rank, p), "float32"),) * (3 if rank else 0)),
    ]

    def fn(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, *mimo):
        ids = jnp.arange(l)[None, :] // 700 * jnp.ones((b, 1), jnp.int32)
        return mamba3(
            q,
            k,
            v,
            adt,
            dt,
            trap,
            q_bias,
            k_bias,
            angles,
            D=D,
            z=z,
            segment_ids=ids,
            mimo=tuple(mimo) or None,
            implementation="pallas_tpu",
            # 128 kernel positions a chunk (128 tokens SISO, 32 at rank 4), on the lanes or the
            # rows; q, k turned by XLA or (SISO) in the kernels
            block_sizes=Mamba3BlockSizes(
                128 // (4 if rank else 1), transposes="kernels" if lanes else "xla", rotation=rotation
            ),
        )

    # SSD's chunk kernels with a per-position decay and scale
    assert _lower_value_and_grad(fn, args, tuple(range(len(args)))) == SSD_KERNELS
