"""The Pallas TPU (Mosaic) layout of the chunk scan (`TpuLayout`, a `layout.Layout`), shared by
`ssd`'s and `mamba3`'s `pallas_tpu`: the same kernels as the Triton layout, with vectors laid out
for Mosaic's block rule (a block's last two dimensions are multiples of (8, 128) or the array's
own): columns as `[b, h, L, 1]` (blocks `[Q, 1]`) and rows as `[b, h, chunks, 1, Q]` (blocks
`[1, Q]`), so no kernel transposes a vector; `x`, `B`, `C` blocks are `[Q, P]` / `[Q, N]` with
`P`, `N` whole. All three grid dimensions are independent (`parallel`).

**Constraints**: the chunk a multiple of 8 (`TPU_MIN_CHUNK`, the sublanes). Scores, decays and
their gradients are `[Q, Q]` float32 in VMEM (about 1.3 MiB at `Q = 256`).

Verified in TPU interpret mode (`pltpu.InterpretParams`) only: Mosaic's lowering of the
transposed-operand products here is unchecked.
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .layout import Layout

__all__ = ["TPU_MIN_CHUNK", "TpuLayout"]

TPU_MIN_CHUNK = 8  # the sublanes


class TpuLayout(Layout):
    """Columns as `[b, h, L, 1]` (blocks `[Q, 1]`), rows as `[b, h, chunks, 1, Q]` (blocks
    `[1, Q]`), segment ids likewise; all three grid dimensions `parallel`."""

    def __init__(self, xt, bt, *, q, interpret, products=None, clean_x=False):
        super().__init__(xt, bt, q=q, interpret=interpret, products=products, clean_x=clean_x)
        self.col_spec = pl.BlockSpec((1, 1, q, 1), lambda b, h, c: (b, h, c, 0))
        self.row_spec = pl.BlockSpec((1, 1, 1, 1, q), lambda b, h, c: (b, h, c, 0, 0))
        self.seg_col_spec = pl.BlockSpec((1, q, 1), lambda b, h, c: (b, c, 0))
        self.seg_row_spec = pl.BlockSpec((1, 1, 1, q), lambda b, h, c: (b, c, 0, 0))
        self.col_shape = (self.batch, self.heads, self.lp, 1)
        self.row_shape = (self.batch, self.heads, self.chunks, 1, q)

    def to_col(self, a):  # [b, h, c, Q] -> [b, h, L, 1]; segment ids [b, c, Q] -> [b, L, 1]
        return a.reshape(*a.shape[:-2], self.lp, 1)

    def to_row(self, a):  # [.., c, Q] -> [.., c, 1, Q]
        return a.reshape(*a.shape[:-1], 1, self.q)

    def from_col(self, a):
        return a.reshape(self.batch, self.heads, self.chunks, self.q)

    from_row = from_col

    @staticmethod
    def col(ref):
        return ref[0, 0]

    @staticmethod
    def row(ref):
        return ref[0, 0, 0]

    @staticmethod
    def seg_col(ref):
        return ref[0]

    @staticmethod
    def seg_row(ref):
        return ref[0, 0]

    @staticmethod
    def put_col(ref, value):
        ref[0, 0] = value

    @staticmethod
    def put_row(ref, value):
        ref[0, 0, 0] = value

    def call_params(self) -> dict:
        return {
            "interpret": pltpu.InterpretParams() if self.interpret else False,
            "compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
        }
