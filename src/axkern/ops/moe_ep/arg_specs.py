"""Shapes that `axkern bench moe_ep_*` uses: every visible device is one expert-parallel rank.

Per device: `T` tokens, hidden `D`, top-`K`, `E` experts in all (`E / R` per device), capacity
factor 1.25. The combine's cases time the dispatch before it too, by the same implementation.
Each `all_to_all` moves the `R·C·D` elements of one send buffer per device; GB/s count those
bytes (the copy ceiling of one device is the reference, not a link's).
Presets: `e64` is 32768 tokens per device, hidden 4096, 64 experts, top-8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from axkern.core import compat
from axkern.core.cases import Case

from .api import capacity_for, moe_ep_combine_positional, moe_ep_dispatch_positional

PRESETS = {"quick": (64, 32, 8, 2), "e64": (32768, 4096, 64, 8)}  # per-device tokens, hidden, experts, top-k
FACTOR = 1.25


def _setup(preset, tokens, dtype):
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"moe_ep: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    t, d, e, k = PRESETS[name]
    t = tokens or t
    devices = jax.devices()
    ranks = len(devices)
    while e % ranks:  # the experts must split evenly over the ranks
        e += 1
    mesh = Mesh(np.array(devices), ("ep",))
    dt = jnp.dtype(dtype or ("float32" if name == "quick" else "bfloat16"))

    def make(key):
        kx, ki, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (ranks * t, d), jnp.float32).astype(dt)
        idx = jax.random.randint(ki, (ranks * t, k), 0, e)
        w = jax.random.uniform(kw, (ranks * t, k), jnp.float32).astype(dt)
        return x, idx, w

    cap = capacity_for(t, k, ranks, FACTOR)
    return name, t, d, e, k, ranks, mesh, dt, make, cap


def _sharded(mesh, fn, n_in, out_specs):
    spec = PartitionSpec("ep")
    return compat.shard_map(fn, mesh=mesh, in_specs=(spec,) * n_in, out_specs=out_specs)


def _case(op, setup, forward, grad_argnums, exchanges, note=""):
    name, t, d, e, k, ranks, mesh, dt, make, cap = setup
    n = exchanges * float(ranks) * ranks * cap * d * dt.itemsize  # every device's send buffers
    return [
        Case(
            op,
            f"{name}: R={ranks} T={t}/device D={d} E={e} K={k} C={cap} {dt.name}{note}",
            {"tokens": t, "embed": d, "experts": e, "topk": k, "ranks": ranks},
            dt.name,
            make,
            forward,
            None,
            grad_argnums,
            0.0,
            0.0,
            bytes_forward=n,
            bytes_backward=n,
            bound="memory",
        )
    ]


def cases_moe_ep_dispatch(*, preset=None, tokens=None, dtype=None):
    setup = _setup(preset, tokens, dtype)
    e, mesh = setup[3], setup[6]

    def forward(impl, x, idx, w):
        def local(x, idx):
            return moe_ep_dispatch_positional(
                x, idx, num_experts=e, axis_name="ep", capacity_factor=FACTOR, implementation=impl
            ).expert_x

        return _sharded(mesh, local, 2, PartitionSpec("ep"))(x, idx)

    return _case("moe_ep_dispatch", setup, forward, (0,), 1)


def cases_moe_ep_combine(*, preset=None, tokens=None, dtype=None):
    setup = _setup(preset, tokens, dtype)
    e, mesh = setup[3], setup[6]

    def forward(impl, x, idx, w):
        def local(x, idx, w):
            expert_x, _, layout = moe_ep_dispatch_positional(
                x, idx, num_experts=e, axis_name="ep", capacity_factor=FACTOR, implementation=impl
            )
            return moe_ep_combine_positional(expert_x, w, layout, implementation=impl)

        return _sharded(mesh, local, 3, PartitionSpec("ep"))(x, idx, w)

    return _case(
        "moe_ep_combine", setup, forward, (0, 2), 2, " (its dispatch included, by the same implementation)"
    )
