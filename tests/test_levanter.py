"""`axkern.levanter` against the real Levanter functions (marin-levanter 0.2.227), values and gradients.

Levanter's wheel needs Python >= 3.12, so it is unzipped (not installed) from `../shared/wheels/peers/levanter/`
beside the repository, with `../shared/peers/levanter_stubs/` and the three small wheels there on `sys.path`.
Two gaps of this environment are bridged for the import only: draccus imports `typing_inspect` (absent
here; an empty stand-in module, none of its functions run in these tests), and Levanter's attention and loss
modules import `haliax.partitioning.shard_map` and call `maybe_reduce_loss(..., weight=)`, both newer than
the haliax installed here: a stand-in `shard_map` that raises (no test runs under a mesh) and haliax's newer
weighted `maybe_reduce_loss`. The module skips, saying why, when the wheel is absent or fails to import.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import haliax as hax
import haliax.nn.loss as hax_loss
import haliax.partitioning as hax_partitioning
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import levanter as axl
from tests.helpers import ce_inputs

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
WHEELS = SHARED / "wheels" / "peers" / "levanter"

# max |axkern - levanter| / max |levanter| per comparison, printed at the end of the module
FIGURES: dict[str, float] = {}


def _weighted_maybe_reduce_loss(arr, reduction, reduction_axis, where, weight=None):
    """haliax's newer `maybe_reduce_loss` (with `weight`), which Levanter 0.2.227 calls."""
    w = weight
    if where is not None:
        mask = where.astype(w.dtype if w is not None else arr.dtype)
        w = mask if w is None else w * mask
    if w is not None:
        w = hax.broadcast_axis(w, arr.axes).astype(arr.dtype)
    if reduction is not None and reduction_axis != ():
        if w is None:
            return reduction(arr, axis=reduction_axis)
        weighted = arr * w
        if reduction is hax.mean or reduction is jnp.mean:
            num, den = hax.sum(weighted, axis=reduction_axis), hax.sum(w, axis=reduction_axis)
            return hax.where(den != 0, num / den, hax.zeros_like(num))
        return reduction(weighted, axis=reduction_axis)
    return arr if w is None else arr * w


@pytest.fixture(scope="module")
def lev(tmp_path_factory):
    wheel = sorted(WHEELS.glob("marin_levanter-*.whl")) if WHEELS.is_dir() else []
    if not wheel:
        pytest.skip(f"Levanter's wheel is not at {WHEELS} (the shared folder beside the repository)")
    root = tmp_path_factory.mktemp("levanter")
    for w in [wheel[-1], *sorted(WHEELS.glob("*.whl"))]:
        with zipfile.ZipFile(w) as z:
            z.extractall(root)
    (root / "typing_inspect.py").write_text('"""Import-time stand-in: draccus imports it."""\n')
    added = [str(root), str(SHARED / "peers" / "levanter_stubs")]
    sys.path[:0] = added
    saved = hax_loss.maybe_reduce_loss
    had_shard_map = hasattr(hax_partitioning, "shard_map")
    if not had_shard_map:

        def shard_map(*args, **kwargs):
            raise NotImplementedError("stand-in: the installed haliax has no shard_map")

        hax_partitioning.shard_map = shard_map
    hax_loss.maybe_reduce_loss = _weighted_maybe_reduce_loss
    try:
        from levanter.kernels.pallas.fused_cross_entropy_loss import (
            fused_cross_entropy_loss_and_logsumexp_penalty as kernel_ce,
        )
        from levanter.kernels.pallas.mamba3 import mamba3_attentionish_forward  # noqa: F401 - imports
        from levanter.kernels.triton.short_conv.api import short_conv
        from levanter.layers.attention import AttentionMask, dot_product_attention
        from levanter.models.loss import maybe_fused_next_token_loss
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        pytest.skip(f"Levanter did not import: {type(e).__name__}: {e}")
    yield dict(
        kernel_ce=kernel_ce,
        short_conv=short_conv,
        AttentionMask=AttentionMask,
        dot_product_attention=dot_product_attention,
        maybe_fused_next_token_loss=maybe_fused_next_token_loss,
    )
    hax_loss.maybe_reduce_loss = saved
    if not had_shard_map:
        del hax_partitioning.shard_map
    for p in added:
        sys.path.remove(p)
    print("\naxkern.levanter against Levanter, max |diff| / max |levanter|:")
    for k, v in FIGURES.items():
        print(f"  {k}: {v:.2e}")


def close(name, got, want, rtol):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, f"{name}[{i}]: shape {g.shape} != {w.shape}"
        err = np.abs(g - w).max(initial=0.0) / max(np.abs(w).max(initial=0.0), 1e-30)
        FIGURES[f"{name}[{i}]"] = max(FIGURES.get(f"{name}[{i}]", 0.0), float(err))
        assert err <= rtol, f"{name}[{i}]: relative error {err:.2e} > {rtol:.0e}"


CE_CASES = {
    "mean": dict(reduction="mean"),
    "sum z-loss cap": dict(reduction="sum", logsumexp_weight=1e-2, logit_soft_cap=3.0),
    "per-token": dict(reduction=None),
    "weighted mean": dict(reduction="mean", weight=True),
    "argmax": dict(reduction="mean", return_argmax=True),
    "block_size": dict(reduction="sum", block_size=128),
}


@pytest.mark.parametrize("case", list(CE_CASES))
def test_fused_cross_entropy_kernel_matches(lev, case):
    x, w, labels = ce_inputs(jax.random.PRNGKey(0), 37, 24, 301, jnp.float32)
    opts = dict(CE_CASES[case])
    if opts.get("weight") is True:
        opts["weight"] = jax.random.uniform(jax.random.PRNGKey(1), (37,))
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
        value_and_grads(lev["kernel_ce"]),
    )
    if argmax:
        np.testing.assert_array_equal(got[0][1], want[0][1])
        got, want = (got[0][0], got[1]), (want[0][0], want[1])
    close(f"fused CE kernel {case}", got, want, 1e-5)


def test_bench_times_levanter_beside_the_reduced_loss(lev):
    # `axkern bench fused_cross_entropy_loss --peers`: Levanter's kernel is a row of the same
    # case, run in this process, its loss and gradients checked against `reference`
    from axkern.bench import cases_for, measure

    case = cases_for("fused_cross_entropy_loss")[0]
    assert callable(case.peers["levanter"])
    rows = measure(case, ["xla", "peer:levanter"], repeats=1)
    peer = [r for r in rows if r.implementation == "peer:levanter"]
    assert [r.pass_ for r in peer] == ["fwd", "fwd+bwd"]
    assert all(r.ms > 0 and r.max_rel_error < 1e-4 and not r.note for r in peer), peer


@pytest.mark.parametrize("weighted", [False, True])
def test_maybe_fused_next_token_loss_matches(lev, weighted):
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
            return fn(
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

        return jax.jit(jax.value_and_grad(lambda h, head: f(h, head).array, argnums=(0, 1)))(h, head)

    close(
        f"maybe_fused_next_token_loss weighted={weighted}",
        run(axl.maybe_fused_next_token_loss, hax.mean),
        run(lev["maybe_fused_next_token_loss"], hax.mean),
        1e-5,
    )
    per = axl.maybe_fused_next_token_loss(Pos, Embed, Vocab, h, head, ids, loss_weight=weight, reduction=None)
    want = lev["maybe_fused_next_token_loss"](
        Pos, Embed, Vocab, h, head, ids, loss_weight=weight, reduction=None
    )
    assert per.axes == want.axes
    close(f"maybe_fused_next_token_loss per-token weighted={weighted}", per.array, want.array, 1e-5)


def _attention_inputs(gqa: bool):
    Batch, Pos, KPos, Key = (
        hax.Axis("batch", 2),
        hax.Axis("position", 24),
        hax.Axis("key_position", 24),
        hax.Axis("head_size", 8),
    )
    KVHeads, Group = hax.Axis("kv_heads", 2), hax.Axis("q_heads_per_group", 2 if gqa else 1)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    q = hax.random.normal(k1, (Batch, Pos, KVHeads, Group, Key))
    k = hax.random.normal(k2, (Batch, KPos, KVHeads, Key))
    v = hax.random.normal(k3, (Batch, KPos, KVHeads, Key))
    seg = hax.named(jnp.repeat(jnp.array([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]]), 4, axis=1), (Batch, Pos))
    return Pos, KPos, Key, q, k, v, seg


ATTN_CASES = ["causal", "sliding window", "segments", "soft cap + scale", "sink", "no mask"]


@pytest.mark.parametrize("case", ATTN_CASES)
def test_dot_product_attention_matches(lev, case):
    Pos, KPos, Key, q, k, v, seg = _attention_inputs(gqa=True)
    kwargs = {}
    if case == "causal":
        mask = lev["AttentionMask"].causal()
    elif case == "sliding window":
        mask = lev["AttentionMask"].causal(sliding_window=5)
    elif case == "segments":
        mask = lev["AttentionMask"].causal().with_segment_ids(seg)
    elif case == "soft cap + scale":
        mask, kwargs = lev["AttentionMask"].causal(), dict(logits_soft_cap=2.0, scaling_factor=0.2)
    elif case == "sink":
        sink = hax.named(jnp.array([[0.5, -0.3], [1.0, 0.0]]), (q.axes[2], q.axes[3]))
        mask, kwargs = lev["AttentionMask"].causal(), dict(attn_sink=sink)
    else:
        mask = None

    def run(fn):
        def f(q, k, v):
            out = fn(Pos, KPos, Key, q, k, v, mask=mask, **kwargs)
            return hax.sum(out * hax.cos(out)).scalar(), out

        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, grads

    got, want = run(axl.dot_product_attention), run(lev["dot_product_attention"])
    assert got[0].axes == want[0].axes
    close(
        f"dot_product_attention {case}",
        (got[0].array, *[g.array for g in got[1]]),
        (want[0].array, *[g.array for g in want[1]]),
        1e-5,
    )


def test_axkern_attention_mask_matches_levanters(lev):
    Pos, KPos, Key, q, k, v, seg = _attention_inputs(gqa=False)
    ours = axl.AttentionMask.causal(sliding_window=7).with_segment_ids(seg)
    theirs = lev["AttentionMask"].causal(sliding_window=7).with_segment_ids(seg)
    np.testing.assert_array_equal(
        ours.materialize(Pos, KPos).rearrange(("batch", "position", "key_position")).array,
        theirs.materialize(Pos, KPos).rearrange(("batch", "position", "key_position")).array,
    )
    got = axl.dot_product_attention(Pos, KPos, Key, q, k, v, mask=ours)
    want = lev["dot_product_attention"](Pos, KPos, Key, q, k, v, mask=theirs)
    close("dot_product_attention axkern AttentionMask", got.array, want.rearrange(got.axes).array, 1e-5)


@pytest.mark.parametrize("segments", [False, True])
def test_short_conv_matches(lev, segments):
    k1, k2 = jax.random.split(jax.random.PRNGKey(4))
    x = jax.random.normal(k1, (2, 19, 12))
    w = jax.random.normal(k2, (4, 12)) * 0.5
    seg = jnp.repeat(jnp.array([[0, 1, 2, 3], [5, 5, 6, 6]]), 5, axis=1)[:, :19] if segments else None

    def run(fn):
        return jax.jit(jax.value_and_grad(lambda w, x: jnp.sum(jnp.sin(fn(w, x, seg))), argnums=(0, 1)))(w, x)

    close(f"short_conv segments={segments}", run(axl.short_conv), run(lev["short_conv"]), 1e-5)


def test_mamba3_with_zero_angles_matches_levanters_xla_path(lev):
    # the adapter the bench times as Levanter's peer, against the oracle (zero angles) on shared inputs
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


def test_ssd_matches_levanters_chunked_xla_path(lev):
    # the adapter the bench times as Levanter's SSD peer, against the oracle on shared inputs
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


def test_refusals_name_the_argument():
    Pos, KPos, Key, q, k, v, _ = _attention_inputs(gqa=False)
    with pytest.raises(ValueError, match="bias must be None"):
        axl.dot_product_attention(Pos, KPos, Key, q, k, v, bias=hax.zeros((Pos, KPos)))
    with pytest.raises(ValueError, match="dropout must be 0 in training"):
        axl.dot_product_attention(Pos, KPos, Key, q, k, v, dropout=0.1, inference=False)
    with pytest.raises(ValueError, match="QPos and KPos must have different names"):
        axl.dot_product_attention(Pos, Pos, Key, q, k, v)
    x, w, labels = ce_inputs(jax.random.PRNGKey(0), 8, 4, 16, jnp.float32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        axl.fused_cross_entropy_loss_and_logsumexp_penalty(x, labels, w, implementation="triton")
    with pytest.raises(TypeError, match="callables are Levanter's own kernels"):
        axl.fused_cross_entropy_loss_and_logsumexp_penalty(x, labels, w, implementation=[print])
    with pytest.raises(ValueError, match="weight and x must share a dtype"):
        axl.short_conv(jnp.ones((4, 3), jnp.bfloat16), jnp.ones((1, 5, 3)))


@pytest.mark.parametrize("rank", [0, 2])
def test_mamba3_against_levanters_direct_recurrence(lev, rank):
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
