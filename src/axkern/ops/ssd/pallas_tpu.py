"""Mamba-2 SSD as Pallas TPU (Mosaic) kernels, forward and backward (`common/kernels.py`).

The same kernels as `pallas_gpu`, with vectors laid out for Mosaic's block rule (a block's
last two dimensions are multiples of (8, 128) or the array's own): columns as
`[b, h, L, 1]` (blocks `[Q, 1]`) and rows as `[b, h, chunks, 1, Q]` (blocks `[1, Q]`), so no
kernel transposes a vector; `x`, `B`, `C` blocks are `[Q, P]` / `[Q, N]` with `P`, `N` whole.
All three grid dimensions are independent (`parallel`).

**Constraints**: the chunk a multiple of 8 (sublanes). Scores, decays and their gradients
are `[Q, Q]` float32 in VMEM (about 1.3 MiB at `Q = 256`).

**No TPU is available to this project**: verified in TPU interpret mode
(`pltpu.InterpretParams`) only, so it is in no default order; Mosaic's lowering of the
transposed-operand products here is unchecked.
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from axkern.core.op import Unsupported

from .blocks import TPU_MIN_CHUNK as MIN_CHUNK
from .blocks import refuse_mosaic_gpu_forms
from axkern.ops.chunked import kernels as chunk_kernels


class TpuLayout(chunk_kernels.Layout):
    def __init__(self, xt, bt, *, q, interpret, products=None):
        super().__init__(xt, bt, q=q, interpret=interpret, products=products)
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


def ssd(x, dt, A, B, C, D, z, segment_ids, initial_state, *, block_sizes, interpret=False):
    refuse_mosaic_gpu_forms(block_sizes)
    q = block_sizes.chunk_size
    if q < MIN_CHUNK:
        raise Unsupported(f"chunk_size={q} is below {MIN_CHUNK} (TPU sublanes)")
    return chunk_kernels.ssd(
        TpuLayout, x, dt, A, B, C, D, z, segment_ids, initial_state, chunk_size=q, interpret=bool(interpret)
    )
