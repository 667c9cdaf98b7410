"""benchmarks/diagnostics/compiled_memory.py: the sizes it reads back are those `axkern bench`
reports for the same programs (compiled here for the CPU, the device this machine has), and a
machine without JAX's CUDA plugin is told what to install."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import pytest

from axkern import bench
from axkern.bench import harness

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "compiled_memory.py"
_spec = importlib.util.spec_from_file_location("compiled_memory", _PATH)
compiled_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled_memory)


@pytest.mark.parametrize("op", ["ssd", "fused_cross_entropy_loss"])
def test_rows_are_the_benchs_temporary_memory(op):
    # ssd pulls a random cotangent back; the reduced loss differentiates its own loss
    case = bench.cases_for(op)[0]
    cpu = jax.devices("cpu")[0]
    got = {r["pass"]: r for r in compiled_memory.rows(case, "xla", cpu)}
    assert set(got) == {"fwd", "fwd+bwd"}
    args = case.make(jax.random.PRNGKey(0))
    if case.loss is None:
        both = jax.jit(bench.forward_backward(case, "xla")), (bench.cotangent(case, args), *args)
    else:
        both = jax.jit(bench.loss_and_grad(case, "xla")), args
    want = {
        "fwd": harness._temp_gib(jax.jit(case.forward_for("xla")), args),
        "fwd+bwd": harness._temp_gib(*both),
    }
    for pass_, row in got.items():
        assert "error" not in row, row
        assert row["temp_gib"] == want[pass_] and row["temp_gib"] > 0
        assert row["arguments_gib"] > 0 and row["outputs_gib"] > 0


def test_a_machine_without_the_cuda_plugin_is_told_what_to_install():
    plugins = importlib.util.find_spec("jax_plugins") is not None
    if plugins and importlib.util.find_spec("jax_plugins.xla_cuda13") is not None:
        device = compiled_memory.gpu_device("h200")
        assert device.platform in ("gpu", "cuda") and "H200" in device.device_kind
        return
    with pytest.raises(SystemExit, match=f"jax-cuda13-plugin=={jax.__version__}"):
        compiled_memory.gpu_device("h200")


def test_a_machine_without_libtpu_is_told_what_to_install():
    if importlib.util.find_spec("libtpu") is not None:
        device = compiled_memory.tpu_device("v5e")
        assert device.platform == "tpu" and device.device_kind == "TPU v5 lite"
        return
    with pytest.raises(SystemExit, match=rf"jax\[tpu\]=={jax.__version__}"):
        compiled_memory.tpu_device("v5e")
