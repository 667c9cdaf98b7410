"""The positional layer: each op on plain `jax.Array`s, shapes and dtypes checked by jaxtyping + beartype."""

from .ops.attention.api import attention_positional as attention
from .ops.cross_entropy.api import cross_entropy_positional as cross_entropy
from .ops.fused_cross_entropy.api import fused_cross_entropy_loss_positional as fused_cross_entropy_loss
from .ops.fused_cross_entropy.api import fused_cross_entropy_positional as fused_cross_entropy
from .ops.mamba3.api import mamba3_positional as mamba3
from .ops.mamba3.api import mamba3_step_positional as mamba3_step
from .ops.moe.api import moe_combine_positional as moe_combine
from .ops.moe.api import moe_dispatch_positional as moe_dispatch
from .ops.moe.api import moe_layout_positional as moe_layout
from .ops.moe_ep.api import moe_ep_combine_positional as moe_ep_combine
from .ops.moe_ep.api import moe_ep_dispatch_positional as moe_ep_dispatch
from .ops.short_conv.api import short_conv_positional as short_conv
from .ops.short_conv.api import short_conv_step_positional as short_conv_step
from .ops.ssd.api import ssd_positional as ssd
from .ops.ssd.api import ssd_step_positional as ssd_step

__all__ = [
    "attention",
    "cross_entropy",
    "fused_cross_entropy",
    "fused_cross_entropy_loss",
    "mamba3",
    "mamba3_step",
    "moe_combine",
    "moe_dispatch",
    "moe_ep_combine",
    "moe_ep_dispatch",
    "moe_layout",
    "short_conv",
    "short_conv_step",
    "ssd",
    "ssd_step",
]
