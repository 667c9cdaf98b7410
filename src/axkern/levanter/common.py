"""What the Levanter adapters share: Levanter's `implementation` argument as axkern's, with
Levanter's rules for names that cannot run on this platform."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from ..core import config


def needs_platform(platform: str) -> Callable[[], str | None]:
    """Why a kernel for `platform` cannot run here (None when it can). axkern's interpret mode
    (`axkern.use(interpret=True)`, `AXKERN_INTERPRET=1`) runs it here, as axkern's tests do."""

    def reason() -> str | None:
        here = jax.default_backend()
        if here == platform or config.current().interpret:
            return None
        return f"needs the {platform} backend, this is {here} (axkern.use(interpret=True) interprets it)"

    return reason


def map_impl(
    fn: str,
    implementation,
    table: dict[str, str | None],
    unavailable: dict[str, Callable[[], str | None]] | None = None,
    error: type[Exception] = NotImplementedError,
):
    """Levanter's `implementation` (a name or a sequence of names) as axkern's.

    `table` maps each Levanter name to an axkern implementation, or to None for the
    dispatcher's own order. `unavailable[name]()` says why a name cannot run here: as in
    Levanter, such a name is skipped in a sequence, and `error` is raised (naming the argument)
    when it is the only name or no name of the sequence can run. The names after one that
    maps to None are left to the dispatcher's order."""
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
    reasons = {n: (unavailable or {}).get(n, lambda: None)() for n in names}
    usable = [n for n in names if reasons[n] is None]
    if not usable:
        why = "; ".join(f"{n!r} {reasons[n]}" for n in names)
        raise error(f"{fn}: implementation={implementation!r} cannot run here: {why}")
    mapped: list[str] = []
    for n in usable:
        if table[n] is None:
            break
        mapped.append(table[n])  # type: ignore[arg-type]
    if not mapped:
        return None
    unique = tuple(dict.fromkeys(mapped))
    return unique[0] if isinstance(implementation, str) else unique
