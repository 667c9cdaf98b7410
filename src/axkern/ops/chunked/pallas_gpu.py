"""The Pallas Triton layout of the chunk scan (`GpuLayout`, a `layout.Layout`), shared by the GPU
implementations (`ssd`'s and `mamba3`'s `pallas_gpu`; their `mosaic_gpu`, whose layout swaps some
stages for Mosaic GPU kernels): vectors as `[b, h, L]` blocks, read as `[Q]` and broadcast into
columns or rows in registers, the kernels compiled by Triton, and the recurrence between chunks
and its reverse as kernels. The sizes its kernels take (`GPU_MIN_DIM`, `GPU_MAX_CHUNK`,
`GPU_MAX_CHUNK_32BIT`) are checked by the implementations and their block-size heuristics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from axkern.core.blocks import next_power_of_2

from .layout import Layout

__all__ = ["GPU_MAX_CHUNK", "GPU_MAX_CHUNK_32BIT", "GPU_MIN_DIM", "GpuLayout"]

GPU_MIN_DIM = 16  # Triton dot tiles: head dim, state and chunk powers of two of at least 16
# The largest chunks whose chunk-scan backward kernel fits in a Hopper block's 227 KiB of
# shared memory: one [Q, Q] float32 tile alone is 256 KiB at Q = 256, and float32 products
# (fp16 and float32 inputs: exact, as three TF32 products) double the operand tiles.
GPU_MAX_CHUNK, GPU_MAX_CHUNK_32BIT = 128, 64


def _state_tile(p, n):
    """Rows of the `[P, N]` state per recurrence program: about 4096 float32 values a program."""
    return max(1, min(p, 4096 // n))


def _pick(vec, c):
    """Element `c` of a register vector (a gather-free read of a traced index)."""
    return jnp.sum(jnp.where(jnp.arange(vec.shape[0]) == c, vec, 0.0))


def _recurrence_kernel(keep_ref, own_ref, init_ref, states_ref, final_ref, *, chunks):
    """`S_{c+1} = keep_c S_c + own_c` over the chunks for one `[bp, N]` rows of one (batch,
    head) state; `states_ref[c]` gets the state entering chunk c."""
    keep = keep_ref[...]
    shape = init_ref.shape

    def body(c, s):
        states_ref[pl.ds(c, 1)] = s.reshape((1,) + shape)
        return _pick(keep, c) * s + own_ref[pl.ds(c, 1)].reshape(shape)

    final_ref[...] = lax.fori_loop(0, chunks, body, init_ref[...])


def _recurrence_bwd_kernel(
    keep_ref, states_ref, d_states_ref, d_final_ref, d_own_ref, d_keep_ref, d_init_ref, *, chunks
):
    """The recurrence backwards: `g` (the gradient of the state leaving chunk c) is `d own_c`,
    `sum(g ∘ S_c)` is this tile's part of `d keep_c`, `keep_c g + d S_c` flows to chunk c-1.
    `d_own_ref` is `d_states_ref`'s buffer (the call aliases them): chunk c's `d S_c` is read
    before its `d own_c` is written over it."""
    keep = keep_ref[...]
    shape = d_final_ref.shape
    lanes = jnp.arange(keep.shape[0])

    def body(i, carry):
        g, d_keep = carry
        c = chunks - 1 - i
        d_keep = d_keep + jnp.where(lanes == c, jnp.sum(g * states_ref[pl.ds(c, 1)].reshape(shape)), 0.0)
        flows = _pick(keep, c) * g + d_states_ref[pl.ds(c, 1)].reshape(shape)
        d_own_ref[pl.ds(c, 1)] = g.reshape((1,) + shape)
        return flows, d_keep

    g, d_keep = lax.fori_loop(0, chunks, body, (d_final_ref[...], jnp.zeros_like(keep)))
    d_init_ref[...] = g
    d_keep_ref[...] = d_keep


class GpuLayout(Layout):
    # TF32 tensor cores for the float32 products of 16-bit inputs (10 mantissa bits, more than
    # bf16's 7; Triton's exact float32 product runs on three of them)
    precision_16bit = lax.Precision.DEFAULT
    # float32 inputs: Triton's exact float32 product (`None`: `kernels.dot`'s HIGHEST), not
    # tf32x3: float32 is the accuracy path here (the GPU order gives float32 to `xla`)
    precision_32bit = None

    def __init__(self, xt, bt, *, q, interpret, products=None, clean_x=False):
        super().__init__(xt, bt, q=q, interpret=interpret, products=products, clean_x=clean_x)
        self.col_spec = self.row_spec = pl.BlockSpec((1, 1, q), lambda b, h, c: (b, h, c))
        self.seg_col_spec = self.seg_row_spec = pl.BlockSpec((1, q), lambda b, h, c: (b, c))
        self.col_shape = self.row_shape = (self.batch, self.heads, self.lp)

    def call_params(self) -> dict:
        # Triton named: jax 0.10 lowers a `pallas_call` without compiler parameters to Mosaic GPU
        return {"interpret": self.interpret, "compiler_params": pltriton.CompilerParams()}

    def to_col(self, a):  # [b, h, c, Q] -> [b, h, L]; segment ids [b, c, Q] -> [b, L]
        return a.reshape(*a.shape[:-2], self.lp)

    to_row = to_col

    def from_col(self, a):
        return a.reshape(self.batch, self.heads, self.chunks, self.q)

    from_row = from_col

    @staticmethod
    def col(ref):
        return ref[0, 0][:, None]

    @staticmethod
    def row(ref):
        return ref[0, 0][None, :]

    @staticmethod
    def seg_col(ref):
        return ref[0][:, None]

    @staticmethod
    def seg_row(ref):
        return ref[0][None, :]

    def put_col(self, ref, value):
        ref[0, 0] = value.reshape(self.q)

    def put_row(self, ref, value):
        ref[0, 0] = value.reshape(self.q)

    def _recurrence_specs(self, keep):
        """`(keep padded to a power of two, grid, keep spec, all-chunks state spec, one-state
        spec)`: one program per (batch, head, `bp` rows of the state)."""
        bp = _state_tile(self.p, self.n)
        cp = next_power_of_2(self.chunks)
        keep = jnp.pad(keep, [(0, 0), (0, 0), (0, cp - self.chunks)])
        grid = (self.batch, self.heads, self.p // bp)
        keep_spec = pl.BlockSpec((None, None, cp), lambda b, h, r: (b, h, 0))
        states = pl.BlockSpec((None, self.chunks, None, bp, self.n), lambda b, h, r: (b, 0, h, r, 0))
        one = pl.BlockSpec((None, None, bp, self.n), lambda b, h, r: (b, h, r, 0))
        return keep, grid, keep_spec, states, one

    def recurrence(self, keep, chunk_states, initial_state):
        """Stage 3 as a kernel, `S_{c+1} = keep_c S_c + own_c`: grid (batch, head, `P / bp` state
        rows), each program loops over the chunks with a `[bp, N]` float32 state in registers,
        reading `own` (`[b, c, h, P, N]`) and writing the states entering each chunk. Memory
        bound: 8 bytes per state value and chunk (read, written), 2 FLOPs; the reverse reads
        the states and their gradients and writes `d own`: 12 bytes, 4 FLOPs. One kernel each
        way, where two `lax.scan`s would launch hundreds of small kernels, copies and transposes."""
        keep, grid, keep_spec, states, one = self._recurrence_specs(keep)
        f32 = jnp.float32
        return pl.pallas_call(
            functools.partial(_recurrence_kernel, chunks=self.chunks),
            name="axkern_ssd_gpu_recurrence",
            grid=grid,
            in_specs=[keep_spec, states, one],
            out_specs=[states, one],
            out_shape=[
                jax.ShapeDtypeStruct(chunk_states.shape, f32),
                jax.ShapeDtypeStruct(initial_state.shape, f32),
            ],
            **self.call_params(),
        )(keep, chunk_states, initial_state)

    def recurrence_bwd(self, keep, states_in, d_states_in, d_final):
        keep, grid, keep_spec, states, one = self._recurrence_specs(keep)
        f32 = jnp.float32
        rows = grid[2]
        d_own, d_keep, d_init = pl.pallas_call(
            functools.partial(_recurrence_bwd_kernel, chunks=self.chunks),
            name="axkern_ssd_gpu_recurrence_bwd",
            grid=grid,
            in_specs=[keep_spec, states, states, one],
            out_specs=[
                states,
                pl.BlockSpec((None, None, None, keep.shape[-1]), lambda b, h, r: (b, h, r, 0)),
                one,
            ],
            out_shape=[
                jax.ShapeDtypeStruct(states_in.shape, f32),
                jax.ShapeDtypeStruct((self.batch, self.heads, rows, keep.shape[-1]), f32),
                jax.ShapeDtypeStruct(d_final.shape, f32),
            ],
            # `d own` over `d S_in` (read before written, chunk by chunk): one `[b, c, h, P, N]`
            # float32 buffer holds both
            input_output_aliases={2: 0},
            **self.call_params(),
        )(keep, states_in, d_states_in, d_final)
        return d_own, d_keep.sum(2)[..., : self.chunks], d_init
