"""How `axkern bench` prints its rows: a table, JSON, CSV or markdown, with rates in the unit that
fits them (TFLOP/s on a GPU, GFLOP/s on a CPU).

The table groups the rows by op and case (the case's label is a heading, not a column), gives
each implementation's time as a multiple of the default's (what the dispatcher picks here, or
`reference` where the default was not timed) beside its temporary memory, and fits the
terminal: its fixed columns take at most 100 characters (fewer rate columns on a narrower
terminal) and a note that does not fit goes on the lines under its row. Off a terminal each row
is one line, its note at the end.
"""

from __future__ import annotations

import json
import sys
import textwrap

from rich.console import Console

from .harness import Row

__all__ = ["print_rows", "row_line", "columns", "table_lines"]

WIDTH = 100  # the table's fixed columns fit this many characters (or the terminal, if narrower)

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
    if not console.is_terminal:  # a file or a pipe: one line per row
        print("\n".join(table_lines(rows, doc, None)))
        return
    for line in table_lines(rows, doc, min(console.width, WIDTH)):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _baseline(group: list[Row], default: str | None) -> Row | None:
    """The row the others' times are divided by: the default's, else reference's, else none."""
    for name in (default, "reference"):
        found = [r for r in group if r.implementation == name and r.ms]
        if found:
            return found[0]
    return None


def table_lines(rows: list[Row], doc: dict, width: int | None = WIDTH) -> list[str]:
    """The table as lines: the title, then per op and case a heading naming the default and the
    rows, each with its time as a multiple of the default's beside its memory. With a `width`,
    rate columns are left out until the fixed columns fit it and long notes go under their row;
    with None each row is one line, its note at the end."""
    flop_scale, flop_unit = _unit([r.tflops * 1e12 for r in rows if r.tflops], _FLOP_UNITS)
    byte_scale, byte_unit = _unit([r.gbps * 1e9 for r in rows if r.gbps], _BYTE_UNITS)
    defaults = {(c.get("op"), c.get("case")): c.get("default") for c in doc.get("cases", [])}
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.op, r.case), []).append(r)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    rate = lambda v, scale: "-" if v is None else _significant(v / scale)  # noqa: E731
    cells: list[dict[str, str]] = []  # per row, by column
    for (op, case), group in groups.items():
        default = defaults.get((op, case))
        heading = f"{op} · {case}"
        if default and not any(r.implementation == default and r.ms for r in group):
            heading += f" (default here: {default}, not timed; times against reference)"
        elif default:
            heading += f" (default here: {default})"
        for pass_ in dict.fromkeys(r.pass_ for r in group):
            mine = [r for r in group if r.pass_ == pass_]
            base = _baseline(mine, default)
            for r in mine:
                ratio = "-" if base is None or not r.ms else f"{r.ms / base.ms:.2f}x"
                cells.append(
                    {
                        "group": heading,
                        "impl": r.implementation + (" (interpret)" if r.interpret else ""),
                        "pass": r.pass_,
                        "ms": fmt(r.ms, ".3f"),
                        "x default": ratio,
                        "temp GiB": fmt(r.temp_gib, ".3f"),
                        flop_unit: rate(None if r.tflops is None else r.tflops * 1e12, flop_scale),
                        byte_unit: rate(None if r.gbps is None else r.gbps * 1e9, byte_scale),
                        "of ceiling": fmt(r.ceiling_fraction, ".1%"),
                        "max rel err": fmt(r.max_rel_error, ".1e"),
                        "note": r.note,
                    }
                )
    names = ["impl", "pass", "ms", "x default", "temp GiB", flop_unit, byte_unit, "of ceiling", "max rel err"]
    names = [n for n in names if n in ("impl", "pass", "ms") or any(c[n] != "-" for c in cells)]
    right = {"ms", "x default", "temp GiB", flop_unit, byte_unit, "of ceiling", "max rel err"}
    widths = {n: max([len(n)] + [len(c[n]) for c in cells]) for n in names}
    indent, gap = "  ", "  "

    def fixed() -> int:
        return len(indent) + sum(widths[n] for n in names) + len(gap) * (len(names) - 1)

    for optional in (byte_unit, "of ceiling", flop_unit):  # what a narrow terminal leaves out first
        if width is not None and fixed() > width and optional in names:
            names.remove(optional)
    lines = [_title(doc)]
    heading = None
    for c in cells:
        if c["group"] != heading:
            heading = c["group"]
            lines += ["", *(textwrap.wrap(heading, width=width) if width else [heading])]
            lines.append(indent + gap.join(_pad(n, widths[n], n in right) for n in names))
        line = indent + gap.join(_pad(c[n], widths[n], n in right) for n in names)
        note = c["note"]
        if note and (width is None or len(line) + len(gap) + len(note) <= width):
            line += gap + note
            note = ""
        lines.append(line.rstrip())
        if note:
            lines += textwrap.wrap(note, width=width, initial_indent=indent * 2, subsequent_indent=indent * 2)
    if doc.get("matmul_ceiling_tflops") is None:
        lines += [""] + textwrap.wrap(
            "On a CPU only xla and reference run compiled; the GPU and TPU kernels' times, beside "
            "the peers, are in docs/benchmarks.md.",
            width=width or WIDTH,
        )
    return lines


def _pad(text: str, width: int, right: bool) -> str:
    return text.rjust(width) if right else text.ljust(width)


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
