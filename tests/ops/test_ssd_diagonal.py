"""The chunk-scan kernels' diagonal term (`chunked/chunk_scan.py`): `scan(..., diag=d)` adds
`d_t (C_t · B_t) x_t` to `y_t`, values and every gradient (the weights' own included) equal to
the scan without it plus that term formed in XLA; Pallas GPU and TPU kernels in interpret mode,
lengths that are not a multiple of the chunk, segments, groups. Layouts whose kernels lack it
refuse it by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axkern.ops.chunked import kernel_scan
from axkern.ops.chunked.pallas_gpu import GpuLayout
from axkern.ops.chunked.pallas_tpu import TpuLayout
from tests.harness import jit


def _inputs(seed, b=2, length=40, heads=4, groups=2, p=16, n=16):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    x = jax.random.normal(ks[0], (b, length, heads, p), jnp.float32)
    a = -jax.nn.softplus(jax.random.normal(ks[1], (b, length, heads))) * 0.3
    s = jax.nn.softplus(jax.random.normal(ks[2], (b, length, heads)))
    B = jax.random.normal(ks[3], (b, length, groups, n), jnp.float32)
    C = jax.random.normal(ks[4], (b, length, groups, n), jnp.float32)
    init = jax.random.normal(ks[5], (b, heads, p, n), jnp.float32)
    d = jax.random.normal(ks[6], (b, length, heads), jnp.float32)
    seg = jnp.concatenate([jnp.zeros((b, 13), jnp.int32), jnp.ones((b, length - 13), jnp.int32)], axis=1)
    return x, a, s, B, C, init, d, seg


@pytest.mark.parametrize("layout", [GpuLayout, TpuLayout], ids=["gpu", "tpu"])
@pytest.mark.parametrize("segments", [False, True])
def test_the_diagonal_term_equals_the_scan_plus_the_term_in_xla(layout, segments):
    x, a, s, B, C, init, d, seg = _inputs(0)
    seg = seg if segments else jnp.zeros_like(seg)
    heads, groups = x.shape[2], B.shape[2]
    kw = dict(chunk_size=16, interpret=True)

    def with_term(x, a, s, B, C, init, d):
        return kernel_scan.scan(layout, x, a, s, B, C, seg, init, diag=d, **kw)

    def in_xla(x, a, s, B, C, init, d):
        y, final = kernel_scan.scan(layout, x, a, s, B, C, seg, init, **kw)
        per_head = lambda u: jnp.repeat(u, heads // groups, axis=2)  # noqa: E731
        self_scores = jnp.sum(per_head(C) * per_head(B), axis=-1)  # [b, L, H]
        return y + (d * self_scores)[..., None] * x, final

    args = (x, a, s, B, C, init, d)
    ks = jax.random.split(jax.random.PRNGKey(1), 2)
    cot = tuple(jax.random.normal(k, o.shape) for k, o in zip(ks, jax.eval_shape(in_xla, *args), strict=True))

    def values_and_gradients(args, cot):  # one compiled program each (interpret mode runs op by op otherwise)
        (got, pull_got), (want, pull_want) = jax.vjp(with_term, *args), jax.vjp(in_xla, *args)
        without = kernel_scan.scan(layout, *args[:5], seg, init, **kw)[0]
        return got, want, without, pull_got(cot), pull_want(cot)

    got, want, without, grads_got, grads_want = jit(values_and_gradients)(args, cot)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
    # the term changes `y` (a test of nothing otherwise)
    assert float(jnp.max(jnp.abs(got[0] - without))) > 0.1
    names = ("x", "a", "s", "B", "C", "initial state", "diag")
    for name, g, w in zip(names, grads_got, grads_want, strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-5 * scale, err_msg=name)


def test_a_layout_without_the_term_refuses_it():
    from axkern.ops.chunked.mosaic_gpu import MosaicLayout

    x, a, s, B, C, init, d, seg = _inputs(2)
    with pytest.raises(ValueError, match="MosaicLayout's kernels take no diagonal term"):
        kernel_scan.scan(MosaicLayout, x, a, s, B, C, seg, init, chunk_size=16, interpret=True, diag=d)


def test_mamba3s_kernel_core_takes_the_term_where_its_layout_does():
    # SISO through the Pallas kernels adds its correction in them; MIMO (later ranks) and the
    # Mosaic kernels' emulation (no diagonal term) leave it to XLA
    import jax.numpy as jnp

    from axkern.ops.chunked.mosaic_gpu.emulate import EmulatedLayout
    from axkern.ops.mamba3.common.kernel_core import kernel_core

    kw = dict(chunk_size=16, interpret=True, dtype=jnp.bfloat16)
    assert kernel_core(GpuLayout, mimo=False, **kw).diagonal
    assert kernel_core(TpuLayout, mimo=False, **kw).diagonal
    assert not kernel_core(GpuLayout, mimo=True, **kw).diagonal
    assert not kernel_core(EmulatedLayout, mimo=False, **kw).diagonal
    assert not kernel_core(GpuLayout, mimo=False, diagonal=False, **kw).diagonal


def test_mamba3s_pallas_gpu_leaves_the_correction_to_xla(monkeypatch):
    # the Triton kernels can take the term, but Mamba-3 on pallas_gpu adds its correction in XLA
    import axkern
    from axkern.ops.mamba3 import pallas_gpu
    from axkern.ops.mamba3.common import kernel_core
    from tests.cases.mamba3 import call, make
    from tests.harness import serving

    made = []

    def spy(*args, **kw):
        made.append(kernel_core.kernel_core(*args, **kw))
        return made[-1]

    monkeypatch.setattr(pallas_gpu, "kernel_core", spy)
    arrays, _ = make(0, 1, 32, 2, 16, 1, 16, 2, 0, "bfloat16", extras=False)
    with axkern.use(interpret=True), serving("pallas_gpu"):
        jax.eval_shape(lambda a: call("pallas_gpu", a, chunk_size=16), arrays)
    assert made and not made[0].diagonal
