"""Block sizes: a frozen-dataclass base, shipped tuned tables, and a blocked loop helper.

Choice order for an implementation's block sizes (done by `Op`): an explicit argument,
then the per-user tuning cache (`core/tuning.py`), then an entry of
`ops/<op>/tuned/<device_key>.json` for the call's shape bucket, then the op's heuristic (in
`ops/<op>/blocks.py`, beside the space of candidates `axkern tune` sweeps). Whatever the
source, `validate` runs before use.

A tuned table is JSON:

```json
{"op": "fused_cross_entropy", "device_key": "nvidia_h200",
 "command": "...", "date": "...", "jax": "...",
 "entries": [{"implementation": "xla",
              "bucket": {"tokens": 16384, "embed": 4096, "vocab": 131072, "dtype": "bfloat16"},
              "block_sizes": {"block_tokens": 16384, "block_vocab": 4096}}]}
```
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from jax import lax

__all__ = [
    "BlockSizes",
    "next_power_of_2",
    "powers_of_two",
    "grid",
    "load_table",
    "lookup",
    "for_each_block",
]

Carry = TypeVar("Carry")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Base of every op's block sizes: frozen, hashable, all fields positive ints (or None),
    except those a subclass lists in `choices` (field name -> the strings it may hold).

    Subclasses add fields and may override `check(spec)` for op-specific limits.
    """

    choices: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    def validate(self, spec: Any = None) -> str | None:
        """`None` if these block sizes can serve `spec`, else the reason they cannot."""
        return self.fields_reason() or self.check(spec)

    def fields_reason(self) -> str | None:
        """Why a field holds a value no call could take (not one of its `choices`, not a positive
        int), or None."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name in self.choices:
                if v not in self.choices[f.name]:
                    allowed = ", ".join(map(repr, self.choices[f.name]))
                    return f"{type(self).__name__}.{f.name} must be one of {allowed} or None, got {v!r}"
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                return f"{type(self).__name__}.{f.name} must be a positive int, got {v!r}"
        return None

    def check(self, spec: Any) -> str | None:
        return None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}; fields are {sorted(names)}")
        return cls(**d)

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.as_dict().items() if v is not None)
        return f"{type(self).__name__}({inner})"


def cdiv(a: int, b: int) -> int:
    """Blocks of `b` needed to cover `a`."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def powers_of_two(size: int, *, high: int, count: int, low: int = 1) -> list[int]:
    """The `count` largest powers of two in `[low, min(high, next_power_of_2(size))]`, largest
    first; `[low]` when that range is empty. The values a tuning space tries for one field."""
    top = min(high, next_power_of_2(size))
    out = []
    p = 1 << max(0, top.bit_length() - 1)
    while p >= low and len(out) < count:
        out.append(p)
        p >>= 1
    return out or [low]


def chunk_blocks(op: str, cls: type[BlockSizes], chunk_size: int | None, block_sizes):
    """The block sizes of a chunked scan's call (`ssd`, `mamba3`): `chunk_size=` as a shorthand
    for `cls(chunk_size=...)` (not together with `block_sizes`), the chunk a power of two."""
    if chunk_size is not None:
        if block_sizes is not None:
            raise ValueError(f"{op}: pass chunk_size or block_sizes, not both")
        block_sizes = cls(chunk_size=chunk_size)
    if block_sizes is not None:
        cs = block_sizes.chunk_size if isinstance(block_sizes, cls) else block_sizes.get("chunk_size")
        if not isinstance(cs, int) or cs < 1 or cs & (cs - 1):
            raise ValueError(f"{op}: chunk_size must be a power of two, got {cs!r}")
    return block_sizes


def grid(cls: type[BlockSizes], spec: Any, first: BlockSizes | None = None, **choices: Iterable) -> list:
    """Every combination of `choices` (field name -> values) as `cls`, those that `validate`
    for `spec`, without repeats; `first` (the heuristic's choice) leads when it validates."""
    names = list(choices)
    out = [] if first is None else [first]
    for values in itertools.product(*(list(choices[n]) for n in names)):
        out.append(cls(**dict(zip(names, values, strict=True))))
    return unique_valid(out, spec)


def unique_valid(candidates: Iterable[BlockSizes], spec: Any) -> list:
    """`candidates` that validate for `spec`, first occurrence kept."""
    seen, out = set(), []
    for c in candidates:
        if c not in seen and c.validate(spec) is None:
            seen.add(c)
            out.append(c)
    return out


@functools.cache
def load_table(package: str, device_key: str) -> tuple[dict, ...]:
    """Entries of `<package>/tuned/<device_key>.json`, or `()` if none ships.

    Each entry gets the table's `op` unless it names its own (a folder may hold several ops).
    """
    try:
        res = importlib.resources.files(package).joinpath("tuned", f"{device_key}.json")
        if not res.is_file():
            return ()
        data = json.loads(res.read_text())
    except (ModuleNotFoundError, FileNotFoundError):
        return ()
    return tuple({"op": data.get("op"), **e} for e in data.get("entries", ()))


def lookup(
    package: str, device_key: str, implementation: str, bucket: Mapping[str, Any], op: str | None = None
) -> dict | None:
    """Block sizes tuned for `op`'s `implementation` at exactly this shape bucket, if the table has them."""
    for entry in load_table(package, device_key):
        if op is not None and entry.get("op") not in (None, op):
            continue
        if entry.get("implementation") == implementation and entry.get("bucket") == dict(bucket):
            return dict(entry["block_sizes"])
    return None


def for_each_block(total: int, block: int, fn: Callable[[Any, int, Carry], Carry], carry: Carry) -> Carry:
    """Run `carry = fn(start, size, carry)` over `[0, total)` in blocks of `block`.

    Full blocks go through one `lax.fori_loop` (`start` traced, `size == block` static); a
    ragged tail is one more static call, so nothing is padded and no input is copied.
    """
    n_full, tail = divmod(total, block)
    if n_full == 1:
        carry = fn(0, block, carry)
    elif n_full > 1:
        carry = lax.fori_loop(0, n_full, lambda i, c: fn(i * block, block, c), carry)
    if tail:
        carry = fn(n_full * block, tail, carry)
    return carry
