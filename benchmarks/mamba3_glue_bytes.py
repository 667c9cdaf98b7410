"""XLA's work around Mamba-3's chunk scan, measured on the CPU (a proxy, not GPU timings): the
layer's `common.forward` with a stand-in for the kernel core (the same interface and layouts as
`kernel_core`: heads-first `B`, `C`, SISO's diagonal term taken, `x` in bf16; cheap elementwise
arithmetic and a `custom_vjp` in place of the kernels), jitted forward and forward+backward
(random cotangent of `y`) on bf16 inputs, and XLA's compiled `cost_analysis()` bytes accessed
and `memory_analysis()` temporaries. The stand-in's own traffic is in both forms alike, so
differences between two source trees are the layer's.

    PYTHONPATH=<tree>/src python benchmarks/mamba3_glue_bytes.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from axkern.ops.mamba3 import common

B, L, H, P, N, G, A, Q = 1, 2048, 16, 64, 128, 1, 32, 64


@jax.custom_vjp
def _kernels(x, a, s, Bm, Cm, seg, g0, diag):
    y = x.astype(jnp.float32) * (s + a + diag)[..., None]
    y = y + jnp.swapaxes(Bm.sum(-1) + Cm.sum(-1), 1, 2)[..., None]
    return y[:, :, None], g0 * 2


def _kernels_fwd(*args):
    return _kernels(*args), args


def _kernels_bwd(res, ct):
    x, a, s, Bm, Cm, seg, g0, diag = res
    dy, dfinal = ct
    t = dy.sum(-1)[:, :, 0]
    return dy[:, :, 0].astype(x.dtype), t, t, Bm * 2 + dfinal.sum(2)[:, :, None], Cm * 3, None, dfinal + g0, t


_kernels.defvjp(_kernels_fwd, _kernels_bwd)


def core(x, a, s, Bm, Cm, seg, g0, diag=None):
    b, l, _, h, p = x.shape
    return _kernels(
        x.reshape(b, l, h, p).astype(jnp.bfloat16), a, s, Bm[:, :, :, 0], Cm[:, :, :, 0], seg, g0, diag
    )


core.heads_major, core.diagonal, core.x_dtype = True, True, jnp.bfloat16


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    k = jax.random.split(jax.random.PRNGKey(0), 8)
    bf = jnp.bfloat16
    inputs = (
        jax.random.normal(k[0], (B, L, G, N), bf)[:, :, None],
        jax.random.normal(k[1], (B, L, G, N), bf)[:, :, None],
        jax.random.normal(k[2], (B, L, H, P), bf),
        -jax.random.uniform(k[3], (B, H, L), bf),
        jax.random.uniform(k[4], (B, H, L), bf),
        jax.random.normal(k[5], (B, H, L), bf),
        jnp.ones((H, 1, N)),
        jnp.ones((H, 1, N)),
        jax.random.normal(k[6], (B, L, H, A), bf),
    )
    state = (jnp.zeros((B, H, A)), jnp.zeros((B, H, P, N)), jnp.zeros((B, 1, H, N)), jnp.zeros((B, H, P)))

    def forward(*a):
        return common.forward(core, *a, None, None, None, *state, None, None, None, chunk_size=Q)[0]

    def forward_backward(ct, *a):
        y, pull = jax.vjp(forward, *a)
        return y, pull(ct)

    ct = jax.random.normal(k[7], (B, L, H, P), bf)
    out = {"shape": dict(batch=B, length=L, heads=H, head_dim=P, state=N, groups=G, angles=A, chunk=Q)}
    for name, fn, a in (("fwd", forward, inputs), ("fwd+bwd", forward_backward, (ct, *inputs))):
        compiled = jax.jit(fn).lower(*a).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out[name] = {
            "bytes_accessed_mib": cost.get("bytes accessed", 0.0) / 2**20,
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        }
        print(
            f"{name}: {out[name]['bytes_accessed_mib']:.1f} MiB accessed, {out[name]['temp_mib']:.1f} MiB temporaries"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
