"""benchmarks/diagnostics/triton_launch_sweep.py's capture: tracing an implementation's forward+backward keeps
each SSD kernel's `pallas_call` (kernel, keywords, operand shapes), and a kept call relaunched
with other Triton parameters is the same call."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "triton_launch_sweep.py"
_spec = importlib.util.spec_from_file_location("triton_launch_sweep", _PATH)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

KERNELS = {
    "axkern_ssd_state_kernel",
    "axkern_ssd_scan_kernel",
    "axkern_ssd_scan_bwd_kernel",
    "axkern_ssd_state_bwd_kernel",
    "axkern_ssd_gpu_recurrence",
    "axkern_ssd_gpu_recurrence_bwd",
}


@pytest.mark.parametrize("op", ["mamba3", "ssd"])
def test_the_forward_and_backward_kernels_are_captured_with_their_operands(op):
    label, calls = sweep.captured_calls(op, "quick", None, "pallas_gpu")
    assert label.startswith("quick")
    assert set(calls) == KERNELS
    for kernel, kw, shapes in calls.values():
        assert callable(kernel) and kw["grid"] and shapes
        assert all(isinstance(s, jax.ShapeDtypeStruct) for s in shapes)
    # the chunk-state backward reads the chunk scan's dx and dB beside its own four operands
    assert len(calls["axkern_ssd_state_bwd_kernel"][2]) == 6


def test_operands_are_finite_floats_and_zero_integers():
    shapes = [jax.ShapeDtypeStruct((4, 8), "bfloat16"), jax.ShapeDtypeStruct((3,), "int32")]
    x, ids = sweep.operands(shapes, jax.random.PRNGKey(0))
    assert x.dtype == shapes[0].dtype and bool(jax.numpy.isfinite(x).all())
    assert ids.dtype == shapes[1].dtype and not ids.any()
