"""mamba3's Pallas TPU kernels compiled on a TPU against the oracle rule, SISO and MIMO, at a
Mamba-3 layer's sizes cut down in batch, length and heads, default chunk sizes; values and every
gradient, with D, z and the initial states (the final states too); the float64 oracle on the host.

Run with `AXKERN_TEST_TPU=1 python -m pytest tests/tpu` on a TPU machine (tests/tpu/chip.py: the
oracle, the dry run on a CPU).
"""

from __future__ import annotations

import pytest

import axkern
from axkern.ops.mamba3.blocks import Mamba3BlockSizes, kernel_slots
from tests.cases.mamba3 import call, make, run
from tests.tpu.chip import DRY_RUN, assert_compiled_first_that_serves, case_id, check, sizes

pytestmark = pytest.mark.tpu

# (b, l, h, p, g, n, angles, rank, dtype): SISO at the 2.7B layer's head and state dims in bf16;
# MIMO of rank 2 in float32 (the float64 oracle on the host) and in bf16 over a length that is no
# multiple of a chunk
CASES = sizes(
    [
        (2, 512, 8, 64, 1, 128, 32, 0, "bfloat16"),
        (2, 300, 4, 32, 2, 64, 16, 2, "float32"),
        (1, 700, 8, 64, 1, 128, 32, 2, "bfloat16"),
    ],
    [(1, 100, 2, 16, 1, 16, 4, 0, "bfloat16"), (1, 40, 2, 16, 2, 16, 4, 2, "float32")],
)


@pytest.mark.parametrize("case,impl", [(c, "pallas_tpu") for c in CASES], ids=case_id)
def test_against_oracle(case, impl):
    *dims, rank, dtype = case
    arrays, seg = make(0, *dims, rank, dtype, segments=True)
    what = f"mamba3 {'MIMO' if rank else 'SISO'} {case_id(case)}"
    # float64 on the host for every case: the bf16 cases' per-position scalars, angles, biases,
    # weights and states are float32 and get gradients too
    check(lambda name, a: run(name, a, seg), impl, arrays, dtype, what, oracle_dtype="float64")


@pytest.mark.parametrize("case", [CASES[0], CASES[-1]], ids=case_id)
def test_positions_on_the_rows_against_oracle(case):
    # the default lays v, y and their gradients out [b, H, P, L] (`transposes="kernels"`) where it
    # serves: the other form, [b, H, L, P], at the same chunks of 256 positions, SISO and MIMO
    *dims, rank, dtype = case
    arrays, seg = make(0, *dims, rank, dtype, segments=True)
    blocks = Mamba3BlockSizes(256 // kernel_slots(rank), transposes="xla")
    run_ = lambda name, a: run(name, a, seg, blocks if name != "reference" else None)  # noqa: E731
    what = f"mamba3 {'MIMO' if rank else 'SISO'} {case_id(case)} transposes=xla"
    check(run_, "pallas_tpu", arrays, dtype, what, oracle_dtype="float64")


def test_q_and_k_turned_in_the_kernels_against_oracle():
    # `rotation="kernel"` (SISO): every kernel forms its rotated q, k tiles from the unrotated
    # values per group, the biases and the angles; on the lanes, chunks of 256, all 32 angles
    dims = sizes((2, 512, 8, 64, 1, 128, 32), (1, 100, 2, 16, 1, 16, 8))
    arrays, seg = make(0, *dims, 0, "bfloat16", segments=True)
    blocks = Mamba3BlockSizes(256, transposes="kernels", rotation="kernel")
    run_ = lambda name, a: run(name, a, seg, blocks if name != "reference" else None)  # noqa: E731
    what = f"mamba3 SISO {case_id((*dims, 0, 'bfloat16'))} rotation=kernel"
    check(run_, "pallas_tpu", arrays, "bfloat16", what, oracle_dtype="float64")


@pytest.mark.parametrize("rank", [0, 2])
def test_pallas_tpu_runs_compiled_and_the_default_is_the_first_that_serves(rank):
    dims = sizes((2, 512, 8, 64, 1, 128, 32), (1, 64, 2, 16, 1, 16, 4))
    arrays, seg = make(0, *dims, rank, "bfloat16")
    d = axkern.explain(lambda a, s: call("pallas_tpu", a, s), arrays, seg)
    assert d.implementation == "pallas_tpu" and d.interpret == DRY_RUN, d
    assert_compiled_first_that_serves(axkern.explain(lambda a, s: call(None, a, s), arrays, seg))
