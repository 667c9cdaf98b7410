"""The one check every op test applies (DESIGN.md's rule), and the implementation lists it runs over.

`check_rule(run, impl, arrays, dtype, what, **kw)` takes an op's case runner,
`run(name, arrays, **kw) -> (outputs, gradients)`, and evaluates it three times: the oracle
(`reference` on float64 copies of the inputs, on the CPU), the reference in the inputs' own
dtype (float32 products at full precision), and `impl`. Outputs and gradients must satisfy
`|impl - oracle| <= 2 * |reference - oracle| + atol` leaf by leaf; NaN never passes.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

import axkern
from tests.helpers import assert_oracle_rule, to64, x64


def oracle(run, arrays: dict, **kw):
    """`run("reference", ...)` on float64 copies of `arrays` on the CPU, as NumPy arrays."""
    with x64(), jax.default_device(jax.devices("cpu")[0]):
        return jax.tree.map(np.asarray, run("reference", {k: to64(v) for k, v in arrays.items()}, **kw))


def check_rule(run, impl: str, arrays: dict, dtype: str, what: str, *, interpret: bool = False, **kw):
    """Apply the rule to `impl`'s outputs and gradients; returns what `impl` computed."""
    want = oracle(run, arrays, **kw)
    with jax.default_matmul_precision("highest"):
        same = run("reference", arrays, **kw)
    with axkern.use(interpret=True) if interpret else contextlib.nullcontext():
        got = run(impl, arrays, **kw)
    assert_oracle_rule(got[0], same[0], want[0], dtype, f"{what} {impl} {dtype} outputs")
    assert_oracle_rule(got[1], same[1], want[1], dtype, f"{what} {impl} {dtype} gradients")
    return got


def implementations(op: str, platform: str, *, blocked_only: bool = False) -> list[str]:
    """The implementations of `op` (from the registry) that run compiled on `platform`, the
    reference aside; `blocked_only`: those with block sizes."""
    impls = axkern.core.op.get_op(op).implementations
    return [
        name
        for name, impl in impls.items()
        if name != "reference" and platform in impl.platforms and (impl.block_sizes or not blocked_only)
    ]
