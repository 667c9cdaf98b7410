"""`patch()`: axkern's drop-ins in place of Levanter's functions, in every Levanter module.

Levanter's modules import its functions by name (`from levanter.layers.attention import
dot_product_attention` in gpt2, whisper, modernbert and the flash attention module; the
attention layers, `lm_model` and the loss module call their own module's name). `patch()` finds
every loaded `levanter.*` module whose globals hold one of the original function objects and
puts the drop-in there, the defining modules included, so a module imported afterwards takes
the drop-in too; `unpatch()` puts the originals back wherever a drop-in is.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from . import attention, conv, loss

# where each original is defined, and its drop-in
_DEFINITIONS = {
    ("levanter.layers.attention", "dot_product_attention"): attention.dot_product_attention,
    ("levanter.models.loss", "maybe_fused_next_token_loss"): loss.maybe_fused_next_token_loss,
    (
        "levanter.models.loss",
        "fused_cross_entropy_loss_and_logsumexp_penalty",
    ): loss.named_fused_cross_entropy_loss_and_logsumexp_penalty,
    (
        "levanter.kernels.pallas.fused_cross_entropy_loss.api",
        "fused_cross_entropy_loss_and_logsumexp_penalty",
    ): loss.fused_cross_entropy_loss_and_logsumexp_penalty,
    ("levanter.kernels.triton.short_conv.api", "short_conv"): conv.short_conv,
}
# each drop-in's original, once `patch()` has seen it
_ORIGINALS: dict[int, object] = {}


def _levanter_modules() -> list[ModuleType]:
    return [
        m
        for name, m in list(sys.modules.items())
        if (name == "levanter" or name.startswith("levanter.")) and isinstance(m, ModuleType)
    ]


def _replace(replacements: dict[int, object]) -> list[str]:
    """Every global of a loaded Levanter module that is a key's object, set to its value."""
    done = []
    for module in _levanter_modules():
        for attr, value in list(vars(module).items()):
            new = replacements.get(id(value))
            if new is not None:
                setattr(module, attr, new)
                done.append(f"{module.__name__}.{attr}")
    return sorted(done)


class Patched:
    """What `patch()` replaced (`names`: `module.attribute` strings); as a context manager,
    `unpatch()` on exit."""

    def __init__(self, names: list[str]):
        self.names = names

    def __enter__(self) -> Patched:
        return self

    def __exit__(self, *exc) -> None:
        unpatch()

    def __repr__(self) -> str:
        return f"Patched({len(self.names)} names)"


def patch() -> Patched:
    """Put axkern's drop-ins in place of Levanter's `dot_product_attention`,
    `maybe_fused_next_token_loss`, both `fused_cross_entropy_loss_and_logsumexp_penalty` (named and
    kernel-level) and `short_conv`, in every loaded Levanter module that holds them.

    ```python
    import axkern.levanter
    axkern.levanter.patch()           # then build and train as usual, e.g. levanter.main.train_lm
    with axkern.levanter.patch():     # or only inside the block
        ...
    ```

    Call it before the first step is traced: a function jitted already keeps what it traced.
    Raises `ImportError` when Levanter is not importable.

    **Returns:** a `Patched` listing each `module.attribute` replaced (a context manager that
    calls `unpatch()` on exit).

    **Example:**

    ```python
    >>> import axkern.levanter
    >>> try:
    ...     with axkern.levanter.patch() as patched:
    ...         print("levanter.layers.attention.dot_product_attention" in patched.names)
    ... except ImportError:  # where Levanter is not installed
    ...     print(True)
    True

    ```
    """
    replacements: dict[int, object] = {}
    for (module_name, attr), drop_in in _DEFINITIONS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ImportError(f"axkern.levanter.patch: Levanter's {module_name} does not import: {e}") from e
        original = getattr(module, attr)
        if original is drop_in:
            continue  # patched already
        _ORIGINALS[id(drop_in)] = original
        replacements[id(original)] = drop_in
    return Patched(_replace(replacements))


def unpatch() -> list[str]:
    """Put Levanter's originals back wherever `patch()` put a drop-in (in modules imported since too).

    **Returns:** each `module.attribute` restored.

    **Example:**

    ```python
    >>> import axkern.levanter
    >>> axkern.levanter.unpatch()  # nothing is patched
    []

    ```
    """
    return _replace(dict(_ORIGINALS))
