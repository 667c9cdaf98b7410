"""Short causal depthwise convolution (width 2..8), segment-aware, with decode steps."""

from .api import OP, STEP_OP, short_conv_positional, short_conv_step_positional
from .blocks import ConvBlockSizes
from .named import short_conv, short_conv_step

__all__ = [
    "OP",
    "STEP_OP",
    "short_conv",
    "short_conv_positional",
    "short_conv_step",
    "short_conv_step_positional",
    "ConvBlockSizes",
]
