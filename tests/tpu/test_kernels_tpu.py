"""The shared kernel helpers on the chip: `core.kernels.log_refined`, the log-sum-exp's `log`
that attention's backward reads back through `p = exp(s - lse)`: its absolute error is the
relative error of every probability of the row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axkern.core.kernels import log_refined


@pytest.mark.tpu
def test_log_refined_within_1e_5_of_the_float64_log():
    """Within 1e-5 over [1, 1e6] (a row's sum of probabilities before normalising), the bound
    its `exp` sets; `jnp.log`'s own error printed beside it."""
    x = np.geomspace(1.0, 1e6, 200_001, dtype=np.float32)
    exact = np.log(x.astype(np.float64))
    refined = np.asarray(jax.jit(log_refined)(jnp.asarray(x)), np.float64)
    plain = np.asarray(jax.jit(jnp.log)(jnp.asarray(x)), np.float64)
    worst, worst_plain = float(np.max(np.abs(refined - exact))), float(np.max(np.abs(plain - exact)))
    print(f"{jax.default_backend()}: log_refined {worst:.2e}, jnp.log {worst_plain:.2e} (absolute)")
    assert worst <= 1e-5, (worst, worst_plain)
