"""Which of the `mosaic_gpu` backward kernels' float32 operands need their two 16-bit halves, by
the oracle rule through the whole layer.

The chunk-scan and chunk-state backward kernels can take each float32 operand as two bf16
halves (`hi + lo`, the products over both), which costs two or three `wgmma`s a product, or
rounded to bf16 once (one product where it was two, two where it was three). The baseline here
takes every operand as halves; then each is rounded once in turn. The layer runs through the
kernels' emulation (`emulate.EmulatedLayout` with `single`, the operands rounded once; the
forward as the kernels compute it), on the CPU; the outputs and every gradient are held to DESIGN.md's rule
against the float64 oracle (`reference`), and each leaf's `max|emulated - oracle| / bound` is
recorded. Operands (product: operand):

    dM: dy        dM = (dy xᵀ) ∘ dt_s          (the cotangent dy is float32 with D or the gate)
    Mdy: M, dy    d(dt ∘ x) = Mᵀ dy
    dgB: dg       dC += dg B
    dgC: dg       dB = dgᵀ C
    fS: fdy, S    dC += (f ∘ dy) S_in
    CS: S         df = rowsum(dy ∘ (C S_inᵀ))
    dS: fdy       dS_in = (f ∘ dy)ᵀ C
    BdS: dS       d(w ∘ x) = B dSᵀ              (the chunk-state backward)
    wdS: wx, dS   dB += (w ∘ x) dS

First every operand alone rounded once, then the plan rounding every operand that passed
alone with its gradients' largest ratio at most `--margin` of the bound (the outputs do not
depend on the backward), then that plan with each of its operands restored, so that a failure
of the combination shows which operand it needs.

    OUT=<folder> python3 benchmarks/diagnostics/ssd_backward_precision.py [--chunks 64,128] [--margin 0.5]

writes `$OUT/sweep_backward_precision.json` (on the CPU; a few minutes). `--plans` evaluates
only the plans it names (`sweep_backward_precision_plans.json`).

`--stored` asks the same of the float32 arrays the kernels pass each other through memory,
each kept in the input dtype instead (mamba_ssm keeps its chunk states and their gradients in
it), with the kernels' own operands (`emulate.ROUNDED_ONCE`):

    S_in     the states entering each chunk: the forward's residual, read by the chunk-scan
             backward and by the reverse recurrence (`d keep = Σ g ∘ S_in`)
    dS_in    the chunk-scan backward's gradient of the entering state, into the reverse recurrence
    d_own    the reverse recurrence's gradient of each chunk's own state, into the chunk-state backward

    OUT=<folder> python3 benchmarks/diagnostics/ssd_backward_precision.py --stored 'S_in;dS_in;d_own;S_in,d_own'

writes `$OUT/sweep_backward_precision_stored.json`. `--cases long` takes `LONG_CASES` instead
(lengths 2048 and 16384 at P 64, N 128, several seeds; `_long` in the file's name), `--lean` the
kernels' operands and the state in `C S_inᵀ` rounded once (`LEAN_ROUNDED_ONCE`: the lean
chunk-scan backward in one tile of the state, were it not to keep the low half; `_lean`):

    OUT=<folder> python3 benchmarks/diagnostics/ssd_backward_precision.py --chunks 64 --cases long --lean --stored S_in

`--scores` runs the layer with `dg` summed per group (`SSDBlockSizes(group_sums="scores")`:
`dB` and `dC`'s `dg B` from the sums in float32, `group_scores.py`), alone the kernels' operands
(`_scores`):

    OUT=<folder> python3 benchmarks/diagnostics/ssd_backward_precision.py --chunks 64 --cases long --scores
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from axkern.ops.chunked import kernel_scan  # noqa: E402
from axkern.ops.chunked.mosaic_gpu import emulate as E  # noqa: E402
from axkern.ops.ssd.api import prepared_dt  # noqa: E402
from tests.cases.ssd import make, run  # noqa: E402
from tests.harness import jit, oracle  # noqa: E402
from tests.helpers import ATOL  # noqa: E402

OPERANDS = E.OPERANDS

# (seed; dims b, l, h, p, g, n; segments: True, False or None (no segments, A / 100); D and the gate)
CASES = [
    (3, (1, 150, 4, 64, 2, 64), True, True),
    (4, (2, 128, 2, 128, 1, 64), False, True),
    (5, (1, 192, 2, 64, 1, 64), None, True),
    (6, (1, 150, 4, 64, 2, 64), True, False),
    (7, (1, 600, 2, 64, 1, 128), True, True),
    (8, (1, 512, 2, 64, 1, 64), None, False),
]
# `--cases long`: the 2.7B layer's head and state sizes over longer sequences and several seeds,
# where a rounding of each chunk's state adds up over the chunks (`d keep` into `dA`)
LONG_CASES = [
    (seed, dims, segments, True)
    for dims, seeds in (
        ((1, 2048, 2, 64, 1, 128), 6),
        ((2, 2048, 4, 64, 1, 128), 6),
        ((1, 16384, 1, 64, 1, 128), 2),
    )
    for seed in range(seeds)
    for segments in (None, True)
]


STORED = ("S_in", "dS_in", "d_own")
# the kernels' operands rounded once with the state in `C S_inᵀ` too (`--lean`)
LEAN_ROUNDED_ONCE = E.ROUNDED_ONCE | {"CS:S"}


def _stored(a):
    """`a` (float32) kept in bf16 (every case here is bf16) and read back."""
    return a.astype(jnp.bfloat16).astype(jnp.float32)


@functools.cache
def layout(single: frozenset | None, stored: frozenset = frozenset(), scores: bool = False):
    """The emulated layout with `single` rounded once in the backward (`emulate.OPERANDS`; None:
    the kernels' choice) and the arrays `stored` (`STORED`) kept in bf16 between the kernels;
    `scores`: `dg` summed per group (`EmulatedLayout.group_scores`)."""
    base, methods = E.EmulatedLayout, {"single": single, "group_scores": scores}
    if "S_in" in stored:

        def recurrence(self, keep, own, initial):
            states_in, final = base.recurrence(self, keep, own, initial)
            return _stored(states_in), final

        methods["recurrence"] = recurrence
    if "dS_in" in stored:

        def chunk_scan_bwd(self, *args, **kwargs):
            *grads, d_states_in = base.chunk_scan_bwd(self, *args, **kwargs)
            return (*grads, _stored(d_states_in))

        methods["chunk_scan_bwd"] = chunk_scan_bwd
    if "d_own" in stored:

        def recurrence_bwd(self, keep, states_in, d_states_in, d_final):
            d_own, d_keep, d_init = base.recurrence_bwd(self, keep, states_in, d_states_in, d_final)
            return _stored(d_own), d_keep, d_init

        methods["recurrence_bwd"] = recurrence_bwd
    return type("Planned", (base,), methods)


@functools.cache
def runner(single: frozenset | None, names, chunk, stored: frozenset = frozenset(), scores: bool = False):
    def f(seg, *vals):
        a = dict(zip(names, vals, strict=True))
        dt = prepared_dt(a["dt"], a.get("dt_bias"), True, None)
        s0 = a.get("initial_state")
        if s0 is None:
            s0 = jnp.zeros((a["x"].shape[0], a["x"].shape[2], a["x"].shape[3], a["B"].shape[3]), jnp.float32)
        args = (a["x"], dt, a["A"], a["B"], a["C"], a.get("D"), a.get("z"), seg, s0)
        y, final = kernel_scan.ssd(layout(single, stored, scores), *args, chunk_size=chunk, interpret=True)
        cot = jnp.round(64 * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))) / 64
        return jnp.sum(y.astype(jnp.float32) * cot) + jnp.sum(jnp.sin(final.astype(jnp.float32))), (y, final)

    def g(arrays, seg):
        argnums = tuple(range(1, len(names) + 1))
        (_, out), grads = jax.value_and_grad(f, argnums=argnums, has_aux=True)(
            seg, *[arrays[k] for k in names]
        )
        return out, grads

    return jit(g)


def ratios(got, same, want, names):
    """Per leaf `max|got - oracle| / bound` (outputs `y`, `final`; gradients by input name)."""
    out = {}
    labels = ["y", "final"] + [f"d{n}" for n in names]
    leaves = jax.tree.leaves(got[0]) + jax.tree.leaves(got[1])
    refs = jax.tree.leaves(same[0]) + jax.tree.leaves(same[1])
    oracles = jax.tree.leaves(want[0]) + jax.tree.leaves(want[1])
    for label, g, r, o in zip(labels, leaves, refs, oracles, strict=True):
        g, r, o = (np.asarray(v, np.float64) for v in (g, r, o))
        scale = max(np.abs(o).max(initial=0.0), 1e-30)
        bound = 2 * np.abs(r - o).max(initial=0.0) + ATOL["bfloat16"] * scale
        err = np.abs(g - o).max(initial=0.0)
        out[label] = float("inf") if np.isnan(g).any() else float(err / bound)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", default="64,128")
    p.add_argument("--margin", type=float, default=0.5)
    p.add_argument("--plans", help="only these plans, `;`-separated, each `,`-separated operands")
    p.add_argument("--stored", help="arrays kept in bf16 (`STORED`), `;`-separated sets, each `,`-separated")
    p.add_argument("--cases", choices=("short", "long"), default="short", help="`CASES` or `LONG_CASES`")
    p.add_argument(
        "--lean", action="store_true", help="the kernels' operands with the lean chunk-scan backward's"
    )
    p.add_argument("--scores", action="store_true", help="dg summed per group (group_sums='scores')")
    a = p.parse_args()
    if a.lean and not a.stored:
        raise SystemExit("--lean: with --stored (the plans and the operands alone name their own roundings)")
    prepared = []
    for chunk in (int(c) for c in a.chunks.split(",")):
        for seed, dims, segments, extras in CASES if a.cases == "short" else LONG_CASES:
            arrays, seg = make(seed, *dims, "bfloat16", segments=bool(segments), extras=extras)
            if segments is None:
                arrays["A"] = arrays["A"] / 100
            names = tuple(sorted(arrays))
            want = oracle(lambda name, arr, seg=seg: run(name, arr, seg), arrays)
            same = run("reference", arrays, seg)
            label = (
                f"chunk {chunk} seed {seed} B={dims[0]} L={dims[1]} H={dims[2]} P={dims[3]} G={dims[4]} N={dims[5]} "
                + ("segments" if segments else ("A/100" if segments is None else ""))
                + (" D, gate" if extras else " no D, gate")
            )
            prepared.append((label, chunk, arrays, seg, names, want, same))

    def evaluate(single, stored=()):
        rows = {}
        kernels = LEAN_ROUNDED_ONCE if a.lean else None  # (None: `emulate.ROUNDED_ONCE`)
        plan = kernels if single is None else frozenset(single)
        for label, chunk, arrays, seg, names, want, same in prepared:
            run_plan = runner(plan, names, chunk, frozenset(stored), a.scores)
            rows[label] = ratios(run_plan(arrays, seg), same, want, names)
        worst = max(max(r.values()) for r in rows.values())
        grads = max(v for r in rows.values() for k, v in r.items() if k not in ("y", "final"))
        named = sorted((plan or E.ROUNDED_ONCE) if single is None else single)
        print(f"{named} stored {sorted(stored)}: worst {worst:.3f}, of the gradients {grads:.3f}", flush=True)
        runner.cache_clear(), layout.cache_clear(), jax.clear_caches()  # each plan compiles anew
        out = {"single": named, "worst": worst, "gradients_worst": grads, "cases": rows}
        return out | ({"stored": sorted(stored)} if stored else {})

    if a.scores and not (a.stored or a.plans):  # the kernels' operands alone
        _write(a, None, [evaluate(None)])
        return
    if a.stored:
        sets = [tuple(s.split(",")) for s in a.stored.split(";")]
        for name in {n for s in sets for n in s} - set(STORED):
            raise SystemExit(f"--stored: unknown array {name!r}; arrays are {', '.join(STORED)}")
        _write(a, None, [evaluate(None)] + [evaluate(None, s) for s in sets])
        return
    results = [evaluate(())]
    if a.plans:
        results += [evaluate(tuple(plan.split(","))) for plan in a.plans.split(";")]
        _write(a, None, results)
        return
    alone = {op: evaluate((op,)) for op in OPERANDS}
    results += list(alone.values())
    plan = [op for op in OPERANDS if alone[op]["gradients_worst"] <= a.margin]
    combined = evaluate(plan)
    results.append(combined)
    for op in plan:
        results.append(evaluate([o for o in plan if o != op]))
    _write(a, plan, results)


def _write(a, plan, results) -> None:
    extra = f" --plans '{a.plans}'" if a.plans else ""
    extra += f" --stored '{a.stored}'" if a.stored else ""
    extra += f" --cases {a.cases}" if a.cases != "short" else ""
    extra += " --lean" if a.lean else ""
    extra += " --scores" if a.scores else ""
    out = {
        "command": "OUT=<folder> python3 benchmarks/diagnostics/ssd_backward_precision.py "
        + f"--chunks {a.chunks} --margin {a.margin}{extra}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": "CPU (the kernels' emulation against the float64 oracle)",
        "margin": a.margin,
        "passed_alone": plan,
        "rows": results,
    }
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    name = "sweep_backward_precision" + ("_plans" if a.plans else "") + ("_stored" if a.stored else "")
    name += (
        ("_long" if a.cases == "long" else "") + ("_lean" if a.lean else "") + ("_scores" if a.scores else "")
    )
    (folder / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
