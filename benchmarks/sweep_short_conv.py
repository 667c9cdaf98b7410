"""Sweep the `pallas_gpu` short_conv tiles and warps on this device, beside `xla`; print and save.

    python benchmarks/sweep_short_conv.py --json out.json

For each activation: `xla`'s forward and forward+backward, then every (block_seq,
block_channels, num_warps) of `pallas_gpu`, each as a fraction of the copy bandwidth
measured in the same run (forward moves 2·B·S·C elements, forward+backward 5·B·S·C). The
forward+backward returns `y` and pulls a fixed random `dy` back (since 2026-11-30; earlier
runs took the gradient of `sum(y)`, whose constant cotangent XLA could fold away).
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from axkern import ConvBlockSizes
from axkern.bench import copy_bandwidth, time_ms
from axkern.ops.short_conv.arg_specs import case
from axkern.positional import short_conv


def _ints(text):
    return [int(v) for v in text.split(",")]


def _timings(x, w, b, dy, act, impl, bs):
    def f(x, w, b):
        return short_conv(x, w, bias=b, activation=act, implementation=impl, block_sizes=bs)

    def f_and_back(dy, x, w, b):  # the output and the pull-back of a given dy, as `axkern bench` does
        y, pull = jax.vjp(f, x, w, b)
        return y, pull(dy)

    return time_ms(jax.jit(f), (x, w, b)), time_ms(jax.jit(f_and_back), (dy, x, w, b))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--channels", type=int, default=4096)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--tiles", default="8x128,8x256,16x64,16x128,16x256,32x64,32x128")
    p.add_argument("--num-warps", default="1,2,4")
    p.add_argument("--activations", default="none,silu")
    p.add_argument("--json")
    a = p.parse_args()
    c = case(a.batch, a.seq, a.channels, a.width)
    x, w, b, _ = c.make(jax.random.PRNGKey(0))
    dy = jax.random.normal(jax.random.PRNGKey(7), x.shape, jnp.float32).astype(x.dtype)
    bw = copy_bandwidth()
    frac = lambda nbytes, ms: nbytes / (ms * 1e-3) / 1e9 / bw  # noqa: E731
    total = c.bytes_forward + c.bytes_backward
    rows = []
    for act_name in a.activations.split(","):
        act = None if act_name == "none" else act_name
        f_ms, g_ms = _timings(x, w, b, dy, act, "xla", None)
        row = {
            "impl": "xla",
            "activation": act_name,
            "fwd_ms": f_ms,
            "fwd_bwd_ms": g_ms,
            "fwd_of_copy": frac(c.bytes_forward, f_ms),
            "fwd_bwd_of_copy": frac(total, g_ms),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
        for tile in a.tiles.split(","):
            bs_, bc = (int(v) for v in tile.split("x"))
            for nw in _ints(a.num_warps):
                bs = ConvBlockSizes(block_seq=bs_, block_channels=bc, num_warps=nw)
                try:
                    f_ms, g_ms = _timings(x, w, b, dy, act, "pallas_gpu", bs)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(tile, nw, "failed", type(e).__name__, str(e)[:160], flush=True)
                    continue
                row = {
                    "impl": "pallas_gpu",
                    "activation": act_name,
                    "block_seq": bs_,
                    "block_channels": bc,
                    "num_warps": nw,
                    "fwd_ms": f_ms,
                    "fwd_bwd_ms": g_ms,
                    "fwd_of_copy": frac(c.bytes_forward, f_ms),
                    "fwd_bwd_of_copy": frac(total, g_ms),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    for act_name in a.activations.split(","):
        cand = [r for r in rows if r["impl"] == "pallas_gpu" and r["activation"] == act_name]
        if cand:
            print("best", act_name, json.dumps(min(cand, key=lambda r: r["fwd_bwd_ms"])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "jax": jax.__version__,
                    "device": jax.devices()[0].device_kind,
                    "copy_gbps": bw,
                    "args": vars(a),
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
