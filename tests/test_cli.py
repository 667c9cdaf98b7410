"""The command line: `axkern info` and `axkern bench --quick` (the README's main job)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import axkern
from axkern import cli
from tests.cluster import launch


def test_info_runs_and_reports_each_op(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "platform" in out and "nvcc" in out and "jax" in out
    assert "fused_cross_entropy: xla" in out  # the typical-shape decision, from explain
    assert re.search(r"processes\s+│ 1 \(this is process 0\)", out)
    assert re.search(r"global devices\s+│ 8 ", out)  # conftest's 8 host devices


def test_info_joins_a_cluster_and_counts_its_processes_and_devices(tmp_path):
    def command(process_id, coordinator):
        flags = f"--coordinator {coordinator} --num-processes 2 --process-id {process_id}"
        return [sys.executable, "-m", "axkern.cli", "info", *flags.split()]

    run = launch(command, 2, tmp_path, local_devices=3, timeout_s=240)
    assert run.returncodes == [0, 0], run.tail(0) + run.tail(1)
    for process, out in enumerate(run.stdout):
        assert re.search(rf"processes\s+│ 2 \(this is process {process}\)", out), out
        assert re.search(r"global devices\s+│ 6 ", out), out
        assert re.search(r"device\s+│ cpu x3 in this process", out), out


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


def test_bench_peers_report_why_they_did_not_run(tmp_path):
    # no CUDA torch here: every peer gets a row that says why, and the bench still succeeds
    out = tmp_path / "peers.json"
    assert cli.main(["bench", "fused_cross_entropy", "--peers", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    peers = [r for r in rows if r["implementation"].startswith("peer:")]
    assert {r["implementation"] for r in peers} == {"peer:liger", "peer:cut_cross_entropy", "peer:torch"}
    assert all(r["ms"] is None and ("not importable" in r["note"] or "no CUDA" in r["note"]) for r in peers)


def test_peer_ratios_land_in_the_notes():
    from axkern.bench import Row, cases_for

    c = cases_for("fused_cross_entropy")[0]
    ours = Row(c.op, c.label, "xla", "fwd+bwd", ms=90.0)
    peer = (c, {"peer": "liger", "pass": "fwd+bwd", "ms": 100.0, "temp_gib": 0.1, "note": ""})
    rows = cli._peer_rows([peer], [], [ours], ceiling=500.0)
    assert rows[0].implementation == "peer:liger" and rows[0].tflops > 0
    assert ours.note == "time 0.90x liger"
