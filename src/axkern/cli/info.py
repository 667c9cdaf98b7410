"""`axkern info`: a summary of what each op runs here and why, then the platform, versions,
processes, nvcc and native libraries; with `--all` each op's implementations and decision."""

from __future__ import annotations

import json
import shutil

from rich.console import Console
from rich.table import Table

from axkern.bench import results

console = Console()

__all__ = ["add_parser", "info"]


def add_parser(sub) -> None:
    i = sub.add_parser(
        "info",
        help="what each op runs here and why; platform, versions, processes, nvcc",
        description="A summary first, one line per op: the implementation the dispatcher picks here "
        "for the op's first quick case, the ones it passed over (with why), and the ones that run "
        "elsewhere or only when asked for. Then the platform, versions, processes, nvcc and the "
        "native libraries.",
    )
    i.add_argument("--json", action="store_true", help="print the same facts as JSON")
    i.add_argument(
        "--all", action="store_true", help="also each op's implementations and full decision (long)"
    )
    i.add_argument("--coordinator", help="HOST:PORT of process 0: join that jax.distributed cluster first")
    i.add_argument("--num-processes", type=int, help="processes in the cluster (with --coordinator)")
    i.add_argument("--process-id", type=int, help="this process's index in the cluster (with --coordinator)")
    i.add_argument(
        "--distributed",
        action="store_true",
        help="join the cluster that JAX detects (SLURM, Open MPI, Kubernetes, Cloud TPU)",
    )
    i.set_defaults(fn=info)


def _nvcc() -> str:
    """nvcc on PATH and its release, from `nvcc --version` run as the native build runs it (its
    process group stopped after `AXKERN_NVCC_TIMEOUT` seconds, at most 30)."""
    from axkern.core import native

    path = shutil.which("nvcc")
    if path is None:
        return "not found"
    try:
        timeout = min(30.0, native.build_timeout())
    except ValueError:
        timeout = 30.0
    try:
        _, out, _ = native.run_compiler([path, "--version"], timeout)
    except native.Unsupported as e:
        return f"{path} (failed to run: {e})"
    release = [line for line in out.splitlines() if "release" in line]
    return f"{path} ({release[-1].strip() if release else 'version unknown'})"


def _typical_decision(op: str):
    """The dispatcher's choice for the op's quick benchmark shape, from `explain`."""
    from axkern.bench import cases_for

    c = cases_for(op)[0]
    return c.label, c.decision()


def _why(op: str, decision) -> dict[str, list[str]]:
    """Why the others were not picked: `passed over` (tried first; `name: reason`), `next` (the
    default order's fallbacks), `explicit only` (they run here when asked for by name) and, per
    set of platforms, `<platforms> only` (they run elsewhere)."""
    from axkern.core.registry import get_op

    op_ = get_op(op)
    spec = decision.spec
    order = op_.default_order.get(spec.platform, ("xla",))
    order = tuple(order(spec) if callable(order) else order)
    rejected = {r.implementation: r.reason for r in decision.rejected}
    out: dict[str, list[str]] = {"passed over": [f"{n}: {why}" for n, why in rejected.items()]}
    chosen = decision.implementation
    out["next"] = [n for n in order[order.index(chosen) + 1 :]] if chosen in order else []
    out["explicit only"] = []
    for name, impl in sorted(op_.implementations.items()):
        if name in (chosen, "reference") or name in rejected or name in out["next"]:
            continue
        if spec.platform in impl.platforms:
            out["explicit only"].append(name)
        else:
            out.setdefault(f"{'/'.join(impl.platforms)} only", []).append(name)
    return {k: v for k, v in out.items() if v}


def summary_lines(data: dict, width: int = 100) -> list[str]:
    """The one-screen summary: one line per op, `op: chosen` and why the others were not."""
    lines = [
        f"axkern {data['versions']['axkern']} on {data['platform']} ({data['device']} "
        f"x{data['local_devices']}), jax {data['versions']['jax']}",
        "What each op runs here, for its first quick case (`reference`, the oracle, only on request):",
    ]
    pad = max(len(f"{op}: {d['typical_choice']}") for op, d in data["ops"].items()) + 2
    for op, d in data["ops"].items():
        why = "; ".join(f"{k}: {', '.join(v)}" for k, v in d["summary"].items())
        line = f"  {op}: {d['typical_choice']}".ljust(pad + 2) + why
        line = line.rstrip()
        lines.append(line if len(line) <= width else line[: width - 1] + "…")
    return lines


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
            "summary": _why(op, decision),
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
    for line in summary_lines(data):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print()
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
    if not getattr(args, "all", False):
        console.print("`axkern info --all` adds each op's implementations and full decision.", markup=False)
        return 0
    for op, d in data["ops"].items():
        ops_t = Table(title=f"{op}")
        ops_t.add_column("implementation")
        ops_t.add_column("platforms")
        for name, plats in d["implementations"].items():
            ops_t.add_row(name, "/".join(plats))
        console.print(ops_t)
        console.print(f"{d['typical_case']} gets:\n{d['typical_decision']}\n", markup=False, highlight=False)
    return 0
