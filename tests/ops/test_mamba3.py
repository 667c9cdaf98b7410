"""mamba3: the chunked xla implementation against the sequential float64 oracle (outputs, final
states and every gradient, SISO and MIMO), decode steps against the scan, the named layer and
the refused inputs. Each oracle check compiles three programs, so the cases are pairwise: every
value of (dtype, groups, SISO/MIMO) once, both with states, segments, `D` and `z`."""

from __future__ import annotations

import functools

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern.positional import mamba3, mamba3_step
from tests.cases.mamba3 import STATE, call, forward, make, run
from tests.harness import check_rule, jit
from tests.helpers import to64, x64


def check(seed, dims, dtype, chunk, **kw):
    arrays, seg = make(seed, *dims, dtype, **kw)
    check_rule(
        lambda name, a, **k: run(name, a, seg, chunk if name != "reference" else None),
        "xla",
        arrays,
        dtype,
        "mamba3",
    )


@pytest.mark.parametrize(
    "dtype,groups,rank",
    [("float32", 2, 0), ("bfloat16", 1, 2)],
    ids=["siso-float32-groups2", "mimo2-bfloat16-groups1"],
)
def test_against_sequential_oracle(dtype, groups, rank):
    # length 37 over chunks of 8: a padded last chunk; state 6 with 2 angles (dims 4, 5 unrotated)
    check(0, (2, 37, 4, 3, groups, 6, 2, rank), dtype, 8)


def test_explain_names_xla_and_its_chunked_backward():
    arrays, _ = make(0, 1, 16, 2, 4, 1, 4, 0, 0, "float32", extras=False)  # no angles: no rotation
    decision = axkern.explain(lambda a: call(None, a), arrays)
    assert decision.implementation == "xla" and decision.block_sizes.chunk_size == 16
    assert "custom_vjp" in decision.backward


@pytest.mark.parametrize("rank", [0, 2])
def test_decode_steps_chained_equal_the_scan(rank):
    arrays, _ = make(1, 2, 6, 4, 3, 2, 6, 2, rank, "float32", segments=False)
    y, final = forward("xla", arrays, None, 4)
    state = tuple(arrays[s] for s in STATE)
    mimo = tuple(arrays[w] for w in ("W_x", "W_z", "W_o")) if rank else None
    step = jit(mamba3_step)
    for t in range(6):
        y_t, state = step(
            arrays["q"][:, t],
            arrays["k"][:, t],
            arrays["v"][:, t],
            arrays["adt"][..., t],
            arrays["dt"][..., t],
            arrays["trap"][..., t],
            arrays["q_bias"],
            arrays["k_bias"],
            arrays["angles"][:, t],
            state,
            D=arrays["D"],
            z_t=arrays["z"][:, t],
            mimo=mimo,
        )
        np.testing.assert_allclose(y_t, y[:, t], rtol=1e-4, atol=1e-4)
    for got, want in zip(state, final, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl,rank", [("xla", 0), ("xla", 2), ("reference", 0)])
def test_decode_steps_gradients_equal_the_oracle_layers(impl, rank):
    # every gradient through five chained steps, the initial state's among them, against the
    # float64 sequential layer's (the oracle) over the same positions, of the same loss
    arrays, _ = make(4, 2, 5, 4, 3, 2, 6, 2, rank, "float32", segments=False)
    names = sorted(arrays)

    def loss(y, state):  # [b, l, h, p] and the final state
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))) + sum(
            jnp.sum(jnp.sin(s)) for s in state
        )

    def layer(*vals):
        return loss(*call("reference", dict(zip(names, vals, strict=True))))

    def steps(*vals):
        a = dict(zip(names, vals, strict=True))
        state = tuple(a[s] for s in STATE)
        mimo = tuple(a[w] for w in ("W_x", "W_z", "W_o")) if rank else None
        ys = []
        for t in range(5):
            y_t, state = mamba3_step(
                *(a[n][:, t] for n in ("q", "k", "v")),
                *(a[n][..., t] for n in ("adt", "dt", "trap")),
                a["q_bias"],
                a["k_bias"],
                a["angles"][:, t],
                state,
                D=a["D"],
                z_t=a["z"][:, t],
                mimo=mimo,
                implementation=impl,
            )
            ys.append(y_t)
        return loss(jnp.stack(ys, axis=1), state)

    with x64():
        a64 = {n: jnp.asarray(v, jnp.float64) for n, v in to64(arrays).items()}
        got, want = (
            jax.jit(jax.grad(f, argnums=tuple(range(len(names)))))(*(a64[n] for n in names))
            for f in (steps, layer)
        )
    for name, g, w in zip(names, got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9, err_msg=name)


def test_a_segment_starts_from_a_zero_state():
    # the second segment of a sequence equals that segment run on its own
    arrays, _ = make(2, 1, 20, 2, 3, 1, 4, 2, 0, "float32", segments=False)
    seg = jnp.asarray([[0] * 9 + [1] * 11], jnp.int32)
    y, final = forward("xla", arrays, seg, 8)
    tail = {
        name: (a[..., 9:] if name in ("adt", "dt", "trap") else a[:, 9:])
        if a.ndim >= 3 and a.shape[0] == 1
        else a
        for name, a in arrays.items()
        if name not in STATE
    }
    y2, final2 = forward("xla", tail, None, 8)
    np.testing.assert_allclose(y[:, 9:], y2, rtol=1e-5, atol=1e-5)
    for a, b in zip(final, final2, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_naming_the_sizes():
    arrays, _ = make(3, 1, 8, 3, 4, 1, 8, 2, 0, "float32", extras=False)
    args = [arrays[k] for k in ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles")]
    two_groups = jnp.ones((1, 8, 2, 8))
    with pytest.raises(ValueError, match="heads=3 is not divisible by groups=2"):
        mamba3(two_groups, two_groups, *args[2:])
    with pytest.raises(ValueError, match=r"n_angles=5 is more than state/2 = 4"):
        mamba3(*args[:8], jnp.ones((1, 8, 3, 5)))
    odd = jnp.ones((1, 8, 1, 7))
    with pytest.raises(ValueError, match="n_angles=2 rotates pairs of state dims, but state=7 is odd"):
        mamba3(odd, odd, *args[2:6], jnp.ones((3, 7)), jnp.ones((3, 7)), args[8])
    with pytest.raises(ValueError, match="head_dim must be at least 1"):
        mamba3(*args[:2], args[2][..., :0], *args[3:])
    with pytest.raises(ValueError, match="chunk_size must be a power of two, got 12"):
        mamba3(*args, chunk_size=12)
    # MIMO: weights of another rank than q's
    m, _ = make(3, 1, 8, 3, 4, 1, 8, 2, 2, "float32", extras=False)
    margs = [m[k] for k in ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles")]
    w3 = jnp.ones((3, 3, 4))
    with pytest.raises(ValueError, match=r"W_x has shape \(3, 3, 4\), expected .* = \(3, 2, 4\)"):
        mamba3(*margs, mimo=(w3, m["W_z"], m["W_o"]))
    with pytest.raises(ValueError, match="with mimo, q and k carry a rank axis"):
        mamba3(*args, mimo=(m["W_x"], m["W_z"], m["W_o"]))
    with pytest.raises(ValueError, match="initial_state must hold all four"):
        mamba3(*args, initial_state=(None, jnp.zeros((1, 3, 4, 8)), None, None))
    with pytest.raises(ValueError, match="initial_state.ssm has shape"):
        state = (jnp.zeros((1, 3, 2)), jnp.zeros((1, 3, 4, 4)), jnp.zeros((1, 3, 8)), jnp.zeros((1, 3, 4)))
        mamba3(*args, initial_state=state)


def test_empty_axes_give_empty_results_and_pass_the_state_through():
    arrays, _ = make(4, 1, 8, 2, 3, 1, 4, 1, 0, "float32")
    short = {
        n: (a[..., :0] if n in ("adt", "dt", "trap") else a[:, :0]) if n not in STATE and a.ndim >= 3 else a
        for n, a in arrays.items()
    }
    y, final = call("xla", short)
    assert y.shape == (1, 0, 2, 3)
    for name, a in zip(STATE, final, strict=True):
        np.testing.assert_array_equal(a, arrays[name])


@pytest.mark.parametrize("rank", [0, 2])
def test_named_layer_equals_the_positional_one(rank):
    arrays, seg = make(5, 2, 12, 4, 3, 2, 6, 2, rank, "float32")
    Batch, Pos, Heads, HeadDim = (
        hax.Axis(n, s) for n, s in (("batch", 2), ("position", 12), ("heads", 4), ("head_size", 3))
    )
    Groups, State, Angles, Rank = (
        hax.Axis("groups", 2),
        hax.Axis("state", 6),
        hax.Axis("angles", 2),
        hax.Axis("rank", rank),
    )
    r = (Rank,) if rank else ()
    n = lambda name, axes: hax.named(arrays[name], axes)  # noqa: E731
    qk = (Batch, Pos, *r, Groups, State)
    state = axkern.Mamba3State(
        n("angle_state", (Batch, Heads, Angles)),
        n("ssm_state", (Batch, Heads, HeadDim, State)),
        n("k_state", (Batch, *r, Heads, State)),
        n("v_state", (Batch, Heads, HeadDim)),
    )
    mimo = tuple(n(w, (Heads, Rank, HeadDim)) for w in ("W_x", "W_z", "W_o")) if rank else None
    v = n("v", (Batch, Pos, Heads, HeadDim)).rearrange((Heads, Batch, HeadDim, Pos))
    y, final = jax.jit(axkern.mamba3, static_argnames=("return_final_state", "chunk_size"))(
        n("q", qk), n("k", qk), v,
        n("adt", (Batch, Heads, Pos)), n("dt", (Batch, Heads, Pos)), n("trap", (Batch, Heads, Pos)),
        n("q_bias", (Heads, *r, State)), n("k_bias", (Heads, *r, State)), n("angles", (Batch, Pos, Heads, Angles)),
        D=n("D", (Heads,)), z=n("z", (Batch, Pos, Heads, HeadDim)), segment_ids=hax.named(seg, (Batch, Pos)),
        initial_state=state, mimo=mimo, return_final_state=True, chunk_size=4,
    )  # fmt: skip
    assert y.axes == v.axes and final.ssm.axes == (Batch, Heads, HeadDim, State)
    want_y, want_final = forward("xla", arrays, seg, 4)
    np.testing.assert_allclose(y.rearrange((Batch, Pos, Heads, HeadDim)).array, want_y, rtol=1e-5, atol=1e-5)
    for got, want in zip(final, want_final, strict=True):
        np.testing.assert_allclose(got.array, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"q has no axis 'grp' \(Groups\)"):
        axkern.mamba3(n("q", qk), n("k", qk), v, *(n(a, (Batch, Heads, Pos)) for a in ("adt", "dt", "trap")),
                      n("q_bias", (Heads, *r, State)), n("k_bias", (Heads, *r, State)),
                      n("angles", (Batch, Pos, Heads, Angles)), Groups="grp", mimo=mimo)  # fmt: skip


def test_sharded_equals_unsharded():
    # batch data parallel over "data"; a Pos mapped to "model" is gathered (no sequence parallel rule)
    from jax.sharding import Mesh

    arrays, seg = make(6, 2, 16, 4, 3, 2, 6, 2, 0, "float32")
    Batch, Pos, Heads, HeadDim = (
        hax.Axis(n, s) for n, s in (("batch", 2), ("position", 16), ("heads", 4), ("head_size", 3))
    )
    Groups, State, Angles = hax.Axis("groups", 2), hax.Axis("state", 6), hax.Axis("angles", 2)
    n = lambda name, axes: hax.named(arrays[name], axes)  # noqa: E731
    qk = (Batch, Pos, Groups, State)
    state = axkern.Mamba3State(
        n("angle_state", (Batch, Heads, Angles)),
        n("ssm_state", (Batch, Heads, HeadDim, State)),
        n("k_state", (Batch, Heads, State)),
        n("v_state", (Batch, Heads, HeadDim)),
    )
    rest = (n("adt", (Batch, Heads, Pos)), n("dt", (Batch, Heads, Pos)), n("trap", (Batch, Heads, Pos)),
            n("q_bias", (Heads, State)), n("k_bias", (Heads, State)), n("angles", (Batch, Pos, Heads, Angles)))  # fmt: skip

    def f(q, k, v, s0):
        y, final = axkern.mamba3(q, k, v, *rest, segment_ids=hax.named(seg, (Batch, Pos)), initial_state=s0,
                                 D=n("D", (Heads,)), return_final_state=True, chunk_size=8)  # fmt: skip
        return hax.sum(y * y).array + sum(hax.sum(s).array for s in final), (y, final)

    args = (n("q", qk), n("k", qk), n("v", (Batch, Pos, Heads, HeadDim)), state)
    want = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": "data", "position": "model"}):
        fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))
        got = fn(*args)
        text = fn.lower(*args).as_text()
        assert "manual_computation" in text or "shard_map" in text
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)


def test_the_chunk_scan_backward_keeps_only_inputs_and_chunk_states():
    # `scan_recompute` (xla's chunk scan) saves its inputs and the state entering each chunk;
    # autodiff through `scan` keeps each chunk's [Q, Q] terms as well
    from jax._src.ad_checkpoint import saved_residuals

    from axkern.ops.chunked import scan

    b, l, r, h, p, n, q = 1, 64, 2, 2, 4, 4, 32
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    x, B, C = (jax.random.normal(k[i], (b, l, r, h, d)) for i, d in ((0, p), (1, n), (2, n)))
    a, s = -jax.nn.softplus(jax.random.normal(k[3], (b, l, h))), jax.random.uniform(k[4], (b, l, h))
    seg, init = jnp.zeros((b, l), jnp.int32), jnp.zeros((b, h, p, n))
    kw = dict(chunk_size=q, precision=None, sums=False)

    def saved(fn):
        loss = lambda *args: jnp.sum(fn(*args, seg, init, **kw)[0])  # noqa: E731
        return sum(aval.size for aval, _ in saved_residuals(loss, x, a, s, B, C))

    inputs = x.size + B.size + C.size + a.size + s.size + seg.size + (l // q) * h * p * n  # + chunk states
    assert saved(scan.scan_recompute) <= inputs < saved(scan.scan) / 2


def test_vmapped_over_a_finite_and_a_non_finite_input_equals_each_call():
    # the guard's masks sit under a `lax.cond` on the inputs (finite, far from overflow); under
    # `vmap` the condition is batched (both branches run, a select picks): each element still
    # gets its own rule
    from tests.helpers import assert_nonfinite_rule, poke

    finite, _ = make(3, 1, 24, 2, 16, 2, 16, 2, 0, "float32", segments=False)
    nan = dict(finite, v=poke(finite["v"], (0, 9, 1, 3), np.nan))

    def loss(impl, a):
        y, final = call(impl, a, None, None if impl == "reference" else 8)
        cot = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
        return jnp.sum(y * cot) + sum(jnp.sum(s) for s in final), (y, tuple(final))

    grad = lambda impl: jax.grad(lambda a: loss(impl, a), has_aux=True)  # noqa: E731
    got = jax.jit(jax.vmap(grad("xla")))(jax.tree.map(lambda *x: jnp.stack(x), finite, nan))
    reference, xla = jax.jit(grad("reference")), jax.jit(grad("xla"))  # compiled once for both
    for i, a in enumerate((finite, nan)):
        grads, outputs = jax.tree.map(lambda x, i=i: x[i], got)
        assert_nonfinite_rule(outputs, reference(a)[1], f"outputs {i}")
        assert_nonfinite_rule(grads, xla(a)[0], f"gradients {i}")
    y = np.asarray(got[1][0])
    assert np.isfinite(y[0]).all() and not np.isfinite(y[1, 0, 9:, 1, 3]).any()


@pytest.mark.parametrize("heads_first", [False, True], ids=["tokens_first", "heads_first"])
@pytest.mark.parametrize("halves", [False, True], ids=["pairs", "halves"])
def test_the_rotations_backward_equals_autodiff(halves, heads_first):
    # `common.rotation.rotated` turns the cotangent back by -theta instead of keeping autodiff's pieces;
    # heads first (the kernels' layout) as the kernel implementations call it
    import importlib

    rotation = importlib.import_module("axkern.ops.mamba3.common.rotation")
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    u = jax.random.normal(k[0], (2, 5, 3, 2, 12))  # [b, l, r, g, n]
    bias = jax.random.normal(k[1], (3, 4, 12))  # [r, h, n]
    theta = 3 * jax.random.normal(k[2], (2, 5, 1, 4, 5))  # [b, l, 1, h, a]: 5 of the 6 pairs
    cot = jax.random.normal(k[3], (2, 5, 3, 4, 12))
    axis = 3
    if heads_first:  # u [b, g, l, r, n], bias [h, 1, r, n], theta [b, h, l, 1, a]
        u, theta, cot = (jnp.transpose(a, (0, 3, 1, 2, 4)) for a in (u, theta, cot))
        bias, axis = jnp.swapaxes(bias, 0, 1)[:, None], 1

    def autodiff(u, bias, theta):
        return rotation.rotate(jnp.repeat(u, 2, axis=axis) + bias, theta, halves)

    def loss(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2))(u, bias, theta)

    ours = functools.partial(rotation.rotated, halves, 2, axis, None)
    np.testing.assert_array_equal(ours(u, bias, theta), autodiff(u, bias, theta))
    for got, want in zip(loss(ours), loss(autodiff), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [1, 3])
def test_the_corrections_pair_products_are_the_rotated_vectors_dot_products(rank):
    # `common.rotation.pair_products` takes the unrotated q, k and biases: a rotation by the same angles
    # keeps the dot products; its backward expands them into matrix products
    import importlib

    rotation = importlib.import_module("axkern.ops.mamba3.common.rotation")
    k = jax.random.split(jax.random.PRNGKey(1), 6)
    b, l, g, n, h = 2, 5, 2, 12, 4
    q, kk = (jax.random.normal(k[i], (b, l, rank, g, n)) for i in (0, 1))  # [b, l, r, g, n]
    bq, bk = (jax.random.normal(k[i], (rank, h, n)) for i in (2, 3))  # [r, h, n]
    theta = 3 * jax.random.normal(k[4], (b, l, 1, h, 5))  # [b, l, 1, h, a]: 5 of the 6 pairs
    cot = jax.random.normal(k[5], (b, l, rank, rank, h))

    def rotated_dots(q, kk, bq, bk):
        qr, kr = (
            rotation.rotate(jnp.repeat(u, h // g, axis=3) + w, theta, rank > 1)
            for u, w in ((q, bq), (kk, bk))
        )
        return jnp.einsum("blrhn,bluhn->blruh", qr, kr, precision="highest")

    def loss(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2, 3))(q, kk, bq, bk)

    np.testing.assert_allclose(
        rotation.pair_products(q, kk, bq, bk), rotated_dots(q, kk, bq, bk), rtol=1e-5, atol=1e-4
    )
    for got, want in zip(loss(rotation.pair_products), loss(rotated_dots), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("heads_major", [False, True])
def test_the_rank_products_are_every_pair_of_ranks_dot_products(heads_major):
    # `common.rotation.rank_products` (MIMO's correction): `[b, l, r, u, h]` from either layout of the
    # rotated vectors, equal to the dot products written out, values and gradients
    import importlib

    rotation = importlib.import_module("axkern.ops.mamba3.common.rotation")
    k = jax.random.split(jax.random.PRNGKey(2), 3)
    b, l, r, h, n = 2, 5, 3, 4, 6
    qc, kc = (jax.random.normal(k[i], (b, l, r, h, n)) for i in (0, 1))  # [b, l, r, h, n]
    cot = jax.random.normal(k[2], (b, l, r, r, h))
    to_layout = (lambda u: jnp.transpose(u, (0, 3, 1, 2, 4))) if heads_major else (lambda u: u)

    def written_out(qc, kc):
        return jnp.stack(
            [jnp.stack([jnp.sum(qc[:, :, i] * kc[:, :, j], axis=-1) for j in range(r)], 2) for i in range(r)],
            2,
        )

    got_fn = lambda qc, kc: rotation.rank_products(to_layout(qc), to_layout(kc), heads_major)  # noqa: E731
    np.testing.assert_allclose(got_fn(qc, kc), written_out(qc, kc), rtol=1e-6, atol=1e-6)
    assert got_fn(qc, kc)[0, 1, 2, 0, 3] != got_fn(qc, kc)[0, 1, 0, 2, 3]  # (r, u) is not symmetric

    def grads(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1))(qc, kc)

    for got, want in zip(grads(got_fn), grads(written_out), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
