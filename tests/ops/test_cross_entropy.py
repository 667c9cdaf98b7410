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
from tests.cases.cross_entropy import OPTIONS, make, run
from tests.harness import check_rules, implementations

IMPLS = implementations("cross_entropy", "cpu")
DTYPES = ["float32", "bfloat16"]
N, V = 37, 301  # odd sizes


def check(dtype, option, reduction, seed=0):
    arrays, options = make(seed, N, V, dtype, OPTIONS[option])
    what = f"cross_entropy {option} reduction={reduction}"
    got = check_rules(run, IMPLS, arrays, dtype, what, reduction=reduction, options=options)
    for out, grad in got.values():
        assert out[0].dtype == jnp.float32 and grad.dtype == arrays["logits"].dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", None])
def test_against_oracle(dtype, option, reduction):
    check(dtype, option, reduction)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_against_oracle(dtype):
    check(dtype, "all", "sum", seed=4)


def logits_and_labels(seed, n, v):
    arrays, _ = make(seed, n, v, "float32")
    return arrays["logits"], arrays["labels"]


def test_reference_matches_numpy():
    logits, labels = logits_and_labels(3, 5, 7)
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
    logits, labels = logits_and_labels(1, 8, 40)
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
    arrays, _ = make(2, 64, 512, "bfloat16")
    logits, labels = arrays["logits"], arrays["labels"]
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
