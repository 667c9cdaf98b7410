"""The Pallas TPU (Mosaic) layout of the chunk scan (`TpuLayout`, a `layout.Layout`), shared by
`ssd`'s and `mamba3`'s `pallas_tpu`: the same kernels as the Triton layout, with every
per-position vector in memory as rows `[b, h, chunks, 1, Q]` (blocks `[1, Q]`, Mosaic's block
rule: a block's last two dimensions are multiples of (8, 128) or the array's own), a column
`[Q, 1]` formed from its row inside the kernel (a transpose) and written back as one. In HBM a
TPU array's last dimension fills 128 lanes: a column array `[b, h, L, 1]` would take 128 times
its values' bytes (640 MiB for a float32 vector at the Mamba-2 2.7B layer, L 4096, where its
row form takes 5). `x`, `B`, `C` blocks are `[Q, P]` / `[Q, N]` with `P`, `N` whole. All three
grid dimensions are independent (`parallel`).

**Constraints**: the chunk a multiple of 8 (`TPU_MIN_CHUNK`, the sublanes). Scores, decays and
their gradients are `[Q, Q]` float32 in VMEM (about 1.3 MiB at `Q = 256`).

Verified in TPU interpret mode (`pltpu.InterpretParams`) and lowered for a TPU in CI, compiled
and run on a TPU v5e (`tests/tpu`).
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .layout import Layout

__all__ = ["TPU_MIN_CHUNK", "TpuLayout"]

TPU_MIN_CHUNK = 8  # the sublanes


class TpuLayout(Layout):
    """Every vector as rows `[b, h, chunks, 1, Q]` (blocks `[1, Q]`), segment ids as `[b,
    chunks, 1, Q]`; a column is its row transposed in the kernel. All three grid dimensions
    `parallel`."""

    def __init__(self, xt, bt, *, q, interpret, products=None, clean_x=False):
        super().__init__(xt, bt, q=q, interpret=interpret, products=products, clean_x=clean_x)
        self.col_spec = self.row_spec = pl.BlockSpec((1, 1, 1, 1, q), lambda b, h, c: (b, h, c, 0, 0))
        self.seg_col_spec = self.seg_row_spec = pl.BlockSpec((1, 1, 1, q), lambda b, h, c: (b, c, 0, 0))
        self.col_shape = self.row_shape = (self.batch, self.heads, self.chunks, 1, q)

    def to_row(self, a):  # [.., c, Q] -> [.., c, 1, Q]
        return a.reshape(*a.shape[:-1], 1, self.q)

    to_col = to_row

    def from_row(self, a):
        return a.reshape(self.batch, self.heads, self.chunks, self.q)

    from_col = from_row

    @staticmethod
    def col(ref):
        return ref[0, 0, 0].T  # [1, Q] -> [Q, 1]

    @staticmethod
    def row(ref):
        return ref[0, 0, 0]

    @staticmethod
    def seg_col(ref):
        return ref[0, 0].T

    @staticmethod
    def seg_row(ref):
        return ref[0, 0]

    @staticmethod
    def put_col(ref, value):
        ref[0, 0, 0] = value.T  # [Q, 1] -> [1, Q]

    @staticmethod
    def put_row(ref, value):
        ref[0, 0, 0] = value

    def call_params(self) -> dict:
        return {
            "interpret": pltpu.InterpretParams() if self.interpret else False,
            "compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
        }
