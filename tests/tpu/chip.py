"""What the TPU tests share: where they run, the sizes of their cases, and the oracle rule with
each case's oracle computed once for every implementation.

On the chip (`AXKERN_TEST_TPU=1` on a TPU machine) the implementations run compiled at real
sizes, default block sizes. The rule's bound comes from `reference` in the case's own dtype at the
chip's default precision; the oracle must be more precise than that reference:

- float32 cases take DESIGN.md's first oracle, `reference` on float64 copies of the inputs on the
  host's CPU (`tests.harness.oracle`). A float32 oracle on the chip would be the same-dtype
  reference itself wherever the reference's float32 arithmetic does not depend on the matmul
  precision (attention's and short_conv's elementwise products): the bound would shrink to atol.
  Their sizes keep that host computation to seconds.
- bfloat16 cases take `reference` on float32 copies of the inputs on the chip at full float32
  precision (DESIGN.md's second oracle: float64 on the host would take too long at these sizes).
  The bf16 reference computes in float32 and rounds its results to bf16, so the bound holds that
  rounding. A case with float32 parameters, whose gradients the bf16 reference may compute as
  the float32 oracle does (attention's sinks; ssd's and mamba3's float32 inputs), asks for the
  float64 oracle (`oracle_dtype`).

`AXKERN_TEST_TPU=interpret` runs the same tests on a CPU, the Pallas TPU kernels in interpret
mode, at cut-down sizes: a check of the tests themselves, not of the chip.

Where `AXKERN_TEST_TPU_RECORD` names a file, each check appends one JSON line to it: the case, the
implementation, the oracle's dtype, the seconds the oracle, the same-dtype reference and the
implementation took (compiles included), and per output and gradient the largest error, the
same-dtype reference's error, the oracle's largest magnitude, the bound and whether it held.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
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
    """Per leaf: the largest error against the oracle, the same-dtype reference's, the oracle's
    largest magnitude, the rule's bound, and whether it held."""
    out = []
    for g, r, o in zip(jax.tree.leaves(got), jax.tree.leaves(same), jax.tree.leaves(want), strict=True):
        g, r, o = (np.asarray(v, np.float64) for v in (g, r, o))
        if g.shape != o.shape:
            out.append({"shape": list(g.shape), "oracle_shape": list(o.shape), "held": False})
            continue
        scale = max(float(np.abs(o).max(initial=0.0)), 1e-30)
        err = float(np.abs(g - o).max(initial=0.0)) if not np.isnan(g).any() else float("nan")
        ref_err = float(np.abs(r - o).max(initial=0.0))
        bound = 2 * ref_err + ATOL[dtype] * scale
        out.append(
            {
                "error": err,
                "reference_error": ref_err,
                "scale": scale,
                "bound": bound,
                "held": bool(err <= bound),
            }
        )
    return out


def _record(what: str, impl: str, dtype: str, oracle_dtype: str, got, same, want, seconds: dict) -> None:
    path = os.environ.get("AXKERN_TEST_TPU_RECORD")
    if not path:
        return
    row = {
        "case": what,
        "implementation": impl,
        "dtype": dtype,
        "oracle": oracle_dtype,
        "device": backend.device_key(),
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "outputs": _margins(got[0], same[0], want[0], dtype),
        "gradients": _margins(got[1], same[1], want[1], dtype),
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def oracle_dtype_for(dtype: str) -> str:
    """The oracle a case in `dtype` takes by default: float64 on the host for float32 cases,
    float32 on the chip for 16-bit ones."""
    return "float64" if jnp.dtype(dtype).itemsize >= 4 else "float32"


def expected(run, arrays: dict, what: str, *, oracle_dtype: str, **kw):
    """`(oracle, same-dtype reference, seconds)` of the case `what` names, as NumPy arrays,
    computed once (`seconds`: what computing each took, compiles included, where computed now)."""
    seconds = {}
    if what not in _EXPECTED:
        start = time.perf_counter()
        want = oracle(run, arrays, dtype=oracle_dtype, **kw)
        seconds["oracle"] = time.perf_counter() - start
        same = jax.tree.map(np.asarray, run("reference", arrays, **kw))
        seconds["reference"] = time.perf_counter() - start - seconds["oracle"]
        _EXPECTED[what] = want, same, oracle_dtype
    want, same, held_by = _EXPECTED[what]
    if held_by != oracle_dtype:
        raise ValueError(f"{what}: its oracle was computed in {held_by}, asked in {oracle_dtype}")
    return want, same, seconds


def _run_timed(run, impl, arrays, seconds, **kw):
    start = time.perf_counter()
    got = jax.tree.map(np.asarray, run(impl, arrays, **kw))
    seconds["implementation"] = time.perf_counter() - start
    return got


def check(run, impl: str, arrays: dict, dtype: str, what: str, *, oracle_dtype: str | None = None, **kw):
    """DESIGN.md's rule for `impl`'s outputs and gradients on one case (`run(name, arrays, **kw)
    -> (outputs, gradients)`, as tests/harness.py's runners); the oracle (`oracle_dtype`, by
    default `oracle_dtype_for(dtype)`) and the same-dtype reference are computed once per `what`,
    which names the case (not the implementation)."""
    oracle_dtype = oracle_dtype or oracle_dtype_for(dtype)
    want, same, seconds = expected(run, arrays, what, oracle_dtype=oracle_dtype, **kw)
    got = _run_timed(run, impl, arrays, seconds, **kw)
    _record(what, impl, dtype, oracle_dtype, got, same, want, seconds)
    assert_oracle_rule(got[0], same[0], want[0], dtype, f"{what} {impl} {dtype} outputs")
    assert_oracle_rule(got[1], same[1], want[1], dtype, f"{what} {impl} {dtype} gradients")
    return got


def _kinds(a) -> np.ndarray:
    """Per element: 0 finite, 1 NaN, 2 +inf, 3 -inf."""
    a = np.asarray(a, np.float64)
    return np.select([np.isnan(a), a == np.inf, a == -np.inf], [1, 2, 3], 0)


def check_nonfinite(
    run, impl: str, arrays: dict, dtype: str, what: str, *, oracle_dtype: str | None = None, **kw
):
    """A case whose inputs hold a NaN or an infinity: `impl`'s outputs and gradients (and the
    same-dtype reference's) are NaN, +inf and -inf exactly where the oracle's are, and hold the
    rule on the entries the oracle has finite (`check`'s oracle and record)."""
    oracle_dtype = oracle_dtype or oracle_dtype_for(dtype)
    want, same, seconds = expected(run, arrays, what, oracle_dtype=oracle_dtype, **kw)
    got = _run_timed(run, impl, arrays, seconds, **kw)
    for name, tree in (("reference", same), (impl, got)):
        for part, i in ((0, "outputs"), (1, "gradients")):
            leaves = zip(jax.tree.leaves(tree[part]), jax.tree.leaves(want[part]), strict=True)
            for n, (t, w) in enumerate(leaves):
                differ = _kinds(t) != _kinds(w)
                assert not differ.any(), (
                    f"{what} {name} {dtype} {i}[{n}]: not finite as the oracle is at {int(differ.sum())} "
                    f"places (first {np.argwhere(differ)[:3].tolist()})"
                )
    finite = jax.tree.map(lambda w: _kinds(w) == 0, want)
    zeroed = lambda tree: jax.tree.map(lambda t, f: np.where(f, np.asarray(t, np.float64), 0.0), tree, finite)  # noqa: E731
    got0, same0, want0 = zeroed(got), zeroed(same), zeroed(want)
    _record(what, impl, dtype, oracle_dtype, got0, same0, want0, seconds)
    assert_oracle_rule(got0[0], same0[0], want0[0], dtype, f"{what} {impl} {dtype} outputs (finite)")
    assert_oracle_rule(got0[1], same0[1], want0[1], dtype, f"{what} {impl} {dtype} gradients (finite)")
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
