"""DeepEP-style MoE routing: layout counts, dispatch to expert-major order, weighted combine."""

from .api import (
    COMBINE,
    DISPATCH,
    LAYOUT,
    MoeDispatch,
    MoeLayout,
    MoeRouting,
    moe_combine_positional,
    moe_dispatch_positional,
    moe_layout_positional,
)
from .named import moe_combine, moe_dispatch, moe_layout

__all__ = [
    "COMBINE",
    "DISPATCH",
    "LAYOUT",
    "MoeDispatch",
    "MoeLayout",
    "MoeRouting",
    "moe_combine",
    "moe_combine_positional",
    "moe_dispatch",
    "moe_dispatch_positional",
    "moe_layout",
    "moe_layout_positional",
]
