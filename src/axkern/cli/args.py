"""What the `axkern` commands share: the usage error and the argument types they parse."""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

__all__ = [
    "UsageError",
    "canonical_dtype",
    "only_cases",
    "positive_int",
    "compute_capability",
    "writable_file",
    "writable_folder",
    "ONLY_HELP",
]


class UsageError(ValueError):
    """A command line that cannot run: one line naming the argument, what was expected, what was given."""


_DTYPES = {  # accepted spellings of the dtypes the benchmark cases take
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}


def canonical_dtype(value: str | None) -> str | None:
    """`--dtype`'s value as the dtype's canonical name (`bf16` -> `bfloat16`), or a `UsageError`."""
    if value is None:
        return None
    try:
        return _DTYPES[value.strip().lower()]
    except KeyError:
        raise UsageError(
            f"--dtype: expected one of float32, bfloat16, float16 (or fp32, bf16, fp16), got {value!r}"
        ) from None


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


ONLY_HELP = (
    "comma-separated parts of case labels: only the cases whose label holds one of them "
    "(e.g. --only docs1024,D=256; labels as printed)"
)


def only_cases(items: list, only: str | None, label=lambda item: item.label) -> list:
    """The items whose case label (`label(item)`) holds one of `--only`'s comma-separated parts;
    all of them when `only` is None. A `UsageError` listing the labels when none is kept."""
    if only is None:
        return items
    parts = [p.strip() for p in only.split(",") if p.strip()]
    kept = [it for it in items if any(p in label(it) for p in parts)]
    if not parts or not kept:
        labels = "; ".join(label(it) for it in items)
        raise UsageError(f"--only: expected parts of these case labels: {labels}; got {only!r}")
    return kept


def compute_capability(flag: str, value: str) -> tuple[int, int]:
    """`9.0` (or `9`, `10.0`) as `(major, minor)`, or a `UsageError` naming `flag`."""
    m = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*", value)
    if m is None:
        raise UsageError(f"{flag}: expected a compute capability such as 9.0, got {value!r}")
    return int(m.group(1)), int(m.group(2) or 0)


def _refused(folder: Path) -> str | None:
    """Why a file cannot be made in `folder` (an existing folder), or None: a file is made and
    removed, which a read-only mode does not stop for root but a read-only filesystem does."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".axkern-probe-", dir=folder)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(probe)
    return None


def writable_file(flag: str, path: str | None) -> None:
    """Fail now, not after the measurements, when the file `path` cannot be written."""
    if path is None:
        return
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise UsageError(f"{flag}: expected a file path, got the directory {path!r}")
    if not parent.is_dir():
        raise UsageError(
            f"{flag}: expected a path in an existing directory, got {path!r} ({parent} does not exist)"
        )
    why = _refused(parent)
    if why is not None or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag}: expected a writable path, got {path!r} ({why or 'permission denied'})")


def writable_folder(flag: str, path: str | None) -> None:
    """Fail now, not after the measurements, when the folder `path` cannot be made or written."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag}: expected a results folder, got the file {path!r}")
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag}: expected a folder that can be made, got {path!r} ({existing} is a file)")
    why = _refused(existing)
    if why is not None:
        raise UsageError(f"{flag}: expected a folder that can be written, got {path!r} ({existing}: {why})")
