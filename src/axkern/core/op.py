"""The dispatcher: an `Op` knows its implementations and picks one per call.

For a call the op builds a `Spec` (shapes, dtype, platform, device kind, flags), walks the
candidates in order (an explicit `implementation=` argument, else `axkern.use(op=...)` /
`AXKERN_IMPL_<OP>`, else the platform's default order), asks each `supports(spec)`, picks
and validates block sizes, and runs the first that can serve. A candidate that cannot
(an unsupported shape, a platform it does not run on, an `Unsupported` raised while
tracing) is skipped with its reason, warned once per (op, implementation, reason), and the
next one runs. Strict mode raises instead, and so does a single explicitly requested
implementation. A Pallas kernel off its platform runs in interpret mode only when asked
for (`axkern.use(interpret=True)`, or named alone); in an order of several it is skipped.
Fallback warnings point at the caller's line. The chosen implementation runs under
`jax.named_scope("axkern.<op>")` and a scope of its own name, so profiles and HLO metadata
name every call. `explain` returns the `Decision` without running anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from . import backend, blocks, caller, compat, config, registry, tuning
from .registry import get_op, implementations, ops, registered_ops

__all__ = [
    "Unsupported",
    "FallbackWarning",
    "Spec",
    "Rejection",
    "Decision",
    "Implementation",
    "Op",
    "explain",
    "registered_ops",
    "get_op",
    "ops",
    "implementations",
    "step_op",
]


class Unsupported(NotImplementedError):
    """An implementation cannot serve a call; the message says why."""


class FallbackWarning(UserWarning):
    """An implementation was skipped and the next candidate ran instead."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the dispatcher knows about a call: sizes by name, dtype, where it runs, static flags."""

    op: str
    dims: tuple[tuple[str, int], ...]
    dtype: str
    platform: str
    device_kind: str
    device_key: str
    flags: tuple[tuple[str, Any], ...] = ()

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    def flag(self, name: str, default: Any = None) -> Any:
        return dict(self.flags).get(name, default)

    def __str__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.dims)
        flags = "".join(f", {k}={v!r}" for k, v in self.flags)
        return f"{self.op}({dims}, dtype={self.dtype}{flags}) on {self.platform} [{self.device_kind}]"


@dataclasses.dataclass(frozen=True)
class Rejection:
    implementation: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which implementation serves a call, with which block sizes, and what was passed over."""

    op: str
    implementation: str
    block_sizes: blocks.BlockSizes | None
    # "tuning" | "argument" | "cache" | "table" | "autotune" | "heuristic" | "default" | "none"
    # | "replaced" (`tuning.replaced`: fields replaced over any of the five before "none")
    block_source: str
    rejected: tuple[Rejection, ...]
    spec: Spec
    interpret: bool = False
    backward: str = ""
    # why the platform's default order is what it is (the op's `order_notes`); only where the
    # default order chose, not an implementation asked for by name or through `axkern.use`
    order_note: str = ""

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.implementation}" + (" (interpret mode)" if self.interpret else "")]
        lines.append(f"  call:        {self.spec}")
        if self.block_sizes is not None:
            lines.append(f"  block sizes: {self.block_sizes} (from {self.block_source})")
        else:
            lines.append("  block sizes: none (this implementation is not blocked)")
        if self.backward:
            lines.append(f"  backward:    {self.backward}")
        if self.order_note:
            lines.append(f"  order:       {self.order_note}")
        for r in self.rejected:
            lines.append(f"  skipped {r.implementation}: {r.reason}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute an op.

    `fn(*arrays, block_sizes=..., interpret=..., **options)` is a positional function with its
    own `jax.custom_vjp`. `platforms` are where it runs compiled; an `interpretable` (Pallas)
    implementation also runs elsewhere in interpret mode when asked to. `space(spec)` lists
    the block sizes `axkern tune` sweeps for a call (declared beside `heuristic` in the op's
    `blocks.py`); an implementation without one is not tunable. `backward` says how its
    gradients are formed: a sentence, or `backward(spec, block_sizes) -> str` where the call's
    shapes and blocks decide it (`explain` reports the sentence for the call).
    """

    name: str
    fn: Callable[..., Any]
    platforms: tuple[str, ...] = ("cpu", "gpu", "tpu")
    supports: Callable[[Spec], str | None] = lambda spec: None
    block_sizes: type[blocks.BlockSizes] | None = None
    heuristic: Callable[[Spec], blocks.BlockSizes] | None = None
    space: Callable[[Spec], Sequence[blocks.BlockSizes]] | None = None
    interpretable: bool = False
    backward: str | Callable[[Spec, blocks.BlockSizes | None], str] = "autodiff"
    why_platforms: str = ""  # why it runs on its platforms alone (said when it is refused elsewhere)


_warned: set[tuple[str, str, str]] = set()
_explaining: contextvars.ContextVar[list | None] = contextvars.ContextVar("axkern_explaining", default=None)


def reset_warnings() -> None:
    """Forget which fallbacks were warned about (each warns once per process otherwise)."""
    _warned.clear()


class Op:
    """An op: its implementations, default order per platform, and tuned block tables.

    `order_notes` says, per platform, why its default order is what it is where that is not
    plain (a kernel left out of it, or put first, on a measurement); `explain` reports it."""

    def __init__(
        self,
        name: str,
        implementations: list[Implementation],
        default_order: Mapping[str, tuple[str, ...] | Callable[[Spec], tuple[str, ...]]],
        *,
        package: str,
        bucket: Callable[[Spec], Mapping[str, Any]],
        order_notes: Mapping[str, str] | None = None,
    ):
        self.name = name
        self.implementations = {impl.name: impl for impl in implementations}
        self.default_order = dict(default_order)
        self.order_notes = dict(order_notes or {})
        self.package = package
        self.bucket = bucket
        registry.register(self)

    def spec(self, dims: Mapping[str, int], dtype: Any, **flags: Any) -> Spec:
        return Spec(
            op=self.name,
            dims=tuple((k, int(v)) for k, v in dims.items()),
            dtype=jax.numpy.dtype(dtype).name,
            platform=backend.platform(),
            device_kind=backend.device_kind(),
            device_key=backend.device_key(),
            flags=tuple(sorted(flags.items())),
        )

    # -- choosing -----------------------------------------------------------------------------

    def _requested(self, implementation, spec: Spec) -> tuple[tuple[str, ...], bool]:
        """Candidate names in order, and whether a failure must raise (a single explicit name)."""
        requested = (
            implementation if implementation is not None else config.implementation_override(self.name)
        )
        if requested is None:
            order = self.default_order.get(spec.platform, ("xla",))
            return (order(spec) if callable(order) else order), False
        names = (requested,) if isinstance(requested, str) else tuple(requested)
        if not names:
            raise ValueError(f"{self.name}: implementation=() names no implementation")
        for n in names:
            if n not in self.implementations:
                raise ValueError(
                    f"{self.name}: unknown implementation {n!r}; known: {sorted(self.implementations)}"
                )
        return names, isinstance(requested, str)

    def _platform_reason(
        self, impl: Implementation, spec: Spec, explicit: bool, interpret: bool
    ) -> str | None:
        """Why `impl` cannot run on this platform, or None. Off its platforms a Pallas kernel
        runs in interpret mode only when asked for: `interpret=True`, or named alone
        (`explicit`); in an order of several it is skipped for the next candidate."""
        if spec.platform in impl.platforms:
            return None
        if impl.interpretable and (interpret or explicit):
            return None
        hint = " (axkern.use(interpret=True) runs it in interpret mode)" if impl.interpretable else ""
        why = f": {impl.why_platforms}" if impl.why_platforms else ""
        return f"runs on {'/'.join(impl.platforms)}, not {spec.platform}{hint}{why}"

    def choose_blocks(
        self,
        impl: Implementation,
        spec: Spec,
        block_sizes: blocks.BlockSizes | Mapping | None,
        call: tuple[tuple, dict] | None = None,
    ) -> tuple[blocks.BlockSizes | None, str, str | None]:
        """(block sizes, their source, reason they cannot serve or None).

        The order: the candidate a sweep is measuring ("tuning"); an explicit argument; the
        per-user tuning cache ("cache"); the shipped table ("table"); with autotuning on and
        the call's `(arrays, options)` given, a sweep now ("autotune", stored in the cache);
        the heuristic; the defaults. Under `tuning.replaced` the fields it names replace those
        of any of the last five ("replaced").
        """
        cls = impl.block_sizes
        if cls is None:
            return None, "none", None
        found = tuning.forced_blocks(self.name, impl.name)
        if found is not None:  # a sweep's candidate, even where the case names block sizes
            bs = cls.from_dict(found)
            return bs, "tuning", bs.validate(spec)
        if block_sizes is not None:
            bs = block_sizes if isinstance(block_sizes, cls) else cls.from_dict(dict(block_sizes))
            reason = bs.validate(spec)
            if reason is not None:
                raise ValueError(f"{self.name}: block_sizes={bs} cannot serve {spec}: {reason}")
            return bs, "argument", None
        bucket = self.bucket(spec)
        found = tuning.lookup(spec.device_key, self.name, impl.name, bucket, check=_serves(cls, spec))
        source = "cache"
        if found is None:
            found = blocks.lookup(self.package, spec.device_key, impl.name, bucket, op=self.name)
            source = "table"
        if found is None and call is not None and self._autotunes(impl, spec):
            found, source = tuning.autotuner()(self, impl, spec, *call), "autotune"
        if found is not None:
            bs = found if isinstance(found, cls) else cls.from_dict(found)
        elif impl.heuristic is not None:
            bs, source = impl.heuristic(spec), "heuristic"
        else:
            bs, source = cls(), "default"
        fields = tuning.replaced_fields(self.name, impl.name)
        if fields is not None:
            bs, source = dataclasses.replace(bs, **fields), "replaced"
        return bs, source, bs.validate(spec)

    def _autotunes(self, impl: Implementation, spec: Spec) -> bool:
        """Autotuning is on, `impl` declares a space, it runs compiled here, and nothing else
        (a sweep, `explain`) is tracing this call."""
        return (
            bool(config.current().autotune)
            and impl.space is not None
            and spec.platform in impl.platforms
            and not tuning.tuning_active()
            and _explaining.get() is None
        )

    def _reject(self, impl: str, reason: str, fatal: bool, rejected: list[Rejection]) -> None:
        if fatal:
            raise Unsupported(f"{self.name}: implementation {impl!r} cannot serve this call: {reason}")
        rejected.append(Rejection(impl, reason))
        key = (self.name, impl, reason)
        if _explaining.get() is None and key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"axkern {self.name}: skipping {impl!r}: {reason}; trying the next implementation",
                FallbackWarning,
                stacklevel=caller.stacklevel(),
            )

    # -- running ------------------------------------------------------------------------------

    def __call__(self, spec: Spec, *arrays, implementation=None, block_sizes=None, **options):
        """Pick an implementation for `spec` and run it on `arrays` (traced: nothing is blocked on)."""
        settings = config.current()
        arrays = compat.match_vma(*arrays)
        names, single = self._requested(implementation, spec)
        fatal = single or bool(settings.strict)
        rejected: list[Rejection] = []
        for name in names:
            impl = self.implementations[name]
            reason = self._platform_reason(impl, spec, single, settings.interpret)
            if reason is None:
                reason = impl.supports(spec)
            bs, source = None, "none"
            if reason is None:
                bs, source, reason = self.choose_blocks(impl, spec, block_sizes, (arrays, options))
            if reason is not None:
                self._reject(name, reason, fatal, rejected)
                continue
            interpret = impl.interpretable and (
                bool(settings.interpret) or spec.platform not in impl.platforms
            )
            kwargs = dict(options)
            if impl.block_sizes is not None:
                kwargs["block_sizes"] = bs
            if impl.interpretable:
                kwargs["interpret"] = interpret
            try:
                with jax.named_scope(f"axkern.{self.name}"), jax.named_scope(name):
                    out = _compiled_when_eager(impl.fn, arrays, kwargs)(*arrays)
            except Unsupported as e:
                self._reject(name, str(e) or type(e).__name__, fatal, rejected)
                continue
            collector = _explaining.get()
            if collector is not None:
                backward = impl.backward(spec, bs) if callable(impl.backward) else impl.backward
                by_default = implementation is None and config.implementation_override(self.name) is None
                note = self.order_notes.get(spec.platform, "") if by_default else ""
                collector.append(
                    Decision(self.name, name, bs, source, tuple(rejected), spec, interpret, backward, note)
                )
            return out
        detail = "; ".join(f"{r.implementation}: {r.reason}" for r in rejected)
        raise Unsupported(f"{self.name}: no implementation can serve {spec} ({detail})")


def _serves(cls: type[blocks.BlockSizes], spec: Spec) -> Callable[[dict], str | None]:
    """Why a cache entry's block sizes (a dict) cannot serve `spec`, or None."""

    def reason(found: dict) -> str | None:
        try:
            return cls.from_dict(found).validate(spec)
        except (TypeError, ValueError) as e:
            return str(e)

    return reason


def _static(value) -> bool:
    """Whether `value` can be a static argument of `jax.jit`: compared by value, never by identity."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, tuple):
        return all(_static(v) for v in value)
    if dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
        return all(_static(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def _typed(value):
    """`value` with the types of its parts, so that `1`, `1.0` and `True` are different keys."""
    return (type(value), tuple(_typed(v) for v in value) if isinstance(value, tuple) else value)


@functools.lru_cache(maxsize=256)
def _jitted(fn: Callable[..., Any], key: tuple, options: tuple) -> Callable[..., Any]:
    return jax.jit(functools.partial(fn, **dict(options)))


def _compiled_when_eager(fn: Callable[..., Any], arrays: tuple, kwargs: dict) -> Callable[..., Any]:
    """`fn` with `kwargs` bound: compiled as one program when called eagerly on concrete arrays
    (run op by op, a chunked scan's hundreds of small operations would each compile and
    dispatch on their own); as it is under a trace (`jit`, `grad`, `vmap`,
    `shard_map`), which compiles it with the rest, or when an option is not a plain value."""
    leaves = jax.tree.leaves(arrays)
    eager = all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in leaves)
    if not (eager and leaves) or not all(_static(v) for v in kwargs.values()):
        return functools.partial(fn, **kwargs)
    options = tuple(sorted(kwargs.items()))
    return _jitted(fn, tuple((k, _typed(v)) for k, v in options), options)


def step_op(name: str, xla: Callable[..., Any], reference: Callable[..., Any], *, package: str) -> Op:
    """The op of a decode step: one position of a recurrence, `xla` everywhere, `reference` on request."""
    return Op(
        name,
        [
            Implementation("xla", xla, backward="autodiff (one step)"),
            Implementation("reference", reference, backward="autodiff"),
        ],
        default_order={"cpu": ("xla",), "gpu": ("xla",), "tpu": ("xla",)},
        package=package,
        bucket=lambda spec: dict(spec.dims),
    )


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Op calls made inside are not reported by `explain` (an implementation that dispatches
    another op call as part of itself: its own decision is the one reported)."""
    token = _explaining.set(None)
    try:
        yield
    finally:
        _explaining.reset(token)


@contextlib.contextmanager
def _collecting() -> Iterator[list[Decision]]:
    decisions: list[Decision] = []
    token = _explaining.set(decisions)
    try:
        yield decisions
    finally:
        _explaining.reset(token)


def explain(fn: Callable[..., Any], *args, **kwargs) -> Decision | tuple[Decision, ...]:
    """What `fn(*args, **kwargs)` would run, without running it.

    `fn` is any function that calls axkern ops (`axkern.fused_cross_entropy`, its positional
    form, or your own model code). It is traced abstractly (`jax.eval_shape`): nothing is
    computed and `args` may be `jax.ShapeDtypeStruct`s. Returns the `Decision` of the one op
    call, or a tuple of them in call order when `fn` calls several.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Batch, Vocab = hax.Axis("batch", 4), hax.Axis("vocab", 10)
    >>> logits, labels = hax.zeros((Batch, Vocab)), hax.zeros(Batch, dtype=jnp.int32)
    >>> decision = axkern.explain(axkern.cross_entropy, logits, labels)
    >>> decision.implementation, [r.implementation for r in decision.rejected]
    ('xla', [])

    ```
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_dyn = [isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or hasattr(x, "__array__") for x in leaves]
    dynamic = [x for x, d in zip(leaves, is_dyn, strict=True) if d]

    def run(dyn):
        it = iter(dyn)
        full = [next(it) if d else x for x, d in zip(leaves, is_dyn, strict=True)]
        a, k = jax.tree.unflatten(treedef, full)
        return fn(*a, **k)

    with _collecting() as decisions:
        jax.eval_shape(run, dynamic)
    if not decisions:
        raise ValueError(
            "explain: no axkern op was traced. Pass the function itself, not one already traced "
            "by jax.jit (a cached trace runs no Python)."
        )
    return decisions[0] if len(decisions) == 1 else tuple(decisions)
