"""`fused_cross_entropy`: the named function, its positional form, and the `Op` behind them.

The op's implementations compute three per-token statistics of `z = softcap(x @ w)`:
`lse`, `label_logit = z[label]` and `sum_logits` (only with label smoothing). Everything
else is assembled here from them, identically for every implementation:

    loss = lse - (1 - eps) * z[label] - (eps / V) * sum_v z_v + w_z * lse**2

for tokens that are kept (`where` true, label != `ignore_index`), 0 for the others, and NaN
for a kept token whose label is outside `[0, V)`. Under vocab-parallel sharding each shard
computes the statistics of its slice of the vocabulary and they are combined with
collectives (`lse` by a stable log-sum-exp across shards, the other two by `psum`).
"""

from __future__ import annotations

import functools

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from haliax import NamedArray
from jax import lax

from axkern.core import compat, config, named
from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Bool, Float, Int, checked

from . import pallas_gpu, pallas_tpu, reference, xla
from .blocks import (
    CrossEntropyBlockSizes,
    bucket,
    heuristic,
    loss_heuristic,
    pallas_gpu_heuristic,
    pallas_tpu_heuristic,
)
from .terms import token_losses

__all__ = [
    "fused_cross_entropy",
    "fused_cross_entropy_positional",
    "fused_cross_entropy_loss_positional",
    "OP",
    "LOSS_OP",
    "CrossEntropyBlockSizes",
]

NAME = "fused_cross_entropy"

OP = Op(
    NAME,
    [
        Implementation(
            "xla",
            xla.stats,
            block_sizes=CrossEntropyBlockSizes,
            heuristic=heuristic,
            backward="custom_vjp: recomputes each logits tile (streamed, no [tokens, vocab] buffer)",
        ),
        Implementation(
            "pallas_gpu",
            pallas_gpu.stats,
            platforms=("gpu",),
            supports=pallas_gpu.supports,
            block_sizes=CrossEntropyBlockSizes,
            heuristic=pallas_gpu_heuristic,
            interpretable=True,
            backward="custom_vjp: recomputes the logits in XLA (streamed tiles, as xla)",
        ),
        Implementation(
            "pallas_tpu",
            pallas_tpu.stats,
            platforms=("tpu",),
            supports=pallas_tpu.supports,
            block_sizes=CrossEntropyBlockSizes,
            heuristic=pallas_tpu_heuristic,
            interpretable=True,
            backward="custom_vjp: recomputes the logits in XLA (streamed tiles, as xla)",
        ),
        Implementation(
            "reference",
            reference.stats,
            backward="autodiff through materialised [tokens, vocab] logits",
        ),
    ],
    # GPU: the Triton forward is at parity with xla's (32.5 against 31.9 ms at llama3's size,
    # the same recomputing backward) without a logits tile in HBM; TPU: Mosaic, verified in
    # interpret mode only (no TPU here). Either falls back to xla when `supports()` refuses.
    default_order={"cpu": ("xla",), "gpu": ("pallas_gpu", "xla"), "tpu": ("pallas_tpu", "xla")},
    package=__package__,
    bucket=bucket,
)

LOSS_NAME = "fused_cross_entropy_loss"

LOSS_OP = Op(
    LOSS_NAME,
    [
        Implementation(
            "xla",
            xla.loss,
            block_sizes=CrossEntropyBlockSizes,
            heuristic=loss_heuristic,
            backward="gradients formed in the forward, one [block_tokens, vocab] logits block at a time "
            "(6·N·D·V FLOPs; the backward scales them)",
        ),
        Implementation(
            "reference",
            reference.loss,
            backward="autodiff through materialised [tokens, vocab] logits",
        ),
    ],
    default_order={"cpu": ("xla",), "gpu": ("xla",), "tpu": ("xla",)},
    package=__package__,
    bucket=bucket,
)

_REDUCTIONS = ("mean", "sum", None)


def _check_options(logit_soft_cap, logsumexp_weight, label_smoothing) -> None:
    if logit_soft_cap is not None and not float(logit_soft_cap) > 0:
        raise ValueError(f"{NAME}: logit_soft_cap must be > 0 or None, got {logit_soft_cap!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{NAME}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    float(logsumexp_weight)  # a Python number: it is a static option


def _stats(x, w, local_labels, *, logit_soft_cap, with_sum, implementation, block_sizes):
    """Dispatch: the op's per-token statistics over this `w`'s columns."""
    tokens, embed = x.shape
    vocab = w.shape[1]
    spec = OP.spec(
        {"tokens": tokens, "embed": embed, "vocab": vocab},
        jnp.result_type(x, w),
        logit_soft_cap=logit_soft_cap,
        with_sum=with_sum,
    )
    return OP(
        spec,
        x,
        w,
        local_labels,
        implementation=implementation,
        block_sizes=block_sizes,
        logit_soft_cap=logit_soft_cap,
        with_sum=with_sum,
    )


def _keep(labels, where, ignore_index):
    keep = jnp.ones(labels.shape, bool) if where is None else where
    if ignore_index is not None:
        keep = keep & (labels != ignore_index)
    return keep


def _check_labels(labels, keep, vocab):
    bad = keep & ((labels < 0) | (labels >= vocab))
    return eqx.error_if(
        labels, jnp.any(bad), f"{NAME}: a label outside [0, {vocab}) that is not ignore_index"
    )


@checked
def fused_cross_entropy_positional(
    x: Float[Array, "tokens embed"],
    w: Float[Array, "embed vocab"],
    labels: Int[Array, " tokens"],
    *,
    where: Bool[Array, " tokens"] | None = None,
    ignore_index: int | None = None,
    logit_soft_cap: float | None = None,
    logsumexp_weight: float = 0.0,
    label_smoothing: float = 0.0,
    check_labels: bool = False,
    implementation: str | tuple[str, ...] | None = None,
    block_sizes: CrossEntropyBlockSizes | dict | None = None,
) -> tuple[Float[Array, " tokens"], Float[Array, " tokens"]]:
    """Per-token fused linear cross-entropy on plain arrays.

    **Arguments:**

    - `x`: `[tokens, embed]` hidden states (any float dtype; accumulation is float32).
    - `w`: `[embed, vocab]` output projection.
    - `labels`: `[tokens]` integer targets in `[0, vocab)`.
    - `where`: optional `[tokens]` bool; false tokens get loss 0.
    - `ignore_index`: a label value whose tokens get loss 0 (e.g. `-100`).
    - `logit_soft_cap`: `c` in `z = c * tanh(z / c)`.
    - `logsumexp_weight`: z-loss weight `w` (adds `w * lse**2`).
    - `label_smoothing`: `eps` (mixes `eps / vocab` uniform mass into the target).
    - `check_labels`: raise at run time (`eqx.error_if`) on a kept label outside `[0, vocab)`.
    - `implementation`, `block_sizes`: override the dispatcher (see `axkern.explain`).

    **Returns:** `(loss, lse)`, each `[tokens]` float32. `loss` is 0 on dropped tokens and NaN
    on a kept token whose label is outside `[0, vocab)`.
    """
    _check_options(logit_soft_cap, logsumexp_weight, label_smoothing)
    vocab = w.shape[1]
    keep = _keep(labels, where, ignore_index)
    if check_labels:
        labels = _check_labels(labels, keep, vocab)
    lse, label_logit, sum_logits = _stats(
        x,
        w,
        labels,
        logit_soft_cap=logit_soft_cap,
        with_sum=bool(label_smoothing),
        implementation=implementation,
        block_sizes=block_sizes,
    )
    loss = token_losses(
        lse,
        label_logit,
        sum_logits,
        labels,
        keep,
        vocab,
        logsumexp_weight=logsumexp_weight,
        label_smoothing=label_smoothing,
    )
    return loss, lse


@checked
def fused_cross_entropy_loss_positional(
    x: Float[Array, "tokens embed"],
    w: Float[Array, "embed vocab"],
    labels: Int[Array, " tokens"],
    *,
    reduction: str | None = "mean",
    where: Bool[Array, " tokens"] | None = None,
    ignore_index: int | None = None,
    logit_soft_cap: float | None = None,
    logsumexp_weight: float = 0.0,
    label_smoothing: float = 0.0,
    check_labels: bool = False,
    implementation: str | tuple[str, ...] | None = None,
    block_sizes: CrossEntropyBlockSizes | dict | None = None,
) -> Float[Array, ""]:
    """The reduced fused linear cross-entropy (a float32 scalar) on plain arrays.

    Same arguments as `fused_cross_entropy_positional`, plus `reduction` (`"mean"` over kept
    tokens, 0 when none is kept, or `"sum"`). Under `jax.grad` the implementations of
    `fused_cross_entropy_loss` form the gradients in the forward pass (the per-token
    cotangents of a reduced loss are known once each token's logsumexp is), which saves the
    recomputation of the logits that per-token outputs need.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{LOSS_NAME}: reduction must be 'mean' or 'sum', got {reduction!r}")
    _check_options(logit_soft_cap, logsumexp_weight, label_smoothing)
    tokens, embed = x.shape
    vocab = w.shape[1]
    keep = _keep(labels, where, ignore_index)
    if check_labels:
        labels = _check_labels(labels, keep, vocab)
    if reduction == "mean":
        scale = 1.0 / jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)
    else:
        scale = jnp.ones((), jnp.float32)
    spec = LOSS_OP.spec(
        {"tokens": tokens, "embed": embed, "vocab": vocab},
        jnp.result_type(x, w),
        logit_soft_cap=logit_soft_cap,
        with_sum=bool(label_smoothing),
    )
    return LOSS_OP(
        spec,
        x,
        w,
        labels,
        keep,
        scale,
        implementation=implementation,
        block_sizes=block_sizes,
        logit_soft_cap=logit_soft_cap,
        logsumexp_weight=logsumexp_weight,
        label_smoothing=label_smoothing,
    )


def _loss_op_request(implementation):
    """What to ask `fused_cross_entropy_loss` for on behalf of a `fused_cross_entropy` call, or
    False when the request (argument, `axkern.use`, `AXKERN_IMPL_FUSED_CROSS_ENTROPY`) names an
    implementation that only the per-token op has (e.g. `pallas_gpu`): that call keeps it."""
    requested = implementation if implementation is not None else config.implementation_override(NAME)
    if requested is None:
        return None
    names = (requested,) if isinstance(requested, str) else tuple(requested)
    return requested if all(n in LOSS_OP.implementations for n in names) else False


def _as_tuple(mesh_axes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def _combine_over(mesh_axes, lse, label_logit, sum_logits):
    """Statistics of the whole vocabulary from each shard's statistics of its slice."""
    m = lax.pmax(lax.stop_gradient(lse), mesh_axes)
    lse = m + jnp.log(lax.psum(jnp.exp(lse - m), mesh_axes))
    return lse, lax.psum(label_logit, mesh_axes), lax.psum(sum_logits, mesh_axes)


def fused_cross_entropy(
    x: NamedArray,
    lm_head: NamedArray,
    labels: NamedArray,
    *,
    Embed: named.AxisSelector = "embed",
    Vocab: named.AxisSelector = "vocab",
    reduction: str | None = "mean",
    where: NamedArray | None = None,
    ignore_index: int | None = None,
    logit_soft_cap: float | None = None,
    logsumexp_weight: float = 0.0,
    label_smoothing: float = 0.0,
    return_lse: bool = False,
    check_labels: bool = False,
    implementation: str | tuple[str, ...] | None = None,
    block_sizes: CrossEntropyBlockSizes | dict | None = None,
):
    """Cross-entropy of `softcap(x @ lm_head)` against `labels`, without materialising the logits.

    **Arguments:**

    - `x`: hidden states with axis `Embed` plus any batch axes (e.g. `batch, position, embed`).
    - `lm_head`: axes `Embed` and `Vocab`, in either order.
    - `labels`: integer targets with exactly `x`'s batch axes, in any order.
    - `Embed`, `Vocab`: axis names or `hax.Axis` objects.
    - `reduction`: `"mean"` over kept tokens (0 when none is kept), `"sum"`, or `None` for a
      `NamedArray` of per-token losses with `x`'s batch axes.
    - `where`: optional bool `NamedArray` over a subset of the batch axes; false tokens are dropped.
    - `ignore_index`, `logit_soft_cap`, `logsumexp_weight`, `label_smoothing`, `check_labels`:
      as in `axkern.positional.fused_cross_entropy`.
    - `return_lse`: also return the per-token logsumexp (a `NamedArray` with the batch axes).
    - `implementation`, `block_sizes`: override the dispatcher.

    **Returns:** the loss (a float32 scalar `jax.Array`, ready for `jax.grad`; or a `NamedArray` of
    per-token losses when `reduction=None`), and the lse if `return_lse`.

    !!! info "Sharding"
        Under a haliax axis mapping with a mesh, batch axes mapped to mesh axes run data
        parallel and a mapped `Vocab` runs vocab parallel (each device holds a slice of
        `lm_head`; statistics are combined with `pmax`/`psum`). A mapped `Embed` is gathered.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{NAME}: reduction must be 'mean', 'sum' or None, got {reduction!r}")
    _check_options(logit_soft_cap, logsumexp_weight, label_smoothing)
    named.require_named(NAME, "x", x)
    named.require_named(NAME, "lm_head", lm_head)
    named.require_named(NAME, "labels", labels)
    named.require_named(NAME, "where", where, optional=True)
    embed = named.resolve(NAME, "x", x, Embed, "Embed")
    embed_w = named.resolve(NAME, "lm_head", lm_head, Embed, "Embed")
    vocab = named.resolve(NAME, "lm_head", lm_head, Vocab, "Vocab")
    if embed_w.size != embed.size:
        raise ValueError(f"{NAME}: x's {embed.name}={embed.size} but lm_head's {embed.name}={embed_w.size}")
    extra = named.without(lm_head, embed.name, vocab.name)
    if extra:
        raise ValueError(
            f"{NAME}: lm_head must have only axes {embed.name!r} and {vocab.name!r}; "
            f"its axes are {named.axes_str(lm_head.axes)}"
        )
    batch = named.without(x, embed.name)
    if not batch:
        raise ValueError(f"{NAME}: x has no batch axes besides {embed.name!r}: {named.axes_str(x.axes)}")
    xd = named.ordered(x, batch + (embed,))
    wd = named.ordered(lm_head, (embed, vocab))
    ld = named.match_axes(NAME, "labels", labels, batch, "x's batch axes")
    wh = None if where is None else named.broadcast_subset(NAME, "where", where, batch, "x's batch axes")
    options = dict(
        ignore_index=ignore_index,
        logit_soft_cap=logit_soft_cap,
        logsumexp_weight=logsumexp_weight,
        label_smoothing=label_smoothing,
        implementation=implementation,
        block_sizes=block_sizes,
    )
    if check_labels:
        ld = _check_labels(ld, _keep(ld, wh, ignore_index), vocab.size)

    # Vocab parallel when the mapping puts Vocab on mesh axes (only inside shard_map, below).
    vocab_mesh = named.mesh_axes_for(vocab) if compat.current_mesh() is not None else None
    if vocab_mesh is not None:
        batch_mesh = {m for a in batch for m in _as_tuple(named.mesh_axes_for(a))}
        if batch_mesh & set(_as_tuple(vocab_mesh)):
            raise ValueError(
                f"{NAME}: {vocab.name!r} and a batch axis are mapped to the same mesh axes "
                f"{sorted(batch_mesh & set(_as_tuple(vocab_mesh)))}"
            )

    def local(xs, ws, ls, whs, vocab_mesh=None):
        n = len(batch)
        lead_local = xs.shape[:n]
        xf, lf = named.flatten(xs, n), named.flatten(ls, n)
        wf = None if whs is None else named.flatten(whs, n)
        if vocab_mesh is None:
            loss, lse = fused_cross_entropy_positional(xf, ws, lf, where=wf, **options)
        else:
            offset = compat.axis_index(vocab_mesh) * ws.shape[1]
            stats = _stats(
                xf,
                ws,
                lf - offset,
                logit_soft_cap=logit_soft_cap,
                with_sum=bool(label_smoothing),
                implementation=implementation,
                block_sizes=block_sizes,
            )
            lse, label_logit, sum_logits = _combine_over(vocab_mesh, *stats)
            loss = token_losses(
                lse,
                label_logit,
                sum_logits,
                lf,
                _keep(lf, wf, ignore_index),
                vocab.size,
                logsumexp_weight=logsumexp_weight,
                label_smoothing=label_smoothing,
            )
        return named.unflatten(loss, lead_local), named.unflatten(lse, lead_local)

    out = named.shard_by_mapping(
        NAME,
        functools.partial(local, vocab_mesh=vocab_mesh),
        [
            ("x", xd, batch + (embed,)),
            ("lm_head", wd, (embed, vocab)),
            ("labels", ld, batch),
            None if wh is None else ("where", wh, batch),
        ],
        (batch, batch),
        replicated=(embed.name,),
    )
    loss_impl = _loss_op_request(implementation)
    if out is None and reduction is not None and not return_lse and loss_impl is not False:
        # unsharded reduced loss: the op whose gradients come from the forward pass
        n = len(batch)
        options["implementation"] = loss_impl
        return fused_cross_entropy_loss_positional(
            named.flatten(xd, n),
            wd,
            named.flatten(ld, n),
            reduction=reduction,
            where=None if wh is None else named.flatten(wh, n),
            **options,
        )
    loss, lse = out if out is not None else local(xd, wd, ld, wh)
    if reduction == "sum":
        result = jnp.sum(loss)
    elif reduction == "mean":
        count = jnp.sum(_keep(ld, wh, ignore_index))
        result = jnp.sum(loss) / jnp.maximum(count, 1).astype(loss.dtype)
    else:
        result = hax.named(loss, batch)
    if return_lse:
        return result, hax.named(lse, batch)
    return result
