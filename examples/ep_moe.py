"""An expert-parallel MoE layer: tokens and experts split over the devices of one mesh axis.

Each device routes its own tokens to the devices holding their experts
(`axkern.positional.moe_ep_dispatch`), runs its local experts with `jax.lax.ragged_dot`, and
brings the outputs back (`moe_ep_combine`). Run on a CPU it makes 8 host devices; on a GPU
machine it uses every visible GPU. It checks the layer and its gradients against the same
layer computed densely on one device, and prints the largest differences.

    python examples/ep_moe.py [--tokens 64] [--capacity-factor 1.25]
"""

from __future__ import annotations

import argparse
import os

if "XLA_FLAGS" not in os.environ and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

import axkern  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="tokens per device")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=None, help="default: exact (no token dropped)")
    a = p.parse_args(argv)
    devices = jax.devices()
    ranks = len(devices)
    mesh = Mesh(np.array(devices), ("ep",))
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    tokens = ranks * a.tokens
    x = jax.random.normal(k[0], (tokens, a.hidden))
    logits = jax.random.normal(k[1], (tokens, a.experts))
    weights, topk_idx = jax.lax.top_k(jax.nn.softmax(logits), a.topk)
    w_in = jax.random.normal(k[2], (a.experts, a.hidden, a.hidden)) / a.hidden**0.5

    def local(x, topk_idx, weights, w_in):
        expert_x, group_sizes, layout = axkern.positional.moe_ep_dispatch(
            x, topk_idx, num_experts=a.experts, axis_name="ep", capacity_factor=a.capacity_factor
        )
        h = jax.nn.gelu(jax.lax.ragged_dot(expert_x, w_in, group_sizes))
        return axkern.positional.moe_ep_combine(h, weights, layout), layout.dropped[None]

    spec = PartitionSpec("ep")
    layer = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec))

    def dense(x, topk_idx, weights, w_in):
        h = jax.nn.gelu(jnp.einsum("td,tkde->tke", x, w_in[topk_idx]))
        return jnp.einsum("tk,tke->te", weights, h)

    y, dropped = jax.jit(layer)(x, topk_idx, weights, w_in)
    grads = jax.jit(jax.grad(lambda *z: jnp.sum(layer(*z)[0] ** 2), argnums=(0, 2, 3)))(
        x, topk_idx, weights, w_in
    )
    want = dense(x, topk_idx, weights, w_in)
    want_grads = jax.grad(lambda *z: jnp.sum(dense(*z) ** 2), argnums=(0, 2, 3))(x, topk_idx, weights, w_in)
    print(
        f"{ranks} devices ({devices[0].platform}), {a.tokens} tokens each, {a.experts} experts, top-{a.topk}"
    )
    print(f"dropped pairs: {int(dropped.sum())}")
    print(f"max |y - dense|: {float(jnp.max(jnp.abs(y - want))):.2e}")
    for name, g, r in zip(("dx", "dweights", "dw_in"), grads, want_grads, strict=True):
        print(f"max |{name} - dense|: {float(jnp.max(jnp.abs(g - r))):.2e}")


if __name__ == "__main__":
    main()
