"""What the TPU tests share: where they run, the sizes of their cases, and the oracle rule with
each case's oracle computed once for every implementation.

On the chip (`AXKERN_TEST_TPU=1` on a TPU machine) the implementations run compiled at real
sizes, default block sizes, and the oracle is `reference` on float32 copies of the inputs on the
chip at full float32 precision (DESIGN.md's second oracle: float64 on the host would take too long
at these sizes). The rule's bound comes from `reference` in the case's own dtype at the chip's
default precision. `AXKERN_TEST_TPU=interpret` runs the same tests on a CPU, the Pallas TPU
kernels in interpret mode, at cut-down sizes: a check of the tests themselves, not of the chip.

Where `AXKERN_TEST_TPU_RECORD` names a file, each check appends one JSON line to it: the case, the
implementation, and per output and gradient the largest error, the bound and whether it held.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from axkern.core import backend
from tests.harness import oracle
from tests.helpers import ATOL, assert_oracle_rule

ON_TPU = jax.default_backend() == "tpu"
DRY_RUN = not ON_TPU


def sizes(chip, dry):
    """`chip` on the TPU, `dry` on a dry run."""
    return dry if DRY_RUN else chip


_EXPECTED: dict = {}


def _margins(got, same, want, dtype: str) -> list[dict]:
    """Per leaf: the largest error against the oracle, the rule's bound, and whether it held."""
    out = []
    for g, r, o in zip(jax.tree.leaves(got), jax.tree.leaves(same), jax.tree.leaves(want), strict=True):
        g, r, o = (np.asarray(v, np.float64) for v in (g, r, o))
        if g.shape != o.shape:
            out.append({"shape": list(g.shape), "oracle_shape": list(o.shape), "held": False})
            continue
        scale = max(float(np.abs(o).max(initial=0.0)), 1e-30)
        err = float(np.abs(g - o).max(initial=0.0)) if not np.isnan(g).any() else float("nan")
        bound = 2 * float(np.abs(r - o).max(initial=0.0)) + ATOL[dtype] * scale
        out.append({"error": err, "bound": bound, "held": bool(err <= bound)})
    return out


def _record(what: str, impl: str, dtype: str, got, same, want) -> None:
    path = os.environ.get("AXKERN_TEST_TPU_RECORD")
    if not path:
        return
    row = {
        "case": what,
        "implementation": impl,
        "dtype": dtype,
        "device": backend.device_key(),
        "outputs": _margins(got[0], same[0], want[0], dtype),
        "gradients": _margins(got[1], same[1], want[1], dtype),
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def check(run, impl: str, arrays: dict, dtype: str, what: str, **kw):
    """DESIGN.md's rule for `impl`'s outputs and gradients on one case (`run(name, arrays, **kw)
    -> (outputs, gradients)`, as tests/harness.py's runners); the oracle and the same-dtype
    reference are computed once per `what`, which names the case (not the implementation)."""
    if what not in _EXPECTED:
        want = oracle(run, arrays, dtype="float32", **kw)
        same = jax.tree.map(np.asarray, run("reference", arrays, **kw))
        _EXPECTED[what] = want, same
    want, same = _EXPECTED[what]
    got = jax.tree.map(np.asarray, run(impl, arrays, **kw))
    _record(what, impl, dtype, got, same, want)
    assert_oracle_rule(got[0], same[0], want[0], dtype, f"{what} {impl} {dtype} outputs")
    assert_oracle_rule(got[1], same[1], want[1], dtype, f"{what} {impl} {dtype} gradients")
    return got


def assert_compiled_first_that_serves(decision) -> None:
    """On the chip, the dispatcher's pick (`axkern.explain` of a call naming no implementation)
    runs compiled and is the first of the op's TPU order that serves the call: every one before
    it was passed over with its reason. Nothing to check on a dry run (the CPU's order)."""
    if DRY_RUN:
        return
    from axkern.core.op import get_op

    order = get_op(decision.op).default_order["tpu"]
    order = order(decision.spec) if callable(order) else order
    assert decision.implementation in order and not decision.interpret, decision
    passed_over = {r.implementation for r in decision.rejected}
    assert set(order[: order.index(decision.implementation)]) <= passed_over, decision


def case_id(value) -> str:
    """A test id: a case's fields joined by `-`."""
    if isinstance(value, tuple | list):
        return "-".join(case_id(v) for v in value)
    if isinstance(value, dict):
        return "-".join(f"{k}={v}" for k, v in value.items()) or "plain"
    return str(value)
