"""`axkern report`: tables and plots from the committed results into the docs and the README."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from axkern.bench import results

from .args import UsageError

console = Console()

__all__ = ["add_parser", "report"]

HELP = "tables and plots from the committed results into docs/ and the README (needs the report extra)"
DESCRIPTION = (
    "Read every run under --results (benchmarks/results/<device_key>/<op>/<preset>.json) and write "
    "the tables and plots: the long form with each run's command and versions into "
    "docs/benchmarks.md and the op pages, the short form (each op's default beside its peers) into "
    "the README, the plots into docs/img/. Only files whose bytes change are rewritten. The plots "
    "need matplotlib: pip install -e '.[report]'."
)


def add_parser(sub) -> None:
    r = sub.add_parser("report", help=HELP, description=DESCRIPTION)
    r.add_argument(
        "--results", default=str(results.DEFAULT_ROOT), help="results folder (default: benchmarks/results)"
    )
    r.add_argument("--docs", default="docs", help="docs folder: benchmarks.md, ops/ and img/ (default: docs)")
    r.add_argument("--readme", default="README.md", help="the README whose short form is refreshed")
    r.set_defaults(fn=report)


def report(args) -> int:
    """Tables and plots from the committed results into the docs and the README."""
    from axkern.bench import plots
    from axkern.bench import report as report_

    for flag, path in (("--results", args.results), ("--docs", args.docs)):
        if not Path(path).is_dir():
            raise UsageError(f"{flag}: expected a folder, got {path!r}")
    if not Path(args.readme).is_file():
        raise UsageError(f"--readme: expected a file, got {args.readme!r}")
    runs = results.load(args.results)
    try:
        changed = report_.write(runs, docs=Path(args.docs), readme=Path(args.readme))
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        raise UsageError(plots.MATPLOTLIB_MISSING) from None
    for path, wrote in changed.items():
        if wrote:
            console.print(f"wrote {path}", markup=False, highlight=False)
    same = sum(not w for w in changed.values())
    console.print(f"{same} of {len(changed)} files unchanged", markup=False, highlight=False)
    return 0
