"""Fixtures of the core tests: one real native build per test run, shared by xdist workers."""

from __future__ import annotations

import os

import pytest

from axkern.core import native


@pytest.fixture(scope="session")
def native_cache(tmp_path_factory):
    """A native build cache for the whole run. xdist workers' base temps are siblings, so they
    share their parent's folder; the loader's file lock makes the first build and the rest load it."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "native-cache"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def moe_library(native_cache):
    """The moe library for Hopper in the run's cache: compiled by the real nvcc at most once per run."""
    if native.nvcc() is None:
        pytest.skip("nvcc is not installed on this machine")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AXKERN_CACHE_DIR", str(native_cache))
        return native.build("moe", (9, 0))
