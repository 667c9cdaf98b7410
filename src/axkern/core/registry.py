"""The registry of ops by name: every `Op` adds itself when built; the dispatcher, `axkern.use`
and the tools look ops up here."""

from __future__ import annotations

from typing import Any

__all__ = ["OPS", "register", "registered_ops", "get_op", "ops", "implementations"]

OPS: dict[str, Any] = {}  # name -> `core.op.Op`


def register(op: Any) -> None:
    """Add `op` (an `Op`) under its name, replacing an op of the same name."""
    OPS[op.name] = op


def registered_ops() -> dict[str, Any]:
    """Every registered op by name."""
    return dict(OPS)


def get_op(name: str) -> Any:
    """The op registered as `name`; an unknown name is a `ValueError` naming the known ones."""
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known ops are {sorted(OPS)}") from None


def ops() -> list[str]:
    """Names of the registered ops (`axkern.ops()`), sorted.

    ```python
    >>> import axkern
    >>> [name for name in axkern.ops() if name.startswith("moe_")]
    ['moe_combine', 'moe_dispatch', 'moe_ep_combine', 'moe_ep_dispatch', 'moe_layout']

    ```
    """
    return sorted(OPS)


def implementations(op: str) -> dict[str, tuple[str, ...]]:
    """An op's implementations and the platforms each runs on, in registration order
    (`axkern.implementations("ssd")`); an unknown op is a `ValueError` naming the known ones.

    ```python
    >>> import axkern
    >>> axkern.implementations("cross_entropy")
    {'xla': ('cpu', 'gpu', 'tpu'), 'reference': ('cpu', 'gpu', 'tpu')}

    ```
    """
    return {name: impl.platforms for name, impl in get_op(op).implementations.items()}
