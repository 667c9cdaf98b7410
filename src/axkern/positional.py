"""The positional layer: each op on plain `jax.Array`s, shapes and dtypes checked by jaxtyping + beartype."""

from .ops.fused_cross_entropy.api import fused_cross_entropy_positional as fused_cross_entropy

__all__ = ["fused_cross_entropy"]
