"""fused_cross_entropy (per token) and the reduced loss fused_cross_entropy_loss compiled on a TPU
(`pallas_tpu`; `xla` on one case of the reduced loss) against the oracle rule, at real sizes,
default block sizes.

Run with `AXKERN_TEST_TPU=1 python -m pytest tests/tpu` on a TPU machine (tests/tpu/chip.py: the
oracle, the dry run on a CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern.positional import fused_cross_entropy, fused_cross_entropy_loss
from tests.cases.fused_cross_entropy import make, run, run_loss
from tests.tpu.chip import DRY_RUN, assert_compiled_first_that_serves, case_id, check, sizes

pytestmark = pytest.mark.tpu

# (tokens, embed, vocab, dtype, options). The reduced loss: float32 over a vocabulary of whole
# blocks (the float64 oracle on the host); bf16 over an odd vocabulary and a token count that are
# no multiples of a block, with the soft cap and z-loss (its kernels' float32 logits); ignored
# labels, label smoothing and a `where` mask (their packed bf16 logits). Vocabularies of 12289 and
# 16384 take the paths GPT-2's and Llama-2's take (the same tiles; the tokens in several chunks,
# then in one), at less host time. The per-token op: float32, bf16 with every option, and fewer
# tokens than a tile (one tile of 384 lanes over 300 tokens).
_ALL = {"logits_soft_cap": 30.0, "logsumexp_weight": 1e-4, "ignore_index": -100, "label_smoothing": 0.1}
LOSS_CASES = sizes(
    [
        (2048, 512, 8192, "float32", {}),
        (1500, 1024, 12289, "bfloat16", {"logits_soft_cap": 30.0, "logsumexp_weight": 1e-4}),
        (2048, 1024, 16384, "bfloat16", {"ignore_index": -100, "label_smoothing": 0.1, "where": True}),
    ],
    [
        (64, 128, 1024, "float32", {}),
        (50, 128, 1000, "bfloat16", {"logits_soft_cap": 30.0, "logsumexp_weight": 1e-4}),
        (64, 128, 1024, "bfloat16", {"ignore_index": -100, "label_smoothing": 0.1, "where": True}),
    ],
)
PER_TOKEN_CASES = sizes(
    [
        (2048, 512, 8192, "float32", {}),
        (1500, 1024, 12289, "bfloat16", _ALL | {"where": True}),
        (300, 512, 8192, "bfloat16", {}),
    ],
    [
        (64, 128, 1024, "float32", {}),
        (50, 128, 1000, "bfloat16", _ALL | {"where": True}),
        (30, 128, 1000, "bfloat16", {}),
    ],
)
# xla on a TPU: the reduced loss's packed case
XLA_LOSS_CASE = LOSS_CASES[2]


def _what(op, case):
    n, d, v, dtype, options = case
    return f"{op} N{n} D{d} V{v} {dtype} {case_id(options)}"


@pytest.mark.parametrize("case,impl", [(c, "pallas_tpu") for c in PER_TOKEN_CASES], ids=case_id)
def test_per_token_against_oracle(case, impl):
    n, d, v, dtype, options = case
    arrays, options = make(1, n, d, v, dtype, options, logit_scale=4.0)
    check(run, impl, arrays, dtype, _what("fused_cross_entropy", case), options=options)


@pytest.mark.parametrize(
    "case,impl", [(c, "pallas_tpu") for c in LOSS_CASES] + [(XLA_LOSS_CASE, "xla")], ids=case_id
)
def test_reduced_loss_against_oracle(case, impl):
    """The loss Levanter trains with, through its own TPU kernel."""
    n, d, v, dtype, options = case
    arrays, options = make(2, n, d, v, dtype, options, logit_scale=4.0)
    check(run_loss, impl, arrays, dtype, _what("fused_cross_entropy_loss", case), options=options)


@pytest.mark.parametrize("op", ["fused_cross_entropy", "fused_cross_entropy_loss"])
def test_pallas_tpu_runs_compiled_and_the_default_is_the_first_that_serves(op):
    n, d, v = sizes((8192, 4096, 128256), (64, 128, 1024))
    x, w = jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((n,), jnp.int32)
    if op == "fused_cross_entropy":
        f = lambda x, w, l, **kw: fused_cross_entropy(x, w, l, reduction=None, **kw)  # noqa: E731
    else:
        f = fused_cross_entropy_loss
    d_ = axkern.explain(lambda x, w, l: f(x, w, l, implementation="pallas_tpu"), x, w, labels)
    assert d_.implementation == "pallas_tpu" and d_.interpret == DRY_RUN, d_
    assert_compiled_first_that_serves(axkern.explain(f, x, w, labels))
