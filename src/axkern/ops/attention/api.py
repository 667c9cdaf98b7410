"""`attention`: scaled dot-product attention with composable masks, named and positional.

`out[b, i, h] = sum_j softmax_j(s[b, h, i, j]) v[b, j, h // G]` with
`s = softcap(q[b, i, h] · k[b, j, h // G] · scale)` over the keys the mask makes visible
(`axkern.masks`), `G = heads // kv_heads` (grouped-query attention; `G = heads` is
multi-query), `softcap(s) = c · tanh(s / c)`. A sink adds `exp(sink[h])` to the softmax's
denominator (a learnable "attend to nothing"). A query that sees no key gets zeros.
`mask=None` means no masking (haliax's and Levanter's meaning); causal attention is
`mask=axkern.masks.Causal()`.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from axkern import masks as masks_
from axkern.core import named
from axkern.core.mesh import mesh_axes_for
from axkern.core.op import Implementation, Op, Unsupported
from axkern.core.typing import Array, Float, checked

from . import common as tiles_common
from . import cudnn, mosaic_gpu, pallas_gpu, pallas_tpu, reference, xla
from .blocks import (
    AttentionBlockSizes,
    bucket,
    heuristic,
    mask_kind,
    mosaic_gpu_heuristic,
    mosaic_gpu_space,
    pallas_gpu_heuristic,
    pallas_gpu_space,
    pallas_tpu_heuristic,
    pallas_tpu_space,
    space,
)

__all__ = ["attention", "attention_positional", "OP", "AttentionBlockSizes"]

NAME = "attention"


def _cudnn_where_finite(q, k, v, sinks, mask, *, scale, logits_soft_cap, return_lse=False):
    """cuDNN's kernel where `q`, `k`, `v` (and, for the gradients, the cotangent) are all finite;
    where one is not, `pallas_gpu` (else `xla`) serves the call, chosen on the device
    (`lax.cond`).

    cuDNN does not follow the non-finite rule (docs/guide.md): a NaN or infinity in `q` or `k`
    can leave its query's output finite, and a NaN in `v` reaches, through the gradients,
    queries that cannot see its key. The check reads the inputs once more (and the cotangent
    in the backward); only cuDNN's residuals are kept, and the other implementation's forward
    and backward run only where something is not finite."""
    if return_lse:
        raise Unsupported(cudnn.LSE_REASON)
    kw = dict(scale=scale, logits_soft_cap=logits_soft_cap)
    fast = lambda q, k, v, sinks, mask: cudnn.attention(q, k, v, sinks=sinks, mask=mask, **kw)  # noqa: E731
    return tiles_common.guarded(fast, q, k, v, sinks, mask, order=_safe_order(mask), **kw)


def _mosaic_gpu_where_finite(q, k, v, sinks, mask, *, scale, logits_soft_cap, block_sizes, return_lse=False):
    """The Mosaic GPU forward and backward kernels where `q`, `k`, `v` (and the cotangent) are
    finite; elsewhere `pallas_gpu` (else `xla`: `_safe_order`), chosen on the device as for
    cuDNN: the kernel's `p v` product would carry a NaN of `v` to rows that cannot see its key."""
    mosaic_gpu.check(mask, block_sizes, q.shape[3], sinks, logits_soft_cap, scale=scale)  # before tracing
    mosaic_gpu.check_inputs(q, k, v)
    why = mosaic_gpu.check_backward(mask, block_sizes, q.shape[3])
    if why is not None:
        raise Unsupported(why)  # backward tiles that do not fit: the dispatcher moves on
    kw = dict(scale=scale, logits_soft_cap=logits_soft_cap)
    attend = functools.partial(mosaic_gpu.attention, block_sizes=block_sizes, return_lse=return_lse, **kw)
    fast = lambda q, k, v, sinks, mask: attend(q, k, v, sinks, mask)  # noqa: E731
    order = _safe_order(mask)
    return tiles_common.guarded(fast, q, k, v, sinks, mask, order=order, return_lse=return_lse, **kw)


def _safe_order(mask) -> tuple[str, ...]:
    """What serves a guarded call whose inputs are not all finite: `pallas_gpu`, which follows
    the rule (any head dim up to 256: its heuristic keeps the forward in a Hopper block's shared
    memory), where it takes the mask (static, `Segments`, `Segments & static`), else `xla`."""
    return ("pallas_gpu", "xla") if _pallas_mask(mask) else ("xla",)


def _pallas_mask(mask) -> bool:
    """Whether `pallas_gpu` takes the mask (static, `Segments`, `Segments & static`)."""
    try:
        tiles_common.split_segments(mask)
    except Unsupported:
        return False
    return True


def _mosaic_gpu_backward(spec, block_sizes) -> str:
    """`explain`'s backward line for `mosaic_gpu`: which kernels its backward runs here."""
    d = max(spec.dim("head_dim"), spec.dim("v_dim"))
    (bq1, bk1, st1), (bq2, bk2, st2) = mosaic_gpu.backward_blocks(block_sizes, d)
    split = d > mosaic_gpu.SPLIT_ABOVE
    reduced = mosaic_gpu.dq_by(block_sizes, d) == "reduction"
    dq = (
        "dk, dv with dq (one launch; dq's tile shares added by TMA reductions into float32"
        if reduced
        else f"dq ({bq1}x{bk1} tiles, {st1} stage{'s' * (st1 > 1)}) and "
        + ("dv, then dk (two launches" if split else "dk, dv (one launch")
    )
    return (
        f"Mosaic GPU kernels: {dq}"
        + f"; {bq2}x{bk2}, {st2} stage{'s' * (st2 > 1)}, the GQA sum in registers) on this forward's "
        "residuals (out, lse); inputs or a cotangent holding NaN or infinity go to pallas_gpu (or xla), "
        "forward and backward"
    )


OP = Op(
    NAME,
    [
        Implementation(
            "xla",
            xla.attention,
            block_sizes=AttentionBlockSizes,
            heuristic=heuristic,
            space=space,
            backward="custom_vjp: flash-style recomputation per tile (float32 dk/dv accumulators)",
        ),
        Implementation(
            "pallas_gpu",
            pallas_gpu.attention,
            platforms=("gpu",),
            supports=pallas_gpu.supports,
            block_sizes=AttentionBlockSizes,
            heuristic=pallas_gpu_heuristic,
            space=pallas_gpu_space,
            interpretable=True,
            backward="custom_vjp: Pallas dq and dk/dv kernels, each with its own tiles",
        ),
        Implementation(
            "pallas_tpu",
            pallas_tpu.attention,
            platforms=("tpu",),
            block_sizes=AttentionBlockSizes,
            heuristic=pallas_tpu_heuristic,
            space=pallas_tpu_space,
            interpretable=True,
            backward="custom_vjp: block-sparse Pallas dq and dk/dv kernels (TPU interpret mode only)",
        ),
        Implementation(
            "cudnn",
            _cudnn_where_finite,
            platforms=("gpu",),
            supports=cudnn.supports,
            backward=(
                "cuDNN's (jax.nn.dot_product_attention's custom_vjp) where q, k, v and the cotangent "
                "are finite, else pallas_gpu's (or xla's)"
            ),
        ),
        Implementation(
            "mosaic_gpu",
            _mosaic_gpu_where_finite,
            platforms=("gpu",),
            supports=mosaic_gpu.supports,
            block_sizes=AttentionBlockSizes,
            heuristic=mosaic_gpu_heuristic,
            space=mosaic_gpu_space,
            backward=_mosaic_gpu_backward,
            why_platforms="a Pallas Mosaic GPU kernel for Hopper (TMA, wgmma); it has no interpret mode here",
        ),
        Implementation("reference", reference.attention, backward="autodiff through materialised scores"),
    ],
    # GPU: cuDNN where its supports() holds (static causal, window and full masks, no soft cap,
    # no sinks: guarded, it ran 1-11% faster forward+backward than mosaic_gpu at head dim 128 and
    # 35% at 256 on the H200; at 64 mosaic_gpu ran 4% faster, one case measured),
    # then mosaic_gpu on Hopper for what cuDNN cannot express through JAX (packed documents,
    # prefix-LM, `|` masks, soft cap, sinks; its supports() refuses other GPUs, float32 and
    # Dense), then pallas_gpu (other GPUs), then xla; pallas_tpu is explicit only (figures:
    # docs/ops/attention.md, "Measured performance")
    default_order={"cpu": ("xla",), "gpu": ("cudnn", "mosaic_gpu", "pallas_gpu", "xla"), "tpu": ("xla",)},
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
      `v`: `[batch, kv_len, kv_heads, v_dim]`. `heads` must be a multiple of `kv_heads`.
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
    has no sink). Empty `batch`, `q_len` or `heads` give an empty result, an empty `kv_len` zeros
    (no query sees a key); an empty `head_dim` or `v_dim` is a `ValueError`. Non-finite input:
    see the guide's rule (`lse` is NaN where a visible score or the sink is, not for a NaN of
    `v`, which reaches the output only).

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
    if kvh < 1 or h % kvh:
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
    spec = OP.spec(
        {
            "batch": b,
            "q_len": sq,
            "kv_len": sk,
            "heads": h,
            "kv_heads": kvh,
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


# -- named layer -------------------------------------------------------------------------------

ROLES = named.Roles(
    NAME,
    {
        "q": named.Arg(("batch", "QPos", "Heads", "HeadDim"), describe="batch axes + QPos + Heads + HeadDim"),
        "k": named.Arg(
            ("batch", "KPos", "KVHeads", "HeadDim"), describe="q's batch axes + KPos + KVHeads + HeadDim"
        ),
        "v": named.Arg(
            ("batch", "KPos", "KVHeads", "VDim"), describe="q's batch axes + KPos + KVHeads + HeadDim"
        ),
        "sinks": named.Arg(("Heads",), optional=True, describe="Heads"),
    },
    fallbacks={"KPos": "QPos", "KVHeads": "Heads"},
)
SHARDING = named.Sharding(
    parallel=("Heads", "KVHeads"),
    together=("Heads", "KVHeads"),
    describe="batch axes data parallel; Heads and KVHeads head parallel (mapped to the same mesh axes; "
    "no communication); positions and head dims gathered",
)
# a single kv head (multi-query) is read by every shard of the query heads
SHARDING_MQA = named.Sharding(parallel=("Heads",), describe=SHARDING.describe)


def _mask_inputs(mask, bound):
    """The mask's arrays as extra inputs of `Bound.run` (canonical order, batch axes unflattened),
    and how to rebuild the mask from their local blocks."""
    leaves, treedef = jax.tree_util.tree_flatten(mask, is_leaf=lambda a: isinstance(a, NamedArray))
    roles = masks_.leaf_roles(mask)
    lead = tuple(a.size for a in bound.batch)
    extra, shared = [], []
    for i, (leaf, leaf_roles) in enumerate(zip(leaves, roles, strict=True)):
        what = f"{type(mask).__name__}'s array {i}"
        if isinstance(leaf, NamedArray):
            want = bound.axes_of(leaf_roles)
            need = {a.name: a.size for a in want}
            pos = [bound.axis(r).name for r in leaf_roles if r != "batch"]
            have = {a.name: a.size for a in leaf.axes}
            if any(need.get(n) != size for n, size in have.items()) or any(p not in have for p in pos):
                raise ValueError(
                    f"{NAME}: {what} has axes {named.axes_str(leaf.axes)}; it must carry "
                    f"{' + '.join(pos)} and a subset of q's batch axes, within {named.axes_str(want)}"
                )
            extra.append((what, hax.broadcast_to(leaf, want).rearrange(want).array, leaf_roles))
            shared.append(False)
            continue
        leaf = jnp.asarray(leaf)
        if leaf.ndim and leaf.shape[0] == 1 and math.prod(lead) != 1:  # shared by every batch row
            extra.append((what, leaf[0], leaf_roles[1:]))
            shared.append(True)
        elif leaf.ndim and leaf.shape[0] == math.prod(lead):
            extra.append((what, jnp.reshape(leaf, lead + leaf.shape[1:]), leaf_roles))
            shared.append(False)
        else:
            raise ValueError(
                f"{NAME}: the mask's arrays must lead with q's batch axes {named.axes_str(bound.batch)} flattened "
                f"({math.prod(lead)} rows) or with 1; {mask!r} has an array of shape {list(jnp.shape(leaf))}"
            )

    def rebuild(local_leaves):
        return treedef.unflatten([x[None] if one else x for x, one in zip(local_leaves, shared, strict=True)])

    return extra, rebuild


def attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    *,
    QPos: named.AxisSelector = "position",
    KPos: named.AxisSelector = "key_position",
    Heads: named.AxisSelector = "heads",
    KVHeads: named.AxisSelector = "kv_heads",
    HeadDim: named.AxisSelector = "head_size",
    mask: masks_.Mask | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: NamedArray | Array | None = None,
    implementation: AttentionImplementation | tuple[AttentionImplementation, ...] | None = None,
    block_sizes: AttentionBlockSizes | dict | None = None,
    return_lse: bool = False,
) -> NamedArray | tuple[NamedArray, NamedArray]:
    """Attention over named axes.

    `q` has batch axes, `QPos`, `Heads` and `HeadDim`; `k` and `v` the same batch axes,
    `KPos` (or `QPos`'s name when `KPos` is absent: self-attention), `KVHeads` (or `Heads`
    when absent) and `HeadDim` (`v`'s may differ in size). Batch axes are every other axis
    of `q`, in any order. `sinks`: over `Heads`.

    `mask=None` attends to every key; causal attention is `mask=axkern.masks.Causal()`.
    Masks that hold arrays (`Segments`, `PrefixLM`, `Dense`) take `NamedArray`s over the batch
    axes (any subset, any order) and `QPos` / `KPos`; plain arrays lead with the batch axes
    flattened in `q`'s order (`Dense` may lead with 1).

    ```python
    out = axkern.attention(q, k, v, mask=axkern.masks.Causal())
    docs = axkern.masks.Segments(doc_ids, doc_ids.rename({"position": "key_position"}))
    out = axkern.attention(q, k, v, mask=axkern.masks.Causal() & docs)
    ```

    Under a haliax axis mapping with a mesh, batch axes and heads run in parallel (`KVHeads`
    mapped like `Heads`, or a single kv head); positions and head dims are gathered.

    **Returns:** the batch axes, `QPos`, `Heads` and `v`'s `HeadDim`, in `q`'s axis order; with
    `return_lse=True`, `(out, lse)`: `lse` over the batch axes, `QPos` and `Heads` (in `q`'s
    order, float32), each query's log-sum-exp of its visible scores (as `attention_positional`'s).

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> Batch, Pos, Heads, HeadDim = hax.Axis("batch", 1), hax.Axis("position", 32), hax.Axis("heads", 2), hax.Axis("head_size", 8)
    >>> q = k = v = hax.random.normal(jax.random.PRNGKey(0), (Batch, Pos, Heads, HeadDim))
    >>> axkern.attention(q, k, v, mask=axkern.masks.Causal()).axes == q.axes
    True

    ```
    """
    if sinks is not None and not isinstance(sinks, NamedArray):
        sinks = hax.named(jnp.asarray(sinks), (Heads.name if isinstance(Heads, hax.Axis) else Heads,))
    bound = ROLES.bind(locals(), VDim=getattr(HeadDim, "name", HeadDim))  # v's head dim may differ in size
    heads, kvheads = bound.axis("Heads"), bound.axis("KVHeads")
    sharding = SHARDING
    if kvheads.name != heads.name and kvheads.size == 1:
        sharding = SHARDING_MQA
    elif kvheads.name != heads.name and bound.sharded(SHARDING):
        if mesh_axes_for(heads) != mesh_axes_for(kvheads):
            raise ValueError(
                f"{NAME}: {heads.name} is mapped to mesh axes {mesh_axes_for(heads)!r} but "
                f"{kvheads.name} to {mesh_axes_for(kvheads)!r}; map both to the same mesh axes "
                "(each shard's query heads must find their kv heads on it)"
            )
    extra, rebuild = _mask_inputs(masks_.Full() if mask is None else mask, bound)

    def body(ctx, qs, ks, vs, ss, *mask_leaves):
        return attention_positional(
            qs,
            ks,
            vs,
            mask=rebuild(mask_leaves),
            sinks=ss,
            scale=scale,
            logits_soft_cap=logits_soft_cap,
            implementation=implementation,
            block_sizes=block_sizes,
            return_lse=return_lse,
        )

    out = named.Out(("batch", "QPos", "Heads", "VDim"), like="q", swap={"HeadDim": "VDim"})
    if return_lse:
        return bound.run(body, sharding, (out, named.Out(("batch", "QPos", "Heads"), like="q")), extra=extra)
    return bound.run(body, sharding, out, extra=extra)
