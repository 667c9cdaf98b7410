"""ssd compiled on a TPU (`pallas_tpu`; `xla` on one case) against the oracle rule, at a Mamba-2 layer's
sizes cut down in batch and length, default chunk sizes; values and every gradient, with D, z,
dt_bias and an initial state (the final state too); the float64 oracle on the host.

Run with `AXKERN_TEST_TPU=1 python -m pytest tests/tpu` on a TPU machine (tests/tpu/chip.py: the
oracle, the dry run on a CPU).
"""

from __future__ import annotations

import pytest

import axkern
from axkern.core.blocks import next_power_of_2
from axkern.ops.ssd.blocks import SSDBlockSizes
from axkern.positional import ssd
from tests.cases.ssd import make, run
from tests.tpu.chip import DRY_RUN, assert_compiled_first_that_serves, case_id, check, sizes

pytestmark = pytest.mark.tpu

# (b, l, h, p, g, n, dtype, segments): the 2.7B layer's head and state dims with packed
# documents; float32 (the float64 oracle on the host) with two groups of state 64 over a length
# that is no multiple of a chunk, without segment ids
CASES = sizes(
    [
        (2, 1024, 8, 64, 1, 128, "bfloat16", True),
        (2, 1000, 8, 64, 2, 64, "float32", False),
    ],
    [(1, 100, 2, 16, 1, 16, "bfloat16", True), (1, 64, 2, 16, 2, 16, "float32", False)],
)
# xla on a TPU: the layer's bf16 case


@pytest.mark.parametrize("case,impl", [(c, "pallas_tpu") for c in CASES] + [(CASES[0], "xla")], ids=case_id)
def test_against_oracle(case, impl):
    *dims, dtype, segments = case
    arrays, seg = make(0, *dims, dtype, segments=segments)
    # float64 on the host for every case: the bf16 cases' A, D, dt_bias and initial state are
    # float32 parameters
    run_ = lambda name, a: run(name, a, seg)  # noqa: E731
    check(run_, impl, arrays, dtype, f"ssd {case_id(case)}", oracle_dtype="float64")


def test_per_head_group_sums_against_oracle():
    # `group_sums="xla"` (`TpuHeadsLayout`: the grid's chunks innermost, dB and dC per head for
    # XLA's sum) on the float32 case with two groups; the chunk the heuristic's
    *dims, dtype, segments = CASES[1]
    arrays, seg = make(0, *dims, dtype, segments=segments)
    blocks = SSDBlockSizes(min(128, next_power_of_2(dims[1])), group_sums="xla")
    run_ = lambda name, a: run(name, a, seg, block_sizes=blocks if name != "reference" else None)  # noqa: E731
    check(
        run_, "pallas_tpu", arrays, dtype, f"ssd {case_id(CASES[1])} group_sums=xla", oracle_dtype="float64"
    )


@pytest.mark.parametrize(
    "blocks",
    [SSDBlockSizes(128, transposes="kernels"), SSDBlockSizes(256, group_sums="kernels", transposes="xla")],
    ids=["lanes-128", "rows-256"],
)
def test_positions_on_the_lanes_and_the_rows_against_oracle(blocks):
    # the default lays x, y, dx, dy out [b, H, P, L] (`transposes="kernels"`, each tile transposed
    # in the kernels) at chunks of 256 here: that form at chunks of 128, and `[b, H, L, P]` at 256,
    # on the bf16 case with segments
    *dims, dtype, segments = CASES[0]
    arrays, seg = make(0, *dims, dtype, segments=segments)
    run_ = lambda name, a: run(name, a, seg, block_sizes=blocks if name != "reference" else None)  # noqa: E731
    check(
        run_,
        "pallas_tpu",
        arrays,
        dtype,
        f"ssd {case_id(CASES[0])} chunk={blocks.chunk_size} transposes={blocks.transposes}",
        oracle_dtype="float64",
    )


def test_pallas_tpu_runs_compiled_and_the_default_is_the_first_that_serves():
    arrays, seg = make(0, *sizes((2, 1024, 8, 64, 1, 128), (1, 64, 2, 16, 1, 16)), "bfloat16")

    def f(a, s, **kw):
        return ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], segment_ids=s, **kw)

    d = axkern.explain(lambda a, s: f(a, s, implementation="pallas_tpu"), arrays, seg)
    assert d.implementation == "pallas_tpu" and d.interpret == DRY_RUN, d
    assert_compiled_first_that_serves(axkern.explain(f, arrays, seg))
