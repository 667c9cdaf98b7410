"""The Mosaic GPU attention forward's launch order on the H200: the grid's fastest axis heads (the
blocks running at once spread over every head, each head's keys and values read by a few of
them) or query blocks (`forward_kernel.forward(..., q_major=True)`: the blocks running at once
walk one or two heads' query blocks, which share those heads' keys and values in L2). The
kernel called directly (no guard) with the H200 table's tiles and ping-pong for each case,
B2 S8192 H32 bf16; five rounds, both orders in a fresh random order each round (3 repeats an
order a round); each row has the median of its samples, its TFLOP/s over the visible (query,
key) pairs, and `ratio`, the median over rounds of the heads-first time over the query-first
time (above 1: query-first is faster). The outputs of both orders are compared (they must be
equal: the order only moves work between blocks).

Writes `$OUT/sweep_mosaic_grid_order.json`. Run on a Hopper GPU from the repository root:
`OUT=<folder> python3 benchmarks/attention_mosaic_grid_order.py`.
"""

from __future__ import annotations

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
from axkern.ops.attention.mosaic_gpu import forward_kernel

COMMAND = "OUT=<folder> python3 benchmarks/attention_mosaic_grid_order.py"
B, S, H = 2, 8192, 32
_IDS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) // 1024, (B, S))
# name: (kv heads, head dim, mask, visible pairs per (batch, head), (block_q, block_kv, stages, ping-pong))
CASES = {
    "causal D128": (32, 128, masks.Causal(), S * (S + 1) // 2, (64, 128, 2, "overlap")),
    "window1024 D128": (32, 128, masks.SlidingWindow(1024), None, (64, 128, 2, "rendezvous")),
    "docs1024 D128": (
        32,
        128,
        masks.Causal() & masks.Segments(_IDS, _IDS),
        8 * 1024 * 1025 // 2,
        (64, 128, 2, "rendezvous"),
    ),
    "causal H32/8 D128": (8, 128, masks.Causal(), S * (S + 1) // 2, (64, 128, 2, "overlap")),
    "causal D64": (32, 64, masks.Causal(), S * (S + 1) // 2, (64, 128, 3, "rendezvous")),
    "full D128": (32, 128, masks.Full(), S * S, (64, 128, 2, "overlap")),
}
_FORMS = {"rendezvous": {}, "overlap": {"handoff": True, "overlap": True}}


def _window_pairs(w: int) -> int:
    return sum(min(i + 1, w) for i in range(S))  # `i - w < j <= i`


def main() -> None:
    out = {
        "command": COMMAND,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "shape": f"B{B} S{S} H{H} bf16",
        "rows": [],
    }
    folder = os.environ.get("OUT", ".")
    for name, (kvh, d, mask, pairs, (bq, bk, stages, form)) in CASES.items():
        pairs = pairs or _window_pairs(1024)
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(keys[0], (B, S, H, d), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (B, S, kvh, d), jnp.bfloat16) for kk in keys[1:])
        call = functools.partial(
            forward_kernel.forward,
            mask=mask,
            scale=d**-0.5,
            block_q=bq,
            block_kv=bk,
            num_stages=stages,
            **_FORMS[form],
        )
        fns = {
            order: jax.jit(functools.partial(call, q_major=order == "q_major"))
            for order in ("heads", "q_major")
        }
        outs = {o: f(q, k, v) for o, f in fns.items()}
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(outs["heads"], outs["q_major"], strict=True))
        samples, medians = time_rounds(fns, (q, k, v), rounds=5, rng=random.Random(0))
        ratio = statistics.median(h / m for h, m in zip(medians["heads"], medians["q_major"], strict=True))
        for order in fns:
            ms = statistics.median(samples[order])
            row = {
                "case": name,
                "order": order,
                "tiles": f"{bq}x{bk}x{stages} {form}",
                "median_ms": ms,
                "min_ms": min(samples[order]),
                "max_ms": max(samples[order]),
                "tflops": 4 * B * H * d * pairs / ms / 1e9,
                "ratio": ratio,
                "outputs_equal": same,
            }
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
        with open(os.path.join(folder, "sweep_mosaic_grid_order.json"), "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
