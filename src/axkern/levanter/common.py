"""What the Levanter adapters share: Levanter's `implementation` argument mapped to axkern's names."""

from __future__ import annotations

from collections.abc import Sequence


def map_impl(fn: str, implementation, table: dict[str, str]):
    """Levanter's `implementation` (a name or a sequence of names) as axkern's."""
    if implementation is None:
        return None
    names = (implementation,) if isinstance(implementation, str) else implementation
    if not isinstance(names, Sequence) or any(not isinstance(n, str) for n in names):
        raise TypeError(
            f"{fn}: implementation must be None, a name or a sequence of names from {sorted(table)}; "
            f"got {implementation!r} (callables are Levanter's own kernels and cannot run here)"
        )
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"{fn}: implementation must be one of {sorted(table)}; got {unknown[0]!r}")
    mapped = tuple(dict.fromkeys(table[n] for n in names))
    return mapped[0] if isinstance(implementation, str) else mapped
