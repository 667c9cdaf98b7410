"""benchmarks/diagnostics/mamba3_operand_precision.py on a small case: Mamba-3's layer through the emulated
Mosaic GPU kernels (`chunked/mosaic_gpu/emulate.py`) with `q`, `k` as two bf16 halves holds the
oracle rule, and rounding them to bf16 in every kernel puts the gradients further from it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import axkern
from tests.cases.mamba3 import make, run
from tests.harness import oracle

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "mamba3_operand_precision.py"
_spec = importlib.util.spec_from_file_location("mamba3_operand_precision", _PATH)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def test_halves_hold_the_rule_and_rounded_operands_lose_accuracy():
    arrays, seg = make(0, 1, 70, 2, 16, 1, 32, 8, 0, "bfloat16", segments=True)

    def runner(name, a, **_):
        return run(name, a, seg, None if name == "reference" else 64)

    want, same = oracle(runner, arrays), runner("reference", arrays)
    original = script.layer.kernel_core
    ratios = {}
    for label in ("halves", "all"):
        rounded = script.VARIANTS[label]
        script.layer.kernel_core = lambda _layout, rounded=rounded, **kw: original(
            script.emulated_layout(rounded), **kw
        )
        try:
            with axkern.use(interpret=True):
                got = runner("pallas_gpu", arrays)
        finally:
            script.layer.kernel_core = original
        ratios[label] = [script.ratios(got[i], same[i], want[i], "bfloat16") for i in (0, 1)]
    assert max(ratios["halves"]) <= 1.0, ratios
    assert ratios["all"][1] > ratios["halves"][1], ratios
