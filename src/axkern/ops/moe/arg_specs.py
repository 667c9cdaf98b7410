"""Shapes that `axkern bench moe_*` uses: memory bound; GB/s count the rows each pass must move.

Dispatch reads `x` (`T·D`) and writes `T·K·D` elements; its backward reads `T·K·D` and writes
`T·D`. Combine reads `T·K·D` and writes `T·D`; its backward reads `dy` and `expert_y` and
writes `T·K·D`. The fwd+bwd rows return the output and pull a fixed random cotangent back
(no loss whose cotangent XLA could fuse away), so they move exactly these bytes.

Layout is less work than JAX's dispatch of one call, so its forward runs the op 20 times
inside one jitted loop (ids shifted each time) and reports the time per call.

Presets: `e64` is 32768 tokens, hidden 4096, 64 experts, top-8; `dsv3` is
DeepSeek-V3-like (8192 tokens, hidden 7168, 256 experts, top-8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axkern.core.cases import Case

from .api import moe_combine_positional, moe_dispatch_positional, moe_layout_positional

PRESETS = {  # tokens, hidden, experts, top-k
    "quick": (512, 256, 8, 2),
    "e64": (32768, 4096, 64, 8),
    "dsv3": (8192, 7168, 256, 8),
}


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

    n = float(t) * k * d * dt.itemsize
    return [
        Case(
            "moe_dispatch",
            f"{name}: T={t} D={d} E={e} K={k} {dt.name}",
            {"tokens": t, "embed": d},
            dt.name,
            _inputs(t, d, e, k, dt),
            forward,
            None,
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

    def make(key):
        x, idx, w = _inputs(t, d, e, k, dt)(key)
        expert_x, _, routing = moe_dispatch_positional(x, idx, num_experts=e, implementation="xla")
        return jnp.sin(expert_x), w, routing

    def forward(impl, expert_y, w, routing):
        return moe_combine_positional(expert_y, w, routing, implementation=impl)

    n = float(t) * k * d * dt.itemsize
    return [
        Case(
            "moe_combine",
            f"{name}: T={t} D={d} E={e} K={k} {dt.name}",
            {"tokens": t, "embed": d},
            dt.name,
            make,
            forward,
            None,
            (0, 1),
            0.0,
            0.0,
            bytes_forward=n + t * d * dt.itemsize,
            bytes_backward=2 * n + t * d * dt.itemsize,
            bound="memory",
        )
    ]


def cases_moe_layout(*, preset=None, tokens=None, dtype=None):
    t, d, e, k, dt, name = _shape(preset, tokens, dtype)

    calls = 20

    def forward(impl, x, idx, w):
        def body(i, acc):
            out = moe_layout_positional((idx + i) % e, num_experts=e, num_ranks=1, implementation=impl)
            return (
                acc[0] + out.tokens_per_expert,
                acc[1] + out.tokens_per_rank,
                acc[2] | out.is_token_in_rank,
                acc[3] + out.dropped,
            )

        init = (jnp.zeros((e,), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((t, 1), bool), jnp.int32(0))
        return jax.lax.fori_loop(0, calls, body, init)

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
            calls=calls,
        )
    ]
