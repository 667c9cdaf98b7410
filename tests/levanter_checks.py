"""`axkern.levanter` against the real marin-levanter 0.2.227 on its own marin-haliax.

Run by tests/test_levanter.py inside the environment tests/levanter_env.py builds (Levanter's
model modules import there with tests/levanter_standins.py); not collected elsewhere. Values and
gradients of each drop-in against Levanter's function on the same inputs (float32, CPU), where
Levanter raises the drop-in raises, `patch()` reaches every module that imports the originals,
and a Levanter model trained a few steps with `patch()` matches Levanter's own run. The largest
differences are written to `$TEST_LEVANTER_FIGURES` (JSON).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os

import equinox as eqx
import haliax as hax
import haliax.partitioning
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from levanter.kernels.pallas.fused_cross_entropy_loss import (
    fused_cross_entropy_loss_and_logsumexp_penalty as levanter_ce,
)
from levanter.kernels.triton.short_conv.api import short_conv as levanter_short_conv
from levanter.layers.attention import AttentionMask
from levanter.layers.attention import dot_product_attention as levanter_attention
from levanter.models.loss import maybe_fused_next_token_loss as levanter_next_token_loss

import axkern
from axkern import levanter as axl
from tests.helpers import ce_inputs

# max |axkern - levanter| / max |levanter| per comparison (absolute for the training losses)
FIGURES: dict[str, float] = {}


@pytest.fixture(autouse=True, scope="module")
def _write_figures():
    yield
    path = os.environ.get("TEST_LEVANTER_FIGURES")
    if path:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=1, sort_keys=True)


def close(name, got, want, rtol):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, f"{name}[{i}]: shape {g.shape} != {w.shape}"
        err = np.abs(g - w).max(initial=0.0) / max(np.abs(w).max(initial=0.0), 1e-30)
        FIGURES[f"{name}[{i}]"] = max(FIGURES.get(f"{name}[{i}]", 0.0), float(err))
        assert err <= rtol, f"{name}[{i}]: relative error {err:.2e} > {rtol:.0e}"


def test_haliax_here_is_marin_haliax():
    dist = importlib.metadata.distribution("marin-haliax")
    assert any(str(f) == "haliax/__init__.py" for f in dist.files)
    assert hasattr(haliax.partitioning, "shard_map")
    assert axl.AttentionMask is AttentionMask  # Levanter's own class where Levanter imports


# -- the kernel-level cross-entropy ------------------------------------------------------------------

CE_CASES = {
    "mean": dict(reduction="mean"),
    "sum z-loss cap": dict(reduction="sum", logsumexp_weight=1e-2, logit_soft_cap=3.0),
    "per-token": dict(reduction=None),
    "weighted mean": dict(reduction="mean", weight="random"),
    "scalar weight mean": dict(reduction="mean", weight="scalar"),
    "argmax": dict(reduction="mean", return_argmax=True),
    "block_size": dict(reduction="sum", block_size=128),
    "labels outside, weight 0": dict(reduction="mean", weight="zero at the bad labels", bad_labels=True),
    "labels outside, per-token": dict(reduction=None, bad_labels=True),
    "labels outside, mean": dict(reduction="mean", bad_labels=True),
}


@pytest.mark.parametrize("case", list(CE_CASES))
def test_fused_cross_entropy_kernel_matches(case):
    n, v = 37, 301
    x, w, labels = ce_inputs(jax.random.PRNGKey(0), n, 24, v, jnp.float32)
    opts = dict(CE_CASES[case])
    if opts.pop("bad_labels", False):
        labels = labels.at[jnp.array([2, 11, 30, 31])].set(jnp.array([-100, v, v + 3, -1000]))
    if opts.get("weight") == "random":
        opts["weight"] = jax.random.uniform(jax.random.PRNGKey(1), (n,))
    elif opts.get("weight") == "scalar":
        opts["weight"] = jnp.float32(0.5)
    elif opts.get("weight") == "zero at the bad labels":
        opts["weight"] = jnp.ones(n).at[jnp.array([2, 11, 30])].set(0.0)
    argmax = opts.get("return_argmax", False)

    def value_and_grads(fn):
        def f(x, w):
            out = fn(x, labels, w, implementation="xla", **opts)
            loss = out[0] if argmax else out
            return jnp.sum(loss * jnp.linspace(0.5, 1.5, loss.size).reshape(loss.shape)), out

        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w)
        return out, grads

    got, want = (
        value_and_grads(axl.fused_cross_entropy_loss_and_logsumexp_penalty),
        value_and_grads(levanter_ce),
    )
    if argmax:
        np.testing.assert_array_equal(got[0][1], want[0][1])
        got, want = (got[0][0], got[1]), (want[0][0], want[1])
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(got))
    close(f"fused CE kernel {case}", got, want, 1e-5)


@pytest.mark.parametrize(
    "implementation", ["pallas_tpu", "batched_xla", ["batched_xla"], ("pallas_tpu", "batched_xla")]
)
def test_kernels_of_another_platform_raise_as_in_levanter(implementation):
    x, w, labels = ce_inputs(jax.random.PRNGKey(0), 8, 8, 16, jnp.float32)
    with pytest.raises(Exception) as theirs:
        levanter_ce(x, labels, w, implementation=implementation)
    with pytest.raises(NotImplementedError, match="implementation=.* cannot run here"):
        axl.fused_cross_entropy_loss_and_logsumexp_penalty(x, labels, w, implementation=implementation)
    assert isinstance(theirs.value, (NotImplementedError, ExceptionGroup))


def test_a_kernel_of_another_platform_is_skipped_in_a_sequence_as_in_levanter():
    x, w, labels = ce_inputs(jax.random.PRNGKey(0), 8, 8, 16, jnp.float32)
    order = ["pallas_tpu", "batched_xla", "xla"]
    close(
        "fused CE in a sequence",
        axl.fused_cross_entropy_loss_and_logsumexp_penalty(x, labels, w, implementation=order),
        levanter_ce(x, labels, w, implementation=order),
        1e-6,
    )


def test_bench_times_levanter_beside_the_reduced_loss():
    # `axkern bench fused_cross_entropy_loss --peers`: Levanter's kernel is a row of the same
    # case, run in this process, its loss and gradients checked against `reference`
    from axkern.bench import cases_for, measure

    case = cases_for("fused_cross_entropy_loss")[0]
    rows = measure(case, ["xla", "peer:levanter"], repeats=1)
    peer = [r for r in rows if r.implementation == "peer:levanter"]
    assert [r.pass_ for r in peer] == ["fwd", "fwd+bwd"]
    assert all(r.ms > 0 and r.max_rel_error < 1e-4 and not r.note for r in peer), peer


# -- the named losses ----------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
def test_maybe_fused_next_token_loss_matches(weighted):
    Batch, Pos, Embed, Vocab = (
        hax.Axis("batch", 2),
        hax.Axis("position", 9),
        hax.Axis("embed", 16),
        hax.Axis("vocab", 53),
    )
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(2), 4)
    h = hax.random.normal(k1, (Batch, Pos, Embed))
    head = hax.random.normal(k2, (Embed, Vocab)) * 0.3
    ids = hax.random.randint(k3, (Batch, Pos), 0, Vocab.size)
    weight = hax.random.uniform(k4, (Batch, Pos)) if weighted else None

    def run(fn, reduction):
        def f(h, head):
            out = fn(
                Pos,
                Embed,
                Vocab,
                h,
                head,
                ids,
                loss_weight=weight,
                reduction=reduction,
                logsumexp_weight=1e-3,
            )
            return out.array

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, head)

    close(
        f"maybe_fused_next_token_loss weighted={weighted}",
        run(axl.maybe_fused_next_token_loss, hax.mean),
        run(levanter_next_token_loss, hax.mean),
        1e-5,
    )
    per = axl.maybe_fused_next_token_loss(Pos, Embed, Vocab, h, head, ids, loss_weight=weight, reduction=None)
    want = levanter_next_token_loss(Pos, Embed, Vocab, h, head, ids, loss_weight=weight, reduction=None)
    assert per.axes == want.axes
    close(f"maybe_fused_next_token_loss per-token weighted={weighted}", per.array, want.array, 1e-5)


# -- attention -------------------------------------------------------------------------------------


def _attention_inputs(gqa: bool, v_size: int | None = None):
    Batch, Pos, KPos, Key = (
        hax.Axis("batch", 2),
        hax.Axis("position", 24),
        hax.Axis("key_position", 24),
        hax.Axis("head_size", 8),
    )
    KVHeads, Group = hax.Axis("kv_heads", 2), hax.Axis("q_heads_per_group", 2 if gqa else 1)
    VHead = Key if v_size is None else hax.Axis("v_size", v_size)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    q = hax.random.normal(k1, (Batch, Pos, KVHeads, Group, Key))
    k = hax.random.normal(k2, (Batch, KPos, KVHeads, Key))
    v = hax.random.normal(k3, (Batch, KPos, KVHeads, VHead))
    seg = hax.named(jnp.repeat(jnp.array([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]]), 4, axis=1), (Batch, Pos))
    return Pos, KPos, Key, q, k, v, seg


ATTN_CASES = [
    "causal",
    "sliding window",
    "segments",
    "soft cap + scale",
    "sink",
    "no mask",
    "offset",
    "bidirectional window",
    "value head v_size",
    "vanilla",
]


@pytest.mark.parametrize("case", ATTN_CASES)
def test_dot_product_attention_matches(case):
    Pos, KPos, Key, q, k, v, seg = _attention_inputs(
        gqa=True, v_size=6 if case == "value head v_size" else None
    )
    kwargs: dict = {}
    mask = AttentionMask.causal()
    if case == "sliding window":
        mask = AttentionMask.causal(sliding_window=5)
    elif case == "segments":
        mask = AttentionMask.causal().with_segment_ids(seg)
    elif case == "soft cap + scale":
        kwargs = dict(logits_soft_cap=2.0, scaling_factor=0.2)
    elif case == "sink":
        kwargs = dict(attn_sink=hax.named(jnp.array([[0.5, -0.3], [1.0, 0.0]]), (q.axes[2], q.axes[3])))
    elif case == "no mask":
        mask = None
    elif case == "offset":
        mask = AttentionMask.causal(offset=3)
    elif case == "bidirectional window":
        mask = AttentionMask.bidirectional_sliding_window(4).with_segment_ids(seg)
    elif case == "vanilla":
        kwargs = dict(use_flash=False)

    def run(fn):
        def f(q, k, v):
            out = fn(Pos, KPos, Key, q, k, v, mask=mask, **kwargs)
            return hax.sum(out * hax.cos(out)).scalar(), out

        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, grads

    got, want = run(axl.dot_product_attention), run(levanter_attention)
    assert got[0].axes == want[0].axes
    close(
        f"dot_product_attention {case}",
        (got[0].array, *[g.array for g in got[1]]),
        (want[0].array, *[g.array for g in want[1]]),
        1e-5,
    )


@pytest.mark.parametrize(
    "kwargs", [dict(use_flash=False, attn_backend="jax_flash"), dict(use_flash=True, attn_backend="vanilla")]
)
def test_conflicting_backend_arguments_raise_as_in_levanter(kwargs):
    Pos, KPos, Key, q, k, v, _ = _attention_inputs(gqa=False)
    with pytest.raises(ValueError) as theirs:
        levanter_attention(Pos, KPos, Key, q, k, v, **kwargs)
    with pytest.raises(ValueError) as ours:
        axl.dot_product_attention(Pos, KPos, Key, q, k, v, **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_a_requested_splash_off_a_tpu_raises_as_in_levanter():
    Pos, KPos, Key, q, k, v, _ = _attention_inputs(gqa=False)
    with pytest.raises(NotImplementedError):
        levanter_attention(Pos, KPos, Key, q, k, v, attn_backend="splash")
    with pytest.raises(NotImplementedError, match="attn_backend=splash needs a TPU"):
        axl.dot_product_attention(Pos, KPos, Key, q, k, v, attn_backend="splash")


@pytest.mark.parametrize("segments", [False, True])
def test_short_conv_matches(segments):
    k1, k2 = jax.random.split(jax.random.PRNGKey(4))
    x = jax.random.normal(k1, (2, 19, 12))
    w = jax.random.normal(k2, (4, 12)) * 0.5
    seg = jnp.repeat(jnp.array([[0, 1, 2, 3], [5, 5, 6, 6]]), 5, axis=1)[:, :19] if segments else None

    def run(fn):
        return jax.jit(jax.value_and_grad(lambda w, x: jnp.sum(jnp.sin(fn(w, x, seg))), argnums=(0, 1)))(w, x)

    close(f"short_conv segments={segments}", run(axl.short_conv), run(levanter_short_conv), 1e-5)


# -- patch() ---------------------------------------------------------------------------------------

IMPORTERS = [
    "levanter.models.gpt2",
    "levanter.models.whisper",
    "levanter.models.modernbert",
    "levanter.layers.flash_attention",
    "levanter.models.lm_model",
    "levanter.models.llama",
    "levanter.models.olmo3",
]


def test_patch_reaches_every_module_that_imports_the_originals():
    for name in IMPORTERS:
        importlib.import_module(name)
    originals = {
        "dot_product_attention": levanter_attention,
        "maybe_fused_next_token_loss": levanter_next_token_loss,
    }
    with axl.patch() as patched:
        for module, attr in [
            ("levanter.models.gpt2", "dot_product_attention"),
            ("levanter.models.whisper", "dot_product_attention"),
            ("levanter.models.modernbert", "dot_product_attention"),
            ("levanter.layers.flash_attention", "dot_product_attention"),
            ("levanter.layers.attention", "dot_product_attention"),
            ("levanter.models.lm_model", "maybe_fused_next_token_loss"),
            ("levanter.models.loss", "maybe_fused_next_token_loss"),
            ("levanter.models.loss", "fused_cross_entropy_loss_and_logsumexp_penalty_kernel"),
            (
                "levanter.kernels.pallas.fused_cross_entropy_loss",
                "fused_cross_entropy_loss_and_logsumexp_penalty",
            ),
        ]:
            assert f"{module}.{attr}" in patched.names, patched.names
            assert getattr(importlib.import_module(module), attr) is not originals.get(attr, levanter_ce)
        # a module imported under the patch takes the drop-in from the defining module
        grug = importlib.import_module("levanter.grug.loss")
        assert (
            grug.fused_cross_entropy_loss_and_logsumexp_penalty
            is axl.fused_cross_entropy_loss_and_logsumexp_penalty
        )
    restored = importlib.import_module("levanter.models.gpt2").dot_product_attention
    assert restored is levanter_attention
    assert grug.fused_cross_entropy_loss_and_logsumexp_penalty is levanter_ce
    assert axl.unpatch() == []


def _counting(monkeypatch, module, name):
    calls = []
    fn = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _train(config, Vocab, example, steps):
    """Levanter's model from `config`, `steps` of Adam on `example`'s next-token loss (as
    `train_lm` computes it): the losses, the first step's gradients and the final model."""
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: m.compute_next_token_loss(example).scalar())(model)
        updates, state = opt.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss, grads

    losses, first = [], None
    for _ in range(steps):
        model, state, loss, grads = step(model, state)
        losses.append(float(loss))
        first = grads if first is None else first
    return losses, eqx.filter(first, eqx.is_array), eqx.filter(model, eqx.is_array)


def test_a_levanter_model_trained_with_patch_matches_levanters_run(monkeypatch):
    from levanter.models.llama import LlamaConfig
    from levanter.models.lm_model import LmExample

    config = LlamaConfig(
        max_seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
    )
    Vocab, Batch, Pos = hax.Axis("vocab", 64), hax.Axis("batch", 2), config.max_Pos.resize(32)
    tokens = hax.random.randint(jax.random.PRNGKey(1), (Batch, Pos), 0, Vocab.size)
    seg = hax.named(jnp.repeat(jnp.array([[0, 1], [0, 0]]), 16, axis=1), (Batch, Pos))
    weight = hax.ones((Batch, Pos)) * (hax.arange(Pos) < Pos.size - 1)
    example = LmExample(
        tokens=tokens, loss_weight=weight, attn_mask=AttentionMask.causal().with_segment_ids(seg)
    )
    steps = 4
    theirs = _train(config, Vocab, example, steps)
    attention_calls = _counting(monkeypatch, axl.attention, "attention")
    loss_calls = _counting(monkeypatch, axl.loss, "fused_cross_entropy")
    with axl.patch():
        ours = _train(config, Vocab, example, steps)
    assert attention_calls and loss_calls  # the drop-ins ran
    FIGURES["training: max |loss difference| over steps"] = max(
        abs(a - b) for a, b in zip(ours[0], theirs[0], strict=True)
    )
    close("training: step-0 gradients", ours[1], theirs[1], 1e-4)
    close("training: parameters after the steps", ours[2], theirs[2], 1e-4)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    assert theirs[0][-1] < theirs[0][0]


def test_olmo3_sliding_window_with_patch_matches_levanter():
    # Olmo3's layers apply their window to Levanter's AttentionMask: axkern's mask is that class
    from levanter.models.olmo3 import Olmo3Config

    def logits(window):
        config = Olmo3Config(
            max_seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
            sliding_window=window, layer_types=["sliding_attention", "sliding_attention"],
        )  # fmt: skip
        Vocab, Pos = hax.Axis("vocab", 64), config.max_Pos.resize(32)
        model = config.build(Vocab, key=jax.random.PRNGKey(0))
        tokens = hax.random.randint(jax.random.PRNGKey(1), (Pos,), 0, Vocab.size)
        return eqx.filter_jit(lambda m: m(tokens, attn_mask=axl.AttentionMask.causal()))(model).array

    theirs = logits(6)
    with axl.patch():
        ours, unwindowed = logits(6), logits(32)
    close("olmo3 window 6: logits", ours, theirs, 1e-5)
    assert np.abs(ours - unwindowed).max() > 1e-2  # the window changes the logits


# -- the peers the benchmarks time -------------------------------------------------------------------


def test_mamba3_with_zero_angles_matches_levanters_xla_path():
    from axkern.ops.mamba3.arg_specs import levanter_forward

    b, length, h, p, n, chunk, groups = 2, 32, 4, 8, 8, 8, 2
    k = jax.random.split(jax.random.PRNGKey(5), 8)
    diff = (
        jax.random.normal(k[0], (b, length, groups, n)),
        jax.random.normal(k[1], (b, length, groups, n)),
        jax.random.normal(k[2], (b, length, h, p)),
        -jax.nn.softplus(jax.random.normal(k[3], (b, h, length))),
        jax.nn.softplus(jax.random.normal(k[4], (b, h, length)) - 1),
        jax.random.normal(k[5], (b, h, length)),
        1 + 0.1 * jax.random.normal(k[6], (h, n)),
        1 + 0.1 * jax.random.normal(k[7], (h, n)),
    )
    zero_angles = jnp.zeros((b, length, h, 2))

    def run(fn):
        cot = jnp.cos(jnp.arange(b * length * h * p, dtype=jnp.float32)).reshape(b, length, h, p)
        return jax.jit(jax.value_and_grad(lambda a: jnp.sum(fn(*a) * cot)))(diff)

    ours = run(lambda *a: axkern.positional.mamba3(*a, zero_angles, implementation="reference"))
    theirs = run(lambda *a: levanter_forward(*a, chunk_size=chunk))
    close("mamba3", ours, theirs, 1e-4)


def test_ssd_matches_levanters_chunked_xla_path():
    from axkern.ops.ssd.arg_specs import levanter_forward

    b, length, h, p, n, chunk, groups = 2, 32, 4, 8, 8, 8, 2
    k = jax.random.split(jax.random.PRNGKey(6), 5)
    diff = (
        jax.random.normal(k[0], (b, length, h, p)),
        jax.nn.softplus(jax.random.normal(k[1], (b, length, h))),
        -jnp.exp(jax.random.normal(k[2], (h,))),
        jax.random.normal(k[3], (b, length, groups, n)),
        jax.random.normal(k[4], (b, length, groups, n)),
    )

    def run(fn):
        cot = jnp.cos(jnp.arange(b * length * h * p, dtype=jnp.float32)).reshape(b, length, h, p)
        return jax.jit(jax.value_and_grad(lambda a: jnp.sum(fn(*a) * cot)))(diff)

    ours = run(lambda *a: axkern.positional.ssd(*a, implementation="reference"))
    theirs = run(lambda *a: levanter_forward(*a, chunk_size=chunk))
    close("ssd", ours, theirs, 1e-4)


@pytest.mark.parametrize("rank", [0, 2])
def test_mamba3_against_levanters_direct_recurrence(rank):
    # Levanter's Mamba-3 oracles (real-valued: no angles, no biases) on shared inputs, SISO and
    # MIMO of rank 2
    from levanter.kernels.pallas.mamba3 import reference as lev3

    from axkern.positional import mamba3

    H, K, C, P, N = 3, 4, 8, 5, 6
    k = jax.random.split(jax.random.PRNGKey(0), 12)
    dt = jax.nn.softplus(jax.random.normal(k[0], (H, K, C)))
    lam = jax.nn.sigmoid(jax.random.normal(k[1], (H, K, C)))
    A = jnp.broadcast_to(-jnp.exp(jax.random.normal(k[2], (H,)))[:, None, None], dt.shape)
    x = jax.random.normal(k[5], (H, K, C, P))
    flat = lambda a: jnp.moveaxis(a.reshape(H, K * C, *a.shape[3:]), 0, 1)[None]  # noqa: E731 - [1, L, H, ..]
    scalars = lambda a: a.reshape(1, H, K * C)  # noqa: E731
    args = (flat(x), scalars(A * dt), scalars(dt), scalars(jnp.log(lam / (1 - lam))))
    no_angles = jnp.zeros((1, K * C, H, 0))
    if not rank:
        b, c = jax.random.normal(k[3], (H, K, C, N)), jax.random.normal(k[4], (H, K, C, N))
        y_lev, h_lev = lev3.mamba3_direct_recurrence_reference_batched(dt, lam, A, b, c, x)
        zeros = jnp.zeros((H, N))
        y, final = mamba3(flat(c), flat(b), *args, zeros, zeros, no_angles, return_final_state=True)
    else:
        b, c = (jax.random.normal(k[i], (H, K, C, N, rank)) for i in (6, 7))
        w_x, w_z, w_o = (jax.random.normal(k[i], (H, P, rank)) for i in (8, 9, 10))
        z = jax.random.normal(k[11], (H, K, C, P))
        y_lev, h_lev = lev3.mamba3_mimo_direct_recurrence_reference_batched(
            dt, lam, A, b, c, x, z, w_x, w_z, w_o
        )
        by_rank = lambda a: jnp.moveaxis(flat(a), -1, 2)  # noqa: E731 - [1, L, R, H, N]
        zeros = jnp.zeros((H, rank, N))
        mimo = tuple(jnp.swapaxes(w, 1, 2) for w in (w_x, w_z, w_o))
        y, final = mamba3(
            by_rank(c),
            by_rank(b),
            *args,
            zeros,
            zeros,
            no_angles,
            z=flat(z),
            mimo=mimo,
            return_final_state=True,
        )
    np.testing.assert_allclose(y, flat(y_lev), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final.ssm[0], h_lev, rtol=1e-4, atol=1e-4)
