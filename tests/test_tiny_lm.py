"""examples/tiny_lm.py trains: 10 steps on the CPU, the loss falls, and explain names every op."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_lm.py"


def load():
    spec = importlib.util.spec_from_file_location("tiny_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # equinox's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_tiny_lm_trains_and_explains_each_op():
    lines = []
    losses = load().train(10, log=lambda line: lines.append(str(line)))
    print("\n".join(lines))
    assert losses[-1] < 0.7 * losses[0], losses
    text = "\n".join(lines)
    for op in ("attention", "short_conv", "ssd", "moe_dispatch", "moe_combine", "fused_cross_entropy_loss"):
        assert f"{op}: " in text, op


def test_bench_times_one_training_step(tmp_path):
    import json

    from axkern import cli

    out = tmp_path / "step.json"
    args = ["bench", "--cases", str(EXAMPLE), "--tokens", "16", "--impl", "default", "--passes", "fwd"]
    assert cli.main([*args, "--repeats", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["op"] == "tiny_lm" and row["ms"] > 0 and row["max_rel_error"] < 1e-3, row
