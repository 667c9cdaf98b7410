"""`axkern.levanter` (Levanter's drop-ins) and `axkern.haliax_compat`.

Here, in this interpreter (haliax, no Levanter): Levanter's semantics that need no Levanter to
state (out-of-range labels, a scalar weight's mean, a value head axis of its own, Levanter's
backend rules and refusals, the mask class used without Levanter), against a float64 oracle
written from Levanter's code. Then, in environments that `tests/levanter_env.py` builds from
wheels: axkern installed beside marin-levanter and marin-haliax (nothing replaced, `pip check`
says nothing of axkern or haliax), a plain install (a haliax that works), and
`tests/levanter_checks.py` run there against the real marin-levanter on its own marin-haliax
(the drop-ins against Levanter's functions, `patch()`, and a Levanter model trained with
`patch()` against Levanter's own run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import haliax as hax
import haliax.nn.attention as hattn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import levanter as axl
from axkern.haliax_compat import dot_product_attention as compat_attention
from tests import levanter_env
from tests.helpers import ce_inputs, x64

# -- Levanter's cross-entropy semantics, from its code, in float64 -------------------------------


def levanter_ce(x, labels, w, *, reduction="mean", weight=None, logsumexp_weight=0.0, soft_cap=None):
    """Levanter 0.2.227's kernel-level loss (its `reference.py`): the label logit is
    `z[arange(B), labels]` (JAX's indexing: a negative label counts from the end, one still
    outside takes the nearest column in the value and adds nothing to the gradient), and
    `_apply_reduction` (`loss * weight`, a mean divided by `sum(weight)` over the weight as
    given)."""
    z = jnp.dot(x, w)
    if soft_cap is not None:
        z = soft_cap * jnp.tanh(z / soft_cap)
    lse = jax.nn.logsumexp(z, axis=-1)
    label_logit = z[jnp.arange(z.shape[0]), labels]
    loss = lse - label_logit + logsumexp_weight * lse**2
    if weight is not None:
        weight = jnp.asarray(weight, loss.dtype)
        loss = loss * weight
    if reduction is None:
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    if weight is None:
        return jnp.mean(loss)
    denom = jnp.sum(weight)
    return jnp.where(denom != 0, jnp.sum(loss) / denom, 0.0)


def assert_close(got, want, rtol=2e-5, what=""):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.isfinite(g).all(), f"{what}[{i}]: not finite"
        err = np.abs(g - w).max(initial=0.0) / max(np.abs(w).max(initial=0.0), 1e-30)
        assert err <= rtol, f"{what}[{i}]: relative error {err:.2e}"


def _value_and_grads(fn, x, w):
    cot = lambda a: jnp.sum(a * jnp.linspace(0.5, 1.5, a.size).reshape(a.shape))  # noqa: E731
    return jax.value_and_grad(lambda x, w: cot(fn(x, w)), argnums=(0, 1))(x, w)


CE_CASES = {
    "mean": dict(reduction="mean"),
    "sum z-loss cap": dict(reduction="sum", logsumexp_weight=1e-2, soft_cap=3.0),
    "per-token": dict(reduction=None),
    "weighted mean": dict(reduction="mean", weight="zero at the bad labels"),
    "weighted per-token": dict(reduction=None, weight="zero at the bad labels"),
}


@pytest.mark.parametrize("case", list(CE_CASES))
def test_labels_outside_the_vocabulary_give_levanters_loss(case):
    # Levanter accepts -100 or V as a label (at a weight-0 position or not) and reads it as JAX
    # indexes; axkern's op alone gives NaN there
    n, v = 12, 40
    x, w, labels = ce_inputs(jax.random.PRNGKey(0), n, 16, v, jnp.float32)
    labels = labels.at[jnp.array([1, 5, 9, 10])].set(jnp.array([-100, v, v + 7, -3]))
    opts = dict(CE_CASES[case])
    if opts.get("weight"):
        opts["weight"] = jnp.ones(n).at[jnp.array([1, 5])].set(0.0).at[3].set(0.5)
    soft_cap = opts.pop("soft_cap", None)

    def ours(x, w):
        return axl.fused_cross_entropy_loss_and_logsumexp_penalty(
            x, labels, w, logit_soft_cap=soft_cap, **opts
        )

    got = jax.jit(lambda x, w: _value_and_grads(ours, x, w))(x, w)
    with x64():
        want = _value_and_grads(
            lambda x, w: levanter_ce(x, labels, w, soft_cap=soft_cap, **opts),
            *(np.asarray(a, np.float64) for a in (x, w)),
        )
    assert_close(got, want, what=case)


def test_named_loss_takes_labels_outside_the_vocabulary():
    Batch, Embed, Vocab = hax.Axis("batch", 6), hax.Axis("embed", 8), hax.Axis("vocab", 20)
    x, w, labels = ce_inputs(jax.random.PRNGKey(1), 6, 8, 20, jnp.float32)
    labels = labels.at[2].set(-100).at[4].set(20)
    weight = hax.named(jnp.ones(6).at[2].set(0.0), Batch)
    loss = axl.named_fused_cross_entropy_loss_and_logsumexp_penalty(
        hax.named(x, (Batch, Embed)),
        hax.named(w, (Embed, Vocab)),
        Embed,
        Vocab,
        hax.named(labels, Batch),
        reduction=None,
        weight=weight,
    )
    with x64():
        want = levanter_ce(
            np.float64(x), labels, np.float64(w), reduction=None, weight=np.asarray(weight.array)
        )
    assert_close(loss.array, want)


def test_a_scalar_weight_divides_the_mean_by_itself():
    # Levanter's `_apply_reduction`: sum(loss * w) / sum(w) over the weight as given, so a scalar
    # weight gives the sum of the losses, not their mean
    x, w, labels = ce_inputs(jax.random.PRNGKey(2), 10, 8, 30, jnp.float32)
    got = axl.fused_cross_entropy_loss_and_logsumexp_penalty(x, labels, w, weight=jnp.float32(0.5))
    total = axl.fused_cross_entropy_loss_and_logsumexp_penalty(x, labels, w, reduction="sum")
    np.testing.assert_allclose(got, total, rtol=1e-6)
    zero = axl.fused_cross_entropy_loss_and_logsumexp_penalty(x, labels, w, weight=jnp.float32(0.0))
    assert float(zero) == 0.0


def _attention_axes():
    Pos, KPos, Key = hax.Axis("position", 12), hax.Axis("key_position", 12), hax.Axis("head_size", 8)
    return Pos, KPos, Key, hax.Axis("heads", 2), hax.Axis("v_size", 5)


def test_a_value_head_axis_of_its_own():
    # haliax (and Levanter) take `value` with a head axis other than the key's, of another size
    Pos, KPos, Key, Heads, VSize = _attention_axes()
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    q = hax.random.normal(k1, (Heads, Pos, Key))
    k = hax.random.normal(k2, (Heads, KPos, Key))
    v = hax.random.normal(k3, (Heads, KPos, VSize))
    mask = hax.arange(KPos).broadcast_axis(Pos) <= hax.arange(Pos).broadcast_axis(KPos)
    want = hattn.dot_product_attention(KPos, Key, q, k, v, mask=mask)  # scaled by 1/sqrt(Key.size)
    got = axl.dot_product_attention(Pos, KPos, Key, q, k, v, mask=axl.AttentionMask.causal())
    assert got.axes == (Heads, Pos, VSize)
    assert_close(got.array, want.rearrange(got.axes).array)
    got = compat_attention(KPos, Key, q, k, v, mask=mask)
    assert got.axes == want.axes
    assert_close(got.array, want.array)


def test_backend_choice_follows_levanters_rules():
    choose = axl.backend_implementation
    with pytest.raises(ValueError, match="use_flash is False, but flash_backend is not VANILLA"):
        choose(False, "jax_flash", None, 16, 16)
    with pytest.raises(ValueError, match="use_flash is True, but flash_backend is VANILLA"):
        choose(True, "vanilla", None, 16, 16)
    with pytest.raises(NotImplementedError, match="attn_backend=splash needs a TPU"):
        choose(None, "splash", None, 16, 16)
    with pytest.raises(NotImplementedError, match="attn_backend=nvte needs an NVIDIA GPU"):
        choose(True, "nvte", None, 16, 16)
    assert choose(False, None, None, 16, 16) == "reference"  # Levanter's VANILLA
    assert choose(None, None, 5, 16, 16) == "reference"  # a block that does not divide the lengths
    assert choose(None, None, 8, 16, 16) is None
    assert choose(True, "default", None, 16, 16) is None
    Pos, KPos, Key, _, _ = _attention_axes()
    q, k = hax.ones((Pos, Key)), hax.ones((KPos, Key))
    with pytest.raises(ValueError, match="use_flash is True"):
        axl.dot_product_attention(Pos, KPos, Key, q, k, k, use_flash=True, attn_backend="vanilla")


def test_kernel_names_follow_levanters_platform_rules():
    # an explicit kernel of another platform raises (Levanter does); in a sequence it is skipped
    x, w, labels = ce_inputs(jax.random.PRNGKey(4), 8, 8, 16, jnp.float32)
    ce = axl.fused_cross_entropy_loss_and_logsumexp_penalty
    with pytest.raises(
        NotImplementedError, match=r"implementation='pallas_tpu' cannot run here: 'pallas_tpu' needs the tpu"
    ):
        ce(x, labels, w, implementation="pallas_tpu")
    with pytest.raises(NotImplementedError, match="implementation=.'batched_xla'. cannot run here"):
        ce(x, labels, w, implementation=["batched_xla"])
    with pytest.raises(NotImplementedError, match="cannot run here"):
        ce(x, labels, w, implementation=("pallas_tpu", "batched_xla"))
    np.testing.assert_allclose(
        ce(x, labels, w, implementation=("pallas_tpu", "batched_xla", "reference")),
        ce(x, labels, w),
        rtol=1e-6,
    )
    with pytest.raises(RuntimeError, match="'triton_gpu' needs the gpu"):
        axl.short_conv(jnp.ones((2, 3)), jnp.ones((1, 5, 3)), implementation="triton_gpu")
    from axkern.levanter import loss as lev_loss
    from axkern.levanter.common import map_impl

    with axkern.use(interpret=True):  # axkern's interpret mode runs the TPU kernel here
        assert (
            map_impl("f", "pallas_tpu", lev_loss.CE_IMPLEMENTATIONS, lev_loss.CE_UNAVAILABLE) == "pallas_tpu"
        )
    assert map_impl("f", ["reference", "xla"], lev_loss.CE_IMPLEMENTATIONS, lev_loss.CE_UNAVAILABLE) == (
        "reference",
        "xla",
    )


def test_refusals_name_the_argument():
    Pos, KPos, Key, Heads, _ = _attention_axes()
    q = hax.ones((Pos, Heads, Key))
    k = v = hax.ones((KPos, Heads, Key))
    with pytest.raises(ValueError, match="bias must be None"):
        axl.dot_product_attention(Pos, KPos, Key, q, k, v, bias=hax.zeros((Pos, KPos)))
    with pytest.raises(ValueError, match="dropout must be 0 in training"):
        axl.dot_product_attention(Pos, KPos, Key, q, k, v, dropout=0.1, inference=False)
    with pytest.raises(ValueError, match="QPos and KPos must have different names"):
        axl.dot_product_attention(Pos, Pos, Key, q, k, v)
    x, w, labels = ce_inputs(jax.random.PRNGKey(0), 8, 4, 16, jnp.float32)
    ce = axl.fused_cross_entropy_loss_and_logsumexp_penalty
    with pytest.raises(ValueError, match="implementation must be one of"):
        ce(x, labels, w, implementation="triton")
    with pytest.raises(TypeError, match="callables are Levanter's own kernels"):
        ce(x, labels, w, implementation=[print])
    with pytest.raises(ValueError, match="labels must be integer dtype"):
        ce(x, labels.astype(jnp.float32), w)
    with pytest.raises(ValueError, match="Hidden mismatch"):
        ce(x, labels, w.T)
    with pytest.raises(ValueError, match="weight and x must share a dtype"):
        axl.short_conv(jnp.ones((4, 3), jnp.bfloat16), jnp.ones((1, 5, 3)))


def test_the_mask_class_without_levanter():
    # Levanter is not importable here: the class with Levanter's fields, constructors and `&`, `|`
    Pos, KPos = hax.Axis("position", 9), hax.Axis("key_position", 9)
    assert axl.AttentionMask is axl.LevanterlessAttentionMask
    M = axl.AttentionMask
    q, k = np.arange(9)[:, None], np.arange(9)[None, :]
    seg = hax.named(jnp.array([0, 0, 0, 0, 1, 1, 1, 1, 1]), Pos)
    cases = {
        "window and bidirectional": (
            M.causal(sliding_window=4) & M.bidirectional_sliding_window(2),
            (k <= q) & (q - k < 4) & (abs(q - k) <= 2),
        ),
        "or of windows": (M.causal(sliding_window=2) | M.causal(sliding_window=5), (k <= q) & (q - k < 5)),
        "offset and segments": (
            M.causal(offset=2).with_segment_ids(seg),
            (k <= q + 2) & (np.asarray(seg.array)[:, None] == np.asarray(seg.array)[None, :]),
        ),
        "explicit": (
            M.explicit(hax.named(jnp.asarray(np.broadcast_to(q >= 3, (9, 9))), (Pos, KPos))) & M.causal(),
            (q >= 3) & (k <= q),
        ),
    }
    for name, (mask, want) in cases.items():
        got = mask.materialize(Pos, KPos).rearrange((Pos, KPos)).array
        np.testing.assert_array_equal(got, want, err_msg=name)
    with pytest.raises(ImportError, match="levanter.layers.attention does not import"):
        axl.patch()


# -- environments built from wheels ---------------------------------------------------------------


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    return levanter_env.wheels(tmp_path_factory.mktemp("levanter_wheels"))


@pytest.fixture(scope="module")
def beside_levanter(wheels, tmp_path_factory):
    return levanter_env.install_beside_levanter(wheels, tmp_path_factory.mktemp("levanter_env"))


def test_installs_beside_levanter_without_replacing_haliax(beside_levanter):
    _, report = beside_levanter
    assert report["installed"] == ["axkern"], report["pip install"]
    assert report["haliax files changed"] == [], report["haliax files changed"]
    assert report["haliax distributions"] == ["marin-haliax"], report["pip install"]
    assert report["pip check about axkern or haliax"] == [], report["pip check"]
    assert report["imports"] == "ok", report["imports"]


@pytest.mark.parametrize("python_version", ["3.11", "3.12"])
def test_a_plain_install_gets_a_haliax(wheels, tmp_path, python_version):
    report = levanter_env.plain_install(wheels, tmp_path, python_version)
    assert report["haliax distributions"] == [report["expected haliax"]], report["pip install"]
    assert report["pip check"] == [], report["pip check"]
    assert report["imports"] == "ok", report["imports"]


def test_drop_ins_against_the_real_levanter(beside_levanter, tmp_path):
    python, _ = beside_levanter
    figures = tmp_path / "figures.json"
    proc = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/levanter_checks.py"],
        cwd=levanter_env.ROOT,
        env={**os.environ, "TEST_LEVANTER_FIGURES": str(figures)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    print(json.dumps(json.loads(figures.read_text()), indent=1), file=sys.stderr)
