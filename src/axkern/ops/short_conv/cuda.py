"""Short causal convolution in CUDA (`native/short_conv/conv.cu`) through XLA FFI.

`y[b, t, c] = act(bias[c] + sum_{k < W} weight[k, c] · x~[b, t - k, c])`, `x~` reading the
state before position 0 and dropping taps across a change of segment id. Layout `[B, S, C]`,
channels innermost; FLOPs `O(W)` per element, so the bytes below bound it.

**Forward** (`AxkernShortConvFwd`): one thread owns a vector of channels (8 bytes for `W <= 4`,
4 above; float32 8) over `block_seq` consecutive positions and walks down the sequence in steps
of 8 rows, loading a step's rows together and carrying the `W-1` inputs before it in
registers: each input element is read from memory once, plus `W-1` halo rows per tile. Grid
`(channel blocks of 128 threads, tiles, batch)`.

**Backward** (`AxkernShortConvBwd`): one pass over `x` and `dy`. Each thread recomputes the
pre-activation from its input ring, forms `g = dy · act'(pre)` in registers, keeps the last
`W` values of `g` in a second ring and writes `dx(t) = sum_k w[k] g(t + k)` over the taps in
`t`'s segment, while `dw[k] = sum_t g(t) x~(t - k)` and `dbias = sum_t g(t)` accumulate in
registers and are written once per tile of `block_seq_backward` positions (float32 partial
sums, added up by XLA: `W + 1` rows of `C` per tile). The state's gradient (the first `W-1`
positions only) is plain JAX.

**Bytes.** Forward: read `x`, write `y` (`2·B·S·C` elements). Backward: read `x` and `dy`,
write `dx` (`3·B·S·C`), plus `(W+1)·C` float32 partial sums per tile. Halo rows add
`(W-1)/block_seq` (forward) and `3(W-1)/block_seq_backward` (backward) to the reads.

**Segments.** A change of segment id between `t - k` and `t` drops tap `k` (the kernel
carries the length of the current run of equal ids, capped at `W`); the state continues the
sequence's first segment.

bf16 and float32 inputs whose channel count is a multiple of the vector width; the weight
and bias are passed as float32. SiLU on 16-bit inputs uses the MUFU `tanh.approx` sigmoid,
float32 the exact one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from axkern.core import native
from axkern.core.blocks import cdiv
from axkern.core.op import Unsupported

from .blocks import ConvBlockSizes
from .common import state_grad

LIBRARY = "short_conv"
DTYPES = ("bfloat16", "float32")
MAX_TILES = 65535  # CUDA grid y and z limits (tiles per sequence, batch)


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
    try:
        native.load(LIBRARY)
    except Unsupported as e:
        return str(e)
    return None


def check_blocks(block_sizes: ConvBlockSizes, seq: int) -> None:
    for name in ("block_seq", "block_seq_backward"):
        rows = getattr(block_sizes, name) or block_sizes.block_seq
        if cdiv(seq, rows) > MAX_TILES:
            raise Unsupported(f"{name}={rows} gives more than {MAX_TILES} tiles for {seq} positions")


def conv(x, weight, bias, segment_ids, initial_state, *, activation=None, block_sizes: ConvBlockSizes):
    check_blocks(block_sizes, x.shape[1])
    rows_bwd = block_sizes.block_seq_backward or block_sizes.block_seq
    cfg = (activation, segment_ids is not None, block_sizes.block_seq, rows_bwd)
    if segment_ids is None:
        segment_ids = jnp.zeros((1,), jnp.int32)  # not read
    return _conv(cfg, x, weight, bias, segment_ids.astype(jnp.int32), initial_state)


def _attrs(cfg, rows):
    activation, segments, _, _ = cfg
    return dict(rows=np.int64(rows), silu=np.int64(activation == "silu"), segments=np.int64(segments))


def _forward(cfg, x, weight, bias, segment_ids, state):
    call = jax.ffi.ffi_call("AxkernShortConvFwd", jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(
        x,
        weight.astype(jnp.float32),
        bias.astype(jnp.float32),
        state.astype(x.dtype),
        segment_ids,
        **_attrs(cfg, cfg[2]),
    )


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
        jax.ShapeDtypeStruct((parts, width, channels), jnp.float32),
        jax.ShapeDtypeStruct((parts, channels), jnp.float32),
    )
    dx, dw_part, db_part = jax.ffi.ffi_call("AxkernShortConvBwd", out)(
        x,
        weight.astype(jnp.float32),
        bias.astype(jnp.float32),
        state.astype(x.dtype),
        segment_ids,
        dy.astype(x.dtype),
        **_attrs(cfg, rows),
    )
    seg = segment_ids if segments else None
    dstate = state_grad(x, weight, bias, seg, state, dy, activation)
    dw = jnp.sum(dw_part, axis=0).astype(weight.dtype)
    db = jnp.sum(db_part, axis=0).astype(bias.dtype)
    return dx, dw, db, None, dstate


_conv.defvjp(_fwd, _bwd)
