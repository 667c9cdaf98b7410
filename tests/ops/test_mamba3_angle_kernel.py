"""Mamba-3's angles by the Triton kernel (`common.angle_kernel.angle_thetas`) in interpret mode against XLA's
passes (`common.angles.angle_sums`, which the layer's oracle tests carry): `Θ` and its gradients
in `angles`, `Δ` and the initial angle, with segments, lengths that are not a multiple of the
kernel's block, angle counts it widens, 16-bit angles and non-finite ones (taken as 0 in `Θ`, as
the layer's guard expects, their gradients NaN); it lowers for CUDA as two Triton calls; the form is refused where no
kernel runs it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern.ops.chunked.chunks import clean, segment_starts
from axkern.ops.mamba3.blocks import Mamba3BlockSizes
from axkern.ops.mamba3.common import angle_kernel
from axkern.ops.mamba3.common.angles import angle_sums
from tests.cases.mamba3 import call, make
from tests.gpu_lowering import lower_for_cuda


def _xla(angles, dt, theta0, seg):
    """XLA's `Θ` heads first, as the layer forms it without the kernel."""
    inc = math.pi * jnp.tanh(clean(angles.astype(jnp.float32))) * jnp.swapaxes(dt, 1, 2)[..., None]
    return jnp.swapaxes(angle_sums(inc, theta0, seg, 64), 1, 2)


def _inputs(b, length, h, a, dtype, segments, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    angles = (jax.random.normal(keys[0], (b, length, h, a)) * 2).astype(dtype)
    angles = angles.at[0, 3, 0, a - 1].set(jnp.nan).at[b - 1, length - 2, h - 1, 0].set(jnp.inf)
    dt = jax.nn.softplus(jax.random.normal(keys[1], (b, h, length)))
    theta0 = jax.random.uniform(keys[2], (b, h, a), maxval=6.0)
    ids = jnp.cumsum(jax.random.bernoulli(keys[3], 0.05, (b, length)), 1) if segments else None
    return (angles, dt, theta0, segment_starts(ids, b, length)), keys[4]


@pytest.mark.parametrize(
    "b,length,h,a,dtype,segments",
    [
        (2, 200, 3, 5, "float32", True),  # 5 angles widened to 16 columns, 200 positions to 256
        (1, 128, 2, 32, "float32", False),  # two whole blocks, the 2.7B layer's 32 angles
        (2, 77, 2, 16, "bfloat16", True),  # 16-bit angles, a ragged length
    ],
)
def test_the_kernel_forms_xlas_angles_and_gradients(b, length, h, a, dtype, segments):
    (angles, dt, theta0, seg), key = _inputs(b, length, h, a, jnp.dtype(dtype), segments)
    got = angle_kernel.angle_thetas(angles, dt, theta0, seg, interpret=True)
    want = _xla(angles, dt, theta0, seg)
    assert got.shape == (b, h, length, a) and got.dtype == jnp.float32
    # the same sums in another order: equal up to float32 rounding, modulo 2π
    diff = np.abs(np.float64(got) - np.float64(want))
    assert np.all(np.minimum(diff, 2 * math.pi - diff) <= 2e-5)
    assert np.all((got >= 0) & (got < 2 * math.pi))
    if segments:  # a segment after the first starts from 0, not from the carried angle
        assert int(seg.max()) > 0
    g = jax.random.normal(key, got.shape)

    def loss(form):
        return lambda *x: jnp.sum(form(*x, seg) * g)

    kernel = lambda *x: angle_kernel.angle_thetas(*x, interpret=True)  # noqa: E731
    grads = jax.grad(loss(kernel), argnums=(0, 1, 2))(angles, dt, theta0)
    wants = jax.grad(loss(_xla), argnums=(0, 1, 2))(angles, dt, theta0)
    for got_g, want_g in zip(grads, wants, strict=True):
        assert got_g.dtype == want_g.dtype and got_g.shape == want_g.shape
        got_g, want_g = np.float64(got_g), np.float64(want_g)
        # NaN exactly where XLA's is: the non-finite angles' own gradients
        np.testing.assert_array_equal(np.isnan(got_g), np.isnan(want_g))
        assert np.all(np.isfinite(got_g[~np.isnan(got_g)]))
        got_g, want_g = np.nan_to_num(got_g), np.nan_to_num(want_g)
        tol = (2e-2 if dtype == "bfloat16" and got_g.shape == angles.shape else 1e-5) * np.abs(want_g).max()
        np.testing.assert_allclose(got_g, want_g, rtol=0, atol=tol)
    # a non-finite angle adds nothing, and its gradient is NaN (never reported as a number)
    assert np.isnan(float(grads[0][0, 3, 0, a - 1])) and np.isnan(
        float(grads[0][b - 1, length - 2, h - 1, 0])
    )
    assert int(np.isnan(np.float64(grads[0])).sum()) == 2


def test_it_lowers_for_cuda_as_two_triton_calls():
    b, length, h, a = 2, 4096, 8, 32
    args = (
        jax.ShapeDtypeStruct((b, length, h, a), jnp.float32),
        jax.ShapeDtypeStruct((b, h, length), jnp.float32),
        jax.ShapeDtypeStruct((b, h, a), jnp.float32),
        jax.ShapeDtypeStruct((b, length), jnp.int32),
    )

    def f(x, dt, theta0, seg):
        return jnp.sum(angle_kernel.angle_thetas(x, dt, theta0, seg) ** 2)

    text = lower_for_cuda(jax.grad(f, argnums=(0, 1, 2)), *args).as_text()
    calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
    assert len(calls) == 2
    assert sum("axkern_mamba3_angles_bwd" in line for line in calls) == 1


def test_the_layers_angles_are_the_kernels_or_xlas():
    # inside the layer (pallas_gpu in interpret mode) both forms give the same outputs
    arrays, seg = make(0, 1, 70, 2, 16, 1, 16, 4, 0, "float32", segments=True)
    outs = {}
    for form in ("kernel", "xla"):
        with axkern.use(interpret=True):
            outs[form] = call("pallas_gpu", arrays, seg, Mamba3BlockSizes(16, angles=form))
    for a, b in zip(jax.tree.leaves(outs["kernel"]), jax.tree.leaves(outs["xla"]), strict=True):
        np.testing.assert_allclose(np.float64(a), np.float64(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu"])
def test_the_kernels_form_is_refused_where_no_kernel_runs_it(impl):
    arrays, seg = make(0, 1, 20, 2, 16, 1, 16, 4, 0, "float32")
    with pytest.raises(axkern.Unsupported, match="angles='kernel': only mosaic_gpu and pallas_gpu"):
        with axkern.use(interpret=True):
            call(impl, arrays, seg, Mamba3BlockSizes(16, angles="kernel"))


def test_programs_of_some_angles_each_form_the_same():
    # `cols=16`: two programs for 32 angles (each its columns; `dΔ` summed over them after)
    (angles, dt, theta0, seg), key = _inputs(1, 150, 2, 32, jnp.float32, True)
    g = jax.random.normal(key, (1, 2, 150, 32))
    outs = []
    for cols in (None, 16):
        f = lambda *x, cols=cols: angle_kernel.angle_thetas(*x, seg, cols=cols, interpret=True)  # noqa: E731
        outs.append(
            (
                f(angles, dt, theta0),
                *jax.grad(lambda *x, f=f: jnp.sum(f(*x) * g), (0, 1, 2))(angles, dt, theta0),
            )
        )
    for a, b in zip(*outs, strict=True):  # (the products' sums may group differently)
        a, b = np.float64(a), np.float64(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=4e-6 * np.nanmax(np.abs(b)))


def test_tiles_that_triton_cannot_take_are_refused():
    (angles, dt, theta0, seg), _ = _inputs(1, 70, 2, 32, jnp.float32, False)
    for bad in (dict(cols=24), dict(cols=8), dict(rows=48), dict(rows=8)):
        with pytest.raises(ValueError, match="power of two of at least 16"):
            angle_kernel.angle_thetas(angles, dt, theta0, seg, interpret=True, **bad)
    # no positions: nothing to sum
    empty = angle_kernel.angle_thetas(angles[:, :0], dt[:, :, :0], theta0, seg[:, :0], interpret=True)
    assert empty.shape == (1, 2, 0, 32)
