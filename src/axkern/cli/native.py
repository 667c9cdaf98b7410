"""`axkern build-native`: compile the CUDA libraries into the cache and print where."""

from __future__ import annotations

import sys

from rich.console import Console

from .args import compute_capability

console = Console()

__all__ = ["add_parser", "build_native"]


def add_parser(sub) -> None:
    n = sub.add_parser("build-native", help="compile the CUDA libraries into the cache and print where")
    n.add_argument("libraries", nargs="*", help="the libraries to build (default: every one), e.g. moe")
    n.add_argument("--arch", help="compute capability to build for (default: the visible GPU's), e.g. 9.0")
    n.set_defaults(fn=build_native)


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

    if args.arch is not None:
        cc = compute_capability("--arch", args.arch)
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
