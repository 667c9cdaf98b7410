"""`axkern report`: tables and plots from the committed results.

Reads every run under `benchmarks/results/<device_key>/<op>/<preset>.json` (see
`axkern.bench.results`) and writes:

- `docs/benchmarks.md`, between its report markers: each op's implementations beside the peers
  timed in the same run, then per device and op a table of every row (time, rate, fraction of
  the ceiling measured in the same run, temporary memory, error) under the run's command,
  date, versions and ceilings, with one plot of the times;
- each op page (`docs/ops/<op>.md`) that has report markers: its op's part of the same;
- the README, between its markers: the short form, one table per op that was timed beside its
  peers, the default implementation's forward+backward time and memory on the device named in
  each row, the peers beside it;
- `docs/img/`: one plot per device and op and `overview.png` (`axkern.bench.plots`).

A file is rewritten only when its bytes change.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from . import plots
from .results import NOTE

__all__ = ["START", "END", "markdown", "peers_table", "summary", "default_order", "fill", "write"]

START = "<!-- axkern report: start (generated from benchmarks/results; edit with `axkern report`) -->"
END = "<!-- axkern report: end -->"
_PASS_ORDER = {"fwd": 0, "fwd+bwd": 1}
# the order a per-call order function can give at its widest: the kernels before xla
_WIDEST_ORDER = ("mosaic_gpu", "pallas_gpu", "xla")
SUMMARY_ROWS = 6  # at most this many cases per op in the README's table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _short(case: str) -> str:
    """A case label without its preset prefix (`llama3: N=..` -> `N=..`)."""
    return case.split(": ", 1)[1] if ": " in case else case


def _case_key(case: str) -> tuple[list[int], str]:
    """Cases in the order of their numbers (N=8192 before N=16384), then by label."""
    return [int(n) for n in re.findall(r"\d+", _short(case))], case


def _groups(runs: Sequence[dict]) -> dict[tuple[str, str], list[dict]]:
    """Runs by (device_key, op), in the order of the files."""
    out: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        out.setdefault((run["device_key"], run["op"]), []).append(run)
    return out


def default_order(op: str, platform: str) -> tuple[tuple[str, ...], bool]:
    """The implementations the dispatcher tries by default for `op` on `platform`, and whether
    the order depends on the call (then taken at its widest: the kernels that serve some calls
    first); `((), False)` for a name that is not a registered op."""
    import axkern  # noqa: F401  (registers the ops)
    from axkern.core import registry

    try:
        op_ = registry.get_op(op)
    except ValueError:
        return (), False
    order = op_.default_order.get(platform, ("xla",))
    if callable(order):
        return tuple(n for n in _WIDEST_ORDER if n in op_.implementations), True
    return tuple(order), False


def _timed(run: dict, pass_: str | None = None) -> set[str]:
    return {r["implementation"] for r in run["rows"] if r.get("ms") and (pass_ is None or r["pass"] == pass_)}


def _untimed_default(run: dict) -> tuple[str, str, str | None] | None:
    """`(first, where, shown)` when the first implementation of the run's default order (`first`,
    `where` it serves) is not in the run, with the first of the order that is (`shown`); else None."""
    platform = run.get("platform", "gpu")
    order, per_call = default_order(run.get("op", ""), platform)
    timed = _timed(run)
    if not order or order[0] in timed or not timed - {"reference"}:
        return None
    where = f"on {platform}" + (" where it serves" if per_call else "")
    return order[0], where, next((i for i in order if i in timed), None)


def _default_note(run: dict, column: bool = False) -> str:
    """What a run says when the first implementation of its default order is not in it."""
    untimed = _untimed_default(run)
    if untimed is None:
        return ""
    first, where, shown = untimed
    if not column:
        return f"The default {where} is `{first}`, which this run does not time"
    note = f"The default {where} is `{first}`, which these runs do not time"
    return note + (f": the default column shows `{shown}`, the next in the default order" if shown else "")


def _table(run: dict) -> list[str]:
    rows = sorted(
        run["rows"],
        key=lambda r: (
            _case_key(r["case"]),
            _PASS_ORDER.get(r["pass"], 2),
            r["implementation"].startswith("peer:"),
        ),
    )
    rate = "GB/s" if any(r.get("gbps") for r in rows) else None
    head = ["case", "implementation", "pass", "ms", "TFLOP/s"] + ([rate] if rate else [])
    head += ["of ceiling", "temp GiB", "max rel err", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        impl = r["implementation"].replace("peer:", "peer: ")
        cells = [
            _short(r["case"]),
            f"`{impl}`",
            r["pass"],
            _fmt(r.get("ms"), ".3f"),
            _fmt(r.get("tflops"), ".1f"),
        ]
        cells += [_fmt(r.get("gbps"), ".0f")] if rate else []
        cells += [
            _fmt(r.get("ceiling_fraction"), ".1%"),
            _fmt(r.get("temp_gib"), ".3f"),
            _fmt(r.get("max_rel_error"), ".1e"),
            _cell(r.get("note") or "")[:120],
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def _about(run: dict) -> str:
    ceiling = run.get("matmul_ceiling_tflops")
    bandwidth = run.get("copy_bandwidth_gbps")
    measured = []
    if ceiling:
        measured.append(f"matmul ceiling {ceiling:.0f} TFLOP/s")
    if bandwidth:
        measured.append(f"copy bandwidth {bandwidth:.0f} GB/s")
    v = run.get("versions", {})
    cut = ""
    if run.get("complete") is False:  # a run cut short keeps the rows it wrote as it went
        done = {r["case"] for r in run.get("rows", [])}
        missing = [c["case"] for c in run.get("cases", []) if c["case"] not in done]
        cut = " The run was cut short" + (f"; no rows for {'; '.join(missing)}" if missing else "") + "."
    # what a run's note says beyond the standard one (e.g. rows joined from several runs)
    note = run.get("note", "")
    more = note[len(NOTE) :].lstrip("; ") if note.startswith(NOTE) else ""
    # errors taken against another implementation where the oracle would not fit in memory
    others = sorted(
        {c["reference"] for c in run.get("cases", []) if c.get("reference", "reference") != "reference"}
    )
    if others:
        more = "; ".join(
            filter(None, [more, f"errors against `{'`, `'.join(others)}` (the oracle would not fit)"])
        )
    default = _default_note(run) if run.get("rows") else ""
    return (
        f"`{run['command']}` on {run['device']}, {run['date'][:10]}, jax {v.get('jax', '?')}"
        + (f"; {', '.join(measured)} measured in the same run" if measured else "")
        + f" (`benchmarks/results/{'/'.join(Path(run['path']).parts[-3:])}`)."
        + (f" {more[:1].upper()}{more[1:]}." if more else "")
        + (f" {default}." if default else "")
        + cut
    )


def _image_name(device_key: str, op: str) -> str:
    return f"{device_key}_{op}.png"


def _heading(op: str, device: str) -> str:
    return f"{op} on {device}"


def markdown(runs: Sequence[dict], image_dir: str = "img") -> str:
    """The tables of every run, grouped by device and op, each op with its plot."""
    out = []
    for (device_key, op), group in _groups(runs).items():
        out += [f"### {_heading(op, group[0]['device'])}", ""]
        out += [f"![{op} on {device_key}]({image_dir}/{_image_name(device_key, op)})", ""]
        for run in group:
            out += [f"**preset `{run['preset']}`**: {_about(run)}", ""]
            out += _table(run) + [""]
    return "\n".join(out).rstrip() + "\n"


def _has_peers(run: dict, pass_: str) -> bool:
    return any(r["implementation"].startswith("peer:") for r in run["rows"] if r["pass"] == pass_)


def _time_and_memory(r: dict | None) -> str:
    if r is None or not r.get("ms"):
        return "-"
    gib = r.get("temp_gib")
    return f"{r['ms']:.1f} ms" + ("" if gib is None else f", {gib:.2f} GiB")


def peers_table(runs: Sequence[dict], pass_: str = "fwd+bwd") -> str:
    """One table per run that timed peers: each case's `pass_` time and temporary memory for
    every implementation and peer, side by side, under a line naming the run (its command and
    versions are under the op's heading, `markdown`)."""
    out = []
    for run in runs:
        if not _has_peers(run, pass_):
            continue
        rows = [r for r in run["rows"] if r["pass"] == pass_]
        impls = sorted({r["implementation"] for r in rows}, key=lambda i: (i.startswith("peer:"), i))
        cases = sorted({r["case"] for r in rows}, key=_case_key)
        got = {(r["case"], r["implementation"]): r for r in rows}
        out.append(
            f"`{run['op']}` on {run['device']}, preset `{run['preset']}`, {pass_}, ms and temporary GiB "
            f"(the run: under *{_heading(run['op'], run['device'])}* below)"
        )
        out += ["", "| case | " + " | ".join(f"`{i.replace('peer:', '')}`" for i in impls) + " |"]
        out.append("|---|" + "---|" * len(impls))
        for case in cases:
            cells = [_time_and_memory(got.get((case, impl))) for impl in impls]
            out.append(f"| {_short(case)} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _cases(run: dict, pass_: str) -> list[str]:
    """The cases `run` timed in `pass_`, in the order of their numbers."""
    return sorted({r["case"] for r in run["rows"] if r["pass"] == pass_ and r.get("ms")}, key=_case_key)


def _quotas(counts: list[int], total: int) -> list[int]:
    """How many of each run's `counts` cases a table of `total` rows shows: an even share each
    (at least one); the rows a run with fewer cases than its share leaves go one at a time to
    the runs with cases left to show, the later runs first."""
    share = max(1, total // len(counts))
    quotas = [min(c, share) for c in counts]
    left = sum(share - q for q in quotas)
    while left > 0 and any(q < c for q, c in zip(quotas, counts, strict=True)):
        for i in reversed(range(len(counts))):
            if left and quotas[i] < counts[i]:
                quotas[i] += 1
                left -= 1
    return quotas


def _spread(items: list, n: int) -> list:
    """At most `n` of `items`, evenly spaced, the first and the last among them."""
    if len(items) <= n:
        return items
    if n == 1:
        return [items[len(items) // 2]]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def _label(run: dict, case: str, with_preset: bool, dtype: str | None) -> str:
    """A case's label in the README: the preset's name only where the table holds several presets,
    the dtype only where the table's cases differ in it."""
    label, preset = case, run["preset"]
    if label.startswith(preset):
        rest = label[len(preset) :].replace(": ", " ", 1).strip(" :")
        label = f"{preset} {rest}" if with_preset else rest
    if dtype and label.endswith(" " + dtype):
        label = label[: -len(dtype) - 1]
    return label


def summary(runs: Sequence[dict], pass_: str = "fwd+bwd", max_rows: int = SUMMARY_ROWS) -> str:
    """The README's short form: per op timed beside peers, one table of at most `max_rows` cases,
    each row naming its device, with the default implementation's time and temporary memory
    (the first of the op's default order timed in that case) and each peer's beside it."""
    by_op: dict[str, list[dict]] = {}
    for run in runs:
        if _has_peers(run, pass_):
            by_op.setdefault(run["op"], []).append(run)
    out = []
    for op, group in by_op.items():
        peers = sorted({i for run in group for i in _timed(run, pass_) if i.startswith("peer:")})
        dtypes = {c.get("dtype") for run in group for c in run.get("cases", [])}
        dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
        presets = len({run["preset"] for run in group}) > 1
        quotas = _quotas([len(_cases(run, pass_)) for run in group], max_rows)
        lines, shown, total, notes = [], 0, 0, []
        for run, share in zip(group, quotas, strict=True):
            order, _ = default_order(op, run.get("platform", "gpu"))
            rows = [r for r in run["rows"] if r["pass"] == pass_ and r.get("ms")]
            got = {(r["case"], r["implementation"]): r for r in rows}
            cases = _cases(run, pass_)
            total += len(cases)
            note = _default_note(run, column=True)
            if note and note not in notes:
                notes.append(note)
            for case in _spread(cases, share):
                ours = [i for i in order if (case, i) in got] or sorted(
                    i for i in _timed(run, pass_) if not i.startswith("peer:") and i != "reference"
                )
                default = f"`{ours[0]}` {_time_and_memory(got.get((case, ours[0])))}" if ours else "-"
                cells = [plots.device_name(run["device"]), _label(run, case, presets, dtype), default]
                cells += [_time_and_memory(got.get((case, p))) for p in peers]
                lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
                shown += 1
        what = f"{shown} of {total} cases" if shown < total else f"{total} cases"
        out.append(f"**`{op}`**, {pass_}{f', {dtype}' if dtype else ''}, {what}: ms and temporary GiB")
        out += ["", "| device | case | default | " + " | ".join(f"`{p[5:]}`" for p in peers) + " |"]
        out.append("|---|---|---|" + "---|" * len(peers))
        out += lines
        out += [""] + [f"{n}." for n in notes] + ([""] if notes else [])
    without = sorted({run["op"] for run in runs} - set(by_op))
    if without:
        out.append("Timed without peers: " + ", ".join(f"`{op}`" for op in without) + ".")
    return "\n".join(out).rstrip() + "\n"


def fill(text: str, generated: str, where: str) -> str:
    """`text` with the part between the report markers replaced by `generated`."""
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), flags=re.S)
    if not pattern.search(text):
        raise ValueError(f"report: {where} has no report markers ({START!r} ... {END!r})")
    return pattern.sub(lambda _: f"{START}\n{generated.rstrip()}\n{END}", text)


def _op_pages(docs: Path, runs: Sequence[dict]) -> dict[Path, set[str]]:
    """Each op's page, `docs/ops/<op>.md`, or the page of the longest op name it starts with
    (`fused_cross_entropy_loss` -> `fused_cross_entropy.md`, `moe_combine` -> `moe.md`)."""
    pages = {p.stem: p for p in (docs / "ops").glob("*.md")}
    out: dict[Path, set[str]] = {}
    for op in sorted({run["op"] for run in runs}):
        names = [n for n in pages if op == n or op.startswith(n + "_")]
        if names:
            out.setdefault(pages[max(names, key=len)], set()).add(op)
    return out


def _benchmarks_page(runs: Sequence[dict]) -> str:
    side = peers_table(runs)
    head = ["### Beside the peers", "", side, "### Every run", ""] if side else []
    return "\n".join(head) + markdown(runs)


def write(runs: Sequence[dict], *, docs: Path, readme: Path | None = None) -> dict[Path, bool]:
    """Write `docs/benchmarks.md`'s tables, the op pages' tables, `docs/img/*.png` and the
    README's short form; return each file considered and whether its bytes changed (an
    unchanged file is not rewritten)."""
    if not runs:
        raise ValueError(
            "report: no results to report (expected benchmarks/results/<device_key>/<op>/<preset>.json)"
        )
    img = docs / "img"
    out: dict[Path, bytes] = {}
    groups = _groups(runs)
    for key, group in groups.items():
        out[img / _image_name(*key)] = plots.plot_op(group)
    out[img / "overview.png"] = plots.plot_overview(groups)
    page = docs / "benchmarks.md"
    out[page] = fill(page.read_text(encoding="utf-8"), _benchmarks_page(runs), str(page)).encode("utf-8")
    for op_page, ops in _op_pages(docs, runs).items():
        text = op_page.read_text(encoding="utf-8")
        if START in text:
            mine = [run for run in runs if run["op"] in ops]
            out[op_page] = fill(text, markdown(mine, image_dir="../img"), str(op_page)).encode("utf-8")
    if readme is not None:
        short = summary(runs) + (
            "\n![Each op's fraction of the measured ceiling, by device](docs/img/overview.png)\n\n"
            "Every run with its command, versions and ceilings, and every implementation: "
            "[docs/benchmarks.md](docs/benchmarks.md)."
        )
        out[readme] = fill(readme.read_text(encoding="utf-8"), short, str(readme)).encode("utf-8")
    changed: dict[Path, bool] = {}
    img.mkdir(parents=True, exist_ok=True)
    for path, data in out.items():
        changed[path] = not path.is_file() or path.read_bytes() != data
        if changed[path]:
            path.write_bytes(data)
    return changed
