"""The named layer's plumbing: resolve axes, check them, order and flatten, shard by axis mapping.

Every named function goes through these helpers, so every op reports a missing axis the
same way ("fused_cross_entropy: x has no axis 'embd' (Embed); its axes are (batch, embed)").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import haliax as hax
import jax
from haliax import NamedArray
from haliax.partitioning import current_thread_local_mapping
from jax.sharding import PartitionSpec

from . import compat

__all__ = [
    "require_named",
    "resolve",
    "axes_str",
    "without",
    "ordered",
    "match_axes",
    "flatten",
    "unflatten",
    "mesh_axes_for",
    "shard_by_mapping",
]

AxisSelector = str | hax.Axis


def axes_str(axes: Sequence[hax.Axis]) -> str:
    return "(" + ", ".join(f"{a.name}={a.size}" for a in axes) + ")"


def require_named(op: str, arg: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, NamedArray):
        kind = type(value).__name__
        raise TypeError(
            f"{op}: {arg} must be a haliax NamedArray, got {kind}; wrap it with hax.named(array, axes) "
            f"or call axkern.positional.{op} with plain arrays"
        )


def resolve(op: str, arg: str, array: NamedArray, selector: AxisSelector, role: str) -> hax.Axis:
    """The axis of `array` named by `selector` (a name or an `hax.Axis`), or a `ValueError` naming it."""
    name = selector.name if isinstance(selector, hax.Axis) else selector
    if not isinstance(name, str):
        raise TypeError(f"{op}: {role} must be an axis name or hax.Axis, got {selector!r}")
    for a in array.axes:
        if a.name == name:
            if isinstance(selector, hax.Axis) and selector.size != a.size:
                raise ValueError(f"{op}: {role}={selector} but {arg}'s axis {name!r} has size {a.size}")
            return a
    raise ValueError(f"{op}: {arg} has no axis {name!r} ({role}); its axes are {axes_str(array.axes)}")


def without(array: NamedArray, *names: str) -> tuple[hax.Axis, ...]:
    return tuple(a for a in array.axes if a.name not in names)


def ordered(array: NamedArray, axes: Sequence[hax.Axis]) -> jax.Array:
    """`array`'s data with its axes in the order of `axes` (no transpose when already so)."""
    if tuple(a.name for a in array.axes) == tuple(a.name for a in axes):
        return array.array
    return array.rearrange(tuple(axes)).array


def match_axes(op: str, arg: str, array: NamedArray, axes: Sequence[hax.Axis], ref: str) -> jax.Array:
    """`array` must carry exactly `axes` (any order, same sizes); returns its data in that order."""
    want = {a.name: a.size for a in axes}
    have = {a.name: a.size for a in array.axes}
    if want != have:
        raise ValueError(
            f"{op}: {arg}'s axes {axes_str(array.axes)} must be {ref} {axes_str(axes)} (any order)"
        )
    return ordered(array, axes)


def broadcast_subset(op: str, arg: str, array: NamedArray, axes: Sequence[hax.Axis], ref: str) -> jax.Array:
    """`array` may carry any subset of `axes`; returns its data broadcast to `axes` in that order."""
    names = {a.name: a.size for a in axes}
    extra = [a for a in array.axes if names.get(a.name) != a.size]
    if extra:
        raise ValueError(
            f"{op}: {arg}'s axes {axes_str(array.axes)} must be a subset of {ref} {axes_str(axes)}"
        )
    if len(array.axes) == len(axes):
        return ordered(array, axes)
    return hax.broadcast_to(array, tuple(axes)).array


def flatten(data: jax.Array | None, n_lead: int) -> jax.Array | None:
    """Merge the first `n_lead` dims into one: no reshape when there is exactly one, a new
    leading dim of 1 when there are none. `None` passes through (an absent optional input)."""
    if data is None or n_lead == 1:
        return data
    return data.reshape((math.prod(data.shape[:n_lead]),) + data.shape[n_lead:])


def unflatten(data: jax.Array, lead_shape: tuple[int, ...]) -> jax.Array:
    """Undo `flatten`: split the leading dim into `lead_shape` (drop it when `lead_shape == ()`)."""
    if len(lead_shape) == 1:
        return data
    return data.reshape(lead_shape + data.shape[1:])


def mesh_axes_for(axis: hax.Axis) -> str | tuple[str, ...] | None:
    """The mesh axis (or axes) haliax's current axis mapping puts `axis` on, if any."""
    mapping = current_thread_local_mapping()
    if not mapping:
        return None
    return mapping.get(axis.name)


def _pspec(axes: Sequence[hax.Axis], replicated: frozenset[str]) -> PartitionSpec:
    return PartitionSpec(*(None if a.name in replicated else mesh_axes_for(a) for a in axes))


def shard_by_mapping(
    op: str,
    body: Callable[..., Any],
    inputs: Sequence[tuple[str, jax.Array, Sequence[hax.Axis]] | None],
    out_axes: Any,
    *,
    replicated: Sequence[str] = (),
) -> Any | None:
    """Run `body` per shard with `shard_map`, sharding by haliax's current axis mapping.

    `inputs` are `(arg_name, data, axes)` triples (or `None` for an absent optional input);
    `body` receives each input's local block (or `None`). `out_axes` is a pytree of axis
    tuples, one per output. Axes named in `replicated` are gathered, never split. Returns
    `None` (and runs nothing) when no mesh is set or no input axis is mapped onto the mesh:
    the caller then makes the plain call, whose HLO has no sharding in it.
    """
    mesh = compat.current_mesh()
    mapping = current_thread_local_mapping()
    if mesh is None or not mapping:
        return None
    rep = frozenset(replicated)
    present = [i for i in inputs if i is not None]
    mapped = {a.name for _, _, axes in present for a in axes if a.name not in rep and mesh_axes_for(a)}
    if not mapped:
        return None
    for arg, _, axes in present:
        for a in axes:
            phys = None if a.name in rep else mesh_axes_for(a)
            if phys is not None:
                n = compat.axis_size(mesh, phys)
                if a.size % n:
                    raise ValueError(
                        f"{op}: {arg}'s axis {a.name}={a.size} is mapped to mesh axis {phys!r} of size "
                        f"{n}, which does not divide it"
                    )
    in_specs = tuple(None if i is None else _pspec(i[2], rep) for i in inputs)
    is_axes = lambda t: isinstance(t, tuple) and all(isinstance(a, hax.Axis) for a in t)  # noqa: E731
    out_specs = jax.tree.map(lambda axes: _pspec(axes, rep), out_axes, is_leaf=is_axes)
    datas = tuple(None if i is None else i[1] for i in inputs)
    fn = compat.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return fn(*datas)
