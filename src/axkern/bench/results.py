"""The results layout: one JSON file per device, op and preset.

`axkern bench --save` writes `<root>/<device_key>/<op>/<preset>.json` (the latest run of that op
and preset; git keeps the earlier ones) and `axkern report` reads every such file back. A file
holds the command, the date, the device, the package versions, the ceilings measured in the
run, each case's dimensions as fields, and the rows.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.cases import Case
    from .harness import Row

__all__ = ["DEFAULT_ROOT", "NOTE", "document", "path_for", "save", "load", "versions"]

DEFAULT_ROOT = Path("benchmarks") / "results"
NOTE = (
    "TFLOP/s count model FLOPs (recomputation not counted); GB/s count the fewest bytes each "
    "pass must move; 'of ceiling' is against the matmul rate (compute-bound ops) or the copy "
    "bandwidth (memory-bound ops) measured at the start of this run, off a CPU only"
)


def versions() -> dict[str, str]:
    """The versions a result records: axkern, jax, jaxlib, haliax, equinox and Python.

    ```python
    >>> from axkern.bench.results import versions
    >>> sorted(versions())
    ['axkern', 'equinox', 'haliax', 'jax', 'jaxlib', 'python']

    ```
    """
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {name: v(name) for name in ("axkern", "jax", "jaxlib", "haliax", "equinox")} | {
        "python": sys.version.split()[0]
    }


def document(
    rows: Sequence[Row],
    cases: Sequence[Case],
    *,
    command: str,
    device: str,
    device_key: str,
    platform: str,
    preset: str | None,
    ceiling: float | None,
    bandwidth: float | None,
) -> dict:
    """One run as plain data: what `--json` and `--save` write."""
    ops = sorted({r.op for r in rows})
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device,
        "device_key": device_key,
        "platform": platform,
        "op": ops[0] if len(ops) == 1 else None,
        "preset": preset,
        "versions": versions(),
        "matmul_ceiling_tflops": ceiling,
        "copy_bandwidth_gbps": bandwidth,
        "note": NOTE,
        "cases": [
            {"op": c.op, "case": c.label, "dtype": c.dtype, "dims": dict(c.dims), "reference": c.reference}
            for c in cases
        ],
        "rows": [r.as_dict() for r in rows],
    }


def path_for(root: Path | str, device_key: str, op: str, preset: str) -> Path:
    """Where the run of `op` at `preset` on `device_key` lives.

    ```python
    >>> from axkern.bench.results import path_for
    >>> path_for("benchmarks/results", "nvidia_h200", "ssd", "mamba2_2.7b").as_posix()
    'benchmarks/results/nvidia_h200/ssd/mamba2_2.7b.json'

    ```
    """
    for what, name in (("device_key", device_key), ("op", op), ("preset", preset)):
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"results: expected a plain {what} name, got {name!r}")
    return Path(root) / device_key / op / f"{preset}.json"


def save(doc: dict, root: Path | str = DEFAULT_ROOT) -> list[Path]:
    """Write one file per op of `doc` (a run of several ops is split) and return their paths."""
    if doc.get("preset") is None:
        raise ValueError("results: expected a run with a preset (the file's name), got none")
    paths = []
    for op in sorted({r["op"] for r in doc["rows"]}):
        one = {
            **doc,
            "op": op,
            "cases": [c for c in doc["cases"] if c["op"] == op],
            "rows": [r for r in doc["rows"] if r["op"] == op],
        }
        path = path_for(root, doc["device_key"], op, doc["preset"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(one, indent=2) + "\n")
        paths.append(path)
    return paths


def load(root: Path | str = DEFAULT_ROOT) -> list[dict]:
    """Every run under `root` (sweeps left out), each with its `path`, sorted by device, op, preset.

    A file that is not a run (not JSON, a field of the wrong kind, a time that is negative or
    not finite) is a `ValueError` naming the file, and the row where it is one; nothing of it
    reaches a table."""
    runs = []
    for path in sorted(Path(root).glob("*/*/*.json")):
        if path.stem == "sweep" or path.stem.startswith("sweep_") or path.stem.startswith("tune_"):
            continue
        doc = _read(path)
        doc.setdefault("device_key", path.parts[-3])
        doc.setdefault("op", path.parts[-2])
        doc.setdefault("preset", path.stem)
        runs.append({**doc, "path": path})
    return runs


def _read(path: Path) -> dict:
    if path.is_dir():
        raise ValueError(f"results: {path} is a folder, not a results file")
    try:
        text = path.read_bytes().decode("utf-8")
        if not text.strip():
            raise ValueError(f"results: {path} is empty")
        doc = json.loads(text)
    except OSError as e:
        raise ValueError(f"results: {path} cannot be read ({type(e).__name__}: {e})") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"results: {path} is not JSON (not UTF-8: {e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"results: {path} is not JSON ({e}): cut short?") from e
    if not isinstance(doc, dict) or "rows" not in doc or "command" not in doc:
        raise ValueError(f"results: {path} is not an `axkern bench` run (no rows or command)")
    problem = _problem(doc)
    if problem is not None:
        raise ValueError(f"results: {path}: {problem}")
    return doc


_TIMES = ("ms", "ms_min", "ms_max", "tflops", "gbps", "ceiling_fraction", "temp_gib")


def _number(value, finite: bool = True) -> bool:
    """A number the tables can show: not a bool, not negative, finite where `finite`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if math.isnan(value):
        return not finite
    return value >= 0 and (math.isfinite(value) or not finite)


def _problem(doc: dict) -> str | None:
    """What in a run the report could not show, or None."""
    for field in ("command", "date", "device"):
        if not isinstance(doc.get(field), str):
            return f"{field} is not a string: {doc.get(field)!r}"
    for field in ("device_key", "op", "preset", "note"):
        if field in doc and not isinstance(doc[field], str):
            return f"{field} is not a string: {doc[field]!r}"
    for field in ("matmul_ceiling_tflops", "copy_bandwidth_gbps"):
        if doc.get(field) is not None and not _number(doc[field]):
            return f"{field} {doc[field]!r} is not a finite number >= 0 or null"
    if not isinstance(doc.get("versions", {}), dict):
        return "versions is not an object"
    if not isinstance(doc.get("cases", []), list):
        return "cases is not a list"
    for i, c in enumerate(doc.get("cases", [])):
        if not isinstance(c, dict) or not isinstance(c.get("case"), str):
            return f"case {i} is not an object with a case label: {c!r}"
    if not isinstance(doc["rows"], list):
        return "rows is not a list"
    for i, r in enumerate(doc["rows"]):
        problem = _row_problem(r)
        if problem is not None:
            return f"row {i} {problem}"
    return None


def _row_problem(r) -> str | None:
    if not isinstance(r, dict):
        return f"is not an object: {r!r}"
    what = f"({r.get('case')!r}, {r.get('implementation')!r}, {r.get('pass')!r})"
    for field in ("case", "implementation", "pass"):
        if field not in r:
            return f"{what} has no {field}"
        if not isinstance(r[field], str):
            return f"{what} has {field} {r[field]!r}, not a string"
    if not isinstance(r.get("note") or "", str):
        return f"{what} has note {r['note']!r}, not a string"
    for field in _TIMES:
        if r.get(field) is not None and not _number(r[field]):
            return f"{what}: {field} {r[field]!r} is not a finite number >= 0 or null"
    error = r.get("max_rel_error")  # NaN: the implementation's output was NaN where the reference's was not
    if error is not None and not _number(error, finite=False):
        return f"{what}: max_rel_error {error!r} is not a number >= 0 or null"
    return None
