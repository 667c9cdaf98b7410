"""`axkern report`: tables and plots from the committed results into the docs and the README."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from axkern.bench import results

from .args import UsageError

console = Console()

__all__ = ["add_parser", "report"]


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="tables and plots from the committed results into docs/ and the README")
    r.add_argument(
        "--results", default=str(results.DEFAULT_ROOT), help="results folder (default: benchmarks/results)"
    )
    r.add_argument("--docs", default="docs", help="docs folder: benchmarks.md and img/ (default: docs)")
    r.add_argument("--readme", default="README.md", help="the README whose overview plot is refreshed")
    r.set_defaults(fn=report)


def report(args) -> int:
    """Tables and plots from the committed results into the docs and the README."""
    from axkern.bench import report as report_

    for flag, path in (("--results", args.results), ("--docs", args.docs)):
        if not Path(path).is_dir():
            raise UsageError(f"{flag}: expected a folder, got {path!r}")
    if not Path(args.readme).is_file():
        raise UsageError(f"--readme: expected a file, got {args.readme!r}")
    for path in report_.write(results.load(args.results), docs=Path(args.docs), readme=Path(args.readme)):
        console.print(f"wrote {path}", markup=False, highlight=False)
    return 0
