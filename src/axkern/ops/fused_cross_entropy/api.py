"""`fused_cross_entropy`: the positional functions and the `Op`s behind them (the named function is
in `named.py`).

The op's implementations compute three per-token statistics of `z = softcap(x @ w)`:
`lse`, `label_logit = z[label]` and `sum_logits` (only with label smoothing). Everything
else is assembled here from them, identically for every implementation:

    loss = lse - (1 - eps) * z[label] - (eps / V) * sum_v z_v + w_z * lse**2

for tokens that are kept (`where` true, label != `ignore_index`), 0 for the others, and NaN
for a kept token whose label is outside `[0, V)`. Under vocab-parallel sharding (`named.py`)
each shard computes the statistics of its slice of the vocabulary and they are combined with
collectives (`lse` by a stable log-sum-exp across shards, the other two by `psum`).
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp

from axkern.core import config, named
from axkern.core.loss import (
    CrossEntropyOutput,
    check_features,
    check_options,
    checked_labels,
    kept,
    reduction_name,
)
from axkern.core.loss import reduce as reduce_loss
from axkern.core.op import Implementation, Op
from axkern.core.typing import Array, Bool, Float, Int, checked

from . import mosaic_gpu, pallas_gpu, pallas_tpu, reference, xla
from .blocks import CrossEntropyBlockSizes, bucket
from .common import token_losses

__all__ = [
    "fused_cross_entropy_positional",
    "fused_cross_entropy_loss_positional",
    "CrossEntropyOutput",
    "OP",
    "LOSS_OP",
    "CrossEntropyBlockSizes",
]

NAME = "fused_cross_entropy"


def _gpu_order(spec) -> tuple[str, ...]:
    """`mosaic_gpu` first where it serves (a Hopper GPU, 16-bit inputs, `D` and `V` multiples
    of 64; docs/decisions.md has the figures), then `pallas_gpu` (the Triton forward, any GPU),
    then `xla`. Both kernels share xla's recomputing backward. Listing `mosaic_gpu` only where it
    serves keeps other GPUs, float32 and odd vocabularies free of fallback warnings and of
    strict mode's refusals."""
    return ("mosaic_gpu", "pallas_gpu", "xla") if mosaic_gpu.supports(spec) is None else ("pallas_gpu", "xla")


def _loss_gpu_order(spec) -> tuple[str, ...]:
    """`mosaic_gpu` where it serves (its undifferentiated value by the Hopper kernel; under a
    gradient the same path as `xla`), else `xla`."""
    return ("mosaic_gpu", "xla") if mosaic_gpu.supports(spec) is None else ("xla",)


OP = Op(
    NAME,
    [
        xla.IMPLEMENTATION,
        pallas_gpu.IMPLEMENTATION,
        mosaic_gpu.IMPLEMENTATION,
        pallas_tpu.IMPLEMENTATION,
        Implementation(
            "reference",
            reference.stats,
            backward="autodiff through materialised [tokens, vocab] logits",
        ),
    ],
    # GPU: `_gpu_order`; TPU: the Mosaic kernel, falling back to xla when `supports()` refuses
    default_order={"cpu": ("xla",), "gpu": _gpu_order, "tpu": ("pallas_tpu", "xla")},
    package=__package__,
    bucket=bucket,
)

LOSS_NAME = "fused_cross_entropy_loss"

# The reduced loss on a TPU: its Mosaic kernels (pallas_tpu/loss.py) first, as measured on the
# chip (compiled, within the oracle rule and faster than xla; more temporary memory: docs/tpu.md),
# and `supports()` or a block check sends what they cannot serve to xla.
LOSS_TPU_ORDER: tuple[str, ...] = ("pallas_tpu", "xla")

LOSS_OP = Op(
    LOSS_NAME,
    [
        xla.LOSS_IMPLEMENTATION,
        mosaic_gpu.LOSS_IMPLEMENTATION,
        pallas_tpu.LOSS_IMPLEMENTATION,
        Implementation(
            "reference",
            reference.loss,
            backward="autodiff through materialised [tokens, vocab] logits",
        ),
    ],
    default_order={"cpu": ("xla",), "gpu": _loss_gpu_order, "tpu": LOSS_TPU_ORDER},
    package=__package__,
    bucket=bucket,
)

CrossEntropyImplementation = Literal["xla", "pallas_gpu", "mosaic_gpu", "pallas_tpu", "reference"]
LossImplementation = Literal["xla", "mosaic_gpu", "pallas_tpu", "reference"]


def token_stats(x, w, local_labels, *, logits_soft_cap, with_sum, implementation, block_sizes):
    """Dispatch: the op's per-token statistics over this `w`'s columns (empty for no token)."""
    tokens, embed = x.shape
    vocab = w.shape[1]
    check_features(NAME, embed=embed, vocab=vocab)
    if tokens == 0:
        return (jnp.zeros((0,), jnp.promote_types(jnp.result_type(x, w), jnp.float32)),) * 3
    spec = OP.spec(
        {"tokens": tokens, "embed": embed, "vocab": vocab},
        jnp.result_type(x, w),
        logits_soft_cap=logits_soft_cap,
        with_sum=with_sum,
    )
    return OP(
        spec,
        x,
        w,
        local_labels,
        implementation=implementation,
        block_sizes=block_sizes,
        logits_soft_cap=logits_soft_cap,
        with_sum=with_sum,
    )


def per_token_loss(
    x,
    w,
    labels,
    *,
    where,
    ignore_index,
    logits_soft_cap,
    logsumexp_weight,
    label_smoothing,
    check_labels,
    implementation,
    block_sizes,
):
    """Per-token `(loss, lse)`, each `[tokens]` float32."""
    vocab = w.shape[1]
    keep = kept(labels, where, ignore_index)
    if check_labels:
        labels = checked_labels(NAME, labels, keep, vocab)
    lse, label_logit, sum_logits = token_stats(
        x,
        w,
        labels,
        logits_soft_cap=logits_soft_cap,
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
def fused_cross_entropy_positional(
    x: Float[Array, "tokens embed"],
    w: Float[Array, "embed vocab"],
    labels: Int[Array, " tokens"],
    *,
    reduction: str | None | object = "mean",
    where: Bool[Array, " tokens"] | None = None,
    ignore_index: int | None = None,
    logits_soft_cap: float | None = None,
    logsumexp_weight: float = 0.0,
    label_smoothing: float = 0.0,
    return_lse: bool = False,
    check_labels: bool = False,
    implementation: CrossEntropyImplementation | tuple[CrossEntropyImplementation, ...] | None = None,
    block_sizes: CrossEntropyBlockSizes | dict | None = None,
    logit_soft_cap: float | None = None,
) -> Float[Array, ""] | Float[Array, " tokens"] | CrossEntropyOutput:
    """Fused linear cross-entropy on plain arrays, with the named function's defaults.

    **Arguments:**

    - `x`: `[tokens, embed]` hidden states (any float dtype; accumulation is float32).
    - `w`: `[embed, vocab]` output projection.
    - `labels`: `[tokens]` integer targets in `[0, vocab)`.
    - `reduction`: `"mean"` over kept tokens (0 when none is kept), `"sum"`, or `None` for the
      per-token losses (`hax.mean` / `hax.sum` are accepted for the strings).
    - `where`: optional `[tokens]` bool; false tokens get loss 0.
    - `ignore_index`: a label value whose tokens get loss 0 (e.g. `-100`).
    - `logits_soft_cap`: `c` in `z = c * tanh(z / c)` (`logit_soft_cap`: its former spelling).
    - `logsumexp_weight`: z-loss weight `w` (adds `w * lse**2`).
    - `label_smoothing`: `eps` (mixes `eps / vocab` uniform mass into the target).
    - `return_lse`: also return the per-token logsumexp.
    - `check_labels`: raise at run time (`eqx.error_if`) on a kept label outside `[0, vocab)`.
    - `implementation`, `block_sizes`: override the dispatcher (see `axkern.explain`).

    **Returns:** the loss (a float32 scalar, or `[tokens]` float32 when `reduction=None`: 0 on
    dropped tokens, NaN on a kept token whose label is outside `[0, vocab)`, with NaN gradients
    from that token), or `CrossEntropyOutput(loss, lse)` with `return_lse`. No token gives an
    empty per-token loss and a reduced loss of 0; an empty `embed` or `vocab` is a `ValueError`.

    A reduced loss without `return_lse` runs `fused_cross_entropy_loss`, whose gradients are
    formed in the forward pass, unless `implementation` names one only the per-token op has.

    ```python
    loss = axkern.positional.fused_cross_entropy(x, w, labels)              # mean over tokens
    per_token, lse = axkern.positional.fused_cross_entropy(x, w, labels, reduction=None, return_lse=True)
    ```

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> x, w, labels = jnp.ones((4, 8)), jnp.zeros((8, 10)), jnp.zeros(4, jnp.int32)
    >>> loss, lse = axkern.positional.fused_cross_entropy(x, w, labels, reduction=None, return_lse=True)
    >>> loss.shape, round(float(lse[0]), 4)
    ((4,), 2.3026)

    ```
    """
    reduction = reduction_name(NAME, reduction)
    logits_soft_cap = named.deprecated_alias(
        NAME, "logit_soft_cap", "logits_soft_cap", logit_soft_cap, logits_soft_cap, None
    )
    check_options(NAME, logits_soft_cap, logsumexp_weight, label_smoothing)
    options = dict(
        where=where,
        ignore_index=ignore_index,
        logits_soft_cap=logits_soft_cap,
        logsumexp_weight=logsumexp_weight,
        label_smoothing=label_smoothing,
        check_labels=check_labels,
        block_sizes=block_sizes,
    )
    loss_impl = _loss_op_request(implementation)
    if reduction is not None and not return_lse and loss_impl is not False:
        return fused_cross_entropy_loss_positional(
            x, w, labels, reduction=reduction, implementation=loss_impl, **options
        )
    loss, lse = per_token_loss(x, w, labels, implementation=implementation, **options)
    if reduction is not None:
        loss = reduce_loss(loss, kept(labels, where, ignore_index), reduction)
    return CrossEntropyOutput(loss, lse) if return_lse else loss


@checked
def fused_cross_entropy_loss_positional(
    x: Float[Array, "tokens embed"],
    w: Float[Array, "embed vocab"],
    labels: Int[Array, " tokens"],
    *,
    reduction: str | object = "mean",
    where: Bool[Array, " tokens"] | None = None,
    ignore_index: int | None = None,
    logits_soft_cap: float | None = None,
    logsumexp_weight: float = 0.0,
    label_smoothing: float = 0.0,
    check_labels: bool = False,
    implementation: LossImplementation | tuple[LossImplementation, ...] | None = None,
    block_sizes: CrossEntropyBlockSizes | dict | None = None,
    logit_soft_cap: float | None = None,
) -> Float[Array, ""]:
    """The reduced fused linear cross-entropy (a float32 scalar) on plain arrays.

    Same arguments as `fused_cross_entropy_positional`, with `reduction` `"mean"` (over kept
    tokens, 0 when none is kept) or `"sum"`. Under `jax.grad` its implementations form the
    gradients in the forward pass (the per-token cotangents of a reduced loss are known once
    each token's logsumexp is), which saves the recomputation of the logits that per-token
    outputs need.

    **Example:**

    ```python
    >>> import haliax as hax, jax, jax.numpy as jnp, axkern
    >>> x, w, labels = jnp.ones((4, 8)), jnp.zeros((8, 10)), jnp.zeros(4, jnp.int32)
    >>> round(float(axkern.positional.fused_cross_entropy_loss(x, w, labels)), 4)
    2.3026

    ```
    """
    reduction = reduction_name(LOSS_NAME, reduction)
    if reduction is None:
        raise ValueError(f"{LOSS_NAME}: reduction must be 'mean' or 'sum', got None")
    logits_soft_cap = named.deprecated_alias(
        LOSS_NAME, "logit_soft_cap", "logits_soft_cap", logit_soft_cap, logits_soft_cap, None
    )
    check_options(NAME, logits_soft_cap, logsumexp_weight, label_smoothing)
    tokens, embed = x.shape
    vocab = w.shape[1]
    check_features(NAME, embed=embed, vocab=vocab)
    if tokens == 0:  # a sum over no token, and a mean over no kept token: 0
        return jnp.zeros((), jnp.float32)
    keep = kept(labels, where, ignore_index)
    if check_labels:
        labels = checked_labels(NAME, labels, keep, vocab)
    if reduction == "mean":
        scale = 1.0 / jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)
    else:
        scale = jnp.ones((), jnp.float32)
    spec = LOSS_OP.spec(
        {"tokens": tokens, "embed": embed, "vocab": vocab},
        jnp.result_type(x, w),
        logits_soft_cap=logits_soft_cap,
        with_sum=bool(label_smoothing),
        w_dtype=jnp.dtype(w.dtype).name,  # decides how dw is accumulated
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
        logits_soft_cap=logits_soft_cap,
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
