"""Attention with composable masks (`axkern.masks`), GQA, logit soft-capping and sinks."""

from .api import OP, AttentionBlockSizes, attention, attention_positional

__all__ = ["OP", "AttentionBlockSizes", "attention", "attention_positional"]
