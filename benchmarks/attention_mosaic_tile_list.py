"""The Mosaic GPU attention kernels under a mask whose blocks see two parts of the keys with a gap
between them (each query's 1024 keys up to it, and every key 4096 or more behind it:
`SlidingWindow(1024) | Causal(offset=-4096)`), on the H200: the schedule's tile list (the blocks
walk only the tiles they see; the default) against the same kernels walking each block's range
from its first to its last seen tile (the schedule built with `has_gaps` answering False: the
gap's empty tiles loaded and masked), and causal beside them for the rate over visible pairs.
B2 S8192 H32 D128 bf16, the heuristic's tiles; forward and forward+backward (`mosaic_gpu.attention`,
the kernels called directly, no guard); five rounds in a fresh random order each (3 repeats a
form a round); each row has the median, its TFLOP/s over the visible (query, key) pairs, and
`ratio`, the median over rounds of the ranges' time over the list's. The outputs and gradients
of both forms are compared (they must be equal: an empty tile adds exact zeros).

Writes `$OUT/sweep_mosaic_tile_list.json`. Run on a Hopper GPU from the repository root:
`OUT=<folder> python3 benchmarks/attention_mosaic_tile_list.py`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import random
import statistics

import jax
import jax.numpy as jnp

from axkern import masks
from axkern.bench import time_rounds
from axkern.ops.attention import OP, mosaic_gpu
from axkern.ops.attention.blocks import mask_kind, mosaic_gpu_heuristic
from axkern.ops.attention.mosaic_gpu import schedules

COMMAND = "OUT=<folder> python3 benchmarks/attention_mosaic_tile_list.py"
B, S, H, D = 2, 8192, 32, 128
W, FAR = 1024, 4096
CASES = {
    "window1024 | far keys": masks.SlidingWindow(W) | masks.Causal(offset=-FAR),
    "causal": masks.Causal(),
}


def _pairs(name: str) -> int:
    if name == "causal":
        return S * (S + 1) // 2
    return sum(min(i + 1, W) + max(0, i - FAR + 1) for i in range(S))  # the two parts are apart


@contextlib.contextmanager
def _ranges():
    """Schedules built without tile lists (as before them): each block's range of tiles."""
    saved = schedules.has_gaps
    schedules.has_gaps = lambda kinds, wgs=schedules.COMPUTE_WGS: False
    try:
        yield
    finally:
        schedules.has_gaps = saved


def _blocks(mask):
    """The heuristic's block sizes for the case (`mosaic_gpu_heuristic`: 64 x 128 tiles, two
    stages, the ping-pong by mask kind and head dim)."""
    dims = {"batch": B, "q_len": S, "kv_len": S, "heads": H, "kv_heads": H, "head_dim": D, "v_dim": D}
    return mosaic_gpu_heuristic(
        OP.spec(dims, jnp.bfloat16, soft_cap=False, sinks=False, mask_kind=mask_kind(mask))
    )


def main() -> None:
    out = {
        "command": COMMAND,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "shape": f"B{B} S{S} H{H} D{D} bf16",
        "rows": [],
    }
    folder = os.environ.get("OUT", ".")
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, d_out = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in keys)
    for name, mask in CASES.items():
        call = functools.partial(
            mosaic_gpu.attention,
            sinks=None,
            mask=mask,
            scale=D**-0.5,
            logits_soft_cap=None,
            block_sizes=(blocks := _blocks(mask)),
        )

        def fwd(q, k, v, do, call=call):
            return call(q, k, v)

        def fwd_bwd(q, k, v, do, call=call):
            out, vjp = jax.vjp(lambda q, k, v: call(q, k, v), q, k, v)
            return vjp(do)

        forms = (
            {"list": contextlib.nullcontext}
            if name == "causal"
            else {"list": contextlib.nullcontext, "ranges": _ranges}
        )
        for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            compiled, cols = {}, {}
            for form, ctx in forms.items():
                with ctx():
                    # a fresh function and no cached traces: each form builds its own schedule
                    jax.clear_caches()
                    compiled[form] = jax.jit(lambda *a, fn=fn: fn(*a)).lower(q, k, v, d_out).compile()
                    cols[form] = int(
                        mosaic_gpu.mask_schedule(mask, S, S, blocks.block_q, blocks.block_kv).shape[1]
                    )
            if "ranges" in cols:  # the comparison is list against ranges, or nothing
                assert cols["list"] > cols["ranges"] == schedules.LIST, cols
            results = {form: c(q, k, v, d_out) for form, c in compiled.items()}
            same = all(
                bool(jnp.array_equal(a, b))
                for a, b in zip(
                    jax.tree.leaves(results["list"]),
                    jax.tree.leaves(results.get("ranges", results["list"])),
                    strict=True,
                )
            )
            samples, medians = time_rounds(compiled, (q, k, v, d_out), rounds=5, rng=random.Random(0))
            ratio = (
                statistics.median(r / t for r, t in zip(medians["ranges"], medians["list"], strict=True))
                if "ranges" in compiled
                else None
            )
            flops = (4 if what == "fwd" else 14) * B * H * D * _pairs(name)
            for form in compiled:
                ms = statistics.median(samples[form])
                row = {
                    "case": name,
                    "pass": what,
                    "form": form,
                    "median_ms": ms,
                    "min_ms": min(samples[form]),
                    "max_ms": max(samples[form]),
                    "tflops": flops / ms / 1e9,
                    "forward_table_columns": cols[form],
                    "ratio_ranges_over_list": ratio,
                    "outputs_equal": same,
                }
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
            with open(os.path.join(folder, "sweep_mosaic_tile_list.json"), "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")


if __name__ == "__main__":
    main()
