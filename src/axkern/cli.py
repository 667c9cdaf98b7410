"""`axkern info | bench | tune | build-native`: what runs here, how fast, and with which block sizes."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from . import cli_tune, results
from .bench_format import print_rows, row_line

console = Console()  # results
status = Console(stderr=True)  # progress and rows as they are measured: stdout keeps only the results


class UsageError(ValueError):
    """A command line that cannot run: one line naming the argument, what was expected, what was given."""


_DTYPES = {  # accepted spellings of the dtypes the benchmark cases take
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}


def _nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        return "not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        release = [line for line in out.splitlines() if "release" in line]
        return f"{path} ({release[-1].strip() if release else 'version unknown'})"
    except (OSError, subprocess.SubprocessError) as e:
        return f"{path} (failed to run: {e})"


def _typical_decision(op: str):
    """The dispatcher's choice for the op's quick benchmark shape, from `explain`."""
    import jax

    import axkern
    from axkern.bench import cases_for

    c = cases_for(op)[0]
    shapes = jax.eval_shape(c.make, jax.random.PRNGKey(0))
    decisions = axkern.explain(lambda *a: c.forward(None, *a), *shapes)
    if isinstance(decisions, tuple):  # the case calls other ops too (e.g. a dispatch before a combine)
        decisions = next((d for d in decisions if d.op == op), decisions[-1])
    return c.label, decisions


def _join_cluster(args) -> None:
    """`jax.distributed.initialize` when the command line asks for it: with `--coordinator`,
    `--num-processes`, `--process-id`, or `--distributed` alone to let JAX detect them (SLURM,
    Open MPI, Kubernetes, Cloud TPU). Before any other JAX call, as JAX requires."""
    given = (args.coordinator, args.num_processes, args.process_id)
    if not args.distributed and all(v is None for v in given):
        return
    import jax

    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
    )


def _info_data() -> dict:
    """What `axkern info` reports, as plain data (`--json` prints it as is)."""
    import jax

    import axkern
    from axkern.core import backend, native

    cc = backend.compute_capability()
    ops = {}
    for op in axkern.ops():
        label, decision = _typical_decision(op)
        ops[op] = {
            "implementations": {n: list(p) for n, p in axkern.implementations(op).items()},
            "typical_case": label,
            "typical_choice": decision.implementation,
            "typical_decision": str(decision),
        }
    return {
        "versions": results.versions(),
        "platform": backend.platform(),
        "device": backend.device_kind(),
        "local_devices": jax.local_device_count(),
        "processes": jax.process_count(),
        "process_index": jax.process_index(),
        "global_devices": jax.device_count(),
        "compute_capability": None if cc is None else f"{cc[0]}.{cc[1]}",
        "tuned_table_key": backend.device_key(),
        "nvcc": _nvcc(),
        "native": native.status(),
        "ops": ops,
    }


def info(args) -> int:
    _join_cluster(args)
    data = _info_data()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    t = Table(title="axkern info", show_header=False)
    t.add_column("what")
    t.add_column("value")
    for k, v in data["versions"].items():
        t.add_row(k, v)
    t.add_row("platform", data["platform"])
    t.add_row("device", f"{data['device']} x{data['local_devices']} in this process")
    t.add_row("processes", f"{data['processes']} (this is process {data['process_index']})")
    t.add_row("global devices", str(data["global_devices"]))
    t.add_row("compute capability", data["compute_capability"] or "n/a")
    t.add_row("tuned-table key", data["tuned_table_key"])
    t.add_row("nvcc", data["nvcc"])
    for name, line in data["native"].items():
        t.add_row(f"native: {name}", line)
    console.print(t)
    for op, d in data["ops"].items():
        ops_t = Table(title=f"{op}")
        ops_t.add_column("implementation")
        ops_t.add_column("platforms")
        for name, plats in d["implementations"].items():
            ops_t.add_row(name, "/".join(plats))
        console.print(ops_t)
        console.print(f"{d['typical_case']} gets:\n{d['typical_decision']}\n", markup=False, highlight=False)
    return 0


def bench(args) -> int:
    if args.list_presets:
        return _list_presets(args)
    work, passes = _plan(args)  # every argument checked before anything is measured
    import jax

    from axkern.bench import DEFAULT_PRESET, copy_bandwidth, matmul_ceiling, measure
    from axkern.core import backend

    repeats = args.repeats or (3 if args.quick else 20)
    preset = args.preset
    ops = sorted({c.op for c, _ in work if not args.cases})
    peer_rows = _peers(args, ops, preset, repeats) if args.peers else []  # before JAX takes the GPU
    device = jax.devices()[0].device_kind
    # On a CPU one matmul's or one copy's rate bounds nothing else: caches, threads and
    # shapes change the rate by more than the kernels differ, so no ceiling is measured.
    ceiling = bandwidth = None
    if backend.platform() != "cpu":
        status.print(f"measuring the matmul ceiling and copy bandwidth on {device} ...")
        ceiling = matmul_ceiling(repeats=repeats)
        bandwidth = copy_bandwidth(repeats=repeats)
    rows = []
    with Progress(console=status, transient=True) as progress:
        task = progress.add_task(
            "benchmarking", total=sum(len(i) * len([p for p in passes if p in c.passes]) for c, i in work)
        )
        for c, impls in work:
            progress.update(task, description=f"{c.op}: {c.label}")
            rows += measure(
                c,
                impls,
                passes=passes,
                repeats=repeats,
                ceiling=ceiling,
                bandwidth=bandwidth,
                on_row=lambda r: (
                    progress.advance(task),
                    status.print(row_line(r), markup=False, highlight=False, soft_wrap=True),
                ),
            )
    rows += _peer_rows(peer_rows, work, rows, ceiling)
    doc = results.document(
        rows,
        [c for c, _ in work],
        command=" ".join(["axkern"] + sys.argv[1:]),
        device=device,
        device_key=backend.device_key(),
        platform=backend.platform(),
        preset=(args.preset or DEFAULT_PRESET) if not args.cases else (args.preset or "default"),
        ceiling=ceiling,
        bandwidth=bandwidth,
    )
    print_rows(rows, doc, args.format, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        status.print(f"wrote {args.json}")
    if args.save:
        for path in results.save(doc, args.save):
            status.print(f"wrote {path}")
    failed = [  # a peer that could not run is reported, not a failure of ours
        r
        for r in rows
        if r.ms is None and not r.note.startswith("unsupported") and not r.implementation.startswith("peer:")
    ]
    return 1 if failed else 0


def _dtype(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return _DTYPES[value.strip().lower()]
    except KeyError:
        raise UsageError(
            f"--dtype: expected one of float32, bfloat16, float16 (or fp32, bf16, fp16), got {value!r}"
        ) from None


def _json_path(path: str | None) -> None:
    """Fail now, not after the measurements, when `path` cannot be written."""
    if path is None:
        return

    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise UsageError(f"--json: expected a file path, got the directory {path!r}")
    if not parent.is_dir():
        raise UsageError(
            f"--json: expected a path in an existing directory, got {path!r} ({parent} does not exist)"
        )
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"--json: expected a writable path, got {path!r} (permission denied)")


def _impls_for(op: str, args, explicit: list[str] | None) -> list[str]:
    import axkern
    from axkern.core import backend

    known = axkern.implementations(op)
    if explicit is None:  # what runs compiled here (Pallas in interpret mode times nothing useful)
        return [n for n, plats in known.items() if backend.platform() in plats]
    if args.op:
        for name in explicit:
            if name not in known:
                raise UsageError(
                    f"--impl: expected implementations of {op} ({', '.join(known)}), got {name!r}"
                )
    return [n for n in explicit if n in known]  # with every op: the ops that have them


def _plan(args) -> tuple[list, tuple[str, ...]]:
    """`[(case, implementations)]` and the passes to time, or a `UsageError`."""
    import axkern
    from axkern.bench import cases_for
    from axkern.core.op import get_op

    if args.op and args.cases:
        raise UsageError(f"--cases: expected no OP with a file's cases, got OP {args.op!r}")
    if args.op:
        try:
            get_op(args.op)
        except ValueError as e:
            raise UsageError(f"OP: {e}") from None
    if args.preset and not args.op and not args.cases:
        raise UsageError(
            f"--preset: expected an OP too (presets belong to one op), got --preset {args.preset!r} alone"
        )
    dtype = args.dtype = _dtype(args.dtype)  # the canonical name, for the peers too
    _json_path(args.json)
    if args.save is not None and Path(args.save).exists() and not Path(args.save).is_dir():
        raise UsageError(f"--save: expected a results folder, got the file {args.save!r}")
    explicit = [n.strip() for n in args.impl.split(",") if n.strip()] if args.impl is not None else None
    if explicit == []:
        raise UsageError(f"--impl: expected comma-separated implementation names, got {args.impl!r}")
    passes = ("fwd", "fwd+bwd") if args.passes == "both" else (args.passes,)
    work = []
    if args.cases:
        impls = explicit or ["default", "reference"]
        work = [(c, impls) for c in _file_cases(args.cases, args.preset, args.tokens, dtype)]
    else:
        ops = [args.op] if args.op else axkern.ops()
        if explicit is not None and not args.op:
            every = {n for op in ops for n in axkern.implementations(op)}
            for name in explicit:
                if name not in every:
                    raise UsageError(
                        f"--impl: expected implementations ({', '.join(sorted(every))}), got {name!r}"
                    )
        for op in ops:
            impls = _impls_for(op, args, explicit)
            try:
                op_cases = cases_for(op, preset=args.preset, tokens=args.tokens, dtype=dtype)
            except ValueError as e:
                raise UsageError(f"--preset: {e}") from None
            work += [(c, impls) for c in op_cases if impls]
    if args.peers:  # JAX peers run in this process, as rows beside ours
        work = [(c, i + [f"peer:{name}" for name in c.peers]) for c, i in work]
    timed = [(c, i) for c, i in work if any(p in c.passes for p in passes)]
    if not timed:
        what = args.op or args.cases or "the selected ops"
        have = sorted({p for c, _ in work for p in c.passes})
        raise UsageError(
            f"--passes: nothing to measure: {what} has no {args.passes} pass"
            + (f" (its passes: {', '.join(have)})" if have else " with these implementations")
        )
    return timed, passes


def _list_presets(args) -> int:
    import axkern
    from axkern.bench import DEFAULT_PRESET, presets_for
    from axkern.core.op import get_op

    if args.op:
        try:
            get_op(args.op)
        except ValueError as e:
            raise UsageError(f"OP: {e}") from None
    for op in [args.op] if args.op else axkern.ops():
        names = [f"{n} (default)" if n == DEFAULT_PRESET else n for n in presets_for(op)]
        print(f"{op}: {', '.join(names)}")
    return 0


def _file_cases(path: str, preset, tokens, dtype) -> list:
    """The `cases(preset=, tokens=, dtype=)` of a Python file (e.g. examples/tiny_lm.py: one
    training step, implementations `default` and `reference`)."""
    import importlib.util
    from pathlib import Path

    if not Path(path).is_file():
        raise UsageError(f"--cases: expected a Python file that defines cases(), got {path!r} (not a file)")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # equinox modules in the file look their module up
    spec.loader.exec_module(module)
    if not hasattr(module, "cases"):
        raise UsageError(
            f"--cases: expected a file that defines cases(preset=, tokens=, dtype=), got {path!r}"
        )
    return module.cases(preset=preset, tokens=tokens, dtype=dtype)


def _peers(args, ops, preset, repeats) -> list[tuple]:
    """`(case, peer result)` for every case of the ops that have peers (`axkern.peers`)."""
    from axkern import peers
    from axkern.bench import cases_for

    out, timed = [], {}
    for op in ops:
        if op not in peers.PEERS:
            continue
        for c in cases_for(op, preset=preset, tokens=args.tokens, dtype=args.dtype):
            key = (peers.PEERS[op], tuple(sorted(c.dims.items())), c.dtype)  # one peers' run per shape
            if key not in timed:
                console.print(f"timing the torch peers of {op} on {c.label} (subprocess) ...")
                timed[key] = peers.run(op, c.dims, c.dtype, repeats=repeats)
            out += [(c, r) for r in timed[key]]
    return out


def _peer_rows(peer_rows, work, rows, ceiling):
    """Rows for the peers, and each axkern row's time as a multiple of each peer's (in its note)."""
    from axkern.bench import Row

    out = []
    for c, r in peer_rows:
        row = Row(c.op, c.label, f"peer:{r['peer']}", r.get("pass", "-"), note=r.get("note", ""))
        if r.get("ms"):
            row.ms, row.temp_gib = r["ms"], r.get("temp_gib")
            flops = c.flops_forward + (c.flops_backward if row.pass_ == "fwd+bwd" else 0)
            row.tflops = flops / (row.ms * 1e-3) / 1e12
            row.ceiling_fraction = row.tflops / ceiling if ceiling else None
        out.append(row)
    timed_peers = out + [r for r in rows if r.implementation.startswith("peer:")]  # and the JAX peers
    for r in rows:
        if r.implementation.startswith("peer:"):
            continue
        ratios = [
            f"{r.ms / p.ms:.2f}x {p.implementation[5:]}"
            for p in timed_peers
            if p.ms and r.ms and (p.case, p.pass_) == (r.case, r.pass_)
        ]
        if ratios:
            r.note = "; ".join(filter(None, [r.note, "time " + ", ".join(ratios)]))
    return out


def report(args) -> int:
    """Tables and plots from the committed results into the docs and the README."""
    from axkern import report as report_

    for flag, path in (("--results", args.results), ("--docs", args.docs)):
        if not Path(path).is_dir():
            raise UsageError(f"{flag}: expected a folder, got {path!r}")
    if not Path(args.readme).is_file():
        raise UsageError(f"--readme: expected a file, got {args.readme!r}")
    for path in report_.write(results.load(args.results), docs=Path(args.docs), readme=Path(args.readme)):
        console.print(f"wrote {path}", markup=False, highlight=False)
    return 0


def build_native(args) -> int:
    """Prebuild every native library (for the visible GPU, or `--arch 9.0` with no GPU)."""
    from axkern.core import backend, native

    if args.arch:
        major, _, minor = args.arch.partition(".")
        cc = (int(major), int(minor or 0))
    else:
        cc = backend.compute_capability()
        if cc is None:
            print("axkern build-native: no CUDA GPU visible; pass --arch (e.g. --arch 9.0)", file=sys.stderr)
            return 2
    for name, lib in native.LIBRARIES.items():
        try:
            path = native.build(lib, cc)
        except native.Unsupported as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 1
        console.print(f"{name}: {path}", markup=False, highlight=False, soft_wrap=True)  # a path copied whole
    return 0


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("axkern")
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="axkern", description=__doc__)
    p.add_argument("--version", action="version", version=f"axkern {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("info", help="platform, versions, processes, nvcc, and what each op picks here")
    i.add_argument("--json", action="store_true", help="print the same facts as JSON")
    i.add_argument("--coordinator", help="HOST:PORT of process 0: join that jax.distributed cluster first")
    i.add_argument("--num-processes", type=int, help="processes in the cluster (with --coordinator)")
    i.add_argument("--process-id", type=int, help="this process's index in the cluster (with --coordinator)")
    i.add_argument(
        "--distributed",
        action="store_true",
        help="join the cluster that JAX detects (SLURM, Open MPI, Kubernetes, Cloud TPU)",
    )
    i.set_defaults(fn=info)
    b = sub.add_parser("bench", help="time every implementation of every op (or one op)")
    b.add_argument("op", nargs="?", help="one op (default: all)")
    shapes = b.add_mutually_exclusive_group()
    shapes.add_argument(
        "--quick", action="store_true", help="the default 'quick' shapes with 3 repeats (seconds on a CPU)"
    )
    shapes.add_argument(
        "--preset",
        help="a named shape set of the op, e.g. llama3 (default: 'quick', small shapes; see --list-presets)",
    )
    b.add_argument("--list-presets", action="store_true", help="list each op's presets and exit")
    b.add_argument("--tokens", type=_positive_int, help="override the preset's token count")
    b.add_argument(
        "--dtype", help="override the preset's dtype: float32, bfloat16, float16 (or fp32, bf16, fp16)"
    )
    b.add_argument(
        "--impl",
        help="comma-separated implementations (default: those that run compiled on this platform; "
        "`axkern info` lists them all)",
    )
    b.add_argument(
        "--peers",
        action="store_true",
        help="also time the PyTorch kernels users pick instead (Liger, cut-cross-entropy, plain torch) "
        "in a subprocess, when importable; notes give each time as a multiple of theirs",
    )
    b.add_argument("--passes", choices=("fwd", "fwd+bwd", "both"), default="both")
    b.add_argument(
        "--repeats", type=_positive_int, help="timed repeats, median reported (default: 20; 3 with --quick)"
    )
    b.add_argument("--json", help="also write the rows as JSON here")
    b.add_argument(
        "--save",
        nargs="?",
        const=str(results.DEFAULT_ROOT),
        metavar="ROOT",
        help="also write each op's run to ROOT/<device_key>/<op>/<preset>.json (default ROOT: benchmarks/results)",
    )
    b.add_argument(
        "--format",
        choices=("table", "json", "csv", "markdown"),
        default="table",
        help="how the results are printed on stdout (progress goes to stderr)",
    )
    b.add_argument(
        "--cases",
        help="time the cases() of this Python file instead of the ops' (examples/tiny_lm.py: one training "
        "step, its ops as the dispatcher picks them ('default') and all 'reference')",
    )
    b.set_defaults(fn=bench)
    r = sub.add_parser("report", help="tables and plots from the committed results into docs/ and the README")
    r.add_argument(
        "--results", default=str(results.DEFAULT_ROOT), help="results folder (default: benchmarks/results)"
    )
    r.add_argument("--docs", default="docs", help="docs folder: benchmarks.md and img/ (default: docs)")
    r.add_argument("--readme", default="README.md", help="the README whose overview plot is refreshed")
    r.set_defaults(fn=report)
    cli_tune.add_parser(sub, _positive_int)
    n = sub.add_parser("build-native", help="compile the CUDA libraries into the cache and print where")
    n.add_argument("--arch", help="compute capability to build for (default: the visible GPU's), e.g. 9.0")
    n.set_defaults(fn=build_native)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.fn(args)
    except ValueError as e:  # a bad op, preset or option: say so, no traceback
        print(f"axkern {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
