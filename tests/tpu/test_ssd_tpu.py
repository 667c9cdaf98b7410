"""ssd compiled on a TPU (`pallas_tpu`, then `xla`) against the oracle rule, at a Mamba-2 layer's
sizes cut down in batch and length, default chunk sizes; values and every gradient, with D, z,
dt_bias and an initial state (the final state too).

Run with `AXKERN_TEST_TPU=1 python -m pytest tests/tpu` on a TPU machine (tests/tpu/chip.py: the
oracle, the dry run on a CPU).
"""

from __future__ import annotations

import pytest

import axkern
from axkern.positional import ssd
from tests.cases.ssd import make, run
from tests.harness import implementations
from tests.tpu.chip import DRY_RUN, assert_compiled_first_that_serves, case_id, check, sizes

pytestmark = pytest.mark.tpu

# (b, l, h, p, g, n, dtype, segments): the 2.7B layer's head and state dims with packed
# documents; two groups of state 64 in float32; a length that is no multiple of a chunk
CASES = sizes(
    [
        (2, 1024, 8, 64, 1, 128, "bfloat16", True),
        (2, 1024, 8, 64, 2, 64, "float32", True),
        (1, 1500, 4, 64, 1, 128, "bfloat16", False),
    ],
    [(1, 100, 2, 16, 1, 16, "bfloat16", True), (1, 64, 2, 16, 2, 16, "float32", False)],
)


@pytest.mark.parametrize(
    "case,impl", [(c, i) for c in CASES for i in sorted(implementations("ssd", "tpu"))], ids=case_id
)
def test_against_oracle(case, impl):
    *dims, dtype, segments = case
    arrays, seg = make(0, *dims, dtype, segments=segments)
    check(lambda name, a: run(name, a, seg), impl, arrays, dtype, f"ssd {case_id(case)}")


def test_pallas_tpu_runs_compiled_and_the_default_is_the_first_that_serves():
    arrays, seg = make(0, *sizes((2, 1024, 8, 64, 1, 128), (1, 64, 2, 16, 1, 16)), "bfloat16")

    def f(a, s, **kw):
        return ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], segment_ids=s, **kw)

    d = axkern.explain(lambda a, s: f(a, s, implementation="pallas_tpu"), arrays, seg)
    assert d.implementation == "pallas_tpu" and d.interpret == DRY_RUN, d
    assert_compiled_first_that_serves(axkern.explain(f, arrays, seg))
