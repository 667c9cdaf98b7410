"""How `axkern bench` prints its rows: a table (rich, full width off a terminal), JSON, CSV or
markdown, with rates in the unit that fits them (TFLOP/s on a GPU, GFLOP/s on a CPU)."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from .harness import Row

__all__ = ["print_rows", "row_line", "columns"]

_FLOP_UNITS = ((1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s"))
_BYTE_UNITS = ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"))


def _unit(values: list[float], units) -> tuple[float, str]:
    """The largest unit in which the largest value is at least 1 (TFLOP/s on a GPU, GFLOP/s on a CPU)."""
    top = max(values, default=0.0)
    for scale, name in units:
        if top >= scale:
            return scale, name
    return units[-1]


def columns(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """The table's header and cells: rates in units that fit them, columns that are empty everywhere left out."""
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    rate = lambda v, scale: "-" if v is None else _significant(v / scale)  # noqa: E731
    flop_scale, flop_unit = _unit([r.tflops * 1e12 for r in rows if r.tflops], _FLOP_UNITS)
    byte_scale, byte_unit = _unit([r.gbps * 1e9 for r in rows if r.gbps], _BYTE_UNITS)
    columns = {
        "op": [r.op for r in rows],
        "case": [r.case for r in rows],
        "impl": [r.implementation + (" (interpret)" if r.interpret else "") for r in rows],
        "pass": [r.pass_ for r in rows],
        "ms": [fmt(r.ms, ".3f") for r in rows],
        "min-max ms": ["-" if r.ms_min is None else f"{r.ms_min:.3f}-{r.ms_max:.3f}" for r in rows],
        flop_unit: [rate(None if r.tflops is None else r.tflops * 1e12, flop_scale) for r in rows],
        byte_unit: [rate(None if r.gbps is None else r.gbps * 1e9, byte_scale) for r in rows],
        "of ceiling": [fmt(r.ceiling_fraction, ".1%") for r in rows],
        "temp GiB": [fmt(r.temp_gib, ".3f") for r in rows],
        "max rel err": [fmt(r.max_rel_error, ".2e") for r in rows],
        "note": [r.note for r in rows],
    }
    optional = ("min-max ms", byte_unit, "of ceiling", "temp GiB", "max rel err", "note")
    keep = [k for k, v in columns.items() if k not in optional or any(x not in ("-", "") for x in v)]
    return keep, [[columns[k][i] for k in keep] for i in range(len(rows))]


def _title(doc: dict) -> str:
    where = f"axkern bench on {doc['device']}" + (f", preset {doc['preset']}" if doc["preset"] else "")
    if doc["matmul_ceiling_tflops"] is None:
        return where + " (no ceiling on a CPU: rates are not compared with one)"
    return f"{where} (matmul ceiling {doc['matmul_ceiling_tflops']:.1f} TFLOP/s, copy {doc['copy_bandwidth_gbps']:.0f} GB/s)"


def print_rows(rows: list[Row], doc: dict, fmt: str, console: Console) -> None:
    """`rows` on `console` as a table, or on stdout as JSON (`doc`), CSV or a markdown table."""
    if fmt == "json":
        print(json.dumps(doc, indent=2))
        return
    if fmt == "csv":
        import csv

        fields = list(rows[0].as_dict()) if rows else []
        writer = csv.DictWriter(sys.stdout, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow(r.as_dict())
        return
    header, cells = columns(rows)
    if fmt == "markdown":
        esc = lambda x: x.replace("|", "\\|")  # noqa: E731
        print(f"{_title(doc)}\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for line in cells:
            print("| " + " | ".join(esc(x) for x in line) + " |")
        return
    t = Table(title=_title(doc))
    for col in header:
        t.add_column(col, overflow="fold", justify="right" if col in ("ms", "temp GiB") else "left")
    for line in cells:
        t.add_row(*line)
    if console.is_terminal:
        console.print(t)
    else:  # a file or a pipe: the table at its full width, one row per line
        width = Console(width=100_000).measure(t).maximum
        Console(width=width, no_color=True, highlight=False).print(t)


def _significant(v: float) -> str:
    """Three significant digits without an exponent: 1234, 123.4 -> 123, 2.72, 0.0334."""
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _rate(per_s: float | None, units) -> str:
    if per_s is None:
        return ""
    scale, name = _unit([per_s], units)
    return f" {_significant(per_s / scale)} {name}"


def row_line(r: Row) -> str:
    """One row as a line, printed as it is measured (a run cut short keeps what it measured)."""
    ms = "-" if r.ms is None else f"{r.ms:.3f} ms"
    tf = _rate(None if r.tflops is None else r.tflops * 1e12, _FLOP_UNITS)
    gb = _rate(None if r.gbps is None else r.gbps * 1e9, _BYTE_UNITS)
    err = "" if r.max_rel_error is None else f" err {r.max_rel_error:.1e}"
    impl = r.implementation + (" (interpret)" if r.interpret else "")
    return f"{r.op} | {r.case} | {impl} | {r.pass_} | {ms}{tf}{gb}{err} {r.note}".rstrip()
