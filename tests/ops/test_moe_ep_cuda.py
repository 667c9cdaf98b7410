"""The CUDA expert-parallel transport where no GPU is: refused on the CPU with its reason and in
no default order, lowered for CUDA inside `shard_map` with the mesh it runs on (its GPUs'
ordinals, shape and the experts' axis) for the forward and both backward passes, the XLA side
of its dispatch (each pair's place among its destination's pairs for the same expert), and the
sizes it refuses. The kernels themselves run in tests/gpu/test_moe_ep_gpu.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import axkern
from axkern.core import compat
from axkern.ops.moe_ep import cuda
from axkern.ops.moe_ep.api import COMBINE, DISPATCH
from axkern.positional import moe_ep_dispatch

P = PartitionSpec("ep")


def test_refused_on_the_cpu_with_its_reason_and_explicit_only():
    if jax.default_backend() != "cpu":
        pytest.skip(f"the CUDA transport may serve on {jax.default_backend()}")
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    x, idx = jnp.zeros((8, 4)), jnp.zeros((8, 1), jnp.int32)

    def route(x, idx):
        return moe_ep_dispatch(x, idx, num_experts=8, axis_name="ep", implementation=("cuda", "xla")).expert_x

    decision = axkern.explain(compat.shard_map(route, mesh=mesh, in_specs=(P, P), out_specs=P), x, idx)
    reason = next(r.reason for r in decision.rejected if r.implementation == "cuda")
    assert "gpu" in reason and cuda.WHY_PLATFORMS in reason and decision.implementation == "xla"
    for platform in ("cpu", "gpu", "tpu"):
        assert "cuda" not in DISPATCH.default_order[platform] + COMBINE.default_order[platform]


def _ints(line, name):
    return [int(v) for v in re.search(name + r" = dense<\[?([-\d, ]+)\]?>", line).group(1).split(",")]


def _scalar(line, name):
    return int(re.search(name + r" = (-?\d+) : i64", line).group(1))


def _calls(text):
    """Each FFI custom call's target and attributes in lowered StableHLO text."""
    return [
        (
            m.group(1),
            _ints(line, "mesh_ordinals"),
            _ints(line, "mesh_shape"),
            _scalar(line, "axis"),
            _scalar(line, "capacity"),
        )
        for m in re.finditer(r"stablehlo\.custom_call @(AxkernEp\w+)\(.*", text)
        for line in [m.group(0)]
    ]


def test_lowered_for_cuda_with_the_mesh_it_runs_on():
    devices = jax.devices()[:8]
    if len(devices) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(devices[::-1]).reshape(2, 4), ("data", "ep"))  # GPU order differs from rank order
    spec = PartitionSpec(("data", "ep"))
    experts, topk, capacity = 8, 2, 8

    def layer(x, idx, w):
        ex, _, order, dst, slot, sent, _ = cuda.dispatch(
            x, idx, num_experts=experts, axis_name="ep", ranks=4, capacity=capacity
        )
        return cuda.combine(
            jnp.tanh(ex), w, order, dst, slot, sent, axis_name="ep", ranks=4, capacity=capacity
        )

    sharded = compat.shard_map(layer, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    args = (jnp.ones((64, 16), jnp.bfloat16), jnp.zeros((64, topk), jnp.int32), jnp.ones((64, topk)))

    def loss(x, w):
        return jnp.sum(jnp.sin(sharded(x, args[1], w).astype(jnp.float32)))

    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1)))
        .trace(args[0], args[2])
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = _calls(text)
    # forward: dispatch, combine's gather; backward: combine's push-pull, dispatch's gather
    assert sorted(c[0] for c in calls) == sorted(
        ["AxkernEpDispatch", "AxkernEpGatherSum", "AxkernEpCombineBwd", "AxkernEpGatherSum"]
    )
    ordinals = [d.local_hardware_id for d in np.asarray(mesh.devices).flat]
    assert ordinals != sorted(ordinals)
    for _, got, shape, axis, cap in calls:
        assert got == ordinals and shape == [2, 4] and axis == 1 and cap == capacity
    assert "has_side_effect = true" in text


def test_each_pairs_place_among_its_destinations_pairs_for_the_same_expert():
    rng = np.random.default_rng(0)
    key = rng.integers(0, 9, size=500).astype(np.int32)  # 8 (destination, expert) keys and the unsent
    got = np.asarray(cuda._within(jnp.asarray(key), jnp.asarray(np.bincount(key, minlength=9), jnp.int32)))
    seen = np.zeros(9, int)
    for p, k in enumerate(key):
        assert got[p] == seen[k]
        seen[k] += 1


def test_replicated_inputs_take_the_gradient_and_misuse_is_named():
    devices = jax.devices()[:8]
    if len(devices) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(devices), ("ep",))

    def layer(x, idx, w):
        ex, _, order, dst, slot, sent, _ = cuda.dispatch(
            x, idx, num_experts=8, axis_name="ep", ranks=8, capacity=4
        )
        return cuda.combine(ex, w, order, dst, slot, sent, axis_name="ep", ranks=8, capacity=4)

    x, idx, w = jnp.ones((4, 16), jnp.bfloat16), jnp.zeros((32, 1), jnp.int32), jnp.ones((4, 1), jnp.bfloat16)
    # x and the weights replicated (not split over "ep"), the ids split: their gradients are sums over ranks
    replicated = PartitionSpec()
    sharded = compat.shard_map(layer, mesh=mesh, in_specs=(replicated, P, replicated), out_specs=P)

    def loss(x, w):
        return jnp.sum(jnp.sin(sharded(x, idx, w).astype(jnp.float32)))

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "AxkernEpCombineBwd" in text and "AxkernEpGatherSum" in text
    with pytest.raises(ValueError, match="does not run under vmap"):
        jax.jit(jax.vmap(lambda x: sharded(x, idx, w))).trace(jnp.ones((2, 4, 16), jnp.bfloat16))
    with pytest.raises(ValueError, match="inside shard_map"):
        cuda._ffi("AxkernEpGatherSum", (jax.ShapeDtypeStruct((1,), jnp.int32),), "ep", jnp.zeros(1))


def test_sizes_it_cannot_hold_are_refused_with_the_reason(monkeypatch):
    def spec(dtype=jnp.bfloat16, **dims):
        base = {"tokens": 64, "topk": 2, "embed": 16, "experts": 8, "ranks": 2, "capacity": 64}
        return DISPATCH.spec(base | dims, dtype)

    assert "not float64" in cuda.supports(spec(jnp.dtype("float64")))

    assert "at most 64 ranks" in cuda.supports(spec(ranks=65, experts=65))
    assert "at most 4096 counts" in cuda.supports(spec(experts=8192))
    assert "top-k at most 16" in cuda.supports(spec(topk=17))
    assert "int32" in cuda.supports(spec(capacity=2**31))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
    assert "memory pool" in cuda.supports(spec())
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert "one process" in cuda.supports(spec())
