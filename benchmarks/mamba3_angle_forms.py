"""Mamba-3's angles `Θ` by the Triton kernel (`common/angle_kernel.py`, `Mamba3BlockSizes(angles=
"kernel")`, the default) against XLA's passes (`angles="xla"`): the layer at the 2.7B size as
`axkern bench` runs it, forward and forward+backward, each form timed in every round, the rounds
in shuffled order; and the angles alone (the kernel against `angles.angle_sums` with the move to
heads first), forward and forward+backward.

    OUT=<folder> python3 benchmarks/mamba3_angle_forms.py [--rounds N] [--mimo] [--tiles R,W,C,S ...]

writes `$OUT/mamba3_angle_forms.json`. `--mimo`: the MIMO rank-4 case (`pallas_gpu`) too.
`--tiles`: the kernel alone also with these positions per block, warps, angles per program and
pipeline stages (`angle_thetas`' `rows`, `warps`, `cols`, `stages`; C 0 for all), each row with its largest distance from XLA's `Θ` (modulo 2π).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
from records import header, write  # (this folder's: run as a script)

from axkern import bench
from axkern.ops.mamba3 import common, mosaic_gpu
from axkern.ops.mamba3.common import angle_kernel
from axkern.ops.mamba3.common.angles import angle_sums
from axkern.ops.chunked.chunks import clean

_KERNEL = common.angle_thetas_for


def _form(name):
    """Make the cores built from now on take `Θ` from the kernel or from XLA."""
    pick = _KERNEL if name == "kernel" else (lambda interpret: None)
    common.angle_thetas_for = mosaic_gpu.angle_thetas_for = pick


def _xla_thetas(angles, dt, theta0, seg):
    inc = math.pi * jnp.tanh(clean(angles.astype(jnp.float32))) * jnp.swapaxes(dt, 1, 2)[..., None]
    return jnp.swapaxes(angle_sums(inc, theta0, seg, 64), 1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mimo", action="store_true")
    parser.add_argument("--tiles", nargs="*", default=[])
    opts = parser.parse_args()
    cases = [(c, "mosaic_gpu") for c in bench.cases_for("mamba3", preset="mamba3_2.7b") if "SISO" in c.label]
    if opts.mimo:
        cases += [
            (c, "pallas_gpu") for c in bench.cases_for("mamba3", preset="mamba3_2.7b") if "MIMO" in c.label
        ]
    out = header("mamba3_angle_forms.py", rounds=opts.rounds, rows=[])
    fns = {}
    for case, impl in cases:
        args = case.make(jax.random.PRNGKey(0))
        cot = bench._cotangent(case, args)
        for form in ("kernel", "xla"):
            _form(form)
            fwd = jax.jit(case.forward_for(impl))
            both = jax.jit(bench._forward_backward(case, impl))
            fwd(*args), both(cot, *args)  # compiled now, with this form's cores
            text = both.lower(cot, *args).as_text()
            assert ("axkern_mamba3_angles" in text) == (form == "kernel"), (case.label, form)
            fns[(case.label, impl, form, "fwd")] = (fwd, args)
            fns[(case.label, impl, form, "fwd+bwd")] = (both, (cot, *args))
        _form("kernel")
    # the angles alone at the SISO case's sizes
    b, length, h, a = 4, 4096, 80, 32
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    alone = (
        jax.random.normal(keys[0], (b, length, h, a)),
        jax.nn.softplus(jax.random.normal(keys[1], (b, h, length))),
        jax.random.uniform(keys[2], (b, h, a), maxval=6.0),
        jnp.zeros((b, length), jnp.int32),
    )
    g = jax.random.normal(keys[3], (b, h, length, a))
    forms = [("kernel", angle_kernel.angle_thetas), ("xla", _xla_thetas)]
    for tiles in opts.tiles:
        rows, warps, cols, stages = (int(t) for t in tiles.split(","))
        tile = dict(rows=rows, warps=warps, cols=cols or None, stages=stages)
        forms.append((f"kernel {tiles}", functools.partial(angle_kernel.angle_thetas, **tile)))
    want = np.float64(jax.jit(_xla_thetas)(*alone))
    distance = {}
    for form, f in forms:
        diff = np.abs(np.float64(jax.jit(f)(*alone)) - want)
        distance[form] = float(np.max(np.minimum(diff, 2 * math.pi - diff)))
        fns[("angles alone", "-", form, "fwd")] = (jax.jit(f), alone)
        grad = jax.jit(jax.grad(lambda *x, f=f: jnp.sum(f(*x, alone[3]) * g), argnums=(0, 1, 2)))
        fns[("angles alone", "-", form, "fwd+bwd")] = (grad, alone[:3])
    times = {k: [] for k in fns}
    order = list(fns)
    for _ in range(opts.rounds):
        random.shuffle(order)
        for key in order:
            fn, fn_args = fns[key]
            times[key].append(bench.time_spread(fn, fn_args, repeats=5)[1])
    for (label, impl, form, pass_), ms in times.items():
        ms = sorted(ms)
        row = {"case": label, "implementation": impl, "angles": form, "pass": pass_}
        if label == "angles alone":
            row["max_distance_from_xla"] = distance[form]
        row |= {"ms": ms[len(ms) // 2], "ms_min": ms[0], "ms_max": ms[-1]}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    write(out, "mamba3_angle_forms.json")


if __name__ == "__main__":
    main()
