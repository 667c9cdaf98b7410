"""`attention`: scaled dot-product attention with composable masks, named and positional.

`out[b, i, h] = sum_j softmax_j(s[b, h, i, j]) v[b, j, h // G]` with
`s = softcap(q[b, i, h] · k[b, j, h // G] · scale)` over the keys the mask makes visible
(`axkern.masks`), `G = heads // kv_heads` (grouped-query attention; `G = heads` is
multi-query), `softcap(s) = c · tanh(s / c)`. A sink adds `exp(sink[h])` to the softmax's
denominator (a learnable "attend to nothing"). A query that sees no key gets zeros.
`mask=None` means no masking (haliax's and Levanter's meaning); causal attention is
`mask=axkern.masks.Causal()`.

The op's implementations (one module each; `reference.py`'s is built here), its order per
platform, and the non-finite guard `cudnn` and `mosaic_gpu` run behind (`behind_guard`, whose
other branch is `rule_following`). The named function is `named.py`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from haliax import NamedArray

from axkern import masks as masks_
from axkern.core import config
from axkern.core.op import Implementation, Op, Spec, Unsupported
from axkern.core.typing import Array, Float, checked

from . import common, cudnn, mosaic_gpu, pallas_gpu, pallas_tpu, reference, xla
from .blocks import AttentionBlockSizes, bucket, mask_kind

__all__ = ["attention_positional", "OP", "AttentionBlockSizes", "AttentionImplementation", "call_spec"]

NAME = "attention"


def rule_following(q, k, v, sinks, mask, *, scale, logits_soft_cap, return_lse=False):
    """What a guarded implementation runs where an input or the cotangent is not finite:
    `pallas_gpu`, which follows the rule (any head dim up to 256: its heuristic keeps the forward
    in a Hopper block's shared memory), where it serves the call (a GPU, the mask:
    `common.pallas_mask`), else `xla`, with the block sizes the dispatcher would choose for it.
    Called directly: the call was validated once, by `attention_positional`."""
    spec = call_spec(q, k, v, sinks, mask, logits_soft_cap, return_lse)
    interpret = bool(config.current().interpret)
    order = [pallas_gpu.IMPLEMENTATION, xla.IMPLEMENTATION]
    if not common.pallas_mask(mask):
        order = order[1:]
    for impl in order:
        if spec.platform not in impl.platforms and not (impl.interpretable and interpret):
            continue
        if impl.supports(spec) is not None:
            continue
        block_sizes, _, why = OP.choose_blocks(impl, spec, None)
        if why is not None:
            continue
        kw = {"interpret": interpret or spec.platform not in impl.platforms} if impl.interpretable else {}
        try:
            with jax.named_scope(impl.name):
                return impl.fn(
                    q,
                    k,
                    v,
                    sinks,
                    mask,
                    scale=scale,
                    logits_soft_cap=logits_soft_cap,
                    block_sizes=block_sizes,
                    return_lse=return_lse,
                    **kw,
                )
        except Unsupported:
            if impl is order[-1]:
                raise
    raise AssertionError("xla serves every call")  # pragma: no cover


def behind_guard(impl: Implementation) -> Implementation:
    """`impl` with its function behind the non-finite guard (`common.guarded`): its kernels where
    `q`, `k`, `v` (and the cotangent) are finite, `rule_following` where one is not, chosen on the
    device; only the kernels' residuals are kept, and the other implementation's forward and
    backward run only where something is not finite. Neither cuDNN's kernel nor the Mosaic GPU
    kernels follow the non-finite rule (docs/guide.md): a NaN in `v` reaches, through `p v` with
    `p = 0`, queries that cannot see its key. `impl`'s own checks run first, when its kernels
    are traced."""
    kernels = impl.fn

    def where_finite(q, k, v, sinks, mask, *, scale, logits_soft_cap, return_lse=False, **blocks):
        kw = dict(scale=scale, logits_soft_cap=logits_soft_cap, return_lse=return_lse)
        fast = functools.partial(kernels, **kw, **blocks)
        return common.guarded(fast, functools.partial(rule_following, **kw), q, k, v, sinks, mask)

    return dataclasses.replace(impl, fn=where_finite)


OP = Op(
    NAME,
    [
        xla.IMPLEMENTATION,
        pallas_gpu.IMPLEMENTATION,
        pallas_tpu.IMPLEMENTATION,
        behind_guard(cudnn.IMPLEMENTATION),
        behind_guard(mosaic_gpu.IMPLEMENTATION),
        Implementation("reference", reference.attention, backward="autodiff through materialised scores"),
    ],
    # GPU: cuDNN where its supports() holds (static causal, window and full masks, no soft cap,
    # no sinks), then mosaic_gpu on Hopper for what cuDNN cannot express through JAX (packed
    # documents, prefix-LM, `|` masks, soft cap, sinks; its supports() refuses other GPUs,
    # float32 and Dense), then pallas_gpu (other GPUs), then xla; on a TPU pallas_tpu (static
    # masks, packed documents), then xla (why this order: docs/decisions.md, "Attention"; on a
    # TPU: docs/tpu.md)
    default_order={
        "cpu": ("xla",),
        "gpu": ("cudnn", "mosaic_gpu", "pallas_gpu", "xla"),
        "tpu": ("pallas_tpu", "xla"),
    },
    package=__package__,
    bucket=bucket,
)


AttentionImplementation = Literal["xla", "pallas_gpu", "pallas_tpu", "cudnn", "mosaic_gpu", "reference"]


def _no_named_leaves(mask) -> None:
    for leaf in jax.tree_util.tree_leaves(mask, is_leaf=lambda a: isinstance(a, NamedArray)):
        if isinstance(leaf, NamedArray):
            raise TypeError(
                f"{NAME}: {mask!r} holds NamedArrays; pass it to axkern.attention, or build it from plain "
                "arrays (leading with the batch axes flattened) for the positional form"
            )


@checked
def attention_positional(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads k_dim"],
    v: Float[Array, "batch kv_len kv_heads v_dim"],
    *,
    mask: masks_.Mask | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    implementation: AttentionImplementation | tuple[AttentionImplementation, ...] | None = None,
    block_sizes: AttentionBlockSizes | dict | None = None,
    return_lse: bool = False,
) -> (
    Float[Array, "batch q_len heads v_dim"]
    | tuple[Float[Array, "batch q_len heads v_dim"], Float[Array, "batch q_len heads"]]
):
    """Attention on plain arrays, laid out as `jax.nn.dot_product_attention`'s (`BTNH`).

    **Arguments:**

    - `q`: `[batch, q_len, heads, head_dim]`; `k`: `[batch, kv_len, kv_heads, head_dim]`;
      `v`: `[batch, kv_len, kv_heads, v_dim]`. `heads` must be a multiple of `kv_heads`
      (both may be 0).
    - `mask`: an `axkern.masks.Mask`; `None` (the default) attends to every key, as
      `masks.Full()`. Causal attention is `mask=masks.Causal()`.
    - `scale`: default `head_dim ** -0.5`.
    - `logits_soft_cap`: `c` in `c · tanh(s / c)`, or None.
    - `sinks`: `[heads]` sink logits, or None.
    - `return_lse`: also return each query's log-sum-exp of its visible scores (after scale
      and soft cap; the sink's logit too), differentiable: for merging partial attentions
      (split keys, ring attention) or a z-loss.

    **Returns:** `[batch, q_len, heads, v_dim]` in `q`'s dtype; with `return_lse`, `(out, lse)`,
    `lse` `[batch, q_len, heads]` float32 (natural log; `-inf` for a query that sees no key and
    has no sink). Empty `batch`, `q_len` or `heads` (`kv_heads` too) give an empty result, an
    empty `kv_len` zeros (no query sees a key); an empty `head_dim` or `v_dim` is a `ValueError`.
    Non-finite input: see the guide's rule (`lse` is NaN where a visible score or the sink is,
    not for a NaN of `v`, which reaches the output only).

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> q = jax.random.normal(jax.random.PRNGKey(0), (1, 32, 2, 8))  # batch, q_len, heads, head_dim
    >>> axkern.positional.attention(q, q, q, mask=axkern.masks.Causal()).shape
    (1, 32, 2, 8)

    ```
    """
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if k.shape[3] != d:
        raise ValueError(f"{NAME}: q's head dim is {d} but k's is {k.shape[3]}; they must match")
    if (kvh == 0 and h) or (kvh and h % kvh):  # no heads at all: an empty result below
        raise ValueError(f"{NAME}: heads={h} is not a multiple of kv_heads={kvh}")
    for axis, n in (("head_dim", d), ("v_dim", v.shape[3])):
        if n == 0:
            raise ValueError(f"{NAME}: {axis} must be at least 1, got 0")
    if 0 in (b, sq, sk, h):  # nothing to attend: empty, or queries that see no key (zeros)
        out = jnp.zeros((b, sq, h, v.shape[3]), q.dtype)
        if not return_lse:
            return out
        # log Σ over no key: -inf, or the sink's logit alone
        none = jnp.full((b, sq, h), -jnp.inf, jnp.float32)
        return out, none if sinks is None else jnp.broadcast_to(sinks.astype(jnp.float32), (b, sq, h))
    if logits_soft_cap is not None and not 0 < float(logits_soft_cap) < math.inf:
        raise ValueError(
            f"{NAME}: logits_soft_cap must be a finite number > 0 or None, got {logits_soft_cap!r}"
        )
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"{NAME}: scale must be a finite number or None, got {scale!r}")
    mask = masks_.Full() if mask is None else mask
    _no_named_leaves(mask)
    mask.check(sq, sk, b)
    scale = d**-0.5 if scale is None else float(scale)
    spec = call_spec(q, k, v, sinks, mask, logits_soft_cap, return_lse)
    return OP(
        spec,
        q,
        k,
        v,
        sinks,
        mask,
        implementation=implementation,
        block_sizes=block_sizes,
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        return_lse=bool(return_lse),
    )


def call_spec(q, k, v, sinks, mask, logits_soft_cap, return_lse) -> Spec:
    """The `Spec` of a call (`OP.spec`): its dims, dtype, and the flags tables and `supports` read."""
    b, sq, h, d = q.shape
    return OP.spec(
        {
            "batch": b,
            "q_len": sq,
            "kv_len": k.shape[1],
            "heads": h,
            "kv_heads": k.shape[2],
            "head_dim": d,
            "v_dim": v.shape[3],
        },
        q.dtype,
        soft_cap=logits_soft_cap is not None,
        sinks=sinks is not None,
        mask=type(mask).__name__,
        mask_kind=mask_kind(mask),
        **({"lse": True} if return_lse else {}),
    )
