"""The one check every op test applies (DESIGN.md's rule), and the implementation lists it runs over.

`check_rule(run, impl, arrays, dtype, what, **kw)` takes an op's case runner,
`run(name, arrays, **kw) -> (outputs, gradients)`, and evaluates it three times: the oracle
(`reference` on float64 copies of the inputs, on the CPU), the reference in the inputs' own
dtype (float32 products at full precision), and `impl`. Outputs and gradients must satisfy
`|impl - oracle| <= 2 * |reference - oracle| + atol` leaf by leaf; NaN never passes.
`check_rules` does the same for several implementations on one case.

Where float64 on the CPU would take too long (a GPU test at a real model's sizes),
`oracle_dtype="float32"` takes DESIGN.md's other oracle: `reference` on float32 copies of the
inputs on the default device, float32 products at full precision.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import axkern
from tests.helpers import assert_oracle_rule, to64, x64

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
    on float32 copies on the default device at full precision; as NumPy arrays."""
    if dtype == "float32":
        with jax.default_matmul_precision("highest"):
            return jax.tree.map(np.asarray, run("reference", {k: _to32(v) for k, v in arrays.items()}, **kw))
    if dtype != "float64":
        raise ValueError(f"oracle dtype must be 'float64' or 'float32', got {dtype!r}")
    with x64(), jax.default_device(jax.devices("cpu")[0]):
        return jax.tree.map(np.asarray, run("reference", {k: to64(v) for k, v in arrays.items()}, **kw))


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
    with jax.default_matmul_precision("highest"):
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
