"""Expert-parallel transport on 8 CPU devices against the unsharded single-device MoE
(`axkern.positional.moe_dispatch` → `ragged_dot` → `moe_combine`): values, gradients, dropped
tokens, empty experts, uneven counts, top-1 and top-8; each implementation, and the backward
of each op as the other op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec

import axkern
from axkern.core import compat
from axkern.ops.moe_ep import xla, xla_ragged
from axkern.ops.moe_ep.api import COMBINE, DISPATCH, capacity_for
from axkern.positional import moe_combine, moe_dispatch, moe_ep_combine, moe_ep_dispatch
from tests.harness import jit

RANKS = 8
P = PartitionSpec("ep")
HIGHEST = jax.lax.Precision.HIGHEST


def _mesh():
    return Mesh(np.array(jax.devices()[:RANKS]), ("ep",))


def _refused_here(impl):
    """Why `impl` cannot run on this machine (what `axkern.explain` reports), or None."""
    x, idx = jnp.zeros((RANKS, 2)), jnp.zeros((RANKS, 1), jnp.int32)

    def route(x, idx):
        return moe_ep_dispatch(
            x, idx, num_experts=RANKS, axis_name="ep", implementation=(impl, "xla")
        ).expert_x

    decision = axkern.explain(compat.shard_map(route, mesh=_mesh(), in_specs=(P, P), out_specs=P), x, idx)
    return next((r.reason for r in decision.rejected if r.implementation == impl), None)


def _require(impl):
    reason = _refused_here(impl) if impl != "xla" else None
    if reason is not None:
        pytest.skip(f"{impl} cannot run on {jax.default_backend()}: {reason}")


def _case(seed, tokens, hidden, out, experts, topk, kind="random"):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(k[0], (RANKS * tokens, hidden))
    if kind == "skewed":  # most pairs to a few experts: uneven counts
        idx = jnp.minimum(jax.random.geometric(k[1], 0.5, (RANKS * tokens, topk)) - 1, experts - 1)
    elif kind == "few":  # only experts 0..3 get tokens: empty experts and empty ranks
        idx = jax.random.randint(k[1], (RANKS * tokens, topk), 0, 4)
    else:
        idx = jnp.argsort(jax.random.uniform(k[1], (RANKS * tokens, experts)), axis=1)[:, :topk]
    w = jax.random.uniform(k[2], (RANKS * tokens, topk))
    weights = jax.random.normal(k[3], (experts, hidden, out)) / hidden**0.5
    return x, idx.astype(jnp.int32), w, weights


def _single_device(x, idx, w, weights, keep=None):
    """The unsharded MoE layer on one device; pairs outside `keep` contribute nothing."""
    experts = weights.shape[0]
    expert_x, group_sizes, routing = moe_dispatch(x, idx, num_experts=experts)
    y = lax.ragged_dot(expert_x, weights, group_sizes, precision=HIGHEST)
    w = w if keep is None else jnp.where(keep, w, 0)
    return moe_combine(y, w, routing)


def _ep_layer(experts, capacity_factor=None, impl=None):
    def local(x, idx, w, weights):
        expert_x, group_sizes, layout = moe_ep_dispatch(
            x, idx, num_experts=experts, axis_name="ep", capacity_factor=capacity_factor, implementation=impl
        )
        y = lax.ragged_dot(expert_x, weights, group_sizes, precision=HIGHEST)
        return moe_ep_combine(y, w, layout, implementation=impl), layout.sent, layout.dropped[None]

    return compat.shard_map(local, mesh=_mesh(), in_specs=(P, P, P, P), out_specs=(P, P, P))


def _loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(*a)))


def _assert_layer_matches(layer, x, idx, w, weights, keep=None):
    y, sent, dropped = jit(layer)(x, idx, w, weights)
    np.testing.assert_allclose(y, jit(_single_device)(x, idx, w, weights, keep), rtol=1e-5, atol=1e-5)
    got = jit(jax.grad(_loss(lambda *a: layer(*a)[0]), argnums=(0, 2, 3)))(x, idx, w, weights)
    want = jit(jax.grad(_loss(lambda *a: _single_device(*a, keep)), argnums=(0, 2, 3)))(x, idx, w, weights)
    for name, g, r in zip(("dx", "dw", "dweights"), got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=name)
    return sent, dropped


@pytest.mark.parametrize("impl", ["xla", "xla_ragged"])
@pytest.mark.parametrize(
    "topk, experts, kind", [(1, 8, "random"), (2, 16, "skewed"), (8, 16, "random"), (2, 16, "few")]
)
def test_exact_capacity_equals_the_single_device_moe(impl, topk, experts, kind):
    _require(impl)
    x, idx, w, weights = _case(topk + experts, 12, 6, 5, experts, topk, kind)
    sent, dropped = _assert_layer_matches(_ep_layer(experts, impl=impl), x, idx, w, weights)
    assert bool(jnp.all(sent)) and int(dropped.sum()) == 0


def _expected_sent(idx, experts, capacity_factor, tokens):
    """Which pairs fit: per source device, a pair's slot among its pairs to the same rank."""
    idx = np.asarray(idx).reshape(RANKS, tokens, -1)
    local = experts // RANKS
    cap = capacity_for(tokens, idx.shape[2], RANKS, capacity_factor)
    sent = np.zeros(idx.shape, bool)
    for src in range(RANKS):
        used = np.zeros(RANKS, int)
        for t in range(tokens):
            for k in range(idx.shape[2]):
                dst = idx[src, t, k] // local
                sent[src, t, k] = used[dst] < cap
                used[dst] += 1
    return sent.reshape(RANKS * tokens, -1)


@pytest.mark.parametrize("impl", ["xla", "xla_ragged", "reference"])
@pytest.mark.parametrize("topk, experts, kind", [(1, 8, "skewed"), (2, 16, "skewed"), (8, 16, "few")])
def test_capacity_drops_pairs_and_counts_them(impl, topk, experts, kind):
    _require(impl)
    tokens, factor = 12, 0.5
    x, idx, w, weights = _case(3 + topk, tokens, 6, 5, experts, topk, kind)
    want_sent = _expected_sent(idx, experts, factor, tokens)
    layer = _ep_layer(experts, capacity_factor=factor, impl=impl)
    sent, dropped = _assert_layer_matches(layer, x, idx, w, weights, keep=want_sent)
    np.testing.assert_array_equal(np.asarray(sent), want_sent)
    assert int(dropped.sum()) == int((~want_sent).sum()) > 0


def test_out_of_range_ids_are_dropped_and_bad_input_is_refused():
    x, idx, w, weights = _case(5, 8, 6, 5, 16, 2)
    idx = idx.at[3, 1].set(99).at[20, 0].set(-1)
    y, sent, dropped = jit(_ep_layer(16))(x, idx, w, weights)
    keep = (idx >= 0) & (idx < 16)
    assert int(dropped.sum()) == 2 and not bool(sent[3, 1]) and not bool(sent[20, 0])
    want = _single_device(x, jnp.clip(idx, 0, 15), w, weights, keep=keep)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="num_experts=12 must be a positive multiple of the 8 devices"):
        jit(_ep_layer(12))(x, idx, w, weights)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        jit(_ep_layer(16, capacity_factor=0.0))(x, idx, w, weights)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_each_backward_is_the_other_exchange(impl):
    """Dispatch's vjp is a combine with unit weights; combine's vjp (unit weights) is a dispatch."""
    experts, factor = 16, 0.75
    x, idx, _, _ = _case(11, 12, 6, 5, experts, 2, "skewed")

    def local(x, idx, g):
        ones = jnp.ones(idx.shape)
        expert_x, _, layout = moe_ep_dispatch(
            x, idx, num_experts=experts, axis_name="ep", capacity_factor=factor, implementation=impl
        )
        dx = jax.vjp(
            lambda x: (
                moe_ep_dispatch(
                    x, idx, num_experts=experts, axis_name="ep", capacity_factor=factor, implementation=impl
                ).expert_x
            ),
            x,
        )[1](g)[0]
        as_combine = moe_ep_combine(g, ones, layout, implementation=impl)
        dy = jax.vjp(lambda e: moe_ep_combine(e, ones, layout, implementation=impl), expert_x)[1](x)[0]
        as_dispatch = moe_ep_dispatch(
            x, idx, num_experts=experts, axis_name="ep", capacity_factor=factor, implementation=impl
        ).expert_x
        return dx, as_combine, dy, as_dispatch

    rows = RANKS * capacity_for(12, 2, RANKS, factor)
    g = jax.random.normal(jax.random.PRNGKey(1), (RANKS * rows, 6))
    dx, as_combine, dy, as_dispatch = jit(
        compat.shard_map(local, mesh=_mesh(), in_specs=(P, P, P), out_specs=(P, P, P, P))
    )(x, idx, g)
    np.testing.assert_allclose(dx, as_combine, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dy, as_dispatch, rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(dx))) > 0 and float(jnp.max(jnp.abs(dy))) > 0


# -- xla_ragged ----------------------------------------------------------------------------------


def test_xla_ragged_is_refused_on_the_cpu_with_its_reason():
    if jax.default_backend() != "cpu":
        pytest.skip(f"xla_ragged runs on {jax.default_backend()}")
    reason = _refused_here("xla_ragged")
    assert reason is not None and "XLA:CPU cannot compile ragged-all-to-all" in reason
    x, idx, w, weights = _case(1, 4, 6, 5, 8, 1)
    with pytest.raises(axkern.Unsupported, match="xla_ragged.*XLA:CPU cannot compile ragged-all-to-all"):
        jit(_ep_layer(8, impl="xla_ragged"))(x, idx, w, weights)
    for platform in ("cpu", "gpu", "tpu"):  # explicit only, everywhere
        assert "xla_ragged" not in DISPATCH.default_order[platform] + COMBINE.default_order[platform]


def _emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`lax.ragged_all_to_all` as its docstring defines it, from a dense `all_to_all`: source `s`
    sends `operand[input_offsets[r] : + send_sizes[r]]` to rank `r`, which writes it at
    `output_offsets[r]` (as `s` gave it) for `recv_sizes[s]` rows."""
    n = operand.shape[0]
    j = jnp.arange(n)
    trailing = (1,) * (operand.ndim - 1)
    valid = (j[None, :] < send_sizes[:, None]).reshape(send_sizes.shape + (n,) + trailing)
    send = jnp.where(valid, operand[jnp.clip(input_offsets[:, None] + j[None, :], 0, n - 1)], 0)
    recv = lax.all_to_all(send, axis_name, 0, 0)  # [source, n, ...]
    at = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source writes here
    where = jnp.where(j[None, :] < recv_sizes[:, None], at[:, None] + j[None, :], output.shape[0])
    return output.at[where.reshape(-1)].set(recv.reshape((-1,) + operand.shape[1:]), mode="drop")


# each value of the capacity factor and of the routing once: every case compiles eight programs
@pytest.mark.parametrize("factor, topk, experts, kind", [(None, 8, 16, "few"), (0.5, 1, 8, "skewed")])
def test_xla_ragged_packing_equals_xla_with_an_emulated_exchange(monkeypatch, factor, topk, experts, kind):
    """xla_ragged's packing, offsets and sizes, run on the CPU with the exchange emulated (XLA:CPU
    cannot compile ragged_all_to_all): the same outputs and gradients as xla, with either's layout
    combined by either."""
    monkeypatch.setattr(xla_ragged, "ragged_all_to_all", _emulated_ragged_all_to_all)
    tokens = 12
    x, idx, w, _ = _case(7 + topk, tokens, 6, 5, experts, topk, kind)
    cap = capacity_for(tokens, topk, RANKS, factor)
    opts = dict(num_experts=experts, axis_name="ep", ranks=RANKS, capacity=cap)

    def layer(send, back):
        def local(x, idx, w):
            expert_x, group_sizes, order, dst, slot, sent, dropped = send.dispatch(x, idx, **opts)
            y = back.combine(
                jnp.tanh(expert_x) * 3,
                w,
                order,
                dst,
                slot,
                sent,
                **{k: v for k, v in opts.items() if k != "num_experts"},
            )
            return y, expert_x, group_sizes, dropped[None]

        return compat.shard_map(local, mesh=_mesh(), in_specs=(P, P, P), out_specs=(P, P, P, P))

    want = jit(layer(xla, xla))(x, idx, w)
    for send, back in [(xla_ragged, xla_ragged), (xla_ragged, xla), (xla, xla_ragged)]:
        got = jit(layer(send, back))(x, idx, w)
        for g, r in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    assert (int(want[3].sum()) > 0) == (factor is not None)
    grad = lambda s, b: jit(jax.grad(lambda *a: jnp.sum(layer(s, b)(*a)[0] ** 2), argnums=(0, 2)))  # noqa: E731
    for g, r in zip(grad(xla_ragged, xla_ragged)(x, idx, w), grad(xla, xla)(x, idx, w), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


# -- the named form ------------------------------------------------------------------------------


def _named_case(experts=16, topk=2):
    import haliax as hax

    Batch, Pos, TopK = hax.Axis("batch", 4), hax.Axis("position", 8), hax.Axis("topk", topk)
    Embed, Out, Experts = hax.Axis("embed", 6), hax.Axis("out", 5), hax.Axis("experts", experts)
    k = jax.random.split(jax.random.PRNGKey(21), 4)
    x = hax.random.normal(k[0], (Batch, Pos, Embed))
    idx = hax.named(jax.random.randint(k[1], (Pos.size, Batch.size, topk), 0, experts), (Pos, Batch, TopK))
    w = hax.random.uniform(k[2], (TopK, Batch, Pos))
    weights = hax.random.normal(k[3], (Experts, Embed, Out)) * Embed.size**-0.5
    return x, idx, w, weights, (Batch, Pos, TopK, Embed, Out)


def _named_layer(mesh, capacity_factor=None):
    import haliax as hax

    def layer(x, idx, w, weights):
        expert_x, group_sizes, layout = axkern.moe_ep_dispatch(
            x, idx, num_experts=weights.axes[0].size, capacity_factor=capacity_factor
        )
        rows, counts, experts = layout.expert_specs()
        assert (rows, counts, experts) == (PartitionSpec(("ep", "data")), PartitionSpec(("data",), "ep"), P)

        def local_experts(rows, counts, w_local):
            return lax.ragged_dot(rows, w_local, counts[0], precision=HIGHEST)

        y = compat.shard_map(local_experts, mesh=mesh, in_specs=(rows, counts, experts), out_specs=rows)(
            expert_x.array, group_sizes.array, weights.array
        )
        y = hax.named(y, (expert_x.axes[0], weights.axes[2]))
        return axkern.moe_ep_combine(y, w, layout), layout.dropped

    return layer


def test_named_form_on_a_data_by_expert_mesh_equals_the_single_device_moe():
    import haliax as hax

    mesh = Mesh(np.array(jax.devices()[:RANKS]).reshape(2, 4), ("data", "ep"))
    x, idx, w, weights, (Batch, Pos, TopK, Embed, Out) = _named_case()
    flat = lambda a, axes: a.rearrange(axes).array.reshape(Batch.size * Pos.size, -1)  # noqa: E731

    def dense(x, w, weights):
        return _single_device(
            flat(x, (Batch, Pos, Embed)),
            flat(idx, (Batch, Pos, TopK)),
            flat(w, (Batch, Pos, TopK)),
            weights.array,
        )

    with jax.set_mesh(mesh), hax.axis_mapping({"batch": "data", "position": "ep", "experts": "ep"}):
        layer = _named_layer(mesh)
        y, dropped = jit(layer)(x, idx, w, weights)
        assert [a.name for a in y.axes] == ["batch", "position", "out"]  # topk_weights' token order
        grads = jit(
            jax.grad(lambda x, w, we: hax.sum(hax.sin(layer(x, idx, w, we)[0])).array, argnums=(0, 1, 2))
        )(x, w, weights)
    assert int(dropped) == 0
    np.testing.assert_allclose(flat(y, (Batch, Pos, Out)), jit(dense)(x, w, weights), rtol=1e-5, atol=1e-5)
    want = jit(jax.grad(lambda *a: jnp.sum(jnp.sin(dense(*a))), argnums=(0, 1, 2)))(x, w, weights)
    for name, g, r in zip(("dx", "dw", "dweights"), grads, want, strict=True):
        np.testing.assert_allclose(g.rearrange(r.axes).array, r.array, rtol=1e-4, atol=1e-5, err_msg=name)


def test_named_form_counts_per_block_and_refuses_a_wrong_mapping():
    import haliax as hax

    mesh = Mesh(np.array(jax.devices()[:RANKS]).reshape(2, 4), ("data", "ep"))
    x, idx, w, weights, (Batch, Pos, TopK, Embed, Out) = _named_case()
    with jax.set_mesh(mesh), hax.axis_mapping({"batch": "data", "position": "ep", "experts": "ep"}):
        expert_x, group_sizes, layout = jit(
            lambda x, idx: axkern.moe_ep_dispatch(x, idx, num_experts=16, capacity_factor=0.5)
        )(x, idx)
    assert [(a.name, a.size) for a in group_sizes.axes] == [("dispatch_blocks", 2), ("experts", 16)]
    counts = np.zeros((2, 16), int)  # pairs per (batch half, expert) that were sent
    ids = np.asarray(idx.rearrange((Batch, Pos, TopK)).array)
    sent = np.asarray(layout.sent.rearrange((Batch, Pos, TopK)).array)
    np.add.at(counts, (np.arange(4)[:, None, None] // 2 * np.ones_like(ids), ids), sent)
    np.testing.assert_array_equal(group_sizes.array, counts)
    assert int(layout.dropped) == int((~sent).sum()) > 0
    assert expert_x.axes[0].size == RANKS * 4 * capacity_for(4, 2, 4, 0.5)

    with jax.set_mesh(mesh), hax.axis_mapping({"batch": "data", "position": "ep"}):
        with pytest.raises(ValueError, match="experts axis 'experts' is mapped to no mesh axis"):
            axkern.moe_ep_dispatch(x, idx, num_experts=16)
    with jax.set_mesh(mesh), hax.axis_mapping({"batch": "data", "experts": "ep"}):
        with pytest.raises(ValueError, match="must be split over the experts' mesh axis 'ep' too"):
            axkern.moe_ep_dispatch(x, idx, num_experts=16)
        with pytest.raises(ValueError, match="under the axis mapping moe_ep_dispatch ran under"):
            axkern.moe_ep_combine(hax.named(expert_x.array, (expert_x.axes[0], Embed)), w, layout)
    with jax.set_mesh(mesh), hax.axis_mapping({"batch": "data", "position": "ep", "experts": "ep"}):
        with pytest.raises(ValueError, match="num_experts=10 must be a positive multiple of the 4 devices"):
            axkern.moe_ep_dispatch(x, idx, num_experts=10)
