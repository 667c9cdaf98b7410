"""The machinery under every op: backend facts, the dispatcher, block sizes, named plumbing, mesh placement, typing.

Nothing here imports from `axkern.ops`.
"""

from . import backend, blocks, compat, config, mesh, named, op, typing
from .blocks import BlockSizes
from .config import use
from .op import Decision, FallbackWarning, Implementation, Op, Rejection, Spec, Unsupported, explain

__all__ = [
    "backend",
    "blocks",
    "compat",
    "config",
    "mesh",
    "named",
    "op",
    "typing",
    "BlockSizes",
    "Decision",
    "FallbackWarning",
    "Implementation",
    "Op",
    "Rejection",
    "Spec",
    "Unsupported",
    "explain",
    "use",
]
