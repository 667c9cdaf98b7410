"""Where the non-finite guard of `cudnn` and `mosaic_gpu` attention spends its time: each
implementation behind the guard as shipped (its conditional's arrays 1-D, `core.control.flat_cond`),
behind the same guard with a plain `lax.cond` (the earlier form), and bare (the kernels alone,
no check), causal and a 1024-token window at B=2 L=8192 H=32 D=128 bf16, forward and
forward+backward. Median of three interleaved rounds of `time_spread` (5 repeats), then each one's
kernels and idle time over five calls under PyTorch's profiler (`kernel_times.profile`). Needs an
H100/H200, torch with CUDA and cuDNN:

    OUT=<folder> python3 benchmarks/attention_guard.py

writes `$OUT/sweep_guard_profile.json`."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

import axkern
from axkern import masks
from axkern.bench import time_spread
from axkern.ops.attention import common

sys.path.append(str(Path(__file__).parent))
from kernel_times import profile  # noqa: E402

B, S, H, D = 2, 8192, 32, 128


def main():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in keys)
    guarded, flat = common.guarded, common.flat_cond
    plain = lambda pred, t, f, *ops: lax.cond(pred, t, f, *ops)  # noqa: E731
    bare = lambda fast, q, k, v, sinks, mask, **kw: fast(q, k, v, sinks, mask)  # noqa: E731
    rows = []
    for mname, mask in (("causal", masks.Causal()), ("window1024", masks.SlidingWindow(1024))):
        fns = {}
        for impl in ("mosaic_gpu", "cudnn"):
            for variant, g, cond in (
                ("guarded", guarded, flat),
                ("lax_cond", guarded, plain),
                ("bare", bare, flat),
            ):
                common.guarded, common.flat_cond = g, cond  # read when the call is traced, just below

                def f(q, k, v, impl=impl, mask=mask):
                    return axkern.positional.attention(q, k, v, mask=mask, implementation=impl)

                fwd = jax.jit(f)
                both = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
                jax.block_until_ready(fwd(q, k, v))
                jax.block_until_ready(both(q, k, v, do))
                fns[(impl, variant)] = (fwd, both)
        common.guarded, common.flat_cond = guarded, flat
        for pass_ in ("fwd", "fwd+bwd"):
            args = (q, k, v) if pass_ == "fwd" else (q, k, v, do)
            which = 0 if pass_ == "fwd" else 1
            times = {key: [] for key in fns}
            for _ in range(3):  # interleaved: all see the same clocks
                for key, fn_pair in fns.items():
                    times[key].append(time_spread(fn_pair[which], args, repeats=5)[1])
            for key, fn_pair in fns.items():
                kernels, timeline = profile(fn_pair[which], args, 5)
                row = dict(
                    mask=mname,
                    impl=key[0],
                    variant=key[1],
                    pass_=pass_,
                    median_ms=sorted(times[key])[1],
                    times=times[key],
                    timeline=timeline,
                    kernels=kernels[:25],
                )
                rows.append(row)
                print(json.dumps({name: x for name, x in row.items() if name != "kernels"}), flush=True)
    out = {
        "command": "OUT=<folder> python3 benchmarks/attention_guard.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "rows": rows,
    }
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep_guard_profile.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
