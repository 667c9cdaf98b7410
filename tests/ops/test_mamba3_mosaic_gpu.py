"""mamba3 `mosaic_gpu`: SSD's Mosaic GPU kernels with the rotated `q`, `k` as two bf16 halves.
The kernels have no CPU interpret mode (they run in tests/gpu): here the layer and its gradients
lower for CUDA in both forward forms, its arithmetic (`chunked.mosaic_gpu.EmulatedLayout`: the
kernels' roundings, `q`, `k` as the same halves, exact products) holds the oracle rule through the
whole layer, the halves hold what they should, and the dispatcher refuses what the kernels cannot
take, with the reason. The forward nothing differentiates turns q and k in its kernel
(`chunked/mosaic_gpu/operands.py`): it lowers so, and what runs around it (the state's columns
reordered, the rotation's operand, its halves by the Triton kernel `rotated_parts` in interpret
mode, the rotation's backward in XLA) holds the oracle rule with the kernels' arithmetic."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern.ops.chunked import mosaic_gpu as ssd_mosaic
from axkern.ops.chunked.mosaic_gpu import operands
from axkern.ops.chunked.mosaic_gpu import rotation_kernel as parts_kernel
from axkern.ops.mamba3 import OP, Mamba3BlockSizes, mosaic_gpu
from axkern.ops.mamba3 import pallas_gpu as mamba3_pallas_gpu
from axkern.ops.mamba3.common import kernel_core as mamba3_kernel_core
from axkern.ops.mamba3.common import rotation as mamba3_rotation
from tests.cases.mamba3 import call, make, run
from tests.gpu_lowering import lower_for_cuda
from tests.harness import check_rule

needs_mosaic = pytest.mark.skipif(
    ssd_mosaic.IMPORT_ERROR is not None,
    reason=f"Pallas Mosaic GPU: {ssd_mosaic.IMPORT_ERROR}",
)


def _positional(a, seg):
    """The implementation's arguments (`reference.mamba3`'s) from `make`'s SISO dict."""
    return (
        *(a[n][:, :, None] for n in ("q", "k")),
        *(a[n] for n in ("v", "adt", "dt", "trap")),
        *(a[n][:, None] for n in ("q_bias", "k_bias")),
        a["angles"],
        a["D"],
        a["z"],
        seg,
        a["angle_state"],
        a["ssm_state"],
        a["k_state"][:, None],
        a["v_state"],
        None,
        None,
        None,
    )


@needs_mosaic
@pytest.mark.parametrize("forward,kernels", [("stages", 4), ("fused", 3)])
def test_the_layer_and_its_gradients_lower_for_cuda(forward, kernels):
    arrays, seg = make(0, 1, 200, 2, 64, 1, 128, 32, 0, "bfloat16")

    def f(a):
        y, *final = mosaic_gpu.mamba3(*_positional(a, seg), block_sizes=Mamba3BlockSizes(64, forward=forward))
        return jnp.sum(y.astype(jnp.float32)) + sum(jnp.sum(s) for s in final)

    text = lower_for_cuda(jax.grad(f), arrays).as_text()
    # forward: the chunk state and scan, or the fused kernel; backward: the chunk scan's and the
    # chunk state's (the recurrences are pallas_gpu's Triton kernels)
    assert len(re.findall(r"stablehlo.custom_call @mosaic_gpu", text)) == kernels
    assert ("axkern_ssd_mosaic_gpu_forward" in text) == (forward == "fused")
    # q and k enter as two bf16 halves, the low half formed from the high one's bits: in XLA
    # with the stages (XLA rotates), with the fused forward (the rotating core) by one Triton
    # kernel for both q and k from the unrotated values, biases and angles (`rotated_parts`)
    assert ("stablehlo.bitcast_convert" in text) == (forward == "stages")
    triton = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
    assert sum("axkern_ssd_rotated_parts" in line for line in triton) == (forward == "fused")
    # with the fused forward (the rotating core) both backward kernels take the angles ([b, h, L,
    # A] float32, 32 angles) and return dB, dC turned back (the forward's take none; a kernel
    # writing an output in place, as the state backward's dx, is not named in its call)
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    operands = [line.rsplit(":", 1)[-1].split("->")[0] for line in calls]
    with_angles = [o for o in operands if "tensor<1x2x256x32xf32>" in o]
    assert len(with_angles) == (2 if forward == "fused" else 0)


@needs_mosaic
@pytest.mark.parametrize("rotation", ["kernel", "xla"])
def test_the_forward_alone_lowers_with_the_rotation_in_the_kernel_or_xla(rotation):
    # nothing differentiates it: the fused kernel turns q and k itself (no halves formed in XLA;
    # XLA still turns the last position's k, the final state's), or with rotation="xla" takes
    # XLA's halves
    arrays, seg = make(0, 1, 200, 2, 64, 1, 128, 32, 0, "bfloat16")

    def f(a):
        return mosaic_gpu.mamba3(*_positional(a, seg), block_sizes=Mamba3BlockSizes(64, rotation=rotation))[0]

    text = lower_for_cuda(f, arrays).as_text()
    assert len(re.findall(r"stablehlo.custom_call @mosaic_gpu", text)) == 1
    assert ("stablehlo.bitcast_convert" in text) == (rotation == "xla")


def test_the_halves_hold_the_float32_value():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 64, 16)) * jnp.logspace(-3, 3, 16)
    parts = jax.jit(ssd_mosaic.operand_parts)(x)
    assert [(a.shape, a.dtype) for a in parts] == [(x.shape, jnp.bfloat16)] * 2
    hi, lo = (np.asarray(a, np.float64) for a in parts)
    np.testing.assert_array_equal(hi, np.asarray(x.astype(jnp.bfloat16), np.float64))  # rounded
    # what the rounding lost, itself rounded: hi + lo within 2^-16 of x (bf16 alone: 2^-8)
    exact = np.asarray(x, np.float64)
    assert np.all(np.abs(hi + lo - exact) <= 2.0**-16 * np.abs(exact))
    assert np.count_nonzero(lo) > 0.9 * lo.size
    # a 16-bit array is its own one part
    b16 = x.astype(jnp.bfloat16)
    assert ssd_mosaic.operand_parts(b16) == (b16,)


@pytest.mark.parametrize(
    "dims, segments",
    [
        # b, l, h, p, g, n, angles: a length not a multiple of the chunk, 2 groups, segments
        ((1, 150, 4, 64, 2, 64, 16), True),
        ((1, 200, 2, 64, 1, 128, 32), True),  # the 2.7B layer's P and N, 32 angles
    ],
)
def test_the_kernels_arithmetic_holds_the_oracle_rule_through_the_layer(monkeypatch, dims, segments):
    # the layer pallas_gpu runs, with its chunk kernels replaced by the Mosaic kernels' arithmetic
    # (what `mosaic_gpu` runs, `q` and `k` as their halves): y, the four final states and every
    # gradient against the float64 oracle (tests/test_mamba3_operand_precision.py: rounding q
    # and k to bf16 instead puts them further from it; P 128 in
    # benchmarks/diagnostics/mamba3_operand_precision.py)
    arrays, seg = make(0, *dims, 0, "bfloat16", segments=segments)
    _emulate(monkeypatch, ssd_mosaic.EmulatedLayout)
    with axkern.use(interpret=True):
        check_rule(_runner(seg), "pallas_gpu", arrays, "bfloat16", "mamba3", interpret=True)


def _emulate(monkeypatch, layout):
    """`pallas_gpu`'s layer with its chunk kernels replaced by `layout`'s."""
    original = mamba3_kernel_core.kernel_core
    monkeypatch.setattr(mamba3_pallas_gpu, "kernel_core", lambda _layout, **kw: original(layout, **kw))


def _runner(seg):
    return lambda name, a, **_: run(name, a, seg, None if name == "reference" else 64)


def _h200_spec(head_dim=64, state=128, dtype="bfloat16", rank=1, mimo=False):
    dims = {
        "batch": 1,
        "length": 256,
        "heads": 4,
        "head_dim": head_dim,
        "groups": 1,
        "state": state,
        "rank": rank,
        "n_angles": 16,
    }
    spec = OP.spec(dims, dtype, segments=False, mimo=mimo)
    return dataclasses.replace(spec, platform="gpu", device_key="nvidia_h200", device_kind="NVIDIA H200")


def test_it_refuses_what_the_kernels_cannot_take_with_the_reason():
    if ssd_mosaic.IMPORT_ERROR is None:
        assert mosaic_gpu.supports(_h200_spec()) is None
    assert "MIMO" in mosaic_gpu.supports(_h200_spec(rank=2, mimo=True))
    assert "Hopper" in mosaic_gpu.supports(
        dataclasses.replace(_h200_spec(), device_key="nvidia_a100", device_kind="A100")
    )
    assert "fp16's range" in mosaic_gpu.supports(_h200_spec(dtype="float16"))
    assert "head_dim=32" in mosaic_gpu.supports(_h200_spec(head_dim=32))
    # with q, k as two tiles each, the scan backward's tiles fit at the sizes SSD's do
    sizes = (64, 128, 192, 256)
    fits = {(p, n) for p in sizes for n in sizes if ssd_mosaic.dims_reason(p, n, 2) is None}
    assert fits == {(64, 64), (64, 128), (128, 64)}
    assert "shared memory" in mosaic_gpu.supports(_h200_spec(128, 128))
    # the fused forward fits at each of them (at P 64, N 128 with no byte to spare)
    assert all(ssd_mosaic.fused_fits(p, n, 2) for p, n in fits)
    arrays, seg = make(0, 1, 64, 2, 64, 1, 64, 16, 0, "bfloat16")
    args = _positional(arrays, seg)
    for blocks, match in [
        (Mamba3BlockSizes(32), "chunk_size=32"),
        (Mamba3BlockSizes(64, rotation_backward="kernel"), "only pallas_gpu"),
    ]:
        with pytest.raises(axkern.Unsupported, match=match):
            mosaic_gpu.mamba3(*args, block_sizes=blocks)
    with pytest.raises(axkern.Unsupported, match="interpret mode"):
        mosaic_gpu.mamba3(*args, block_sizes=Mamba3BlockSizes(64), interpret=True)
    # the rotating forward: column halves of whole tiles (N a multiple of 128), within shared
    # memory (at P 64, N 128 it fits with B's and C's halves in one slot), the fused form, bf16
    assert ssd_mosaic.rotation_reason(64, 128) is None
    assert "multiple of 128" in ssd_mosaic.rotation_reason(64, 64)
    assert "shared memory" in ssd_mosaic.rotation_reason(128, 128)
    with pytest.raises(axkern.Unsupported, match="rotation='kernel': state=64"):
        mosaic_gpu.mamba3(*args, block_sizes=Mamba3BlockSizes(64, rotation="kernel"))
    stages = Mamba3BlockSizes(64, forward="stages", rotation="kernel")
    # `explain` says where q and k are turned, and why not in the kernel
    says = OP.implementations["mosaic_gpu"].backward
    assert "turns q, k itself" in says(_h200_spec(), Mamba3BlockSizes(64))
    assert "backward kernels turn dq, dk back" in says(_h200_spec(), Mamba3BlockSizes(64))
    assert "state=64: the kernel turns column halves" in says(_h200_spec(state=64), Mamba3BlockSizes(64))
    assert "rotation='xla'" in says(_h200_spec(), Mamba3BlockSizes(64, rotation="xla"))
    # and how it forms the angles: one Triton kernel unless XLA's passes are asked for
    assert "Θ by one Triton kernel" in says(_h200_spec(), Mamba3BlockSizes(64))
    assert "Θ by XLA's passes (angles='xla')" in says(_h200_spec(), Mamba3BlockSizes(64, angles="xla"))
    gpu_says = OP.implementations["pallas_gpu"].backward
    assert "Θ by one Triton kernel" in gpu_says(_h200_spec(), Mamba3BlockSizes(64))
    assert "only the fused forward" in mosaic_gpu.rotation_reason(stages, 64, 128, False, jnp.bfloat16)
    with pytest.raises(axkern.Unsupported, match="MIMO"):
        mosaic_gpu.mamba3(*args[:16], *[jnp.ones((2, 2, 64))] * 3, block_sizes=Mamba3BlockSizes(64))
    # the forward's forms are mosaic_gpu's: the others refuse them by name
    small, _ = make(0, 1, 32, 2, 16, 1, 16, 2, 0, "float32", extras=False)
    for impl in ("xla", "pallas_gpu"):
        with pytest.raises(axkern.Unsupported, match="only mosaic_gpu has forward forms"):
            with axkern.use(interpret=True):
                call(impl, small, chunk_size=Mamba3BlockSizes(16, forward="fused"))
        with pytest.raises(
            axkern.Unsupported, match="only mosaic_gpu and pallas_tpu choose where q and k are rotated"
        ):
            with axkern.use(interpret=True):
                call(impl, small, chunk_size=Mamba3BlockSizes(16, rotation="xla"))
    assert "forward must be one of" in Mamba3BlockSizes(64, forward="one").validate(_h200_spec())
    # first in the GPU's order for bf16 inputs, then pallas_gpu (MIMO falls to it); fp16 and
    # float32 take xla
    assert OP.default_order["gpu"](_h200_spec()) == ("mosaic_gpu", "pallas_gpu", "xla")
    assert OP.default_order["gpu"](_h200_spec(dtype="float16")) == ("xla",)


def test_a_rotated_operand_is_the_rotation_and_its_backward_is_autodiffs():
    # `RotatedOperand` (what the rotating forward kernel forms, and XLA's halves elsewhere):
    # `rotate(u + bias, Θ)` on the pairs (i, i + N/2), u per group, bias and Θ per head
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    b, g, h, length, n, a = 2, 2, 4, 8, 16, 5
    u = jax.random.normal(keys[0], (b, g, length, n)).astype(jnp.bfloat16)
    bias = jax.random.normal(keys[1], (h, n))
    theta = jax.random.uniform(keys[2], (b, h, length, a), maxval=6.28)

    def plain(u, bias, theta):
        w = jnp.repeat(u.astype(jnp.float32), h // g, axis=1) + bias[:, None]
        return mamba3_rotation.rotate(w, theta, True)

    op = ssd_mosaic.RotatedOperand(u, bias, theta)
    assert op.shape == (b, h, length, n)
    np.testing.assert_allclose(op.value(), plain(u, bias, theta), rtol=1e-6, atol=1e-6)
    cot = jax.random.normal(keys[3], (b, h, length, n))
    hi, lo = (np.float64(x) for x in ssd_mosaic.operand_parts(op.parts()))
    assert np.all(np.abs(hi + lo - np.float64(op.value())) <= 2.0**-16 * np.abs(np.float64(op.value())))
    got = op.cotangent(cot)
    want = jax.vjp(plain, u, bias, theta)[1](cot)
    for name, x, y in zip(("du", "dbias", "dtheta"), (got.u, got.bias, got.theta), want, strict=True):
        np.testing.assert_allclose(
            np.float32(x), np.float32(y), rtol=2e-2 if name == "du" else 1e-5, atol=1e-5
        )
    # the column orders: SISO's neighbouring pairs to halves and back
    x = jnp.arange(8)
    np.testing.assert_array_equal(ssd_mosaic.pairs_to_halves(x), [0, 2, 4, 6, 1, 3, 5, 7])
    np.testing.assert_array_equal(ssd_mosaic.halves_to_pairs(ssd_mosaic.pairs_to_halves(x)), x)


@pytest.mark.parametrize("n,a", [(64, 13), (64, 32)])  # 16 of 32 columns turned; all of them
def test_the_parts_kernel_forms_the_halves_of_the_rotation(monkeypatch, n, a):
    # `rotated_parts` (the differentiated forward's halves on the GPU; interpret mode here) against
    # XLA's `operand_parts(value())`: the same high halves, `hi + lo` within 2^-16 of the rotated
    # value's terms; an infinite `u` (its partner's column too), a turned pair that overflows and
    # NaN in a column no angle turns give 0 halves, as XLA's
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    b, g, h, length = 2, 2, 4, 128
    half = n // 2
    u = (jax.random.normal(keys[0], (b, g, length, n)) * jnp.logspace(-2, 2, n)).astype(jnp.bfloat16)
    u = u.at[0, 1, 3, 5].set(jnp.inf).at[1, 0, 9, half - 1].set(jnp.nan)
    u = u.at[1, 0, 7, 2].set(3e38).at[1, 0, 7, half + 2].set(3e38)
    bias = jax.random.normal(keys[1], (h, n))
    theta = jax.random.uniform(keys[2], (b, h, length, a), maxval=6.28)
    theta = theta.at[1, :2, 7, 2].set(7 * np.pi / 4)  # group 0's heads: the pair turns to ~4.2e38
    op = ssd_mosaic.RotatedOperand(u, bias, theta, same_angles=True)
    other = ssd_mosaic.RotatedOperand(u[:, ::-1], bias[::-1] * 2, theta, same_angles=True)
    assert ssd_mosaic.parts_kernel_reason(op, other) is None
    assert parts_kernel.turned_columns(13, 32) == 16 and parts_kernel.turned_columns(32, 64) == 32
    assert parts_kernel.turned_columns(13, 64) == 32 and parts_kernel.turned_columns(40, 64) == 64
    alone = ssd_mosaic.rotated_parts(op, interpret=True)
    both = ssd_mosaic.rotated_parts(op, other, interpret=True)
    for x, y in zip(alone, both[:2], strict=True):  # one operand or two: the same halves
        np.testing.assert_array_equal(np.float32(x), np.float32(y))
    # one kernel for both where both turn by the same angles (`parts_with`), else one each
    calls = []
    original = parts_kernel.rotated_parts
    monkeypatch.setattr(
        operands, "rotated_parts", lambda *o, **kw: calls.append(len(o)) or original(*o, **kw)
    )
    paired = op.parts_with(other, True, kernel=True, interpret=True)
    np.testing.assert_array_equal(np.float32(paired[1].hi), np.float32(both[2]))
    assert paired[0].theta.shape == (b, h, length, 32) and calls == [2]
    apart = dataclasses.replace(other, same_angles=False)
    np.testing.assert_array_equal(
        np.float32(op.parts_with(apart, kernel=True, interpret=True)[1].lo), np.float32(both[3])
    )
    assert calls == [2, 1, 1]
    for o, (hi, lo) in ((op, both[:2]), (other, both[2:])):
        hi, lo = np.float64(hi), np.float64(lo)
        want_hi = np.float64(ssd_mosaic.operand_parts(o.value())[0])
        value = np.float64(o.value())
        terms = np.abs(np.float64(jnp.repeat(o.u.astype(jnp.float32), h // g, axis=1) + o.bias[:, None]))
        terms = terms + np.flip(terms.reshape(b, h, length, 2, half), -2).reshape(terms.shape)
        assert np.all(np.isfinite(hi + lo)) and np.count_nonzero(lo) > 0.9 * lo.size
        np.testing.assert_array_equal(hi == 0, want_hi == 0)  # the zeroed values: non-finite in XLA too
        assert np.mean(hi == want_hi) > 0.999
        # within 2^-16 of the value, or of the turn's rounding of its terms (cos, sin, products)
        bound = 2.0**-16 * np.abs(value) + 2.0**-20 * np.where(np.isfinite(terms), terms, 0)
        assert np.all((np.abs(hi + lo - value) <= bound) | (want_hi == 0))
    hi = np.float64(both[0])
    assert np.all(hi[0, 2:, 3, [5, half + 5]] == 0)  # the infinite u and its partner
    assert np.all(hi[1, :2, 9, [half - 1, n - 1]] == 0)  # NaN past the turned columns, its partner
    assert np.all(hi[1, :2, 7, 2] == 0)  # w0 cos - w1 sin overflows (its partner cancels: finite)
    # what it refuses (XLA forms those), and refuses to be called with
    odd = ssd_mosaic.RotatedOperand(u[..., :48], bias[:, :48], theta)
    assert "power of two" in ssd_mosaic.parts_kernel_reason(odd)
    short = ssd_mosaic.RotatedOperand(u[:, :, :100], bias, theta[:, :, :100])
    assert "not a multiple of 32" in ssd_mosaic.parts_kernel_reason(short)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        ssd_mosaic.rotated_parts(short, interpret=True)
    f32 = ssd_mosaic.RotatedOperand(u.astype(jnp.float32), bias, theta)
    assert "16-bit" in ssd_mosaic.parts_kernel_reason(f32)
    assert "angles are not" in ssd_mosaic.parts_kernel_reason(
        op, dataclasses.replace(other, theta=theta[..., :4])
    )
    assert "at most" in ssd_mosaic.parts_kernel_reason(
        dataclasses.replace(op, theta=jnp.zeros((b, h, length, half + 1)))
    )


def test_the_rotating_forwards_layer_holds_the_oracle_rule(monkeypatch):
    # what `rotation="kernel"` runs around its kernels (the state's columns reordered, q and k per
    # group with the biases and angles to the kernels, the backward's halves by `rotated_parts` in
    # interpret mode and the rotation's backward from them), with the kernels' arithmetic in XLA:
    # y, the final states, every gradient
    arrays, seg = make(0, 1, 100, 4, 64, 2, 128, 32, 0, "bfloat16", segments=True)
    monkeypatch.setattr(
        mamba3_pallas_gpu,
        "kernel_core",
        lambda _layout, **kw: mosaic_gpu.rotating_core(
            ssd_mosaic.EmulatedLayout, kw["dtype"], interpret=True, angle_kernel=kw["angle_kernel"]
        ),
    )
    with axkern.use(interpret=True):
        check_rule(_runner(seg), "pallas_gpu", arrays, "bfloat16", "mamba3", interpret=True)
