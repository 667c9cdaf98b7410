"""`axkern info | bench | tune | report | build-native`: what runs here, how fast, and with which block sizes."""

from __future__ import annotations

import argparse
import sys

from . import bench, info, native, report, tune

__all__ = ["main", "parser"]


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
    info.add_parser(sub)
    bench.add_parser(sub)
    report.add_parser(sub)
    tune.add_parser(sub)
    native.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.fn(args)
    except ValueError as e:  # a bad op, preset or option: say so, no traceback
        print(f"axkern {args.command}: error: {e}", file=sys.stderr)
        return 2
