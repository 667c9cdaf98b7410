"""The TPU tests' oracle (tests/tpu/chip.py), on the CPU in CI (no chip needed): a float32 case's
oracle is float64 on the host, so its bound holds the float32 reference's own error and not atol
alone; a bf16 case keeps the float32 oracle unless it asks for float64 (sinks)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from axkern import masks
from tests.cases.attention import inputs, run
from tests.helpers import ATOL
from tests.tpu import chip


@pytest.fixture
def oracles(monkeypatch):
    """The dtypes `chip.check` asks `tests.harness.oracle` for, in call order (no record kept
    unless a test names its file)."""
    monkeypatch.delenv("AXKERN_TEST_TPU_RECORD", raising=False)
    asked = []
    real = chip.oracle

    def spy(*args, dtype, **kw):
        asked.append(dtype)
        return real(*args, dtype=dtype, **kw)

    monkeypatch.setattr(chip, "oracle", spy)
    return asked


def test_a_float32_case_takes_the_float64_oracle_and_a_bound_beyond_atol(oracles, monkeypatch, tmp_path):
    record = tmp_path / "records.jsonl"
    monkeypatch.setenv("AXKERN_TEST_TPU_RECORD", str(record))
    arrays = inputs(3, 1, 24, 24, 2, 1, 16, "float32")
    ids = np.repeat(np.arange(24) // 10, 1)[None].astype(np.int32)
    kw = dict(mask=masks.Causal() & masks.Segments(ids, ids), blocks=(8, 8), sinks=True, cap=20.0)
    chip.check(run, "reference", arrays, "float32", "chip test: float32 attention", **kw)
    assert oracles == ["float64"]
    (row,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert row["oracle"] == "float64"
    leaves = row["outputs"] + row["gradients"]
    assert len(leaves) == 5 and all(leaf["held"] for leaf in leaves)  # out, dq, dk, dv, dsinks
    for leaf in leaves:  # the float32 reference differs from the float64 oracle: the bound is more than atol
        assert leaf["reference_error"] > 0, leaf
        assert leaf["bound"] > ATOL["float32"] * leaf["scale"], leaf


def test_a_bf16_case_keeps_the_float32_oracle_unless_asked(oracles):
    arrays = inputs(4, 1, 16, 16, 2, 1, 8, "bfloat16")
    kw = dict(mask=masks.Causal(), blocks=(8, 8), cap=None)
    chip.check(run, "reference", arrays, "bfloat16", "chip test: bf16 attention", sinks=False, **kw)
    chip.check(
        run,
        "reference",
        arrays,
        "bfloat16",
        "chip test: bf16 sinks",
        oracle_dtype="float64",
        sinks=True,
        **kw,
    )
    assert oracles == ["float32", "float64"]
    assert chip.oracle_dtype_for("float32") == "float64" and chip.oracle_dtype_for("bfloat16") == "float32"


def test_the_bf16_weights_are_cos_rounded_to_bf16():
    import jax.numpy as jnp

    from tests.cases.attention import weights

    w = np.asarray(weights((4, 300, 3), jnp.cos, "bfloat16"))
    assert w.dtype == np.float32 and w.shape == (4, 300, 3)
    assert (np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32) == w).all()  # bf16 holds them
    exact = np.cos(np.arange(w.size, dtype=np.float64)).reshape(w.shape)
    assert np.max(np.abs(w - exact)) <= 2.0**-9  # cos rounded to bf16, no more
    assert np.max(np.abs(np.asarray(weights((4, 300, 3), jnp.cos, "float32")) - exact)) < 1e-5
