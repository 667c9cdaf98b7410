"""The named layer: one mechanism that every op's named function declares instead of re-writing.

An op declares a `Roles` table — the role of each argument's axes — and a `Sharding` rule,
then calls `Roles.bind(...)` and `Bound.run(body, ...)`:

```python
ROLES = named.Roles("short_conv", {
    "x": ("batch", "Pos", "Channel"),
    "weight": ("Width", "Channel"),
    "bias": named.Arg(("Channel",), optional=True),
})
# the arrays by argument, then each role's axis selector
bound = ROLES.bind({"x": x, "weight": weight, "bias": bias}, Pos=Pos, Width=Width, Channel=Channel)
y = bound.run(body, SHARDING, named.Out(("batch", "Pos", "Channel"), like="x"))
```

`bind` resolves every axis selector (a name or an `hax.Axis`) against the arrays that carry
it, checks that every argument carries exactly its axes (any order; the error names the
argument, the axes it needs and the axes it has), and takes the *batch* axes to be every
other axis of the first argument, in the caller's order. `run` puts each array's axes in the
kernel's canonical order (batch first, flattened into one dim), calls `body`, and re-wraps
its results as `NamedArray`s in the caller's axis order. Under a haliax axis mapping with a
mesh it runs `body` per shard with `shard_map`: batch axes and the roles the op's `Sharding`
lists as parallel are split as the mapping says, every other axis is gathered, and `body`
learns the mesh axes of its parallel roles from `Context.mesh_axes` (vocab-parallel
cross-entropy combines statistics with collectives, a sequence-parallel conv exchanges a
halo). With no mapping `body` runs on the whole arrays, and the named call lowers to the
positional call's HLO. Which mesh axes each array's dims go on is `core/mesh.py`'s.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import haliax as hax
import jax
from haliax import NamedArray
from haliax.partitioning import current_thread_local_mapping

from . import caller, compat
from . import mesh as placement
from .mesh import BATCH, mesh_axes_for

__all__ = [
    "AxisSelector",
    "Arg",
    "Out",
    "Roles",
    "Bound",
    "Sharding",
    "Context",
    "require_named",
    "resolve",
    "axes_str",
    "flatten",
    "unflatten",
    "deprecated_alias",
    "WithFinalState",
    "StepResult",
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


def _selector_name(op: str, role: str, selector: Any) -> str:
    name = selector.name if isinstance(selector, hax.Axis) else selector
    if not isinstance(name, str):
        raise TypeError(f"{op}: {role} must be an axis name or hax.Axis, got {selector!r}")
    return name


def resolve(op: str, arg: str, array: NamedArray, selector: AxisSelector, role: str) -> hax.Axis:
    """The axis of `array` named by `selector` (a name or an `hax.Axis`), or a `ValueError` naming it."""
    name = _selector_name(op, role, selector)
    for a in array.axes:
        if a.name == name:
            if isinstance(selector, hax.Axis) and selector.size != a.size:
                raise ValueError(f"{op}: {role}={selector} but {arg}'s axis {name!r} has size {a.size}")
            return a
    raise ValueError(f"{op}: {arg} has no axis {name!r} ({role}); its axes are {axes_str(array.axes)}")


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


_warned_aliases: set[tuple[str, str]] = set()


def deprecated_alias(op: str, old: str, new: str, old_value: Any, new_value: Any, default: Any) -> Any:
    """The value of option `new`, taking `old` (its former spelling) with a DeprecationWarning
    once per process; both given is an error."""
    if old_value is None:
        return new_value
    if new_value is not default:
        raise TypeError(f"{op}: pass {new}= only ({old}= is its former spelling)")
    if (op, old) not in _warned_aliases:
        _warned_aliases.add((op, old))
        warnings.warn(
            f"axkern.{op}: {old}= is deprecated, use {new}= (same meaning)",
            DeprecationWarning,
            stacklevel=caller.stacklevel(),
        )
    return old_value


class WithFinalState(NamedTuple):
    """An op's output and its state after the last position (`return_final_state=True`)."""

    y: Any
    final_state: Any


class StepResult(NamedTuple):
    """One decode step's output and the new state."""

    y: Any
    state: Any


# -- the role table ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arg:
    """The axes one argument carries, by role. `"batch"` stands for the op's batch axes.

    `optional`: the argument may be `None`. `subset`: it may carry any subset of its axes
    (broadcast to all of them, as a `where` mask over some batch axes).
    """

    roles: tuple[str, ...]
    optional: bool = False
    subset: bool = False
    describe: str | None = None  # how an error names the axes it needs (default: the roles)
    name: str | None = None  # how an error names the argument (default: its key in the table)


@dataclasses.dataclass(frozen=True)
class Out:
    """One output: its roles (`"batch"` first when present), and the argument whose axis order it
    takes (`like`: a name or several, the first one given wins; `swap` renames roles on the way,
    e.g. `{"HeadDim": "VDim"}` for attention's output, whose head dim is `v`'s)."""

    roles: tuple[str, ...]
    like: str | tuple[str, ...] | None = None
    swap: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """An op's sharding rule under a haliax axis mapping.

    Batch axes always run data parallel. `parallel` roles may be split too (`body` reads their
    mesh axes from `Context.mesh_axes` and communicates what it must); every other role is
    gathered. `describe` is what the op's docs say the rule communicates.
    """

    parallel: tuple[str, ...] = ()
    describe: str = "batch axes data parallel; every other axis gathered"
    together: tuple[str, ...] = ()  # parallel roles split together: they may share mesh axes
    with_batch: tuple[str, ...] = ()  # axes the op creates from the batch (one block per batch shard)


@dataclasses.dataclass(frozen=True)
class Context:
    """What `body` knows about its call: the mesh axes of each parallel role inside `shard_map`
    (all `None` outside it) and the local batch shape."""

    mesh: Mapping[str, str | tuple[str, ...] | None]
    batch_shape: tuple[int, ...]
    batch_mesh: tuple[str, ...] = ()  # the mesh axes the batch axes are split over

    def mesh_axes(self, role: str) -> str | tuple[str, ...] | None:
        return self.mesh.get(role)

    @property
    def sharded(self) -> bool:
        return any(v is not None for v in self.mesh.values())


class Roles:
    """An op's role table: `args` maps each argument to its `Arg` (or a plain roles tuple).

    Each role's axis is resolved from the first argument in table order that carries it.
    `fallbacks` maps a role to another whose axis name it takes when the argument lacks its
    own (attention's `KPos` falls back to `QPos`'s name for self-attention). The batch axes
    are the first argument's axes that have no role.
    """

    def __init__(self, op: str, args: Mapping[str, Arg | tuple[str, ...]], *, fallbacks=None):
        self.op = op
        self.args = {k: v if isinstance(v, Arg) else Arg(tuple(v)) for k, v in args.items()}
        self.fallbacks = dict(fallbacks or {})
        self.batch_arg = next(iter(self.args))

    def bind(self, scope: Mapping[str, Any], **overrides: Any) -> Bound:
        """Resolve one call: `scope` maps each argument of the table to its array (or `None` for an
        absent optional one); `overrides` give each role's axis selector by the role's name, and
        may replace or add entries (an argument split in two, a selector shared by two roles)."""
        op = self.op
        selectors = {**scope, **overrides}
        arrays = {arg: selectors.get(arg) for arg in self.args}
        for arg, spec in self.args.items():
            require_named(op, spec.name or arg, arrays.get(arg), optional=spec.optional)
        present = {arg: arrays[arg] for arg in self.args if arrays.get(arg) is not None}
        axes: dict[str, hax.Axis] = {}
        source: dict[str, str] = {}
        for arg, spec in self.args.items():
            if arg not in present or spec.subset:
                continue
            for role in spec.roles:
                if role == BATCH or role in axes:
                    continue
                axes[role] = self._resolve_role(arg, present[arg], role, selectors, axes)
                source[role] = arg
        batch_src = present[self.batch_arg]
        role_names = {axes[r].name for r in self.args[self.batch_arg].roles if r != BATCH}
        batch = tuple(a for a in batch_src.axes if a.name not in role_names)
        bound = Bound(self, axes, batch, present, source)
        for arg, array in present.items():
            bound.check_arg(arg, array)
        return bound

    def _resolve_role(self, arg, array, role, selectors, axes) -> hax.Axis:
        if role not in selectors:
            raise TypeError(f"{self.op}: no axis selector for role {role!r} (an axkern bug)")
        selector = selectors[role]
        name = _selector_name(self.op, role, selector)
        fallback = self.fallbacks.get(role)
        names = {a.name for a in array.axes}
        if fallback is not None and name not in names and fallback in axes:
            if axes[fallback].name not in names:
                raise ValueError(
                    f"{self.op}: {arg} has no axis {name!r} ({role}) nor {axes[fallback].name!r} ({fallback}'s, "
                    f"which {role} falls back to); its axes are {axes_str(array.axes)}"
                )
            selector = axes[fallback].name
        return resolve(self.op, arg, array, selector, role)


class Bound:
    """One call's resolved axes: `axes[role]`, `batch` (the batch axes in the caller's order)."""

    def __init__(self, roles: Roles, axes: dict[str, hax.Axis], batch: tuple[hax.Axis, ...], arrays, source):
        self.roles = roles
        self.source = source
        self.op = roles.op
        self.axes = axes
        self.batch = batch
        self.arrays = arrays

    def axis(self, role: str) -> hax.Axis:
        return self.axes[role]

    def create(self, role: str, name: AxisSelector, size: int) -> hax.Axis:
        """An axis the op creates (e.g. a state axis), named by the caller's selector."""
        if role in self.axes:
            if self.axes[role].size != size:
                raise ValueError(
                    f"{self.op}: {self.source[role]}'s axis {self.axes[role].name!r} ({role}) has size "
                    f"{self.axes[role].size}; it must be {size}"
                )
            return self.axes[role]
        if isinstance(name, hax.Axis) and name.size != size:
            raise ValueError(f"{self.op}: {role}={name} but the axis the op creates has size {size}")
        name = _selector_name(self.op, role, name)
        self.axes[role] = hax.Axis(name, size)
        return self.axes[role]

    def axes_of(self, roles: Sequence[str]) -> tuple[hax.Axis, ...]:
        out: list[hax.Axis] = []
        for r in roles:
            out.extend(self.batch if r == BATCH else (self.axes[r],))
        return tuple(out)

    def check_arg(self, key: str, array: NamedArray) -> None:
        spec = self.roles.args[key]
        arg = spec.name or key
        want = self.axes_of(r for r in spec.roles if r == BATCH or r in self.axes)
        missing = [r for r in spec.roles if r != BATCH and r not in self.axes]
        if missing:
            raise ValueError(f"{self.op}: no axis resolved for {missing} ({arg}); an axkern bug")
        need = {a.name: a.size for a in want}
        have = {a.name: a.size for a in array.axes}
        what = spec.describe or " + ".join(spec.roles)
        if spec.subset:
            if any(need.get(n) != s for n, s in have.items()):
                raise ValueError(
                    f"{self.op}: {arg}'s axes {axes_str(array.axes)} must be a subset of {what} "
                    f"{axes_str(want)}"
                )
        elif need != have:
            raise ValueError(
                f"{self.op}: {arg}'s axes {axes_str(array.axes)} must be {what} {axes_str(want)} (any order)"
            )

    def data(self, arg: str) -> jax.Array | None:
        """`arg`'s data in canonical order (its roles' order, batch axes as the caller has them)."""
        array = self.arrays.get(arg)
        if array is None:
            return None
        want = self.axes_of(r for r in self.roles.args[arg].roles if r == BATCH or r in self.axes)
        if self.roles.args[arg].subset and len(array.axes) != len(want):
            return hax.broadcast_to(array, want).array
        if tuple(a.name for a in array.axes) == tuple(a.name for a in want):
            return array.array
        return array.rearrange(want).array

    # -- running ------------------------------------------------------------------------------

    def _mesh_roles(self, sharding: Sharding) -> dict[str, Any]:
        if compat.current_mesh() is None:
            return {}
        return {r: mesh_axes_for(self.axes[r]) for r in sharding.parallel if r in self.axes}

    def sharded(self, sharding: Sharding) -> bool:
        """Whether `run` splits any input across devices (a mesh, and a batch axis or a parallel
        role mapped onto it)."""
        if compat.current_mesh() is None or not current_thread_local_mapping():
            return False
        if any(mesh_axes_for(a) for a in self.batch):
            return True
        return any(mesh_axes_for(self.axes[r]) for r in sharding.parallel if r in self.axes)

    def batch_mesh(self) -> tuple[str, ...]:
        """The mesh axes the batch axes are split over."""
        return placement.batch_mesh(self.batch)

    def blocks_mesh(self, sharding: Sharding, beside: Sequence[str] = ()) -> tuple[str, ...]:
        """The mesh axes a `with_batch` axis is split over in an array beside the roles `beside`."""
        return placement.blocks_mesh(self.batch, [self.axes[r] for r in beside if r in sharding.parallel])

    def _check_mapping(self, sharding: Sharding, split: frozenset[str]) -> None:
        """Every split axis divisible by its mesh axes, and no two axes on the same mesh axis
        (but the roles the rule splits `together`)."""
        placed = {}
        for arg in self.arrays:
            roles = self.roles.args[arg].roles
            placed[arg] = [(a, True) for a in self.batch if BATCH in roles] + [
                (self.axes[r], r in split) for r in roles if r != BATCH and r in self.axes
            ]
        together = {self.axes[r].name for r in sharding.together if r in self.axes}
        placement.check_mapping(self.op, placed, together, "+".join(sharding.together))

    def run(
        self,
        body: Callable[..., Any],
        sharding: Sharding,
        outs: Out | Sequence[Out],
        *,
        extra: Sequence[tuple[str, jax.Array, tuple[str, ...]]] = (),
    ) -> Any:
        """Run `body(ctx, *datas)` and wrap its outputs.

        `body` receives a `Context` and each argument's data in table order (`None` for an
        absent optional one) with the batch axes flattened into one leading dim (or none when
        the argument has no batch role), followed by the `extra` arrays (`(name, data, roles)`,
        data already in canonical order; a role `"batch"` there is the batch axes unflattened).
        It returns one array per `Out` (a tuple when `outs` is a sequence), batch flattened.
        """
        single = isinstance(outs, Out)
        out_list = [outs] if single else list(outs)
        arg_roles = [self.roles.args[a].roles for a in self.roles.args]
        arg_roles = [tuple(r for r in roles if r == BATCH or r in self.axes) for roles in arg_roles]
        datas = [self.data(a) for a in self.roles.args] + [d for _, d, _ in extra]
        roles_all = arg_roles + [tuple(r) for _, _, r in extra]
        n = len(self.batch)

        def call(ctx_mesh, batch_mesh, *arrays):
            lead = arrays[0].shape[:n]
            flat = [
                None if a is None else (flatten(a, n) if BATCH in roles else a)
                for a, roles in zip(arrays, roles_all, strict=True)
            ]
            result = body(Context(ctx_mesh, tuple(lead), batch_mesh), *flat)
            results = [result] if single else list(result)
            return tuple(
                unflatten(r, tuple(lead)) if BATCH in o.roles else r
                for r, o in zip(results, out_list, strict=True)
            )

        with jax.named_scope(f"axkern.{self.op}"):
            mesh = compat.current_mesh()
            if self.sharded(sharding):
                split = frozenset(r for r in sharding.parallel if r in self.axes)
                self._check_mapping(sharding, split)
                mesh_roles = self._mesh_roles(sharding)

                def spec(roles):
                    return placement.partition_spec(roles, self.batch, self.axes, split, sharding.with_batch)

                in_specs = tuple(
                    None if d is None else spec(roles) for d, roles in zip(datas, roles_all, strict=True)
                )
                out_specs = tuple(spec(o.roles) for o in out_list)
                batch_mesh = self.batch_mesh()
                fn = compat.shard_map(
                    lambda *a: call(mesh_roles, batch_mesh, *a),
                    mesh=mesh,
                    in_specs=in_specs,
                    out_specs=out_specs,
                )
                results = fn(*datas)
            else:
                results = call({}, (), *datas)
        wrapped = tuple(self._wrap(r, o) for r, o in zip(results, out_list, strict=True))
        return wrapped[0] if single else wrapped

    def _wrap(self, data: jax.Array, out: Out) -> NamedArray:
        axes = self.axes_of(out.roles)
        result = hax.named(data, axes)
        likes = (out.like,) if isinstance(out.like, str) else tuple(out.like or ())
        like = next((a for a in likes if a in self.arrays), None)
        if like is None:
            return result
        role_of = {self.axes[r].name: r for r in self.roles.args[like].roles if r != BATCH and r in self.axes}
        order: list[str] = []
        for a in self.arrays[like].axes:
            role = out.swap.get(role_of.get(a.name), role_of.get(a.name))
            if a.name not in role_of:
                order.append(a.name)  # a batch axis
            elif role in out.roles:
                order.append(self.axes[role].name)
        order += [a.name for a in axes if a.name not in order]
        if tuple(order) == tuple(a.name for a in axes):
            return result
        return result.rearrange(tuple(order))
