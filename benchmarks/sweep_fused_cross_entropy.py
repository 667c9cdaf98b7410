"""Sweep the fused cross-entropy's block sizes on this device; print and save the table.

    python benchmarks/sweep_fused_cross_entropy.py --target loss --block-tokens 512,1024,2048 --json out.json

Targets: `stats` (xla per-token statistics, the mean of the per-token losses differentiated:
recomputing backward), `loss` (xla `fused_cross_entropy_loss` differentiated: gradients
formed in the forward; only `--block-tokens` matters), `pallas_gpu` (the Pallas kernel's
forward alone, over `--block-tokens/--block-vocab/--block-embed/--num-warps/--num-stages`).
Each candidate is compiled, checked against the `reference` implementation (relative max
error of the value and gradients, or of the forward statistics) and timed (median of repeats).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json

import jax
import jax.numpy as jnp

from axkern import CrossEntropyBlockSizes
from axkern.bench import _max_rel_error, _temp_gib, time_ms
from axkern.ops.fused_cross_entropy.api import (
    fused_cross_entropy_loss_positional,
    fused_cross_entropy_positional,
)
from axkern.ops.fused_cross_entropy.arg_specs import case

FIELDS = ("block_tokens", "block_vocab", "block_embed", "num_warps", "num_stages")


def _ints(text):
    return [int(v) for v in text.split(",")] if text else [None]


def _fn(target, bs):
    if target == "pallas_gpu":
        return jax.jit(
            lambda x, w, l: fused_cross_entropy_positional(
                x, w, l, reduction=None, return_lse=True, implementation="pallas_gpu", block_sizes=bs
            )
        )

    def loss(x, w, labels):
        if target == "loss":
            return fused_cross_entropy_loss_positional(x, w, labels, implementation="xla", block_sizes=bs)
        per_token = fused_cross_entropy_positional(
            x, w, labels, reduction=None, implementation="xla", block_sizes=bs
        )
        return jnp.mean(per_token)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", choices=("stats", "loss", "pallas_gpu"), default="stats")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--embed", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-tokens", default="4096,8192,16384")
    p.add_argument("--block-vocab", default="1024,2048,4096,8192")
    p.add_argument("--block-embed", default="")
    p.add_argument("--num-warps", default="")
    p.add_argument("--num-stages", default="")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args()
    c = case(a.tokens, a.embed, a.vocab, a.dtype)
    args = c.make(jax.random.PRNGKey(0))
    if a.target == "pallas_gpu":
        ref = jax.jit(
            lambda x, w, l: fused_cross_entropy_positional(
                x, w, l, reduction=None, return_lse=True, implementation="reference"
            )
        )
    else:
        ref = jax.jit(jax.value_and_grad(lambda *z: c.loss("reference", *z), argnums=(0, 1)))
    want = jax.block_until_ready(ref(*args))
    flops = (2 if a.target == "pallas_gpu" else 6) * a.tokens * a.embed * a.vocab
    lists = [_ints(getattr(a, f)) for f in FIELDS]
    if a.target == "loss":
        lists[1:] = [[a.vocab]] + [[None]] * 3
    rows = []
    for values in itertools.product(*lists):
        if values[0] > a.tokens:
            continue
        bs = CrossEntropyBlockSizes(**{f: v for f, v in zip(FIELDS, values, strict=True) if v is not None})
        try:
            fn = _fn(a.target, bs)
            temp = _temp_gib(fn, args)
            err = _max_rel_error(fn(*args), want)
            ms = time_ms(fn, args, repeats=a.repeats)
        except Exception as e:  # a candidate that does not compile is a row, not the end of the sweep
            row = {**bs.as_dict(), "error": f"{type(e).__name__}: {str(e)[:200]}"}
        else:
            row = {
                **bs.as_dict(),
                "ms": ms,
                "temp_gib": temp,
                "max_rel_error": err,
                "tflops_model": flops / (ms * 1e-3) / 1e12,
            }
        print(json.dumps(row), flush=True)
        rows.append(row)
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    print("best", json.dumps(best))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "command": "python benchmarks/sweep_fused_cross_entropy.py "
                    + " ".join(
                        f"--{k.replace('_', '-')} {v}"
                        for k, v in vars(a).items()
                        if v not in ("", None) and k != "json"
                    ),
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
