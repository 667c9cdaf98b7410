"""The `mosaic_gpu` forward's tiles on the H200, per head dim and mask kind: the forward kernel
alone (`mosaic_gpu.forward`, unguarded) for every candidate of `mosaic_gpu_space` (64 or 128
query rows per warpgroup, 64 to 256 keys, 2 to 4 ring stages, where shared memory allows, each
in the rendezvous and the overlap ping-pong),
B2 S8192 H32 bf16. Each candidate is compiled and checked against the heuristic's tiles (largest
difference relative to the largest output; a sanity check, the oracle rule is the GPU tests'),
then timed in two interleaved rounds of 5 repeats (median of the rounds' medians).

Writes `$OUT/sweep_mosaic_forward.json` after each case: the rows, and per case the entry of the
fastest candidate for the shipped table (`tuned/nvidia_h200.json`: its bucket holds the mask
kind; the backward fields stay the heuristic's, which the backward sweep chose,
`attention_mosaic_sweep.py`).

Run on a Hopper GPU from the repository root: `OUT=<folder> python3 benchmarks/attention_mosaic_forward_sweep.py`.

With `--variants`: per case, the shipped tiles (`tuned/nvidia_h200.json`, else the heuristic's)
in the kernel's forms (`VARIANTS`): the default (JAX's rendezvous ping-pong), `handoff=True`
(FA3's handoff), `nan_scores=True` (non-finite scores made NaN: what that part of the
non-finite rule costs), the handoff on hardware named barriers, the ring's releases on them,
both, the lean epilogue, all three, and FA3's overlap inside a warpgroup (alone and on named
barriers), their outputs compared with the default's (finite inputs: they should agree
exactly) and timed in nine rounds, the forms in a fresh random order each round (3 repeats a
form a round). The default is compiled and timed twice (`default (again)`): the spread between
the two is the noise floor a form's difference must clear. Each row has the median of all its
samples and `ratio_to_default`, the median over rounds of its time over the default's in the same
round (under 1: faster). `--forms a,b,...` times only those forms (with the default's two).
Writes `$OUT/sweep_mosaic_variants.json`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import statistics
import sys

import jax
import jax.numpy as jnp

from axkern import masks
from axkern.bench import time_rounds, time_spread
from axkern.core import tuning
from axkern.ops.attention import OP, mosaic_gpu
from axkern.ops.attention.blocks import bucket, mask_kind, mosaic_gpu_heuristic, mosaic_gpu_space

COMMAND = "OUT=<folder> python3 benchmarks/attention_mosaic_forward_sweep.py"
B, S, H = 2, 8192, 32


def _mask(name):
    if name == "full":
        return masks.Full()
    if name == "window1024":
        return masks.SlidingWindow(1024)
    if name == "docs1024":
        ids = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) // 1024, (B, S))
        return masks.Causal() & masks.Segments(ids, ids)
    return masks.Causal()


# name: (kv heads, head dim, mask)
CASES = {
    "causal H32 D128": (32, 128, "causal"),
    "full H32 D128": (32, 128, "full"),
    "window1024 H32 D128": (32, 128, "window1024"),
    "docs1024 H32 D128": (32, 128, "docs1024"),
    "causal H32/8 D128": (8, 128, "causal"),
    "causal H32 D64": (32, 64, "causal"),
    "full H32 D64": (32, 64, "full"),
    "causal H32 D256": (32, 256, "causal"),
}


def _spec(kvh, d, mask):
    dims = {"batch": B, "q_len": S, "kv_len": S, "heads": H, "kv_heads": kvh, "head_dim": d, "v_dim": d}
    return OP.spec(dims, jnp.bfloat16, soft_cap=False, sinks=False, mask_kind=mask_kind(mask))


def _inputs(kvh, d):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (B, S, H, d), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (B, S, kvh, d), jnp.bfloat16) for kk in keys[1:])
    return q, k, v


def _write(out, command, last_case, **found):
    """The results so far (after each case: a run cut short keeps what it measured)."""
    result = {
        "command": command,
        "shape": {"batch": B, "length": S, "heads": H, "dtype": "bfloat16"},
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "complete": last_case == list(CASES)[-1],
    }
    with open(out, "w") as f:
        json.dump(result | found, f, indent=1)


VARIANTS = {
    "default": {},
    "handoff": {"handoff": True},
    "nan_scores": {"nan_scores": True},
    "named_barriers": {"handoff": True, "named_barriers": True},
    "named_releases": {"named_releases": True},
    "named_both": {"handoff": True, "named_barriers": True, "named_releases": True},
    "lean": {"lean": True},
    "named_both+lean": {"handoff": True, "named_barriers": True, "named_releases": True, "lean": True},
    "overlap": {"handoff": True, "overlap": True},
    "overlap+named_both": {"handoff": True, "overlap": True, "named_barriers": True, "named_releases": True},
}


def variants(forms=None):
    out = os.path.join(os.environ.get("OUT", "."), "sweep_mosaic_variants.json")
    chosen = {"default": {}, "default (again)": {}}
    chosen |= {f: VARIANTS[f] for f in (forms or VARIANTS) if f != "default"}
    order = random.Random(0)
    rows = []
    for name, (kvh, d, mask_name) in CASES.items():
        mask = _mask(mask_name)
        spec = _spec(kvh, d, mask)
        bs, _, _ = OP.choose_blocks(OP.implementations["mosaic_gpu"], spec, None)  # table, else heuristic
        tiles = dict(block_q=bs.block_q, block_kv=bs.block_kv, num_stages=bs.num_stages)
        q, k, v = _inputs(kvh, d)
        fns = {
            form: jax.jit(
                lambda q, k, v, opts=opts, mask=mask, d=d, tiles=tiles: mosaic_gpu.forward(
                    q, k, v, mask, scale=d**-0.5, **tiles, **opts
                )[0]
            )
            for form, opts in chosen.items()
        }
        label = f"{bs.block_q}x{bs.block_kv}x{bs.num_stages}"
        outs = {}
        for form, fn in list(fns.items()):  # a form that does not compile here is a row, not the end
            try:
                outs[form] = fn(q, k, v).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001 - recorded with its message
                del fns[form]
                row = dict(case=name, tiles=label, form=form, error=f"{type(e).__name__}: {str(e)[:300]}")
                rows.append(row)
                print(row, flush=True)
        samples, rounds = time_rounds(fns, (q, k, v), rounds=9, rng=order)
        for form, t in samples.items():
            ratio = None
            if "default" in rounds:
                ratio = statistics.median(a / b for a, b in zip(rounds[form], rounds["default"], strict=True))
            row = dict(
                case=name,
                tiles=label,
                form=form,
                median_ms=statistics.median(t),
                min_ms=min(t),
                max_ms=max(t),
                ratio_to_default=ratio,
                max_abs_diff_vs_default=(
                    float(jnp.max(jnp.abs(outs[form] - outs["default"]))) if "default" in outs else None
                ),
            )
            rows.append(row)
            print(row, flush=True)
        _write(
            out, COMMAND + " --variants" + (f" --forms {','.join(forms)}" if forms else ""), name, rows=rows
        )


def main():
    if "--variants" in sys.argv[1:]:
        forms = None
        if "--forms" in sys.argv[1:]:
            forms = sys.argv[sys.argv.index("--forms") + 1].split(",")
            unknown = sorted(set(forms) - set(VARIANTS))
            if unknown:
                sys.exit(f"unknown forms {unknown}: the forms are {sorted(VARIANTS)}")
        return variants(forms)
    out = os.path.join(os.environ.get("OUT", "."), "sweep_mosaic_forward.json")
    rows, entries = [], []
    for name, (kvh, d, mask_name) in CASES.items():
        mask = _mask(mask_name)
        spec = _spec(kvh, d, mask)
        q, k, v = _inputs(kvh, d)
        base = mosaic_gpu_heuristic(spec)
        cands = mosaic_gpu_space(spec)
        label = lambda bs: f"{bs.block_q}x{bs.block_kv}x{bs.num_stages} {bs.ping_pong}"  # noqa: E731
        fns, errs = {}, {}
        want = None
        for bs in cands:
            fn = jax.jit(
                lambda q, k, v, bs=bs, mask=mask, d=d: mosaic_gpu.forward(
                    q,
                    k,
                    v,
                    mask,
                    scale=d**-0.5,
                    block_q=bs.block_q,
                    block_kv=bs.block_kv,
                    num_stages=bs.num_stages,
                    **mosaic_gpu.forward_flags(bs),
                )[0]
            )
            try:
                got = fn(q, k, v).astype(jnp.float32)
                if want is None:  # the heuristic's tiles come first
                    want = got
                errs[label(bs)] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                fns[label(bs)] = (bs, fn)
            except Exception as e:  # noqa: BLE001 - tiles that do not compile: report, go on
                errs[label(bs)] = f"{type(e).__name__}: {str(e)[:200]}"
        times = {n: [] for n in fns}
        for _ in range(2):  # interleaved rounds: every candidate sees the same clocks
            for n, (_, fn) in fns.items():
                times[n].append(time_spread(fn, (q, k, v), repeats=5))
        best = None
        for bs in cands:
            n = label(bs)
            row = dict(case=name, tiles=n, heuristic=bs == base)
            if n in times:
                t = times[n]
                row |= dict(
                    median_ms=sorted(x[1] for x in t)[len(t) // 2],
                    min_ms=min(x[0] for x in t),
                    max_ms=max(x[2] for x in t),
                    rel_diff_vs_heuristic=errs[n],
                )
                if errs[n] < 2e-2 and (best is None or row["median_ms"] < best[1]):
                    best = (bs, row["median_ms"])
            else:
                row["error"] = errs[n]
            rows.append(row)
            print(row, flush=True)
        if best is not None:
            sizes = {f: x for f, x in dataclasses.asdict(best[0]).items() if x is not None}
            e = tuning.entry(
                "attention", "mosaic_gpu", bucket(spec), sizes, ms={"fwd": best[1]}, command=COMMAND
            )
            e["case"] = name
            entries.append(e)
        _write(out, COMMAND, name, rows=rows, entries=entries)


if __name__ == "__main__":
    main()
