"""Sweep `pallas_gpu` attention's tiles, warps and pipelining stages on this device, beside cuDNN.

    python benchmarks/sweep_attention.py --json out.json
    python benchmarks/tune_table.py --sweep out.json --op attention --impl pallas_gpu \
        --package axkern.ops.attention --device-key nvidia_h200 --source <committed json>

One shape (default: the issue's B=2, L=8192, 32 heads, head dim 128, causal, bf16). For
each (block_q, block_kv, num_warps, num_stages) of `pallas_gpu`: the forward and the
forward+backward (the output and the pull-back of a fixed random cotangent, as `axkern bench`
does), in ms and in TFLOP/s over the visible FLOPs, with the temporary memory of the
forward+backward; `cudnn` (where it can serve) and `xla` once each for the ratio. A candidate
that does not compile (shared memory, registers) is printed and skipped. `ms` in each row is
the forward+backward time (what `tune_table.py` minimises).

    python benchmarks/sweep_attention.py --per-kernel --fwd 128x64x4x2,... --dkv 32x128x4x2,... \
        --dq 128x32x4x2,... --json out.json

`--per-kernel`: each kernel's tiles on their own (`BQxBKxWARPSxSTAGES` candidates), one after
the other: the forward's by the forward's time (rows without `ms`), then the `dk, dv` kernel's
with the best forward (and `--dq`'s first candidate for `dq`), then the `dq` kernel's with both
best, by the forward+backward time; the last rows carry all three kernels' fields.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys

import jax
import jax.numpy as jnp

from axkern.bench import time_ms
from axkern.ops.attention.arg_specs import _mask, case
from axkern.positional import attention


def _ints(text):
    return [int(v) for v in text.split(",")]


KEYS = ("block_q", "block_kv", "num_warps", "num_stages")  # one kernel's fields, as BQxBKxWARPSxSTAGES


def _candidates(text):
    return [dict(zip(KEYS, (int(v) for v in c.split("x")), strict=True)) for c in text.split(",") if c]


def _kernel_fields(cand, kernel):
    return cand if kernel == "fwd" else {f"{k}_{kernel}": v for k, v in cand.items()}


def _measure_fwd(q, k, v, mask, bs):
    f = jax.jit(lambda q, k, v: attention(q, k, v, mask=mask, implementation="pallas_gpu", block_sizes=bs))
    return time_ms(f, (q, k, v))


def _measure(q, k, v, do, mask, impl, bs):
    def f(q, k, v):
        return attention(q, k, v, mask=mask, implementation=impl, block_sizes=bs)

    def f_and_back(do, q, k, v):
        o, pull = jax.vjp(f, q, k, v)
        return o, pull(do)

    back = jax.jit(f_and_back)
    temp = back.lower(do, q, k, v).compile().memory_analysis().temp_size_in_bytes / 2**30
    return time_ms(jax.jit(f), (q, k, v)), time_ms(back, (do, q, k, v)), temp


def _per_kernel(a, q, k, v, do, mask, record):
    fwd_rows = []
    for cand in _candidates(a.fwd):
        try:
            ms = _measure_fwd(q, k, v, mask, cand)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(json.dumps(cand), "failed", type(e).__name__, str(e)[:160], flush=True)
            continue
        row = {"impl": "pallas_gpu", "stage": "fwd"} | cand | {"fwd_ms": ms}
        print(json.dumps(row), flush=True)
        fwd_rows.append(row)
    if not fwd_rows:
        return fwd_rows
    best = {key: min(fwd_rows, key=lambda r: r["fwd_ms"])[key] for key in KEYS}
    best |= _kernel_fields(_candidates(a.dq)[0], "dq")
    for kernel in ("dkv", "dq"):
        timed = []
        for cand in _candidates(getattr(a, kernel)):
            bs = best | _kernel_fields(cand, kernel)
            try:
                measured = _measure(q, k, v, do, mask, "pallas_gpu", bs)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(json.dumps(bs), "failed", type(e).__name__, str(e)[:160], flush=True)
                continue
            record({"impl": "pallas_gpu", "stage": kernel} | bs, *measured)
            timed.append((measured[1], bs))
        if timed:
            best = min(timed, key=lambda t: t[0])[1]
    return fwd_rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mask", default="causal", help="causal, window1024 or docs1024")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-q", default="64,128")
    p.add_argument("--block-kv", default="32,64,128")
    p.add_argument("--num-warps", default="4,8")
    p.add_argument("--num-stages", default="2,3")
    p.add_argument("--peers", default="cudnn,xla", help="implementations timed once for the ratio")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--per-kernel", action="store_true", help="sweep --fwd, --dkv, --dq one after the other")
    p.add_argument("--fwd", default="128x64x4x2,64x64x4x2")
    p.add_argument("--dkv", default="32x128x4x2,64x64x4x2")
    p.add_argument("--dq", default="64x64x4x2,128x32x4x2")
    p.add_argument("--json")
    a = p.parse_args()
    c = case(a.batch, a.length, a.heads, a.kv_heads, a.head_dim, a.mask, a.dtype)
    q, k, v = c.make(jax.random.PRNGKey(0))
    do = jax.random.normal(jax.random.PRNGKey(7), q.shape, jnp.float32).astype(q.dtype)
    mask = _mask(a.mask, a.batch, a.length)
    tf = lambda flops, ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    total = c.flops_forward + c.flops_backward
    rows = []

    def record(row, f_ms, g_ms, temp):
        row |= {"fwd_ms": f_ms, "ms": g_ms, "temp_gib": temp}
        row |= {"fwd_tflops": tf(c.flops_forward, f_ms), "tflops": tf(total, g_ms)}
        print(json.dumps(row), flush=True)
        rows.append(row)

    for impl in [s for s in a.peers.split(",") if s]:
        try:
            record({"impl": impl}, *_measure(q, k, v, do, mask, impl, None))
        except Exception as e:  # noqa: BLE001 - report and go on
            print(impl, "failed", type(e).__name__, str(e)[:160], flush=True)
    if a.per_kernel:
        rows.extend(_per_kernel(a, q, k, v, do, mask, record))
    grid = itertools.product(_ints(a.block_q), _ints(a.block_kv), _ints(a.num_warps), _ints(a.num_stages))
    for bq, bk, nw, ns in [] if a.per_kernel else grid:
        bs = dict(block_q=bq, block_kv=bk, num_warps=nw, num_stages=ns)
        try:
            record({"impl": "pallas_gpu"} | bs, *_measure(q, k, v, do, mask, "pallas_gpu", bs))
        except Exception as e:  # noqa: BLE001 - report and go on
            print(json.dumps(bs), "failed", type(e).__name__, str(e)[:160], flush=True)
    cand = [r for r in rows if r["impl"] == "pallas_gpu"]
    if any("ms" in r for r in cand):
        print("best fwd+bwd", json.dumps(min((r for r in cand if "ms" in r), key=lambda r: r["ms"])))
        print("best fwd", json.dumps(min(cand, key=lambda r: r["fwd_ms"])))
    if a.json:
        dims = {
            "batch": a.batch,
            "q_len": a.length,
            "kv_len": a.length,
            "heads": a.heads,
            "kv_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "v_dim": a.head_dim,
        }
        with open(a.json, "w") as f:
            json.dump(
                {
                    "command": "python " + " ".join(sys.argv),
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "jax": jax.__version__,
                    "device": jax.devices()[0].device_kind,
                    "shape": {"dims": dims, "dtype": a.dtype, "mask": a.mask},
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
