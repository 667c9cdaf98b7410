"""The one check every op test applies (DESIGN.md's rule), and the implementation lists it runs over.

`check_rule(run, impl, arrays, dtype, what, **kw)` takes an op's case runner,
`run(name, arrays, **kw) -> (outputs, gradients)`, and evaluates it three times: the oracle
(`reference` on float64 copies of the inputs, on the CPU), the reference in the inputs' own
dtype (float32 products at full precision), and `impl`. Outputs and gradients must satisfy
`|impl - oracle| <= 2 * |reference - oracle| + atol` leaf by leaf; NaN never passes.

`implementations(op, platform)` lists an op's implementations compiled on a platform (the GPU
tests); `implementations_here(op)` those that run on this machine, compiled or in interpret
mode (the non-finite tests); `serving(impl)` skips a case that `impl` cannot serve, with the
dispatcher's reason.
"""

from __future__ import annotations

import contextlib

import hypothesis
import jax
import numpy as np
import pytest

import axkern
from axkern.core.op import Unsupported
from tests.helpers import assert_oracle_rule, to64, x64

# On a GPU (`AXKERN_TEST_GPU=1`) the implementations run compiled; elsewhere the Pallas kernels
# run in interpret mode.
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


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


def implementations_here(op: str, *, reference: bool = False) -> list[str]:
    """Every implementation of `op` (from the registry) that runs on this machine, in registration
    order: on a GPU those whose platforms include "gpu", compiled; on a CPU those that run on it
    compiled and the Pallas kernels (`interpretable`) in interpret mode (`INTERPRET`);
    `reference`: the oracle too."""
    platform = jax.default_backend()
    return [
        name
        for name, impl in axkern.core.op.get_op(op).implementations.items()
        if (reference or name != "reference")
        and (platform in impl.platforms or (platform == "cpu" and impl.interpretable))
    ]


@contextlib.contextmanager
def serving(impl: str, *, drawn: bool = False):
    """Run a case of `impl`; where the dispatcher refuses it (`supports()` gives a reason for the
    shape, dtype or options, or the kernel raises `Unsupported` for them) the test is skipped
    with that reason, or, for a case a hypothesis test `drawn`, the example is rejected (the
    reason recorded as its event; hypothesis draws another, and fails when none is served).
    A native library that does not build or load is a failure, not a skip: where these tests
    run a `cuda` implementation (a GPU) its library must build."""
    try:
        yield
    except Unsupported as e:
        if "native library" in str(e):  # axkern.core.native.load's reason for a failed build or load
            raise
        reason = f"{impl} cannot serve this case: {e}"
        if drawn:
            hypothesis.event(reason)
            hypothesis.reject()
        pytest.skip(reason)
