"""Control flow around kernels: a conditional whose branches keep their layouts to themselves.

XLA's GPU layout assignment gives a conditional's operands and results the layouts its branches
prefer. Where one branch transposes an input for its kernel (the Pallas Triton attention reads
`[B, H, S, D]`, its caller holds `[B, S, H, D]`), the transpose becomes a bitcast inside that
branch and a physical copy outside the conditional, which then runs whichever branch is taken:
the rarely taken branch's layout work is paid on every call. `flat_cond` passes every array
into and out of the conditional as a 1-D array, which has one layout only, so each branch's
copies stay inside it. Flattening an array of the default layout is a bitcast (no copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["flat_cond"]


def flat_cond(pred, true_fn, false_fn, *operands):
    """`lax.cond(pred, true_fn, false_fn, *operands)` with each array leaf of `operands`, of the
    floating-point arrays the branches close over and of the branches' results crossing the
    conditional 1-D (module docstring). Both branches must return the same structure of shapes
    and dtypes, as for `lax.cond`."""
    # the closed-over arrays become operands (a closed-over array would cross in its own shape);
    # integer and boolean ones stay closed over (`jax.closure_convert` hoists inexact ones only)
    (true_fn, true_consts), (false_fn, false_consts) = (
        jax.closure_convert(fn, *operands) for fn in (true_fn, false_fn)
    )
    leaves, tree = jax.tree.flatten((operands, true_consts, false_consts))
    shapes = [jnp.shape(x) for x in leaves]
    results = {}

    def branch(fn, which):
        def flat_fn(*flat):
            args, *consts = jax.tree.unflatten(
                tree, [x.reshape(s) for x, s in zip(flat, shapes, strict=True)]
            )
            out_leaves, out_tree = jax.tree.flatten(fn(*args, *consts[which]))
            results.setdefault("tree", out_tree)
            results.setdefault("shapes", [jnp.shape(x) for x in out_leaves])
            return [jnp.ravel(x) for x in out_leaves]

        return flat_fn

    # the barriers keep XLA from moving the flattening into the branches (and the results'
    # reshapes into them), which would hand the branches' layouts back to the conditional
    flat_in = lax.optimization_barrier([jnp.ravel(x) for x in leaves])
    flat_out = lax.cond(pred, branch(true_fn, 0), branch(false_fn, 1), *flat_in)
    out = [x.reshape(s) for x, s in zip(lax.optimization_barrier(flat_out), results["shapes"], strict=True)]
    return jax.tree.unflatten(results["tree"], out)
