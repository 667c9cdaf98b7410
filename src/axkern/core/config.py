"""`axkern.use(...)`: scoped settings (strict mode, interpret mode, autotuning, per-op implementation choice).

Precedence for every setting: an argument of the call > the innermost `use(...)` > the
environment (`AXKERN_STRICT`, `AXKERN_INTERPRET`, `AXKERN_AUTOTUNE`, `AXKERN_IMPL_<OP>`) > the default.

Settings are read when a function is traced. The settings of `use(...)` are also part of
`jax.jit`'s cache key (a JAX user context): a function compiled by `jax.jit` or
`eqx.filter_jit` outside a `use(...)` block is traced again when called inside it, so the
change takes effect in the next call. The environment variables are read at trace time
only: change them before the first call. An `AXKERN_*` variable that axkern does not read (a
misspelt op in `AXKERN_IMPL_<OP>`, say) warns once, naming the closest one it does read.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import os
import warnings
from collections.abc import Iterator

from . import caller, compat, registry

__all__ = ["Settings", "use", "current", "implementation_override"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True)
class Settings:
    strict: bool | None = None
    interpret: bool | None = None
    autotune: bool | None = None
    implementations: tuple[tuple[str, str | tuple[str, ...]], ...] = ()


_settings: contextvars.ContextVar[Settings] = contextvars.ContextVar("axkern_settings", default=Settings())  # noqa: B039 - frozen
_jit_key = compat.jit_context(None)  # the settings of use(...), as part of jax.jit's cache key


# read here, by the native loader (AXKERN_CACHE_DIR, AXKERN_NVCC*), by the test suite (AXKERN_TEST_*)
# and by the bench's splash attention peer (AXKERN_SPLASH_SWEEP)
_KNOWN_VARIABLES = (
    "AXKERN_STRICT",
    "AXKERN_INTERPRET",
    "AXKERN_AUTOTUNE",
    "AXKERN_CACHE_DIR",
    "AXKERN_NVCC",
    "AXKERN_NVCC_TIMEOUT",
    "AXKERN_TEST_GPU",
    "AXKERN_TEST_TPU",
    "AXKERN_TEST_TPU_RECORD",
    "AXKERN_TEST_PROCESSES",
    "AXKERN_SPLASH_SWEEP",
)
_warned_variables: set[str] = set()


def _check_variables() -> None:
    """Warn once per unknown `AXKERN_*` variable, naming the closest known one."""
    unknown = [k for k in os.environ if k.startswith("AXKERN_") and k not in _warned_variables]
    if not unknown:
        return
    known = list(_KNOWN_VARIABLES) + [f"AXKERN_IMPL_{op.upper()}" for op in registry.ops()]
    for name in unknown:
        if name in known:
            continue
        _warned_variables.add(name)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; axkern reads {', '.join(sorted(known))}"
        warnings.warn(
            f"axkern: the environment variable {name} is not one axkern reads, so it is ignored{hint}",
            UserWarning,
            stacklevel=caller.stacklevel(),
        )


def _env_flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of 1/0, true/false, yes/no, on/off")


def current() -> Settings:
    """The settings in force here, with the environment filled in."""
    _check_variables()
    s = _settings.get()
    strict = s.strict if s.strict is not None else _env_flag("AXKERN_STRICT")
    interpret = s.interpret if s.interpret is not None else _env_flag("AXKERN_INTERPRET")
    autotune = s.autotune if s.autotune is not None else _env_flag("AXKERN_AUTOTUNE")
    return dataclasses.replace(s, strict=strict, interpret=interpret, autotune=autotune)


def _parse_names(value: str | tuple[str, ...] | list[str]) -> str | tuple[str, ...]:
    if isinstance(value, str):
        names = tuple(v.strip() for v in value.split(",") if v.strip())
        return names[0] if len(names) == 1 else names
    return tuple(value)


def implementation_override(op: str) -> str | tuple[str, ...] | None:
    """The implementation(s) requested for `op` by `use(...)` or `AXKERN_IMPL_<OP>`, if any."""
    for name, value in reversed(_settings.get().implementations):
        if name == op:
            return value
    raw = os.environ.get(f"AXKERN_IMPL_{op.upper()}")
    return _parse_names(raw) if raw and raw.strip() else None


@contextlib.contextmanager
def use(
    *,
    strict: bool | None = None,
    interpret: bool | None = None,
    autotune: bool | None = None,
    **implementations,
) -> Iterator[None]:
    """Scope settings for the axkern calls traced inside the `with` block.

    **Arguments:**

    - `strict`: raise instead of falling back when an implementation cannot serve a call.
      `strict`, `interpret` and `autotune` take `True`, `False` or `None` (the setting
      outside the block); any other value is a `TypeError`.
    - `interpret`: run Pallas kernels in interpret mode (`interpret=True` on GPU kernels,
      `pltpu.InterpretParams()` on TPU kernels), so they run on CPU.
    - `autotune`: on a call whose block sizes are in neither the tuning cache nor a shipped
      table, sweep the implementation's block-size space on random inputs of the call's
      shapes (as `axkern tune` does), store the winner in the tuning cache and use it. Off by
      default: the first such call takes a sweep's time.
    - `<op>=name` (e.g. `fused_cross_entropy="xla"`): pick that implementation for the op, as
      if passed as `implementation=`; a tuple or a comma-separated string is an ordered list.

    ```python
    with axkern.use(strict=True, fused_cross_entropy="xla"):
        loss = axkern.fused_cross_entropy(x, lm_head, labels)
    ```

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Batch, Vocab = hax.Axis("batch", 4), hax.Axis("vocab", 10)
    >>> logits, labels = hax.zeros((Batch, Vocab)), hax.zeros(Batch, dtype=jnp.int32)
    >>> with axkern.use(cross_entropy="reference"):
    ...     axkern.explain(axkern.cross_entropy, logits, labels).implementation
    'reference'

    ```
    """
    for name, value in (("strict", strict), ("interpret", interpret), ("autotune", autotune)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(
                f"use({name}={value!r}): expected True, False or None "
                f"(AXKERN_{name.upper()} in the environment takes 1/0, true/false, yes/no, on/off)"
            )
    known = registry.ops()
    for op in implementations:
        if known and op not in known:
            raise ValueError(f"use(): unknown op {op!r}; known ops are {sorted(known)}")
    old = _settings.get()
    new = Settings(
        strict=old.strict if strict is None else strict,
        interpret=old.interpret if interpret is None else interpret,
        autotune=old.autotune if autotune is None else autotune,
        implementations=old.implementations
        + tuple((op, _parse_names(v)) for op, v in implementations.items()),
    )
    token = _settings.set(new)
    try:
        if _jit_key is None:
            yield
        else:
            with _jit_key(new):
                yield
    finally:
        _settings.reset(token)
