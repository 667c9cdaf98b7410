"""attention on a real GPU: xla, pallas_gpu and the cuDNN wrapper against the oracle rule; the GPU order.

Run with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. The float64 oracle materialises
`[B, KVH, G, Sq, Sk, D]` on the CPU: the cases keep that under about 200M elements (a few GB of
host memory a case, with pytest-xdist's workers side by side), lengths of several tiles that are
not multiples of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern import masks
from axkern.core import backend
from tests.cases.attention import inputs as _inputs
from tests.cases.attention import run as _run
from tests.harness import check_rule, implementations

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mask", [masks.Causal(), masks.SlidingWindow(128), masks.Full()])
@pytest.mark.parametrize("impl", implementations("attention", "gpu"))
def test_against_oracle(impl, mask):
    a = _inputs(0, 1, 700, 700, 4, 2, 64, "bfloat16")
    check_rule(_run, impl, a, "bfloat16", "attention", mask=mask, sinks=False, blocks=(64, 64))


def test_cudnn_is_chosen_explicitly_and_compiles():
    a = _inputs(0, 1, 256, 256, 4, 4, 64, "bfloat16")
    d = axkern.explain(
        lambda q, k, v: axkern.positional.attention(q, k, v, implementation="cudnn"), a["q"], a["k"], a["v"]
    )
    assert d.implementation == "cudnn"
    f = jax.jit(lambda q, k, v: axkern.positional.attention(q, k, v, implementation="cudnn"))
    assert f(a["q"], a["k"], a["v"]).shape == (1, 256, 4, 64)


def test_default_order_on_gpu_is_cudnn_then_mosaic_gpu_on_hopper_then_pallas_gpu_then_xla():
    a = _inputs(0, 1, 256, 256, 4, 4, 64, "bfloat16")
    att = axkern.positional.attention
    hopper = (backend.compute_capability() or (0,))[0] == 9
    assert axkern.explain(att, a["q"], a["k"], a["v"]).implementation == "cudnn"
    # what cuDNN cannot express through JAX: the Mosaic kernels on Hopper, else pallas_gpu
    ids = jnp.zeros((1, 256), jnp.int32).at[:, 100:].set(1)
    d = axkern.explain(lambda q, k, v: att(q, k, v, mask=masks.Segments(ids, ids)), a["q"], a["k"], a["v"])
    assert d.implementation == ("mosaic_gpu" if hopper else "pallas_gpu"), d
    d = axkern.explain(lambda q, k, v: att(q, k, v, logits_soft_cap=30.0), a["q"], a["k"], a["v"])
    assert (
        d.implementation == ("mosaic_gpu" if hopper else "pallas_gpu") and "soft cap" in d.rejected[0].reason
    )
    # float32 (neither cuDNN nor the Mosaic kernels take it): pallas_gpu, with the reasons
    f = {n: x.astype(jnp.float32) for n, x in a.items()}
    d = axkern.explain(lambda q, k, v: att(q, k, v, mask=masks.Segments(ids, ids)), f["q"], f["k"], f["v"])
    assert d.implementation == "pallas_gpu" and any("float32" in r.reason for r in d.rejected), d
    # and what none of the kernels serves (a head dim that is not a power of two) goes to xla
    b = _inputs(0, 1, 256, 256, 4, 4, 80, "bfloat16")
    d = axkern.explain(lambda q, k, v: att(q, k, v, logits_soft_cap=30.0), b["q"], b["k"], b["v"])
    assert d.implementation == "xla", d


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
def test_lse_against_oracle(impl):
    # return_lse compiled: lse and the gradients through it, rows that see nothing (the first 20)
    # with sinks, soft cap, GQA 2, a ragged length
    a = _inputs(3, 1, 300, 300, 4, 2, 64, "bfloat16")
    mask = masks.Causal(offset=-20)
    check_rule(
        _run, impl, a, "bfloat16", "attention lse", mask=mask, sinks=True, cap=30.0, blocks=(64, 64), lse=True
    )


@pytest.mark.parametrize("opts", [dict(cap=30.0), dict(sinks=True), dict(cap=20.0, sinks=True)])
def test_pallas_gpu_soft_cap_and_sinks_against_oracle(opts):
    a = _inputs(1, 1, 700, 700, 4, 2, 64, "bfloat16")
    kw = dict(sinks=False, blocks=(64, 64)) | opts
    check_rule(_run, "pallas_gpu", a, "bfloat16", f"attention {opts}", mask=masks.Causal(), **kw)


@pytest.mark.parametrize("mask_kind", ["segments", "causal&segments"])
def test_pallas_gpu_packed_documents_against_oracle(mask_kind):
    # documents of random lengths (the tile schedule is built per batch row at run time)
    a = _inputs(3, 2, 500, 500, 4, 2, 64, "bfloat16")
    cuts = jax.random.randint(jax.random.PRNGKey(5), (2, 500), 0, 100) == 0
    ids = jnp.cumsum(cuts, axis=1).astype(jnp.int32)
    mask = masks.Segments(ids, ids)
    mask = masks.Causal() & mask if mask_kind == "causal&segments" else mask
    check_rule(
        _run, "pallas_gpu", a, "bfloat16", f"attention {mask_kind}", mask=mask, sinks=False, blocks=(64, 64)
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mask_kind", ["causal", "window", "causal&segments"])
def test_pallas_gpu_default_tiles_against_oracle(mask_kind, dtype):
    # no block sizes given: the heuristic's per-kernel tiles (bf16: forward 128x64, dq 128x32,
    # dk/dv 64x64 with their warps and stages; float32: 64x64) at head dim 128, lengths that are
    # not multiples of 128, GQA 4
    b, n = 1, 600
    a = _inputs(4, b, n, n, 4, 1, 128, dtype)
    ids = jnp.cumsum(jax.random.randint(jax.random.PRNGKey(6), (b, n), 0, 150) == 0, axis=1).astype(jnp.int32)
    mask = {
        "causal": masks.Causal(),
        "window": masks.SlidingWindow(200),
        "causal&segments": masks.Causal() & masks.Segments(ids, ids),
    }[mask_kind]
    check_rule(_run, "pallas_gpu", a, dtype, f"attention {mask_kind}", mask=mask, sinks=False, blocks=None)


@pytest.mark.parametrize("impl", ["cudnn", "mosaic_gpu"])
def test_head_dim_256_guarded_against_oracle_and_a_nan(impl):
    """The guarded kernels at head dim 256, finite inputs against the oracle, then a NaN in `v`:
    the rule-following path (pallas_gpu at head dim 256) compiles, runs and puts the NaN where it
    belongs (queries from its key on, its head and feature only; `dq` of the earlier ones finite)."""
    if impl == "mosaic_gpu" and (backend.compute_capability() or (0,))[0] != 9:
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU (compute capability 9.x)")
    a = _inputs(4, 1, 384, 384, 4, 4, 256, "bfloat16")
    check_rule(
        _run, impl, a, "bfloat16", f"attention {impl} D256", mask=masks.Causal(), sinks=False, blocks=None
    )
    b = dict(a, v=a["v"].at[0, 300, 1, 7].set(jnp.nan))
    out, (dq, dk, dv) = _run(impl, b, masks.Causal(), sinks=False, blocks=None)
    nan = jnp.zeros(out.shape, bool).at[0, 300:, 1, 7].set(True)
    assert bool(jnp.all(jnp.isnan(out) == nan)), "NaN of v[300] outside its queries, head and feature"
    assert bool(jnp.all(jnp.isfinite(dq[0, :300]))) and bool(jnp.all(jnp.isfinite(dv)))
