"""The results layout (`axkern bench --save`) and `axkern report`: the committed docs page,
README section and plots are what the committed results give."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

from axkern import cli
from axkern.bench import plots, report, results
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
        assert not written[page]  # the same text: not rewritten
    assert (tmp_path / "README.md").read_text() == (REPO / "README.md").read_text(), (
        "README: run `axkern report`"
    )
    images = sorted(p.name for p in written if p.suffix == ".png")
    assert images == sorted(p.name for p in (REPO / "docs" / "img").glob("*.png"))
    for name in images:
        data = (docs / "img" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) < 100_000, name
        assert data == (REPO / "docs" / "img" / name).read_bytes(), f"docs/img/{name}: run `axkern report`"
        assert f"img/{name}" in (docs / "benchmarks.md").read_text() or name == "overview.png"
    page = (docs / "benchmarks.md").read_text()
    assert "| `peer: liger` |" in page and "of ceiling" in page
    # a second report over the same results rewrites nothing
    again = report.write(results.load(RESULTS), docs=docs, readme=tmp_path / "README.md")
    assert again.keys() == written.keys() and not any(again.values())


def _generated(text: str) -> str:
    return text.split(report.START, 1)[1].split(report.END, 1)[0]


def test_the_readme_has_the_short_form_and_the_docs_the_provenance():
    readme = _generated((REPO / "README.md").read_text())
    page = _generated((REPO / "docs" / "benchmarks.md").read_text())
    # the commands, versions and ceilings of each run are on the benchmarks page, not in the README
    assert "axkern bench" not in readme and "jax 0." not in readme and "TFLOP/s" not in readme
    for run in results.load(RESULTS):
        assert f"`{run['command']}` on {run['device']}" in page
    assert max(len(line) for line in readme.splitlines()) < 200
    # every README table names its device in every row, and shows the default beside the peers
    tables = re.findall(r"^\| device \| case \| default \|.*\n\|[-|]+\n((?:\|.*\n)+)", readme, flags=re.M)
    assert len(tables) >= 4
    devices = {plots.device_name(run["device"]) for run in results.load(RESULTS)}
    for table in tables:
        rows = [line.split(" | ") for line in table.strip().splitlines()]
        assert len(rows) <= report.SUMMARY_ROWS
        for cells in rows:
            assert cells[0].removeprefix("| ") in devices, cells
            assert re.match(r"`\w+` \d+\.\d ms", cells[2]), cells
    # the loss's committed runs time xla; the note says the GPU's default is mosaic_gpu
    assert "`mosaic_gpu`, which these runs do not time: the default column shows `xla`" in readme
    assert "`mosaic_gpu`, which this run does not time" in page


def test_tables_order_cases_by_their_numbers():
    page = (REPO / "docs" / "benchmarks.md").read_text()
    llama3 = page.index("**preset `llama3`**: `axkern bench fused_cross_entropy_loss")
    assert page.index("| N=8192 D=4096", llama3) < page.index("| N=16384 D=4096", llama3)
    assert report._case_key("B=4 L=2048 H=80") < report._case_key("B=4 L=16384 H=80")


@pytest.mark.parametrize(
    "counts,quotas",
    [
        ([4, 4, 1], [2, 3, 1]),  # the run of one case leaves a row: the later run of four takes it
        ([3, 3], [3, 3]),
        ([3, 3, 3, 3], [1, 1, 1, 1]),  # no run short of its share: nothing to hand on
        ([1, 1, 1, 1, 1, 1, 1, 1], [1] * 8),  # at least one each, even past the table's rows
        ([0, 5], [0, 5]),
    ],
)
def test_the_readme_table_shares_its_rows_among_the_runs(counts, quotas):
    assert report._quotas(counts, 6) == quotas


def test_the_overview_names_the_device_of_every_bar():
    runs = results.load(RESULTS)
    bars = plots.overview_bars(report._groups(runs))
    devices = {plots.device_name(run["device"]) for run in runs}
    assert bars and all(label.rsplit(" · ", 1)[1] in devices for label, _ in bars)
    assert {"H100", "H200"} <= devices
    assert (
        plots.device_name("NVIDIA H100 80GB HBM3") == "H100"
        and plots.device_name("TPU v5 lite") == "TPU v5 lite"
    )


def test_report_without_matplotlib_says_which_extra_to_install(tmp_path, capsys, monkeypatch):
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs, ignore=shutil.ignore_patterns("img"))
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails as where it is missing
    argv = ["report", "--results", str(RESULTS), "--docs", str(docs), "--readme", str(tmp_path / "README.md")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[report]'" in err and "Traceback" not in err


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
    assert cli.main(argv) == 0  # nothing changed since: nothing rewritten
    out = capsys.readouterr().out
    assert "wrote" not in out and "files unchanged" in out
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


def _run(rows, **extra) -> dict:
    return {
        "command": "axkern bench x",
        "date": "2026-01-01T00:00:00+00:00",
        "device": "cpu",
        "versions": {"jax": "0.0"},
        "cases": [{"op": "x", "case": "c", "dtype": "float32", "dims": {"n": 1}}],
        "rows": rows,
        **extra,
    }


_ROW = {"op": "x", "case": "c", "implementation": "xla", "pass": "fwd", "ms": 1.5, "max_rel_error": None}


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "is empty"),
        (json.dumps(_run([_ROW])).encode()[:40], "is not JSON"),
        (b"\xff\xfe", "is not JSON"),
        (b"[]", "is not an `axkern bench` run"),
        (json.dumps(_run({"0": _ROW})).encode(), "rows is not a list"),
        (json.dumps(_run([_ROW | {"ms": "1.5"}])).encode(), r"row 0 .*ms '1\.5' is not a finite number"),
        (json.dumps(_run([{k: v for k, v in _ROW.items() if k != "case"}])).encode(), "row 0 .*has no case"),
        (json.dumps(_run([_ROW, _ROW | {"ms": -5.0}])).encode(), r"row 1 .*ms -5\.0 is not a finite number"),
        (json.dumps(_run([_ROW | {"ms": float("nan")}])).encode(), "row 0 .*ms nan is not a finite number"),
        (json.dumps(_run([_ROW | {"ms_max": float("inf")}])).encode(), "row 0 .*ms_max inf is not"),
        (json.dumps(_run([_ROW | {"tflops": True}])).encode(), "row 0 .*tflops True is not"),
        (json.dumps(_run([_ROW | {"max_rel_error": "x"}])).encode(), "row 0 .*max_rel_error 'x' is not"),
        (json.dumps(_run([_ROW], matmul_ceiling_tflops="fast")).encode(), "matmul_ceiling_tflops 'fast'"),
        (json.dumps(_run([_ROW], cases={})).encode(), "cases is not a list"),
        (json.dumps(_run([_ROW], device=None)).encode(), "device is not a string"),
    ],
    ids=[
        "empty",
        "truncated",
        "not-utf8",
        "a-list",
        "rows-a-dict",
        "ms-a-string",
        "no-case",
        "ms-negative",
        "ms-nan",
        "ms-max-infinite",
        "tflops-a-bool",
        "error-a-string",
        "ceiling-a-string",
        "cases-a-dict",
        "no-device",
    ],
)
def test_a_malformed_results_file_is_an_error_naming_it(tmp_path, content, says):
    path = tmp_path / "cpu" / "x" / "quick.json"
    path.parent.mkdir(parents=True)
    (tmp_path / "cpu" / "x" / "other.json").write_text(json.dumps(_run([_ROW])))
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + says):
        results.load(tmp_path)


def test_a_results_folder_named_like_a_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "cpu" / "x" / "quick.json").mkdir(parents=True)
    with pytest.raises(
        ValueError, match=re.escape(str(tmp_path / "cpu" / "x" / "quick.json")) + " is a folder"
    ):
        results.load(tmp_path)


def test_a_row_whose_error_is_nan_is_kept(tmp_path):
    # an implementation whose output was NaN where the reference's was not: the table says nan
    path = tmp_path / "cpu" / "x" / "quick.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_run([_ROW | {"max_rel_error": float("nan")}, _ROW | {"ms": None}])))
    (run,) = results.load(tmp_path)
    assert "| c | `xla` | fwd | 1.500 | - | - | - | nan |" in report.markdown([run])


def test_report_command_names_the_bad_results_file(tmp_path, capsys):
    root, docs = tmp_path / "results", tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "README.md").write_text("")
    path = root / "cpu" / "x" / "quick.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_run([_ROW | {"ms": float("nan")}])))
    argv = ["report", "--results", str(root), "--docs", str(docs), "--readme", str(tmp_path / "README.md")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err
