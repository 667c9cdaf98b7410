"""Shape and dtype checking of positional signatures: jaxtyping annotations, beartype at trace time."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
from beartype import BeartypeConf, beartype
from jaxtyping import Bool, Float, Int, Shaped, jaxtyped

__all__ = ["checked", "Array", "Bool", "Float", "Int", "Shaped"]

F = TypeVar("F", bound=Callable)

#: What a positional function takes as an array: a JAX array (or tracer) or a NumPy array.
Array = jax.Array | np.ndarray

# PEP 484's numeric tower: an `int` is accepted where a `float` is annotated.
_typechecker = beartype(conf=BeartypeConf(is_pep484_tower=True))


def checked(fn: F) -> F:
    """Check `fn`'s jaxtyping annotations with beartype on every call (at trace time under jit).

    A wrong rank, inconsistent named dimension or wrong dtype kind raises jaxtyping's
    `TypeCheckError` naming the argument, before any kernel is traced.
    """
    return jaxtyped(typechecker=_typechecker)(fn)
