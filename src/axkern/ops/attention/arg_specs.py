"""Shapes that `axkern bench attention` uses. FLOPs count the visible part of `q k^T` and `p v`
(`4·B·H·D` per visible (query, key) pair forward, 2.5 times that backward).

Peers (`--peers`, timed in this process): tokamax's `dot_product_attention` with
`implementation="mosaic"` (`tokamax_mosaic`) and `"cudnn"` (`tokamax_cudnn`) on the case's
`q, k, v` as they are: tokamax takes the same `[batch, length, heads, head_dim]` layout, and
grouped kv heads as `[batch, length, kv_heads, head_dim]`. The case's mask maps onto tokamax's
keywords only where it does exactly (`tokamax_mask`): no mask, `Causal()` as `is_causal=True`,
`SlidingWindow(size)` as `local_window_size=(size - 1, 0)`; the scale is passed as
`head_dim ** -0.5`. tokamax has no segment ids, so the packed-documents case gets a row saying
so rather than a dense `[B, 1, L, L]` mask (a different computation). tokamax is found by
import: install its wheel (it needs Python >= 3.12 and jax >= 0.11.1) and put a stand-in for
its profiler package on `PYTHONPATH`, as `benchmarks/gpu.sh` does; where it is absent or does
not import, its rows say why.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axkern import masks
from axkern.core.cases import Case
from axkern.core.op import Unsupported

from .api import attention_positional

# batch, length, heads, kv_heads, head_dim, mask
PRESETS = {
    "quick": [(1, 256, 4, 2, 32, "causal")],
    "h200": [
        (2, 8192, 32, 32, 128, "causal"),
        (2, 8192, 32, 8, 128, "causal"),
        (2, 8192, 32, 32, 64, "causal"),
        (2, 8192, 32, 32, 128, "window1024"),
        (2, 8192, 32, 32, 128, "docs1024"),
        (2, 8192, 32, 32, 256, "causal"),
    ],
    # the Hopper forward's two headline cases: causal and no mask
    "h200_core": [
        (2, 8192, 32, 32, 128, "causal"),
        (2, 8192, 32, 32, 128, "full"),
    ],
}


def _mask(name, batch, length):
    if name == "full":
        return masks.Full()
    if name == "window1024":
        return masks.SlidingWindow(1024)
    if name == "docs1024":  # packed documents of 1024 tokens, causal within each
        ids = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) // 1024, (batch, length))
        return masks.Causal() & masks.Segments(ids, ids)
    return masks.Causal()


def case(batch, length, heads, kv_heads, head_dim, mask_name="causal", dtype="bfloat16") -> Case:
    dt = jnp.dtype(dtype)
    mask = _mask(mask_name, batch, length)

    def make(key):
        k = jax.random.split(key, 3)
        q = jax.random.normal(k[0], (batch, length, heads, head_dim), jnp.float32).astype(dt)
        kk = jax.random.normal(k[1], (batch, length, kv_heads, head_dim), jnp.float32).astype(dt)
        v = jax.random.normal(k[2], (batch, length, kv_heads, head_dim), jnp.float32).astype(dt)
        return q, kk, v

    def forward(impl, q, k, v):
        return attention_positional(q, k, v, mask=mask, implementation=impl)

    visible = float(np.asarray(mask.dense(length, length)).sum()) / (batch if mask.batch_size() else 1)

    flops = 4.0 * batch * heads * head_dim * visible
    return Case(
        op="attention",
        label=f"B={batch} L={length} H={heads}/{kv_heads} D={head_dim} {mask_name} {dt.name}",
        dims={"batch": batch, "length": length, "heads": heads},
        dtype=dt.name,
        make=make,
        forward=forward,
        loss=None,  # the backward pulls a random cotangent back
        grad_argnums=(0, 1, 2),
        flops_forward=flops,
        flops_backward=2.5 * flops,
        peers={name: tokamax_peer(impl, mask) for name, impl in TOKAMAX_PEERS.items()},
    )


# peer name -> tokamax's `implementation=`
TOKAMAX_PEERS = {"tokamax_mosaic": "mosaic", "tokamax_cudnn": "cudnn"}


def tokamax_mask(mask: masks.Mask, q_len: int | None = None) -> dict[str, Any] | str:
    """The keywords of `tokamax.dot_product_attention` that express `mask` exactly, or why none do.
    With `q_len`, a window no query outreaches (`size >= q_len`) is causal."""
    if isinstance(mask, masks.Full):
        return {}
    if isinstance(mask, masks.Causal) and mask.offset == 0:
        return {"is_causal": True}
    if isinstance(mask, masks.SlidingWindow) and mask.offset == 0:
        if q_len is not None and mask.size >= q_len:
            return {"is_causal": True}
        # tokamax's (before, after) window keeps keys q - before <= k <= q + after; ours
        # q - size < k <= q
        return {"local_window_size": (mask.size - 1, 0)}
    return (
        f"tokamax.dot_product_attention cannot take the mask {mask!r} exactly: it takes is_causal "
        "(offset 0), a local window and dense mask arrays, no segment ids or offsets"
    )


def tokamax_peer(implementation: str, mask: masks.Mask) -> Callable[..., Any] | str:
    """`(q, k, v) -> tokamax.dot_product_attention(q, k, v, ..., implementation=implementation)`
    under `mask`, or why it cannot run (tokamax is imported at the first call: building cases
    does not import it). Differentiable: tokamax's own backward runs under `jax.vjp`."""
    if importlib.util.find_spec("tokamax") is None:
        return "tokamax is not installed"
    keywords = tokamax_mask(mask)
    if isinstance(keywords, str):
        return keywords

    def forward(q, k, v):
        try:
            import tokamax
        except Exception as e:  # noqa: BLE001 - any import failure: the peer is absent
            raise Unsupported(f"tokamax did not import: {type(e).__name__}: {e}") from None
        try:
            return tokamax.dot_product_attention(
                q,
                k,
                v,
                scale=q.shape[-1] ** -0.5,
                implementation=implementation,
                **tokamax_mask(mask, q.shape[1]),
            )
        except NotImplementedError as e:  # tokamax's way of saying a backend cannot take the call
            raise Unsupported(f"tokamax {implementation}: {e}") from None

    return forward


def cases(*, preset=None, tokens=None, dtype=None):
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"attention: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    dtype = dtype or ("float32" if name == "quick" else "bfloat16")
    return [case(b, tokens or n, h, kvh, d, m, dtype) for b, n, h, kvh, d, m in PRESETS[name]]
