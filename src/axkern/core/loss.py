"""Conventions shared by the loss ops (`fused_cross_entropy`, `cross_entropy`): reductions, option
checks, which tokens count, and the `(loss, lse)` output."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import equinox as eqx
import haliax as hax
import jax.numpy as jnp

__all__ = [
    "CrossEntropyOutput",
    "reduction_name",
    "check_options",
    "check_features",
    "kept",
    "reduce",
    "checked_labels",
]

REDUCTIONS = ("mean", "sum", None)


class CrossEntropyOutput(NamedTuple):
    """A cross-entropy with `return_lse=True`: the (reduced or per-token) loss and the per-token
    logsumexp."""

    loss: Any
    lse: Any


def reduction_name(op: str, reduction) -> str | None:
    """`"mean"`, `"sum"` or `None`; haliax's `hax.mean` / `hax.sum` are accepted for the strings."""
    if reduction is hax.mean:
        return "mean"
    if reduction is hax.sum:
        return "sum"
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"{op}: reduction must be 'mean', 'sum', None, hax.mean or hax.sum; got {reduction!r}"
        )
    return reduction


def check_options(op: str, logits_soft_cap, logsumexp_weight, label_smoothing) -> None:
    if logits_soft_cap is not None and not float(logits_soft_cap) > 0:
        raise ValueError(f"{op}: logits_soft_cap must be > 0 or None, got {logits_soft_cap!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not math.isfinite(float(logsumexp_weight)):  # a Python number: it is a static option
        raise ValueError(f"{op}: logsumexp_weight must be a finite number, got {logsumexp_weight!r}")


def check_features(op: str, **sizes: int) -> None:
    """A `ValueError` naming the first empty feature axis (`vocab`, `embed`): a loss over no
    classes, or logits from no features, has no meaning."""
    for axis, n in sizes.items():
        if n == 0:
            raise ValueError(f"{op}: {axis} must be at least 1, got 0")


def kept(labels, where, ignore_index):
    """The tokens that count: `where` (default all) and a label other than `ignore_index`."""
    if where is not None and where.dtype != jnp.bool_:
        raise TypeError(f"where must be a bool array (true: the token counts), got {where.dtype}")
    keep = jnp.ones(labels.shape, bool) if where is None else where
    if ignore_index is not None:
        keep = keep & (labels != ignore_index)
    return keep


def reduce(loss, keep, reduction):
    """`"sum"` of the per-token losses, or their `"mean"` over kept tokens (0 when none is kept)."""
    if reduction == "sum":
        return jnp.sum(loss)
    return jnp.sum(loss) / jnp.maximum(jnp.sum(keep), 1).astype(loss.dtype)


def checked_labels(op: str, labels, keep, vocab: int):
    """`labels`, raising at run time (`eqx.error_if`) on a kept label outside `[0, vocab)`."""
    bad = keep & ((labels < 0) | (labels >= vocab))
    return eqx.error_if(labels, jnp.any(bad), f"{op}: a label outside [0, {vocab}) that is not ignore_index")
