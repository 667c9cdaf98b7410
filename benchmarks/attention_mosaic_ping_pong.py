"""The `mosaic_gpu` forward's ping-pong through the public function, beside cuDNN, on the H200.

`axkern.positional.attention` (the dispatcher's guard and all) with `implementation="mosaic_gpu"`
and the chosen block sizes (`tuned/nvidia_h200.json`, else the heuristic) in their `ping_pong`
and in the other of the rendezvous and the overlap, and with `implementation="cudnn"`; forward,
and forward+backward (the gradient of `sum(out · d_out)` in q, k, v). B2 S8192 H32 bf16: causal
and no mask at head dim 128, causal at 256. Seven rounds, the forms in a fresh random order each
round (3 repeats a form a round); each row has the median of all its samples and
`ratio_to_cudnn`, the median over rounds of cuDNN's time over the row's in the same round (above
1: faster than cuDNN).

Writes `$OUT/sweep_mosaic_ping_pong.json` after each case. Run on a Hopper GPU from the
repository root: `OUT=<folder> python3 benchmarks/attention_mosaic_ping_pong.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import statistics

import jax
import jax.numpy as jnp

from axkern import masks
from axkern.bench import time_rounds
from axkern.ops.attention import OP
from axkern.ops.attention.blocks import mask_kind
from axkern.positional import attention

COMMAND = "OUT=<folder> python3 benchmarks/attention_mosaic_ping_pong.py"
B, S, H = 2, 8192, 32
CASES = {
    "causal D128": (128, masks.Causal()),
    "full D128": (128, masks.Full()),
    "causal D256": (256, masks.Causal()),
}


def _forms(d, mask):
    dims = {"batch": B, "q_len": S, "kv_len": S, "heads": H, "kv_heads": H, "head_dim": d, "v_dim": d}
    spec = OP.spec(dims, jnp.bfloat16, soft_cap=False, sinks=False, mask_kind=mask_kind(mask))
    bs, _, _ = OP.choose_blocks(OP.implementations["mosaic_gpu"], spec, None)
    other = "rendezvous" if bs.ping_pong == "overlap" else "overlap"
    return {
        f"mosaic_gpu {bs.ping_pong} (chosen)": ("mosaic_gpu", bs),
        f"mosaic_gpu {other}": ("mosaic_gpu", dataclasses.replace(bs, ping_pong=other)),
        "cudnn": ("cudnn", None),
    }


def main():
    out = os.path.join(os.environ.get("OUT", "."), "sweep_mosaic_ping_pong.json")
    order = random.Random(0)
    rows = []
    for name, (d, mask) in CASES.items():
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, do = (jax.random.normal(kk, (B, S, H, d), jnp.bfloat16) for kk in keys)
        fns = {}
        for form, (impl, bs) in _forms(d, mask).items():

            def fwd(q, k, v, impl=impl, bs=bs, mask=mask):
                return attention(q, k, v, mask=mask, implementation=impl, block_sizes=bs)

            def loss(q, k, v, fwd=fwd, do=do):
                return jnp.sum(fwd(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

            fns[(form, "fwd")] = jax.jit(fwd)
            fns[(form, "fwd+bwd")] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        samples, rounds = time_rounds(fns, (q, k, v), rounds=7, rng=order)
        for (form, passes), t in samples.items():
            ref = rounds[("cudnn", passes)]
            row = dict(
                case=name,
                form=form,
                passes=passes,
                median_ms=statistics.median(t),
                min_ms=min(t),
                max_ms=max(t),
                ratio_to_cudnn=statistics.median(
                    c / a for a, c in zip(rounds[(form, passes)], ref, strict=True)
                ),
            )
            rows.append(row)
            print(row, flush=True)
        result = {
            "command": COMMAND,
            "shape": {"batch": B, "length": S, "heads": H, "dtype": "bfloat16"},
            "date": datetime.date.today().isoformat(),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "complete": name == list(CASES)[-1],
            "rows": rows,
        }
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
