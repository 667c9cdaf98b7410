"""The `mosaic_gpu` backward kernels' tiles on the H200: forward+backward time of the Mosaic
forward and backward kernels (unguarded: `mosaic_gpu.attention` called directly) for each
backward tiling, beside cuDNN (`jax.nn.dot_product_attention`, unguarded) in the same run, with
each gradient's largest difference from cuDNN's relative to cuDNN's largest (a sanity check; the
oracle rule is the GPU tests'). Median of three interleaved rounds of 5 repeats.

Run on a CUDA machine from the repository root: `OUT=<folder> python3 benchmarks/attention_mosaic_sweep.py`
(writes `sweep_mosaic_backward.json`)."""

from __future__ import annotations

import datetime
import json
import os

import jax
import jax.numpy as jnp

from axkern import masks
from axkern.bench import time_spread
from axkern.ops.attention import mosaic_gpu
from axkern.ops.attention.blocks import AttentionBlockSizes

B, S, H = 2, 8192, 32
# (dq: block_q, block_kv, stages), (dk, dv: block_q, block_kv, stages)
TILES = [
    ((64, 64, 2), (64, 64, 2)),
    ((64, 64, 3), (64, 64, 2)),
    ((64, 128, 2), (64, 64, 2)),
    ((64, 64, 2), (128, 64, 2)),
    ((64, 64, 2), (64, 64, 3)),
    ((64, 128, 2), (128, 64, 2)),
]
# name: (kv heads, head dim, mask, every tiling or the first only)
CASES = {
    "causal H32 D128": (32, 128, "causal", True),
    "full H32 D128": (32, 128, "full", True),
    "causal H32/8 D128": (8, 128, "causal", False),
    "causal H32 D64": (32, 64, "causal", False),
}


def blocks(dq, dkv) -> AttentionBlockSizes:
    return AttentionBlockSizes(
        block_q=64,
        block_kv=128,
        num_stages=2,
        block_q_dq=dq[0],
        block_kv_dq=dq[1],
        num_stages_dq=dq[2],
        block_q_dkv=dkv[0],
        block_kv_dkv=dkv[1],
        num_stages_dkv=dkv[2],
    )


def main():
    rows = []
    for name, (kvh, d, mask_name, every) in CASES.items():
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q, do = (jax.random.normal(kk, (B, S, H, d), jnp.bfloat16) for kk in keys[:2])
        k, v = (jax.random.normal(kk, (B, S, kvh, d), jnp.bfloat16) for kk in keys[2:])
        mask = masks.Causal() if mask_name == "causal" else masks.Full()
        scale = d**-0.5

        def cudnn(q, k, v, causal=mask_name == "causal", scale=scale):
            return jax.nn.dot_product_attention(
                q, k, v, scale=scale, is_causal=causal, implementation="cudnn"
            )

        fns = {"cudnn": cudnn}
        for dq, dkv in TILES if every else TILES[:1]:
            fns[f"mosaic dq {dq} dkv {dkv}"] = lambda q, k, v, bs=blocks(dq, dkv), mask=mask, scale=scale: (
                mosaic_gpu.attention(q, k, v, None, mask, scale=scale, logits_soft_cap=None, block_sizes=bs)
            )
        jitted = {n: jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do)) for n, f in fns.items()}
        want = jitted["cudnn"](q, k, v, do)
        times = {n: [] for n in jitted}
        errs = {}
        for n, fn in jitted.items():
            try:
                got = fn(q, k, v, do)
                errs[n] = [
                    float(
                        jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                        / jnp.max(jnp.abs(w.astype(jnp.float32)))
                    )
                    for g, w in zip(got, want, strict=True)
                ]
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile: report, go on
                errs[n] = f"{type(e).__name__}: {str(e)[:200]}"
        live = {n: fn for n, fn in jitted.items() if not isinstance(errs[n], str)}
        for _ in range(3):  # interleaved: all see the same clocks
            for n, fn in live.items():
                times[n].append(time_spread(fn, (q, k, v, do), repeats=5))
        for n in jitted:
            t = times[n]
            row = dict(case=name, implementation=n, pass_="fwd+bwd")
            if t:
                row |= dict(
                    median_ms=sorted(x[1] for x in t)[1],
                    min_ms=min(x[0] for x in t),
                    max_ms=max(x[2] for x in t),
                )
            row["grad_rel_diff_vs_cudnn" if not isinstance(errs[n], str) else "error"] = errs[n]
            rows.append(row)
            print(row, flush=True)
    result = {
        "command": "OUT=<folder> python3 benchmarks/attention_mosaic_sweep.py",
        "shape": {"batch": B, "length": S, "heads": H, "dtype": "bfloat16"},
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "rows": rows,
    }
    with open(os.path.join(os.environ.get("OUT", "."), "sweep_mosaic_backward.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
