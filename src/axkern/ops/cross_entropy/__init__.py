"""Cross-entropy from precomputed logits: `loss = lse(z) - z[label]`, `z = softcap(logits)`, gradient formed in the forward."""

from .api import OP, cross_entropy_positional
from .named import cross_entropy

__all__ = ["OP", "cross_entropy", "cross_entropy_positional"]
