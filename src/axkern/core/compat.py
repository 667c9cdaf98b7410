"""Version shims for JAX and haliax APIs that move between releases. Keep them all here."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax

__all__ = [
    "shard_map",
    "current_mesh",
    "axis_size",
    "axis_index",
    "match_vma",
    "jit_context",
    "mosaic_gpu_load",
    "ffi_result_avals",
]


def _haliax_einsum_on_new_jax() -> None:
    """haliax 1.4.dev453's einsum (under `hax.dot`) calls `jax.core.is_constant_dim`, which jax
    0.11 removed from the public module; put JAX's own function back where haliax looks."""
    import warnings

    import jax.core

    with warnings.catch_warnings():  # jax 0.10 still has it, deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        if hasattr(jax.core, "is_constant_dim"):
            return
    from jax._src import core as _core

    fn = getattr(_core, "is_constant_dim", None)
    if fn is None:  # pragma: no cover - a JAX without it: every dim of a concrete shape is an int
        fn = lambda d: isinstance(d, int)  # noqa: E731
    jax.core.is_constant_dim = fn


_haliax_einsum_on_new_jax()


def jit_context(default=None):
    """A context whose value is part of `jax.jit`'s cache key (`jax.make_user_context`, jax >=
    0.8): a jitted function called under another value is traced again. `None` where JAX has
    no such context."""
    make = getattr(jax, "make_user_context", None)
    return make(default) if make is not None else None


def shard_map(f, *, mesh, in_specs, out_specs, check: bool = True):
    """`jax.shard_map` (jax >= 0.6) or `jax.experimental.shard_map.shard_map` before it."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as _sm  # pragma: no cover - old jax

    return _sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def no_mesh():
    """A context outside any mesh the caller runs in (`jax.sharding.use_abstract_mesh` with an
    empty mesh), for eager constants computed while tracing: inside `shard_map` the context's
    abstract mesh has manual axes, whose shardings eager operations would take."""
    use = getattr(jax.sharding, "use_abstract_mesh", None)
    try:
        return use(jax.sharding.AbstractMesh((), ()))
    except (TypeError, ValueError, AttributeError):  # pragma: no cover - a jax without this context
        return contextlib.nullcontext()


def current_mesh() -> Any | None:
    """The mesh haliax would shard with here (`jax.set_mesh`, `hax.partitioning.set_mesh`, `with mesh:`)."""
    try:
        from haliax.partitioning import _resolve_mesh
    except ImportError:  # pragma: no cover - other haliax
        _resolve_mesh = None
    if _resolve_mesh is not None:
        mesh = _resolve_mesh()
    else:  # pragma: no cover
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False):
        return None
    return mesh


def axis_size(mesh, names: str | tuple[str, ...]) -> int:
    names = (names,) if isinstance(names, str) else tuple(names)
    size = 1
    for n in names:
        size *= mesh.shape[n]
    return size


def axis_index(names: str | tuple[str, ...]):
    """Linear index of this shard along one mesh axis or a tuple of them (row-major)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    idx = jax.lax.axis_index(names[0])
    for n in names[1:]:
        idx = idx * jax.lax.psum(1, n) + jax.lax.axis_index(n)
    return idx


def _vma(x) -> frozenset:
    typeof = getattr(jax, "typeof", None) or jax.core.get_aval
    try:
        aval = typeof(x)
    except TypeError:  # not an array
        return frozenset()
    if hasattr(aval, "vma"):  # jax 0.7 - 0.9
        return frozenset(aval.vma)
    mat = getattr(aval, "mat", None)  # jax >= 0.10: manual axis type
    return frozenset(getattr(mat, "varying", ()))


def _to_varying(x, axes: tuple[str, ...]):
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # pragma: no cover - jax before pcast


def vary_like(value, *refs):
    """`value` (a pytree) cast to vary over every manual mesh axis the `refs` vary over: a
    `lax.scan` carry started from a constant must match the carry its body returns."""
    union = frozenset().union(*(_vma(leaf) for r in refs for leaf in jax.tree.leaves(r)))
    if not union:
        return value

    def cast(leaf):
        v = _vma(leaf)
        return leaf if v == union else _to_varying(leaf, tuple(sorted(union - v)))

    return jax.tree.map(cast, value)


def match_vma(*arrays):
    """Make every array vary over the same manual mesh axes (inside `shard_map`), else no-op.

    A `jax.custom_vjp` must return cotangents of its inputs' exact types. Inside `shard_map`
    a replicated weight (varying over no axis) meeting data-parallel activations (varying
    over `data`) would get a varying cotangent: casting the inputs up front makes the types
    agree, and the cast's transpose is the `psum` the weight's gradient needs.
    """
    leaves = [leaf for a in arrays for leaf in jax.tree.leaves(a)]  # arguments may be pytrees (masks)
    union = frozenset().union(*(_vma(leaf) for leaf in leaves))
    if not union:
        return arrays

    def cast(leaf):
        v = _vma(leaf)
        return leaf if v == union else _to_varying(leaf, tuple(sorted(union - v)))

    return tuple(jax.tree.map(cast, a) for a in arrays)


@functools.cache
def _mosaic_load_takes_index() -> bool:
    import inspect

    from jax.experimental.pallas import mosaic_gpu as plgpu

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    return idx is not None and idx.default is inspect.Parameter.empty


def mosaic_gpu_load(ref, *, layout=None, optimized: bool = True):
    """`plgpu.load(ref, layout=..., optimized=...)` of Pallas Mosaic GPU: the whole of `ref` (a
    `.at[...]` view) into registers. jax 0.10 takes an index argument as well (here `()`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if _mosaic_load_takes_index():
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def ffi_result_avals(name: str, avals_in, outs) -> list:
    """A primitive's result avals as `jax.ffi.ffi_call` forms them (the results' sharding from the
    current mesh), varying over the manual mesh axes its inputs vary over (which must agree):
    for a primitive that lowers to an FFI call with attributes of its own."""
    from jax._src import core as _core

    vma = _core.standard_vma_rule(name, *avals_in)
    first = next((a for a in avals_in if hasattr(a, "shape")), None)
    out = []
    for o in outs:
        aval = _core.shaped_abstractify(jax.ShapeDtypeStruct(o.shape, o.dtype)).update(dtype=o.dtype)
        if aval.sharding.mesh.empty:
            aval = aval.update(sharding=_core.get_cur_mesh_sharding())
        if vma and hasattr(first, "manual_axis_type"):  # jax >= 0.10
            aval = aval.update(manual_axis_type=first.manual_axis_type)
        elif vma:  # pragma: no cover - jax 0.7 - 0.9
            aval = aval.update(vma=vma)
        out.append(aval)
    return out
