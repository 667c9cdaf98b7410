"""`core.kernels`' numerics helpers on the CPU (tests/tpu/test_kernels_tpu.py: on a chip)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from axkern.core.kernels import log_refined, row_dot


def test_log_refined_matches_the_float64_log_within_two_ulps():
    x = np.geomspace(1.0, 1e6, 10_001, dtype=np.float32)
    exact = np.log(x.astype(np.float64))
    ulp = np.maximum(np.spacing(np.abs(exact).astype(np.float32)), np.spacing(np.float32(1)))
    got = np.asarray(log_refined(jnp.asarray(x)), np.float64)
    assert np.max(np.abs(got - exact) / ulp) <= 2.0


def test_log_refined_keeps_nan_and_the_log_of_one():
    got = np.asarray(log_refined(jnp.asarray([1.0, np.nan], jnp.float32)))
    assert got[0] == 0.0 and np.isnan(got[1])


def test_row_dot_is_the_float32_sum_of_products():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5, 64)).astype(np.float32)
    b = rng.standard_normal((3, 5, 64)).astype(np.float32)
    exact = np.sum(a.astype(np.float64) * b, axis=-1)
    got = np.asarray(row_dot(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)))
    assert got.dtype == np.float32 and got.shape == (3, 5)
    rounded = np.sum(
        np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
        * np.asarray(jnp.asarray(b, jnp.bfloat16), np.float64),
        -1,
    )
    np.testing.assert_allclose(got, rounded, rtol=1e-5, atol=1e-5)
    assert np.asarray(row_dot(jnp.asarray(a), jnp.asarray(b), keepdims=True)).shape == (3, 5, 1)
    np.testing.assert_allclose(
        np.asarray(row_dot(jnp.asarray(a), jnp.asarray(b))), exact, rtol=1e-5, atol=1e-5
    )
