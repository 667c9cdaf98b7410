"""Sweep the `xla` fused cross-entropy's block sizes on this device; print and save the table.

    python benchmarks/sweep_fused_cross_entropy.py --tokens 16384 --embed 4096 --vocab 128256 --json out.json

Each candidate is compiled, checked against the `reference` implementation (forward loss
and gradients, relative max error) and timed forward+backward (median of repeats).
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from axkern import CrossEntropyBlockSizes
from axkern.bench import _max_rel_error, _temp_gib, time_ms
from axkern.ops.fused_cross_entropy.api import fused_cross_entropy_positional
from axkern.ops.fused_cross_entropy.arg_specs import case


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--embed", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-tokens", default="4096,8192,16384")
    p.add_argument("--block-vocab", default="1024,2048,4096,8192")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args()
    c = case(a.tokens, a.embed, a.vocab, a.dtype)
    args = c.make(jax.random.PRNGKey(0))

    def grad_fn(bs):
        def loss(x, w, labels):
            return jnp.mean(
                fused_cross_entropy_positional(x, w, labels, implementation="xla", block_sizes=bs)[0]
            )

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    want = jax.block_until_ready(
        jax.jit(jax.value_and_grad(lambda *z: c.loss("reference", *z), argnums=(0, 1)))(*args)
    )
    rows = []
    for bt in [int(v) for v in a.block_tokens.split(",")]:
        for bv in [int(v) for v in a.block_vocab.split(",")]:
            if bt > a.tokens:
                continue
            bs = CrossEntropyBlockSizes(block_tokens=bt, block_vocab=bv)
            fn = grad_fn(bs)
            temp = _temp_gib(fn, args)
            err = _max_rel_error(fn(*args), want)
            ms = time_ms(fn, args, repeats=a.repeats)
            row = {
                "block_tokens": bt,
                "block_vocab": bv,
                "ms": ms,
                "temp_gib": temp,
                "max_rel_error": err,
                "tflops_model": 6 * a.tokens * a.embed * a.vocab / (ms * 1e-3) / 1e12,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    best = min(rows, key=lambda r: r["ms"])
    print("best", json.dumps(best))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "jax": jax.__version__,
                    "device": jax.devices()[0].device_kind,
                    "shape": vars(a),
                    "rows": rows,
                    "best": best,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
