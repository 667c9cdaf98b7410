"""Mamba-3's angles `Θ` by the Triton kernel (`common/angle_kernel.py`, `Mamba3BlockSizes(angles=
"kernel")`, the default) against XLA's passes (`angles="xla"`): the layer at the 2.7B size as
`axkern bench` runs it, forward and forward+backward, each form timed in every round, the rounds
in shuffled order; and the angles alone (the kernel against `angles.angle_sums` with the move to
heads first), forward and forward+backward.

    OUT=<folder> python3 benchmarks/mamba3_angle_forms.py [--rounds N] [--mimo] [--chain] [--sums]
        [--tiles R,W,C,S ...]

writes `$OUT/mamba3_angle_forms.json`. `--mimo`: the MIMO rank-4 case (`pallas_gpu`) too.
`--chain`: also the form `chain`, the kernel with the carried angle formed from the block's last
row of sums before the remainder (`_forward_chain`, `_backward_chain`: the same arithmetic, so
the same values; the row's reduction leaves the chain of steps one block waits on). `--sums`:
also the layer (`mosaic_gpu`) with the backward's sums of the turned-back cotangents of `q`, `k`
by one Triton kernel (`Mamba3BlockSizes(rotation_backward="kernel")`). `--tiles`:
the kernel alone also with these positions per block, warps, angles per program and pipeline
stages (`angle_thetas`' `rows`, `warps`, `cols`, `stages`; C 0 for all), each row with its
largest distance from XLA's `Θ` (modulo 2π).
"""

from __future__ import annotations

import argparse
import json
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from records import header, write  # (this folder's: run as a script)

from axkern import bench
from axkern.ops.mamba3 import common, mosaic_gpu
from axkern.ops.mamba3.common import angle_kernel
from axkern.ops.mamba3.common.angles import angle_sums
from axkern.ops.ssd.common.chunks import clean

_KERNEL = common.angle_thetas_for
_BODIES = (angle_kernel._forward_kernel, angle_kernel._backward_kernel)


def _forward_chain(ang_ref, dt_ref, theta0_ref, seg_ref, theta_ref, *, rows, exact):
    """`angle_kernel._forward_kernel` with the next block's carry from the last row of sums (a
    reduction no step waits on) and the carried angle: the same values."""
    blocks = seg_ref.shape[0] // rows
    row = angle_kernel._row

    def block(i, carry):
        theta_c, seg_c = carry
        at = pl.ds(pl.multiple_of(i * rows, rows), rows)
        a = ang_ref[at, :].astype(jnp.float32)
        inc = math.pi * jnp.tanh(jnp.where(angle_kernel._finite(a), a, 0.0)) * dt_ref[at][:, None]
        seg = seg_ref[at]
        local = jnp.dot(angle_kernel._mask(seg, rows, False), inc, precision=exact)
        last, last_seg = row(local, rows, rows - 1), row(seg, rows, rows - 1)
        theta_ref[at, :] = jnp.mod(
            local + jnp.where((seg == seg_c)[:, None], theta_c[None, :], 0.0), 2 * math.pi
        )
        return jnp.mod(last + jnp.where(last_seg == seg_c, theta_c, 0.0), 2 * math.pi), last_seg

    lax.fori_loop(0, blocks, block, (theta0_ref[...].astype(jnp.float32), jnp.int32(0)))


def _backward_chain(g_ref, ang_ref, dt_ref, seg_ref, dang_ref, ddt_ref, dtheta0_ref, *, rows, exact):
    """`angle_kernel._backward_kernel` with the carry from the first row of sums and the carry."""
    blocks = seg_ref.shape[0] // rows
    row = angle_kernel._row

    def block(j, carry):
        d_c, seg_c = carry
        at = pl.ds(pl.multiple_of((blocks - 1 - j) * rows, rows), rows)
        seg = seg_ref[at]
        sums = jnp.dot(angle_kernel._mask(seg, rows, True), g_ref[at, :], precision=exact)
        first, first_seg = row(sums, rows, 0), row(seg, rows, 0)
        d_inc = sums + jnp.where((seg == seg_c)[:, None], d_c[None, :], 0.0)
        a = ang_ref[at, :].astype(jnp.float32)
        ok = angle_kernel._finite(a)
        th = jnp.tanh(jnp.where(ok, a, 0.0))
        dang = jnp.where(ok, d_inc * (math.pi * dt_ref[at])[:, None] * (1.0 - th * th), jnp.nan)
        dang_ref[at, :] = dang.astype(dang_ref.dtype)
        ddt_ref[at] = jnp.sum(d_inc * th, axis=1) * math.pi
        return first + jnp.where(first_seg == seg_c, d_c, 0.0), first_seg

    d0 = jnp.zeros(dtheta0_ref.shape, jnp.float32)
    d_first, _ = lax.fori_loop(0, blocks, block, (d0, jnp.int32(-1)))
    dtheta0_ref[...] = d_first


_ROTATING_CORE = mosaic_gpu.rotating_core


def _with_sums_kernel(*args, **kw):
    return _ROTATING_CORE(*args, **(kw | {"cotangent_kernel": True}))


def _form(name):
    """Make the cores built from now on take `Θ` from the kernel (`chain`: its variant above)
    or from XLA; `sums`: the kernel, and the rotating core's backward sums of the turned-back
    cotangents of `q`, `k` by one Triton kernel (`rotation_backward="kernel"`)."""
    pick = (lambda interpret: None) if name == "xla" else _KERNEL
    common.angle_thetas_for = mosaic_gpu.angle_thetas_for = pick
    bodies = (_forward_chain, _backward_chain) if name == "chain" else _BODIES
    angle_kernel._forward_kernel, angle_kernel._backward_kernel = bodies
    mosaic_gpu.rotating_core = _with_sums_kernel if name == "sums" else _ROTATING_CORE


def _xla_thetas(angles, dt, theta0, seg):
    inc = math.pi * jnp.tanh(clean(angles.astype(jnp.float32))) * jnp.swapaxes(dt, 1, 2)[..., None]
    return jnp.swapaxes(angle_sums(inc, theta0, seg, 64), 1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mimo", action="store_true")
    parser.add_argument("--tiles", nargs="*", default=[])
    parser.add_argument("--chain", action="store_true")
    parser.add_argument("--sums", action="store_true")
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
        texts = {}
        extra = (("chain",) if opts.chain else ()) + (("sums",) if opts.sums and impl == "mosaic_gpu" else ())
        for form in ("kernel", "xla", *extra):
            _form(form)
            fwd = jax.jit(case.forward_for(impl))
            both = jax.jit(bench._forward_backward(case, impl))
            fwd(*args), both(cot, *args)  # compiled now, with this form's cores
            texts[form] = text = both.lower(cot, *args).as_text()
            assert ("axkern_mamba3_angles" in text) == (form != "xla"), (case.label, form)
            assert ("axkern_ssd_rotation_cotangents" in text) == (form == "sums"), (case.label, form)
            fns[(case.label, impl, form, "fwd")] = (fwd, args)
            fns[(case.label, impl, form, "fwd+bwd")] = (both, (cot, *args))
        _form("kernel")
        assert texts.get("chain", "") != texts["kernel"]  # (the variant's kernels, not a cached trace)
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
    # (name, the function, the form its kernels take); each traced and compiled under its form
    forms = [("kernel", {}, "kernel"), ("xla", None, "xla")]
    forms += [("chain", {}, "chain")] if opts.chain else []
    for tiles in opts.tiles:
        rows, warps, cols, stages = (int(t) for t in tiles.split(","))
        forms.append(
            (f"kernel {tiles}", dict(rows=rows, warps=warps, cols=cols or None, stages=stages), "kernel")
        )
    want = np.float64(jax.jit(_xla_thetas)(*alone))
    distance = {}
    for form, tile, bodies in forms:
        _form(bodies)
        f = _xla_thetas if tile is None else (lambda *x, tile=tile: angle_kernel.angle_thetas(*x, **tile))
        fwd = jax.jit(f)
        grad = jax.jit(jax.grad(lambda *x, f=f: jnp.sum(f(*x, alone[3]) * g), argnums=(0, 1, 2)))
        diff = np.abs(np.float64(fwd(*alone)) - want)
        grad(*alone[:3])
        distance[form] = float(np.max(np.minimum(diff, 2 * math.pi - diff)))
        fns[("angles alone", "-", form, "fwd")] = (fwd, alone)
        fns[("angles alone", "-", form, "fwd+bwd")] = (grad, alone[:3])
    _form("kernel")
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
