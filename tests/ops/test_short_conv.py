"""short_conv, positional layer: every implementation against the float64 oracle, forward and all gradients.

The oracle is the `reference` implementation in float64; the reference itself is checked
against a NumPy loop that applies the definition position by position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axkern
from axkern.core import backend
from axkern.ops.short_conv import OP
from axkern.positional import short_conv as conv
from axkern.positional import short_conv_step as step
from tests.helpers import assert_oracle_rule, to64, x64

# every implementation that runs here: compiled on its platform, or a Pallas kernel in interpret mode
IMPLS = [
    name
    for name, impl in OP.implementations.items()
    if name != "reference" and (impl.interpretable or backend.platform() in impl.platforms)
]
DTYPES = ["float32", "bfloat16"]


def random_segments(key, batch, seq, kind):
    """Segment-id runs: none, random boundaries, length-1 segments, or a boundary at every position."""
    if kind == "none":
        return None
    if kind == "every":
        return jnp.broadcast_to(jnp.arange(seq), (batch, seq)).astype(jnp.int32)
    p = 0.5 if kind == "short" else 0.15
    starts = jax.random.bernoulli(key, p, (batch, seq)).at[:, 0].set(False)
    return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def make(seed, batch, seq, channels, width, dtype, *, segments="random", state=True, bias=True):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    dt = jnp.dtype(dtype)
    x = jax.random.normal(ks[0], (batch, seq, channels), jnp.float32).astype(dt)
    w = (jax.random.normal(ks[1], (width, channels), jnp.float32) / np.sqrt(width)).astype(dt)
    b = jax.random.normal(ks[2], (channels,), jnp.float32).astype(dt) if bias else None
    s0 = jax.random.normal(ks[3], (batch, width - 1, channels), jnp.float32).astype(dt) if state else None
    seg = random_segments(ks[4], batch, seq, segments)
    cot = jax.random.normal(ks[5], (batch, seq, channels), jnp.float32)
    return x, w, b, seg, s0, cot


def run(impl, x, w, b, seg, s0, cot, activation, block_sizes=None):
    def f(x, w, b, s0):
        y = conv(
            x,
            w,
            bias=b,
            segment_ids=seg,
            initial_state=s0,
            activation=activation,
            implementation=impl,
            block_sizes=block_sizes,
        )
        return jnp.sum(y.astype(jnp.float32) * cot), y

    argnums = tuple(i for i, a in enumerate((x, w, b, s0)) if a is not None)
    (_, y), grads = jax.value_and_grad(f, argnums=argnums, has_aux=True)(x, w, b, s0)
    return y, grads


def oracle(x, w, b, seg, s0, cot, activation):
    with x64():
        y, g = run(
            "reference",
            *to64((x, w)),
            *(None if a is None else to64(a) for a in (b,)),
            seg,
            None if s0 is None else to64(s0),
            jnp.asarray(to64(cot)),
            activation,
        )
        return jax.tree.map(np.asarray, (y, g))


def check(impl, seed, batch, seq, channels, width, dtype, activation=None, block_sizes=None, **kw):
    args = make(seed, batch, seq, channels, width, dtype, **kw)
    want = oracle(*args, activation)
    same = run("reference", *args, activation)
    got = run(impl, *args, activation, block_sizes)
    assert got[0].dtype == jnp.dtype(dtype)
    assert_oracle_rule(got[0], same[0], want[0], dtype, f"{impl} {dtype} W={width} y")
    assert_oracle_rule(got[1], same[1], want[1], dtype, f"{impl} {dtype} W={width} grads")


# every width in float32; bfloat16 (whose rounding does not depend on the width) at the
# smallest, a middle and the largest width: the Pallas kernels run slowly in interpret mode
WIDTHS = [(w, "float32") for w in range(1, 9)] + [(w, "bfloat16") for w in (1, 4, 8)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("width,dtype", WIDTHS)
def test_every_width_against_oracle(impl, width, dtype):
    # S and C not multiples of any block; segments, state, bias and silu all on; several
    # sequence blocks, so every tap crosses a block edge somewhere.
    bs = axkern.ConvBlockSizes(block_seq=8, block_channels=8) if impl.startswith("pallas") else None
    check(impl, width, 2, 37, 19, width, dtype, activation="silu", block_sizes=bs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("segments", ["none", "random", "short", "every"])
@pytest.mark.parametrize("state", [True, False])
def test_segments_and_state(impl, segments, state):
    check(impl, 7, 3, 45, 33, 4, "float32", segments=segments, state=state, bias=not state)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_sequence_several_programs(impl):
    # 300 positions in 8-row tiles: pallas_gpu's backward walks 32 tiles per program, so two
    # programs, the second ragged; pallas_tpu gets 38 blocks.
    bs = axkern.ConvBlockSizes(block_seq=8, block_channels=8) if impl.startswith("pallas") else None
    check(impl, 11, 1, 300, 10, 4, "float32", activation="silu", block_sizes=bs)


@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 70),
    channels=st.integers(1, 40),
    width=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
    activation=st.sampled_from([None, "silu"]),
    segments=st.sampled_from(["none", "random", "short", "every"]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(batch, seq, channels, width, dtype, activation, segments, seed):
    for impl in IMPLS:
        check(impl, seed, batch, seq, channels, width, dtype, activation, segments=segments)


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
    x, w, b, seg, s0, _ = make(1, 2, 23, 5, 4, "float32", segments=segments)
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
    x, w, b, seg, s0, _ = make(3, 2, 13, 6, width, "float32", segments=segments)
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
    x, w, b, seg, s0, _ = make(4, 2, 30, 8, 4, "float32", segments="random")
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
    x, w, b, seg, s0, _ = make(0, 2, 10, 4, 4, "float32")
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
    x, w, b, seg, s0, _ = make(0, 2, 20, 8, 4, "float32")
    f = lambda x: conv(x, w, bias=b, segment_ids=seg, initial_state=s0)  # noqa: E731
    np.testing.assert_allclose(jax.jit(f)(x), f(x), rtol=1e-5, atol=1e-6)
    g = jax.vmap(lambda xi, si, s0i: conv(xi[None], w, segment_ids=si[None], initial_state=s0i[None])[0])(
        x, seg, s0
    )
    np.testing.assert_allclose(g, conv(x, w, segment_ids=seg, initial_state=s0), rtol=1e-5, atol=1e-6)
    d = axkern.explain(f, x)
    assert d.op == "short_conv" and d.spec.dim("width") == 4 and d.spec.flag("segments") is True


def test_gpu_order_puts_cuda_first():
    # measured faster than pallas_gpu and xla on the H200 (docs/ops/short_conv.md)
    assert OP.default_order["gpu"] == ("cuda", "pallas_gpu", "xla")
    assert OP.default_order["tpu"] == ("pallas_tpu", "xla")
