"""Where does the `pallas_gpu` SSD forward+backward spend its time, kernel by kernel? (a
diagnostic, not a benchmark table)

    python benchmarks/ssd_profile.py --json out.json [--chunk 64,128] [--num-warps 4,8]

The Mamba-2 2.7B layer (B=4 L=4096 H=80 P=64 N=128, bf16): the output and the pull-back of a
random cotangent, as `axkern bench` times it, once per chunk size. Each is timed whole
(`time_ms`), then run a few times under PyTorch's profiler, whose CUPTI activity trace sees
every GPU kernel of the process (XLA's and Triton's too): the rows are the kernels' total
device time per call, largest first, by name (Pallas kernels keep their Python names; XLA's
fusions are grouped by their name without the trailing number). Needs torch with CUDA.
"""

from __future__ import annotations

import argparse
import collections
import json
import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from axkern.bench import time_ms
from axkern.ops.ssd import pallas_gpu
from axkern.ops.ssd.arg_specs import cases
from axkern.ops.ssd.blocks import SSDBlockSizes
from axkern.positional import ssd


def _profile(fn, args, calls):
    import torch
    from torch.profiler import ProfilerActivity, profile

    jax.block_until_ready(fn(*args))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        torch.cuda.synchronize()
    totals, counts = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = re.sub(r"[._]\d+$", "", e.name)
        totals[name] += (getattr(e, "device_time", None) or e.cuda_time) / 1e3 / calls  # us -> ms per call
        counts[name] += 1 / calls
    return [{"kernel": k, "ms_per_call": v, "launches_per_call": counts[k]} for k, v in totals.most_common()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--chunk", default="64,128")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument(
        "--num-warps",
        default="",
        help="Triton warps for the four chunk kernels, e.g. 4,8 (default: the shipped; the recurrence kernels keep theirs)",
    )
    p.add_argument("--json")
    a = p.parse_args()
    c = cases(preset="mamba2_2.7b")[0]
    x, dt, A, B, C = c.make(jax.random.PRNGKey(0))
    dy = jax.random.normal(jax.random.PRNGKey(9), x.shape, jnp.float32).astype(x.dtype)
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "case": c.label, "runs": []}
    shipped = pallas_gpu.GpuLayout.call_params
    variants = [
        (q, w)
        for q in (int(s) for s in a.chunk.split(","))
        for w in (a.num_warps.split(",") if a.num_warps else [""])
    ]
    for q, warps in variants:
        if warps:
            pallas_gpu.GpuLayout.call_params = lambda self, w=int(warps): {
                "interpret": self.interpret,
                "compiler_params": plgpu.CompilerParams(num_warps=w),
            }
        else:
            pallas_gpu.GpuLayout.call_params = shipped

        def f(x, dt, A, B, C, q=q):
            return ssd(
                x, dt, A, B, C, dt_softplus=True, implementation="pallas_gpu", block_sizes=SSDBlockSizes(q)
            )

        def f_and_back(dy, *args, f=f):
            y, pull = jax.vjp(f, *args)
            return y, pull(dy)

        fwd, both = jax.jit(f), jax.jit(f_and_back)
        run = {"chunk": q, "num_warps": warps or "shipped"}
        try:
            run["fwd_ms"] = time_ms(fwd, (x, dt, A, B, C), repeats=5)
            run["ms"] = time_ms(both, (dy, x, dt, A, B, C), repeats=5)
        except Exception as e:  # noqa: BLE001 - report and go on
            run["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        else:
            try:
                run["kernels"] = _profile(both, (dy, x, dt, A, B, C), a.calls)
                run["kernels_total_ms"] = sum(r["ms_per_call"] for r in run["kernels"])
            except Exception as e:  # noqa: BLE001 - the profile is optional
                run["profile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps({k: v for k, v in run.items() if k != "kernels"}), flush=True)
        for r in run.get("kernels", [])[:25]:
            print(
                f"  {r['ms_per_call']:8.3f} ms  x{r['launches_per_call']:6.1f}  {r['kernel'][:100]}",
                flush=True,
            )
        out["runs"].append(run)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
