"""Fused cross-entropy's cases, shared by the CPU tests (tests/ops/test_fused_cross_entropy.py)
and the GPU tests (tests/gpu/test_fused_cross_entropy_gpu.py): random inputs with a loss
option drawn (ignored labels, a `where` mask), and runners for the per-token op
(`fused_cross_entropy`: `(loss, lse)`) and the reduced loss (`fused_cross_entropy_loss`), each
returning its outputs and the gradients of `x` and `w`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from axkern.positional import fused_cross_entropy, fused_cross_entropy_loss
from tests.harness import jit
from tests.helpers import LOSS_OPTIONS

OPTIONS = LOSS_OPTIONS

# GPU sizes (n, d, v, options): a Llama-2 vocabulary; GPT-2's odd one over a token count that
# is no multiple of a block, with the options the kernels compute (soft cap, logit sum) and
# z-loss; Llama-3's with ignored labels (the reduced loss's dw over many token blocks)
GPU_CASES = [
    (4096, 2048, 32000, {}),
    (3001, 1536, 50257, {"logits_soft_cap": 30.0, "label_smoothing": 0.1, "logsumexp_weight": 1e-4}),
    (8192, 4096, 128256, {"ignore_index": -100}),
]


def make(seed, n, d, v, dtype, options=None, *, logit_scale=2.0):
    """`(arrays, options)`: `x [n, d]`, `w [d, v]` (logits of order `logit_scale`), `labels [n]`
    (a quarter of them `ignore_index` when the options ignore one), the cotangents `cot [2, n]`
    of loss and lse, and `where [n]` when the options ask for a random mask; `options` without
    `where`. NumPy draws them: no compilation per shape."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    x = rng.standard_normal((n, d), np.float32).astype(dt)
    w = (rng.standard_normal((d, v), np.float32) * (logit_scale / np.sqrt(d))).astype(dt)
    labels = rng.integers(0, v, n, dtype=np.int32)
    options = dict(options or {})
    if "ignore_index" in options:
        labels = np.where(rng.random(n) < 0.25, np.int32(options["ignore_index"]), labels)
    arrays = dict(x=x, w=w, labels=labels, cot=rng.standard_normal((2, n), np.float32))
    if options.pop("where", None) is True:
        arrays["where"] = rng.random(n) < 0.7
    return {k: jnp.asarray(a) for k, a in arrays.items()}, options


def _blocks(impl, block_sizes):
    """`block_sizes` for `impl`: the same for every implementation, or a dict by implementation
    name (the runners do not take the dict form of block sizes)."""
    if impl == "reference":
        return None
    return block_sizes[impl] if isinstance(block_sizes, dict) else block_sizes


def run(impl, arrays, *, options=None, block_sizes=None):
    """`(loss, lse)` per token and the gradients of `<cot[0], loss> + <cot[1], lse>` w.r.t. x and w."""

    def f(x, w, rest):
        loss, lse = fused_cross_entropy(
            x,
            w,
            rest["labels"],
            reduction=None,
            return_lse=True,
            where=rest.get("where"),
            implementation=impl,
            block_sizes=_blocks(impl, block_sizes),
            **(options or {}),
        )
        return jnp.sum(loss * rest["cot"][0]) + jnp.sum(lse * rest["cot"][1]), (loss, lse)

    rest = {k: a for k, a in arrays.items() if k not in ("x", "w")}
    (_, out), grads = jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(arrays["x"], arrays["w"], rest)
    return out, grads


def run_loss(impl, arrays, *, reduction="mean", options=None, block_sizes=None):
    """The reduced loss and its gradients w.r.t. x and w."""

    def f(x, w, rest):
        return fused_cross_entropy_loss(
            x,
            w,
            rest["labels"],
            reduction=reduction,
            where=rest.get("where"),
            implementation=impl,
            block_sizes=_blocks(impl, block_sizes),
            **(options or {}),
        )

    rest = {k: a for k, a in arrays.items() if k not in ("x", "w", "cot")}
    return jit(jax.value_and_grad(f, argnums=(0, 1)))(arrays["x"], arrays["w"], rest)
