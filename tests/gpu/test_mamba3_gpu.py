"""mamba3's implementations compiled on a real GPU against the oracle rule.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. Oracle: `reference` (the
sequential scan) in float64 on the CPU; the rule's same-dtype reference is `reference` on the
test's dtype. Sizes are a Mamba-3 layer cut down in batch, length and heads; the length is not a
multiple of the chunk. MIMO of rank 2 on every implementation (chunks of 16 tokens: 32 kernel
positions), and of rank 4 on `pallas_gpu` at the bench's chunk (16 tokens: 64 positions, the
largest chunk of its float32 `x`). `mosaic_gpu` (Hopper, SISO, bf16, head dims and states of 64
and 128) at its own sizes, in both forward forms.
"""

from __future__ import annotations

import jax
import pytest

import axkern
from tests.cases.mamba3 import call, make, run
from tests.harness import check_rule, implementations, serving

pytestmark = pytest.mark.gpu

# b, l, h, p, g, n, n_angles
GPU_DIMS = [(1, 700, 8, 64, 1, 128, 32), (2, 300, 4, 32, 2, 64, 16)]


@pytest.mark.parametrize(
    "impl,dtype,rank,dims",
    [
        (i, d, r, dims)
        for i in implementations("mamba3", "gpu")
        if i != "mosaic_gpu"  # below: SISO, bf16, feature dims of 64 and 128 only
        for d in ("bfloat16", "float32")
        for r in (0, 2)
        for dims in GPU_DIMS
    ]
    + [("pallas_gpu", "bfloat16", 4, GPU_DIMS[1])]
    + [("pallas_gpu", "float16", r, GPU_DIMS[0]) for r in (0, 2)],
)
def test_on_gpu_against_oracle(impl, dtype, rank, dims):
    arrays, seg = make(0, *dims, rank, dtype, segments=True)
    chunk = 64 if rank == 0 else 16
    with serving(impl):
        check_rule(
            lambda name, a: run(name, a, seg, None if name == "reference" else chunk),
            impl,
            arrays,
            dtype,
            "mamba3",
        )


# b, l, h, p, g, n, n_angles: lengths not a multiple of the chunk; the 2.7B layer's P and N, two
# groups, P 128
MOSAIC_DIMS = [(1, 700, 8, 64, 1, 128, 32), (2, 300, 4, 64, 2, 64, 16), (1, 300, 2, 128, 1, 64, 16)]


@pytest.mark.parametrize(
    "dims,forward,rotation",
    [(d, None, None) for d in MOSAIC_DIMS]
    + [(MOSAIC_DIMS[0], "stages", None), (MOSAIC_DIMS[2], "fused", None), (MOSAIC_DIMS[0], None, "xla")],
)
def test_mosaic_gpu_on_gpu_against_oracle(dims, forward, rotation):
    # N 128: the fused forward turns q and k itself unless rotation="xla" (or the stages run)
    from axkern.ops.mamba3 import Mamba3BlockSizes

    arrays, seg = make(0, *dims, 0, "bfloat16", segments=True)
    blocks = Mamba3BlockSizes(64, forward=forward, rotation=rotation)
    with serving("mosaic_gpu"):
        check_rule(
            lambda name, a: run(name, a, seg, None if name == "reference" else blocks),
            "mosaic_gpu",
            arrays,
            "bfloat16",
            "mamba3",
        )


def test_explicit_pallas_gpu_is_compiled():
    arrays, _ = make(0, 1, 256, 2, 64, 1, 64, 16, 0, "bfloat16", extras=False)
    d = axkern.explain(lambda a: call("pallas_gpu", a, chunk_size=64), arrays)
    assert d.implementation == "pallas_gpu" and not d.interpret
    y, _ = jax.jit(lambda a: call("pallas_gpu", a, chunk_size=64))(arrays)
    assert y.shape == (1, 256, 2, 64)


@pytest.mark.parametrize("dims", [MOSAIC_DIMS[0], (2, 320, 4, 64, 2, 128, 32)])
def test_mosaic_gpu_rotating_forward_on_gpu_against_oracle(dims):
    # the forward nothing differentiates, where the fused kernel turns q and k itself (with
    # gradients the differentiated forward forms XLA's halves: the tests above): y and the final
    # states against the float64 oracle, and against the same kernel fed XLA's halves within a
    # few roundings of the rotation (cos and sin on the approximate units)
    import numpy as np

    from axkern.ops.mamba3 import Mamba3BlockSizes
    from tests.cases.mamba3 import forward

    arrays, seg = make(1, *dims, 0, "bfloat16", segments=True)

    def values(rotation):
        def fwd(name, a):
            blocks = None if name == "reference" else Mamba3BlockSizes(64, rotation=rotation)
            return forward(name, a, seg, blocks), ()

        return fwd

    with serving("mosaic_gpu"):
        got = check_rule(values("kernel"), "mosaic_gpu", arrays, "bfloat16", "mamba3")[0]
        xla = values("xla")("mosaic_gpu", arrays)[0]
    flat = [jax.tree.leaves(o) for o in (got, xla)]
    assert len(flat[0]) == len(flat[1]) >= 5
    for a, b in zip(*flat, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a) == np.isfinite(b))
        assert np.nanmax(np.abs(a - b)) <= 2**-7 * (np.max(np.abs(b)) + 1e-30), np.nanmax(np.abs(a - b))


def test_mosaic_gpu_rotating_forward_takes_x_with_non_finite_values():
    # the forward nothing differentiates reads `v` as it comes and its kernel takes the
    # non-finite values as 0 (`clean_x`); XLA's halves (rotation="xla") take a cleaned copy:
    # both put NaN where the oracle does and agree elsewhere
    import numpy as np

    from axkern.ops.mamba3 import Mamba3BlockSizes
    from tests.cases.mamba3 import forward

    arrays, seg = make(1, *MOSAIC_DIMS[0], 0, "bfloat16", segments=True)
    v = np.asarray(arrays["v"], np.float32)
    v[0, 100, 1, 3], v[0, 400, 5, 60] = np.nan, np.inf
    arrays = dict(arrays, v=jax.numpy.asarray(v, arrays["v"].dtype))

    def run_with(rotation):
        blocks = None if rotation is None else Mamba3BlockSizes(64, rotation=rotation)
        return [
            np.asarray(o, np.float64) for o in jax.tree.leaves(forward("mosaic_gpu", arrays, seg, blocks))
        ]

    with serving("mosaic_gpu"):
        kernel, xla = run_with("kernel"), run_with("xla")
    want = [np.asarray(o, np.float64) for o in jax.tree.leaves(forward("reference", arrays, seg, None))]
    assert len(kernel) == len(xla) == len(want) >= 5
    for a, b, w in zip(kernel, xla, want, strict=True):
        assert np.all(np.isfinite(a) == np.isfinite(w)) and np.all(np.isfinite(b) == np.isfinite(w))
        assert np.nanmax(np.abs(a - b), initial=0.0) <= 2**-7 * (np.nanmax(np.abs(b), initial=0.0) + 1e-30)
    assert not np.isfinite(want[0]).all()


@pytest.mark.parametrize("n,angles", [(128, 32), (64, 13)])
def test_rotated_parts_compiled_forms_xlas_halves(n, angles):
    # the differentiated forward's halves by the Triton kernel (`rotated_parts`), compiled, against
    # XLA's `operand_parts(value())` on the same GPU: the high halves equal but for the roundings of
    # the turn (cos and sin from different libraries), `hi + lo` within 2^-16 of the value's terms
    import jax.numpy as jnp
    import numpy as np

    from axkern.ops.chunked import mosaic_gpu as ssd_mosaic

    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    b, g, h, length = 2, 2, 8, 320
    u = jax.random.normal(keys[0], (b, g, length, n)).astype(jnp.bfloat16).at[1, 0, 5, 3].set(jnp.nan)
    bias = jax.random.normal(keys[1], (h, n))
    theta = jax.random.uniform(keys[2], (b, h, length, angles), maxval=6.28)
    op = ssd_mosaic.RotatedOperand(u, bias, theta)
    hi, lo = (np.float64(x) for x in jax.jit(ssd_mosaic.rotated_parts)(op))
    # two operands, one kernel: each operand's halves as it alone gets them
    other = ssd_mosaic.RotatedOperand(u[:, ::-1], bias[::-1] * 2, theta)
    pair = [np.float64(x) for x in jax.jit(ssd_mosaic.rotated_parts)(op, other)]
    alone = [np.float64(x) for x in jax.jit(ssd_mosaic.rotated_parts)(other)]
    for got, want in zip(pair, (hi, lo, *alone), strict=True):
        np.testing.assert_array_equal(got, want)
    want_hi, _ = (np.float64(x) for x in jax.jit(ssd_mosaic.operand_parts)(op.value()))
    value = np.float64(jax.jit(op.value)())
    assert np.all(np.isfinite(hi + lo))
    np.testing.assert_array_equal(hi == 0, want_hi == 0)
    assert np.mean(hi == want_hi) > 0.999
    terms = np.abs(np.float64(jnp.repeat(u.astype(jnp.float32), h // g, axis=1) + bias[:, None]))
    terms = np.where(np.isfinite(terms), terms, 0)
    terms = terms + np.flip(terms.reshape(b, h, length, 2, n // 2), -2).reshape(terms.shape)
    # within 2^-16 of the value, or of the turn's rounding of its terms (cos, sin, products)
    bound = 2.0**-16 * np.abs(value) + 2.0**-20 * terms
    assert np.all((np.abs(hi + lo - value) <= bound) | (want_hi == 0))


@pytest.mark.parametrize("a,dtype", [(32, "float32"), (13, "bfloat16")])
def test_angle_kernel_compiled_forms_xlas_angles_and_gradients(a, dtype):
    # `Θ` by the Triton kernel (`common.angle_kernel.angle_thetas`), compiled, against XLA's passes on the same
    # GPU: values modulo 2π against a float64 sum, the largest distance from it at most twice
    # XLA's (plus one float32 rounding of 2π), as the oracle rule, and the gradients in the angles, Δ and the initial angle (NaN
    # exactly at the non-finite angles), with segments and a length that is not a multiple of its
    # block
    import math

    import jax.numpy as jnp
    import numpy as np

    from axkern.ops.mamba3.common import angle_kernel
    from tests.ops.test_mamba3_angle_kernel import _inputs, _xla

    (angles, dt, theta0, seg), key = _inputs(2, 1000, 8, a, jnp.dtype(dtype), True, seed=5)
    got = jax.jit(angle_kernel.angle_thetas)(angles, dt, theta0, seg)
    want = jax.jit(_xla)(angles, dt, theta0, seg)
    # the float64 sums: Θ_0 on the first segment, then each segment's running sum, mod 2π
    a64 = np.float64(angles)
    inc = math.pi * np.tanh(np.where(np.isfinite(a64), a64, 0)) * np.float64(dt).transpose(0, 2, 1)[..., None]
    s = np.asarray(seg)
    exact = np.empty(inc.shape)
    for i in range(s.shape[0]):
        total = np.float64(theta0[i])
        for t in range(s.shape[1]):
            total = (total if t == 0 or s[i, t] == s[i, t - 1] else 0.0) + inc[i, t]
            exact[i, t] = total
    exact = np.mod(exact, 2 * math.pi).transpose(0, 2, 1, 3)

    def distance(x):
        d = np.abs(np.float64(x) - exact)
        return np.minimum(d, 2 * math.pi - d)

    assert distance(got).max() <= 2 * distance(want).max() + 2 * math.pi * 2.0**-24
    g = jax.random.normal(key, got.shape)
    grads = [
        jax.jit(jax.grad(lambda *x, f=f: jnp.sum(f(*x, seg) * g), argnums=(0, 1, 2)))(angles, dt, theta0)
        for f in (angle_kernel.angle_thetas, _xla)
    ]
    for got_g, want_g in zip(*grads, strict=True):
        got_g, want_g = np.float64(got_g), np.float64(want_g)
        np.testing.assert_array_equal(np.isnan(got_g), np.isnan(want_g))
        got_g, want_g = np.nan_to_num(got_g), np.nan_to_num(want_g)
        tol = (2e-2 if dtype == "bfloat16" and got_g.shape == angles.shape else 1e-5) * np.abs(want_g).max()
        np.testing.assert_allclose(got_g, want_g, rtol=0, atol=tol)
