"""The `axkern` command: what runs here, how fast, and with which block sizes.

- `axkern info`: the platform, versions and each op's default implementation here (and why
  the others are passed over);
- `axkern bench [OP]`: time every implementation of every op (or one op) on its shapes;
- `axkern tune OP`: find the fastest block sizes here and keep them in the tuning cache;
- `axkern report`: tables and plots from the committed results into docs/ and the README;
- `axkern build-native [LIB]`: compile the CUDA libraries into the cache.

`axkern COMMAND -h` gives each command's options.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, info, native, report, tune
from .args import UsageError

__all__ = ["main", "parser"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("axkern")
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    """The `axkern` command line's parser."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each command's parser by name."""
    p = argparse.ArgumentParser(
        prog="axkern", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="version", version=f"axkern {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info.add_parser(sub)
    bench.add_parser(sub)
    report.add_parser(sub)
    tune.add_parser(sub)
    native.add_parser(sub)
    return p, dict(sub.choices)


def main(argv: list[str] | None = None) -> int:
    p, commands = _parsers()
    args, unknown = p.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.fn(args)
    except UsageError as e:  # a command line that cannot run: its usage and what is wrong
        commands[args.command].print_usage(sys.stderr)
        print(f"axkern {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a bad results file, cache entry or op: say so, no traceback
        print(f"axkern {args.command}: error: {e}", file=sys.stderr)
        return 2
