"""What the `axkern` commands share: the usage error and the argument types they parse."""

from __future__ import annotations

import argparse

__all__ = ["UsageError", "canonical_dtype", "only_cases", "positive_int", "ONLY_HELP"]


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
