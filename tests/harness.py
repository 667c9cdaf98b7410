"""The one check every op test applies (DESIGN.md's rule), and the implementation lists it runs over.

`check_rule(run, impl, arrays, dtype, what, **kw)` takes an op's case runner,
`run(name, arrays, **kw) -> (outputs, gradients)`, and evaluates it three times: the oracle
(`reference` on float64 copies of the inputs, on the CPU), the reference in the inputs' own
dtype at the platform's default matmul precision (the one the implementations get: full
float32 on a CPU, TF32 for float32 products on a GPU), and `impl`. Outputs and gradients must satisfy
`|impl - oracle| <= 2 * |reference - oracle| + atol` leaf by leaf; NaN never passes.
`check_rules` does the same for several implementations on one case.

`implementations(op, platform)` lists an op's implementations compiled on a platform (the GPU
tests); `implementations_here(op)` those that run on this machine, compiled or in interpret
mode (the non-finite tests); `serving(impl)` skips a case that `impl` cannot serve, with the
dispatcher's reason.

Where float64 on the CPU would take too long (a GPU test at a real model's sizes),
`oracle_dtype="float32"` takes DESIGN.md's other oracle: `reference` on float32 copies of the
inputs on the default device, float32 products at full precision.
"""

from __future__ import annotations

import contextlib

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern.core.op import Unsupported
from tests.helpers import assert_oracle_rule, to64, x64

# On a GPU (`AXKERN_TEST_GPU=1`) the implementations run compiled; elsewhere the Pallas kernels
# run in interpret mode.
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU

# On the CPU a case's time goes to compiling it (the cases are small), most of that to LLVM's
# optimisation passes; the rule compares values, which do not need them
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def jit(fn, **kw):
    """`jax.jit` for case runners: compiled for the CPU without LLVM's optimisation passes."""
    return jax.jit(fn, compiler_options=FAST_COMPILE if jax.default_backend() == "cpu" else None, **kw)


def _to32(a):
    return a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a


def oracle(run, arrays: dict, *, dtype: str = "float64", **kw):
    """`run("reference", ...)` on float64 copies of `arrays` on the CPU, or (`dtype="float32"`)
    on float32 copies on the default device at full precision; as NumPy arrays. On an
    accelerator the float64 oracle still runs on the host: the copies, and the arrays `kw` holds
    (e.g. a mask's segment ids), are put on the CPU device."""
    if dtype == "float32":
        with jax.default_matmul_precision("highest"):
            return jax.tree.map(np.asarray, run("reference", {k: _to32(v) for k, v in arrays.items()}, **kw))
    if dtype != "float64":
        raise ValueError(f"oracle dtype must be 'float64' or 'float32', got {dtype!r}")
    cpu = jax.devices("cpu")[0]
    with x64(), jax.default_device(cpu):
        copies = jax.device_put({k: to64(v) for k, v in arrays.items()}, cpu)
        kw = jax.tree.map(lambda a: jax.device_put(a, cpu) if isinstance(a, jax.Array) else a, kw)
        return jax.tree.map(np.asarray, run("reference", copies, **kw))


def check_rules(
    run,
    impls,
    arrays: dict,
    dtype: str,
    what: str,
    *,
    interpret: bool = False,
    oracle_dtype: str = "float64",
    **kw,
) -> dict:
    """Apply the rule to each of `impls` on one case (the oracle and the same-dtype reference
    evaluated once for all); returns what each computed, by name."""
    want = oracle(run, arrays, dtype=oracle_dtype, **kw)
    same = run("reference", arrays, **kw)
    got = {}
    for impl in impls:
        with axkern.use(interpret=True) if interpret else contextlib.nullcontext():
            got[impl] = run(impl, arrays, **kw)
        assert_oracle_rule(got[impl][0], same[0], want[0], dtype, f"{what} {impl} {dtype} outputs")
        assert_oracle_rule(got[impl][1], same[1], want[1], dtype, f"{what} {impl} {dtype} gradients")
    return got


def check_rule(run, impl: str, arrays: dict, dtype: str, what: str, **kw):
    """Apply the rule to `impl`'s outputs and gradients; returns what `impl` computed."""
    return check_rules(run, [impl], arrays, dtype, what, **kw)[impl]


def implementations(
    op: str, platform: str, *, blocked_only: bool = False, interpret: bool = False
) -> list[str]:
    """The implementations of `op` (from the registry) that run compiled on `platform`, the
    reference aside; `interpret`: and the Pallas kernels, which run anywhere in interpret mode;
    `blocked_only`: those with block sizes."""
    impls = axkern.core.op.get_op(op).implementations
    return [
        name
        for name, impl in impls.items()
        if name != "reference"
        and (platform in impl.platforms or (interpret and impl.interpretable))
        and (impl.block_sizes or not blocked_only)
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
