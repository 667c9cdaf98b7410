"""attention compiled on a TPU (`pallas_tpu`; `xla` on a few cases) against the oracle rule,
forward and backward (dq, dk, dv and the sinks' gradient), default block sizes: every mask kind
the Pallas TPU kernel takes (causal, full, a sliding window, packed documents & causal, and a
block-sparse mask: a look-ahead window, a band half the length back and everything beyond three
quarters, with empty tiles between them), GQA and MQA, head dim 256, sinks, the soft cap,
`return_lse` with rows that see nothing; bf16 and float32. A NaN in `v` under the causal mask and
an infinity in `k` under a sliding window reach exactly what they reach in the oracle. Prefix-LM
masks (alone, `|` a window, `&` packed documents) where the kernel serves them (skipped with the
dispatcher's reason otherwise).

The float32 cases and those with sinks (float32 parameters) take the float64 oracle on the host
(tests/tpu/chip.py), so their sizes keep the oracle's `[B, KVH, G, Sq, Sk, D]` products near
40M elements; the bf16 ones run at a layer's sizes against the float32 oracle on the chip. The
non-finite cases reuse the programs of the finite case of their mask (same shapes). The loss
weighs the outputs by bf16 weights (tests/cases/attention.py: XLA on a TPU would keep the
reference's cotangent in float32 where a kernel receives it rounded).

Run with `AXKERN_TEST_TPU=1 python -m pytest tests/tpu` on a TPU machine (tests/tpu/chip.py: the
oracle, the dry run on a CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import masks
from axkern.positional import attention
from tests.cases.attention import inputs, run
from tests.harness import serving
from tests.helpers import poke
from tests.tpu.chip import DRY_RUN, assert_compiled_first_that_serves, case_id, check, check_nonfinite, sizes

pytestmark = pytest.mark.tpu

# (b, sq, sk, heads, kv heads, head dim): a layer's attention in bf16; head dim 256; float32
# (GQA 2) where the float64 oracle takes a few seconds; sinks with the soft cap over query and key
# lengths that differ (head dim 64); return_lse over a length that is no multiple of a tile, MQA
LAYER = sizes((2, 1024, 1024, 8, 2, 128), (1, 64, 64, 4, 2, 32))
D256 = sizes((1, 2048, 2048, 2, 1, 256), (1, 48, 48, 2, 1, 256))
FLOAT32 = sizes((1, 384, 384, 2, 1, 128), (1, 48, 48, 2, 1, 32))
SOFT_CAP = sizes((1, 256, 384, 4, 2, 64), (1, 40, 56, 4, 2, 32))
LSE = sizes((1, 300, 300, 2, 1, 128), (1, 50, 50, 4, 1, 32))


def _mask(kind, b, sq, sk):
    ids = jnp.cumsum(
        jax.random.bernoulli(jax.random.PRNGKey(5), 0.004 if sq > 256 else 0.05, (b, sq)), axis=1
    )
    ids = ids.astype(jnp.int32)
    w = max(sk // 4, 8)
    return {
        "causal": lambda: masks.Causal(offset=sk - sq),
        "full": lambda: masks.Full(),
        "window": lambda: masks.SlidingWindow(w, offset=sk - sq),
        "causal&segments": lambda: masks.Causal() & masks.Segments(ids, ids),
        # a look-ahead window, a band half the length back, everything three quarters back
        "block-sparse": lambda: (
            masks.SlidingWindow(w // 2 + 1, offset=w // 4)
            | masks.SlidingWindow(w // 2, offset=-(sq // 2))
            | masks.Causal(offset=-(3 * sq // 4))
        ),
        "prefix": lambda: masks.PrefixLM(jnp.asarray([sq // 3, 0][:b] + [5] * (b - 2))),
        # the window reaches w // 2 keys ahead: beyond the causal part PrefixLM already holds
        "prefix|window": lambda: (
            masks.SlidingWindow(w, offset=w // 2)
            | masks.PrefixLM(jnp.asarray([sq // 3, 0][:b] + [5] * (b - 2)))
        ),
        "prefix&segments": lambda: masks.PrefixLM(jnp.asarray([sq // 2] * b)) & masks.Segments(ids, ids),
        "rows that see nothing": lambda: masks.Causal(offset=-20),
    }[kind]()


OPTIONS = {
    "plain": dict(sinks=False),
    "sinks+cap": dict(sinks=True, cap=30.0),
    "lse": dict(sinks=True, cap=30.0, lse=True),
}

# (mask, dtype, options, dims)
CASES = (
    [(k, "bfloat16", "plain", LAYER) for k in ("causal", "full", "window", "causal&segments", "block-sparse")]
    + [("causal", "bfloat16", "plain", D256)]
    + [("causal", "bfloat16", "sinks+cap", SOFT_CAP), ("rows that see nothing", "bfloat16", "lse", LSE)]
    + [("causal", "float32", "plain", FLOAT32)]
    + [("rows that see nothing", "float32", "lse", LSE)]
)
# xla on a TPU: the layer's causal bf16 case, head dim 256, float32 causal, and sinks with the
# soft cap (each oracle computed once for both implementations)
XLA_CASES = [
    ("causal", "bfloat16", "plain", LAYER),
    ("causal", "bfloat16", "plain", D256),
    ("causal", "float32", "plain", FLOAT32),
    ("causal", "bfloat16", "sinks+cap", SOFT_CAP),
]


def _what(kind, dtype, options, dims):
    b, sq, sk, h, kvh, d = dims
    return f"attention {kind} {options} B{b} Sq{sq} Sk{sk} H{h}/{kvh} D{d} {dtype}"


def _oracle_dtype(dtype, options):
    """float64 on the host for float32 cases and for sinks (float32 parameters, whose gradient
    the bf16 reference computes as a float32 oracle would); float32 on the chip otherwise."""
    return "float64" if dtype == "float32" or OPTIONS[options]["sinks"] else "float32"


def _check(check_fn, impl, case, arrays, what):
    kind, dtype, options, dims = case
    b, sq, sk = dims[:3]
    return check_fn(
        run,
        impl,
        arrays,
        dtype,
        what,
        oracle_dtype=_oracle_dtype(dtype, options),
        mask=_mask(kind, b, sq, sk),
        blocks=None,
        weights="bfloat16",  # a cotangent nothing rounds (tests/cases/attention.py)
        **OPTIONS[options],
    )


@pytest.mark.parametrize(
    "case,impl", [(c, "pallas_tpu") for c in CASES] + [(c, "xla") for c in XLA_CASES], ids=case_id
)
def test_against_oracle(case, impl):
    kind, dtype, options, dims = case
    _check(check, impl, case, inputs(len(kind), *dims, dtype), _what(*case))


def test_a_nan_in_v_reaches_only_the_queries_that_see_its_key():
    """Under the causal mask a NaN in `v[key, kv head, feature]` makes that feature of the
    outputs NaN for the queries from the key on, in the query heads reading that kv head, and
    nowhere else; outputs and gradients are non-finite where the oracle's are."""
    case = ("causal", "bfloat16", "plain", LAYER)
    b, sq, sk, h, kvh, d = LAYER
    arrays = inputs(len(case[0]), *LAYER, "bfloat16")
    key, head, feature = sk // 3, kvh - 1, 7
    arrays["v"] = poke(arrays["v"], (b - 1, key, head, feature), jnp.nan)
    out, _ = _check(check_nonfinite, "pallas_tpu", case, arrays, _what(*case) + " NaN in v")
    group = h // kvh
    want = np.zeros(out.shape, bool)
    want[b - 1, key:, head * group : (head + 1) * group, feature] = True
    assert (np.isnan(out) == want).all(), "the NaN of v reached other queries, heads or features"


def test_an_infinity_in_k_reaches_only_the_queries_whose_window_holds_its_key():
    """Under a sliding window an infinity in `k` makes its key's scores non-finite: NaN for the
    queries whose window holds the key (every feature of the heads reading that kv head), as
    the oracle has it; the other queries' outputs and gradients stay finite where the oracle's do."""
    case = ("window", "bfloat16", "plain", LAYER)
    b, sq, sk, h, kvh, d = LAYER
    arrays = inputs(len(case[0]), *LAYER, "bfloat16")
    key = sk // 2 + 3
    arrays["k"] = poke(arrays["k"], (0, key, 0, 5), jnp.inf)
    out, _ = _check(check_nonfinite, "pallas_tpu", case, arrays, _what(*case) + " inf in k")
    w = max(sk // 4, 8)
    rows = np.flatnonzero(np.isnan(out[0, :, : h // kvh]).any(axis=(1, 2)))
    assert np.array_equal(rows, np.arange(key, min(sq, key + w))), f"NaN in rows {rows} for key {key}"


@pytest.mark.parametrize("kind", ["prefix", "prefix|window", "prefix&segments"])
def test_prefix_lm_where_served(kind):
    """Prefix-LM masks (arrays): checked where `pallas_tpu` serves them; the dispatcher's refusal
    is asked first (nothing compiles for a case the kernel does not take)."""
    b, sq, sk, h, kvh, d = LAYER
    arrays = inputs(9, *LAYER, "bfloat16")
    mask = _mask(kind, b, sq, sk)
    with serving("pallas_tpu"):
        axkern.explain(
            lambda q, k, v: attention(q, k, v, mask=mask, implementation="pallas_tpu"),
            arrays["q"],
            arrays["k"],
            arrays["v"],
        )
        check(
            run,
            "pallas_tpu",
            arrays,
            "bfloat16",
            f"attention {kind} bfloat16",
            mask=mask,
            blocks=None,
            sinks=False,
        )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_tpu_runs_compiled_and_the_default_is_the_first_that_serves(dtype):
    b, s, h, kvh, d = sizes((2, 8192, 32, 8, 128), (1, 64, 4, 2, 32))
    q = jax.ShapeDtypeStruct((b, s, h, d), dtype)
    k = jax.ShapeDtypeStruct((b, s, kvh, d), dtype)
    d_ = axkern.explain(
        lambda q, k, v: attention(q, k, v, mask=masks.Causal(), implementation="pallas_tpu"), q, k, k
    )
    assert d_.implementation == "pallas_tpu" and d_.interpret == DRY_RUN, d_
    assert_compiled_first_that_serves(
        axkern.explain(lambda q, k, v: attention(q, k, v, mask=masks.Causal()), q, k, k)
    )
