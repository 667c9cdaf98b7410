"""The positional layer: each op on plain `jax.Array`s, shapes and dtypes checked by jaxtyping + beartype."""

from .ops.fused_cross_entropy.api import fused_cross_entropy_positional as fused_cross_entropy
from .ops.short_conv.api import short_conv_positional as short_conv
from .ops.short_conv.api import short_conv_step_positional as short_conv_step

__all__ = ["fused_cross_entropy", "short_conv", "short_conv_step"]
