"""short_conv, positional layer: every implementation against the float64 oracle, forward and all gradients.

The oracle is the `reference` implementation in float64; the reference itself is checked
against a NumPy loop that applies the definition position by position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axkern
from axkern.ops.short_conv import OP
from axkern.positional import short_conv as conv
from axkern.positional import short_conv_step as step
from tests.cases.short_conv import SEGMENTS, make, run
from tests.harness import check_rules, implementations
from tests.helpers import to64, x64

# every implementation that runs here: compiled on the CPU, or a Pallas kernel in interpret mode
IMPLS = implementations("short_conv", "cpu", interpret=True)
DTYPES = ["float32", "bfloat16"]


def check(impls, seed, batch, seq, channels, width, dtype, activation=None, block_sizes=None, **kw):
    arrays = make(seed, batch, seq, channels, width, dtype, **kw)
    what = f"short_conv W={width} {activation} {kw}"
    got = check_rules(run, impls, arrays, dtype, what, activation=activation, block_sizes=block_sizes)
    for y, _ in got.values():
        assert y.dtype == jnp.dtype(dtype)


def unpack(arrays):
    """`(x, w, b, seg, s0)` of a case, None where absent."""
    return tuple(arrays.get(k) for k in ("x", "w", "b", "seg", "s0"))


TILES = axkern.ConvBlockSizes(block_seq=8, block_channels=8)

# Each case runs every implementation (the Pallas kernels in interpret mode, which compile
# slowly on a CPU: a case costs one compilation per implementation). Between them the cases
# take both dtypes, both activations, segments on and off, the width without a halo (1), the
# shortest halo (2), the longest (8: 7 rows across 8-row tiles) and widths between, state and
# bias given or left out (zeros in the kernels), explicit 8 x 8 tiles or the heuristic's. No
# size is a multiple of a tile: ragged last tiles on both axes. "mixed" segments: each kind
# of segment ids in its own batch row.
CASES = {
    # id: (batch, seq, channels, width, dtype, activation, segments, state and bias, tiles)
    "w1-f32-silu-segments": (4, 21, 11, 1, "float32", "silu", "mixed", True, TILES),
    "w2-bf16-plain-heuristic-no-state": (2, 37, 19, 2, "bfloat16", None, "none", False, None),
    "w8-bf16-silu-segments": (4, 21, 11, 8, "bfloat16", "silu", "mixed", True, TILES),
    "w7-f32-silu-heuristic-no-state": (2, 21, 11, 7, "float32", "silu", "none", False, None),
    # 300 positions in 128-row tiles: pallas_gpu's backward walks 2 tiles per program, so two
    # programs, the second ragged and its second tile wholly past the sequence
    "w4-f32-silu-long": (1, 300, 10, 4, "float32", "silu", "random", True, axkern.ConvBlockSizes(128, 8)),
    # a sequence shorter than the halo: every position reads the initial state
    "w6-f32-plain-shorter-than-the-halo": (2, 3, 3, 6, "float32", None, "mixed", True, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_against_oracle(case):
    batch, seq, channels, width, dtype, activation, segments, extras, tiles = CASES[case]
    kw = dict(segments=segments, state=extras, bias=extras)
    check(IMPLS, width, batch, seq, channels, width, dtype, activation, tiles, **kw)


@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 70),
    channels=st.integers(1, 40),
    width=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
    activation=st.sampled_from([None, "silu"]),
    segments=st.sampled_from(SEGMENTS),
    extras=st.booleans(),
    impl=st.sampled_from(IMPLS),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=max(1, settings.default.max_examples // 3))
def test_random_shapes(batch, seq, channels, width, dtype, activation, segments, extras, impl, seed):
    # one implementation per example (the cases above run all of them), the heuristic's tiles
    kw = dict(segments=segments, state=extras, bias=extras)
    check([impl], seed, batch, seq, channels, width, dtype, activation, **kw)


def numpy_conv(x, w, b, seg, s0, activation):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    batch, seq, channels = x.shape
    width = w.shape[0]
    b = np.zeros(channels) if b is None else np.asarray(b, np.float64)
    s0 = np.zeros((batch, width - 1, channels)) if s0 is None else np.asarray(s0, np.float64)
    y = np.zeros_like(x)
    for i in range(batch):
        for t in range(seq):
            acc = b.copy()
            for k in range(width):
                src = t - k
                if seg is not None:
                    first = int(seg[i, 0])
                    if (src >= 0 and seg[i, src] != seg[i, t]) or (src < 0 and seg[i, t] != first):
                        continue
                acc += w[k] * (x[i, src] if src >= 0 else s0[i, width - 1 + src])
            y[i, t] = acc / (1 + np.exp(-acc)) if activation == "silu" else acc
    return y


@pytest.mark.parametrize("segments", ["none", "random", "every"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_reference_against_numpy_loop(segments, activation):
    x, w, b, seg, s0 = unpack(make(1, 2, 23, 5, 4, "float32", segments=segments))
    with x64():
        got = conv(
            *to64((x, w)),
            bias=to64(b),
            segment_ids=seg,
            initial_state=to64(s0),
            activation=activation,
            implementation="reference",
        )
    np.testing.assert_allclose(got, numpy_conv(x, w, b, seg, s0, activation), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("segments", ["none", "random"])
def test_decode_steps_chained_equal_the_full_convolution(width, segments):
    x, w, b, seg, s0 = unpack(make(3, 2, 13, 6, width, "float32", segments=segments))
    if seg is not None:  # decoding continues one document: keep the first segment only
        seg = jnp.zeros_like(seg)
    full, final = conv(
        x, w, bias=b, segment_ids=seg, initial_state=s0, activation="silu", return_final_state=True
    )
    state = s0
    for t in range(x.shape[1]):
        y_t, state = step(x[:, t], state, w, bias=b, activation="silu")
        np.testing.assert_allclose(y_t, full[:, t], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, final, rtol=0, atol=0)


def test_final_state_and_chunked_prefill():
    """Two chunks, the second continuing from the first's final state, equal one pass."""
    x, w, b, seg, s0 = unpack(make(4, 2, 30, 8, 4, "float32", segments="random"))
    full, final = conv(x, w, bias=b, segment_ids=seg, initial_state=s0, return_final_state=True)
    y1, mid = conv(x[:, :17], w, bias=b, segment_ids=seg[:, :17], initial_state=s0, return_final_state=True)
    # the state carried into chunk 2 must only be used by chunk 2's first segment if it continues chunk 1's last
    same_doc = (seg[:, 17] == seg[:, 16])[:, None, None]
    y2, end = conv(
        x[:, 17:],
        w,
        bias=b,
        segment_ids=seg[:, 17:],
        initial_state=jnp.where(same_doc, mid, 0),
        return_final_state=True,
    )
    np.testing.assert_allclose(jnp.concatenate([y1, y2], axis=1), full, rtol=1e-5, atol=1e-6)
    last_seg_len = np.asarray((seg == seg[:, -1:]).sum(1))
    for i in range(2):  # the final state holds only the last document's inputs
        if last_seg_len[i] >= 3:
            np.testing.assert_allclose(final[i], x[i, -3:])
    np.testing.assert_allclose(end, final, rtol=0, atol=1e-7)


def test_bad_input():
    x, w, b, seg, s0 = unpack(make(0, 2, 10, 4, 4, "float32"))
    with pytest.raises(ValueError, match="width must be in 1..8, got 9"):
        conv(x, jnp.zeros((9, 4)))
    with pytest.raises(
        ValueError, match=r"initial_state holds 2 previous inputs, but width 4 needs width - 1 = 3"
    ):
        conv(x, w, initial_state=s0[:, :2])
    with pytest.raises(ValueError, match="activation must be None or 'silu'"):
        conv(x, w, activation="gelu")
    with pytest.raises(Exception, match="weight"):  # jaxtyping: channels differ
        conv(x, jnp.zeros((4, 5)))
    with pytest.raises(Exception, match="segment_ids"):  # jaxtyping: float segment ids
        conv(x, w, segment_ids=seg.astype(jnp.float32))


def test_jit_vmap_and_explain():
    x, w, b, seg, s0 = unpack(make(0, 2, 20, 8, 4, "float32"))
    f = lambda x: conv(x, w, bias=b, segment_ids=seg, initial_state=s0)  # noqa: E731
    np.testing.assert_allclose(jax.jit(f)(x), f(x), rtol=1e-5, atol=1e-6)
    g = jax.vmap(lambda xi, si, s0i: conv(xi[None], w, segment_ids=si[None], initial_state=s0i[None])[0])(
        x, seg, s0
    )
    np.testing.assert_allclose(g, conv(x, w, segment_ids=seg, initial_state=s0), rtol=1e-5, atol=1e-6)
    d = axkern.explain(f, x)
    assert d.op == "short_conv" and d.spec.dim("width") == 4 and d.spec.flag("segments") is True


@pytest.mark.parametrize(
    ("dims", "reason"),
    [({"channels": 2**27 + 8}, "int32"), ({"batch": 65536}, "grid limit"), ({"channels": 12}, "16-byte")],
)
def test_cuda_refuses_sizes_its_kernels_cannot_hold(dims, reason):
    from axkern.core.op import Spec
    from axkern.ops.short_conv import cuda

    sizes = {"batch": 2, "seq": 64, "channels": 64, "width": 4, **dims}
    spec = Spec("short_conv", tuple(sizes.items()), "bfloat16", "gpu", "H200", "nvidia_h200")
    assert reason in cuda.supports(spec)


def test_gpu_order_puts_cuda_first():
    # measured faster than pallas_gpu and xla on the H200 (docs/ops/short_conv.md)
    assert OP.default_order["gpu"] == ("cuda", "pallas_gpu", "xla")
    assert OP.default_order["tpu"] == ("pallas_tpu", "xla")
