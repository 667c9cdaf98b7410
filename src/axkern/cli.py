"""`axkern info | bench | tune | build-native`: what runs here, how fast, and with which block sizes."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import cli_bench, cli_tune, results
from .cli_args import UsageError

console = Console()


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
    """Prebuild the named native libraries, or every one (for the visible GPU, or `--arch 9.0`
    with no GPU)."""
    from axkern.core import backend, native

    unknown = [n for n in args.libraries if n not in native.LIBRARIES]
    if unknown:
        print(
            f"axkern build-native: expected libraries among {', '.join(native.LIBRARIES)}, got {', '.join(unknown)}",
            file=sys.stderr,
        )
        return 2

    if args.arch:
        major, _, minor = args.arch.partition(".")
        cc = (int(major), int(minor or 0))
    else:
        cc = backend.compute_capability()
        if cc is None:
            print("axkern build-native: no CUDA GPU visible; pass --arch (e.g. --arch 9.0)", file=sys.stderr)
            return 2
    for name, lib in native.LIBRARIES.items():
        if args.libraries and name not in args.libraries:
            continue
        try:
            path = native.build(lib, cc)
        except native.Unsupported as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 1
        console.print(f"{name}: {path}", markup=False, highlight=False, soft_wrap=True)  # a path copied whole
    return 0


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
    cli_bench.add_parser(sub)
    r = sub.add_parser("report", help="tables and plots from the committed results into docs/ and the README")
    r.add_argument(
        "--results", default=str(results.DEFAULT_ROOT), help="results folder (default: benchmarks/results)"
    )
    r.add_argument("--docs", default="docs", help="docs folder: benchmarks.md and img/ (default: docs)")
    r.add_argument("--readme", default="README.md", help="the README whose overview plot is refreshed")
    r.set_defaults(fn=report)
    cli_tune.add_parser(sub)
    n = sub.add_parser("build-native", help="compile the CUDA libraries into the cache and print where")
    n.add_argument("libraries", nargs="*", help="the libraries to build (default: every one), e.g. moe")
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
