"""The notebooks execute top to bottom on a CPU (nbclient, the venv's own Python kernel), and
what each code cell prints is what the committed notebook shows.

Compared per code cell: its stdout and the text form of its results (images are not compared;
memory addresses are masked). A cell tagged `volatile` (times, anything that changes from run
to run) only has to run. `python tests/test_notebooks.py` re-executes the notebooks and writes
their outputs back.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def execute(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},  # paths in the notebook are relative to it
    )
    client.execute()
    return nb


def shown(cell) -> str:
    """A code cell's stdout and text results, addresses masked."""
    parts = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream" and o["name"] == "stdout":
            parts.append(o["text"])
        elif o["output_type"] in ("execute_result", "display_data"):
            parts.append(o["data"].get("text/plain", "") + "\n")
        elif o["output_type"] == "error":
            parts.append(f"{o['ename']}: {o['evalue']}\n")
    return re.sub(r"0x[0-9a-f]+", "0x…", "".join(parts))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_and_prints_what_it_shows(path):
    committed = nbformat.read(path, as_version=4)
    ran = execute(path)
    code = [(a, b) for a, b in zip(committed.cells, ran.cells, strict=True) if a.cell_type == "code"]
    assert sum(bool(shown(a).strip()) for a, _ in code) >= 3, "the committed notebook keeps its outputs"
    for i, (want, got) in enumerate(code):
        assert "error" not in {o["output_type"] for o in got.get("outputs", [])}, shown(got)
        if "volatile" in want.metadata.get("tags", []):
            continue
        assert shown(got) == shown(want), f"{path.name}, code cell {i}:\n{want.source}"


def test_the_notebooks_cover_every_op_and_the_results():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "benchmarks.ipynb"} <= names
    import axkern

    source = "\n".join(c.source for c in nbformat.read(NOTEBOOK_DIR / "quickstart.ipynb", as_version=4).cells)
    for op in axkern.ops():
        # the named fused_cross_entropy runs the fused_cross_entropy_loss op for reduced losses
        call = "fused_cross_entropy(" if op == "fused_cross_entropy_loss" else f"{op}("
        assert call in source, f"quickstart.ipynb does not call {op}"
    assert source.count("axkern.explain(") >= 6 and "implementation=(" in source  # explain and a fallback
    bench = "\n".join(c.source for c in nbformat.read(NOTEBOOK_DIR / "benchmarks.ipynb", as_version=4).cells)
    assert "results.load(" in bench and "plt." in bench


if __name__ == "__main__":  # refresh the committed outputs
    for p in sys.argv[1:] or NOTEBOOKS:
        nbformat.write(execute(Path(p).resolve()), p)
        print("executed", p)
