"""How XLA forms Mamba-3's rotation around the Mosaic GPU kernels in a differentiated call
(a diagnostic): the forward's halves of the rotated `q`, `k` (`RotatedOperand.parts`) and the
rotation's backward (`RotatedOperand.cotangent`) in several forms, each timed forward+backward
at the 2.7B layer as `axkern bench` runs it, with its temporaries and the optimized program's
large fusions (bytes in and out), so that a form's cost points at what XLA materialises.

    OUT=<folder> python3 benchmarks/mamba3_rotation_forms.py [--parts-tiles ROWS,WARPS] [FORM ...]

writes `$OUT/mamba3_rotation_forms.json`. Forms: `now` (the code's: the halves formed by one
Triton kernel, `rotation.rotated_parts`, the backward kernels given the angles and turning `dB`,
`dC` back themselves), `xla_parts` (the halves formed in XLA from `cos`, `sin` of the angles
padded to `N/2` columns, `value()` then `operand_parts`; the backward as `now`), `xla_turn` (the
halves as `xla_parts`, the turn back in XLA from the forward's `cos`, `sin`; every form below
turns in XLA too), `negated`
(the backward turns by `cos`, `sin` of `-Θ`, another expression), `shared` (`cos`, `sin` of the
`A` angles, widened after; one expression everywhere), `own` (each operand's forward and backward
compute them from their own inputs, behind an optimization barrier, so that XLA neither merges
nor shares them), `own_parts` (`own`'s forward, `shared`'s backward). `--parts-tiles`: the
`rotated_parts` programs' positions and warps (`rotation.PARTS_ROWS`, `PARTS_WARPS`).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
from jax import lax
from kernel_times import fusion_bytes, fusion_sources  # (this folder's: run as a script)
from records import header, write

from axkern import bench
from axkern.ops.chunked.mosaic_gpu import rotation
from axkern.ops.chunked.mosaic_gpu.kernels import operand_parts

R = rotation.RotatedOperand


def _trig(theta, n2, sign=1):
    """`cos`, `sin` of `sign · Θ` on the `A` angles, widened to `N/2` columns (1 and 0)."""
    a = theta if sign == 1 else -theta
    widen = [(0, 0)] * (theta.ndim - 1) + [(0, n2 - theta.shape[-1])]
    return jnp.pad(jnp.cos(a), widen, constant_values=1), jnp.pad(jnp.sin(a), widen)


def _cotangent(self, g, u, bias, theta, cos, sin):
    # (these forms' halves carry no angles: the kernels leave `g` unturned)
    b, groups, length, n = u.shape
    h, a = bias.shape[0], theta.shape[-1]
    back = rotation.rotate_halves(g.astype(jnp.float32), cos, sin)
    du = back.reshape(b, groups, h // groups, length, n).sum(2)
    w = rotation._biased(u, bias).reshape(b, h, length, 2, n // 2)
    bv = back.reshape(b, h, length, 2, n // 2)
    d_theta = (bv[..., 1, :] * w[..., 0, :] - bv[..., 0, :] * w[..., 1, :])[..., :a]
    return R(du.astype(u.dtype), back.sum((0, 2)).astype(bias.dtype), d_theta.astype(theta.dtype))


def _parts(u, bias, theta):
    cos, sin = _trig(theta, u.shape[-1] // 2)
    return rotation.SplitOperand(*operand_parts(rotation.rotate_halves(rotation._biased(u, bias), cos, sin)))


def shared_parts(self, angles=False, **_):
    return _parts(self.u, self.bias, self.theta)


def shared_cotangent(self, g, turned=False):
    cos, sin = _trig(self.theta, self.u.shape[-1] // 2)
    return _cotangent(self, g, self.u, self.bias, self.theta, cos, -sin)


def negated_cotangent(self, g, turned=False):
    n2 = self.u.shape[-1] // 2
    pad = [(0, 0)] * (self.theta.ndim - 1) + [(0, n2 - self.theta.shape[-1])]
    a = -jnp.pad(self.theta, pad)
    return _cotangent(self, g, self.u, self.bias, self.theta, jnp.cos(a), jnp.sin(a))


def own_parts(self, angles=False, **_):
    return _parts(*lax.optimization_barrier((self.u, self.bias, self.theta)))


def own_cotangent(self, g, turned=False):
    g, u, bias, theta = lax.optimization_barrier((g, self.u, self.bias, self.theta))
    return _cotangent(self, g, u, bias, theta, *_trig(theta, u.shape[-1] // 2, -1))


def xla_turn_parts(self, angles=False, **_):
    return _NOW_PARTS(self)  # no angles: the backward kernels leave the turn to XLA


def xla_parts(self, angles=False, **_):
    return _NOW_PARTS(self, angles)  # XLA's halves (no kernel)


def separately(self, other, angles=False, **kw):
    # each operand's halves by its own `parts` (the form's): no kernel for the pair
    return self.parts(angles, **kw), other.parts(angles, **kw)


_NOW_PARTS, _NOW_PARTS_WITH = R.parts, R.parts_with

FORMS = {
    "now": (R.parts, R.cotangent),
    "xla_parts": (xla_parts, R.cotangent),
    "xla_turn": (xla_turn_parts, R.cotangent),
    "negated": (xla_turn_parts, negated_cotangent),
    "shared": (shared_parts, shared_cotangent),
    "own": (own_parts, own_cotangent),
    "own_parts": (own_parts, shared_cotangent),
}


def large_fusions(hlo: str, floor: float = 250e6) -> list[str]:
    """The entry computation's kernels that read and write more than `floor` bytes (at most:
    `kernel_times.fusion_bytes`), with the JAX operation each came from."""
    sources = fusion_sources(hlo)
    return [
        f"{name}: in {read / 1e6:.0f} MB, out {written / 1e6:.0f} MB, {sources.get(name, '')[-60:]}"
        for name, (read, written) in fusion_bytes(hlo).items()
        if read + written > floor
    ]


def main() -> None:
    forms = sys.argv[1:]
    if forms[:1] == ["--parts-tiles"]:
        rotation.PARTS_ROWS, rotation.PARTS_WARPS = (int(t) for t in forms[1].split(","))
        forms = forms[2:]
    forms = forms or list(FORMS)
    case = next(c for c in bench.cases_for("mamba3", preset="mamba3_2.7b") if "SISO" in c.label)
    args = case.make(jax.random.PRNGKey(0))
    cot = bench._cotangent(case, args)
    out = header("mamba3_rotation_forms.py", case=case.label, forms={})
    for form in forms:
        R.parts, R.cotangent = FORMS[form]
        R.parts_with = _NOW_PARTS_WITH if form == "now" else separately
        fn = jax.jit(bench._forward_backward(case, "mosaic_gpu"))
        compiled = fn.lower(cot, *args).compile()
        spread = bench.time_spread(fn, (cot, *args), repeats=7)
        row = {
            "ms": spread[1],
            "ms_min": spread[0],
            "ms_max": spread[2],
            "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30,
            "large_fusions": large_fusions(compiled.as_text()),
        }
        out["forms"][form] = row
        print(form, json.dumps({k: v for k, v in row.items() if k != "large_fusions"}), flush=True)
        for line in row["large_fusions"]:
            print("   ", line, flush=True)
    write(out, "mamba3_rotation_forms.json")


if __name__ == "__main__":
    main()
