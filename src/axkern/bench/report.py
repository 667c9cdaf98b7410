"""`axkern report`: tables and plots from the committed results.

Reads every run under `benchmarks/results/<device_key>/<op>/<preset>.json` (see
`axkern.bench.results`) and writes, per device and op, a markdown table (time, rate, fraction of
the ceiling measured in the same run, temporary memory and error, for every implementation
and peer) and one plot of the times. The tables go between the report markers of
`docs/benchmarks.md`; an overview plot of every op's fraction of the ceiling goes between the
markers of `README.md`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .results import NOTE

__all__ = ["START", "END", "markdown", "peers_table", "plot_op", "plot_overview", "fill", "write"]

START = "<!-- axkern report: start (generated from benchmarks/results; edit with `axkern report`) -->"
END = "<!-- axkern report: end -->"
_PASS_ORDER = {"fwd": 0, "fwd+bwd": 1}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _short(case: str) -> str:
    """A case label without its preset prefix (`llama3: N=..` -> `N=..`)."""
    return case.split(": ", 1)[1] if ": " in case else case


def _groups(runs: Sequence[dict]) -> dict[tuple[str, str], list[dict]]:
    """Runs by (device_key, op), in the order of the files."""
    out: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        out.setdefault((run["device_key"], run["op"]), []).append(run)
    return out


def _table(run: dict) -> list[str]:
    rows = sorted(
        run["rows"],
        key=lambda r: (r["case"], _PASS_ORDER.get(r["pass"], 2), r["implementation"].startswith("peer:")),
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
    return (
        f"`{run['command']}` on {run['device']}, {run['date'][:10]}, jax {v.get('jax', '?')}"
        + (f"; {', '.join(measured)} measured in the same run" if measured else "")
        + f" (`benchmarks/results/{'/'.join(Path(run['path']).parts[-3:])}`)."
        + (f" {more[:1].upper()}{more[1:]}." if more else "")
        + cut
    )


def _image_name(device_key: str, op: str) -> str:
    return f"{device_key}_{op}.png"


def markdown(runs: Sequence[dict], image_dir: str = "img") -> str:
    """The tables of every run, grouped by device and op, each op with its plot."""
    out = []
    for (device_key, op), group in _groups(runs).items():
        out += [f"### {op} on {group[0]['device']}", ""]
        out += [f"![{op} on {device_key}]({image_dir}/{_image_name(device_key, op)})", ""]
        for run in group:
            out += [f"**preset `{run['preset']}`**: {_about(run)}", ""]
            out += _table(run) + [""]
    return "\n".join(out).rstrip() + "\n"


def peers_table(runs: Sequence[dict], pass_: str = "fwd+bwd") -> str:
    """One table per run that timed peers: each case's `pass_` time and temporary memory for
    every implementation and peer, side by side."""
    out = []
    for run in runs:
        rows = [r for r in run["rows"] if r["pass"] == pass_]
        if not any(r["implementation"].startswith("peer:") for r in rows):
            continue
        impls = sorted({r["implementation"] for r in rows}, key=lambda i: (i.startswith("peer:"), i))
        cases = sorted({r["case"] for r in rows}, key=lambda c: ([int(n) for n in re.findall(r"\d+", c)], c))
        got = {(r["case"], r["implementation"]): r for r in rows}
        out.append(f"`{run['op']}`, preset `{run['preset']}`, {pass_}: {_about(run)}")
        out += ["", "| case | " + " | ".join(f"`{i.replace('peer:', '')}`" for i in impls) + " |"]
        out.append("|---|" + "---|" * len(impls))
        for case in cases:
            cells = []
            for impl in impls:
                r = got.get((case, impl))
                if r is None or not r.get("ms"):
                    cells.append("-")
                else:
                    cells.append(
                        f"{r['ms']:.1f} ms" + (f", {r['temp_gib']:.2f} GiB" if r.get("temp_gib") else "")
                    )
            out.append(f"| {_short(case)} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _figure(height: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.subplots(figsize=(7.5, height), dpi=72)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    # no metadata: the same results give the same bytes
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
    return path


def _numbers(case: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", case)]


def plot_op(group: Sequence[dict], path: Path) -> Path:
    """Horizontal bars, log scale: ms per (case, pass), one bar per implementation and peer
    timed there (each in the same colour throughout)."""
    rows = [r for run in group for r in run["rows"] if r.get("ms")]
    keys = sorted(
        {(r["case"], r["pass"]) for r in rows}, key=lambda k: (_numbers(k[0]), k[0], _PASS_ORDER.get(k[1], 2))
    )
    impls = sorted({r["implementation"] for r in rows}, key=lambda i: (i.startswith("peer:"), i))
    colour = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}
    ms = {(r["case"], r["pass"], r["implementation"]): r["ms"] for r in rows}
    bars, ticks, y = [], [], 0.0
    for case, pass_ in keys:
        present = [i for i in impls if (case, pass_, i) in ms]
        ticks.append((y + (len(present) - 1) / 2, f"{_short(case)} · {pass_}"))
        for impl in present:
            bars.append((y, ms[(case, pass_, impl)], impl))
            y += 1
        y += 0.6
    plt, (fig, ax) = _figure(0.9 + 0.16 * y)
    for impl in impls:
        mine = [b for b in bars if b[2] == impl]
        ax.barh([b[0] for b in mine], [b[1] for b in mine], height=0.9, color=colour[impl], label=impl)
    ax.set_yticks([t[0] for t in ticks])
    ax.set_yticklabels([t[1] for t in ticks], fontsize=7)
    ax.set_ylim(y - 0.3, -0.8)
    ax.set_xscale("log")
    ax.set_xlabel("ms (lower is faster)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"{group[0]['op']} on {group[0]['device']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(plt, fig, path)


def plot_overview(runs: Sequence[dict], path: Path) -> Path:
    """Each op's best fraction of the measured ceiling per implementation (its first case, the
    forward+backward pass where timed)."""
    bars = []
    for (_, op), group in _groups(runs).items():
        rows = [r for run in group for r in run["rows"] if r.get("ceiling_fraction")]
        if not rows:
            continue
        first = sorted({r["case"] for r in rows})[0]
        passes = {r["pass"] for r in rows if r["case"] == first}
        pass_ = "fwd+bwd" if "fwd+bwd" in passes else sorted(passes)[0]
        best: dict[str, float] = {}
        for r in rows:
            if r["case"] == first and r["pass"] == pass_:
                best[r["implementation"]] = max(best.get(r["implementation"], 0.0), r["ceiling_fraction"])
        bars += [(f"{op} · {impl}", 100 * f) for impl, f in sorted(best.items())]
    plt, (fig, ax) = _figure(1.0 + 0.2 * len(bars))
    ax.barh(range(len(bars)), [b[1] for b in bars], color="tab:blue")
    for i, (_, percent) in enumerate(bars):
        ax.text(percent + 0.5, i, f"{percent:.0f}%", va="center", fontsize=7)
    ax.set_xlim(0, 105)
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% of the ceiling measured in the same run (matmul or copy)")
    ax.set_title("axkern on " + ", ".join(sorted({r["device"] for r in runs})), fontsize=9)
    return _save(plt, fig, path)


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


def write(runs: Sequence[dict], *, docs: Path, readme: Path | None = None) -> list[Path]:
    """Write `docs/benchmarks.md`'s tables, `docs/img/*.png` and the README's overview; return what changed hands."""
    if not runs:
        raise ValueError(
            "report: no results to report (expected benchmarks/results/<device_key>/<op>/<preset>.json)"
        )
    img = docs / "img"
    img.mkdir(parents=True, exist_ok=True)
    written = [plot_op(g, img / _image_name(*key)) for key, g in _groups(runs).items()]
    written.append(plot_overview(runs, img / "overview.png"))
    page = docs / "benchmarks.md"
    page.write_text(fill(page.read_text(), markdown(runs), str(page)))
    written.append(page)
    for op_page, ops in _op_pages(docs, runs).items():
        mine = [run for run in runs if run["op"] in ops]
        text = op_page.read_text()
        if START in text:
            op_page.write_text(fill(text, markdown(mine, image_dir="../img"), str(op_page)))
            written.append(op_page)
    if readme is not None:
        overview = (
            peers_table(runs) + "\n![Each op's fraction of the measured ceiling](docs/img/overview.png)\n\n"
            "Every op, implementation and shape, with one plot per op: "
            "[docs/benchmarks.md](docs/benchmarks.md)."
        )
        readme.write_text(fill(readme.read_text(), overview, str(readme)))
        written.append(readme)
    return written
