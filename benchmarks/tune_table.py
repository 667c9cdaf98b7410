"""Put a sweep's fastest candidate into an op's shipped table of tuned block sizes.

    python benchmarks/tune_table.py --sweep sweep.json --op fused_cross_entropy_loss --impl xla \
        --package axkern.ops.fused_cross_entropy --max-temp-gib 1.0

The candidate is the fastest row of the sweep (`benchmarks/sweep_*.py --json`) whose temporary
memory stays under `--max-temp-gib`; its entry replaces any entry of the same op,
implementation and bucket in `<package>/tuned/<device>.json`, with the sweep's command, date
and jax version beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pathlib

import jax.numpy as jnp

from axkern.core import backend


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", required=True)
    p.add_argument("--op", required=True)
    p.add_argument("--impl", required=True)
    p.add_argument("--package", required=True)
    p.add_argument("--max-temp-gib", type=float, default=float("inf"))
    p.add_argument("--source", help="where the sweep's JSON is committed")
    p.add_argument("--device-key", help="the table's device (default: this machine's), e.g. nvidia_h200")
    a = p.parse_args()
    sweep = json.loads(pathlib.Path(a.sweep).read_text())
    rows = [
        r
        for r in sweep["rows"]
        if "ms" in r and r["temp_gib"] <= a.max_temp_gib and r.get("impl", a.impl) == a.impl
    ]
    if not rows:
        raise SystemExit(f"no row of {a.sweep} ran under {a.max_temp_gib} GiB")
    best = min(rows, key=lambda r: r["ms"])
    api = importlib.import_module(f"{a.package}.api")
    op = next(o for o in vars(api).values() if getattr(o, "name", None) == a.op and hasattr(o, "bucket"))
    shape = sweep["shape"]
    # the op's dims: a sweep names them under "dims" (cross-entropy sweeps give tokens/embed/vocab)
    dims = shape.get("dims") or {k: shape[k] for k in ("tokens", "embed", "vocab")}
    spec = op.spec(dims, jnp.dtype(shape["dtype"]))
    fields = {f.name: best.get(f.name) for f in dataclasses.fields(op.implementations[a.impl].block_sizes)}
    entry = {
        "op": a.op,
        "implementation": a.impl,
        "bucket": dict(op.bucket(spec)),
        "block_sizes": {k: v for k, v in fields.items() if v is not None},
        "measured": {"ms": round(best["ms"], 2), "temp_gib": round(best["temp_gib"], 3)},
        "command": sweep.get("command"),
        "date": sweep.get("date"),
        "jax": sweep.get("jax"),
        "source": a.source,
        "note": f"fastest candidate with temporary memory <= {a.max_temp_gib} GiB",
    }
    device = a.device_key or backend.device_key()
    path = pathlib.Path(importlib.import_module(a.package).__file__).parent / "tuned" / f"{device}.json"
    table = (
        json.loads(path.read_text()) if path.exists() else {"op": a.op, "device_key": device, "entries": []}
    )
    table["entries"] = [
        e
        for e in table["entries"]
        if not (
            e.get("op", table.get("op")) == a.op
            and e["implementation"] == a.impl
            and e["bucket"] == entry["bucket"]
        )
    ] + [entry]
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n")
    print(f"{path}: {json.dumps(entry)}")


if __name__ == "__main__":
    main()
