"""Shapes that `axkern bench moe_*` uses: memory bound; GB/s count the rows each pass must move.

Dispatch moves `T·K·D` elements out (and reads `x`); combine reads `T·K·D` and writes `T·D`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axkern.bench import Case

from .api import moe_combine_positional, moe_dispatch_positional, moe_layout_positional

PRESETS = {"quick": (512, 256, 8, 2), "deepseek": (32768, 4096, 64, 8)}  # tokens, hidden, experts, top-k


def _inputs(tokens, hidden, experts, topk, dt):
    def make(key):
        kx, ki, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (tokens, hidden), jnp.float32).astype(dt)
        idx = jax.random.randint(ki, (tokens, topk), 0, experts)
        w = jax.random.uniform(kw, (tokens, topk), jnp.float32).astype(dt)
        return x, idx, w

    return make


def _shape(preset, tokens, dtype):
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"moe: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    t, d, e, k = PRESETS[name]
    return tokens or t, d, e, k, jnp.dtype(dtype or ("float32" if name == "quick" else "bfloat16")), name


def cases_moe_dispatch(*, preset=None, tokens=None, dtype=None):
    t, d, e, k, dt, name = _shape(preset, tokens, dtype)

    def forward(impl, x, idx, w):
        return moe_dispatch_positional(x, idx, num_experts=e, implementation=impl)[0]

    def loss(impl, x, idx, w):
        return jnp.sum(forward(impl, x, idx, w).astype(jnp.float32) ** 2)

    n = float(t) * k * d * dt.itemsize
    return [
        Case(
            "moe_dispatch",
            f"{name}: T={t} D={d} E={e} K={k} {dt.name}",
            {"tokens": t, "embed": d},
            dt.name,
            _inputs(t, d, e, k, dt),
            forward,
            loss,
            (0,),
            0.0,
            0.0,
            bytes_forward=n + t * d * dt.itemsize,
            bytes_backward=n + t * d * dt.itemsize,
            bound="memory",
        )
    ]


def cases_moe_combine(*, preset=None, tokens=None, dtype=None):
    t, d, e, k, dt, name = _shape(preset, tokens, dtype)

    def forward(impl, x, idx, w):
        expert_x, _, routing = moe_dispatch_positional(x, idx, num_experts=e, implementation="xla")
        return moe_combine_positional(expert_x, w, routing, implementation=impl)

    def loss(impl, x, idx, w):
        return jnp.sum(forward(impl, x, idx, w).astype(jnp.float32) ** 2)

    n = float(t) * k * d * dt.itemsize
    return [
        Case(
            "moe_combine",
            f"{name}: dispatch(xla)+combine T={t} D={d} E={e} K={k} {dt.name}",
            {"tokens": t, "embed": d},
            dt.name,
            _inputs(t, d, e, k, dt),
            forward,
            loss,
            (0, 2),
            0.0,
            0.0,
            bytes_forward=2 * n + 2 * t * d * dt.itemsize,
            bytes_backward=2 * n + 2 * t * d * dt.itemsize,
            bound="memory",
        )
    ]


def cases_moe_layout(*, preset=None, tokens=None, dtype=None):
    t, d, e, k, dt, name = _shape(preset, tokens, dtype)

    def forward(impl, x, idx, w):
        return moe_layout_positional(idx, num_experts=e, num_ranks=1, implementation=impl)

    return [
        Case(
            "moe_layout",
            f"{name}: T={t} E={e} K={k}",
            {"tokens": t},
            "int32",
            _inputs(t, d, e, k, dt),
            forward,
            None,
            (),
            0.0,
            0.0,
            bytes_forward=t * k * 4.0,
            bound="memory",
            passes=("fwd",),
        )
    ]
