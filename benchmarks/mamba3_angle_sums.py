"""How Mamba-3's angle sums inside each chunk are best formed on the GPU (a diagnostic): the
sum `Σ_{s <= t} inc_s` of `angles.within_chunks` for a call without segments in several forms,
each timed in the whole layer (`mosaic_gpu`, forward and forward+backward at the 2.7B layer, as
`axkern bench` runs it) and alone (the angles' sums and their gradient), with its largest error
against a float64 sum.

    OUT=<folder> python3 benchmarks/mamba3_angle_sums.py [FORM ...]

writes `$OUT/mamba3_angle_sums.json`. Forms: `product` (the code's: the `[Q, Q]` masked
product, exact float32 products), `cumsum` (`jnp.cumsum` along the chunk), `blocked` (sums of 8
positions as `[8, 8]` products, then the sums before each 8 as another: 16 products a position
where `product` takes 64).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from records import header, write  # (this folder's: run as a script)

from axkern import bench
from axkern.ops.mamba3.common import angles

_plain = angles.within_chunks


def _ein(spec, *a):
    return jnp.einsum(spec, *a, precision=lax.Precision.HIGHEST)


def _blocked(ic, sc):
    b, c, q, h, a = ic.shape
    x = ic.reshape(b, c, q // 8, 8, h, a)
    inner = _ein("ts,bcksha->bcktha", jnp.tril(jnp.ones((8, 8), ic.dtype)), x)
    before = _ein("jk,bckha->bcjha", jnp.tril(jnp.ones((q // 8, q // 8), ic.dtype), -1), inner[:, :, :, -1])
    return (inner + before[:, :, :, None]).reshape(ic.shape)


FORMS = {
    "product": _plain,
    "cumsum": lambda ic, sc: jnp.cumsum(ic, axis=2),
    "blocked": _blocked,
}


def main() -> None:
    forms = sys.argv[1:] or list(FORMS)
    case = next(c for c in bench.cases_for("mamba3", preset="mamba3_2.7b") if "SISO" in c.label)
    args = case.make(jax.random.PRNGKey(0))
    cot = bench._cotangent(case, args)
    b, length, h, a, q = 4, 4096, 80, 32, 64
    inc = jax.random.uniform(jax.random.PRNGKey(1), (b, length, h, a), jnp.float32, -0.2, 0.2)
    seg = jnp.zeros((b, length), jnp.int32)
    want = np.cumsum(np.asarray(inc, np.float64).reshape(b, -1, q, h, a), axis=2)
    out = header("mamba3_angle_sums.py", case=case.label, forms={})
    for form in forms:
        angles.within_chunks = FORMS[form]

        def sums(x, form=FORMS[form]):
            return form(x.reshape(b, -1, q, h, a), seg.reshape(b, -1, q))

        alone, alone_bwd = jax.jit(sums), jax.jit(jax.grad(lambda x, sums=sums: jnp.sum(jnp.sin(sums(x)))))
        err = float(np.max(np.abs(np.asarray(alone(inc), np.float64) - want)))
        row = {"max_abs_error": err}
        for name, fn, fn_args in (
            ("layer_fwd", jax.jit(case.forward_for("mosaic_gpu")), args),
            ("layer_fwd_bwd", jax.jit(bench._forward_backward(case, "mosaic_gpu")), (cot, *args)),
            ("sums_fwd", alone, (inc,)),
            ("sums_fwd_bwd", alone_bwd, (inc,)),
        ):
            spread = bench.time_spread(fn, fn_args, repeats=7)
            row[name] = {"ms": spread[1], "ms_min": spread[0], "ms_max": spread[2]}
        out["forms"][form] = row
        print(form, json.dumps(row), flush=True)
    angles.within_chunks = _plain
    write(out, "mamba3_angle_sums.json")


if __name__ == "__main__":
    main()
