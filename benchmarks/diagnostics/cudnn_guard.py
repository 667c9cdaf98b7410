"""What the non-finite guard around cuDNN attention costs: `jax.nn.dot_product_attention`
(cuDNN) called directly against axkern's `cudnn` implementation (the same kernel behind
`lax.cond` on the inputs' finiteness), forward and forward+backward, median of interleaved
repeats, and each one's temporary memory; and the finiteness check alone. Run on a CUDA machine:
`OUT=<folder> python3 benchmarks/diagnostics/cudnn_guard.py` (writes `sweep_cudnn_guard.json`, with the
`XLA_FLAGS` it ran under: e.g. `--xla_gpu_enable_command_buffer=...,CONDITIONAL` to time the
guard's `lax.cond` inside a CUDA graph)."""

from __future__ import annotations

import datetime
import json
import os

import jax
import jax.numpy as jnp

import axkern
from axkern import masks
from axkern.bench import time_spread
from axkern.ops.attention.common import all_finite

B, S, H, D = 2, 8192, 32, 128


def raw(q, k, v, window):
    kw = {"is_causal": True} if window is None else {"is_causal": True, "local_window_size": (window - 1, 0)}
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)


def guarded(q, k, v, window):
    mask = masks.Causal() if window is None else masks.SlidingWindow(window)
    return axkern.positional.attention(q, k, v, mask=mask, implementation="cudnn")


def check_only(q, k, v, window):
    del window
    return all_finite(q, k, v)


def temp_gib(jitted, args):
    mem = jitted.lower(*args).compile().memory_analysis()
    return None if mem is None else mem.temp_size_in_bytes / 2**30


def main():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in keys)
    rows = []
    for window in (None, 1024):
        fns = {}
        for name, f in (
            ("jax.nn cudnn", raw),
            ("axkern cudnn (guarded)", guarded),
            ("the finiteness check", check_only),
        ):
            fwd = jax.jit(lambda q, k, v, f=f, w=window: f(q, k, v, w))
            bwd = jax.jit(lambda q, k, v, do, f=f, w=window: jax.vjp(lambda *a: f(*a, w), q, k, v)[1](do))
            fns[name] = {"fwd": (fwd, (q, k, v))}
            if f is not check_only:
                fns[name]["fwd+bwd"] = (bwd, (q, k, v, do))
        for pass_ in ("fwd", "fwd+bwd"):
            timed = {name: by_pass for name, by_pass in fns.items() if pass_ in by_pass}
            times = {name: [] for name in timed}
            for _ in range(3):  # interleaved: all see the same clocks
                for name, by_pass in timed.items():
                    fn, args = by_pass[pass_]
                    times[name].append(time_spread(fn, args, repeats=5))
            for name, by_pass in timed.items():
                fn, args = by_pass[pass_]
                med = sorted(t[1] for t in times[name])[1]
                row = dict(
                    mask="causal" if window is None else f"window{window}",
                    implementation=name,
                    pass_=pass_,
                    median_ms=med,
                    min_ms=min(t[0] for t in times[name]),
                    max_ms=max(t[2] for t in times[name]),
                    temp_gib=temp_gib(fn, args),
                )
                rows.append(row)
                print(row, flush=True)
    result = {
        "command": "OUT=<folder> python3 benchmarks/diagnostics/cudnn_guard.py",
        "shape": {"batch": B, "length": S, "heads": H, "head_dim": D, "dtype": "bfloat16"},
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "rows": rows,
    }
    with open(os.path.join(os.environ.get("OUT", "."), "sweep_cudnn_guard.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
