"""Attention with composable masks (`axkern.masks`), GQA, logit soft-capping and sinks."""

from .api import OP, attention_positional
from .blocks import AttentionBlockSizes
from .named import attention

__all__ = ["OP", "AttentionBlockSizes", "attention", "attention_positional"]
