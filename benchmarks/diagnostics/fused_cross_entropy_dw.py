"""The reduced fused cross-entropy's `dw` accumulations side by side at a model's size: for each
strategy (`compensated`, `compensated_int8`, `float32`, `plain`: `dw_accumulation` of
`CrossEntropyBlockSizes`) and token block, the forward+backward time of `jax.value_and_grad`
(median of repeats), its temporary memory (`memory_analysis`), and the oracle rule for the
loss, `dx` and `dw`.

The oracle is the GPU tests' (tests/gpu/test_fused_cross_entropy_gpu.py, DESIGN.md's float32
oracle): `reference` on float32 copies of the inputs at `precision=HIGHEST` on the device; the
rule `max|impl - oracle| <= 2 * max|reference in bf16 - oracle| + atol * max|oracle|` per
output. A row's `rule` is the worst `max|impl - oracle| / bound` over its outputs (<= 1 meets
it). Inputs: `tests/cases/fused_cross_entropy.make` with logits of order 4, as the GPU tests.

Run on a CUDA machine from the repository root (about 3 minutes on an H200 with `--peers`):

    PYTHONPATH=src python3 benchmarks/diagnostics/fused_cross_entropy_dw.py --peers --json dw.json

or `bash benchmarks/gpu.sh fused_cross_entropy_dw`. `--peers` also times Liger-Kernel,
cut-cross-entropy and PyTorch (`axkern.bench.peers`, in a subprocess started before JAX takes the
GPU) and Levanter (in this process) on the same shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests` (the cases and the rule's atol)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/diagnostics/fused_cross_entropy_dw.py")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--embed", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--strategies", default="compensated,compensated_int8,float32,plain")
    p.add_argument(
        "--block-tokens", default="2048", help="token blocks to time each strategy at (e.g. 1024,2048)"
    )
    p.add_argument(
        "--block-vocab",
        type=int,
        default=8192,
        help="dw slab columns of the slab-wise strategies (the GPU heuristic's)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peers", action="store_true")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    n, d, v = a.tokens, a.embed, a.vocab
    dims = {"tokens": n, "embed": d, "vocab": v}

    torch_peers = []
    if a.peers:  # before JAX takes the GPU
        from axkern.bench import peers

        torch_peers = peers.run("fused_cross_entropy_loss", dims, "bfloat16", repeats=a.repeats)

    import jax
    import jax.numpy as jnp

    import axkern
    from axkern.bench import time_spread
    from axkern.ops.fused_cross_entropy.arg_specs import levanter_peer
    from axkern.positional import fused_cross_entropy_loss as ce_loss
    from tests.cases.fused_cross_entropy import make
    from tests.helpers import ATOL

    arrays, _ = make(n, n, d, v, "bfloat16", logit_scale=4.0)
    x, w, labels = arrays["x"], arrays["w"], arrays["labels"]

    def value_and_grad(loss):
        return jax.jit(jax.value_and_grad(lambda x, w: loss(x, w), argnums=(0, 1)))

    with jax.default_matmul_precision("highest"):
        f32 = (x.astype(jnp.float32), w.astype(jnp.float32))
        oracle = value_and_grad(lambda x, w: ce_loss(x, w, labels, implementation="reference"))(*f32)
    del f32
    same = value_and_grad(lambda x, w: ce_loss(x, w, labels, implementation="reference"))(x, w)
    names = ("loss", "dx", "dw")
    flat = lambda out: (out[0], *out[1])  # noqa: E731
    ref_err = [
        float(jnp.max(jnp.abs(r.astype(jnp.float32) - o)))
        for r, o in zip(flat(same), flat(oracle), strict=True)
    ]
    del same
    scales = [float(jnp.max(jnp.abs(o))) for o in flat(oracle)]
    bounds = [2 * e + ATOL["bfloat16"] * s for e, s in zip(ref_err, scales, strict=True)]

    def rule(out):
        ratios = {}
        for name, g, o, b in zip(names, flat(out), flat(oracle), bounds, strict=True):
            err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - o)))
            ratios[name] = err / b if jnp.isfinite(err) else float("inf")
        return ratios

    slab = a.block_vocab  # not the tuned table's field: its float32 entry spans the whole vocabulary
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    def measured(loss):
        """Time (min, median, max of repeats), temporary memory and the rule of `loss`'s
        forward+backward, compiled once."""
        compiled = value_and_grad(loss).lower(x, w).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
        ratios = rule(compiled(x, w))
        t_min, t_med, t_max = time_spread(compiled, (x, w), repeats=a.repeats)
        return dict(
            ms=t_med,
            ms_min=t_min,
            ms_max=t_max,
            temp_gib=temp,
            rule=max(ratios.values()),
            rule_by_output=ratios,
        )

    for strategy in a.strategies.split(","):
        for bt in (int(b) for b in a.block_tokens.split(",")):
            bs = axkern.CrossEntropyBlockSizes(block_tokens=bt, block_vocab=slab, dw_accumulation=strategy)
            row = measured(lambda x, w, bs=bs: ce_loss(x, w, labels, implementation="xla", block_sizes=bs))
            decision = axkern.explain(lambda x, w, bs=bs: ce_loss(x, w, labels, block_sizes=bs), x, w)
            record(
                dict(
                    implementation=f"xla {strategy}",
                    block_tokens=bt,
                    block_vocab=slab,
                    **row,
                    explain=decision.backward,
                )
            )
    if a.peers:
        for r in torch_peers:
            if r.get("pass", "fwd+bwd") == "fwd+bwd":
                record(
                    dict(
                        implementation=f"peer:{r['peer']}",
                        ms=r.get("ms"),
                        temp_gib=r.get("temp_gib"),
                        note=r.get("note", ""),
                    )
                )
        peer = levanter_peer()
        if isinstance(peer, str):
            record(dict(implementation="peer:levanter", note=peer))
        else:
            try:
                record(dict(implementation="peer:levanter", **measured(lambda x, w: peer(x, w, labels))))
            except Exception as e:  # noqa: BLE001 - an absent or failing peer is a row, not a crash
                record(dict(implementation="peer:levanter", note=f"{type(e).__name__}: {str(e)[:200]}"))

    print(f"\n{'implementation':<24}{'block':>7}{'ms':>9}{'temp GiB':>10}{'rule':>7}  note")
    for r in rows:
        ms = f"{r['ms']:.1f}" if r.get("ms") else "-"
        temp = f"{r['temp_gib']:.2f}" if r.get("temp_gib") is not None else "-"
        ok = f"{r['rule']:.2f}" if r.get("rule") is not None else "-"
        print(
            f"{r['implementation']:<24}{r.get('block_tokens', ''):>7}{ms:>9}{temp:>10}{ok:>7}  {r.get('note', '')}"
        )
    if a.json:
        result = {
            "command": "PYTHONPATH=src python3 benchmarks/diagnostics/fused_cross_entropy_dw.py "
            + " ".join(argv or sys.argv[1:]),
            "shape": {**dims, "dtype": "bfloat16"},
            "oracle": "reference in float32 at precision=HIGHEST on the device; rule <= 1 meets the oracle rule",
            "reference_error": dict(zip(names, ref_err, strict=True)),
            "date": datetime.date.today().isoformat(),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "rows": rows,
        }
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
