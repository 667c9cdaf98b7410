"""cuDNN's fused attention through `jax.nn.dot_product_attention(implementation="cudnn")`.

Offered only where that call can serve (`supports`): a CUDA GPU, bf16 or f16, a causal
(`Causal()`), sliding-window (`SlidingWindow(size)`, as `is_causal=True, local_window_size=(size - 1, 0)`)
or full mask, no soft cap, no sinks, head dims equal and a multiple of 8 up to 256 (cuDNN's
limits as JAX checks them). Masks holding arrays (`Segments`, `PrefixLM`) are not
expressible through JAX's public API (it has no segment ids), hence refused. Forward and
backward are cuDNN's (JAX's own `custom_vjp`); `api.py` registers this implementation behind the
non-finite guard (`common.guarded`), which serves inputs holding NaN or infinity with
`pallas_gpu` (else `xla`), since cuDNN's kernel does not follow the non-finite rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axkern import masks as masks_
from axkern.core.op import Implementation, Unsupported


def _mask_args(mask, q_len=None):
    """The keywords of `jax.nn.dot_product_attention` that express `mask`, or None. With `q_len`,
    a window no query outreaches (`size >= q_len`: every key at or before the query) is causal,
    so no window size beyond what cuDNN takes reaches it."""
    if isinstance(mask, masks_.Full):
        return {}
    if isinstance(mask, masks_.Causal) and mask.offset == 0:
        return {"is_causal": True}
    if isinstance(mask, masks_.SlidingWindow) and mask.offset == 0:
        if q_len is not None and mask.size >= q_len:
            return {"is_causal": True}
        # without is_causal cuDNN's window bounds the left side only (future keys would
        # stay visible)
        return {"is_causal": True, "local_window_size": (mask.size - 1, 0)}
    return None


LSE_REASON = "jax.nn.dot_product_attention does not return the log-sum-exp (return_lse=True)"


def supports(spec) -> str | None:
    if spec.platform != "gpu":
        return "cuDNN attention needs a CUDA GPU"
    if spec.dtype not in ("bfloat16", "float16"):
        return f"cuDNN attention takes bf16 or f16, not {spec.dtype}"
    if spec.flag("soft_cap"):
        return "cuDNN attention through jax.nn.dot_product_attention has no logit soft cap"
    if spec.flag("sinks"):
        return "cuDNN attention through jax.nn.dot_product_attention has no sinks"
    if spec.flag("lse"):
        return LSE_REASON
    if spec.flag("mask") not in ("Causal", "SlidingWindow", "Full"):
        return f"mask {spec.flag('mask')} is not expressible through jax.nn.dot_product_attention"
    d = spec.dim("head_dim")
    if d != spec.dim("v_dim") or d % 8 or d > 256:
        return f"head dims {d} and {spec.dim('v_dim')}: cuDNN needs them equal, a multiple of 8, at most 256"
    return None


def attention(q, k, v, sinks, mask, *, scale, logits_soft_cap, return_lse=False):
    del sinks, logits_soft_cap  # refused by supports()
    if return_lse:
        raise Unsupported(LSE_REASON)
    args = _mask_args(mask, q.shape[1])
    if args is None:
        raise Unsupported(f"{mask!r} is not expressible through jax.nn.dot_product_attention")
    try:
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn", **args)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        # JAX checks cuDNN's presence, version and limits while tracing: a refusal there lets
        # the dispatcher move on (first in the GPU order, this must never break a call)
        raise Unsupported(f"jax.nn.dot_product_attention(implementation='cudnn') refused: {e}") from e
    return out.astype(jnp.result_type(q))


IMPLEMENTATION = Implementation(
    "cudnn",
    attention,
    platforms=("gpu",),
    supports=supports,
    backward=(
        "cuDNN's (jax.nn.dot_product_attention's custom_vjp) where q, k, v and the cotangent "
        "are finite, else pallas_gpu's (or xla's)"
    ),
)
