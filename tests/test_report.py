"""The results layout (`axkern bench --save`) and `axkern report`: the committed docs page,
README section and plots are what the committed results give."""

from __future__ import annotations

import json
import shutil

import pytest

from axkern import cli
from axkern.bench import report, results
from tests.test_readme import REPO

RESULTS = REPO / "benchmarks" / "results"


def test_every_committed_result_is_a_run_in_the_layout():
    runs = results.load(RESULTS)
    assert runs
    for run in runs:
        path = run["path"]
        assert path == results.path_for(RESULTS, run["device_key"], run["op"], run["preset"])
        for field in ("command", "date", "device", "versions", "cases", "rows"):
            assert run[field], f"{path}: no {field}"
        assert "matmul_ceiling_tflops" in run and "copy_bandwidth_gbps" in run, path
        labels = {c["case"] for c in run["cases"]}
        assert all(c["dims"] for c in run["cases"]), path
        assert {r["case"] for r in run["rows"]} <= labels, f"{path}: a row's case has no dimensions"
    assert not [p for p in RESULTS.rglob("*") if p.suffix in (".log", ".txt")], "test logs stay out"


def test_report_rebuilds_the_committed_page_readme_and_plots(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(REPO / "docs" / "benchmarks.md", docs / "benchmarks.md")
    shutil.copytree(REPO / "docs" / "ops", docs / "ops")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    written = report.write(results.load(RESULTS), docs=docs, readme=tmp_path / "README.md")
    pages = [p for p in written if p.suffix == ".md" and p.name != "README.md"]
    assert {p.relative_to(docs).as_posix() for p in pages} >= {
        "benchmarks.md",
        "ops/attention.md",
        "ops/moe.md",
    }
    for page in pages:
        rel = page.relative_to(docs)
        assert page.read_text() == (REPO / "docs" / rel).read_text(), (
            f"docs/{rel} differs from what `axkern report` writes: run it"
        )
    assert (tmp_path / "README.md").read_text() == (REPO / "README.md").read_text(), (
        "README: run `axkern report`"
    )
    images = sorted(p.name for p in written if p.suffix == ".png")
    assert images == sorted(p.name for p in (REPO / "docs" / "img").glob("*.png"))
    for name in images:
        data = (docs / "img" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) < 100_000, name
        assert f"img/{name}" in (docs / "benchmarks.md").read_text() or name == "overview.png"
    page = (docs / "benchmarks.md").read_text()
    assert "| `peer: liger` |" in page and "of ceiling" in page


def test_report_needs_its_markers_and_some_results(tmp_path):
    with pytest.raises(ValueError, match="no report markers"):
        report.fill("# no markers\n", "x", "page.md")
    with pytest.raises(ValueError, match="no results"):
        report.write([], docs=tmp_path)


def test_path_for_refuses_names_that_leave_the_layout():
    with pytest.raises(ValueError, match="expected a plain op name"):
        results.path_for("r", "cpu", "../x", "quick")


def test_bench_save_writes_the_layout_that_report_reads(tmp_path, monkeypatch):
    root = tmp_path / "results"
    argv = ["bench", "moe_layout", "--quick", "--repeats", "1", "--save", str(root)]
    monkeypatch.setattr("sys.argv", ["axkern", *argv])
    assert cli.main(argv) == 0
    (run,) = results.load(root)
    assert run["path"] == root / "cpu" / "moe_layout" / "quick.json"
    assert run["command"] == "axkern " + " ".join(argv)
    assert run["preset"] == "quick" and run["device_key"] == "cpu" and run["versions"]["jax"]
    assert run["cases"] and all(c["dims"] and c["dtype"] is not None for c in run["cases"])
    assert {r["implementation"] for r in run["rows"]} >= {"xla", "reference"}
    assert json.loads(run["path"].read_text())["op"] == "moe_layout"


def test_bench_save_into_a_file_is_a_usage_error(tmp_path, capsys):
    target = tmp_path / "f"
    target.write_text("")
    assert cli.main(["bench", "moe_layout", "--save", str(target)]) == 2
    assert "--save: expected a results folder" in capsys.readouterr().err


def test_report_command_writes_into_the_given_folders(tmp_path, capsys):
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs, ignore=shutil.ignore_patterns("img"))
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    argv = ["report", "--results", str(RESULTS), "--docs", str(docs), "--readme", str(tmp_path / "README.md")]
    assert cli.main(argv) == 0
    assert (docs / "img" / "overview.png").is_file() and "wrote" in capsys.readouterr().out
    assert cli.main(["report", "--results", str(tmp_path / "none")]) == 2
    assert "--results: expected a folder" in capsys.readouterr().err


def test_a_run_cut_short_says_which_cases_have_no_rows():
    from axkern.bench import report

    run = {
        "command": "axkern bench attention --preset h200",
        "device": "NVIDIA H200",
        "date": "2026-12-01T14:01:17+00:00",
        "versions": {"jax": "0.11.2"},
        "path": "benchmarks/results/nvidia_h200/attention/h200.json",
        "cases": [{"case": "causal"}, {"case": "docs"}, {"case": "D=256"}],
        "rows": [{"case": "causal"}, {"case": "docs"}],
    }
    assert "cut short" not in report._about(run)
    assert report._about(dict(run, complete=False)).endswith("The run was cut short; no rows for D=256.")
