"""Control flow around kernels: a conditional whose branches keep their layouts to themselves.

XLA's GPU layout assignment gives a conditional's operands and results the layouts its branches
prefer. Where one branch transposes an input for its kernel (the Pallas Triton attention reads
`[B, H, S, D]`, its caller holds `[B, S, H, D]`), the transpose becomes a bitcast inside that
branch and a physical copy outside the conditional, which then runs whichever branch is taken:
the rarely taken branch's layout work is paid on every call. `flat_cond` passes every array
into and out of the conditional as a 1-D array, which has one layout only, so each branch's
copies stay inside it. Flattening an array of the default layout is a bitcast (no copy), on
one device or on a device's own block (`arrays_are_local`); an array `jit` may have sharded
along an inner axis would be gathered, so there `flat_cond` is a plain `lax.cond`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["arrays_are_local", "flat_cond"]


def arrays_are_local() -> bool:
    """Whether reshaping an array here moves nothing between devices: one device in the process,
    or inside `shard_map` over every axis of its mesh (each array is one device's block).
    Elsewhere, on several devices, `jit` may have sharded an array along any of its axes, and
    flattening it would gather it (or, with explicit sharding, fail)."""
    if jax.device_count() == 1:
        return True
    mesh = jax.sharding.get_abstract_mesh()
    names = set(getattr(mesh, "axis_names", ()))
    return bool(names) and names <= set(getattr(mesh, "manual_axes", ()))


def flat_cond(pred, true_fn, false_fn, *operands, flatten=None):
    """`lax.cond(pred, true_fn, false_fn, *operands)` with each array leaf of `operands`, of the
    floating-point arrays the branches close over as traced values and of the branches' results
    crossing the conditional 1-D (module docstring), where `flatten` (default:
    `arrays_are_local()`); a plain `lax.cond` otherwise. Both branches must return the same
    structure of shapes and dtypes, as for `lax.cond`. Under `grad` of the conditional itself
    (rather than inside a `custom_vjp`'s rules, as the attention guard calls it), the residuals
    JAX's linearisation passes between the two halves cross in their own shapes."""
    if flatten is None:
        flatten = arrays_are_local()
    if not flatten:
        return lax.cond(pred, true_fn, false_fn, *operands)
    # the closed-over arrays become operands (a closed-over array would cross in its own shape);
    # integer and boolean ones stay closed over (`jax.closure_convert` hoists inexact ones only)
    (true_fn, true_consts), (false_fn, false_consts) = (
        jax.closure_convert(fn, *operands) for fn in (true_fn, false_fn)
    )
    leaves, tree = jax.tree.flatten((operands, true_consts, false_consts))
    shapes = [jnp.shape(x) for x in leaves]
    results = []

    def branch(fn, which):
        def flat_fn(*flat):
            args, *consts = jax.tree.unflatten(
                tree, [x.reshape(s) for x, s in zip(flat, shapes, strict=True)]
            )
            out_leaves, out_tree = jax.tree.flatten(fn(*args, *consts[which]))
            results.append((out_tree, [(jnp.shape(x), jnp.result_type(x)) for x in out_leaves]))
            return [jnp.ravel(x) for x in out_leaves]

        return flat_fn

    # the barriers (one a leaf: a barrier over several would give them all the union of their
    # varying mesh axes inside `shard_map`) keep XLA from moving the flattening into the
    # branches, and the results' reshapes into them, which would hand the branches' layouts
    # back to the conditional
    flat_in = [lax.optimization_barrier(jnp.ravel(x)) for x in leaves]
    flat_out = lax.cond(pred, branch(true_fn, 0), branch(false_fn, 1), *flat_in)
    (out_tree, out_types), *others = results
    for other in others:  # 1-D, branches of different shapes could still agree: say so as lax.cond would
        if other != (out_tree, out_types):
            raise TypeError(
                f"flat_cond: the branches give different results: {out_tree} {out_types} and "
                f"{other[0]} {other[1]}"
            )
    out = [lax.optimization_barrier(x).reshape(s) for x, (s, _) in zip(flat_out, out_types, strict=True)]
    return jax.tree.unflatten(out_tree, out)
