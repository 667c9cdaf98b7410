"""Shape and dtype checking of positional signatures: jaxtyping annotations, beartype at trace time."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, jaxtyped

__all__ = ["checked", "Array", "Bool", "Float", "Int"]

F = TypeVar("F", bound=Callable)


def checked(fn: F) -> F:
    """Check `fn`'s jaxtyping annotations with beartype on every call (at trace time under jit).

    A wrong rank, inconsistent named dimension or wrong dtype kind raises jaxtyping's
    `TypeCheckError` naming the argument, before any kernel is traced.
    """
    return jaxtyped(typechecker=beartype)(fn)
