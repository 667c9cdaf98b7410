"""benchmarks/diagnostics/kernel_times.py's HLO reading (each fusion of a compiled program named with the JAX
operation it came from, under the names the profiler reports its kernels by) and its timeline of
kernel spans."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "kernel_times.py"
_spec = importlib.util.spec_from_file_location("kernel_times", _PATH)
kernel_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_times)


def test_each_row_gets_the_operations_its_fusions_came_from():
    def f(x):
        return jnp.sum(jnp.tanh(x) * 3.0, axis=0)

    hlo = jax.jit(f).lower(jnp.ones((64, 32))).compile().as_text()
    sources = kernel_times.fusion_sources(hlo)
    assert "jit(f)/tanh" in sources.values()
    # a kernel reported as `name.N` or `name_N` finds its instruction, whichever the HLO spells
    name = next(n for n in sources if "fusion" in n)
    rows = [
        {"kernel": "a", "names": [name.replace("_", ".", 1)]},
        {"kernel": "b", "names": [name]},
        {"kernel": "c", "names": ["not_in_the_program"]},
    ]
    kernel_times.add_sources(rows, sources)
    assert rows[0]["sources"] == rows[1]["sources"] == [sources[name]]
    assert "sources" not in rows[2]


def test_timeline_counts_overlapping_kernels_once_and_finds_the_gaps():
    # two calls: a, b overlapping b's predecessor (an early launch), then c; 5 us between calls
    spans = [
        (0.0, 10.0, "a"),
        (8.0, 20.0, "b"),
        (22.0, 100.0, "c"),
        (105.0, 115.0, "a"),
        (113.0, 125.0, "b"),
        (126.0, 200.0, "c"),
    ]
    t = kernel_times.timeline(list(reversed(spans)), calls=2)
    assert t["window_ms_per_call"] == 200.0 / 1e3 / 2
    assert t["idle_ms_per_call"] == (2.0 + 5.0 + 1.0) / 1e3 / 2
    assert t["busy_ms_per_call"] == (200.0 - 8.0) / 1e3 / 2
    assert t["longest_gaps"][0] == {"us": 5.0, "before": "a"}
    assert [g["before"] for g in t["longest_gaps"]] == ["a", "c", "c"]
    assert kernel_times.timeline([], calls=3) == {}


def test_each_row_gets_the_bytes_its_fusions_read_and_write():
    def f(x, y):
        return jnp.tanh(x) * y + 1.0

    x = jnp.ones((256, 128), jnp.float32)
    y = jnp.ones((256, 128), jnp.bfloat16)
    hlo = jax.jit(f).lower(x, y).compile().as_text()
    sizes = kernel_times.fusion_bytes(hlo)
    name, (read, written) = next((n, s) for n, s in sizes.items() if "fusion" in n)
    assert read == 256 * 128 * (4 + 2) and written == 256 * 128 * 4
    rows = [
        {"kernel": "a", "names": [name], "ms_per_call": 0.001},
        {"kernel": "b", "names": [name, "not_in_the_program"], "ms_per_call": 0.001},
    ]
    kernel_times.add_bytes(rows, sizes)
    assert rows[0]["gb_in"] == read / 1e9 and rows[0]["gb_out"] == written / 1e9
    assert abs(rows[0]["gb_per_s"] - (read + written) / 1e9 / 1e-6) < 1e-6
    assert "gb_in" not in rows[1]  # a row is given bytes only where every kernel of it is found
