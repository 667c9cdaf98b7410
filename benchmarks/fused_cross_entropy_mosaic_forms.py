"""The fused cross-entropy's Hopper kernel (`mosaic_gpu`) in each of its forms and tiles, beside
`xla`'s and `pallas_gpu`'s forwards, at a model's size: per row the forward's time (the per-token
statistics, `jax.jit` of `fused_cross_entropy(..., reduction=None)` returning `lse` alone, or
with `--value loss` the per-token loss, which needs the label's logit too; median, min and max
of repeats), its TFLOP/s over `2·N·D·V`, and its largest difference from `xla`'s value.

The forms are module constants of `ops/fused_cross_entropy/mosaic_gpu.py` set for a row:
`CLUSTER` (2: CTA pairs sharing their `x` slices by TMA multicast), `PIPELINED` (a CTA's
tiles as one pipeline of pipelines) and `LABELS_IN_KERNEL` (the label's logit picked in the
epilogue; time it with `--value loss`); the tiles are `CrossEntropyBlockSizes(block_tokens,
block_vocab, block_embed=64, num_stages)`.

Run on a Hopper GPU from the repository root (a minute or two on an H200):

    PYTHONPATH=src python3 benchmarks/fused_cross_entropy_mosaic_forms.py --json forms.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/fused_cross_entropy_mosaic_forms.py")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--embed", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--clusters", default="1,2")
    p.add_argument("--pipelined", default="0,1")
    p.add_argument("--tiles", default="256x128x4,128x128x4", help="block_tokens x block_vocab x stages")
    p.add_argument("--labels-in-kernel", default="0", help="LABELS_IN_KERNEL values, e.g. 0,1")
    p.add_argument(
        "--value",
        choices=("lse", "loss"),
        default="lse",
        help="what the timed function returns: lse alone, or the per-token loss (lse and the label's logit)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the rows here")
    args = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(args)
    if "1" in a.labels_in_kernel.split(",") and a.value == "lse":
        p.error("--labels-in-kernel 1 times the label's logit only with --value loss (lse alone drops it)")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from axkern import CrossEntropyBlockSizes
    from axkern.bench import time_spread
    from axkern.ops.fused_cross_entropy import mosaic_gpu
    from axkern.positional import fused_cross_entropy

    n, d, v = a.tokens, a.embed, a.vocab
    kx, kw, kl = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (n, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (d, v), jnp.float32) * (4.0 / d**0.5)).astype(jnp.bfloat16)
    labels = jax.random.randint(kl, (n,), 0, v)
    flops = 2.0 * n * d * v

    def lse_of(impl, block_sizes=None):
        def f(x, w, l):
            loss, lse = fused_cross_entropy(
                x, w, l, reduction=None, return_lse=True, implementation=impl, block_sizes=block_sizes
            )
            return lse if a.value == "lse" else loss

        return jax.jit(f)

    rows = []
    want = np.asarray(lse_of("xla")(x, w, labels))

    def row(name, fn, **extra):
        r = {"implementation": name, **extra}
        try:
            got = np.asarray(fn(x, w, labels))
            r[f"max_abs_diff_{a.value}_vs_xla"] = float(np.abs(got - want).max())
            lo, med, hi = time_spread(fn, (x, w, labels), repeats=a.repeats)
            r.update(ms=med, ms_min=lo, ms_max=hi, tflops=flops / med / 1e9)
        except Exception as e:  # noqa: BLE001 - report it and go on
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(r), flush=True)
        rows.append(r)

    row("xla", lse_of("xla"))
    row("pallas_gpu", lse_of("pallas_gpu"))
    clusters = [int(c) for c in a.clusters.split(",")]
    tiles = [tuple(int(t) for t in s.split("x")) for s in a.tiles.split(",")]
    chains = [bool(int(c)) for c in a.pipelined.split(",")]
    picks = [bool(int(c)) for c in a.labels_in_kernel.split(",")]
    for cluster, chain, pick, (bt, bv, stages) in itertools.product(clusters, chains, picks, tiles):
        mosaic_gpu.CLUSTER, mosaic_gpu.PIPELINED, mosaic_gpu.LABELS_IN_KERNEL = cluster, chain, pick
        bs = CrossEntropyBlockSizes(block_tokens=bt, block_vocab=bv, block_embed=64, num_stages=stages)
        row(
            "mosaic_gpu",
            lse_of("mosaic_gpu", bs),
            cluster=cluster,
            pipelined=chain,
            labels_in_kernel=pick,
            tiles=[bt, bv, 64, stages],
        )
    if a.json:
        out = {
            "command": "PYTHONPATH=src python3 benchmarks/fused_cross_entropy_mosaic_forms.py "
            + " ".join(
                "<file>" if prev == "--json" else arg for prev, arg in zip([""] + args, args, strict=False)
            ),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "jax": jax.__version__,
            "device": jax.devices()[0].device_kind,
            "shape": {"tokens": n, "embed": d, "vocab": v, "dtype": "bfloat16"},
            "value": a.value,
            "rows": rows,
        }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
