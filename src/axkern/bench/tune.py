"""`axkern tune`: sweep an implementation's block sizes, keep the fastest correct candidate.

For one benchmark case (`ops/<op>/arg_specs.py`) and one implementation, every candidate of
the implementation's space (`space(spec)` beside its heuristic in the op's `blocks.py`) runs
through `harness.measure` with the dispatcher held to that candidate (`tuning.forced`): one
compile, a check of the outputs and gradients against the `reference` implementation, and
timed repeats. The pass timed is the forward+backward where the case has one, else the
forward.

A candidate is accepted when its largest relative error against the reference is at most
twice the heuristic's (the tested default) plus a few units in the last place of the case's
dtype; the winner is the accepted candidate with the lowest median time. It goes into the
per-user tuning cache (`core/tuning.py`), and with `write_table` also into the shipped table
`ops/<op>/tuned/<device_key>.json`, with the command, date and jax version that found it.

`autotune` does the same for a call the dispatcher has no tuned entry for, when
`axkern.use(autotune=True)` (or `AXKERN_AUTOTUNE=1`) asks for it: its inputs are random
arrays of the call's shapes (normal floats, zero integers, true booleans). The dispatcher
reaches it through the hook in `core/tuning.py` (`autotuner()`), which `import axkern` fills.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ..core import blocks, caller, compat, tuning
from ..core.blocks import BlockSizes, unique_valid
from ..core.cases import Case
from ..core.op import Implementation, Op, Spec, get_op
from .harness import Row, measure

__all__ = [
    "Result",
    "tunable",
    "candidates",
    "sweep",
    "save",
    "table_path",
    "write_table",
    "autotune",
    "tolerance",
]

_ULPS = 8  # units in the last place allowed on top of twice the heuristic's error


@dataclasses.dataclass
class Result:
    """One sweep: every candidate with its row, and the winner (`None`: none was accepted)."""

    op: str
    implementation: str
    case: str
    spec: Spec
    bucket: dict
    rows: list[tuple[BlockSizes, Row]]
    best: BlockSizes | None = None
    best_row: Row | None = None
    limit: float | None = None  # the largest relative error accepted

    def accepted(self, row: Row) -> bool:
        return (
            row.ms is not None
            and row.max_rel_error is not None
            and self.limit is not None
            and row.max_rel_error <= self.limit
        )


def tolerance(dtype: str) -> float:
    """The error allowed on top of twice the heuristic's: a few units in the last place of `dtype`."""
    return _ULPS * float(jnp.finfo(jnp.dtype(dtype)).eps)


def tunable(op: str) -> list[str]:
    """The implementations of `op` that declare a block-size space."""
    return [n for n, impl in get_op(op).implementations.items() if impl.space is not None]


def candidates(impl: Implementation, spec: Spec) -> list[BlockSizes]:
    """The heuristic's choice, then the rest of the space: those that validate for `spec`."""
    if impl.space is None:
        raise ValueError(f"{spec.op}: implementation {impl.name!r} declares no block-size space to tune")
    first = [impl.heuristic(spec)] if impl.heuristic is not None else []
    return unique_valid(first + list(impl.space(spec)), spec)


def sweep(
    case: Case,
    implementation: str,
    *,
    repeats: int = 10,
    on_row: Callable[[BlockSizes, Row], None] | None = None,
) -> Result:
    """Measure every candidate of `implementation`'s space on `case`; pick the winner."""
    op = get_op(case.op)
    if implementation not in op.implementations:
        raise ValueError(
            f"{case.op}: unknown implementation {implementation!r}; known: {sorted(op.implementations)}"
        )
    impl = op.implementations[implementation]
    spec = case.decision(implementation).spec
    pass_ = "fwd+bwd" if "fwd+bwd" in case.passes else "fwd"
    result = Result(case.op, implementation, case.label, spec, dict(op.bucket(spec)), [])
    references: dict = {}
    for bs in candidates(impl, spec):
        with tuning.forced(case.op, implementation, bs.as_dict()):
            (row,) = measure(case, [implementation], passes=(pass_,), repeats=repeats, references=references)
        result.rows.append((bs, row))
        if on_row is not None:
            on_row(bs, row)
    return _pick(result, impl, spec)


def _pick(result: Result, impl: Implementation, spec: Spec) -> Result:
    heuristic = impl.heuristic(spec) if impl.heuristic is not None else None
    base = next((r.max_rel_error for bs, r in result.rows if bs == heuristic), None)
    result.limit = 2 * (base or 0.0) + tolerance(spec.dtype)
    ok = [(bs, r) for bs, r in result.rows if result.accepted(r)]
    if ok:
        result.best, result.best_row = min(ok, key=lambda c: c[1].ms)
    return result


def _entry(result: Result, command: str | None) -> dict:
    r = result.best_row
    return tuning.entry(
        result.op,
        result.implementation,
        result.bucket,
        result.best.as_dict(),
        ms={"min": r.ms_min, "median": r.ms, "max": r.ms_max},
        command=command,
    )


def save(results: Sequence[Result], command: str | None = None) -> Path | None:
    """Store each result's winner in the per-user tuning cache; the cache file, or None.
    A cache that cannot be written is a `ValueError` naming the file (`tuning.store`)."""
    by_device: dict[str, list[dict]] = {}
    for res in results:
        if res.best is not None:
            by_device.setdefault(res.spec.device_key, []).append(_entry(res, command))
    path = None
    for device_key, entries in by_device.items():
        path = tuning.store(device_key, entries)
    return path


def table_path(op: str, device_key: str) -> Path:
    """The shipped table of `op` for `device_key`: `<op's folder>/tuned/<device_key>.json`."""
    package = importlib.import_module(get_op(op).package)
    return Path(package.__file__).parent / "tuned" / f"{device_key}.json"


def write_table(
    results: Sequence[Result], command: str | None = None, source: str | None = None
) -> list[Path]:
    """Put each result's winner into its op's shipped table `tuned/<device_key>.json`, replacing
    the entry of the same op, implementation and bucket; each entry records how it was found
    (`command`, date, jax version, and `source`: where the sweep's output is kept)."""
    import filelock

    written = []
    for res in results:
        if res.best is None:
            continue
        path = table_path(res.op, res.spec.device_key)
        e = _entry(res, command)
        e["source"] = source or "axkern tune"
        lock = tuning.cache_root() / "tuning" / f"table-{res.op}-{res.spec.device_key}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(lock), timeout=60):
            table = json.loads(path.read_text()) if path.exists() else {}
            table.setdefault("device_key", res.spec.device_key)
            table["entries"] = tuning.merge(list(table.get("entries", [])), [e], default_op=table.get("op"))
            tuning.write_json(path, table)
        written.append(path)
    blocks.load_table.cache_clear()
    return written


# -- tuning on a cache miss -----------------------------------------------------------------------

_failed: set[tuple] = set()  # (op, implementation, device key, bucket) whose sweep accepted nothing
_unkept: dict[tuple, dict] = {}  # the same key -> its winner, where the cache could not keep it


def _concrete(leaf: Any, key: jax.Array) -> jax.Array:
    dtype = jnp.dtype(leaf.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.random.normal(key, leaf.shape, jnp.float32).astype(dtype)
    if dtype == jnp.bool_:
        return jnp.ones(leaf.shape, dtype)
    return jnp.zeros(leaf.shape, dtype)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def autotune(op: Op, impl: Implementation, spec: Spec, arrays: tuple, options: dict) -> dict | None:
    """Sweep `impl`'s space for this call on random inputs of its shapes; store and return the
    winner's block sizes (`None` when no candidate was accepted: the heuristic then serves).
    A winner that cannot be kept in the cache serves this process, with a `CacheWarning`."""
    bucket = dict(op.bucket(spec))
    key = (op.name, impl.name, spec.device_key, json.dumps(bucket, sort_keys=True))
    if key in _failed:
        return None
    if key in _unkept:
        return dict(_unkept[key])
    leaves, treedef = jax.tree.flatten((arrays, options))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
    # run the sweep now, even inside the caller's trace, and outside its mesh (`compat.no_mesh`)
    with jax.ensure_compile_time_eval(), compat.no_mesh():
        keys = jax.random.split(jax.random.PRNGKey(0), max(1, len(dynamic)))
        inputs = tuple(_concrete(leaves[i], k) for i, k in zip(dynamic, keys, strict=False))
        floating = tuple(n for n, x in enumerate(inputs) if jnp.issubdtype(x.dtype, jnp.floating))

        def forward(name, *dyn):
            full = list(leaves)
            for i, x in zip(dynamic, dyn, strict=True):
                full[i] = x
            a, o = jax.tree.unflatten(treedef, full)
            return op(spec, *a, implementation=name, **o)

        def loss(name, *dyn):
            outs = [o for o in jax.tree.leaves(forward(name, *dyn)) if jnp.issubdtype(o.dtype, jnp.floating)]
            return sum(jnp.sum(o.astype(jnp.float32)) for o in outs)

        case = Case(
            op=op.name,
            label="autotune",
            dims=dict(spec.dims),
            dtype=spec.dtype,
            make=lambda _key: inputs,
            forward=forward,
            loss=loss if floating else None,
            grad_argnums=floating,
            flops_forward=0.0,
            flops_backward=0.0,
            passes=("fwd", "fwd+bwd") if floating else ("fwd",),
        )
        result = Result(op.name, impl.name, "autotune", spec, bucket, [])
        references: dict = {}
        for bs in candidates(impl, spec):
            with tuning.forced(op.name, impl.name, bs.as_dict()):
                (row,) = measure(case, [impl.name], passes=case.passes[-1:], repeats=3, references=references)
            result.rows.append((bs, row))
        result = _pick(result, impl, spec)
    if result.best is None:
        _failed.add(key)
        return None
    try:
        save([result], command="axkern.use(autotune=True)")
    except ValueError as e:  # the cache cannot be written: the winner serves this process only
        _unkept[key] = result.best.as_dict()
        warnings.warn(
            f"axkern {op.name}: autotuning chose {result.best} for {impl.name!r} at {bucket}, but it "
            f"could not be kept: {e}",
            tuning.CacheWarning,
            stacklevel=caller.stacklevel(),
        )
    return result.best.as_dict()
