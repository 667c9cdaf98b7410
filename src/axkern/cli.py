"""`axkern info | bench`: what runs here, and how fast."""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

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


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {name: v(name) for name in ("axkern", "jax", "jaxlib", "haliax", "equinox")} | {
        "python": sys.version.split()[0]
    }


def _typical_decision(op: str):
    """The dispatcher's choice for the op's quick benchmark shape, from `explain`."""
    import jax

    import axkern
    from axkern.bench import cases_for

    c = cases_for(op)[0]
    shapes = jax.eval_shape(c.make, jax.random.PRNGKey(0))
    return c.label, axkern.explain(lambda *a: c.forward(None, *a), *shapes)


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


def info(args) -> int:
    _join_cluster(args)
    import jax

    import axkern
    from axkern.core import backend

    t = Table(title="axkern info", show_header=False)
    t.add_column("what")
    t.add_column("value")
    for k, v in _versions().items():
        t.add_row(k, v)
    t.add_row("platform", backend.platform())
    t.add_row("device", f"{backend.device_kind()} x{jax.local_device_count()} in this process")
    t.add_row("processes", f"{jax.process_count()} (this is process {jax.process_index()})")
    t.add_row("global devices", str(jax.device_count()))
    cc = backend.compute_capability()
    t.add_row("compute capability", "n/a" if cc is None else f"{cc[0]}.{cc[1]}")
    t.add_row("tuned-table key", backend.device_key())
    t.add_row("nvcc", _nvcc())
    from axkern.core import native

    for name, line in native.status().items():
        t.add_row(f"native: {name}", line)
    console.print(t)
    for op in axkern.ops():
        ops_t = Table(title=f"{op}")
        ops_t.add_column("implementation")
        ops_t.add_column("platforms")
        for name, plats in axkern.implementations(op).items():
            ops_t.add_row(name, "/".join(plats))
        console.print(ops_t)
        label, decision = _typical_decision(op)
        console.print(f"{label} gets:\n{decision}\n", markup=False, highlight=False)
    return 0


def bench(args) -> int:
    import jax

    import axkern
    from axkern.bench import cases_for, copy_bandwidth, matmul_ceiling, measure
    from axkern.core import backend

    ops = [args.op] if args.op else axkern.ops()
    if args.cases:
        ops = []  # the file's cases only
    if args.preset and not args.op and not args.cases:
        console.print("[red]--preset needs an OP (presets belong to one op)[/red]")
        return 2
    repeats = args.repeats or (3 if args.quick else 20)
    passes = ("fwd", "fwd+bwd") if args.passes == "both" else (args.passes,)
    preset = None if args.quick else args.preset
    peer_rows = _peers(args, ops, preset, repeats) if args.peers else []  # before JAX takes the GPU
    console.print(f"measuring the matmul ceiling on {jax.devices()[0].device_kind} ...")
    ceiling = matmul_ceiling(repeats=repeats)
    bandwidth = copy_bandwidth(repeats=repeats)
    work = []
    for op in ops:
        # by default, the implementations that run compiled here (Pallas in interpret mode times nothing useful)
        here = backend.platform()
        impls = (
            args.impl.split(",")
            if args.impl
            else [n for n, p in axkern.implementations(op).items() if here in p]
        )
        for c in cases_for(op, preset=preset, tokens=args.tokens, dtype=args.dtype):
            work.append((c, impls))
    if args.cases:
        impls = args.impl.split(",") if args.impl else ["default", "reference"]
        work += [(c, impls) for c in _file_cases(args.cases, preset, args.tokens, args.dtype)]
    rows = []
    with Progress(console=console, transient=True) as progress:
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
                    console.print(_row_line(r), markup=False, highlight=False),
                ),
            )
    rows += _peer_rows(peer_rows, work, rows, ceiling)

    t = Table(
        title=f"axkern bench on {jax.devices()[0].device_kind} "
        f"(matmul ceiling {ceiling:.1f} TFLOP/s, copy {bandwidth:.0f} GB/s)"
    )
    for col in (
        "op",
        "case",
        "impl",
        "pass",
        "ms",
        "TFLOP/s",
        "GB/s",
        "of ceiling",
        "temp GiB",
        "max rel err",
        "note",
    ):
        t.add_column(col, overflow="fold")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        t.add_row(
            r.op,
            r.case,
            r.implementation,
            r.pass_,
            fmt(r.ms, ".3f"),
            fmt(r.tflops, ".2f"),
            fmt(r.gbps, ".0f"),
            fmt(r.ceiling_fraction, ".1%"),
            fmt(r.temp_gib, ".3f"),
            fmt(r.max_rel_error, ".2e"),
            r.note,
        )
    console.print(t)
    if args.json:
        out = {
            "command": " ".join(["axkern"] + sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": jax.devices()[0].device_kind,
            "versions": _versions(),
            "matmul_ceiling_tflops": ceiling,
            "copy_bandwidth_gbps": bandwidth,
            "note": "TFLOP/s count model FLOPs (recomputation not counted); GB/s count the fewest bytes each "
            "pass must move; 'of ceiling' is against the matmul rate (compute-bound ops) or the copy "
            "bandwidth (memory-bound ops) measured at the start of this run",
            "rows": [r.as_dict() for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        console.print(f"wrote {args.json}")
    failed = [  # a peer that could not run is reported, not a failure of ours
        r
        for r in rows
        if r.ms is None and not r.note.startswith("unsupported") and not r.implementation.startswith("peer:")
    ]
    return 1 if failed else 0


def _file_cases(path: str, preset, tokens, dtype) -> list:
    """The `cases(preset=, tokens=, dtype=)` of a Python file (e.g. examples/tiny_lm.py: one
    training step, implementations `default` and `reference`)."""
    import importlib.util
    from pathlib import Path

    if not Path(path).is_file():
        raise ValueError(f"--cases must be a Python file that defines cases(); {path!r} is not a file")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # equinox modules in the file look their module up
    spec.loader.exec_module(module)
    if not hasattr(module, "cases"):
        raise ValueError(f"--cases: {path} defines no cases(preset=, tokens=, dtype=) function")
    return module.cases(preset=preset, tokens=tokens, dtype=dtype)


def _row_line(r) -> str:
    """One row as a line, printed as it is measured (a run cut short keeps what it measured)."""
    ms = "-" if r.ms is None else f"{r.ms:.3f} ms"
    tf = "" if r.tflops is None else f" {r.tflops:.1f} TFLOP/s"
    gb = "" if r.gbps is None else f" {r.gbps:.0f} GB/s"
    err = "" if r.max_rel_error is None else f" err {r.max_rel_error:.1e}"
    return f"{r.op} | {r.case} | {r.implementation} | {r.pass_} | {ms}{tf}{gb}{err} {r.note}".rstrip()


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
    for r in rows:
        ratios = [
            f"{r.ms / p.ms:.2f}x {p.implementation[5:]}"
            for p in out
            if p.ms and r.ms and (p.case, p.pass_) == (r.case, r.pass_)
        ]
        if ratios:
            r.note = "; ".join(filter(None, [r.note, "time " + ", ".join(ratios)]))
    return out


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
        console.print(f"{name}: {path}", markup=False, highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="axkern", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    i = sub.add_parser("info", help="platform, versions, processes, nvcc, and what each op picks here")
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
    b.add_argument("--quick", action="store_true", help="small default shapes (seconds on a CPU)")
    b.add_argument("--preset", help="a named shape set of the op (e.g. llama3)")
    b.add_argument("--tokens", type=int, help="override the preset's token count")
    b.add_argument("--dtype", help="override the preset's dtype (e.g. bfloat16, float32)")
    b.add_argument("--impl", help="comma-separated implementations (default: all)")
    b.add_argument(
        "--peers",
        action="store_true",
        help="also time the PyTorch kernels users pick instead (Liger, cut-cross-entropy, plain torch) "
        "in a subprocess, when importable; notes give each time as a multiple of theirs",
    )
    b.add_argument("--passes", choices=("fwd", "fwd+bwd", "both"), default="both")
    b.add_argument("--repeats", type=int, help="timed repeats (median reported)")
    b.add_argument("--json", help="also write the rows as JSON here")
    b.add_argument(
        "--cases",
        help="time the cases() of this Python file instead of the ops' (examples/tiny_lm.py: one training "
        "step, its ops as the dispatcher picks them ('default') and all 'reference')",
    )
    b.set_defaults(fn=bench)
    n = sub.add_parser("build-native", help="compile the CUDA libraries into the cache and print where")
    n.add_argument("--arch", help="compute capability to build for (default: the visible GPU's), e.g. 9.0")
    n.set_defaults(fn=build_native)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:  # a bad op, preset or option: say so, no traceback
        print(f"axkern {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
