"""The Triton launch parameters (`num_warps`, `num_stages`) of the SSD chunk kernels and their
recurrence kernels (`chunked/kernels.py`, `chunked/pallas_gpu.py`), kernel by kernel, as one
implementation's forward and backward launch them at a bench preset: Mamba-3's `pallas_gpu`
(rotated `q`, `k` in float32, TF32 products) and SSD's `pallas_gpu` (16-bit `B`, `C`).

The forward+backward of the preset's first case is traced (not run) with `pallas_call` watched:
each SSD kernel's call is kept (kernel, grid, block specs, and its operands' shapes and dtypes).
Each kernel then runs alone on random operands of those shapes (floats `N(0, 0.5)`, integers
zero: one segment) under every candidate `(num_warps, num_stages)`, its outputs compared with
those of Pallas's default launch (4 warps, 3 stages; the largest difference relative to the
output's largest value: the launch changes how a product's sums are split, not what they are),
and timed in interleaved rounds (`axkern.bench.time_rounds`, the candidates in a fresh random
order each round; the row's `ms` the median of the rounds' medians, `ratio_to_default` the
median over rounds of its time over the default's in the same round).

Run on a CUDA GPU from the repository root:

    OUT=<folder> python3 benchmarks/diagnostics/triton_launch_sweep.py mamba3 mamba3_2.7b ssd mamba2_2.7b

(pairs of op and preset; `--tokens 4096` by default), writes `$OUT/sweep_triton_launch.json`
after each kernel.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas
from jax.experimental.pallas import triton as pltriton

from axkern import bench

COMMAND = "OUT=<folder> python3 benchmarks/diagnostics/triton_launch_sweep.py"
DEFAULT = (4, 3)
DOT_CANDIDATES = [(4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (8, 3), (16, 2)]
LOOP_CANDIDATES = [(1, 1), (2, 1), (4, 1), (4, 3), (8, 1), (8, 3)]


def captured_calls(op: str, preset: str, tokens: int, impl: str) -> tuple[str, dict]:
    """`(case label, {kernel name: (kernel, pallas_call keywords, operand shapes)})` of the SSD
    kernels the case's forward+backward launches."""
    case = bench.cases_for(op, preset=preset, tokens=tokens)[0]
    args = case.make(jax.random.PRNGKey(0))
    calls = {}
    real = pallas.pallas_call

    def spy(kernel, **kw):
        launch = real(kernel, **kw)

        def run(*operands):
            name = kw.get("name") or ""
            if name.startswith("axkern_ssd") and name not in calls:
                shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in operands]
                calls[name] = (kernel, kw, shapes)
            return launch(*operands)

        return run

    pallas.pallas_call = spy
    try:
        both = jax.jit(bench.forward_backward(case, impl))
        both.lower(bench.cotangent(case, args), *args)
    finally:
        pallas.pallas_call = real
    return case.label, calls


def operands(shapes, key):
    out = []
    for i, s in enumerate(shapes):
        if jnp.issubdtype(s.dtype, jnp.floating):
            out.append(
                (0.5 * jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32)).astype(s.dtype)
            )
        else:
            out.append(jnp.zeros(s.shape, s.dtype))
    return out


def launcher(kernel, kw, warps, stages):
    kw = dict(kw, compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages))
    return jax.jit(pallas.pallas_call(kernel, **kw))


def rel_diff(a, b) -> float:
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        worst = max(worst, float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30)))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", nargs="+", help="op preset [op preset ...]")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--impl", default="pallas_gpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kernels", default="", help="comma-separated kernel names to keep (default: all)")
    a = p.parse_args()
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    out = {
        "command": f"{COMMAND} {' '.join(a.pairs)}"
        + (f" --tokens {a.tokens}" if a.tokens != 4096 else "")
        + (f" --rounds {a.rounds}" if a.rounds != 5 else "")
        + (f" --kernels {a.kernels}" if a.kernels else ""),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "default": list(DEFAULT),
        "rows": [],
    }
    keep = set(filter(None, a.kernels.split(",")))
    rng = random.Random(0)
    for op, preset in zip(a.pairs[::2], a.pairs[1::2], strict=True):
        label, calls = captured_calls(op, preset, a.tokens, a.impl)
        for name, (kernel, kw, shapes) in calls.items():
            if keep and name not in keep:
                continue
            args = operands(shapes, jax.random.PRNGKey(1))
            loop = "recurrence" in name
            fns, diffs, errors = {}, {}, {}
            ref = launcher(kernel, kw, *DEFAULT)(*args)
            for cand in LOOP_CANDIDATES if loop else DOT_CANDIDATES:
                tag = f"{cand[0]}x{cand[1]}"
                try:
                    fn = launcher(kernel, kw, *cand)
                    diffs[tag] = rel_diff(fn(*args), ref)
                    fns[tag] = fn
                except Exception as e:  # noqa: BLE001 - a launch that does not compile is a row
                    errors[tag] = f"{type(e).__name__}: {str(e)[:200]}"
            _, medians = bench.time_rounds(fns, args, rounds=a.rounds, repeats=3, rng=rng)
            base = medians["4x3"]
            for tag in list(fns) + list(errors):
                row = {"op": op, "case": label, "kernel": name, "launch": tag}
                if tag in errors:
                    row["error"] = errors[tag]
                else:
                    row["ms"] = statistics.median(medians[tag])
                    row["ratio_to_default"] = statistics.median(
                        t / b for t, b in zip(medians[tag], base, strict=True)
                    )
                    row["max_rel_diff_to_default"] = diffs[tag]
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
            (folder / "sweep_triton_launch.json").write_text(json.dumps(out, indent=1) + "\n")
            del args, ref, fns


if __name__ == "__main__":
    main()
