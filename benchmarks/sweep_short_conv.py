"""Sweep the `pallas_gpu` short_conv block sizes on this device; print and save the table.

python benchmarks/sweep_short_conv.py --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax

from axkern import ConvBlockSizes
from axkern.bench import copy_bandwidth, time_ms
from axkern.ops.short_conv.arg_specs import case
from axkern.positional import short_conv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--channels", type=int, default=4096)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--block-seq", default="16,32,64")
    p.add_argument("--block-channels", default="64,128,256")
    p.add_argument("--activation", default="none")
    p.add_argument("--json")
    a = p.parse_args()
    act = None if a.activation == "none" else a.activation
    c = case(a.batch, a.seq, a.channels, a.width)
    x, w, b, seg = c.make(jax.random.PRNGKey(0))
    bw = copy_bandwidth()
    rows = []
    for bs_ in [int(v) for v in a.block_seq.split(",")]:
        for bc in [int(v) for v in a.block_channels.split(",")]:
            bs = ConvBlockSizes(block_seq=bs_, block_channels=bc)
            fwd = jax.jit(
                lambda x, w, b: short_conv(
                    x,
                    w,
                    bias=b,
                    activation=act,
                    implementation="pallas_gpu",
                    block_sizes=bs,  # noqa: B023 - used at once
                )
            )
            grad = jax.jit(
                jax.grad(
                    lambda x, w, b: (
                        short_conv(x, w, bias=b, activation=act, implementation="pallas_gpu", block_sizes=bs)  # noqa: B023
                        .astype("float32")
                        .sum()
                    ),
                    argnums=(0, 1, 2),
                )
            )
            try:
                f_ms = time_ms(fwd, (x, w, b))
                g_ms = time_ms(grad, (x, w, b))
            except Exception as e:  # noqa: BLE001
                print(bs, "failed", type(e).__name__, str(e)[:200])
                continue
            row = {
                "block_seq": bs_,
                "block_channels": bc,
                "fwd_ms": f_ms,
                "fwd_bwd_ms": g_ms,
                "fwd_of_copy": c.bytes_forward / (f_ms * 1e-3) / 1e9 / bw,
                "fwd_bwd_of_copy": (c.bytes_forward + c.bytes_backward) / (g_ms * 1e-3) / 1e9 / bw,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
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
