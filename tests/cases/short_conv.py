"""short_conv's cases, shared by the CPU tests (tests/ops/test_short_conv.py) and the GPU tests
(tests/gpu/test_short_conv_gpu.py): random inputs with segment ids of several kinds, and a
runner returning the output and the gradients of x, the weight, and the bias and initial
state where given."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from axkern.core.op import get_op
from axkern.positional import short_conv
from tests.harness import jit

# segment ids: none; random boundaries; length-1 segments; a boundary at every position; one
# segment; "reused": random boundaries, the ids alternating between 0 and 1 (an id used again
# after another starts a new segment); "mixed": the batch rows take random, reused, short, every
# and one in turn (the kinds differ only in data, so one compiled case checks them all)
SEGMENTS = ["none", "random", "reused", "short", "every", "one", "mixed"]

# GPU cases over (batch, seq) = GPU_BATCH_SEQ, run by every GPU implementation: (channels,
# activation, block sizes, whether an implementation may refuse the channels). 777 channels
# are no whole 16-byte vector (the CUDA kernels refuse them, with the reason); 776 are; the
# small explicit tiles put halos across tiles
GPU_BATCH_SEQ = (3, 1000)
GPU_CASES = [
    (777, "silu", None, True),
    (776, "silu", None, False),
    (1024, None, {"block_seq": 8, "block_channels": 1024, "block_seq_backward": 16}, False),
]


def random_segments(rng, batch, seq, kind):
    """Segment ids of one of `SEGMENTS`' kinds, `[batch, seq]` int32 (None for "none")."""
    if kind == "none":
        return None
    if kind == "mixed":
        kinds = ["random", "reused", "short", "every", "one"]
        return np.concatenate([random_segments(rng, 1, seq, kinds[i % len(kinds)]) for i in range(batch)])
    if kind == "every":
        return np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
    if kind == "one":
        return np.zeros((batch, seq), np.int32)
    starts = rng.random((batch, seq)) < (0.5 if kind == "short" else 0.15)
    starts[:, 0] = False
    ids = np.cumsum(starts, axis=1, dtype=np.int32)
    return ids % 2 if kind == "reused" else ids


def make(seed, batch, seq, channels, width, dtype, *, segments="random", state=True, bias=True):
    """`x [batch, seq, channels]`, `w [width, channels]`, the cotangent `cot` of the output, and
    where asked the bias `b`, the initial state `s0 [batch, width - 1, channels]` and the
    segment ids `seg` (`SEGMENTS`' kinds; "random" starts a segment with probability 0.15,
    "short" with 0.5). NumPy draws them: no compilation per shape."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)

    def normal(*shape, scale=1.0):
        return jnp.asarray((rng.standard_normal(shape, np.float32) * scale).astype(dt))

    arrays = dict(
        x=normal(batch, seq, channels),
        w=normal(width, channels, scale=1 / np.sqrt(width)),
        cot=jnp.asarray(rng.standard_normal((batch, seq, channels), np.float32)),
    )
    if bias:
        arrays["b"] = normal(channels)
    if state:
        arrays["s0"] = normal(batch, width - 1, channels)
    seg = random_segments(rng, batch, seq, segments)
    if seg is not None:
        arrays["seg"] = jnp.asarray(seg)
    return arrays


def run(impl, arrays, *, activation=None, block_sizes=None):
    """The output `y` and the gradients of `sum(y * cot)` w.r.t. x, w, and b and s0 where given;
    `block_sizes` go to the implementations that take them."""
    diff = {k: arrays[k] for k in ("x", "w", "b", "s0") if k in arrays}
    rest = {k: arrays[k] for k in ("seg", "cot") if k in arrays}

    def f(d, rest):
        y = short_conv(
            d["x"],
            d["w"],
            bias=d.get("b"),
            segment_ids=rest.get("seg"),
            initial_state=d.get("s0"),
            activation=activation,
            implementation=impl,
            block_sizes=block_sizes if get_op("short_conv").implementations[impl].block_sizes else None,
        )
        return jnp.sum(y.astype(jnp.float32) * rest["cot"]), y

    (_, y), grads = jit(jax.value_and_grad(f, has_aux=True))(diff, rest)
    return y, tuple(grads[k] for k in diff)
