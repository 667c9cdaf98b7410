"""Where one op's implementations spend their time, kernel by kernel (a diagnostic, not a bench
table): each implementation's forward and forward+backward at a bench preset, as `axkern bench`
runs them (the same inputs and random cotangent), timed whole and then run a few times under
PyTorch's profiler, whose CUPTI activity trace sees every GPU kernel of the process (XLA's
fusions, Triton's and Mosaic GPU's kernels). Rows: each kernel's device time per call, largest
first, by name (XLA's fusions grouped without their trailing number); and each run's
`timeline` over the calls enqueued back to back: per call the window from the first kernel's
start to the last one's end, the time some kernel ran and the time none did (launch gaps,
dispatch), with the longest gaps. A kernel launched early (a programmatic dependent launch)
may start before the kernel it waits for ends: its row then includes that wait, and the
timeline counts the overlap once. Needs torch with CUDA.

    OUT=<folder> python3 benchmarks/diagnostics/kernel_times.py ssd mamba2_2.7b --tokens 4096 --impl mosaic_gpu,pallas_gpu

writes `$OUT/kernel_times_<op>_<preset>.json`. `--blocks IMPL:FIELD=VALUE` runs an implementation
with those block-size fields over those the dispatcher picks (`bench.replaced_blocks`: a form
that is not the default, such as `mosaic_gpu:rotation=xla` for `mamba3`). `--hlo` also writes each program's optimized HLO
to `$OUT/hlo/` and gives each row the JAX operations its fusions came from (`sources`: the
`op_name` metadata XLA keeps on each fusion), so that a fusion's time points at the code, and
the bytes its fusions read and write per call (`gb_in`, `gb_out`, at most: an operand read in
part counts whole) with their rate (`gb_per_s`), so that a row's time can be set against the
memory's bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import re
import shlex
from pathlib import Path

import jax

from axkern import bench


def profile(fn, args, calls: int) -> tuple[list[dict], dict]:
    """Device time per call of each kernel `fn(*args)` launches, largest first, and the
    `timeline` of the calls, enqueued back to back as `axkern bench` times them."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    jax.block_until_ready(fn(*args))
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        torch.cuda.synchronize()
    totals, counts, raw = collections.Counter(), collections.Counter(), collections.defaultdict(set)
    spans = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = re.sub(r"[._]\d+$", "", e.name)
        totals[name] += (getattr(e, "device_time", None) or e.cuda_time) / 1e3 / calls  # us -> ms a call
        counts[name] += 1 / calls
        raw[name].add(e.name)
        spans.append((e.time_range.start, e.time_range.end, name))
    rows = [
        {"kernel": k, "ms_per_call": v, "launches_per_call": counts[k], "names": sorted(raw[k])}
        for k, v in totals.most_common()
    ]
    return rows, timeline(spans, calls)


def timeline(spans: list[tuple[float, float, str]], calls: int, top: int = 8) -> dict:
    """Where the device's time goes between the first kernel's start and the last one's end of
    `calls` back-to-back calls (`spans`: each kernel's start and end in microseconds, and its
    name): per call, the window, the time some kernel ran (kernels that overlap counted once)
    and the time none did; and the `top` longest idle gaps, each with the kernel after it."""
    if not spans:
        return {}
    spans = sorted(spans)
    busy, gaps = 0.0, []
    run_start, run_end = spans[0][0], spans[0][1]
    for start, end, name in spans[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((start - run_end, name))
            run_start = start
        run_end = max(run_end, end)
    busy += run_end - run_start
    window = run_end - spans[0][0]
    gaps.sort(key=lambda g: -g[0])
    return {
        "window_ms_per_call": window / 1e3 / calls,
        "busy_ms_per_call": busy / 1e3 / calls,
        "idle_ms_per_call": (window - busy) / 1e3 / calls,
        "longest_gaps": [{"us": round(g, 2), "before": n} for g, n in gaps[:top]],
    }


def fusion_sources(hlo: str) -> dict[str, str]:
    """Each fusion (and other named instruction) of an optimized HLO module's text: the JAX
    operation it came from (its `op_name` metadata), by `_key` of the instruction's name."""
    found = re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]+)\"", hlo, re.M)
    return {_key(name): op for name, op in found}


def _key(name: str) -> str:
    """An instruction's name as the profiler may report its kernel: `.` and `-` as `_`."""
    return name.replace(".", "_").replace("-", "_")


_SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s64|s32|s16|s8|u64|u32|u16|u8|pred)\[([\d,]*)\]")
_ITEM = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def _bytes(shapes: str) -> int:
    """The bytes of every array shape written in `shapes` (an HLO type, or a tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(shapes):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _ITEM.get(dtype, 1)
    return total


def fusion_bytes(hlo: str) -> dict[str, tuple[int, int]]:
    """Each kernel of an optimized HLO module's entry computation: the bytes of its
    instructions' operands and results, `(in, out)`, by `_key` of the kernel's name (an
    instruction's own, or the `deduplicated_name` under which XLA launches several identical
    fusions' one kernel: their bytes summed): what the kernel's launches of one call read and
    write at most (an operand read in part counts whole), so that its time gives a rate."""
    entry = hlo[hlo.index("ENTRY") :]
    entry = entry[: entry.find("\n}\n") if "\n}\n" in entry else len(entry)]
    shapes, found = {}, {}
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w-]+)\((.*)", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        kernel = re.search(r'deduplicated_name="([^"]+)"', rest)
        key = _key(kernel.group(1) if kernel else name)
        read, written = found.get(key, (0, 0))
        found[key] = (read + sum(_bytes(shapes.get(a, "")) for a in operands), written + _bytes(shape))
    return found


def add_bytes(rows: list[dict], sizes: dict[str, tuple[int, int]]) -> None:
    """`rows[i]["gb_in"]`, `["gb_out"]`: the bytes (GB) the row's fusions read and write per call,
    where the HLO names them all, and `["gb_per_s"]` their sum over the row's time."""
    for r in rows:
        got = [sizes.get(_key(n)) for n in r["names"]]
        if not got or None in got:
            continue
        r["gb_in"] = sum(g[0] for g in got) / 1e9
        r["gb_out"] = sum(g[1] for g in got) / 1e9
        if r.get("ms_per_call"):
            r["gb_per_s"] = (r["gb_in"] + r["gb_out"]) / (r["ms_per_call"] / 1e3)


def add_sources(rows: list[dict], sources: dict[str, str]) -> None:
    """`rows[i]["sources"]`: the operations the row's kernels came from, where the HLO names them."""
    for r in rows:
        ops = {sources.get(_key(n)) for n in r["names"]} - {None}
        if ops:
            r["sources"] = sorted(ops)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("op")
    p.add_argument("preset")
    p.add_argument("--tokens", type=int)
    p.add_argument("--impl", required=True, help="comma-separated implementation names")
    p.add_argument("--calls", type=int, default=3, help="calls under the profiler (default 3)")
    p.add_argument(
        "--hlo", action="store_true", help="write the optimized HLO; name each row's sources and bytes"
    )
    p.add_argument(
        "--only", help="the first case whose label contains this text (default: the preset's first)"
    )
    p.add_argument(
        "--blocks",
        help="IMPL:FIELD=VALUE[,FIELD=VALUE]: those fields over the block sizes the dispatcher picks",
    )
    a = p.parse_args()
    with bench.replaced_blocks(a.op, a.blocks) if a.blocks else contextlib.nullcontext():
        measure_op(a)


def measure_op(a) -> None:
    folder = Path(os.environ.get("OUT", "."))
    out = {
        "command": "OUT=<folder> python3 benchmarks/diagnostics/kernel_times.py "
        + " ".join(
            [a.op, a.preset]
            + ([f"--tokens {a.tokens}"] if a.tokens else [])
            + [f"--impl {a.impl}"]
            + ([f"--calls {a.calls}"] if a.calls != 3 else [])
            + (["--hlo"] if a.hlo else [])
            + ([f"--only {shlex.quote(a.only)}"] if a.only else [])
            + ([f"--blocks {shlex.quote(a.blocks)}"] if a.blocks else [])
        ),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "runs": [],
    }
    cases = [c for c in bench.cases_for(a.op, preset=a.preset, tokens=a.tokens) if (a.only or "") in c.label]
    if not cases:
        raise SystemExit(f"no case of {a.op} {a.preset} has {a.only!r} in its label")
    for case in cases[:1]:
        args = case.make(jax.random.PRNGKey(0))
        for impl in a.impl.split(","):
            fwd = jax.jit(case.forward_for(impl))
            both = jax.jit(bench.forward_backward(case, impl))
            for pass_, fn, fn_args in (
                ("fwd", fwd, args),
                ("fwd+bwd", both, (bench.cotangent(case, args), *args)),
            ):
                run = {"case": case.label, "implementation": impl, "pass": pass_}
                try:
                    run["ms"] = bench.time_spread(fn, fn_args, repeats=5)[1]
                    run["kernels"], run["timeline"] = profile(fn, fn_args, a.calls)
                    run["kernels_total_ms"] = sum(r["ms_per_call"] for r in run["kernels"])
                    if a.hlo:
                        hlo = fn.lower(*fn_args).compile().as_text()
                        (folder / "hlo").mkdir(parents=True, exist_ok=True)
                        (folder / "hlo" / f"{a.op}_{impl}_{pass_.replace('+', '_')}.txt").write_text(hlo)
                        add_sources(run["kernels"], fusion_sources(hlo))
                        add_bytes(run["kernels"], fusion_bytes(hlo))
                except Exception as e:  # noqa: BLE001 - report it and go on
                    run["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(
                    json.dumps({k: v for k, v in run.items() if k not in ("kernels", "timeline")}), flush=True
                )
                print("  timeline", json.dumps(run.get("timeline", {})), flush=True)
                for r in run.get("kernels", [])[:20]:
                    rate = f"  {r['gb_per_s']:6.0f} GB/s" if "gb_per_s" in r else ""
                    print(
                        f"  {r['ms_per_call']:8.3f} ms  x{r['launches_per_call']:5.1f}{rate}  {r['kernel'][:110]}",
                        flush=True,
                    )
                    for op in r.get("sources", [])[:6]:
                        print(f"        from {op[:120]}", flush=True)
                out["runs"].append(run)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"kernel_times_{a.op}_{a.preset}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
