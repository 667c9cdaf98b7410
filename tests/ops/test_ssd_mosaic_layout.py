"""`mosaic_gpu.ssd` on the CPU with its Mosaic GPU kernels replaced by their emulations
(`emulate.py`, the recurrences by `chunks.py`): the block sizes' mapping to a layout and
`MosaicLayout`'s glue between the kernels (which outputs are per head or per group, where the
chunk-scan backward's `dx` is added, the dg sums' products, the caller's layout) run as on the
GPU, through the whole layer and its gradients. Each stand-in checks its outputs' shapes and
dtypes against `jax.eval_shape` of the kernel it replaces, called with the same arguments. The
layer must then equal the emulated layout's (`EmulatedLayout`, or with the dg sums, which
`test_ssd_mosaic_gpu.py`'s oracle tests hold to the rule)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axkern.ops.chunked import chunks, kernel_scan
from axkern.ops.chunked import mosaic_gpu as M
from axkern.ops.chunked.mosaic_gpu import emulate as E
from axkern.ops.chunked.mosaic_gpu import layout as L
from axkern.ops.ssd import SSDBlockSizes, mosaic_gpu
from tests.cases.ssd import make
from tests.ops.test_ssd_mosaic_gpu import _emulated_runner, needs_mosaic

REAL = {k: getattr(M, k) for k in ("chunk_scan_bwd", "chunk_state_bwd", "fused_state_bwd", "fused_forward")}


def _heads(a, first):  # the caller's [b, L, h, d] as the kernels' [b, h, L, d]
    return jnp.moveaxis(a, 1, 2) if first else a


def _back(a, first):
    return jnp.moveaxis(a, 2, 1) if first else a


def _per_group(a, bt):
    g = M.operand_parts(bt)[0].shape[1]
    return a.reshape(a.shape[0], g, a.shape[1] // g, *a.shape[2:]).sum(2)


def _read(x, kw):  # `x` as a kernel reads it: non-finite values as 0 where `clean_x`
    return jnp.where(jnp.isfinite(x), x, 0).astype(x.dtype) if kw.get("clean_x") else x


def _checked(name, out, args, kw):
    want = jax.eval_shape(functools.partial(REAL[name], **kw), *args)
    spec = lambda t: [None if o is None else (o.shape, jnp.dtype(o.dtype)) for o in t]  # noqa: E731
    assert spec(out) == spec(want), (name, kw)
    return out


def _fused_forward(xt, w, dt, cum, f, keep, seg, bt, ct, s0, *, positions_first=False, **kw):
    x = _heads(xt, positions_first)
    seen = (jnp.sum(x.astype(jnp.float32) * 0, -1),) if kw.get("seen") else ()  # (`forward_lean.seen_rows`)
    x = _read(x, kw)
    states_in, final = chunks.recurrence(keep, E.emulate_chunk_state(x, w, bt, 64), s0.astype(jnp.float32))
    y = E.emulate_chunk_scan(x, dt, cum, f, seg, bt, ct, states_in, 64).astype(kw.get("y_dtype", jnp.float32))
    out = (_back(y, positions_first), final, states_in if kw.get("states", True) else None, *seen)
    args = (xt, w, dt, cum, f, keep, seg, bt, ct, s0)
    return _checked("fused_forward", out, args, kw | {"positions_first": positions_first})


def _chunk_scan_bwd(dy, xt, *rest, group_sums=False, positions_first=False, scores=False, **kw):
    first = positions_first
    out = list(
        E.emulate_chunk_scan_bwd(_heads(dy, first), _read(_heads(xt, first), kw), *rest, scores=scores)
    )
    out[0] = _back(out[0], first)
    if group_sums and not scores:
        out[5], out[6] = _per_group(out[5], rest[5]), _per_group(out[6], rest[5])
    kw |= dict(group_sums=group_sums, positions_first=first, scores=scores)
    return tuple(_checked("chunk_scan_bwd", out, (dy, xt, *rest), kw))


def _chunk_state_bwd(xt, w, bt, d_own, dx_in=None, *, group_sums=False, positions_first=False, **kw):
    dx, dw, db = E.emulate_chunk_state_bwd(_read(_heads(xt, positions_first), kw), w, bt, d_own, 64)
    if dx_in is not None:  # (the kernel adds it and writes dx in the input dtype)
        dx = (dx + _heads(dx_in, positions_first).astype(jnp.float32)).astype(xt.dtype)
    out = (_back(dx, positions_first), dw, _per_group(db, bt) if group_sums else db)
    args = (xt, w, bt, d_own) + (() if dx_in is None else (dx_in,))
    return _checked(
        "chunk_state_bwd", out, args, kw | dict(group_sums=group_sums, positions_first=positions_first)
    )


def _fused_state_bwd(
    xt, w, bt, keep, s, ds, d_final, dx_in=None, *, group_sums=False, positions_first=False, **kw
):
    d_own, d_keep, d_init = chunks.recurrence_bwd(keep, s, ds, d_final.astype(jnp.float32))
    dx, dw, db = E.emulate_chunk_state_bwd(_read(_heads(xt, positions_first), kw), w, bt, d_own, 64)
    dx = dx if dx_in is None else dx + _heads(dx_in, positions_first)
    out = (_back(dx, positions_first), dw, _per_group(db, bt) if group_sums else db, d_keep, d_init)
    args = (xt, w, bt, keep, s, ds, d_final) + (() if dx_in is None else (dx_in,))
    return _checked(
        "fused_state_bwd", out, args, kw | dict(group_sums=group_sums, positions_first=positions_first)
    )


@pytest.fixture
def emulated_kernels(monkeypatch):
    """`MosaicLayout`'s kernels as their emulations; `mosaic_gpu.ssd`'s recurrence kernels in
    interpret mode (the implementation refuses `interpret=True` itself)."""
    fakes = dict(
        fused_forward=_fused_forward,
        chunk_scan_bwd=_chunk_scan_bwd,
        chunk_state_bwd=_chunk_state_bwd,
        fused_state_bwd=_fused_state_bwd,
    )
    for name, fake in fakes.items():
        monkeypatch.setattr(L, name, fake)
    ssd = kernel_scan.ssd
    monkeypatch.setattr(
        mosaic_gpu.kernel_scan, "ssd", lambda *a, interpret, **kw: ssd(*a, interpret=True, **kw)
    )


class _Scores(E.EmulatedLayout):
    group_scores = True


# two groups of two heads over a partial last chunk at N 64; one group of four heads at N 128,
# where the state's columns make two blocks
GROUPS, COLUMNS = (1, 150, 4, 64, 2, 64), (1, 192, 4, 64, 1, 128)


@needs_mosaic
@pytest.mark.parametrize(
    "form, dims",
    [
        # the previous default (at P 128 still)
        (dict(forward="lean", group_sums="kernels", transposes="kernels"), GROUPS),
        (dict(forward="lean", backward="columns"), COLUMNS),  # dx, dw added over the column blocks
        (dict(forward="lean", group_sums="kernels", transposes="kernels", backward="columns"), GROUPS),
        (dict(forward="lean", group_sums="kernels", transposes="kernels", backward="columns"), COLUMNS),
        (dict(forward="fused", group_sums="kernels", backward="lean"), GROUPS),
        (dict(forward="lean", group_sums="scores", transposes="kernels", scan_backward="lean"), COLUMNS),
        (dict(forward="lean", group_sums="scores", backward="columns", scan_backward="lean"), GROUPS),
        (dict(forward="lean", group_sums="scores", backward="columns", scan_backward="lean"), COLUMNS),
    ],
    ids=str,
)
def test_the_layouts_glue_gives_the_emulated_layouts_layer(emulated_kernels, form, dims):
    arrays, seg = make(3, *dims, "bfloat16", segments=True)
    names = tuple(sorted(arrays))
    blocks = SSDBlockSizes(64, **form)
    got = _emulated_runner(names, call=lambda args: mosaic_gpu.ssd(*args, block_sizes=blocks))(arrays, seg)
    layout = _Scores if form.get("group_sums") == "scores" else E.EmulatedLayout
    want = _emulated_runner(names, layout=layout)(arrays, seg)
    # equal but for float32 sums in another order (the stand-ins' recurrence is XLA's, the emulated
    # layout's the Triton kernel's in interpret mode), which may move a bf16 result by one step
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        rtol = 2.0**-7 if a.dtype == jnp.bfloat16 else 0
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-5 * max(np.abs(e).max(), 1e-30))


@needs_mosaic
@pytest.mark.parametrize("planted", ["x", "B"])
@pytest.mark.parametrize("forward", ["lean", "fused"])
def test_the_guard_takes_the_forward_kernels_report_of_x(emulated_kernels, planted, forward):
    # the walking forwards report what they read of x (`Layout.reports_x`): a NaN in x reaches
    # the guard through that report alone (no pass of XLA's over x), and a NaN elsewhere through
    # XLA's check of the small inputs; either way the layer equals the emulated layout's, whose
    # forward reports nothing (XLA reads x), NaN in the same places of every output and gradient
    arrays, seg = make(3, *GROUPS, "bfloat16", segments=True)
    arrays[planted] = arrays[planted].at[0, 70, 1, 3].set(jnp.nan)
    names = tuple(sorted(arrays))
    blocks = SSDBlockSizes(64, forward=forward, group_sums="kernels", transposes="kernels")
    got = _emulated_runner(names, call=lambda args: mosaic_gpu.ssd(*args, block_sizes=blocks))(arrays, seg)
    want = _emulated_runner(names, layout=E.EmulatedLayout)(arrays, seg)
    assert np.isnan(np.asarray(want[0][0], np.float32)).any()  # (the case reaches the guard)
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        rtol = 2.0**-7 if a.dtype == jnp.bfloat16 else 0
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
        finite = np.nan_to_num(e, nan=0.0)
        np.testing.assert_allclose(
            np.nan_to_num(a, nan=0.0), finite, rtol=rtol, atol=1e-5 * max(np.abs(finite).max(), 1e-30)
        )


def test_the_kernels_report_reaches_the_guard(emulated_kernels, monkeypatch):
    # the report decides: a report that says "finite" for an x that is not leaves the guard's
    # masks out (NaN then spreads as the chunks mix it, not where the recurrence puts it), so the
    # layer differs from the emulated layout's; the test above would see a report not read
    real = _fused_forward

    def lying(*a, **kw):
        out = real(*a, **kw)
        return (*out[:3], jnp.zeros_like(out[3])) if kw.get("seen") else out

    monkeypatch.setattr(L, "fused_forward", lying)
    arrays, seg = make(3, *GROUPS, "bfloat16", segments=True)
    arrays["x"] = arrays["x"].at[0, 70, 1, 3].set(jnp.nan)
    names = tuple(sorted(arrays))
    blocks = SSDBlockSizes(64, forward="lean", group_sums="kernels", transposes="kernels")
    got = _emulated_runner(names, call=lambda args: mosaic_gpu.ssd(*args, block_sizes=blocks))(arrays, seg)
    want = _emulated_runner(names, layout=E.EmulatedLayout)(arrays, seg)
    y_got, y_want = (np.isnan(np.asarray(o[0][0], np.float32)) for o in (got, want))
    assert not np.array_equal(y_got, y_want)
