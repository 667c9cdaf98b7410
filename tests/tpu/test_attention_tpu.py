"""attention compiled on a TPU (`pallas_tpu`, then `xla`) against the oracle rule, forward and
backward (dq, dk, dv and the sinks' gradient), default block sizes: every mask the Pallas TPU
kernel takes (causal, full, sliding window, a two-sided window and a window beside a far causal
part with tiles skipped between them, packed documents alone and causal), GQA and MQA, sinks, the
soft cap, `return_lse` with rows that see nothing; bf16 and float32. A prefix-LM mask where the
kernel serves it (skipped with its reason otherwise).

Run with `AXKERN_TEST_TPU=1 python -m pytest tests/tpu` on a TPU machine (tests/tpu/chip.py: the
oracle, the dry run on a CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern import masks
from axkern.positional import attention
from tests.cases.attention import inputs, run
from tests.harness import implementations, serving
from tests.tpu.chip import DRY_RUN, assert_compiled_first_that_serves, case_id, check, sizes

pytestmark = pytest.mark.tpu

# (b, sq, sk, heads, kv heads, head dim)
LAYER = sizes((2, 1024, 1024, 8, 2, 128), (1, 64, 64, 4, 2, 32))


def _mask(kind, b, sq, sk):
    ids = jnp.cumsum(
        jax.random.bernoulli(jax.random.PRNGKey(5), 0.004 if sq > 256 else 0.05, (b, sq)), axis=1
    )
    ids = ids.astype(jnp.int32)
    w = max(sk // 4, 8)
    return {
        "causal": masks.Causal(offset=sk - sq),
        "full": masks.Full(),
        "window": masks.SlidingWindow(w, offset=sk - sq),
        "two-sided window": masks.SlidingWindow(w + 1, offset=sk - sq + w // 2),
        # a band and, half the length back, everything before: the tiles between are skipped
        "window|far causal": masks.SlidingWindow(w // 2) | masks.Causal(offset=-(sq // 2)),
        "segments": masks.Segments(ids, ids),
        "causal&segments": masks.Causal() & masks.Segments(ids, ids),
        "prefix": masks.PrefixLM(jnp.asarray([sq // 3, 0][:b] + [5] * (b - 2))),
        "rows that see nothing": masks.Causal(offset=-20),
    }[kind]


# (mask, dtype, options, dims): the masks at the layer's sizes in bf16, the main ones in float32
# too; sinks with the soft cap over query and key lengths that differ (head dim 64); return_lse
# with sinks and the soft cap, MQA, a length that is no multiple of a tile, the first 20 rows
# seeing only the sink
MASK_KINDS = [
    "causal",
    "full",
    "window",
    "two-sided window",
    "window|far causal",
    "segments",
    "causal&segments",
]
SOFT_CAP = sizes((2, 512, 768, 8, 2, 64), (1, 40, 56, 4, 2, 32))
LSE = sizes((1, 1000, 1000, 8, 1, 128), (1, 50, 50, 4, 1, 32))
CASES = (
    [(k, "bfloat16", "plain", LAYER) for k in MASK_KINDS]
    + [("causal", "bfloat16", "sinks+cap", SOFT_CAP), ("rows that see nothing", "bfloat16", "lse", LSE)]
    + [(k, "float32", "plain", LAYER) for k in ("causal", "window", "causal&segments")]
    + [("causal", "float32", "sinks+cap", SOFT_CAP), ("rows that see nothing", "float32", "lse", LSE)]
)
OPTIONS = {
    "plain": dict(sinks=False),
    "sinks+cap": dict(sinks=True, cap=30.0),
    "lse": dict(sinks=True, cap=30.0, lse=True),
}


@pytest.mark.parametrize(
    "case,impl", [(c, i) for c in CASES for i in sorted(implementations("attention", "tpu"))], ids=case_id
)
def test_against_oracle(case, impl):
    kind, dtype, options, dims = case
    b, sq, sk, h, kvh, d = dims
    arrays = inputs(len(kind), *dims, dtype)
    what = f"attention {kind} {options} B{b} Sq{sq} Sk{sk} H{h}/{kvh} D{d} {dtype}"
    check(run, impl, arrays, dtype, what, mask=_mask(kind, b, sq, sk), blocks=None, **OPTIONS[options])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("impl", ["pallas_tpu"])
def test_prefix_lm_where_served(impl, dtype):
    b, sq, sk, h, kvh, d = LAYER
    arrays = inputs(9, *LAYER, dtype)
    with serving(impl):
        check(
            run,
            impl,
            arrays,
            dtype,
            f"attention prefix {dtype}",
            mask=_mask("prefix", b, sq, sk),
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
