"""Shape and dtype checking of positional signatures: jaxtyping annotations, beartype at trace time."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Literal, TypeVar

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
    `TypeCheckError` naming the argument, before any kernel is traced. A parameter
    `implementation` annotated with `Literal` names (an op's implementations, for `<op>_positional`)
    is checked first: a name outside them is a `ValueError` listing them, as the dispatcher's.
    """
    typed = jaxtyped(typechecker=_typechecker)(fn)
    signature = inspect.signature(fn)
    if "implementation" not in signature.parameters:
        return typed
    op = fn.__name__.removesuffix("_positional")
    known: list[str] = []

    @functools.wraps(fn)
    def check_names(*args, **kwargs):
        if "implementation" in kwargs:
            value = kwargs["implementation"]
        else:
            value = signature.bind_partial(*args, **kwargs).arguments.get("implementation")
        names = (value,) if isinstance(value, str) else value if isinstance(value, (tuple, list)) else ()
        if names and not known:
            known.extend(sorted(_literal_names(fn)))
        for name in names:
            if isinstance(name, str) and known and name not in known:
                raise ValueError(f"{op}: unknown implementation {name!r}; known: {known}")
        return typed(*args, **kwargs)

    return check_names  # type: ignore[return-value]


def _literal_names(fn: Callable) -> set[str]:
    """The strings of the `Literal`s in `fn`'s annotation of `implementation`."""
    annotation = fn.__annotations__["implementation"]
    if isinstance(annotation, str):  # `from __future__ import annotations`
        annotation = eval(annotation, fn.__globals__)  # noqa: S307 - the module's own annotation

    def walk(tp) -> set[str]:
        if typing.get_origin(tp) is Literal:
            return {a for a in typing.get_args(tp) if isinstance(a, str)}
        return set().union(*(walk(a) for a in typing.get_args(tp)))

    return walk(annotation)
