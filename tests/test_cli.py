"""The command line: `axkern info` and `axkern bench --quick` (the README's main job)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import jax
import pytest

import axkern
from axkern import cli
from axkern.bench import format as bench_format
from axkern.cli import bench as cli_bench
from axkern.core import tuning
from tests.cluster import launch


def test_info_runs_and_reports_each_op(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "platform" in out and "nvcc" in out and "jax" in out
    assert "fused_cross_entropy: xla" in out  # the typical-shape decision, from explain
    assert re.search(r"processes\s+│ 1 \(this is process 0\)", out)
    assert re.search(r"global devices\s+│ 8 ", out)  # conftest's 8 host devices


def test_info_starts_with_a_one_screen_summary(capsys):
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[: len(axkern.ops()) + 2]
    assert max(map(len, head)) <= 100
    for op in axkern.ops():  # op -> the default here, and why the others are not
        assert any(line.strip().startswith(f"{op}: xla") for line in head), op
    assert any(
        "short_conv: xla" in line and "gpu only: cuda, pallas_gpu; tpu only: pallas_tpu" in line
        for line in head
    )
    assert len(lines) < 60 and "--all" in lines[-1]  # the full decisions on request
    assert cli.main(["info", "--all"]) == 0
    out = capsys.readouterr().out
    assert "B=2 S=256 C=256 W=4 silu float32 gets:" in out and "block sizes:" in out


def test_every_command_and_option_has_help_and_usage_errors_show_the_commands_usage(capsys):
    top, commands = cli._parsers()
    assert set(commands) == {"info", "bench", "report", "tune", "build-native"}
    for name in commands:
        assert f"axkern {name}" in top.description  # the top-level description lists every command
    for name, p in commands.items():
        for action in p._actions:
            assert action.help, f"axkern {name} {action.option_strings or action.dest}: no help"
    assert "report" in top.format_help() and "needs the report extra" in top.format_help()
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--quick", "--bogus"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and err.startswith("usage: axkern bench")
        and "unrecognized arguments: --bogus" in err
    )
    assert cli.main(["bench", "no_such_op"]) == 2  # a check of the command's own: its usage too
    err = capsys.readouterr().err
    assert err.startswith("usage: axkern bench") and err.strip().splitlines()[-1].startswith(
        "axkern bench: error: OP"
    )


def test_info_joins_a_cluster_and_counts_its_processes_and_devices(tmp_path):
    def command(process_id, coordinator):
        flags = f"--coordinator {coordinator} --num-processes 2 --process-id {process_id}"
        return [sys.executable, "-m", "axkern", "info", *flags.split()]

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
    assert data["versions"]["jax"] and data["preset"] == "quick"
    assert data["matmul_ceiling_tflops"] is None  # on a CPU no ceiling is measured
    assert all(r["ceiling_fraction"] is None and not r["interpret"] for r in rows)


def test_bench_rejects_unknown_op_and_preset():
    proc = subprocess.run(
        [sys.executable, "-m", "axkern", "bench", "no_such_op"], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "unknown op 'no_such_op'" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "axkern", "bench", "fused_cross_entropy", "--preset", "nope"],
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


def test_bench_levanter_peer_absent_is_a_row_that_says_so(tmp_path, monkeypatch):
    # Levanter (an in-process JAX peer of the reduced loss) not importable: its rows say why
    monkeypatch.setitem(sys.modules, "levanter", None)
    out = tmp_path / "peers.json"
    argv = ["bench", "fused_cross_entropy_loss", "--impl", "xla", "--peers", "--repeats", "1"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["implementation"] == "peer:levanter"]
    assert {r["pass"] for r in rows} == {"fwd", "fwd+bwd"}
    assert all(r["ms"] is None and r["note"] == "unsupported: levanter is not installed" for r in rows)


def test_bench_only_runs_the_torch_peers_of_the_cases_it_times(monkeypatch):
    import axkern.bench
    from axkern.bench import peers

    ran = []
    monkeypatch.setattr(peers, "run", lambda op, dims, dtype, **kw: ran.append(dims["length"]) or [])
    monkeypatch.setattr(axkern.bench, "measure", lambda case, impls, **kw: [])
    argv = ["bench", "ssd", "--preset", "mamba2_2.7b", "--impl", "xla", "--peers", "--only", "L=2048"]
    assert cli.main(argv) == 0
    assert ran == [2048]  # not the preset's other three shapes


def test_bench_tokamax_peers_absent_are_rows_that_say_so(tmp_path, monkeypatch):
    # tokamax (in-process JAX peers of attention) not importable: each peer's rows say why
    monkeypatch.setitem(sys.modules, "tokamax", None)
    out = tmp_path / "peers.json"
    argv = ["bench", "attention", "--impl", "xla", "--peers", "--repeats", "1"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["implementation"].startswith("peer:")]
    assert {(r["implementation"], r["pass"]) for r in rows} == {
        (f"peer:{name}", p) for name in ("tokamax_mosaic", "tokamax_cudnn") for p in ("fwd", "fwd+bwd")
    }
    assert all(r["ms"] is None and r["note"] == "unsupported: tokamax is not installed" for r in rows)


def test_mamba3_cases_carry_what_its_torch_peer_reads():
    from axkern.bench import cases_for, peers

    siso, mimo = cases_for("mamba3", preset="mamba3_2.7b")
    for c in (siso, mimo):
        assert {"batch", "length", "heads", "head_dim", "state", "groups", "angles", "chunk", "rank"} <= set(
            c.dims
        )
    assert siso.dims["rank"] == 0 and mimo.dims["rank"] == 4
    # no torch here: the subprocess reports why, one row for the one peer
    (row,) = peers.run("mamba3", siso.dims, siso.dtype, repeats=1)
    assert row["peer"] == "mamba_ssm" and "ms" not in row and row["note"]
    assert "levanter" in siso.peers and isinstance(mimo.peers["levanter"], str)


def test_peer_ratios_land_in_the_notes():
    from axkern.bench import Row, cases_for

    c = cases_for("fused_cross_entropy")[0]
    ours = Row(c.op, c.label, "xla", "fwd+bwd", ms=90.0)
    peer = (c, {"peer": "liger", "pass": "fwd+bwd", "ms": 100.0, "temp_gib": 0.1, "note": ""})
    rows = cli_bench._peer_rows([peer], [], [ours], ceiling=500.0)
    assert rows[0].implementation == "peer:liger" and rows[0].tflops > 0
    assert ours.note == "time 0.90x liger"


# -- usage: every argument is checked before anything is measured -----------------------------


def _no_measuring(monkeypatch):
    import axkern.bench

    def refuse(*a, **k):
        raise AssertionError("measured before the arguments were checked")

    for name in ("measure", "matmul_ceiling", "copy_bandwidth"):
        monkeypatch.setattr(axkern.bench, name, refuse)


def _usage_error(argv, capsys) -> str:
    """The one-line error of a command line that must exit 2 without a traceback."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "nosuchop"], "OP: unknown op 'nosuchop'"),
        (["bench", "short_conv", "--impl", "bogus"], "--impl: expected implementations of short_conv"),
        (["bench", "--impl", "bogus"], "--impl: expected implementations"),
        (["bench", "short_conv", "--impl", ","], "--impl: expected comma-separated"),
        (["bench", "short_conv", "--preset", "nope"], "unknown preset 'nope'"),
        (["bench", "--preset", "llama3"], "--preset: expected an OP too"),
        (["bench", "short_conv", "--dtype", "int7"], "--dtype: expected one of float32, bfloat16"),
        (["bench", "short_conv", "--json", "/nonexistent/x.json"], "--json: expected a path in an existing"),
        (
            ["bench", "moe_layout", "--passes", "fwd+bwd"],
            "--passes: nothing to measure: moe_layout has no fwd+bwd",
        ),
        (
            ["bench", "fused_cross_entropy", "--quick", "--preset", "llama3"],
            "--preset: not allowed with argument --quick",
        ),
        (["bench", "--repeats", "0"], "--repeats: expected a positive integer, got '0'"),
        (["bench", "--tokens", "x"], "--tokens: expected a positive integer, got 'x'"),
        (["bench", "--cases", "no_such_file.py"], "--cases: expected a Python file"),
        (["bench", "short_conv", "--cases", "examples/tiny_lm.py"], "--cases: expected no OP"),
        (["bench", "--format", "html"], "--format: invalid choice"),
        (
            ["bench", "short_conv", "--only", "no-such-case"],
            "--only: expected parts of these case labels: B=2",
        ),
        (["bench", "--blocks", "xla:chunk_size=32"], "--blocks: expected one OP"),
        (["bench", "ssd", "--blocks", "chunk_size=32"], "--blocks: ssd: expected IMPL:FIELD=VALUE"),
        (["bench", "ssd", "--blocks", "bogus:chunk_size=32"], "with IMPL one of xla, pallas_gpu, mosaic_gpu"),
        (["bench", "ssd", "--blocks", "xla:chunk=32"], "expected FIELD=VALUE with FIELD one of chunk_size"),
        (["bench", "ssd", "--blocks", "xla:chunk_size"], "got 'chunk_size'"),
        (["bench", "ssd", "--blocks", "mosaic_gpu:forward=lena"], "forward must be one of 'stages'"),
        (["bench", "ssd", "--blocks", "xla:chunk_size=0"], "chunk_size must be a positive int, got 0"),
    ],
)
def test_bench_usage_errors_exit_2_before_measuring(argv, expected, capsys, monkeypatch):
    _no_measuring(monkeypatch)
    assert expected in _usage_error(argv, capsys)


def test_bench_only_times_the_cases_whose_label_holds_one_of_its_parts(tmp_path, monkeypatch):
    import axkern.bench

    seen = []
    monkeypatch.setattr(axkern.bench, "measure", lambda case, impls, **kw: seen.append(case.label) or [])
    argv = ["bench", "--quick", "--impl", "xla", "--only", "W=4, H=4/2", "--json", str(tmp_path / "o.json")]
    assert cli.main(argv) == 0
    # attention's, short_conv's and short_conv_step's quick cases; none of the other ops'
    assert sorted(seen) == [
        "B=1 L=256 H=4/2 D=32 causal float32",
        "B=2 S=256 C=256 W=4 silu float32",
        "B=4 C=256 W=4 silu float32",
    ]


def test_bench_blocks_replace_the_dispatchers_fields_while_it_measures(monkeypatch):
    import axkern.bench

    chosen = []

    def measure(case, impls, **kw):  # the bench's xla case names its chunk: pallas_gpu's does not
        decision = axkern.explain(case.forward_for("pallas_gpu"), *case.make(jax.random.PRNGKey(0)))
        chosen.append((decision.block_source, decision.block_sizes.chunk_size))
        return []

    monkeypatch.setattr(axkern.bench, "measure", measure)
    argv = ["bench", "ssd", "--quick", "--impl", "pallas_gpu", "--blocks", "pallas_gpu:chunk_size=16"]
    assert cli.main(argv) == 0
    assert chosen and set(chosen) == {("replaced", 16)}  # the heuristic's 64 replaced in every case
    chosen.clear()
    assert cli.main(argv[:-2]) == 0
    assert set(chosen) == {("heuristic", 64)}  # and only while it measured
    with axkern.bench.replaced_blocks("ssd", "mosaic_gpu:scan_backward=none,forward=fused"):
        assert tuning.replaced_fields("ssd", "mosaic_gpu") == {"scan_backward": None, "forward": "fused"}


def test_bench_json_path_that_is_a_directory_is_a_usage_error(tmp_path, capsys, monkeypatch):
    _no_measuring(monkeypatch)
    assert "--json: expected a file path" in _usage_error(
        ["bench", "short_conv", "--json", str(tmp_path)], capsys
    )


@pytest.mark.parametrize(
    "given, dtype",
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("fp32", "float32"),
        ("f16", "float16"),
        ("bfloat16", "bfloat16"),
    ],
)
def test_bench_dtype_aliases(given, dtype):
    work, _ = cli_bench._plan(cli.parser().parse_args(["bench", "short_conv", "--dtype", given]))
    assert {c.dtype for c, _ in work} == {dtype}


def test_bench_marks_what_runs_in_interpret_mode():
    from axkern.bench import runs_interpreted

    assert runs_interpreted("short_conv", "pallas_gpu") and not runs_interpreted("short_conv", "xla")
    assert not runs_interpreted("short_conv", "default")  # a file's cases: the dispatcher's choice


def test_bench_plan_defaults_to_the_quick_preset_and_the_implementations_compiled_here():
    work, passes = cli_bench._plan(cli.parser().parse_args(["bench", "short_conv"]))
    assert passes == ("fwd", "fwd+bwd")
    assert [impls for _, impls in work] == [["xla", "reference"]]  # no Pallas kernel in interpret mode
    work, _ = cli_bench._plan(cli.parser().parse_args(["bench", "--impl", "pallas_gpu"]))
    assert {c.op for c, _ in work} == {
        "attention",
        "fused_cross_entropy",
        "mamba3",
        "short_conv",
        "ssd",
    }  # the ops that have it


def test_bench_list_presets(capsys, monkeypatch):
    _no_measuring(monkeypatch)
    assert cli.main(["bench", "--list-presets"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        "short_conv: quick (default), mamba, tpu" in out and "short_conv_step: quick (default), decode" in out
    )
    assert len(out) == len(axkern.ops())
    assert cli.main(["bench", "fused_cross_entropy", "--list-presets"]) == 0
    assert "llama3" in capsys.readouterr().out


def test_version_and_python_dash_m(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("axkern ")
    proc = subprocess.run(
        [sys.executable, "-m", "axkern", "bench", "--list-presets"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "short_conv: quick (default)" in proc.stdout, proc.stderr


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["platform"] == "cpu" and data["versions"]["jax"]
    assert data["ops"]["fused_cross_entropy"]["typical_choice"] == "xla"
    assert set(data["ops"]) == set(axkern.ops())


# -- output: units, ceilings and interpret mode told plainly; full width off a terminal --------


def _rows(gpu: bool):
    from axkern.bench import Row

    scale = 1e3 if gpu else 1.0
    return [
        Row(
            "short_conv",
            "B=2 S=256",
            "xla",
            "fwd",
            ms=0.3,
            tflops=0.003 * scale,
            gbps=3.0 * scale,
            temp_gib=0.0,
            max_rel_error=0.0,
            ceiling_fraction=0.5 if gpu else None,
        ),
        Row(
            "short_conv",
            "B=2 S=256",
            "pallas_gpu",
            "fwd",
            ms=12.0,
            tflops=0.00008 * scale,
            gbps=0.03 * scale,
            interpret=not gpu,
            note="" if gpu else "interpret mode: times the Pallas interpreter, not the kernel " * 3,
        ),
    ]


def test_bench_columns_fit_the_magnitudes_and_mark_interpret_mode():
    header, cells = bench_format.columns(_rows(gpu=False))
    assert "GFLOP/s" in header and "TFLOP/s" not in header and "of ceiling" not in header
    assert cells[0][header.index("GFLOP/s")] == "3.00" and cells[1][header.index("GFLOP/s")] == "0.08"
    assert cells[1][header.index("impl")] == "pallas_gpu (interpret)"
    header, cells = bench_format.columns(_rows(gpu=True))
    assert "TFLOP/s" in header and "of ceiling" in header and "note" not in header
    assert cells[0][header.index("of ceiling")] == "50.0%"
    assert "(interpret)" in bench_format.row_line(_rows(gpu=False)[1])
    assert "3.00 GFLOP/s" in bench_format.row_line(_rows(gpu=False)[0])


def _doc(rows):
    return {
        "device": "cpu",
        "preset": "quick",
        "matmul_ceiling_tflops": None,
        "rows": [r.as_dict() for r in rows],
    }


def test_bench_table_off_a_terminal_is_one_line_per_row(capsys):
    from rich.console import Console

    rows = _rows(gpu=False)
    bench_format.print_rows(rows, _doc(rows), "table", Console(file=io.StringIO()))  # not a terminal
    lines = capsys.readouterr().out.splitlines()
    assert "no ceiling on a CPU" in lines[0]
    found = [line for line in lines if line.lstrip().startswith(("xla ", "pallas_gpu"))]
    assert len(found) == len(rows)  # one line per row, its note at the end
    assert "pallas_gpu (interpret)" in found[1] and rows[1].note.strip() in found[1]


def test_bench_table_fits_a_terminal_with_ratios_to_the_default_beside_memory():
    from axkern.bench import Row

    rows = _rows(gpu=True) + [
        Row("short_conv", "B=2 S=256", "reference", "fwd", ms=0.6, temp_gib=0.5, tflops=1.0, gbps=9.0),
        Row("short_conv", "B=4 S=512", "cuda", "fwd", ms=1.0, temp_gib=0.1, tflops=1.0, gbps=9.0),
        Row("short_conv", "B=4 S=512", "peer:cut_cross_entropy", "fwd", ms=3.0, temp_gib=0.1, note="n " * 80),
    ]
    doc = _doc(rows) | {
        "matmul_ceiling_tflops": 700.0,
        "copy_bandwidth_gbps": 4000.0,
        "cases": [{"op": "short_conv", "case": "B=2 S=256", "default": "pallas_gpu"}],
    }
    for width in (100, 80):
        lines = bench_format.table_lines(rows, doc, width)
        assert max(map(len, lines)) <= width, width
        names = next(line for line in lines if "x default" in line).split()
        assert names[names.index("x") + 2] == "temp"  # the ratio beside the memory
        # the case is a heading, once per case, naming the default; not a column of every row
        assert sum("B=2 S=256" in line for line in lines) == 1
        assert any("B=2 S=256 (default here: pallas_gpu)" in line for line in lines)
        row = {line.split()[0]: line.split() for line in lines if line.startswith("  ") and "fwd" in line}
        assert (
            row["pallas_gpu"][3] == "1.00x"
            and row["xla"][3] == f"{0.3 / 12:.2f}x"
            and row["reference"][3] == "0.05x"
        )
        # no default known for the second case: times against reference, none there: no ratio
        assert row["peer:cut_cross_entropy"][3] == "-" and row["cuda"][3] == "-"
    assert "TB/s" in bench_format.table_lines(rows, doc, 100)[3]
    assert "TB/s" not in bench_format.table_lines(rows, doc, 80)[3]  # a rate left out at 80 columns


@pytest.mark.parametrize("fmt", ["json", "csv", "markdown"])
def test_bench_formats(fmt, capsys):
    import csv

    rows = _rows(gpu=False)
    bench_format.print_rows(rows, _doc(rows), fmt, None)
    out = capsys.readouterr().out
    if fmt == "json":
        assert [r["implementation"] for r in json.loads(out)["rows"]] == ["xla", "pallas_gpu"]
    elif fmt == "csv":
        got = list(csv.DictReader(io.StringIO(out)))
        assert [r["implementation"] for r in got] == ["xla", "pallas_gpu"] and got[1]["interpret"] == "True"
    else:
        table = [line for line in out.splitlines() if line.startswith("|")]
        assert table[0].startswith("| op | case | impl | pass | ms | GFLOP/s") and len(table) == 2 + len(rows)


def test_bench_json_keeps_the_rows_of_a_run_cut_short(tmp_path, monkeypatch):
    # the file is written after each case: a run stopped in its second case leaves the first's rows
    from axkern import bench

    calls, real = [], bench.measure

    def measure(case, *a, **kw):
        calls.append(case.label)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(case, *a, **kw)

    monkeypatch.setattr(bench, "measure", measure)
    out = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["bench", "--impl", "xla", "--repeats", "1", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and len(calls) == 2
    assert {r["case"] for r in doc["rows"]} == {calls[0]} and all(r["ms"] for r in doc["rows"])


@pytest.mark.parametrize("where", ["proc", "below-a-file"])
def test_bench_save_into_a_folder_that_cannot_be_made_is_a_usage_error_before_measuring(
    where, tmp_path, capsys, monkeypatch
):
    _no_measuring(monkeypatch)
    (tmp_path / "file").write_text("")
    root = "/proc/axkern-results" if where == "proc" else str(tmp_path / "file" / "results")
    line = _usage_error(["bench", "short_conv", "--save", root], capsys)
    assert line.startswith("axkern bench: error: --save: expected a folder") and root in line


def test_build_native_names_a_malformed_arch(capsys):
    for arch in ("9.x", "sm_90", "9.0.1", ""):
        line = _usage_error(["build-native", "moe", "--arch", arch], capsys)
        assert "--arch: expected a compute capability such as 9.0" in line and repr(arch) in line


def test_bench_cases_file_whose_cases_takes_no_keywords_is_a_usage_error(tmp_path, capsys, monkeypatch):
    _no_measuring(monkeypatch)
    path = tmp_path / "mine.py"
    path.write_text("def cases():\n    return []\n")
    line = _usage_error(["bench", "--cases", str(path)], capsys)
    assert "--cases: expected" in line and "cases(preset=, tokens=, dtype=)" in line and str(path) in line
