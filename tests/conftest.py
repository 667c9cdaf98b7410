"""Test setup: 8 host devices for the sharded tests and XLA without its slow optimisations on the CPU
(set before JAX starts), fresh warn-once state."""

import gc
import os
import subprocess
import sys

# the device tests (tests/gpu, tests/tpu) let JAX pick the accelerator; the others run on the CPU
_ON_DEVICE = bool(os.environ.get("AXKERN_TEST_GPU") or os.environ.get("AXKERN_TEST_TPU"))
# XLA's elemental fusion emitters compile the CPU tests' programs in much less time than its MLIR
# ones (the default), and the tests compare values by the oracle rule, not the code's speed.
_ELEMENTAL_FUSIONS = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA takes `flag` (an unknown flag in XLA_FLAGS ends the process, so a
    child process tries it)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    try:
        child = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return False
    return child.returncode == 0


if "XLA_FLAGS" not in os.environ:  # (set here, xdist's workers inherit it: one child process a run)
    _flags = ["--xla_force_host_platform_device_count=8"]
    if not _ON_DEVICE and _xla_knows(_ELEMENTAL_FUSIONS):
        _flags.append(_ELEMENTAL_FUSIONS)
    os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "" if _ON_DEVICE else "cpu")
if not _ON_DEVICE:
    # The CPU tests compile hundreds of small programs once each: XLA's backend optimisation
    # passes take most of their time (a third of it without them) and the tests compare
    # values by the oracle rule, not the compiled code's speed.
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
for _var in ("AXKERN_STRICT", "AXKERN_INTERPRET", "AXKERN_IMPL_FUSED_CROSS_ENTROPY"):
    os.environ.pop(_var, None)

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=6, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def _empty_tuning_cache(tmp_path_factory):
    """The tests see no per-user tuning cache: block sizes come from the tables and heuristics."""
    from axkern.core import tuning

    root = tmp_path_factory.mktemp("tuning_cache")
    patch = pytest.MonkeyPatch()
    patch.setattr(tuning, "cache_path", lambda key: root / f"{key}.json")
    yield
    patch.undo()


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_freed_after_each_module():
    """Each test module's compiled programs and traces are dropped when it ends: a worker of
    `pytest -n auto` runs a thousand tests, and the interpret-mode kernels' programs are large, so
    keeping every one for the whole run grows each worker's memory until the machine runs out."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _fresh_warnings():
    from axkern.core import op

    op.reset_warnings()
    yield
    op.reset_warnings()


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ.get("AXKERN_TEST_GPU") else False
    skip = pytest.mark.skip(reason="needs a CUDA GPU (set AXKERN_TEST_GPU=1 on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
