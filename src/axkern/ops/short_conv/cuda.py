"""Short causal convolution in CUDA (`native/short_conv/conv.cu`) through XLA FFI.

`y[b, t, c] = act(bias[c] + sum_{k < W} weight[k, c] · x~[b, t - k, c])`, `x~` reading the
state before position 0 and dropping taps across a change of segment id. Layout `[B, S, C]`,
channels innermost; FLOPs `O(W)` per element, so the bytes below bound it.

**Forward** (`AxkernShortConvFwd`): one thread owns a vector of channels (8 bytes; float32 2
channels) over `block_seq` consecutive positions and walks down the sequence in steps of 8
rows. The rows reach it through a private ring of 4 steps in shared memory, filled by
asynchronous copies (`cp.async`) 3 steps ahead of the step it computes, so the bytes in flight
do not hang on registers or occupancy; the `W-1` inputs before a step are carried in
registers: each input element is read from memory once, plus `W-1` halo rows per tile. Grid
`(channel blocks of 128 threads, tiles, batch)`.

**Backward** (`AxkernShortConvBwd`): one pass over `x` and `dy` through the same kind of ring
(8-byte vectors, two blocks of 128 threads an SM). Each thread recomputes the pre-activation from its
inputs, forms `g = dy · act'(pre)` in registers, keeps the last `W` values of `g` and writes
`dx(t) = sum_k w[k] g(t + k)` over the taps in `t`'s segment, while `dw[k] = sum_t g(t) x~(t -
k)` and `dbias = sum_t g(t)` accumulate in registers and are written once per tile of
`block_seq_backward` positions (float32 partial sums, `W + 1` rows of `C` per tile, added up by
one XLA reduction). The state's gradient (the first `W-1` positions only) is plain JAX, and
only when a state was given.

**Bytes.** Forward: read `x`, write `y` (`2·B·S·C` elements). Backward: read `x` and `dy`,
write `dx` (`3·B·S·C`), plus `(W+1)·C` float32 partial sums per tile. Halo rows add
`(W-1)/block_seq` (forward) and `3(W-1)/block_seq_backward` (backward) to the reads.

**Segments.** A change of segment id between `t - k` and `t` drops tap `k`. The kernel carries
the length of the current run of equal ids, capped at `W`, so it reads the ids as given (an id
used again after another starts a new run, without the cumulative count of changes the other
implementations form first); the state continues the sequence's first segment. A step whose
rows all keep every tap (no change of id within `W` rows: the common case) runs the plain
multiply-adds; only steps near a boundary select.

**One kernel a pass.** The weight and bias are read in their own dtype (float32, bfloat16 or
float16; others are converted first), and without an initial state the kernels take the rows
before position 0 as zeros instead of reading a zero array: each XLA operation around a
kernel costs a launch (docs/ops/short_conv.md has what each cost).

bf16 and float32 inputs whose channel count is a multiple of 16 bytes. SiLU on 16-bit inputs
uses the MUFU `tanh.approx` sigmoid, float32 the exact one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from axkern.core import native
from axkern.core.blocks import cdiv
from axkern.core.op import Implementation, Unsupported

from .blocks import ConvBlockSizes, cuda_heuristic, cuda_space
from .common import state_grad

LIBRARY = "short_conv"
DTYPES = ("bfloat16", "float32")
MAX_TILES = 65535  # CUDA grid y and z limits (tiles per sequence, batch)
MAX_CHANNELS = 2**27  # 8 rows of channels fit an int32 offset


def vector(dtype) -> int:
    """Channels per thread: one 16-byte access."""
    return 16 // jnp.dtype(dtype).itemsize


def supports(spec) -> str | None:
    if spec.dtype not in DTYPES:
        return f"the CUDA kernels take bfloat16 or float32 inputs, not {spec.dtype}"
    channels, n = spec.dim("channels"), vector(spec.dtype)
    if channels % n:
        return f"channels ({channels}) must be a multiple of {n} (the CUDA kernels take channels in 16-byte groups)"
    if spec.dim("batch") > MAX_TILES:
        return f"batch ({spec.dim('batch')}) above the CUDA grid limit {MAX_TILES}"
    if channels > MAX_CHANNELS:
        return f"channels ({channels}) above {MAX_CHANNELS}: the kernels' row offsets within a step are int32"
    return native.unavailable(LIBRARY)


def check_blocks(block_sizes: ConvBlockSizes, seq: int) -> None:
    for name in ("block_seq", "block_seq_backward"):
        rows = getattr(block_sizes, name) or block_sizes.block_seq
        if cdiv(seq, rows) > MAX_TILES:
            raise Unsupported(f"{name}={rows} gives more than {MAX_TILES} tiles for {seq} positions")


PARAM_DTYPES = ("float32", "bfloat16", "float16")  # the weight's and bias's, read as they are


def conv(x, weight, bias, segment_ids, initial_state, *, activation=None, block_sizes: ConvBlockSizes):
    check_blocks(block_sizes, x.shape[1])
    rows_bwd = block_sizes.block_seq_backward or block_sizes.block_seq
    cfg = (activation, segment_ids is not None, block_sizes.block_seq, rows_bwd)
    if segment_ids is None:
        segment_ids = jnp.zeros((1,), jnp.int32)  # not read
    weight, bias = (a if a.dtype.name in PARAM_DTYPES else a.astype(jnp.float32) for a in (weight, bias))
    if initial_state is not None:
        initial_state = initial_state.astype(x.dtype)
    return _conv(cfg, x, weight, bias, segment_ids.astype(jnp.int32), initial_state)


def _attrs(cfg, rows, state):
    activation, segments, _, _ = cfg
    return dict(
        rows=np.int64(rows),
        silu=np.int64(activation == "silu"),
        segments=np.int64(segments),
        has_state=np.int64(state is not None),
    )


def _state_operand(x, state):
    return x if state is None else state  # not read without a state (x: no constant to place)


def _forward(cfg, x, weight, bias, segment_ids, state):
    call = jax.ffi.ffi_call("AxkernShortConvFwd", jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, weight, bias, _state_operand(x, state), segment_ids, **_attrs(cfg, cfg[2], state))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(cfg, x, weight, bias, segment_ids, state):
    return _forward(cfg, x, weight, bias, segment_ids, state)


def _fwd(cfg, x, weight, bias, segment_ids, state):
    return _forward(cfg, x, weight, bias, segment_ids, state), (x, weight, bias, segment_ids, state)


def _bwd(cfg, residuals, dy):
    x, weight, bias, segment_ids, state = residuals
    activation, segments, _, rows = cfg
    batch, seq, channels = x.shape
    width = weight.shape[0]
    parts = batch * cdiv(seq, rows)
    out = (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct((parts, width + 1, channels), jnp.float32),
    )
    dx, part = jax.ffi.ffi_call("AxkernShortConvBwd", out)(
        x,
        weight,
        bias,
        _state_operand(x, state),
        segment_ids,
        dy.astype(x.dtype),
        **_attrs(cfg, rows, state),
    )
    dstate = None
    if state is not None:
        seg = segment_ids if segments else None
        dstate = state_grad(x, weight, bias, seg, state, dy, activation)
    total = jnp.sum(part, axis=0)  # one reduction: rows 0..W-1 of dw, row W of dbias
    return dx, total[:width].astype(weight.dtype), total[width].astype(bias.dtype), None, dstate


_conv.defvjp(_fwd, _bwd)


IMPLEMENTATION = Implementation(
    "cuda",
    conv,
    platforms=("gpu",),
    supports=supports,
    block_sizes=ConvBlockSizes,
    heuristic=cuda_heuristic,
    space=cuda_space,
    backward="custom_vjp: one CUDA pass (dx, partial dw/dbias per tile), state grad in JAX",
)
