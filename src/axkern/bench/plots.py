"""`axkern report`'s plots (matplotlib, the `report` extra): one per device and op, and the
overview. Each plot is rendered to PNG bytes without metadata, so the same results give the
same bytes and `axkern report` rewrites only the plots whose results changed."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence

__all__ = ["MATPLOTLIB_MISSING", "device_name", "overview_bars", "plot_op", "plot_overview"]

MATPLOTLIB_MISSING = "the plots need matplotlib: pip install -e '.[report]' (or pip install matplotlib)"
_PASS_ORDER = {"fwd": 0, "fwd+bwd": 1}


def device_name(device: str) -> str:
    """A device's name without its vendor and memory (`NVIDIA H100 80GB HBM3` -> `H100`)."""
    words = device.removeprefix("NVIDIA ").split()
    kept = [w for w in words if not re.fullmatch(r"\d+GB|HBM\d*e?|PCIe|SXM\d*|NVL", w)]
    return " ".join(kept) or device


def _short(case: str) -> str:
    return case.split(": ", 1)[1] if ": " in case else case


def _numbers(case: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", case)]


def _figure(height: float):
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ModuleNotFoundError(MATPLOTLIB_MISSING, name="matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.subplots(figsize=(7.5, height), dpi=72)


def _png(plt, fig) -> bytes:
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", metadata={"Software": None})  # no metadata: same results, same bytes
    plt.close(fig)
    return out.getvalue()


def plot_op(group: Sequence[dict]) -> bytes:
    """Horizontal bars, log scale: ms per (case, pass), one bar per implementation and peer
    timed there (each in the same colour throughout)."""
    rows = [r for run in group for r in run["rows"] if r.get("ms")]
    keys = sorted(
        {(r["case"], r["pass"]) for r in rows},
        key=lambda k: (_numbers(k[0]), k[0], _PASS_ORDER.get(k[1], 2)),
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
    return _png(plt, fig)


def overview_bars(groups: dict[tuple[str, str], list[dict]]) -> list[tuple[str, float]]:
    """The overview's bars, `(label, percent)`: each op's best fraction of the measured ceiling per
    implementation (its smallest case, the forward+backward pass where timed), each label naming
    the op, the implementation and the device (`ssd · mosaic_gpu · H100`)."""
    bars = []
    for (_, op), group in groups.items():
        rows = [r for run in group for r in run["rows"] if r.get("ceiling_fraction")]
        if not rows:
            continue
        first = min({r["case"] for r in rows}, key=lambda c: (_numbers(_short(c)), c))
        passes = {r["pass"] for r in rows if r["case"] == first}
        pass_ = "fwd+bwd" if "fwd+bwd" in passes else sorted(passes)[0]
        best: dict[str, float] = {}
        for r in rows:
            if r["case"] == first and r["pass"] == pass_:
                best[r["implementation"]] = max(best.get(r["implementation"], 0.0), r["ceiling_fraction"])
        device = device_name(group[0]["device"])
        bars += [(f"{op} · {impl} · {device}", 100 * f) for impl, f in sorted(best.items())]
    return bars


def plot_overview(groups: dict[tuple[str, str], list[dict]]) -> bytes:
    """The overview's bars (`overview_bars`) as one horizontal bar chart."""
    bars = overview_bars(groups)
    plt, (fig, ax) = _figure(1.0 + 0.2 * len(bars))
    ax.barh(range(len(bars)), [b[1] for b in bars], color="tab:blue")
    for i, (_, percent) in enumerate(bars):
        ax.text(percent + 0.5, i, f"{percent:.0f}%", va="center", fontsize=7)
    ax.set_xlim(0, 105)
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% of the ceiling measured in the same run (matmul or copy)")
    ax.set_title("Each op's fraction of the ceiling, by implementation and device", fontsize=9)
    return _png(plt, fig)
