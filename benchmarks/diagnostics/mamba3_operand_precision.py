"""How Mamba-3 SISO's `q`, `k` may enter SSD's Mosaic GPU chunk kernels, by the oracle rule.

SSD's `mosaic_gpu` kernels take `B`, `C` (Mamba-3's rotated `k`, `q`) as 16-bit operands. In
SSD they are bf16 inputs, exact in bf16; in Mamba-3 they are float32 values formed from the
inputs (biases, rotations), which the kernels take as two bf16 halves each (`mamba3`'s
`mosaic_gpu`) or would have to round. This runs Mamba-3's chunked
layer (`kernel_core`, the chunk scan `pallas_gpu` calls) on the CPU with the four stage kernels
replaced by their emulation (`chunked/mosaic_gpu/emulate.py`: the kernels' roundings, exact
products) and `B`, `C` rounded to bf16 where a variant says so, and reports, for the outputs
(`y` and the final states) and every gradient, the largest `max|emulated - oracle| / bound`
of DESIGN.md's rule (over 1: the rule fails). Variants:

- `halves`: `B`, `C` as two bf16 halves each (`chunked.mosaic_gpu.operand_parts`: what `mamba3`'s
  `mosaic_gpu` runs);
- `state k`: `k` rounded in the chunk state's kernels (forward and backward);
- `scan q`: `q` rounded in the chunk scan's kernels; `scan q, k`: both there;
- `all`: both rounded everywhere (the kernels as they are).

Run from the repository root: `OUT=<folder> python3 benchmarks/diagnostics/mamba3_operand_precision.py`
(a few minutes on a CPU); writes `$OUT/sweep_operand_precision.json`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests`: the cases and the rule

import axkern  # noqa: E402
from axkern.ops.chunked.mosaic_gpu.emulate import EmulatedLayout  # noqa: E402
from axkern.ops.mamba3 import pallas_gpu as layer  # noqa: E402

VARIANTS = {
    "halves": (),
    "state k": ("state_k",),
    "scan q": ("scan_q",),
    "scan q, k": ("scan_q", "scan_k"),
    "all": ("state_k", "scan_q", "scan_k"),
}
# batch, length, heads, head dim, groups, state, angles; segments
CASES = [
    ((1, 150, 4, 64, 2, 64, 16), True),
    ((2, 128, 2, 128, 1, 64, 16), False),
    ((1, 200, 2, 64, 1, 128, 32), True),
]


def _bf16(a):
    return a.astype(jnp.bfloat16).astype(jnp.float32)


def emulated_layout(rounded):
    """The layer through the Mosaic kernels' arithmetic (`EmulatedLayout`), `B` / `C`
    rounded to bf16 where `rounded` names them ("state_k", "scan_q", "scan_k")."""

    def bc(kernel, bt, ct=None):
        bt = _bf16(bt) if f"{kernel}_k" in rounded else bt
        ct = None if ct is None else (_bf16(ct) if f"{kernel}_q" in rounded else ct)
        return bt, ct

    class Rounded(EmulatedLayout):
        def chunk_state(self, xt, w, bt, *, dtype):
            return super().chunk_state(xt, w, bc("state", bt)[0], dtype=dtype)

        def chunk_state_bwd(self, xt, w, bt, d_own, dx_scan, db_scan):
            return super().chunk_state_bwd(xt, w, bc("state", bt)[0], d_own, dx_scan, db_scan)

        def chunk_scan(self, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums, dtype):
            bt, ct = bc("scan", bt, ct)
            return super().chunk_scan(xt, scale, cum, ac, f, sc, bt, ct, states_in, sums=sums, dtype=dtype)

        def chunk_scan_bwd(self, dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, *, sums):
            bt, ct = bc("scan", bt, ct)
            return super().chunk_scan_bwd(dy, xt, scale, cum, ac, f, sc, bt, ct, states_in, sums=sums)

    return Rounded


def ratios(got, same, want, dtype):
    """The largest `err / bound` of the rule over the leaves."""
    from tests.helpers import ATOL

    worst = 0.0
    for g, r, o in zip(jax.tree.leaves(got), jax.tree.leaves(same), jax.tree.leaves(want), strict=True):
        g, r, o = (np.asarray(v, np.float64) for v in (g, r, o))
        if np.isnan(g).any():
            return float("nan")
        scale = max(np.abs(o).max(initial=0.0), 1e-30)
        bound = 2 * np.abs(r - o).max(initial=0.0) + ATOL[dtype] * scale
        worst = max(worst, float(np.abs(g - o).max(initial=0.0) / bound))
    return worst


def main():
    from tests.cases.mamba3 import make, run
    from tests.harness import oracle

    dtype, original = "bfloat16", layer.kernel_core
    rows = []
    for dims, segments in CASES:
        arrays, seg = make(0, *dims, 0, dtype, segments=segments)
        runner = lambda name, a, **_: run(name, a, seg, 64 if name != "reference" else None)  # noqa: B023, E731
        want, same = oracle(runner, arrays), runner("reference", arrays)
        for label, rounded in VARIANTS.items():
            layer.kernel_core = lambda _layout, rounded=rounded, **kw: original(
                emulated_layout(rounded), **kw
            )
            try:
                with axkern.use(interpret=True):
                    got = runner("pallas_gpu", arrays)
            finally:
                layer.kernel_core = original
            row = {
                "case": dict(
                    zip(
                        ("batch", "length", "heads", "head_dim", "groups", "state", "angles"),
                        dims,
                        strict=True,
                    )
                ),
                "segments": segments,
                "variant": label,
                "outputs": ratios(got[0], same[0], want[0], dtype),
                "gradients": ratios(got[1], same[1], want[1], dtype),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "command": "OUT=<folder> python3 benchmarks/diagnostics/mamba3_operand_precision.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "note": "largest max|emulated - oracle| / bound of the oracle rule (over 1 fails), outputs and "
        "gradients, bf16 inputs, chunks of 64",
        "rows": rows,
    }
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_operand_precision.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
