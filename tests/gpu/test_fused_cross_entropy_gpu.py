"""fused_cross_entropy compiled on a real GPU, at real sizes, against the oracle rule.

Run on a GPU machine with `AXKERN_TEST_GPU=1 python -m pytest tests/gpu -m gpu`. The oracle
is the `reference` implementation in float32 at `precision=HIGHEST` (true float32 products,
no TF32), as DESIGN.md allows where float64 would not fit the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import axkern
from axkern.positional import fused_cross_entropy
from axkern.positional import fused_cross_entropy_loss as ce_loss
from tests.helpers import assert_oracle_rule, ce_inputs


def ce(*args, **kwargs):
    """Per-token `(loss, lse)`."""
    return fused_cross_entropy(*args, reduction=None, return_lse=True, **kwargs)


pytestmark = pytest.mark.gpu


def _run(impl, x, w, labels, cot, opts):
    def f(x, w):
        loss, lse = ce(x, w, labels, implementation=impl, **opts)
        return jnp.sum(loss * cot[0]) + jnp.sum(lse * cot[1]), (loss, lse)

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w)
    return out, grads


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "n,d,v,opts",
    [
        (4096, 2048, 32000, {}),
        (3001, 1536, 50257, {"logits_soft_cap": 30.0, "label_smoothing": 0.1, "logsumexp_weight": 1e-4}),
        (8192, 4096, 128256, {"ignore_index": -100}),
    ],
)
def test_on_gpu_against_oracle(impl, n, d, v, opts, dtype):
    assert jax.devices()[0].platform == "gpu"
    x, w, labels = ce_inputs(jax.random.PRNGKey(n), n, d, v, jnp.dtype(dtype), logit_scale=4.0)
    if "ignore_index" in opts:
        labels = labels.at[::7].set(-100)
    cot = jax.random.normal(jax.random.PRNGKey(1), (2, n), jnp.float32)
    with jax.default_matmul_precision("highest"):
        oracle = _run("reference", x.astype(jnp.float32), w.astype(jnp.float32), labels, cot, opts)
    same = _run("reference", x, w, labels, cot, opts)
    got = _run(impl, x, w, labels, cot, opts)
    assert_oracle_rule(got[0], same[0], oracle[0], dtype, f"{impl} {dtype} N={n} forward")
    assert_oracle_rule(got[1], same[1], oracle[1], dtype, f"{impl} {dtype} N={n} grads")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "n,d,v,opts",
    [
        (3001, 1536, 50257, {"logits_soft_cap": 30.0, "label_smoothing": 0.1, "logsumexp_weight": 1e-4}),
        (8192, 4096, 128256, {"ignore_index": -100}),  # dw accumulated over 8 token blocks
    ],
)
def test_loss_gradients_in_forward_on_gpu_against_oracle(n, d, v, opts, dtype):
    x, w, labels = ce_inputs(jax.random.PRNGKey(n + 1), n, d, v, jnp.dtype(dtype), logit_scale=4.0)
    if "ignore_index" in opts:
        labels = labels.at[::7].set(-100)

    def run(impl, x, w):
        f = lambda x, w: ce_loss(x, w, labels, implementation=impl, **opts)  # noqa: E731
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)

    with jax.default_matmul_precision("highest"):
        oracle = run("reference", x.astype(jnp.float32), w.astype(jnp.float32))
    same = run("reference", x, w)
    got = run("xla", x, w)
    assert_oracle_rule(got[0], same[0], oracle[0], dtype, f"loss {dtype} N={n} value")
    assert_oracle_rule(got[1], same[1], oracle[1], dtype, f"loss {dtype} N={n} grads")


def test_h200_table_and_memory_at_llama3_size():
    n, d, v = 16384, 4096, 128256
    shapes = (
        jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    decision = axkern.explain(ce, *shapes)
    assert decision.implementation == "pallas_gpu"
    if decision.spec.device_key == "nvidia_h200":
        assert decision.block_source == "table"
    grad = jax.jit(jax.grad(lambda x, w, l: jnp.mean(ce(x, w, l)[0]), argnums=(0, 1)))
    temp = grad.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 1.5 * 2**30, f"temporary memory {temp / 2**30:.2f} GiB"
    # the reduced loss: one float32 [block_tokens, V] logits block and its 16-bit dz, the float32
    # [D, V] dw accumulator, and slack
    decision = axkern.explain(ce_loss, *shapes)
    bt = decision.block_sizes.block_tokens
    grad = jax.jit(jax.grad(lambda x, w, l: ce_loss(x, w, l), argnums=(0, 1)))
    temp = grad.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    print(f"loss block_tokens={bt}: temporary memory {temp / 2**30:.3f} GiB")
    assert temp <= 1.25 * (bt * v * 6 + d * v * 4), (
        f"temporary memory {temp / 2**30:.2f} GiB at block_tokens={bt}"
    )
