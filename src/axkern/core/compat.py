"""Version shims for JAX and haliax APIs that move between releases. Keep them all here."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["shard_map", "current_mesh", "axis_size", "axis_index"]


def shard_map(f, *, mesh, in_specs, out_specs, check: bool = True):
    """`jax.shard_map` (jax >= 0.6) or `jax.experimental.shard_map.shard_map` before it."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as _sm  # pragma: no cover - old jax

    return _sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


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
