"""Fused linear cross-entropy: `loss = lse(z) - z[label]`, `z = softcap(x @ W)`, never materialised."""

from .api import OP, fused_cross_entropy, fused_cross_entropy_positional
from .blocks import CrossEntropyBlockSizes

__all__ = ["OP", "fused_cross_entropy", "fused_cross_entropy_positional", "CrossEntropyBlockSizes"]
