"""short_conv's Pallas TPU kernel compiled on a TPU against the oracle rule, at real sizes (the float32
case against the float64 oracle on the host: the conv's products are elementwise, so a float32
oracle would be the float32 reference itself).

Run with `AXKERN_TEST_TPU=1 python -m pytest tests/tpu` on a TPU machine (tests/tpu/chip.py: the
oracle, the dry run on a CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern.positional import short_conv as conv
from tests.cases.short_conv import make, run
from tests.tpu.chip import DRY_RUN, assert_compiled_first_that_serves, case_id, check, sizes

pytestmark = pytest.mark.tpu

# (batch, seq, channels, width, dtype, segments, activation): a Mamba layer's conv in bf16 with
# packed documents of every kind; float32 over channels that are no multiple of the default
# channel block; width 2 over a longer sequence; width 8
CASES = sizes(
    [
        (2, 1024, 1024, 4, "bfloat16", "mixed", "silu"),
        (2, 1024, 768, 4, "float32", "mixed", None),
        (2, 2048, 1024, 2, "bfloat16", "none", "silu"),
        (2, 1000, 512, 8, "bfloat16", "mixed", None),
    ],
    [(2, 64, 256, 4, "bfloat16", "mixed", "silu"), (2, 40, 128, 8, "float32", "mixed", None)],
)


@pytest.mark.parametrize("case,impl", [(c, "pallas_tpu") for c in CASES], ids=case_id)
def test_against_oracle(case, impl):
    b, s, c, w, dtype, segments, activation = case
    arrays = make(w, b, s, c, w, dtype, segments=segments)
    check(
        run,
        impl,
        arrays,
        dtype,
        f"short_conv B{b} S{s} C{c} W{w} {dtype} {segments} {activation}",
        activation=activation,
    )


def test_without_state_or_bias():
    arrays = make(
        11, *sizes((2, 1024, 1024), (2, 64, 128)), 4, "bfloat16", segments="mixed", state=False, bias=False
    )
    check(run, "pallas_tpu", arrays, "bfloat16", "short_conv without state or bias", activation="silu")


def test_pallas_tpu_runs_compiled_and_the_default_is_the_first_that_serves():
    x = jax.ShapeDtypeStruct((8, 4096, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 4096), jnp.bfloat16)
    d = axkern.explain(lambda x, w: conv(x, w, activation="silu", implementation="pallas_tpu"), x, w)
    assert d.implementation == "pallas_tpu" and d.interpret == DRY_RUN, d
    assert_compiled_first_that_serves(axkern.explain(lambda x, w: conv(x, w, activation="silu"), x, w))
