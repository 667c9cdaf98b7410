"""docs/tpu.md's table of what runs on a TPU agrees with the registry: every op, whether it has a
`pallas_tpu` implementation, and its default order on a TPU. A CPU test (no chip needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from axkern.core import registry
from axkern.core.op import get_op

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tpu.md"


def test_the_tpu_page_lists_each_ops_kernel_and_default_order():
    section = PAGE.read_text().split("## What runs where", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| (.+?) \|$", section, flags=re.M)
    table = {op: (kernel, order) for op, kernel, order in rows}
    want = {}
    for name in registry.ops():
        op = get_op(name)
        order = op.default_order.get("tpu", ("xla",))
        assert not callable(order), f"{name}: the page's table needs a fixed TPU order"
        kernel = "`pallas_tpu`" if "pallas_tpu" in op.implementations else "none"
        want[name] = (kernel, ", ".join(f"`{i}`" for i in order))
    assert table == want


def test_an_op_that_leaves_its_tpu_kernel_out_of_the_tpu_order_says_why():
    for name in registry.ops():
        op = get_op(name)
        if "pallas_tpu" in op.implementations and "pallas_tpu" not in op.default_order.get("tpu", ()):
            note = op.order_notes.get("tpu", "")
            assert "pallas_tpu" in note and "docs/tpu.md" in note, f"{name}: no reason for its TPU order"


@pytest.mark.parametrize(
    "op, chosen, note",
    [
        ("attention", "pallas_tpu", ""),
        ("mamba3", "pallas_tpu", ""),
        ("ssd", "pallas_tpu", ""),
        ("fused_cross_entropy_loss", "pallas_tpu", ""),
        ("short_conv", "pallas_tpu", ""),
    ],
)
def test_explain_on_a_tpu_gives_the_measured_default_and_why(op, chosen, note):
    from axkern.bench import cases_for
    from tests.tpu_lowering import as_tpu

    with as_tpu():
        decision = cases_for(op)[0].decision()
    assert decision.implementation == chosen and not decision.interpret, decision
    assert note in decision.order_note and (f"order:       {note}" in str(decision)) == bool(note)


def test_the_readmes_tpu_table_is_the_committed_tpu_run():
    import json

    repo = PAGE.parents[1]
    measured = {}
    for path in (repo / "benchmarks" / "results" / "tpu_v5e").glob("*/tpu.json"):
        for r in json.loads(path.read_text())["rows"]:
            if r["pass"] == "fwd+bwd" and r["temp_gib"] is not None:
                measured.setdefault(r["implementation"], set()).add(
                    (f"{r['ms']:.1f}", f"{r['temp_gib']:.2f}")
                )
    rows = re.findall(
        r"^\| TPU v5e \| `(\w+)` .+? \| (.+?) \| (.+?) \| `(\w+)` \|$", (repo / "README.md").read_text(), re.M
    )
    assert {op for op, *_ in rows} == {
        "fused_cross_entropy",
        "fused_cross_entropy_loss",
        "ssd",
        "short_conv",
        "attention",
        "mamba3",
    }
    for op, kernel, xla, default in rows:
        for impl, cell in (("pallas_tpu", kernel), ("xla", xla)):
            got = re.fullmatch(r"(\d+\.\d) ms, (\d+\.\d\d) GiB", cell)
            assert got and got.groups() in measured[impl], (op, impl, cell)
        order = get_op(op).default_order["tpu"]
        assert default == order[0], (op, order)
