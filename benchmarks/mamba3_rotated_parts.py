"""The differentiated Mamba-3 forward's halves of the rotated `q`, `k` at the 2.7B layer's sizes
(`[4, 80, 4096, 128]` per operand, one group, 32 angles), formed by `rotation.rotated_parts` in
its forms beside XLA's (`operand_parts(value())`, each operand in its own pass), timed
alternately in rounds; the kernel's outputs compared with XLA's.

    OUT=<folder> python3 benchmarks/mamba3_rotated_parts.py [--rounds 5]

writes `$OUT/mamba3_rotated_parts.json`: per form the median of each round's time (ms, both
operands), the bytes the kernel must move (each operand's `hi`, `lo` written and the angles
read, once for a pair) and the rate against them. Forms: `xla`; `kernel_single` (one call per
operand, each computing `cos`, `sin`); `kernel_pair_R_W_S` (one call for both, `R` positions, `W`
warps and `S` pipeline stages a program).
"""

from __future__ import annotations

import argparse
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
from records import header, write

from axkern import bench
from axkern.ops.chunked.mosaic_gpu import operand_parts, rotation

B, G, H, L, N, A = 4, 1, 80, 4096, 128, 32
TILES = [
    (32, 2, 1),
    (32, 4, 1),
    (64, 4, 1),
    (64, 4, 2),
    (64, 8, 1),
    (128, 4, 1),
    (128, 8, 1),
    (128, 8, 2),
    (256, 8, 1),
]


def operands():
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    theta = jax.random.uniform(keys[0], (B, H, L, A), maxval=6.28)
    make = lambda k1, k2: rotation.RotatedOperand(  # noqa: E731
        jax.random.normal(k1, (B, G, L, N)).astype(jnp.bfloat16), jax.random.normal(k2, (H, N)), theta, True
    )
    return make(keys[1], keys[2]), make(keys[3], keys[4])


def forms() -> dict:
    out = {
        "xla": lambda q, k: (*operand_parts(q.value()), *operand_parts(k.value())),
        "kernel_single": lambda q, k: (*rotation.rotated_parts(q), *rotation.rotated_parts(k)),
    }
    for rows, warps, stages in TILES:
        out[f"kernel_pair_{rows}_{warps}_{stages}"] = lambda q, k, r=rows, w=warps, s=stages: (
            rotation.rotated_parts(q, k, rows=r, warps=w, stages=s)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    q, k = operands()
    fns = {name: jax.jit(f) for name, f in forms().items()}
    want = [np.asarray(x, np.float32) for x in fns["xla"](q, k)]
    rows = {}
    for name, fn in fns.items():
        got = [np.asarray(x, np.float32) for x in fn(q, k)]
        rows[name] = {
            "hi_equal": float(np.mean([np.mean(g == w) for g, w in zip(got[::2], want[::2], strict=True)])),
            "max_sum_diff": float(
                max(
                    np.max(np.abs((g0 + g1) - (w0 + w1)))
                    for g0, g1, w0, w1 in zip(got[::2], got[1::2], want[::2], want[1::2], strict=True)
                )
            ),
            "times": [],
        }
    for _ in range(a.rounds):
        names = list(fns)
        random.shuffle(names)
        for name in names:
            rows[name]["times"].append(bench.time_spread(fns[name], (q, k), repeats=5)[1])
    written = 2 * 2 * B * H * L * N * 2  # two operands' hi and lo, bf16
    angles = B * H * L * A * 4
    for name, row in rows.items():
        row["ms"] = float(np.median(row["times"]))
        moved = written + angles * (2 if name in ("xla", "kernel_single") else 1)
        row["gb"] = moved / 1e9
        row["gb_per_s"] = moved / 1e9 / (row["ms"] / 1e3)
        print(name, json.dumps(row), flush=True)
    write(
        header("mamba3_rotated_parts.py", shape=[B, G, H, L, N, A], forms=rows), "mamba3_rotated_parts.json"
    )


if __name__ == "__main__":
    main()
