"""The command line: `axkern info` and `axkern bench --quick` (the README's main job)."""

from __future__ import annotations

import json
import subprocess
import sys

import axkern
from axkern import cli


def test_info_runs_and_reports_each_op(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "platform" in out and "nvcc" in out and "jax" in out
    assert "fused_cross_entropy: xla" in out  # the typical-shape decision, from explain


def test_bench_quick_writes_every_implementation(tmp_path):
    path = tmp_path / "bench.json"
    assert cli.main(["bench", "--quick", "--repeats", "1", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    rows = data["rows"]
    ce_rows = [r for r in rows if r["op"] == "fused_cross_entropy"]
    assert {r["op"] for r in rows} == set(axkern.ops())
    assert {(r["implementation"], r["pass"]) for r in ce_rows} == {
        ("xla", "fwd"),
        ("xla", "fwd+bwd"),
        ("reference", "fwd"),
        ("reference", "fwd+bwd"),
    }
    for r in rows:
        assert r["ms"] > 0 and r["note"] == ""
        assert r["max_rel_error"] < 1e-4  # float32 quick case against the reference
    assert data["versions"]["jax"] and data["matmul_ceiling_tflops"] > 0


def test_bench_rejects_unknown_op_and_preset():
    proc = subprocess.run(
        [sys.executable, "-m", "axkern.cli", "bench", "no_such_op"], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "unknown op 'no_such_op'" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "axkern.cli", "bench", "fused_cross_entropy", "--preset", "nope"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "unknown preset 'nope'" in proc.stderr


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("axkern") or str(__import__("pathlib").Path(sys.executable).with_name("axkern"))
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "bench" in proc.stdout
