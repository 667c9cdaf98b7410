"""What parts of SSD's two lean `mosaic_gpu` kernels cost on one GPU, by leaving them out: the
chunk-scan backward (`backward.py`, `lean=True`, `dB` and `dC` summed into each group's rows by
TMA reductions) and the lean fused forward (`forward_lean.py`, writing the entering states),
each timed as it is and with a part left out, at the Mamba-2 2.7B layer (batch 4, L 4096, 80
heads, P 64, N 128, one group), in shuffled rounds (`bench.time_rounds`).

Left out (by replacing `backward._staged`, through which the lean kernels send their results,
while the kernel is traced): `no_waits`, the waits before a staging tile is written again (its
copy out may still be reading it: the results may be wrong); `no_dbdc`, the chunk-scan
backward's `dB`, `dC` copies (its TMA reductions; the others kept). Also the whole chunk-scan
backward kernel, the forward without the entering states (`states=False`, the forward
alone's form), and both lean kernels with two `[64, 32]` staging tiles in turn (`two_tiles`:
`kernels.STAGES` replaced; a form whose results the CPU shim checks, not these runs). The
others are measures of a part's cost, not forms: their results are wrong by design.

    OUT=<folder> python3 benchmarks/ssd_lean_costs.py [--rounds 7]

writes `$OUT/sweep_lean_costs.json`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp

from axkern import bench
from axkern.ops.ssd import mosaic_gpu
from axkern.ops.chunked.mosaic_gpu import backward, forward_lean, kernels
from axkern.ops.chunked.mosaic_gpu.kernels import CHUNK, plgpu

B, H, G, L, P, N = 4, 80, 1, 4096, 64, 128
_STAGED = backward._staged  # the kernels' own, which the variants wrap


def _inputs():
    q, c, bf = CHUNK, L // CHUNK, jnp.bfloat16
    k = jax.random.split(jax.random.PRNGKey(0), 8)
    x, dy = (jax.random.normal(k[i], (B, H, L, P)).astype(bf) for i in (0, 1))
    bt, ct = (jax.random.normal(k[i], (B, G, L, N)).astype(bf) for i in (2, 3))
    dt = jax.nn.softplus(jax.random.normal(k[4], (B, H, L)))
    cum = jnp.cumsum((-0.01 * dt).reshape(B, H, c, q), -1)
    w = (jnp.exp(cum[..., -1:] - cum) * dt.reshape(B, H, c, q)).reshape(B, H, L)
    keep, cum = jnp.exp(cum[..., -1]), cum.reshape(B, H, L)
    seg = jnp.zeros((B, L), jnp.int32)
    s0 = jax.random.normal(k[5], (B, H, P, N))
    states = jax.random.normal(k[6], (B, c, H, P, N))
    scan_bwd = (dy, x, dt, cum, jnp.exp(cum), seg, bt, ct, states)
    forward = (x, w, dt, cum, jnp.exp(cum), keep, seg, bt, ct, s0)
    return scan_bwd, forward


class _NoWaits:
    """`plgpu` with `wait_smem_to_gmem` doing nothing."""

    def __getattr__(self, name):
        return getattr(plgpu, name)

    @staticmethod
    def wait_smem_to_gmem(*args, **kwargs):
        return None


def _staged_without(waits=True, dbdc=True):
    """`backward._staged` with its waits (`waits=False`: `plgpu` replaced while it sends) or its
    reductions' copies (`dbdc=False`) left out."""

    def staged(stages):
        inner = _STAGED(stages)

        def send(value, dst, reduction_op=None):
            if reduction_op is not None and not dbdc:
                return
            if not waits:
                backward.plgpu = _NoWaits()
            try:
                inner(value, dst, reduction_op)
            finally:
                backward.plgpu = plgpu

        return send

    return staged


def _compiled(fn, args, two_tiles=False, **without):
    """`fn` jitted and compiled on `args` with `_staged` replaced as `without` asks, or
    (`two_tiles`) the staging tiles two of 64 x 32."""
    staged, stages = backward._staged, kernels.STAGES
    if without:
        backward._staged = forward_lean._staged = _staged_without(**without)
    if two_tiles:
        kernels.STAGES = forward_lean.STAGES = [((CHUNK, CHUNK // 2), jnp.float32)] * 2
    try:  # (a fresh callable: `jax.jit` would reuse the trace it holds for `fn`)
        run = jax.jit(functools.partial(fn)).lower(*args).compile()
    finally:
        backward._staged = forward_lean._staged = staged
        kernels.STAGES = forward_lean.STAGES = stages
    jax.block_until_ready(run(*args))
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    scan_args, fwd_args = _inputs()
    scan = functools.partial(mosaic_gpu.chunk_scan_bwd, group_sums=True)
    fwd = functools.partial(mosaic_gpu.fused_forward, lean=True, y_dtype=jnp.bfloat16)
    variants = {
        "scan_bwd_lean": (_compiled(functools.partial(scan, lean=True), scan_args), scan_args),
        "scan_bwd_lean_no_waits": (
            _compiled(functools.partial(scan, lean=True), scan_args, waits=False),
            scan_args,
        ),
        "scan_bwd_lean_no_dbdc": (
            _compiled(functools.partial(scan, lean=True), scan_args, dbdc=False),
            scan_args,
        ),
        "scan_bwd_lean_two_tiles": (
            _compiled(functools.partial(scan, lean=True), scan_args, two_tiles=True),
            scan_args,
        ),
        "scan_bwd_whole": (_compiled(scan, scan_args), scan_args),
        "forward_lean": (_compiled(fwd, fwd_args), fwd_args),
        "forward_lean_no_waits": (_compiled(fwd, fwd_args, waits=False), fwd_args),
        "forward_lean_two_tiles": (_compiled(fwd, fwd_args, two_tiles=True), fwd_args),
        "forward_lean_no_states": (_compiled(functools.partial(fwd, states=False), fwd_args), fwd_args),
    }
    # one argument list for `time_rounds`: each function closes over its own arguments
    fns = {name: (lambda run=run, args=args: run(*args)) for name, (run, args) in variants.items()}
    samples, medians = bench.time_rounds(fns, (), rounds=a.rounds)
    rows = [
        {"variant": name, "ms": statistics.median(medians[name]), "samples_ms": samples[name]} for name in fns
    ]
    for row in rows:
        print(f"{row['variant']:28s} {row['ms']:.3f} ms", flush=True)
    out = {
        "command": f"OUT=<folder> python3 benchmarks/ssd_lean_costs.py --rounds {a.rounds}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "case": f"B={B} L={L} H={H} P={P} N={N} G={G} bfloat16",
        "rows": rows,
    }
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep_lean_costs.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
