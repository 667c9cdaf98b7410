"""Where the named layer's arrays sit on a device mesh under a haliax axis mapping.

The named layer (`core/named.py`) resolves each call's axes; this module answers, for those
axes, which mesh axes each one is split over (`mesh_axes_for`), what `PartitionSpec` an
array of given roles gets (`partition_spec`), whether a mapping is one the op can run under
(`check_mapping`), and the mesh axes of an axis the op creates from the batch (`with_batch`
axes: the per-shard blocks of token-parallel and expert-parallel MoE). Every function reads
haliax's current axis mapping; none holds state.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import haliax as hax
from haliax.partitioning import current_thread_local_mapping
from jax.sharding import PartitionSpec

from . import compat

__all__ = [
    "BATCH",
    "mesh_axes_for",
    "as_tuple",
    "batch_mesh",
    "blocks_mesh",
    "partition_spec",
    "check_mapping",
]

BATCH = "batch"  # the role that stands for an op's batch axes


def mesh_axes_for(axis: hax.Axis | str) -> str | tuple[str, ...] | None:
    """The mesh axis (or axes) haliax's current axis mapping puts `axis` on, if any."""
    mapping = current_thread_local_mapping()
    if not mapping:
        return None
    return mapping.get(axis.name if isinstance(axis, hax.Axis) else axis)


def as_tuple(mesh_axes: str | Sequence[str] | None) -> tuple[str, ...]:
    """A mapping's value (`None`, one mesh axis or several) as a tuple of mesh axes."""
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def batch_mesh(batch: Sequence[hax.Axis]) -> tuple[str, ...]:
    """The mesh axes the batch axes are split over, in the batch axes' order."""
    return tuple(m for a in batch for m in as_tuple(mesh_axes_for(a)))


def blocks_mesh(batch: Sequence[hax.Axis], beside: Sequence[hax.Axis]) -> tuple[str, ...]:
    """The mesh axes a `with_batch` axis is split over in an array whose other split axes are
    `beside`: the batch's mesh axes that none of them is on (expert-parallel counts: blocks over
    the data axes, experts over the expert axis)."""
    taken = {m for a in beside for m in as_tuple(mesh_axes_for(a))}
    return tuple(m for m in batch_mesh(batch) if m not in taken)


def partition_spec(
    roles: Sequence[str],
    batch: Sequence[hax.Axis],
    axes: Mapping[str, hax.Axis],
    split: Collection[str],
    with_batch: Collection[str] = (),
) -> PartitionSpec:
    """The `PartitionSpec` of an array whose dims carry `roles` (`"batch"` expands to the batch
    axes). A role in `split` is split as the mapping says, every other role is whole, and a role
    in `with_batch` is split over the batch's mesh axes that no other dim of the array is on."""
    parts: list[Any] = []
    blocks = object()  # stands for a with_batch dim until the others are known
    for r in roles:
        if r == BATCH:
            parts.extend(mesh_axes_for(a) for a in batch)
        elif r in with_batch:
            parts.append(blocks)
        else:
            parts.append(mesh_axes_for(axes[r]) if r in split else None)
    taken = {m for p in parts if p is not blocks for m in as_tuple(p)}
    rest = tuple(m for m in batch_mesh(batch) if m not in taken) or None
    return PartitionSpec(*(rest if p is blocks else p for p in parts))


def check_mapping(
    op: str,
    arrays: Mapping[str, Sequence[tuple[hax.Axis, bool]]],
    together: Collection[str] = (),
    together_key: str = "",
) -> None:
    """A `ValueError` unless every split axis is divisible by its mesh axes and no two axes share
    a mesh axis. `arrays` lists each argument's axes with whether the op splits them; the axis
    names in `together` may share mesh axes (the op splits them as one, reported as
    `together_key`)."""
    mesh = compat.current_mesh()
    used: dict[str, str] = {}
    for arg, placed in arrays.items():
        for axis, is_split in placed:
            phys = mesh_axes_for(axis) if is_split else None
            if phys is None:
                continue
            n = compat.axis_size(mesh, phys)
            if axis.size % n:
                raise ValueError(
                    f"{op}: {arg}'s axis {axis.name}={axis.size} is mapped to mesh axis {phys!r} of "
                    f"size {n}, which does not divide it"
                )
            key = together_key if axis.name in together else axis.name
            for m in as_tuple(phys):
                if used.setdefault(m, key) != key:
                    raise ValueError(
                        f"{op}: axes {used[m]!r} and {key!r} are both mapped to mesh axis {m!r}; "
                        "map them to different mesh axes"
                    )
