"""Expert-parallel MoE transport: tokens to the devices holding their experts, and back."""

from .api import (
    COMBINE,
    DISPATCH,
    EpDispatch,
    EpLayout,
    moe_ep_combine_positional,
    moe_ep_dispatch_positional,
)
from .named import moe_ep_combine, moe_ep_dispatch

__all__ = [
    "COMBINE",
    "DISPATCH",
    "EpDispatch",
    "EpLayout",
    "moe_ep_combine",
    "moe_ep_combine_positional",
    "moe_ep_dispatch",
    "moe_ep_dispatch_positional",
]
