"""The shared kernel helpers on the chip: `core.kernels.log_refined`, the log-sum-exp's `log`
that attention's backward reads back through `p = exp(s - lse)`, within a few float32 ulps of
the float64 log where the platform's own `log` may miss by more."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axkern.core.kernels import log_refined


@pytest.mark.tpu
def test_log_refined_within_a_few_ulps_of_the_float64_log():
    x = np.geomspace(1.0, 1e6, 200_001, dtype=np.float32)
    exact = np.log(x.astype(np.float64))
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    ulp = np.maximum(ulp, np.spacing(np.float32(1)))  # at log(1) = 0: an ulp of 1
    refined = np.asarray(jax.jit(log_refined)(jnp.asarray(x)), np.float64)
    plain = np.asarray(jax.jit(jnp.log)(jnp.asarray(x)), np.float64)
    worst_refined = float(np.max(np.abs(refined - exact) / ulp))
    worst_plain = float(np.max(np.abs(plain - exact) / ulp))
    print(f"{jax.default_backend()}: log_refined {worst_refined:.2f} ulps, jnp.log {worst_plain:.2f} ulps")
    assert worst_refined <= 4.0, (worst_refined, worst_plain)
