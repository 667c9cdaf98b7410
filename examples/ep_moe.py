"""An expert-parallel MoE layer: tokens and experts split over the devices of one mesh axis.

Each device routes its own tokens to the devices holding their experts (`moe_ep_dispatch`),
runs its local experts (`ragged_dot` → gelu → `ragged_dot`), and brings the outputs back
(`moe_ep_combine`). The layer is written twice: positional, inside `shard_map` over the mesh
axis `ep`; and named, over haliax axes with the experts axis mapped to `ep`. Run on a CPU it
makes 8 host devices; on a GPU machine it uses every visible GPU. It checks both forms and
their gradients against the same layer computed densely on one device, and prints the
largest differences.

    python examples/ep_moe.py [--tokens 64] [--capacity-factor 1.25] [--impl xla]

`axkern bench --cases examples/ep_moe.py [--preset e64] [--impl xla,xla_ragged]` times one
forward and backward step of the layer per transport implementation.
"""

from __future__ import annotations

import argparse
import os

if "XLA_FLAGS" not in os.environ and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    # 8 host devices where the CPU is the platform; a GPU, when JAX finds one, is unaffected
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

import axkern  # noqa: E402

SPEC = PartitionSpec("ep")


def ep_layer(mesh, num_experts, capacity_factor=None, implementation=None):
    """`(x, topk_idx, topk_weights, w_in, w_out) -> (y, dropped)`, every array split over `ep`."""

    def local(x, topk_idx, topk_weights, w_in, w_out):
        expert_x, group_sizes, layout = axkern.positional.moe_ep_dispatch(
            x,
            topk_idx,
            num_experts=num_experts,
            axis_name="ep",
            capacity_factor=capacity_factor,
            implementation=implementation,
        )
        h = jax.nn.gelu(jax.lax.ragged_dot(expert_x, w_in, group_sizes))
        expert_y = jax.lax.ragged_dot(h, w_out, group_sizes)
        y = axkern.positional.moe_ep_combine(expert_y, topk_weights, layout, implementation=implementation)
        return y, layout.dropped[None]

    return jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 5, out_specs=(SPEC, SPEC))


def named_ep_layer(mesh, capacity_factor=None, implementation=None):
    """The same layer over named axes; call it under `hax.axis_mapping({token: "ep", "experts": "ep"})`."""

    def layer(x, topk_idx, topk_weights, w_in, w_out):
        expert_x, group_sizes, layout = axkern.moe_ep_dispatch(
            x,
            topk_idx,
            num_experts=w_in.axes[0].size,
            capacity_factor=capacity_factor,
            implementation=implementation,
        )
        rows, counts, experts = layout.expert_specs()

        def local_experts(rows, counts, w_in, w_out):
            h = jax.nn.gelu(jax.lax.ragged_dot(rows, w_in, counts[0]))
            return jax.lax.ragged_dot(h, w_out, counts[0])

        expert_y = jax.shard_map(
            local_experts, mesh=mesh, in_specs=(rows, counts, experts, experts), out_specs=rows
        )(expert_x.array, group_sizes.array, w_in.array, w_out.array)
        expert_y = hax.named(expert_y, (expert_x.axes[0], w_out.axes[-1]))
        return axkern.moe_ep_combine(
            expert_y, topk_weights, layout, implementation=implementation
        ), layout.dropped

    return layer


def dense(x, topk_idx, topk_weights, w_in, w_out):
    """The layer on one device, every pair computed."""
    h = jax.nn.gelu(jnp.einsum("td,tkdf->tkf", x, w_in[topk_idx]))
    return jnp.einsum("tk,tkf,tkfd->td", topk_weights, h, w_out[topk_idx])


def inputs(key, tokens, hidden, ffn, experts, topk, dtype=jnp.float32):
    k = jax.random.split(key, 4)
    x = jax.random.normal(k[0], (tokens, hidden), jnp.float32).astype(dtype)
    weights, topk_idx = jax.lax.top_k(jax.nn.softmax(jax.random.normal(k[1], (tokens, experts))), topk)
    w_in = (jax.random.normal(k[2], (experts, hidden, ffn)) / hidden**0.5).astype(dtype)
    w_out = (jax.random.normal(k[3], (experts, ffn, hidden)) / ffn**0.5).astype(dtype)
    return x, topk_idx, weights.astype(dtype), w_in, w_out


def _loss(layer):
    return lambda *a: jnp.sum(layer(*a)[0].astype(jnp.float32) ** 2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="tokens per device")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=48)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=None, help="default: exact (no token dropped)")
    p.add_argument("--impl", default=None, help="transport implementation (default: the dispatcher's choice)")
    a = p.parse_args(argv)
    devices = jax.devices()
    ranks = len(devices)
    mesh = Mesh(np.array(devices), ("ep",))
    args = inputs(jax.random.PRNGKey(0), ranks * a.tokens, a.hidden, a.ffn, a.experts, a.topk)
    grad_args = (0, 2, 3, 4)
    names = ("dx", "dweights", "dw_in", "dw_out")
    want = dense(*args)
    want_grads = jax.grad(_loss(lambda *z: (dense(*z),)), argnums=grad_args)(*args)

    layer = ep_layer(mesh, a.experts, a.capacity_factor, a.impl)
    y, dropped = jax.jit(layer)(*args)
    grads = jax.jit(jax.grad(_loss(layer), argnums=grad_args))(*args)
    print(
        f"{ranks} devices ({devices[0].platform}), {a.tokens} tokens each, {a.experts} experts, top-{a.topk}"
    )
    print(f"dropped pairs: {int(dropped.sum())}")
    print(f"max |y - dense|: {float(jnp.max(jnp.abs(y - want))):.2e}")
    for name, g, r in zip(names, grads, want_grads, strict=True):
        print(f"max |{name} - dense|: {float(jnp.max(jnp.abs(g - r))):.2e}")

    # the named form: token axes ("token") and the experts axis both mapped to the mesh axis "ep"
    Token, TopK = hax.Axis("token", ranks * a.tokens), hax.Axis("topk", a.topk)
    Embed, Ffn, Experts = hax.Axis("embed", a.hidden), hax.Axis("ffn", a.ffn), hax.Axis("experts", a.experts)
    axes = ((Token, Embed), (Token, TopK), (Token, TopK), (Experts, Embed, Ffn), (Experts, Ffn, Embed))
    named_args = [hax.named(v, ax) for v, ax in zip(args, axes, strict=True)]
    with jax.set_mesh(mesh), hax.axis_mapping({"token": "ep", "experts": "ep"}):
        named = named_ep_layer(mesh, a.capacity_factor, a.impl)
        y_named, dropped_named = jax.jit(named)(*named_args)

        def named_loss(*z):
            return _loss(lambda *n: (named(*n)[0].array,))(*z)

        named_grads = jax.jit(jax.grad(named_loss, argnums=grad_args))(*named_args)
    print(f"named: dropped pairs: {int(dropped_named)}")
    print(f"max |named y - dense|: {float(jnp.max(jnp.abs(y_named.array - want))):.2e}")
    for name, g, r in zip(names, named_grads, want_grads, strict=True):
        print(f"max |named {name} - dense|: {float(jnp.max(jnp.abs(g.array - r))):.2e}")


PRESETS = {  # per-device tokens, hidden, ffn, experts, top-k
    "quick": (64, 32, 48, 16, 2),
    "e64": (32768, 4096, 2048, 64, 8),
}


def cases(*, preset=None, tokens=None, dtype=None):
    """`axkern bench --cases examples/ep_moe.py`: one step of the EP MoE layer (forward, and
    backward to the inputs and both expert weights), every visible device one rank, capacity
    factor 1.25. Implementation `default` lets the dispatcher choose the transport; any other
    name (`xla`, `xla_ragged`, `reference`) is passed to dispatch and combine."""
    from axkern.bench import Case

    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"ep_moe: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    t, d, f, e, k = PRESETS[name]
    t = tokens or t
    devices = jax.devices()
    ranks = len(devices)
    e += -e % ranks  # the experts split evenly over the ranks
    mesh = Mesh(np.array(devices), ("ep",))
    dt = jnp.dtype(dtype or ("float32" if name == "quick" else "bfloat16"))
    flops = 4.0 * ranks * t * k * d * f  # the two expert matmuls of every routed pair

    def forward(impl, *args):
        return ep_layer(mesh, e, 1.25, None if impl == "default" else impl)(*args)[0]

    def loss(impl, *args):
        return _loss(ep_layer(mesh, e, 1.25, None if impl == "default" else impl))(*args)

    return [
        Case(
            op="ep_moe",
            label=f"{name}: layer step R={ranks} T={t}/device D={d} F={f} E={e} K={k} {dt.name}",
            dims={"tokens": t, "embed": d, "ffn": f, "experts": e, "topk": k, "ranks": ranks},
            dtype=dt.name,
            make=lambda key: inputs(key, ranks * t, d, f, e, k, dt),
            forward=forward,
            loss=loss,
            grad_argnums=(0, 2, 3, 4),
            flops_forward=flops,
            flops_backward=2 * flops,
        )
    ]


if __name__ == "__main__":
    main()
