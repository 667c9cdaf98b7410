"""What `bench.time_spread` adds to the device's time (a diagnostic): calls of about 2 ms (a
bf16 matrix product; the `mosaic_gpu` and `cudnn` attention forwards without the guard, B=2
L=8192 H=32 D=128 causal) timed by `time_spread` with samples of about 20 ms and of about 200 ms
of calls, and their kernels' busy time per call over back-to-back calls under PyTorch's profiler
(`kernel_times.profile`, 20 calls). A per-call time above the busy time that shrinks with longer
samples is the cost of each sample's synchronisation, one that stays the host's dispatch, and
one that grows with longer samples the chip's clock falling under sustained load (what the
H200 showed: `benchmarks/results/nvidia_h200/attention/sweep_timing_overhead.json`).

    OUT=<folder> python3 benchmarks/timing_overhead.py

writes `$OUT/timing_overhead.json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from axkern import masks
from axkern.bench import time_spread
from axkern.ops.attention.mosaic_gpu import forward_kernel

sys.path.append(str(Path(__file__).parent))
from kernel_times import profile  # noqa: E402
from records import header, write  # noqa: E402

B, S, H, D = 2, 8192, 32, 128


def main():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in keys)
    a = jax.random.normal(keys[0], (8192, 8192), jnp.bfloat16)
    scale = D**-0.5
    calls = {
        "matmul": (jax.jit(lambda a: a @ a), (a,)),
        "mosaic_gpu": (
            jax.jit(
                lambda q, k, v: forward_kernel.forward(
                    q,
                    k,
                    v,
                    masks.Causal(),
                    scale=scale,
                    block_q=64,
                    block_kv=128,
                    num_stages=2,
                    handoff=True,
                    overlap=True,
                )
            ),
            (q, k, v),
        ),
        "cudnn": (
            jax.jit(
                lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            ),
            (q, k, v),
        ),
    }
    out = header("timing_overhead.py", rows=[])
    for name, (fn, args) in calls.items():
        row = {"call": name}
        for batch_s in (0.02, 0.2):
            lo, mid, hi = time_spread(fn, args, repeats=7, batch_s=batch_s)
            row[f"ms_samples_{int(batch_s * 1e3)}ms"] = {"ms": mid, "ms_min": lo, "ms_max": hi}
        _, line = profile(fn, args, calls=20)
        row["busy_ms_per_call"] = line["busy_ms_per_call"]
        row["window_ms_per_call"] = line["window_ms_per_call"]
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    write(out, "timing_overhead.json")


if __name__ == "__main__":
    main()
