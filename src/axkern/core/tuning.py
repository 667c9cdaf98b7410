"""The per-user tuning cache: block sizes that `axkern tune` (or autotuning) found fastest here.

One JSON file per device, `<cache root>/tuning/<device_key>.json`, where the cache root is
`AXKERN_CACHE_DIR` when set, else the user's cache directory for axkern (`~/.cache/axkern`
on Linux, from `platformdirs`). The file has the shape of a shipped table
(`ops/<op>/tuned/<device_key>.json`, see `core/blocks.py`), with every entry naming its op:

```json
{"device_key": "nvidia_h200",
 "entries": [{"op": "ssd", "implementation": "pallas_gpu",
              "bucket": {"batch": 2, "length": 4096, "...": 0, "dtype": "bfloat16"},
              "block_sizes": {"chunk_size": 64},
              "ms": {"min": 8.5, "median": 8.6, "max": 8.9},
              "command": "axkern tune ssd", "date": "...", "jax": "..."}]}
```

Writers take a file lock beside the file (`filelock`), merge their entries into what is
there, and replace the file atomically, so concurrent processes never lose each other's
entries and a reader never sees half a file. Readers need no lock: they read the file
whole, and reread it only when its modification time changes. A file that is not a tuning
cache, or an entry that is not one (or whose block sizes cannot serve the call), is passed
over with a `CacheWarning` naming the file and the entry, and the shipped table or the
heuristic serves; a cache that cannot be written is a `ValueError` naming the file (for
autotuning, a `CacheWarning`: the winner serves the process without being kept).

The dispatcher reads this cache before the shipped tables. While `axkern tune` sweeps a
block-size space, `forced(...)` makes the dispatcher use one candidate for one op and
implementation (its source reads "tuning"). `replaced(...)` makes it replace some fields of
whatever block sizes it finds for one op and implementation (`axkern bench --blocks`: a form
that is not the default, timed through the same dispatcher; its source reads "replaced").

Autotuning (`axkern.use(autotune=True)`) sweeps block sizes with the benchmark harness, which
sits above the core: the dispatcher reaches it through `autotuner()`, the function that
`register_autotuner` was given (`import axkern` registers one that loads `axkern.bench.tune`
on first use).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from . import caller, compat

__all__ = [
    "CacheWarning",
    "cache_root",
    "cache_path",
    "read_cache",
    "lookup",
    "store",
    "entry",
    "merge",
    "write_json",
    "forced",
    "forced_blocks",
    "tuning_active",
    "replaced",
    "replaced_fields",
    "register_autotuner",
    "autotuner",
]


class CacheWarning(UserWarning):
    """The tuning cache could not be read, or a winner could not be kept in it; the dispatcher
    went on without it (the shipped tables, the heuristic)."""


def cache_root() -> Path:
    """Where axkern keeps its per-user caches: `AXKERN_CACHE_DIR`, else the platform's user cache."""
    env = os.environ.get("AXKERN_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("axkern", appauthor=False))


def cache_path(device_key: str) -> Path:
    """The tuning cache file of one device key."""
    return cache_root() / "tuning" / f"{device_key}.json"


_read: dict[Path, tuple[int, tuple[dict, ...]]] = {}
_warned: set[tuple] = set()


def _warn(key: tuple, message: str) -> None:
    """Warn once per `key` (a file's state and what is wrong with it), at the caller's line."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, CacheWarning, stacklevel=caller.stacklevel())


def read_cache(device_key: str) -> tuple[dict, ...]:
    """The cached entries for `device_key` (empty when there is no cache file yet).

    A file that is not a tuning cache (unreadable, not UTF-8, not JSON, no `entries` list, a
    path below a file) raises a `ValueError` naming the file, rather than being silently
    ignored or overwritten. An entry that is not `{"op": ..., "implementation": ...,
    "bucket": {...}, "block_sizes": {...}}` is left out with a `CacheWarning` naming the file
    and the entry.
    """
    path = cache_path(device_key)
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return ()
    except OSError as e:
        raise ValueError(_unreadable(path, e)) from e
    hit = _read.get(path)
    if hit is not None and hit[0] == mtime:
        return hit[1]
    entries = []
    for i, e in enumerate(_load(path).get("entries", ())):
        problem = _malformed(e)
        if problem is None:
            entries.append(e)
        else:
            _warn((str(path), mtime, i), f"{_where(path, i, e)} {problem}; it is ignored (fix or delete it)")
    _read[path] = (mtime, tuple(entries))
    return _read[path][1]


def _unreadable(path: Path, e: BaseException) -> str:
    return (
        f"axkern tuning cache {path} cannot be read ({type(e).__name__}: {e}); "
        "delete it or set AXKERN_CACHE_DIR elsewhere"
    )


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON
        raise ValueError(_unreadable(path, e)) from e
    if not isinstance(data, dict) or not isinstance(data.get("entries", []), list):
        raise ValueError(f"axkern tuning cache {path} is not a tuning cache (expected {{'entries': [...]}})")
    return data


def _malformed(e: Any) -> str | None:
    """What keeps `e` from being a cache entry, or None."""
    if not isinstance(e, dict):
        return "is not an object"
    for field, kind, name in (
        ("op", str, "a string"),
        ("implementation", str, "a string"),
        ("bucket", dict, "an object"),
        ("block_sizes", dict, "an object"),
    ):
        if field not in e:
            return f"has no {field}"
        if not isinstance(e[field], kind):
            return f"has {field} {e[field]!r}, not {name}"
    return None


def _where(path: Path, i: int, e: Any) -> str:
    what = (
        f"({e.get('op')}/{e.get('implementation')} at {e.get('bucket')})" if isinstance(e, dict) else repr(e)
    )
    return f"axkern tuning cache {path}: entry {i} {what}"


def lookup(
    device_key: str,
    op: str,
    implementation: str,
    bucket: Mapping[str, Any],
    check: Callable[[dict], str | None] | None = None,
) -> dict | None:
    """The cached block sizes of `op`'s `implementation` at exactly this bucket, if any.

    `check(block_sizes)` says why the entry's block sizes cannot serve the call (or None). A
    cache that cannot be read, or an entry that `check` refuses, gives a `CacheWarning` naming
    the file (and the entry), once, and `None`: the shipped table or the heuristic serves.
    """
    try:
        entries = read_cache(device_key)
    except ValueError as e:
        _warn((str(e),), f"{e}; the tuning cache is not used")
        return None
    for i, e in enumerate(entries):
        if e["op"] == op and e["implementation"] == implementation and e["bucket"] == dict(bucket):
            found = dict(e["block_sizes"])
            reason = None if check is None else check(found)
            if reason is None:
                return found
            path = cache_path(device_key)
            _warn(
                (str(path), _read.get(path, (None,))[0], op, implementation, str(e)),
                f"{_where(path, i, e)}: block sizes {found} cannot serve this call ({reason}); "
                "it is not used (fix or delete the entry)",
            )
            return None
    return None


def entry(
    op: str,
    implementation: str,
    bucket: Mapping[str, Any],
    block_sizes: Mapping[str, Any],
    *,
    ms: Mapping[str, float] | None = None,
    command: str | None = None,
) -> dict:
    """A cache or table entry, with the date and the jax version that measured it."""
    import jax

    e = {
        "op": op,
        "implementation": implementation,
        "bucket": dict(bucket),
        "block_sizes": {k: v for k, v in block_sizes.items() if v is not None},
    }
    if ms is not None:
        e["ms"] = {k: round(float(v), 4) for k, v in ms.items()}
    e["command"] = command
    e["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    e["jax"] = jax.__version__
    return e


def _same_key(a: Any, b: Any, default_op: str | None = None) -> bool:
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        return False
    return (
        a.get("op", default_op) == b.get("op", default_op)
        and a.get("implementation") == b.get("implementation")
        and a.get("bucket") == b.get("bucket")
    )


def merge(entries: list[dict], new: list[dict], default_op: str | None = None) -> list[dict]:
    """`entries` with each of `new` replacing the entry of its (op, implementation, bucket)."""
    kept = [e for e in entries if not any(_same_key(e, n, default_op) for n in new)]
    return kept + list(new)


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` atomically: a temporary file in the same folder, then `os.replace`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def store(device_key: str, entries: list[dict], *, timeout_s: float = 60.0) -> Path:
    """Add `entries` to the cache of `device_key` under its file lock; returns the file.

    A cache that cannot be written (a read-only folder, a path below a file, a lock not taken
    in `timeout_s`) or that holds something else than a tuning cache raises a `ValueError`
    naming the file; the file is left as it was."""
    import filelock

    path = cache_path(device_key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(path) + ".lock", timeout=timeout_s):
            data = _load(path) or {"device_key": device_key, "entries": []}
            data["entries"] = merge(list(data.get("entries", [])), entries)
            write_json(path, data)
    except OSError as e:  # filelock.Timeout is one too
        raise ValueError(
            f"axkern tuning cache {path} cannot be written ({type(e).__name__}: {e}); "
            "set AXKERN_CACHE_DIR to a writable folder"
        ) from e
    finally:
        _read.pop(path, None)
    return path


# -- block sizes set for one op and implementation within a context -----------------------------


class _Scoped:
    """`(op, implementation, fields)` set within a context (a context variable), and part of
    `jax.jit`'s cache key there, so that a function jitted outside is traced again inside."""

    def __init__(self, name: str):
        self._var: contextvars.ContextVar[tuple[str, str, dict] | None] = contextvars.ContextVar(
            name, default=None
        )
        self._jit_key = compat.jit_context(None)

    @contextlib.contextmanager
    def set(self, op: str, implementation: str, fields: Mapping[str, Any]) -> Iterator[None]:
        value = (op, implementation, dict(fields))
        token = self._var.set(value)
        try:
            if self._jit_key is None:
                yield
            else:
                with self._jit_key(json.dumps(value, sort_keys=True)):
                    yield
        finally:
            self._var.reset(token)

    def get(self, op: str, implementation: str) -> dict | None:
        v = self._var.get()
        return dict(v[2]) if v is not None and v[0] == op and v[1] == implementation else None

    def active(self) -> bool:
        return self._var.get() is not None


_forced = _Scoped("axkern_forced_blocks")  # the candidate under measurement
_replaced = _Scoped("axkern_replaced_fields")  # fields replaced over what the dispatcher finds


def forced(op: str, implementation: str, block_sizes: Mapping[str, Any]):
    """A context in which the dispatcher gives `op`'s `implementation` these block sizes (a
    sweep's candidate); inside, autotuning is off (a sweep never starts another)."""
    return _forced.set(op, implementation, block_sizes)


def forced_blocks(op: str, implementation: str) -> dict | None:
    """The candidate `forced(...)` set for this op and implementation, if any."""
    return _forced.get(op, implementation)


def tuning_active() -> bool:
    """Whether a sweep is measuring a candidate right now."""
    return _forced.active()


def replaced(op: str, implementation: str, fields: Mapping[str, Any]):
    """A context in which the dispatcher gives `op`'s `implementation` the block sizes it would
    have picked (cache, table, autotuning, heuristic or the defaults) with `fields` replaced;
    block sizes passed as an argument, or a sweep's candidate, stay as they are. A function
    jitted outside is traced again inside, and the other way round."""
    return _replaced.set(op, implementation, fields)


def replaced_fields(op: str, implementation: str) -> dict | None:
    """The fields `replaced(...)` set for this op and implementation, if any."""
    return _replaced.get(op, implementation)


# -- the autotuner, registered by the tooling ---------------------------------------------------

_autotuner: Callable[..., dict | None] | None = None


def register_autotuner(fn: Callable[..., dict | None] | None) -> None:
    """Make `fn(op, implementation, spec, arrays, options) -> block sizes dict | None` the sweep the
    dispatcher runs on a tuning miss under `axkern.use(autotune=True)`; `None` removes it."""
    global _autotuner
    _autotuner = fn


def autotuner() -> Callable[..., dict | None]:
    """The registered autotuner; a `RuntimeError` saying how to register one when there is none."""
    if _autotuner is None:
        raise RuntimeError(
            "axkern: autotuning is on (axkern.use(autotune=True) or AXKERN_AUTOTUNE=1) but no autotuner "
            "is registered; `import axkern` registers one (or call "
            "axkern.core.tuning.register_autotuner(axkern.bench.tune.autotune))"
        )
    return _autotuner
