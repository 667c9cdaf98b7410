"""`axkern bench`: check every argument, time the implementations (and, on request, the PyTorch
peers), and print or save the rows."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from axkern.bench import results
from axkern.bench.format import print_rows, row_line

from .args import (
    ONLY_HELP,
    UsageError,
    canonical_dtype,
    only_cases,
    positive_int,
    writable_file,
    writable_folder,
)

console = Console()  # results
status = Console(stderr=True)  # progress and rows as they are measured: stdout keeps only the results

__all__ = ["add_parser", "bench"]


def add_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="time every implementation of every op (or one op)",
        description="Time every implementation of every op (or of OP) on the op's shapes: per case, "
        "each implementation's milliseconds as a multiple of the default's (what the dispatcher picks "
        "here), its temporary memory, rates and error against reference. Every argument is checked "
        "before anything is measured.",
    )
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
    b.add_argument("--tokens", type=positive_int, help="override the preset's token count")
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
    b.add_argument(
        "--passes",
        choices=("fwd", "fwd+bwd", "both"),
        default="both",
        help="which passes to time: the forward, forward+backward, or both (default)",
    )
    b.add_argument(
        "--repeats", type=positive_int, help="timed repeats, median reported (default: 20; 3 with --quick)"
    )
    b.add_argument(
        "--json",
        help='also write the rows as JSON here (after each case, with "complete": false until the end)',
    )
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
        help="how the results are printed on stdout: a table grouped by case that fits the terminal "
        "(default), or json, csv, markdown for machines (progress goes to stderr)",
    )
    b.add_argument(
        "--cases",
        help="time the cases() of this Python file instead of the ops' (examples/tiny_lm.py: one training "
        "step, its ops as the dispatcher picks them ('default') and all 'reference')",
    )
    b.add_argument(
        "--only",
        help=ONLY_HELP,
    )
    b.add_argument(
        "--blocks",
        metavar="IMPL:FIELD=VALUE[,...]",
        help="with one OP: the block sizes the dispatcher picks for that implementation (tuning cache, "
        "table or heuristic) with these fields replaced (none for None), e.g. "
        "mosaic_gpu:forward=fused,scan_backward=whole for ssd: a form that is not the default, timed as "
        "the default is",
    )
    b.set_defaults(fn=bench)


def bench(args) -> int:
    if args.list_presets:
        return _list_presets(args)
    work, passes = _plan(args)  # every argument checked before anything is measured
    import jax

    from axkern.bench import DEFAULT_PRESET, copy_bandwidth, matmul_ceiling, measure, replaced_blocks
    from axkern.core import backend

    repeats = args.repeats or (3 if args.quick else 20)
    preset = args.preset
    ops = sorted({c.op for c, _ in work if not args.cases})
    labels = {c.label for c, _ in work}
    peer_rows = _peers(args, ops, preset, repeats, labels) if args.peers else []  # before JAX takes the GPU
    device = jax.devices()[0].device_kind
    # On a CPU one matmul's or one copy's rate bounds nothing else: caches, threads and
    # shapes change the rate by more than the kernels differ, so no ceiling is measured.
    ceiling = bandwidth = None
    if backend.platform() != "cpu":
        status.print(f"measuring the matmul ceiling and copy bandwidth on {device} ...")
        ceiling = matmul_ceiling(repeats=repeats)
        bandwidth = copy_bandwidth(repeats=repeats)
    rows = []
    defaults = _defaults(work, args)

    def document(rows):
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
        for case in doc["cases"]:  # what the dispatcher picks here: the table's times are ratios to it
            case["default"] = defaults.get((case["op"], case["case"]))
        return doc

    blocks = replaced_blocks(args.op, args.blocks) if args.blocks else contextlib.nullcontext()
    with blocks, Progress(console=status, transient=True) as progress:
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
            if args.json:  # the rows so far, so that a run cut short keeps what it measured
                _write_json(args.json, document(rows) | {"complete": False})
    rows += _peer_rows(peer_rows, work, rows, ceiling)
    doc = document(rows)
    print_rows(rows, doc, args.format, console)
    if args.json:
        _write_json(args.json, doc)
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


def _defaults(work, args) -> dict[tuple[str, str], str]:
    """Each case's default implementation here, what the dispatcher picks for it (`explain` on its
    shapes), by (op, case label); `default` for a file's cases (`--cases`)."""
    out = {}
    for c, _ in work:
        if args.cases:
            out[(c.op, c.label)] = "default"
            continue
        try:
            out[(c.op, c.label)] = c.decision().implementation
        except (NotImplementedError, ValueError, TypeError):  # nothing serves it here: ratios to reference
            continue
    return out


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


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
    if args.blocks is not None:
        if not args.op:
            raise UsageError(
                f"--blocks: expected one OP (block sizes belong to one op), got --blocks {args.blocks!r}"
            )
        from axkern.bench import replaced_blocks

        try:
            replaced_blocks(args.op, args.blocks)  # checks the text; entered while measuring
        except ValueError as e:
            raise UsageError(f"--blocks: {e}") from None
    dtype = args.dtype = canonical_dtype(args.dtype)  # the canonical name, for the peers too
    writable_file("--json", args.json)
    writable_folder("--save", args.save)
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
    work = only_cases(work, args.only, label=lambda item: item[0].label)
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
    import inspect

    if not Path(path).is_file():
        raise UsageError(f"--cases: expected a Python file that defines cases(), got {path!r} (not a file)")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # equinox modules in the file look their module up
    spec.loader.exec_module(module)
    expected = f"--cases: expected a file that defines cases(preset=, tokens=, dtype=), got {path!r}"
    if not callable(getattr(module, "cases", None)):
        raise UsageError(expected)
    try:
        inspect.signature(module.cases).bind(preset=preset, tokens=tokens, dtype=dtype)
    except TypeError as e:
        raise UsageError(
            f"{expected}, whose cases{inspect.signature(module.cases)} does not take them ({e})"
        ) from None
    except ValueError:  # no signature to inspect (a builtin): called as it is
        pass
    return module.cases(preset=preset, tokens=tokens, dtype=dtype)


def _peers(args, ops, preset, repeats, labels) -> list[tuple]:
    """`(case, peer result)` for every case to be timed (`labels`, after `--only`) of the ops that
    have peers (`axkern.bench.peers`)."""
    from axkern.bench import cases_for, peers

    out, timed = [], {}
    for op in ops:
        if op not in peers.PEERS:
            continue
        for c in cases_for(op, preset=preset, tokens=args.tokens, dtype=args.dtype):
            if c.label not in labels:
                continue
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
            row.ms, row.ms_min, row.ms_max, row.temp_gib = (
                r.get(k) for k in ("ms", "ms_min", "ms_max", "temp_gib")
            )
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
