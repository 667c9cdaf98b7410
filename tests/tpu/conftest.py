"""The TPU tests run on a TPU with `AXKERN_TEST_TPU=1`, in one process (one program at a time holds
the chip), and are skipped elsewhere; `AXKERN_TEST_TPU=interpret` runs them on a CPU at cut-down
sizes (see tests/tpu/chip.py). The Pallas TPU kernels' cases run first, so that a run stopped by its
time limit has checked them."""

from __future__ import annotations

import os

import jax
import pytest


def _skip_reason() -> str | None:
    mode = os.environ.get("AXKERN_TEST_TPU", "")
    if not mode:
        return "needs a TPU (set AXKERN_TEST_TPU=1 on a TPU machine)"
    if mode == "interpret" or jax.default_backend() == "tpu":
        return None
    return f"needs a TPU: JAX's backend here is {jax.default_backend()} (AXKERN_TEST_TPU=interpret: a CPU dry run)"


def _later(item) -> bool:
    """Whether `item` is a TPU test of another implementation than the Pallas TPU kernel."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return item.get_closest_marker("tpu") is not None and params.get("impl", "pallas_tpu") != "pallas_tpu"


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    for item in items:
        if reason and item.get_closest_marker("tpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
    items.sort(key=_later)  # stable: each file's order kept
