"""The harness behind `axkern bench`: time every implementation of an op on a set of shapes.

Each op supplies `Case`s (`axkern.core.cases`, built in `ops/<op>/arg_specs.py`). For each
case and implementation we compile once, report peak temporary memory from
`compiled.memory_analysis()`, check the outputs against the `reference` implementation on
the same inputs, then time device-synchronised calls (warm-up, then repeats: the median is
the row's `ms`, the fastest and slowest repeat its `ms_min` and `ms_max`).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..core import backend, config, tuning
from ..core.cases import Case
from ..core.op import Unsupported, get_op

__all__ = [
    "Case",
    "Row",
    "measure",
    "time_ms",
    "time_spread",
    "time_rounds",
    "matmul_ceiling",
    "copy_bandwidth",
    "cotangent",
    "forward_backward",
    "loss_and_grad",
    "cases_for",
    "presets_for",
    "DEFAULT_PRESET",
    "runs_interpreted",
    "replaced_blocks",
]

DEFAULT_PRESET = "quick"  # the shapes of `axkern bench OP` without --preset: small, seconds on a CPU


@dataclasses.dataclass
class Row:
    op: str
    case: str
    implementation: str
    pass_: str  # "fwd" | "fwd+bwd"
    ms: float | None = None  # median over the repeats
    ms_min: float | None = None
    ms_max: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    ceiling_fraction: float | None = None
    temp_gib: float | None = None
    max_rel_error: float | None = None
    note: str = ""
    interpret: bool = False  # a Pallas kernel run by the interpreter: its time says nothing of the kernel

    def as_dict(self) -> dict:
        return {("pass" if k == "pass_" else k): v for k, v in dataclasses.asdict(self).items()}


def _sync(tree):
    return jax.block_until_ready(tree)


def time_spread(
    fn: Callable, args: Sequence, *, warmup: int = 2, repeats: int = 10, batch_s: float = 0.02
) -> tuple[float, float, float]:
    """Device time of `fn(*args)` in ms over `repeats` samples: (min, median, max).

    Each sample enqueues enough back-to-back calls to take about `batch_s` seconds and
    synchronises once at the end, so the host's dispatch and synchronisation latency (tens
    of microseconds) does not inflate sub-millisecond kernels.
    """
    for _ in range(warmup):
        _sync(fn(*args))
    t0 = time.perf_counter()
    _sync(fn(*args))
    one = time.perf_counter() - t0
    inner = max(1, min(200, int(batch_s / max(one, 1e-6))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        _sync(out)
        times.append((time.perf_counter() - t0) * 1e3 / inner)
    return min(times), statistics.median(times), max(times)


def time_rounds(fns: dict, args: Sequence, *, rounds: int, repeats: int = 3, rng=None) -> tuple[dict, dict]:
    """Time every function of `fns` on `args` in `rounds` rounds, in a fresh random order each
    round (`rng`: a `random.Random`), `repeats` samples a function a round (`time_spread`):
    `(samples, medians)`, per key every sample's (min, median, max) ms and each round's median,
    so that ratios can be taken between functions timed in the same round."""
    import random

    rng = rng or random.Random(0)
    samples = {key: [] for key in fns}
    medians = {key: [] for key in fns}
    for _ in range(rounds):
        keys = list(fns)
        rng.shuffle(keys)
        for key in keys:
            lo, med, hi = time_spread(fns[key], args, repeats=repeats)
            samples[key] += [lo, med, hi]
            medians[key].append(med)
    return samples, medians


def time_ms(
    fn: Callable, args: Sequence, *, warmup: int = 2, repeats: int = 10, batch_s: float = 0.02
) -> float:
    """Median device time of `fn(*args)` in ms (see `time_spread`)."""
    return time_spread(fn, args, warmup=warmup, repeats=repeats, batch_s=batch_s)[1]


def matmul_ceiling(*, size: int | None = None, dtype=None, repeats: int = 10, warmup: int = 10) -> float:
    """TFLOP/s of a square matmul on random data here: the ceiling compute-bound kernels are held to."""
    on_gpu = backend.platform() != "cpu"
    size = size or (8192 if on_gpu else 1024)
    dtype = dtype or (jnp.bfloat16 if on_gpu else jnp.float32)
    ka, kb = jax.random.split(jax.random.PRNGKey(1))
    a = jax.random.normal(ka, (size, size), dtype)
    b = jax.random.normal(kb, (size, size), dtype)
    f = jax.jit(lambda a, b: a @ b)
    ms = time_ms(f, (a, b), warmup=warmup, repeats=repeats)  # warm-up lets the clocks ramp
    return 2 * size**3 / (ms * 1e-3) / 1e12


def copy_bandwidth(*, gib: float | None = None, repeats: int = 10, warmup: int = 5) -> float:
    """GB/s of a large device copy here (bytes read plus bytes written): the memory-bound ceiling."""
    gib = gib or (1.0 if backend.platform() != "cpu" else 0.0625)
    n = int(gib * 2**30) // 4
    x = jax.random.normal(jax.random.PRNGKey(2), (n,), jnp.float32)
    f = jax.jit(lambda x: x + 1)
    ms = time_ms(f, (x,), warmup=warmup, repeats=repeats)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def _temp_gib(jitted, args) -> float | None:
    try:
        stats = jitted.lower(*args).compile().memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None
    if stats is None:
        return None
    return stats.temp_size_in_bytes / 2**30


def cotangent(case: Case, args):
    """A random cotangent shaped like the forward's output (the same for every implementation)."""
    shapes = jax.eval_shape(lambda *a: case.forward("reference", *a), *args)
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    return tree.unflatten(
        [
            jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype)
            for k, s in zip(keys, leaves, strict=True)
        ]
    )


def forward_backward(case: Case, impl: str, forward: Callable | None = None):
    """`(ct, *inputs) -> (output, gradients of <output, ct> for case.grad_argnums)`; `forward`
    (default: `case.forward_for(impl)`) is the function differentiated."""
    forward = forward or case.forward_for(impl)

    def run(ct, *args):
        def f(*diff):
            full = list(args)
            for i, d in zip(case.grad_argnums, diff, strict=True):
                full[i] = d
            return forward(*full)

        out, pull = jax.vjp(f, *[args[i] for i in case.grad_argnums])
        return out, pull(ct)

    return run


def loss_and_grad(case: Case, impl: str):
    """`(*inputs) -> (loss, gradients for case.grad_argnums)`: the forward+backward of a case
    with a `loss` (`forward_backward` pulls a cotangent back for the others)."""
    return jax.value_and_grad(lambda *a: case.loss(impl, *a), argnums=case.grad_argnums)


@jax.jit
def _rel_error(g, w):
    g, w = jnp.asarray(g, jnp.float32), jnp.asarray(w, jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(w)), 1e-30)
    return jnp.max(jnp.abs(g - w)) / scale


def _max_rel_error(got, want) -> float:
    errs = [float(_rel_error(g, w)) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    return max(errs) if errs else 0.0


def measure(
    case: Case,
    implementations: Sequence[str],
    *,
    passes: Sequence[str] = ("fwd", "fwd+bwd"),
    repeats: int = 10,
    ceiling: float | None = None,
    bandwidth: float | None = None,
    on_row: Callable[[Row], None] | None = None,
    references: dict | None = None,
) -> list[Row]:
    """Rows for every (implementation, pass) of `case`. An implementation that cannot serve
    the case (or fails) gets a row with its reason in `note` and no numbers. `references`
    (a dict, empty at first) keeps the reference's outputs per pass across calls on one case.

    A peer with `variants` (an attribute: a dict, label -> a callable like the peer, e.g. the
    peer under each block size of a sweep) gets one row per pass: its fastest variant that runs,
    whose label the note names beside every variant's time."""
    args = case.make(jax.random.PRNGKey(0))
    fns = {"fwd": lambda impl, forward: jax.jit(forward or (lambda *a: case.forward_for(impl)(*a)))}
    pass_args = {"fwd": args, "fwd+bwd": args}
    if case.loss is not None:

        def loss_pass(impl, forward):
            if forward is not None:
                raise Unsupported(
                    "a peer's variants are timed on cases whose backward pulls a cotangent back"
                )
            return jax.jit(loss_and_grad(case, impl))

        fns["fwd+bwd"] = loss_pass
    elif "fwd+bwd" in case.passes and "fwd+bwd" in passes:
        fns["fwd+bwd"] = lambda impl, forward: jax.jit(forward_backward(case, impl, forward))
        pass_args["fwd+bwd"] = (cotangent(case, args), *args)
    jitted: dict[tuple[str, str, str | None], Callable] = {}

    def fn_for(pass_: str, impl: str, variant: str | None = None) -> Callable:
        """One jitted function per pass, implementation and variant: the reference's outputs and
        its own row come from one compilation."""
        if (pass_, impl, variant) not in jitted:
            forward = None if variant is None else _variants(case, impl)[variant]
            jitted[pass_, impl, variant] = fns[pass_](impl, forward)
        return jitted[pass_, impl, variant]

    rows = []
    for pass_ in [p for p in passes if p in case.passes]:
        args = pass_args[pass_]
        want, want_note = None, ""
        if references is not None and pass_ in references:
            want, want_note = references[pass_]
        else:
            try:
                want = _sync(fn_for(pass_, case.reference)(*args))
            except Exception as e:  # noqa: BLE001 - the reference may not fit in memory
                want_note = f"no reference ({type(e).__name__})"
            if references is not None:
                references[pass_] = (want, want_note)
        for impl in implementations:
            row = Row(case.op, case.label, impl, pass_, interpret=runs_interpreted(case.op, impl))
            variants = _variants(case, impl)
            if variants is None:
                _fill(row, case, functools.partial(fn_for, pass_, impl), args, (want, want_note), repeats)
            else:
                tried = []
                for label in variants:
                    tried.append((label, dataclasses.replace(row)))
                    fn = functools.partial(fn_for, pass_, impl, label)
                    _fill(tried[-1][1], case, fn, args, (want, want_note), repeats)
                row = _fastest(row, tried)
            _rates(row, case, pass_, ceiling, bandwidth)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        del want
    return rows


def _variants(case: Case, impl: str) -> dict[str, Callable] | None:
    if not impl.startswith("peer:"):
        return None
    return getattr(case.peers.get(impl.removeprefix("peer:")), "variants", None)


def _fill(row: Row, case: Case, compiled: Callable[[], Callable], args, reference, repeats: int) -> None:
    """Compile (`compiled()`), check against the reference's outputs and time one row, or put
    why it cannot run in its note."""
    want, want_note = reference
    try:
        fn = compiled()
        row.temp_gib = _temp_gib(fn, args)
        got = _sync(fn(*args))
        incomparable = getattr(case.peers.get(row.implementation.removeprefix("peer:")), "incomparable", None)
        if row.implementation.startswith("peer:") and incomparable:
            row.note = f"not checked: {incomparable}"
        elif want is not None:
            row.max_rel_error = _max_rel_error(got, want)
        else:
            row.note = want_note
        del got
        spread = time_spread(fn, args, repeats=repeats)
        row.ms_min, row.ms, row.ms_max = (t / case.calls for t in spread)
        if row.interpret:
            row.note = "interpret mode: times the Pallas interpreter, not the kernel"
    except Unsupported as e:
        row.note = f"unsupported: {e}"
    except Exception as e:  # noqa: BLE001 - report, keep going
        row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _fastest(row: Row, tried: list[tuple[str, Row]]) -> Row:
    """The fastest of a peer's variants' rows, its note naming it and every variant's time."""
    timed = [(label, r) for label, r in tried if r.ms is not None]
    times = "; ".join(
        f"{label} {r.ms:.3f} ms" if r.ms is not None else f"{label} {r.note}" for label, r in tried
    )
    if not timed:
        row.note = f"no variant ran: {times}" if tried else "no variant to run"
        return row
    label, best = min(timed, key=lambda t: t[1].ms)
    best.note = "; ".join(filter(None, [f"{label}, fastest of {len(tried)}: {times}", best.note]))
    return best


def _rates(row: Row, case: Case, pass_: str, ceiling: float | None, bandwidth: float | None) -> None:
    """The row's TFLOP/s, GB/s and fraction of the ceiling its case is held to, from its time."""
    if row.ms is None:
        return
    flops = case.flops_forward + (case.flops_backward if pass_ == "fwd+bwd" else 0.0)
    nbytes = case.bytes_forward + (case.bytes_backward if pass_ == "fwd+bwd" else 0.0)
    row.tflops = flops / (row.ms * 1e-3) / 1e12
    if nbytes:
        row.gbps = nbytes / (row.ms * 1e-3) / 1e9
    if case.bound == "memory" and bandwidth and row.gbps:
        row.ceiling_fraction = row.gbps / bandwidth
    elif case.bound == "compute" and ceiling:
        row.ceiling_fraction = row.tflops / ceiling


def runs_interpreted(op: str, implementation: str) -> bool:
    """Whether `implementation=implementation` runs `op` in interpret mode here (a Pallas
    kernel off its platform, or anywhere under `axkern.use(interpret=True)`)."""
    try:
        impl = get_op(op).implementations[implementation]
    except (ValueError, KeyError):  # "default", a file's own case names
        return False
    return impl.interpretable and (
        bool(config.current().interpret) or backend.platform() not in impl.platforms
    )


def replaced_blocks(op: str, text: str):
    """A context (`tuning.replaced`) inside which the dispatcher gives `op`'s implementation named
    by `text` (`IMPL:FIELD=VALUE[,FIELD=VALUE]`) the block sizes it would pick with those fields
    replaced (integers where the value is digits, None where it is `none`), so that a form that
    is not the default runs through the same dispatcher, `explain` included. A `ValueError`
    names an unknown implementation or field, or a value no call could take."""
    impl_name, sep, fields = text.partition(":")
    impls = get_op(op).implementations
    if not sep or impl_name not in impls:
        raise ValueError(
            f"{op}: expected IMPL:FIELD=VALUE[,...] with IMPL one of {', '.join(impls)}, got {text!r}"
        )
    cls = impls[impl_name].block_sizes
    if cls is None:
        raise ValueError(f"{op}: implementation {impl_name!r} has no block sizes to replace")
    names = [f.name for f in dataclasses.fields(cls)]
    kw: dict[str, Any] = {}
    for part in fields.split(","):
        name, eq, value = (s.strip() for s in part.partition("="))
        if not eq or name not in names or not value:
            raise ValueError(
                f"{op}: {impl_name}: expected FIELD=VALUE with FIELD one of {', '.join(names)}, got {part!r}"
            )
        kw[name] = int(value) if value.isdigit() else None if value.lower() == "none" else value
    reason = dataclasses.replace(cls(), **kw).fields_reason()
    if reason is not None:
        raise ValueError(f"{op}: {impl_name}: {reason}")
    return tuning.replaced(op, impl_name, kw)


def _arg_specs(op: str):
    import importlib

    return importlib.import_module(
        f"{get_op(op).package}.arg_specs"
    )  # get_op: a clear error for an unknown op


def presets_for(op: str) -> list[str]:
    """The preset names an op ships; a folder holding several ops maps each op to its own
    dict in `PRESETS_BY_OP`, else its `PRESETS` serve every op in it."""
    mod = _arg_specs(op)
    presets = getattr(mod, "PRESETS_BY_OP", {}).get(op, mod.PRESETS)
    return sorted(presets, key=lambda name: (name != DEFAULT_PRESET, name))


def cases_for(
    op: str, *, preset: str | None = None, tokens: int | None = None, dtype: str | None = None
) -> list[Case]:
    """The benchmark cases an op ships (`ops/<op>/arg_specs.py`), for a preset or the default
    (`DEFAULT_PRESET`)."""
    mod = _arg_specs(op)
    # a folder holding several ops (moe) names its functions `cases_<op>`
    fn = getattr(mod, f"cases_{op}", None) or mod.cases
    return fn(preset=preset, tokens=tokens, dtype=dtype)
