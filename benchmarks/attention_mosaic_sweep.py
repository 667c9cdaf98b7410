"""The `mosaic_gpu` backward kernels' tiles on the H200: forward+backward time of the Mosaic
forward and backward kernels (unguarded: `mosaic_gpu.attention` called directly) for each
backward tiling, beside cuDNN (`jax.nn.dot_product_attention`, unguarded) in the same run, with
each gradient's largest difference from cuDNN's relative to cuDNN's largest (a sanity check; the
oracle rule is the GPU tests'). Median of three interleaved rounds of 5 repeats.

Run on a CUDA machine from the repository root: `OUT=<folder> python3 benchmarks/attention_mosaic_sweep.py`
(writes `sweep_mosaic_backward.json`). With `--head-dim-256`: the head dim 256 backward, the
Mosaic kernels' one tiling beside `pallas_gpu`'s Triton `dq` and `dk, dv` kernels on the Mosaic
forward's residuals for each of `TILES_256` (block_q, block_kv, warps, stages per kernel),
causal H32 (writes `sweep_mosaic_backward_d256.json`). With `--dq-by-reduction`: the heuristic's
tiling with `dq` by its own kernel against `dq_by="reduction"` (the `dk, dv` kernel adding each
tile's `dq` share by TMA reductions), each case of `CASES` (writes
`sweep_mosaic_dq_by_reduction.json`)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

from axkern import masks
from axkern.bench import time_spread
from axkern.ops.attention import mosaic_gpu, pallas_gpu
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
# head dim 256: pallas_gpu's kernels, (dq: block_q, block_kv, warps, stages), (dk, dv: the same);
# the last, the Mosaic kernels' (block_q, block_kv, stages)
TILES_256 = [
    ((32, 32, 4, 2), (32, 32, 4, 2)),
    ((128, 32, 8, 2), (64, 32, 4, 2)),
    ((128, 32, 8, 2), (64, 32, 8, 2)),
    ((128, 32, 8, 2), (128, 32, 8, 2)),
    ((128, 32, 8, 3), (64, 32, 4, 3)),
    ((128, 64, 8, 2), (64, 32, 4, 2)),
    ((64, 32, 4, 2), (64, 32, 4, 2)),
    ((128, 32, 8, 2), (32, 32, 4, 2)),
    ((128, 32, 4, 2), (64, 32, 4, 2)),
    ((64, 64, 8, 2), (64, 32, 4, 2)),
    ((64, 64, 1), (64, 64, 1)),  # the Mosaic kernels (one ring stage fits at head dim 256)
]
# name: (kv heads, head dim, mask, every tiling or the first only)
CASES = {
    "causal H32 D128": (32, 128, "causal", True),
    "full H32 D128": (32, 128, "full", True),
    "causal H32/8 D128": (8, 128, "causal", False),
    "causal H32 D64": (32, 64, "causal", False),
}


def blocks(dq, dkv, d=128) -> AttentionBlockSizes:
    """The forward's heuristic tiles at head dim `d` with these backward tiles: `(block_q,
    block_kv, stages)` each for the Mosaic kernels, `(block_q, block_kv, warps, stages)` for
    `pallas_gpu`'s."""
    if len(dq) == 4:  # pallas_gpu's tiles, with warps
        warps = dict(num_warps_dq=dq[2], num_warps_dkv=dkv[2])
        dq, dkv = (t[:2] + t[3:] for t in (dq, dkv))
    else:
        warps = {}
    return AttentionBlockSizes(
        block_q=64,
        block_kv=128 if d <= 128 else 64,
        num_stages=2,
        block_q_dq=dq[0],
        block_kv_dq=dq[1],
        num_stages_dq=dq[2],
        block_q_dkv=dkv[0],
        block_kv_dkv=dkv[1],
        num_stages_dkv=dkv[2],
        **warps,
    )


def attend(q, k, v, *, bs, mask, scale):
    """The Mosaic forward and its backward: the Mosaic kernels where `bs` names their tiles (no
    warps; at head dim 256 `dq`, then `dv` and `dk` in two launches), else `pallas_gpu`'s."""
    backward = None
    if bs.num_warps_dq is not None:
        # pallas_gpu.backward's block sizes: the forward fields repeat dq's (they set the padding)
        back = dataclasses.replace(
            bs,
            block_q=bs.block_q_dq,
            block_kv=bs.block_kv_dq,
            num_warps=bs.num_warps_dq,
            num_stages=bs.num_stages_dq,
        )
        backward = functools.partial(pallas_gpu.backward, scale=scale, block_sizes=back, logits_soft_cap=None)
    return mosaic_gpu.attention(
        q, k, v, None, mask, scale=scale, logits_soft_cap=None, block_sizes=bs, backward=backward
    )


def main():
    wide = "--head-dim-256" in sys.argv[1:]
    reduction = "--dq-by-reduction" in sys.argv[1:]
    cases, tilings = ({"causal H32 D256": (32, 256, "causal", True)}, TILES_256) if wide else (CASES, TILES)
    rows = []
    for name, (kvh, d, mask_name, every) in cases.items():
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
        for dq, dkv in tilings if every and not reduction else tilings[2:3] if reduction else tilings[:1]:
            fns[f"mosaic dq {dq} dkv {dkv}"] = functools.partial(
                attend, bs=blocks(dq, dkv, d), mask=mask, scale=scale
            )
            if reduction:
                bs = dataclasses.replace(blocks(dq, dkv, d), dq_by="reduction")
                fns[f"mosaic dkv {dkv} dq by reduction"] = functools.partial(
                    attend, bs=bs, mask=mask, scale=scale
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
        "command": "OUT=<folder> python3 benchmarks/attention_mosaic_sweep.py"
        + (" --head-dim-256" if wide else "")
        + (" --dq-by-reduction" if reduction else ""),
        "shape": {"batch": B, "length": S, "heads": H, "dtype": "bfloat16"},
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "rows": rows,
    }
    out = "sweep_mosaic_backward_d256.json" if wide else "sweep_mosaic_backward.json"
    out = "sweep_mosaic_dq_by_reduction.json" if reduction else out
    with open(os.path.join(os.environ.get("OUT", "."), out), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
