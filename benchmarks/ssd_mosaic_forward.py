"""Two of SSD's `mosaic_gpu` forms against each other on one GPU (by default the forward in
three stages against the fused kernel): forward and forward+backward (random cotangent) of the
Mamba-2 2.7B layer at each length, timed in shuffled rounds (`bench.time_rounds`), with the
largest difference between the two forms' outputs and gradients relative to their largest
magnitude. Forms: `stages`, `fused`, `fused_group_sums` (the fused forward, `dB` and `dC`
summed in the backward kernels), `fused_transposes` (`x`, `y`, `dy`, `dx` in the caller's layout
in the kernels), `fused_backward` (the reverse recurrence and the chunk states' backward as one
kernel), `fused_sums_transposes` (the first two: the default), `fused_all` (all three),
`stages_sums_transposes` (the three stages with the first two), `chunk128` (the default at chunks
of 128, by tiles of 64 rows), `chunk128_stages` (`stages_sums_transposes` at chunks of 128),
`lean` (the lean chunk-scan backward), `lean_forward` (the lean fused forward), `lean_both` (the
two), `lean_state_backward` (the lean forward and the lean fused state backward), `lean_all`
(the three lean kernels), `state_columns` (the lean forward and the lean fused state backward a
block per 64 of the state's columns), `group_scores` (`lean_both` with `dg` summed per group in
the chunk-scan backward), `scores_columns` (that with `state_columns`' state backward),
`unguarded` (`group_scores` with the layer's finiteness check and its conditional taken out: the
predicate a constant, so XLA keeps the fast branch alone; wrong where an input is not finite, a
diagnostic of what the guard costs on finite inputs).

    OUT=<folder> python3 benchmarks/ssd_mosaic_forward.py [--lengths 2048,4096,16384] [--rounds 5]
        [--forms stages,fused]

writes `$OUT/sweep_mosaic_forward.json` (other forms: `sweep_mosaic_<base>_<new>.json`; `--forms`
may name more than two, each timed against the first in the same shuffled rounds,
`sweep_mosaic_<base>_<new>_<new>....json`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from axkern import bench
from axkern.ops.ssd import SSDBlockSizes
from axkern.ops.ssd.arg_specs import case
from axkern.ops.chunked import chunks
from axkern.positional import ssd

FORMS = {
    "stages": SSDBlockSizes(chunk_size=64, forward="stages"),
    "fused": SSDBlockSizes(chunk_size=64, forward="fused"),
    "fused_group_sums": SSDBlockSizes(chunk_size=64, forward="fused", group_sums="kernels"),
    "fused_transposes": SSDBlockSizes(chunk_size=64, forward="fused", transposes="kernels"),
    "fused_backward": SSDBlockSizes(chunk_size=64, forward="fused", backward="fused"),
    "fused_sums_transposes": SSDBlockSizes(64, "fused", group_sums="kernels", transposes="kernels"),
    "fused_all": SSDBlockSizes(64, "fused", group_sums="kernels", transposes="kernels", backward="fused"),
    "stages_sums_transposes": SSDBlockSizes(64, "stages", group_sums="kernels", transposes="kernels"),
    "chunk128": SSDBlockSizes(128, "fused", group_sums="kernels", transposes="kernels"),
    "chunk128_stages": SSDBlockSizes(128, "stages", group_sums="kernels", transposes="kernels"),
    "lean": SSDBlockSizes(64, "fused", group_sums="kernels", transposes="kernels", scan_backward="lean"),
    "lean_forward": SSDBlockSizes(64, "lean", group_sums="kernels", transposes="kernels"),
    "lean_both": SSDBlockSizes(64, "lean", group_sums="kernels", transposes="kernels", scan_backward="lean"),
    "lean_state_backward": SSDBlockSizes(
        64, "lean", group_sums="kernels", transposes="kernels", backward="lean"
    ),
    "lean_all": SSDBlockSizes(64, "lean", "kernels", "kernels", backward="lean", scan_backward="lean"),
    "state_columns": SSDBlockSizes(64, "lean", "kernels", "kernels", backward="columns"),
    "group_scores": SSDBlockSizes(64, "lean", "scores", "kernels", scan_backward="lean"),
    "scores_columns": SSDBlockSizes(
        64, "lean", "scores", "kernels", backward="columns", scan_backward="lean"
    ),
}
FORMS["unguarded"] = FORMS["group_scores"]
UNGUARDED = {"unguarded"}


@contextlib.contextmanager
def unguarded(form: str):
    """While tracing an `UNGUARDED` form: the layer's finiteness check a constant `True`."""
    if form not in UNGUARDED:
        yield
        return
    saved = chunks.all_finite
    chunks.all_finite = lambda *arrays: jnp.bool_(True)
    try:
        yield
    finally:
        chunks.all_finite = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--forms", default="stages,fused", help="the base form, then those timed against it")
    a = p.parse_args()
    forms = tuple(a.forms.split(","))
    base, others = forms[0], forms[1:]
    if len(forms) < 2 or len(set(forms)) < len(forms) or set(forms) - set(FORMS):
        raise SystemExit(f"--forms: a base and at least one other, each once, of {', '.join(FORMS)}")
    out = {
        "command": (f"XLA_FLAGS={os.environ['XLA_FLAGS']!r} " if os.environ.get("XLA_FLAGS") else "")
        + f"OUT=<folder> python3 benchmarks/ssd_mosaic_forward.py --lengths {a.lengths} --rounds {a.rounds}"
        + ("" if a.forms == "stages,fused" else f" --forms {a.forms}"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "rows": [],
    }
    for length in (int(v) for v in a.lengths.split(",")):
        c = case("mamba2_2.7b", 4, length, 80, 64, 128, 1, 256, jnp.dtype("bfloat16"))
        args = c.make(jax.random.PRNGKey(0))
        ct = jax.random.normal(jax.random.PRNGKey(7), args[0].shape, jnp.float32).astype(args[0].dtype)

        def forward(form):
            blocks = FORMS[form]

            def run(x, dt, A, B, C):
                with unguarded(form):
                    return ssd(
                        x, dt, A, B, C, dt_softplus=True, implementation="mosaic_gpu", block_sizes=blocks
                    )

            return run

        def both(form):
            f = forward(form)

            def run(cot, *a):
                y, pull = jax.vjp(lambda x, dt, B, C: f(x, dt, a[2], B, C), a[0], a[1], a[3], a[4])
                return y, pull(cot)

            return run

        fns = {(form, "fwd"): jax.jit(forward(form)) for form in forms}
        fns |= {(form, "fwd+bwd"): jax.jit(both(form)) for form in forms}
        diff = {}
        for pass_, new in itertools.product(("fwd", "fwd+bwd"), others):
            fn_args = args if pass_ == "fwd" else (ct, *args)
            got = jax.tree.leaves(fns[new, pass_](*fn_args))
            want = jax.tree.leaves(fns[base, pass_](*fn_args))
            diff[pass_, new] = max(
                float(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)).max())
                / max(float(np.abs(np.asarray(w, np.float64)).max()), 1e-30)
                for g, w in zip(got, want, strict=True)
            )
        for pass_ in ("fwd", "fwd+bwd"):
            fn_args = args if pass_ == "fwd" else (ct, *args)
            keyed = {form: fns[form, pass_] for form in forms}
            samples, medians = bench.time_rounds(keyed, fn_args, rounds=a.rounds)
            row = {"case": c.label, "pass": pass_} | {f"{f}_ms": statistics.median(medians[f]) for f in forms}
            for new in others:  # (each round's ratio, their median)
                ratios = (f / s for f, s in zip(medians[new], medians[base], strict=True))
                row[f"{new}_over_{base}"] = statistics.median(ratios)
            # the largest difference from the base form's outputs (and gradients): one form's, or each's
            diffs = {new: diff[pass_, new] for new in others}
            row["max_rel_diff"] = diffs[others[0]] if len(others) == 1 else diffs
            row["samples_ms"] = {form: samples[form] for form in keyed}
            print(json.dumps({k: v for k, v in row.items() if k != "samples_ms"}), flush=True)
            out["rows"].append(row)
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    name = "sweep_mosaic_forward" if a.forms == "stages,fused" else "sweep_mosaic_" + "_".join(forms)
    (folder / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
