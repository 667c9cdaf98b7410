"""cross_entropy (from logits): every implementation against the float64 oracle, values and gradients."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import axkern
from axkern.positional import cross_entropy
from tests.helpers import LOSS_OPTIONS, assert_oracle_rule, to64, x64

IMPLS = ["xla", "reference"]
DTYPES = ["float32", "bfloat16"]
OPTIONS = LOSS_OPTIONS
N, V = 37, 301  # odd sizes


def make_case(seed, dtype, options, n=N, v=V):
    key = jax.random.PRNGKey(seed)
    kz, kl, k1, k2, k3 = jax.random.split(key, 5)
    logits = (jax.random.normal(kz, (n, v), jnp.float32) * 3).astype(dtype)
    labels = jax.random.randint(kl, (n,), 0, v)
    opts = dict(options)
    if "ignore_index" in opts:
        labels = jnp.where(jax.random.bernoulli(k1, 0.25, (n,)), opts["ignore_index"], labels)
    if opts.get("where") is True:
        opts["where"] = jax.random.bernoulli(k2, 0.7, (n,))
    cot = jax.random.normal(k3, (2, n), jnp.float32)
    return logits, labels, opts, cot


def run(impl, logits, labels, opts, reduction, cot):
    """The loss (and lse for per-token runs) and the gradient w.r.t. the logits."""

    def f(z):
        if reduction is None:
            loss, lse = cross_entropy(z, labels, reduction=None, return_lse=True, implementation=impl, **opts)
            return jnp.sum(loss * cot[0]) + jnp.sum(lse * cot[1]), (loss, lse)
        loss = cross_entropy(z, labels, reduction=reduction, implementation=impl, **opts)
        return loss, (loss,)

    (_, out), grad = jax.value_and_grad(f, has_aux=True)(logits)
    return out, grad


def check(impl, dtype, option, reduction, seed=0):
    logits, labels, opts, cot = make_case(seed, dtype, OPTIONS[option])
    with x64():
        o = {k: (np.asarray(a) if k == "where" else a) for k, a in opts.items()}
        want = jax.tree.map(
            np.asarray, run("reference", to64(logits), labels, o, reduction, jnp.asarray(to64(cot)))
        )
    same = run("reference", logits, labels, opts, reduction, cot)
    got = run(impl, logits, labels, opts, reduction, cot)
    assert got[0][0].dtype == jnp.float32 and got[1].dtype == logits.dtype
    what = f"{impl} {dtype} {option} reduction={reduction}"
    assert_oracle_rule(got[0], same[0], want[0], dtype, what + " value")
    assert_oracle_rule(got[1], same[1], want[1], dtype, what + " grad")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", None])
def test_against_oracle(impl, dtype, option, reduction):
    check(impl, dtype, option, reduction)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_against_oracle(dtype):
    check("xla", dtype, "all", "sum", seed=4)


def test_reference_matches_numpy():
    logits, labels, _, _ = make_case(3, "float32", {}, n=5, v=7)
    z = np.asarray(logits, np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = lse - z[np.arange(5), np.asarray(labels)]
    got = cross_entropy(logits, labels, reduction=None, implementation="reference")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    p = np.exp(z - lse[:, None])
    p[np.arange(5), np.asarray(labels)] -= 1
    g = jax.grad(lambda z: cross_entropy(z, labels, reduction="sum"))(logits)
    np.testing.assert_allclose(g, p, atol=1e-6)


def test_edge_cases_and_errors():
    logits, labels, _, _ = make_case(1, "float32", {}, n=8, v=40)
    nothing = jnp.zeros((8,), bool)
    value, grad = jax.value_and_grad(lambda z: cross_entropy(z, labels, where=nothing))(logits)
    assert value == 0 and not grad.any()  # mean over no kept token: 0, not NaN
    bad = labels.at[2].set(40)
    assert np.isnan(cross_entropy(logits, bad))
    grad = np.asarray(jax.grad(lambda z: cross_entropy(z, bad))(logits))
    assert np.isnan(grad[2]).all() and np.isfinite(np.delete(grad, 2, 0)).all()
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum', None"):
        cross_entropy(logits, labels, reduction="max")
    with pytest.raises(ValueError, match="logits_soft_cap must be > 0"):
        cross_entropy(logits, labels, logits_soft_cap=0.0)
    with pytest.raises(ValueError, match="block_sizes must be None"):
        cross_entropy(logits, labels, block_sizes={"block_tokens": 8})
    with pytest.raises(jaxtyping.TypeCheckError):
        cross_entropy(logits, labels[:4])
    with pytest.raises(Exception, match="a label outside"):
        jax.block_until_ready(cross_entropy(logits, bad, check_labels=True))
    d = axkern.explain(cross_entropy, logits, labels)
    assert d.op == "cross_entropy" and d.implementation == "xla" and "forward" in d.backward


def test_gradient_is_the_one_residual():
    # the differentiated xla call keeps one [tokens, vocab] buffer (the gradient) for the backward
    logits, labels, _, _ = make_case(2, "bfloat16", {}, n=64, v=512)
    _, vjp = jax.vjp(lambda z: cross_entropy(z, labels, implementation="xla"), logits)
    big = [a for a in jax.tree.leaves(vjp) if hasattr(a, "shape") and a.size >= 64 * 512]
    assert len(big) == 1 and big[0].dtype == jnp.bfloat16


def test_named_matches_positional_and_seed_example():
    Batch, Pos, Vocab = hax.Axis("batch", 3), hax.Axis("position", 5), hax.Axis("vocab", 11)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    logits = hax.random.normal(k1, (Vocab, Batch, Pos))
    labels = hax.random.randint(k2, (Pos, Batch), 0, Vocab.size)
    flat = logits.rearrange((Batch, Pos, Vocab)).array.reshape(15, 11)
    flat_labels = labels.rearrange((Batch, Pos)).array.reshape(15)
    np.testing.assert_allclose(
        axkern.cross_entropy(logits, labels), cross_entropy(flat, flat_labels), rtol=1e-6
    )
    per = axkern.cross_entropy(logits, labels, reduction=None, label_smoothing=0.1)
    assert [a.name for a in per.axes] == ["batch", "position"]
    want = cross_entropy(flat, flat_labels, reduction=None, label_smoothing=0.1).reshape(3, 5)
    np.testing.assert_allclose(per.array, want, rtol=1e-6)
    out = axkern.cross_entropy(logits, labels, reduction=hax.sum, return_lse=True)
    assert out.lse.axes == per.axes
    # [batch, vocab] logits and [batch] labels, as the README's first example
    two = logits[Pos, 0]
    loss = axkern.cross_entropy(two, labels[Pos, 0])
    assert loss.shape == () and np.isfinite(loss)
    with pytest.raises(ValueError, match="no axis 'vocab'"):
        axkern.cross_entropy(logits.rename({"vocab": "v"}), labels)
