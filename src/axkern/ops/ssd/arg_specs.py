"""Shapes that `axkern bench ssd` uses: the Mamba-2 2.7B layer and a quick CPU one."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axkern.bench import Case

from .api import ssd_positional

# batch, length, heads, head_dim, state, groups, chunk
PRESETS = {"quick": (2, 256, 4, 16, 16, 1, 64), "mamba2_2.7b": (4, 4096, 80, 64, 128, 1, 256)}


def cases(*, preset=None, tokens=None, dtype=None):
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"ssd: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    b, l, h, p, n, g, q = PRESETS[name]
    l = tokens or l  # noqa: E741
    dt_ = jnp.dtype(dtype or ("float32" if name == "quick" else "bfloat16"))

    def make(key):
        k = jax.random.split(key, 6)
        x = jax.random.normal(k[0], (b, l, h, p)).astype(dt_)
        dt = jax.random.normal(k[1], (b, l, h)).astype(dt_)
        A = -jnp.exp(jax.random.normal(k[2], (h,)))
        B = jax.random.normal(k[3], (b, l, g, n)).astype(dt_)
        C = jax.random.normal(k[4], (b, l, g, n)).astype(dt_)
        return x, dt, A, B, C

    def forward(impl, x, dt, A, B, C):
        kw = {"chunk_size": q} if impl == "xla" else {}  # pallas_gpu picks its own chunk
        return ssd_positional(x, dt, A, B, C, dt_softplus=True, implementation=impl, **kw)

    def loss(impl, *a):
        return jnp.sum(forward(impl, *a).astype(jnp.float32))

    flops = 2.0 * b * l * q * h * (n + p)  # intra-chunk products, roughly
    return [
        Case(
            "ssd",
            f"{name}: B={b} L={l} H={h} P={p} N={n} G={g} Q={q} {dt_.name}",
            {"batch": b, "length": l},
            dt_.name,
            make,
            forward,
            loss,
            (0, 1, 3, 4),
            flops,
            2 * flops,
        )
    ]
