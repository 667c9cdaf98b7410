"""The CUDA expert-parallel transport against `xla` on a mesh of every visible GPU (one rank per
GPU): the dispatch's outputs exactly (rows, group sizes, order, slots, drops), the combine's
value and every gradient (dx, the weights', the expert outputs' through them) within float32
summation order of `xla`'s for float32 inputs and by DESIGN.md's rule for 16-bit ones, each
layout combined by the other implementation. On one GPU every kernel and both
barriers run against the GPU itself; the `multi_gpu` cases need two or more.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu/test_moe_ep_gpu.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import axkern
from axkern.core import compat
from axkern.positional import moe_ep_combine, moe_ep_dispatch
from tests.helpers import assert_oracle_rule

pytestmark = pytest.mark.gpu
P = PartitionSpec("ep")


def _mesh():
    return Mesh(np.array(jax.devices()), ("ep",))


def _ranks():
    return len(jax.devices())


def _case(seed, tokens, hidden, experts, topk, dtype, kind="random"):
    """Inputs over every rank: `tokens` per rank."""
    n = _ranks() * tokens
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k[0], (n, hidden)).astype(dtype)
    if kind == "skewed":  # most pairs to a few experts: uneven counts, drops under a capacity factor
        idx = jnp.minimum(jax.random.geometric(k[1], 0.5, (n, topk)) - 1, experts - 1)
    elif kind == "few":  # only experts 0..3: empty experts and, over several GPUs, empty ranks
        idx = jax.random.randint(k[1], (n, topk), 0, 4)
    else:
        idx = jnp.argsort(jax.random.uniform(k[1], (n, experts)), axis=1)[:, :topk]
    idx = idx.astype(jnp.int32)
    if kind == "bad_ids":  # ids outside [0, E): dropped and counted
        idx = idx.at[3, 0].set(experts + 5).at[n - 1, topk - 1].set(-1)
    w = jax.random.uniform(k[2], (n, topk), jnp.float32)
    return x, idx, w


def _layer(experts, factor, dispatch_impl, combine_impl):
    """Per rank: dispatch, an elementwise expert (`tanh`, so every row's gradient differs),
    combine; returns the combine's output and the dispatch's outputs."""

    def local(x, idx, w):
        expert_x, group_sizes, layout = moe_ep_dispatch(
            x, idx, num_experts=experts, axis_name="ep", capacity_factor=factor, implementation=dispatch_impl
        )
        y = moe_ep_combine(jnp.tanh(expert_x), w, layout, implementation=combine_impl)
        return y, expert_x, group_sizes, layout.order, layout.slot, layout.sent, layout.dropped[None]

    return compat.shard_map(local, mesh=_mesh(), in_specs=(P, P, P), out_specs=(P,) * 7)


def _compare(x, idx, w, experts, factor, dispatch_impl="cuda", combine_impl="cuda"):
    """The dispatch's outputs exactly `xla`'s; the combine's value and the gradients of x and of
    the weights by DESIGN.md's rule, with `xla` in the inputs' dtype as the reference and `xla`
    on float32 copies as the oracle (the same routing; float32 `y`, `dx`, `dw` within float32
    summation order of it)."""
    got = jax.jit(_layer(experts, factor, dispatch_impl, combine_impl))(x, idx, w)
    want = jax.jit(_layer(experts, factor, "xla", "xla"))(x, idx, w)
    names = ("y", "expert_x", "group_sizes", "order", "slot", "sent", "dropped")
    for name, g, r in zip(names[1:], got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)  # a permutation: exact

    def loss(impls):
        layer = _layer(experts, factor, *impls)
        return lambda x, w: jnp.sum(jnp.sin(layer(x, idx, w)[0].astype(jnp.float32)))

    def value_and_grads(impls, x):
        y = jax.jit(_layer(experts, factor, *impls))(x, idx, w)[0]
        return (y, *jax.jit(jax.grad(loss(impls), argnums=(0, 1)))(x, w))

    impl = value_and_grads((dispatch_impl, combine_impl), x)
    reference = value_and_grads(("xla", "xla"), x)
    for name, a in zip(("y", "dx", "dw"), impl, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), name
    if x.dtype == jnp.float32:
        for name, a, b in zip(("y", "dx", "dw"), impl, reference, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
    else:
        with jax.default_matmul_precision("highest"):
            oracle = value_and_grads(("xla", "xla"), x.astype(jnp.float32))
        assert_oracle_rule(impl, reference, oracle, jnp.dtype(x.dtype).name, "y, dx, dw")
    assert float(jnp.max(jnp.abs(impl[1].astype(jnp.float32)))) > 0
    return got


@pytest.mark.parametrize(
    "tokens, hidden, experts, topk, dtype, factor, kind",
    [
        (64, 256, 16, 2, "float32", None, "random"),  # exact capacity
        (96, 512, 16, 2, "bfloat16", 0.5, "skewed"),  # a capacity factor that drops pairs
        (40, 128, 16, 8, "bfloat16", None, "few"),  # top-8, empty experts
        (33, 1001, 16, 1, "float32", 1.0, "random"),  # top-1, rows not whole 16-byte vectors
        (24, 96, 16, 12, "float32", None, "random"),  # top-12: the kernels' 16-slot variant
        (50, 64, 16, 2, "bfloat16", None, "bad_ids"),  # ids outside [0, E)
    ],
)
def test_cuda_matches_xla(tokens, hidden, experts, topk, dtype, factor, kind):
    x, idx, w = _case(tokens + topk, tokens, hidden, experts, topk, dtype, kind)
    got = _compare(x, idx, w, experts, factor)
    dropped = int(np.asarray(got[-1]).sum())
    if kind == "bad_ids":
        assert dropped >= 2
    if factor == 0.5:
        assert dropped > 0


@pytest.mark.parametrize("dispatch_impl, combine_impl", [("cuda", "xla"), ("xla", "cuda")])
def test_each_layout_combines_with_the_other_implementation(dispatch_impl, combine_impl):
    x, idx, w = _case(3, 48, 128, 16, 4, "bfloat16", "skewed")
    _compare(x, idx, w, 16, 0.75, dispatch_impl, combine_impl)


def test_explain_names_cuda_where_asked():
    x, idx, _ = _case(0, 8, 64, 16, 2, "bfloat16")

    def route(x, idx):
        return moe_ep_dispatch(x, idx, num_experts=16, axis_name="ep", implementation="cuda").expert_x

    d = axkern.explain(compat.shard_map(route, mesh=_mesh(), in_specs=(P, P), out_specs=P), x, idx)
    assert d.implementation == "cuda", d


@pytest.mark.multi_gpu
def test_cuda_matches_xla_across_gpus():
    if _ranks() < 2:
        pytest.skip(f"needs two or more GPUs; {_ranks()} visible")
    x, idx, w = _case(7, 512, 1024, 64, 8, "bfloat16", "random")
    _compare(x, idx, w, 64, 1.25)
    x, idx, w = _case(8, 256, 512, 64, 8, "bfloat16", "skewed")
    _compare(x, idx, w, 64, None)
