"""Levanter's `short_conv`, computed by `axkern.positional.short_conv`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from ..ops.short_conv import short_conv_positional
from .common import map_impl, needs_platform

_CONV_IMPLS = {"reference": "reference", "triton_gpu": "pallas_gpu"}
_CONV_UNAVAILABLE = {"triton_gpu": needs_platform("gpu")}
DEFAULT_BATCH_AXES: tuple[str, ...] = ("replica_dcn", "data", "expert")


def short_conv(
    weight: jax.Array,
    x: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    implementation: Any = None,
    exact_reference_rounding: bool = True,
    batch_axes: Sequence[str] = DEFAULT_BATCH_AXES,
) -> jax.Array:
    """Levanter's `levanter.kernels.triton.short_conv.short_conv(weight, x, segment_ids)`, computed by
    `axkern.positional.short_conv(x, weight, segment_ids=...)`.

    `out[b, t, c] = sum_lag weight[lag, c] * x[b, t - lag, c]`, a tap into another segment
    dropped. `implementation`: `"reference"` or `"triton_gpu"` (mapped to `pallas_gpu`; off a GPU
    skipped in a sequence, a `RuntimeError` alone, as in Levanter).
    `exact_reference_rounding` and `batch_axes` are accepted: axkern accumulates the taps in
    float32 (Levanter's `exact_reference_rounding=False`) and shards as the inputs are laid out.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> from axkern.levanter import short_conv
    >>> short_conv(jnp.ones((2, 2)), jnp.ones((1, 6, 2)))[0, :, 0].tolist()  # weight [width, channels], x [batch, seq, channels]
    [1.0, 2.0, 2.0, 2.0, 2.0, 2.0]

    ```
    """
    fn = "axkern.levanter.short_conv"
    if weight.dtype != x.dtype:
        raise ValueError(
            f"{fn}: weight and x must share a dtype; got weight={weight.dtype}, x={x.dtype}. "
            "Cast to a common dtype before calling."
        )
    impl = map_impl(fn, implementation, _CONV_IMPLS, _CONV_UNAVAILABLE, error=RuntimeError)
    del exact_reference_rounding, batch_axes
    return short_conv_positional(x, weight, segment_ids=segment_ids, implementation=impl)
