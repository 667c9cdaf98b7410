"""Which products of SSD's chunked forward can take 16-bit operands, by the oracle rule.

A float64 emulation (NumPy, on the CPU) of the chunked scan: per chunk `C Bᵀ`, the decayed
scores `M = (C Bᵀ) ∘ Λ ∘ dt` times `x`, the incoming state `C S_inᵀ`, the chunk's own state
`(w ∘ x)ᵀ B`. Each product's operands are rounded as a tensor core would take them (`bf16`;
`tf32`, a 10-bit mantissa, what float32 operands become; `bf16x2`, a float32 operand as the sum
of two bf16 products, hi and lo) and the products summed exactly; `y` (before `D` and the gate)
and the final state are held to DESIGN.md's rule against the float64 oracle (`reference.ssd`):
`max|emulated - oracle| <= 2 * max|float32 reference - oracle| + 2e-3 * max|oracle|`. The
inputs `x`, `B`, `C` are bf16 values, `dt` and `A` float32, as the kernels see them.

The gradients (`gradients`): the same chunked forward in JAX, each product a `custom_vjp`
whose two backward products take operands rounded as given after a `/` (`bf16/tf32`: bf16
forward, TF32 backward), differentiated for `dx, ddt, dA, dB, dC` under a random cotangent
of `y` and of the final state, each held to the rule against the float64 oracle's.

Run from the repository root: `OUT=<folder> python3 benchmarks/diagnostics/ssd_operand_precision.py`
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


def _inputs(length, heads, p, n, seed):
    """`(x, dt, A, B, C)` as the kernels see them (bf16 values for `x`, `B`, `C`; float32 `dt`,
    `A`), and the generator for what follows."""
    rng = np.random.default_rng(seed)
    x = bf16(rng.standard_normal((length, heads, p)))
    dt = f32(np.log1p(np.exp(rng.standard_normal((length, heads)) - 2)))  # softplus: about 0.1
    A = f32(-np.exp(rng.uniform(0, 1.5, heads)))
    B = bf16(rng.standard_normal((length, n)) * (2 / np.sqrt(n)))
    C = bf16(rng.standard_normal((length, n)) * (2 / np.sqrt(n)))
    return (x, dt, A, B, C), rng


def _bound(ref32, oracle):
    """The oracle rule's bound for bf16 inputs."""
    return 2 * np.abs(ref32 - oracle).max() + 2e-3 * np.abs(oracle).max()


def _row(what, case, q, form, kinds, **fields):
    return dict(
        what=what,
        case="L={} H={} P={} N={} seed {}".format(*case),
        chunk=q,
        form=form,
        operands=kinds,
        **fields,
    )


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


def _rounded(kind):
    """The operand rounding of `kind` in JAX (float64 in and out)."""
    from jax import lax

    def bf(a):
        return a.astype(jnp.float32).astype(jnp.bfloat16).astype(jnp.float64)

    def tf(a):
        f = lax.bitcast_convert_type(a.astype(jnp.float32), jnp.uint32)
        f = (f + jnp.uint32(0x0FFF) + ((f >> 13) & jnp.uint32(1))) & jnp.uint32(0xFFFFE000)
        return lax.bitcast_convert_type(f, jnp.float32).astype(jnp.float64)

    return {"bf16": bf, "tf32": tf}[kind]


def _product(kind, a, b):
    """`a @ b` in JAX as `kind` takes the operands; `bf16x2`: each operand as bf16 hi + lo, the
    three products that carry more than the low halves' product."""
    if kind == "bf16x2":
        bf = _rounded("bf16")
        ah, bh = bf(a), bf(b)
        al, bl = (
            bf(a.astype(jnp.float32).astype(jnp.float64) - ah),
            bf(b.astype(jnp.float32).astype(jnp.float64) - bh),
        )
        return ah @ bh + al @ bh + ah @ bl
    r = _rounded(kind)
    return r(a) @ r(b)


def _dot(kinds):
    """A product whose forward takes `kinds`' first rounding and whose two backward products
    the second (`"bf16/tf32"`; one name: both)."""
    fwd_kind, bwd_kind = kinds.split("/") if "/" in kinds else (kinds, kinds)

    @jax.custom_vjp
    def dot(a, b):
        return _product(fwd_kind, a, b)

    def forward(a, b):
        return _product(fwd_kind, a, b), (a, b)

    def backward(res, g):
        a, b = res
        return _product(bwd_kind, g, b.T), _product(bwd_kind, a.T, g)

    dot.defvjp(forward, backward)
    return dot


def _chunked_jax(x, dt, A, B, C, q, kinds):
    f32 = lambda a: a.astype(jnp.float32).astype(jnp.float64)  # noqa: E731
    dots = {name: _dot(k) for name, k in kinds.items()}
    length, heads, _ = x.shape
    a = dt * A[None]
    ys, state = [], jnp.zeros((heads, x.shape[2], B.shape[1]))
    for c0 in range(0, length, q):
        rows = slice(c0, c0 + q)
        cum = jnp.cumsum(a[rows], axis=0)
        xc, dtc, bc, cc = x[rows], dt[rows], B[rows], C[rows]
        cb = dots["C·Bᵀ"](cc, bc.T)
        below = jnp.tril(jnp.ones((xc.shape[0], xc.shape[0])))
        yh, sh = [], []
        for h in range(heads):
            m = f32(cb * jnp.exp(cum[:, None, h] - cum[None, :, h]) * below * dtc[None, :, h])
            y = dots["M·x"](m, xc[:, h]) + jnp.exp(cum[:, h])[:, None] * dots["C·S_inᵀ"](cc, state[h].T)
            w = jnp.exp(cum[-1, h] - cum[:, h]) * dtc[:, h]
            own = dots["(w∘x)ᵀ·B"](f32(w[:, None] * xc[:, h]).T, bc)
            yh.append(y)
            sh.append(jnp.exp(cum[-1, h]) * state[h] + own)
        ys.append(jnp.stack(yh, 1))
        state = jnp.stack(sh)
    return jnp.concatenate(ys, 0), state


GRAD_FORMS = {
    "tf32 everywhere": dict.fromkeys(PRODUCTS, "tf32"),
    "C·Bᵀ bf16/tf32": {**dict.fromkeys(PRODUCTS, "tf32"), "C·Bᵀ": "bf16/tf32"},
    "C·Bᵀ bf16 both ways": {**dict.fromkeys(PRODUCTS, "tf32"), "C·Bᵀ": "bf16"},
    "C·S_inᵀ bf16/tf32": {**dict.fromkeys(PRODUCTS, "tf32"), "C·S_inᵀ": "bf16/tf32"},
    "C·S_inᵀ bf16 both ways": {**dict.fromkeys(PRODUCTS, "tf32"), "C·S_inᵀ": "bf16"},
    "M·x bf16x2": {**dict.fromkeys(PRODUCTS, "tf32"), "M·x": "bf16x2"},
    "M·x bf16x2/bf16": {**dict.fromkeys(PRODUCTS, "tf32"), "M·x": "bf16x2/bf16"},
    "16-bit plan (C·Bᵀ, C·S_inᵀ bf16/bf16x2; M·x, state bf16x2)": {
        "C·Bᵀ": "bf16/bf16x2",
        "M·x": "bf16x2",
        "C·S_inᵀ": "bf16/bf16x2",
        "(w∘x)ᵀ·B": "bf16x2",
    },
    "bf16 everywhere": dict.fromkeys(PRODUCTS, "bf16"),
}
GRAD_CASES = [(512, 2, 64, 64, 1, 64), (1024, 2, 64, 128, 0, 128)]  # ..., seed, chunk


def gradients():
    rows = []
    for length, heads, p, n, seed, q in GRAD_CASES:
        inputs, rng = _inputs(length, heads, p, n, seed)
        cot_y, cot_s = rng.standard_normal((length, heads, p)), rng.standard_normal((heads, p, n))
        grads = {}
        for dtype in (jnp.float64, jnp.float32):

            def loss(x, dt, A, B, C, dtype=dtype, shape=(1, heads, p, n), cots=(cot_y, cot_s)):
                y, s = reference(
                    x[None], dt[None], A, B[None, :, None], C[None, :, None], None, None, None,
                    jnp.zeros(shape, dtype),
                )  # fmt: skip
                return jnp.sum(y[0] * cots[0].astype(dtype)) + jnp.sum(s[0] * cots[1].astype(dtype))

            g = jax.grad(loss, argnums=range(5))(*(jnp.asarray(v, dtype) for v in inputs))
            grads[dtype] = [np.asarray(v, np.float64) for v in g]
        oracle, ref32 = grads[jnp.float64], grads[jnp.float32]
        for form, kinds in GRAD_FORMS.items():

            def loss(x, dt, A, B, C, kinds=kinds, q=q, cots=(cot_y, cot_s)):
                y, s = _chunked_jax(x, dt, A, B, C, q, kinds)
                return jnp.sum(y * cots[0]) + jnp.sum(s * cots[1])

            got = jax.jit(jax.grad(loss, argnums=range(5)))(*(jnp.asarray(v) for v in inputs))
            ratios = {}
            for name, g, r, o in zip(("dx", "ddt", "dA", "dB", "dC"), got, ref32, oracle, strict=True):
                ratios[name] = float(np.abs(np.asarray(g) - o).max() / _bound(r, o))
            ok = all(v <= 1 for v in ratios.values())
            row = _row("gradients", (length, heads, p, n, seed), q, form, kinds, err_over_bound=ratios, ok=ok)
            rows.append(row)
            print(
                f"{row['case']} Q={q:3d} {form:60s} "
                + "  ".join(f"{k} {v:.2f}{'' if v <= 1 else '!'}" for k, v in ratios.items()),
                flush=True,
            )
    return rows


def main():
    rows = []
    for length, heads, p, n, seed in CASES:
        (x, dt, A, B, C), _ = _inputs(length, heads, p, n, seed)

        args = (x[None], dt[None], A, B[None, :, None], C[None, :, None])
        refs = []
        for dtype in (jnp.float64, jnp.float32):  # the oracle, then the reference in float32
            y, s = reference(
                *(jnp.asarray(v, dtype) for v in args), None, None, None, jnp.zeros((1, heads, p, n), dtype)
            )
            refs.append((np.asarray(y, np.float64)[0], np.asarray(s, np.float64)[0]))
        (y64, s64), (y32, s32) = refs
        bound_y, bound_s = _bound(y32, y64), _bound(s32, s64)
        for q in CHUNKS:
            for form, kinds in FORMS.items():
                y, s = chunked(x, dt, A, B, C, q, kinds)
                err_y, err_s = float(np.abs(y - y64).max()), float(np.abs(s - s64).max())
                row = _row(
                    "forward",
                    (length, heads, p, n, seed),
                    q,
                    form,
                    kinds,
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
    rows += gradients()
    out = os.path.join(os.environ.get("OUT", "."), "sweep_operand_precision.json")
    with open(out, "w") as f:
        json.dump(
            dict(
                command="OUT=<folder> python3 benchmarks/diagnostics/ssd_operand_precision.py",
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
