"""Fused linear cross-entropy: `loss = lse(z) - z[label]`, `z = softcap(x @ W)`, never materialised."""

from .api import (
    LOSS_OP,
    OP,
    CrossEntropyOutput,
    fused_cross_entropy_loss_positional,
    fused_cross_entropy_positional,
)
from .blocks import CrossEntropyBlockSizes
from .named import fused_cross_entropy

__all__ = [
    "OP",
    "CrossEntropyOutput",
    "LOSS_OP",
    "fused_cross_entropy",
    "fused_cross_entropy_positional",
    "fused_cross_entropy_loss_positional",
    "CrossEntropyBlockSizes",
]
