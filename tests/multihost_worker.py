"""One process of the multi-process test: every op's named function under each of its sharding rules.

Run as a script, one process per `--process-id`, all with the same `--coordinator` and
`--num-processes`, each with `XLA_FLAGS=--xla_force_host_platform_device_count=K` so that the
processes hold 8 CPU devices together; `tests/test_multihost.py` starts them. Each process
joins the cluster with `jax.distributed.initialize` (CPU collectives run over gloo), builds
the global mesh over all processes' devices and, per case:

1. computes the case's loss, outputs and gradients without a mesh on its first local device
   (the single-process run),
2. places the same inputs on the global mesh, sharded as the case's haliax axis mapping says,
   and runs the same function under the mapping (`jit` of `value_and_grad`),
3. compares every output and gradient shard it holds with the single-process values.

It prints one JSON line per case on stdout: `case`, `process`, `ok` and `message` (what did
not match), `manual` (whether the named layer wrapped the op in `shard_map`), `collectives`
(those in the compiled HLO) and timings; the parent asserts on them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import axkern

MESH_AXES = ("data", "model")
GLOBAL_DEVICES = 8
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


@dataclasses.dataclass(frozen=True)
class Case:
    """`fn(*diff, *const) -> (scalar, aux)`; gradients are taken with respect to `diff`.

    `mesh_shape` splits the 8 global devices over `("data", "model")`; the devices are
    process-major, so with 2 processes of 4 devices a mesh axis of size 8, or `data` of
    size 2, crosses the processes. `collectives` must appear in the sharded run's compiled
    HLO.
    Cases with the same `reference` compute the same thing (only the mapping differs), so
    the single-process run is made once for them.
    """

    mesh_shape: tuple[int, int]
    mapping: dict[str, str]
    fn: Callable
    diff: tuple
    const: tuple = ()
    rtol: float = 2e-5
    atol: float = 2e-5
    collectives: tuple[str, ...] = ()
    reference: str | None = None


# Inputs come from numpy (the same in every process, and no eager JAX op to compile per array).


def _named(data, axes):
    return hax.named(jnp.asarray(data), tuple(axes))


def _normal(seed, axes, scale=1.0):
    data = np.random.default_rng(seed).standard_normal([a.size for a in axes]) * scale
    return _named(data.astype(np.float32), axes)


def _segments(seed, batch, pos, rate=0.15):
    starts = np.random.default_rng(seed).random((batch.size, pos.size)) < rate
    starts[:, 0] = False
    return _named(np.cumsum(starts, axis=1).astype(np.int32), (batch, pos))


# -- fused cross-entropy ----------------------------------------------------------------------

CE_BATCH, CE_POS, CE_EMBED, CE_VOCAB = (
    hax.Axis("batch", 8),
    hax.Axis("position", 4),
    hax.Axis("embed", 16),
    hax.Axis("vocab", 64),
)


def _ce_inputs():
    x = _normal(1, (CE_BATCH, CE_POS, CE_EMBED))
    w = _normal(2, (CE_EMBED, CE_VOCAB), scale=0.5)
    labels = np.random.default_rng(3).integers(0, CE_VOCAB.size, (CE_BATCH.size, CE_POS.size), np.int32)
    labels[1, 2] = -100  # one ignored token
    labels = _named(labels, (CE_BATCH, CE_POS))
    return x, w, labels


def _ce_per_token(x, w, labels):
    loss, lse = axkern.fused_cross_entropy(x, w, labels, reduction=None, return_lse=True, ignore_index=-100)
    return hax.sum(loss).array + 0.1 * hax.sum(lse * lse).array, (loss, lse)


def _ce_mean(x, w, labels):
    loss = axkern.fused_cross_entropy(
        x, w, labels, ignore_index=-100, label_smoothing=0.1, logsumexp_weight=1e-2
    )
    return loss, loss


def ce_case(mesh_shape, mapping, fn, collectives):
    x, w, labels = _ce_inputs()
    return Case(mesh_shape, mapping, fn, (x, w), (labels,), collectives=collectives)


# -- short convolution ------------------------------------------------------------------------

SC_BATCH, SC_POS, SC_CHAN, SC_WIDTH = (
    hax.Axis("batch", 2),
    hax.Axis("position", 32),
    hax.Axis("embed", 6),
    hax.Axis("width", 4),
)
SC_STATE = hax.Axis("conv_state", SC_WIDTH.size - 1)


def short_conv_case(mesh_shape, mapping, collectives):
    x = _normal(11, (SC_BATCH, SC_POS, SC_CHAN))
    w = _normal(12, (SC_WIDTH, SC_CHAN), scale=0.5)
    b = _normal(13, (SC_CHAN,))
    s0 = _normal(14, (SC_BATCH, SC_STATE, SC_CHAN))
    seg = _segments(15, SC_BATCH, SC_POS)

    def f(x, w, b, s0, seg):
        y, final = axkern.short_conv(
            x, w, bias=b, segment_ids=seg, initial_state=s0, activation="silu", return_final_state=True
        )
        return hax.sum(y * y).array + hax.sum(final * final).array, (y, final)

    return Case(
        mesh_shape, mapping, f, (x, w, b, s0), (seg,), collectives=collectives, reference="short_conv"
    )


# -- SSD --------------------------------------------------------------------------------------

SSD_BATCH, SSD_POS, SSD_HEADS, SSD_HEAD_DIM, SSD_GROUPS, SSD_STATE = (
    hax.Axis("batch", 2),
    hax.Axis("position", 32),
    hax.Axis("heads", 4),
    hax.Axis("head_size", 3),
    hax.Axis("groups", 2),
    hax.Axis("state", 5),
)


def ssd_case(mesh_shape, mapping, collectives):
    bpos = (SSD_BATCH, SSD_POS)
    x = _normal(21, (*bpos, SSD_HEADS, SSD_HEAD_DIM))
    dt = _normal(22, (*bpos, SSD_HEADS))
    A = _named(-np.exp(np.random.default_rng(23).standard_normal(SSD_HEADS.size, np.float32)), (SSD_HEADS,))
    B = _normal(24, (*bpos, SSD_GROUPS, SSD_STATE))
    C = _normal(25, (*bpos, SSD_GROUPS, SSD_STATE))
    D = _normal(26, (SSD_HEADS,))
    z = _normal(27, (*bpos, SSD_HEADS, SSD_HEAD_DIM))
    s0 = _normal(28, (SSD_BATCH, SSD_HEADS, SSD_HEAD_DIM, SSD_STATE))
    seg = _segments(29, SSD_BATCH, SSD_POS, rate=0.1)

    def f(x, dt, A, B, C, D, z, s0, seg):
        y, final = axkern.ssd(
            x,
            dt,
            A,
            B,
            C,
            D=D,
            z=z,
            initial_state=s0,
            segment_ids=seg,
            dt_softplus=True,
            return_final_state=True,
            chunk_size=4,
        )
        return hax.sum(y * y).array + hax.sum(final).array, (y, final)

    return Case(
        mesh_shape,
        mapping,
        f,
        (x, dt, A, B, C, D, z, s0),
        (seg,),
        rtol=2e-4,
        atol=2e-4,
        collectives=collectives,
        reference="ssd",
    )


# -- attention --------------------------------------------------------------------------------

AT_BATCH, AT_POS, AT_KPOS, AT_HEADS, AT_HEAD_SIZE = (
    hax.Axis("batch", 2),
    hax.Axis("position", 16),
    hax.Axis("key_position", 16),
    hax.Axis("heads", 8),
    hax.Axis("head_size", 8),
)


def attention_case(mesh_shape, mapping, kv_heads, collectives):
    kvh = hax.Axis("kv_heads", kv_heads)
    q = _normal(31, (AT_BATCH, AT_POS, AT_HEADS, AT_HEAD_SIZE))
    k = _normal(32, (AT_BATCH, AT_KPOS, kvh, AT_HEAD_SIZE))
    v = _normal(33, (AT_BATCH, AT_KPOS, kvh, AT_HEAD_SIZE))
    sinks = _normal(34, (AT_HEADS,))
    seg = _segments(35, AT_BATCH, AT_POS)

    def f(q, k, v, sinks, seg):
        mask = axkern.masks.Causal() & axkern.masks.Segments(seg.array, seg.array)
        out = axkern.attention(q, k, v, mask=mask, sinks=sinks)
        return hax.sum(out * out).array, out

    return Case(
        mesh_shape, mapping, f, (q, k, v, sinks), (seg,), rtol=1e-5, atol=1e-5, collectives=collectives
    )


# -- MoE routing ------------------------------------------------------------------------------

MOE_TOKEN, MOE_TOPK, MOE_EMBED, MOE_EXPERTS = (
    hax.Axis("token", 16),
    hax.Axis("topk", 2),
    hax.Axis("embed", 8),
    4,
)


def moe_case(mesh_shape, mapping):
    rng = np.random.default_rng(41)
    x = _normal(42, (MOE_TOKEN, MOE_EMBED))
    logits = rng.standard_normal((MOE_TOKEN.size, MOE_TOPK.size)).astype(np.float32)
    weights = _named(np.exp(logits) / np.exp(logits).sum(1, keepdims=True), (MOE_TOKEN, MOE_TOPK))
    first = rng.integers(0, MOE_EXPERTS, MOE_TOKEN.size)
    second = (first + rng.integers(1, MOE_EXPERTS, MOE_TOKEN.size)) % MOE_EXPERTS  # two distinct experts
    topk_idx = _named(np.stack([first, second], axis=1).astype(np.int32), (MOE_TOKEN, MOE_TOPK))

    def f(x, weights, topk_idx):
        layout = axkern.moe_layout(topk_idx, num_experts=MOE_EXPERTS)
        expert_x, _, routing = axkern.moe_dispatch(x, topk_idx, num_experts=MOE_EXPERTS)
        y = axkern.moe_combine(hax.tanh(expert_x) * 2.0, weights, routing)  # a per-row "expert"
        return hax.sum(y * y).array, (y, layout.tokens_per_expert, layout.is_token_in_rank)

    return Case(mesh_shape, mapping, f, (x, weights), (topk_idx,), rtol=1e-5, atol=1e-5)


def moe_ep_case(mesh_shape, mapping):
    """The expert-parallel transport's `xla` path: an EP MoE layer with the experts over the mesh
    axis `model` (its all_to_all crosses the processes) against the dense single-device layer."""
    experts, embed, out = 16, MOE_EMBED.size, 3
    Expert, Out = hax.Axis("experts", experts), hax.Axis("out", out)
    rng = np.random.default_rng(43)
    x = _normal(44, (MOE_TOKEN, MOE_EMBED))
    weights = _named(
        rng.uniform(size=(MOE_TOKEN.size, MOE_TOPK.size)).astype(np.float32), (MOE_TOKEN, MOE_TOPK)
    )
    w_experts = _normal(45, (Expert, MOE_EMBED, Out), scale=embed**-0.5)
    topk_idx = _named(
        np.argsort(rng.random((MOE_TOKEN.size, experts)), axis=1)[:, :2].astype(np.int32),
        (MOE_TOKEN, MOE_TOPK),
    )

    def dense(x, w, idx, we):
        per = jnp.einsum("td,tkdo->tko", x, we[idx], precision="highest")
        return jnp.einsum("tk,tko->to", w, per, precision="highest")

    def ep(x, w, idx, we):
        expert_x, groups, layout = axkern.positional.moe_ep_dispatch(
            x, idx, num_experts=experts, axis_name="model"
        )
        y = jax.lax.ragged_dot(expert_x, we, groups, precision=jax.lax.Precision.HIGHEST)
        return axkern.positional.moe_ep_combine(y, w, layout)

    def f(x, weights, w_experts, topk_idx):
        mesh = hax.partitioning._resolve_mesh()
        args = (x.array, weights.array, topk_idx.array, w_experts.array)
        if mesh is None or getattr(mesh, "empty", False):
            y = dense(*args)
        else:
            spec = PartitionSpec("model")
            y = jax.shard_map(ep, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)(*args)
        y = hax.named(y, (MOE_TOKEN, Out))
        return hax.sum(y * y).array, y

    return Case(
        mesh_shape,
        mapping,
        f,
        (x, weights, w_experts),
        (topk_idx,),
        collectives=("all-to-all",),
        rtol=1e-5,
        atol=1e-5,
    )


CASES: dict[str, Callable[[], Case]] = {
    # vocab parallel: each device holds a slice of lm_head; lse and label logits are combined
    "fused_cross_entropy/vocab": lambda: ce_case((1, 8), {"vocab": "model"}, _ce_mean, ("all-reduce",)),
    # data parallel over the processes, vocab parallel inside each
    "fused_cross_entropy/data+vocab": lambda: ce_case(
        (2, 4), {"batch": "data", "vocab": "model"}, _ce_per_token, ("all-reduce",)
    ),
    # sequence parallel: each shard gets the previous shard's last width - 1 inputs
    "short_conv/sequence": lambda: short_conv_case((1, 8), {"position": "model"}, ("collective-permute",)),
    "short_conv/data+sequence": lambda: short_conv_case(
        (2, 4), {"batch": "data", "position": "model"}, ("collective-permute", "all-reduce")
    ),
    # sequence parallel: each shard's final state reaches every later shard
    "ssd/sequence": lambda: ssd_case((1, 8), {"position": "model"}, ("all-reduce",)),
    "ssd/data+sequence": lambda: ssd_case((2, 4), {"batch": "data", "position": "model"}, ("all-reduce",)),
    "attention/heads": lambda: attention_case((1, 8), {"heads": "model", "kv_heads": "model"}, 8, ()),
    "attention/data+heads": lambda: attention_case(
        (2, 4), {"batch": "data", "heads": "model", "kv_heads": "model"}, 4, ("all-reduce",)
    ),
    # one kv head read by every shard of heads: its gradient is summed over them
    "attention/data+heads (one kv head)": lambda: attention_case(
        (2, 4), {"batch": "data", "heads": "model"}, 1, ("all-reduce",)
    ),
    "moe/tokens": lambda: moe_case((8, 1), {"token": "data"}),
    # expert parallel: tokens and experts over `model`, exchanged by all_to_all across the processes
    "moe_ep/xla": lambda: moe_ep_case((1, 8), {"token": "model", "experts": "model"}),
}


def _place(value: NamedArray, mesh: Mesh, mapping: dict[str, str]) -> NamedArray:
    """`value` as a global array on `mesh`, its axes split as `mapping` says (the rest replicated);
    each process supplies the blocks of its own devices."""
    spec = PartitionSpec(*(mapping.get(a.name) for a in value.axes))
    data = np.asarray(value.array)
    array = jax.make_array_from_callback(data.shape, NamedSharding(mesh, spec), lambda index: data[index])
    return hax.named(array, value.axes)


def _compare(got, want, rtol, atol) -> str | None:
    """The first mismatch between the sharded run's local shards and the single-process values."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} outputs, the single-process run has {len(want_leaves)}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        w = np.asarray(w)
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape}, the single-process run has {w.shape}"
        for shard in g.addressable_shards:
            local, expected = np.asarray(shard.data), w[shard.index]
            if np.isnan(local).any():
                return f"output {i}: NaN in the shard at {shard.index}"
            try:
                np.testing.assert_allclose(local, expected, rtol=rtol, atol=atol)
            except AssertionError as e:
                return f"output {i}, shard {shard.index} on {shard.device}: {e}"
    return None


_references: dict[str, object] = {}


def _together(name: str, timeout_s: int = 300) -> None:
    """Wait until every process gets here. The first collective over a group of devices sets
    up a gloo context, which gives up when the processes arrive more than 30 s apart (one of
    them slowed down by a busy machine); the coordination service's barrier waits longer."""
    from jax._src import distributed  # the client whose barrier JAX's own multi-process tests use

    distributed.global_state.client.wait_at_barrier(name, timeout_s * 1000)


def run_case(name: str, case: Case) -> dict:
    argnums = tuple(range(len(case.diff)))
    step = jax.value_and_grad(case.fn, argnums=argnums, has_aux=True)
    t0 = time.perf_counter()
    want = _references.get(case.reference) if case.reference else None
    if want is None:
        with jax.default_device(jax.local_devices()[0]):
            want = jax.tree.map(np.asarray, jax.jit(step)(*case.diff, *case.const))
        if case.reference:
            _references[case.reference] = want
    t1 = time.perf_counter()
    mesh = Mesh(np.array(jax.devices()).reshape(case.mesh_shape), MESH_AXES)
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(case.mapping):
        args = [_place(a, mesh, case.mapping) for a in (*case.diff, *case.const)]
        lowered = jax.jit(step).lower(*args)
        compiled = lowered.compile()
        _together(name)
        got = compiled(*args)
        jax.block_until_ready(got)
    t2 = time.perf_counter()
    lowered_text, hlo = lowered.as_text(), compiled.as_text()
    manual = "manual_computation" in lowered_text or "shard_map" in lowered_text
    found = sorted(c for c in COLLECTIVES if c in hlo)
    problems = []
    mismatch = _compare(got, want, case.rtol, case.atol)
    if mismatch:
        problems.append(mismatch)
    missing = [c for c in case.collectives if c not in found]
    if missing:
        problems.append(f"no {', '.join(missing)} in the compiled HLO (it has {found or 'no collectives'})")
    return {
        "single_process_s": t1 - t0,
        "sharded_s": t2 - t1,
        "ok": not problems,
        "message": "; ".join(problems),
        "manual": manual,
        "collectives": found,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True, help="HOST:PORT of process 0")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--cases", help="comma-separated case names (default: all)")
    args = p.parse_args(argv)
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=60,
    )
    if jax.device_count() != GLOBAL_DEVICES:
        raise SystemExit(
            f"the cases need {GLOBAL_DEVICES} devices over all processes, found {jax.device_count()} "
            f"({jax.local_device_count()} here x {jax.process_count()} processes)"
        )
    names = args.cases.split(",") if args.cases else list(CASES)
    for name in names:
        start = time.perf_counter()
        try:
            result = run_case(name, CASES[name]())
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the case
            result = {
                "ok": False,
                "message": f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                "manual": False,
                "collectives": [],
            }
        result |= {"case": name, "process": jax.process_index(), "seconds": time.perf_counter() - start}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
