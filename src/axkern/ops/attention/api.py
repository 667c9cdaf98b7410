"""`attention`: scaled dot-product attention with composable masks, named and positional.

`out[b, i, h] = sum_j softmax_j(s[b, h, i, j]) v[b, j, h // G]` with
`s = softcap(q[b, i, h] · k[b, j, h // G] · scale)` over the keys the mask makes visible
(`axkern.masks`), `G = heads // kv_heads` (grouped-query attention; `G = heads` is
multi-query), `softcap(s) = c · tanh(s / c)`. A sink adds `exp(sink[h])` to the softmax's
denominator (a learnable "attend to nothing"). A query that sees no key gets zeros.
"""

from __future__ import annotations

import math

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from axkern import masks as masks_
from axkern.core import compat, named
from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Float, checked

from . import cudnn, pallas_gpu, pallas_tpu, reference, xla
from .blocks import AttentionBlockSizes, bucket, heuristic

__all__ = ["attention", "attention_positional", "OP", "AttentionBlockSizes"]

NAME = "attention"

OP = Op(
    NAME,
    [
        Implementation(
            "xla",
            xla.attention,
            block_sizes=AttentionBlockSizes,
            heuristic=heuristic,
            backward="custom_vjp: flash-style recomputation per tile (float32 dk/dv accumulators)",
        ),
        Implementation(
            "pallas_gpu",
            pallas_gpu.attention,
            platforms=("gpu",),
            supports=pallas_gpu.supports,
            block_sizes=AttentionBlockSizes,
            heuristic=pallas_gpu.heuristic,
            interpretable=True,
            backward="custom_vjp: Pallas dq and dk/dv kernels, each with its own tiles",
        ),
        Implementation(
            "pallas_tpu",
            pallas_tpu.attention,
            platforms=("tpu",),
            block_sizes=AttentionBlockSizes,
            heuristic=pallas_tpu.heuristic,
            interpretable=True,
            backward="custom_vjp: block-sparse Pallas dq and dk/dv kernels (TPU interpret mode only)",
        ),
        Implementation(
            "cudnn",
            cudnn.attention,
            platforms=("gpu",),
            supports=cudnn.supports,
            backward="cuDNN's (jax.nn.dot_product_attention's custom_vjp)",
        ),
        Implementation("reference", reference.attention, backward="autodiff through materialised scores"),
    ],
    # GPU: cuDNN where its supports() holds (on the H200, 2026-11-30: 608 TFLOP/s forward
    # against pallas_gpu's 253 and xla's 80 at B2 L8192 H32 D128 causal bf16), then
    # pallas_gpu for what cuDNN cannot express through JAX (packed documents: 0.89 ms against
    # xla's 24.5 ms forward; 2.5-4x xla on every measured mask), then xla; pallas_tpu
    # (interpret-verified only) is explicit only
    default_order={"cpu": ("xla",), "gpu": ("cudnn", "pallas_gpu", "xla"), "tpu": ("xla",)},
    package=__package__,
    bucket=bucket,
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
    implementation: str | tuple[str, ...] | None = None,
    block_sizes: AttentionBlockSizes | dict | None = None,
) -> Float[Array, "batch q_len heads v_dim"]:
    """Attention on plain arrays, laid out as `jax.nn.dot_product_attention`'s (`BTNH`).

    **Arguments:**

    - `q`: `[batch, q_len, heads, head_dim]`; `k`: `[batch, kv_len, kv_heads, head_dim]`;
      `v`: `[batch, kv_len, kv_heads, v_dim]`. `heads` must be a multiple of `kv_heads`.
    - `mask`: an `axkern.masks.Mask`; default `masks.Causal()`. `masks.Full()` for none.
    - `scale`: default `head_dim ** -0.5`.
    - `logits_soft_cap`: `c` in `c · tanh(s / c)`, or None.
    - `sinks`: `[heads]` sink logits, or None.

    **Returns:** `[batch, q_len, heads, v_dim]` in `q`'s dtype. Empty `batch`, `q_len` or
    `heads` give an empty result, an empty `kv_len` zeros (no query sees a key); an empty
    `head_dim` or `v_dim` is a `ValueError`. Non-finite input: see the guide's rule.
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
        return jnp.zeros((b, sq, h, v.shape[3]), q.dtype)
    if logits_soft_cap is not None and not 0 < float(logits_soft_cap) < math.inf:
        raise ValueError(
            f"{NAME}: logits_soft_cap must be a finite number > 0 or None, got {logits_soft_cap!r}"
        )
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"{NAME}: scale must be a finite number or None, got {scale!r}")
    mask = masks_.Causal() if mask is None else mask
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
    )


def attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    *,
    QPos="position",
    KPos="key_position",
    Heads="heads",
    KVHeads="kv_heads",
    HeadDim="head_size",
    mask: masks_.Mask | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: NamedArray | Array | None = None,
    implementation: str | tuple[str, ...] | None = None,
    block_sizes: AttentionBlockSizes | dict | None = None,
) -> NamedArray:
    """Attention over named axes.

    `q` has batch axes, `QPos`, `Heads` and `HeadDim`; `k` and `v` the same batch axes,
    `KPos` (or `QPos`'s name when `KPos` is absent: self-attention), `KVHeads` (or `Heads`
    when absent) and `HeadDim` (`v`'s may differ in size). Batch axes are every other axis
    of `q`, in any order. `sinks`: over `Heads`. Masks index positions along `QPos` and
    `KPos`, and their batch dimension is the batch axes flattened in `q`'s order.

    Under a haliax axis mapping with a mesh, batch axes and heads run in parallel (`KVHeads`
    mapped like `Heads`, or a single kv head); positions and head dims are gathered.

    **Returns:** the batch axes, `QPos`, `Heads` and `v`'s `HeadDim`, in `q`'s axis order.
    """
    for arg, value in (("q", q), ("k", k), ("v", v)):
        named.require_named(NAME, arg, value)
    qpos = named.resolve(NAME, "q", q, QPos, "QPos")
    heads = named.resolve(NAME, "q", q, Heads, "Heads")
    head_dim = named.resolve(NAME, "q", q, HeadDim, "HeadDim")
    k_names = {a.name for a in k.axes}
    kpos_name = KPos.name if isinstance(KPos, hax.Axis) else KPos
    if kpos_name not in k_names and qpos.name in k_names:
        kpos_name = qpos.name
    kvh_name = KVHeads.name if isinstance(KVHeads, hax.Axis) else KVHeads
    if kvh_name not in k_names:
        kvh_name = heads.name
    kpos = named.resolve(NAME, "k", k, kpos_name, "KPos")
    kvheads = named.resolve(NAME, "k", k, kvh_name, "KVHeads")
    k_dim = named.resolve(NAME, "k", k, head_dim.name, "HeadDim")
    v_dim = named.resolve(NAME, "v", v, head_dim.name, "HeadDim")
    batch = named.without(q, qpos.name, heads.name, head_dim.name)
    k_batch = named.without(k, kpos.name, kvheads.name, k_dim.name)
    for arg, arr, got in (("k", k, k_batch), ("v", v, named.without(v, kpos.name, kvheads.name, v_dim.name))):
        if {a.name: a.size for a in got} != {a.name: a.size for a in batch}:
            raise ValueError(
                f"{NAME}: {arg} must carry q's batch axes {named.axes_str(batch)} besides its position, "
                f"heads and head dim; its axes are {named.axes_str(arr.axes)}"
            )
    n = len(batch)
    q_axes, k_axes, v_axes = (
        (*batch, qpos, heads, head_dim),
        (*batch, kpos, kvheads, k_dim),
        (*batch, kpos, kvheads, v_dim),
    )
    if isinstance(sinks, NamedArray):
        sinks = named.match_axes(NAME, "sinks", sinks, (heads,), "Heads")
    # a mask's arrays lead with the flattened batch: split it back into the batch axes to shard them
    leaves, treedef = jax.tree_util.tree_flatten(masks_.Causal() if mask is None else mask)
    lead = tuple(a.size for a in batch)
    mask_inputs, mask_axes, shared = [], [], []
    for i, leaf in enumerate(leaves):
        rest = tuple(hax.Axis(f"__mask{i}_{j}", size) for j, size in enumerate(jnp.shape(leaf)[1:]))
        if jnp.ndim(leaf) and leaf.shape[0] == 1 and math.prod(lead) != 1:  # shared by every batch row
            rest = (hax.Axis(f"__mask{i}_b", 1), *rest)
            mask_axes += [a.name for a in rest]
            mask_inputs.append((f"mask leaf {i}", leaf, rest))
            shared.append(True)
            continue
        if jnp.ndim(leaf) == 0 or leaf.shape[0] != math.prod(lead):
            raise ValueError(
                f"{NAME}: the mask's arrays must lead with q's batch axes {named.axes_str(batch)} flattened "
                f"({math.prod(lead)} rows) or with 1; {mask!r} has an array of shape {list(jnp.shape(leaf))}"
            )
        mask_axes += [a.name for a in rest]
        mask_inputs.append((f"mask leaf {i}", jnp.reshape(leaf, lead + leaf.shape[1:]), batch + rest))
        shared.append(False)
    replicated = (qpos.name, kpos.name, head_dim.name, v_dim.name, *mask_axes)
    if kvheads.name != heads.name and kvheads.size == 1:
        replicated += (kvheads.name,)  # MQA: every shard of heads reads the one kv head
    elif kvheads.name != heads.name and compat.current_mesh() is not None:
        if named.mesh_axes_for(heads) != named.mesh_axes_for(kvheads):
            raise ValueError(
                f"{NAME}: {heads.name} is mapped to mesh axes {named.mesh_axes_for(heads)!r} but "
                f"{kvheads.name} to {named.mesh_axes_for(kvheads)!r}; map both to the same mesh axes "
                "(each shard's query heads must find their kv heads on it)"
            )
    options = dict(
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        implementation=implementation,
        block_sizes=block_sizes,
    )

    def local(qs, ks, vs, ss, *leaves_local):
        fl = lambda a: named.flatten(a, n)  # noqa: E731
        m = treedef.unflatten(
            [
                x if one else jnp.reshape(x, (-1, *x.shape[n:]))
                for x, one in zip(leaves_local, shared, strict=True)
            ]
        )
        out = attention_positional(fl(qs), fl(ks), fl(vs), mask=m, sinks=ss, **options)
        return named.unflatten(out, qs.shape[:n])

    inputs = [
        ("q", named.ordered(q, q_axes), q_axes),
        ("k", named.ordered(k, k_axes), k_axes),
        ("v", named.ordered(v, v_axes), v_axes),
        None if sinks is None else ("sinks", sinks, (heads,)),
        *mask_inputs,
    ]
    out_axes = (*batch, qpos, heads, v_dim)
    out = named.shard_by_mapping(NAME, local, inputs, out_axes, replicated=replicated)
    if out is None:
        out = local(*[None if i is None else i[1] for i in inputs])
    result = hax.named(out, out_axes)
    return result.rearrange(tuple(a.name if a.name != head_dim.name else v_dim.name for a in q.axes))
