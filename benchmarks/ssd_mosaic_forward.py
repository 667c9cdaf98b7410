"""SSD's `mosaic_gpu` forward in three stages against the fused kernel, on one GPU: forward and
forward+backward (random cotangent) of the Mamba-2 2.7B layer at each length, timed in
shuffled rounds (`bench.time_rounds`), with the largest difference between the two forms'
outputs and gradients relative to their largest magnitude.

    OUT=<folder> python3 benchmarks/ssd_mosaic_forward.py [--lengths 2048,4096,16384] [--rounds 5]

writes `$OUT/sweep_mosaic_forward.json`.
"""

from __future__ import annotations

import argparse
import datetime
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
from axkern.positional import ssd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    out = {
        "command": f"OUT=<folder> python3 benchmarks/ssd_mosaic_forward.py --lengths {a.lengths} --rounds {a.rounds}",
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
            blocks = SSDBlockSizes(chunk_size=64, forward=form)
            return lambda x, dt, A, B, C: ssd(
                x, dt, A, B, C, dt_softplus=True, implementation="mosaic_gpu", block_sizes=blocks
            )

        def both(form):
            f = forward(form)

            def run(cot, *a):
                y, pull = jax.vjp(lambda x, dt, B, C: f(x, dt, a[2], B, C), a[0], a[1], a[3], a[4])
                return y, pull(cot)

            return run

        fns = {(form, "fwd"): jax.jit(forward(form)) for form in ("stages", "fused")}
        fns |= {(form, "fwd+bwd"): jax.jit(both(form)) for form in ("stages", "fused")}
        diff = {}
        for pass_ in ("fwd", "fwd+bwd"):
            fn_args = args if pass_ == "fwd" else (ct, *args)
            got = jax.tree.leaves(fns["fused", pass_](*fn_args))
            want = jax.tree.leaves(fns["stages", pass_](*fn_args))
            diff[pass_] = max(
                float(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)).max())
                / max(float(np.abs(np.asarray(w, np.float64)).max()), 1e-30)
                for g, w in zip(got, want, strict=True)
            )
        for pass_ in ("fwd", "fwd+bwd"):
            fn_args = args if pass_ == "fwd" else (ct, *args)
            keyed = {form: fns[form, pass_] for form in ("stages", "fused")}
            samples, medians = bench.time_rounds(keyed, fn_args, rounds=a.rounds)
            ratio = statistics.median(f / s for f, s in zip(medians["fused"], medians["stages"], strict=True))
            row = {
                "case": c.label,
                "pass": pass_,
                "stages_ms": statistics.median(medians["stages"]),
                "fused_ms": statistics.median(medians["fused"]),
                "fused_over_stages": ratio,
                "max_rel_diff": diff[pass_],
                "samples_ms": {form: samples[form] for form in keyed},
            }
            print(json.dumps({k: v for k, v in row.items() if k != "samples_ms"}), flush=True)
            out["rows"].append(row)
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep_mosaic_forward.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
