"""Which products of SSD's chunked forward can take 16-bit operands, by the oracle rule.

A float64 emulation (NumPy, on the CPU) of the chunked scan: per chunk `C Bᵀ`, the decayed
scores `M = (C Bᵀ) ∘ Λ ∘ dt` times `x`, the incoming state `C S_inᵀ`, the chunk's own state
`(w ∘ x)ᵀ B`. Each product's operands are rounded as a tensor core would take them (`bf16`;
`tf32`, a 10-bit mantissa, what float32 operands become; `bf16x2`, a float32 operand as the sum
of two bf16 products, hi and lo) and the products summed exactly; `y` (before `D` and the gate)
and the final state are held to DESIGN.md's rule against the float64 oracle (`reference.ssd`):
`max|emulated - oracle| <= 2 * max|float32 reference - oracle| + 2e-3 * max|oracle|`. The
inputs `x`, `B`, `C` are bf16 values, `dt` and `A` float32, as the kernels see them.

Run from the repository root: `OUT=<folder> python3 benchmarks/ssd_operand_precision.py`
(a few minutes on a CPU); writes `$OUT/sweep_operand_precision.json`.
"""

from __future__ import annotations

import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

from axkern.ops.ssd.reference import ssd as reference  # noqa: E402


def bf16(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float64))


def tf32(a):
    """Rounded to nearest (even) at a 10-bit mantissa."""
    f = np.ascontiguousarray(a, np.float32).view(np.uint32)
    r = ((f + np.uint32(0x0FFF) + ((f >> 13) & np.uint32(1))) & np.uint32(0xFFFFE000)).view(np.float32)
    return r.astype(np.float64)


def f32(a):
    return np.asarray(a, np.float32).astype(np.float64)


def product(kind, a, b):
    """`a @ b` with the operands as `kind` takes them, summed exactly."""
    if kind == "bf16x2":  # a's float32 value as hi + lo, each bf16; b is 16-bit already
        hi = bf16(a)
        return hi @ bf16(b) + bf16(f32(a) - hi) @ bf16(b)
    r = {"bf16": bf16, "tf32": tf32, "f32": f32}[kind]
    return r(a) @ r(b)


def chunked(x, dt, A, B, C, q, kinds):
    """`(y [L, H, P], final state [H, P, N])` of one group's heads, chunks of `q`."""
    length, heads, p = x.shape
    a = dt * A[None]
    y = np.zeros((length, heads, p))
    state = np.zeros((heads, p, B.shape[1]))
    for c0 in range(0, length, q):
        rows = slice(c0, c0 + q)
        cum = np.cumsum(a[rows], axis=0)
        xc, dtc, bc, cc = x[rows], dt[rows], B[rows], C[rows]
        n = xc.shape[0]
        cb = product(kinds["C·Bᵀ"], cc, bc.T)
        below = np.tril(np.ones((n, n)))
        for h in range(heads):
            m = f32(cb * np.exp(cum[:, None, h] - cum[None, :, h]) * below * dtc[None, :, h])
            y[rows, h] = product(kinds["M·x"], m, xc[:, h])
            y[rows, h] += np.exp(cum[:, h])[:, None] * product(kinds["C·S_inᵀ"], cc, state[h].T)
            w = np.exp(cum[-1, h] - cum[:, h]) * dtc[:, h]
            own = product(kinds["(w∘x)ᵀ·B"], f32(w[:, None] * xc[:, h]).T, bc)
            state[h] = np.exp(cum[-1, h]) * state[h] + own
    return y, state


PRODUCTS = ("C·Bᵀ", "M·x", "C·S_inᵀ", "(w∘x)ᵀ·B")
FORMS = {
    "tf32 everywhere": dict.fromkeys(PRODUCTS, "tf32"),
    "C·Bᵀ bf16": {**dict.fromkeys(PRODUCTS, "tf32"), "C·Bᵀ": "bf16"},
    "C·Bᵀ, M·x bf16": {**dict.fromkeys(PRODUCTS, "tf32"), "C·Bᵀ": "bf16", "M·x": "bf16"},
    "C·Bᵀ bf16, M·x bf16x2": {**dict.fromkeys(PRODUCTS, "tf32"), "C·Bᵀ": "bf16", "M·x": "bf16x2"},
    "C·Bᵀ, C·S_inᵀ bf16": {**dict.fromkeys(PRODUCTS, "tf32"), "C·Bᵀ": "bf16", "C·S_inᵀ": "bf16"},
    "C·Bᵀ, state bf16": {**dict.fromkeys(PRODUCTS, "tf32"), "C·Bᵀ": "bf16", "(w∘x)ᵀ·B": "bf16"},
    "bf16 everywhere": dict.fromkeys(PRODUCTS, "bf16"),
    "bf16, M·x bf16x2": {**dict.fromkeys(PRODUCTS, "bf16"), "M·x": "bf16x2"},
}
# (length, heads, head dim P, state N, seed)
CASES = [(2048, 2, 64, 128, 0), (1024, 2, 64, 128, 1), (1024, 2, 128, 64, 2)]
CHUNKS = (64, 256)


def main():
    rows = []
    for length, heads, p, n, seed in CASES:
        rng = np.random.default_rng(seed)
        x = bf16(rng.standard_normal((length, heads, p)))
        dt = f32(np.log1p(np.exp(rng.standard_normal((length, heads)) - 2)))  # softplus: about 0.1
        A = f32(-np.exp(rng.uniform(0, 1.5, heads)))
        B = bf16(rng.standard_normal((length, n)) * (2 / np.sqrt(n)))
        C = bf16(rng.standard_normal((length, n)) * (2 / np.sqrt(n)))

        args = (x[None], dt[None], A, B[None, :, None], C[None, :, None])
        refs = []
        for dtype in (jnp.float64, jnp.float32):  # the oracle, then the reference in float32
            y, s = reference(
                *(jnp.asarray(v, dtype) for v in args), None, None, None, jnp.zeros((1, heads, p, n), dtype)
            )
            refs.append((np.asarray(y, np.float64)[0], np.asarray(s, np.float64)[0]))
        (y64, s64), (y32, s32) = refs
        bound_y = 2 * np.abs(y32 - y64).max() + 2e-3 * np.abs(y64).max()
        bound_s = 2 * np.abs(s32 - s64).max() + 2e-3 * np.abs(s64).max()
        for q in CHUNKS:
            for form, kinds in FORMS.items():
                y, s = chunked(x, dt, A, B, C, q, kinds)
                err_y, err_s = float(np.abs(y - y64).max()), float(np.abs(s - s64).max())
                row = dict(
                    case=f"L={length} H={heads} P={p} N={n} seed {seed}",
                    chunk=q,
                    form=form,
                    operands=kinds,
                    y_err=err_y,
                    y_bound=float(bound_y),
                    y_rel=err_y / float(np.abs(y64).max()),
                    y_ok=bool(err_y <= bound_y),
                    state_err=err_s,
                    state_bound=float(bound_s),
                    state_ok=bool(err_s <= bound_s),
                )
                rows.append(row)
                print(
                    f"{row['case']} Q={q:3d} {form:24s} y {err_y:.2e} / {bound_y:.2e} {'ok' if row['y_ok'] else 'FAIL'}"
                    f"   state {err_s:.2e} / {bound_s:.2e} {'ok' if row['state_ok'] else 'FAIL'}",
                    flush=True,
                )
    out = os.path.join(os.environ.get("OUT", "."), "sweep_operand_precision.json")
    with open(out, "w") as f:
        json.dump(
            dict(
                command="OUT=<folder> python3 benchmarks/ssd_operand_precision.py",
                date=datetime.date.today().isoformat(),
                device="CPU (float64 NumPy emulation)",
                jax=jax.__version__,
                rows=rows,
            ),
            f,
            indent=1,
        )
    print("wrote", out)


if __name__ == "__main__":
    main()
