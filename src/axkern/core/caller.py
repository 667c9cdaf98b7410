"""Where a warning should point: the user's line, not a frame inside axkern or the libraries
a call passes through on its way to the dispatcher (jax's tracing, jaxtyping's and
beartype's checking wrappers, equinox's and haliax's transforms)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

__all__ = ["stacklevel"]

_PASSED_THROUGH = ("axkern", "jax", "jaxlib", "jaxtyping", "beartype", "equinox", "haliax")


@functools.cache
def _internal_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _PASSED_THROUGH:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += [os.path.join(os.path.realpath(d), "") for d in spec.submodule_search_locations]
    return tuple(dirs)


def _internal(filename: str) -> bool:
    if filename.startswith("<@beartype"):  # the checking wrapper beartype generates
        return True
    return os.path.realpath(filename).startswith(_internal_dirs())


def stacklevel() -> int:
    """`warnings.warn`'s `stacklevel`, counted from the function that calls this one, of the
    first frame outside axkern and the libraries it is called through (the outermost frame
    when every frame is inside them)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and _internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level
