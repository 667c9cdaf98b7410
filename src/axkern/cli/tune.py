"""`axkern tune OP`: sweep block sizes on this device and keep the winners (see `axkern.bench.tune`)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from .args import ONLY_HELP, UsageError, canonical_dtype, only_cases, positive_int, writable_file

console = Console()
status = Console(stderr=True)

__all__ = ["add_parser", "tune"]


def add_parser(sub) -> None:
    t = sub.add_parser(
        "tune",
        help="sweep an op's block sizes here; store the fastest correct ones in the tuning cache",
        description="For each case of the preset and each tunable implementation: measure every "
        "candidate of the implementation's block-size space (forward+backward, checked against the "
        "reference), and store the fastest accepted one in the per-user tuning cache "
        "(~/.cache/axkern/tuning/<device>.json; AXKERN_CACHE_DIR overrides), which the dispatcher "
        "reads before the shipped tables.",
    )
    t.add_argument("op", help="the op to tune (`axkern info` lists them)")
    t.add_argument(
        "--preset", help="a named shape set of the op (default: 'quick'; see bench --list-presets)"
    )
    t.add_argument("--tokens", type=positive_int, help="override the preset's token count")
    t.add_argument("--dtype", help="override the preset's dtype: float32, bfloat16, float16")
    t.add_argument(
        "--impl",
        help="comma-separated implementations (default: the tunable ones that run compiled here)",
    )
    t.add_argument(
        "--repeats", type=positive_int, default=10, help="timed repeats per candidate (default 10)"
    )
    t.add_argument(
        "--write-table",
        action="store_true",
        help="also put the winners into the shipped table src/axkern/ops/<op>/tuned/<device>.json",
    )
    t.add_argument(
        "--source", help="with --write-table: where the sweep's output is kept (recorded in the entry)"
    )
    t.add_argument("--json", help="also write every candidate's row as JSON here")
    t.add_argument("--only", help=ONLY_HELP)
    t.set_defaults(fn=tune)


def _implementations(op: str, explicit: str | None) -> list[str]:
    from axkern.bench.tune import tunable
    from axkern.core import backend
    from axkern.core.op import get_op

    impls = get_op(op).implementations
    names = tunable(op)
    if explicit is None:
        here = [n for n in names if backend.platform() in impls[n].platforms]
        if not here:
            raise UsageError(
                f"OP: expected an op with a tunable implementation that runs compiled on "
                f"{backend.platform()}, got {op!r} (tunable: {', '.join(names) or 'none'})"
            )
        return here
    chosen = [n.strip() for n in explicit.split(",") if n.strip()]
    if not chosen:
        raise UsageError(f"--impl: expected comma-separated implementation names, got {explicit!r}")
    for n in chosen:
        if n not in names:
            raise UsageError(
                f"--impl: expected tunable implementations of {op} ({', '.join(names)}), got {n!r}"
            )
    return chosen


def _print(result) -> None:
    t = Table(title=f"{result.op} / {result.implementation}: {result.case}")
    title = f"accepted: max rel err <= {result.limit:.2e}" if result.limit is not None else None
    t.caption = title
    for col in ("block sizes", "ms (median)", "min-max ms", "max rel err", ""):
        t.add_column(col, overflow="fold")
    for bs, r in result.rows:
        mark = (
            "best" if bs == result.best else ("ok" if result.accepted(r) else (r.note or "rejected: error"))
        )
        t.add_row(
            " ".join(f"{k}={v}" for k, v in bs.as_dict().items() if v is not None),
            "-" if r.ms is None else f"{r.ms:.3f}",
            "-" if r.ms_min is None else f"{r.ms_min:.3f}-{r.ms_max:.3f}",
            "-" if r.max_rel_error is None else f"{r.max_rel_error:.2e}",
            mark,
        )
    console.print(t)


def tune(args) -> int:
    from axkern.bench import cases_for
    from axkern.bench import tune as tune_
    from axkern.core.op import get_op

    try:
        get_op(args.op)
    except ValueError as e:
        raise UsageError(f"OP: {e}") from None
    if args.source and not args.write_table:
        raise UsageError("--source: expected with --write-table (it is recorded in the shipped table)")
    impls = _implementations(args.op, args.impl)
    try:
        cases = cases_for(args.op, preset=args.preset, tokens=args.tokens, dtype=canonical_dtype(args.dtype))
    except ValueError as e:
        raise UsageError(f"--preset: {e}") from None
    cases = only_cases(cases, args.only)
    writable_file("--json", args.json)
    command = " ".join(["axkern", *args.argv])
    results = []
    for case in cases:
        for impl in impls:
            status.print(f"tuning {args.op} / {impl} on {case.label} ...")
            res = tune_.sweep(
                case,
                impl,
                repeats=args.repeats,
                on_row=lambda bs, r: status.print(
                    f"  {bs}: "
                    + ("-" if r.ms is None else f"{r.ms:.3f} ms")
                    + (f" {r.note}" if r.note else ""),
                    markup=False,
                    highlight=False,
                ),
            )
            _print(res)
            results.append(res)
    unkept = False
    try:
        path = tune_.save(results, command=command)
    except ValueError as e:  # the cache cannot be written: the winners are printed, not kept
        path, unkept = None, True
        for r in results:
            if r.best is not None:
                status.print(
                    f"{r.op} / {r.implementation} on {r.case}: best {r.best}", markup=False, soft_wrap=True
                )
        status.print(f"tuning cache: {e}; the winners above are not kept", markup=False, soft_wrap=True)
    if path is not None:
        console.print(f"tuning cache: {path}", markup=False, highlight=False)
    if args.write_table:
        try:
            for p in tune_.write_table(results, command=command, source=args.source):
                console.print(f"shipped table: {p}", markup=False, highlight=False)
        except OSError as e:
            unkept = True
            status.print(
                f"shipped table: not written ({type(e).__name__}: {e})", markup=False, soft_wrap=True
            )
    if args.json:
        doc = [
            {
                "op": r.op,
                "implementation": r.implementation,
                "case": r.case,
                "bucket": r.bucket,
                "limit_max_rel_error": r.limit,
                "best": None if r.best is None else r.best.as_dict(),
                "rows": [{"block_sizes": bs.as_dict()} | row.as_dict() for bs, row in r.rows],
            }
            for r in results
        ]
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    missing = [r for r in results if r.best is None]
    for r in missing:
        status.print(
            f"{r.op} / {r.implementation} on {r.case}: no candidate passed the check; nothing stored"
        )
    return 1 if missing or unkept else 0
