"""The SSD Mosaic GPU kernels' own Python bodies run on the CPU through a shim of the Mosaic GPU
calls they make (`plgpu`, `pl.ds`, `pl.when`, `lax.axis_index`, `lax.fori_loop`, loads and
`wgmma` sums on numpy arrays), block by block over the grid, against the kernels' emulation
(`emulate.py`). Beside the values, the shim checks what the GPU would get wrong silently (or
hang on): a per-row vector broadcast along columns (or the reverse), shared memory read by
`wgmma` or a TMA store after a write from registers without `commit_smem`, shared memory read
before its TMA load's barrier was waited, shared memory written (from registers or by a TMA
load) while a TMA store may still read it, a barrier armed by a second copy before the first was
waited, a wait on a barrier no copy armed, and a kernel ending with stores in flight or loads
never waited. It does not model registers, swizzling or timing: the GPU tests carry those."""

from __future__ import annotations

import functools
import itertools
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from axkern.ops.chunked.mosaic_gpu import body as Bo
from axkern.ops.chunked.mosaic_gpu import emulate as E
from axkern.ops.chunked.mosaic_gpu import forward as F
from axkern.ops.chunked.mosaic_gpu import forward_lean as FL
from axkern.ops.chunked.mosaic_gpu import forward_tiled as FT
from axkern.ops.chunked.mosaic_gpu import operands, sizes, tiles
from axkern.ops.chunked.mosaic_gpu import scan as Sc
from axkern.ops.chunked.mosaic_gpu import scan_backward as SB
from axkern.ops.chunked.mosaic_gpu import state as St
from axkern.ops.chunked.mosaic_gpu import tiled as T


class _State:
    def __init__(self):
        self.hazards, self.grid = [], {}
        self.dirty, self.pending, self.loading = [], [], []

    def hazard(self, msg):
        self.hazards.append(msg)

    def reads(self, r, what):
        if isinstance(r, _Ref) and r.smem:
            if any(np.shares_memory(d, r.a) for d, _ in self.dirty):
                self.hazard(f"{what} reads {r.name} written without commit_smem")
            if any(np.shares_memory(d, r.a) for d, _ in self.loading):
                self.hazard(f"{what} reads {r.name} before its TMA load was waited")


ST = _State()


class _DS:
    def __init__(self, start, size):
        self.start, self.size = int(start), int(size)


def _index(i):
    if isinstance(i, tuple):
        return tuple(_index(x) for x in i)
    if isinstance(i, _DS):
        return slice(i.start, i.start + i.size)
    if isinstance(i, (np.integer, jax.Array)):
        return int(i)
    return i


class _At:
    def __init__(self, ref):
        self.ref = ref

    def __getitem__(self, i):
        return _Ref(self.ref.a[_index(i)], self.ref.smem, self.ref.name)


class _Ref:
    """A kernel ref over a numpy array (a view where indexed, as `.at` is)."""

    def __init__(self, a, smem=False, name="?"):
        self.a, self.smem, self.name = a, smem, name

    at = property(lambda self: _At(self))
    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)

    def transpose(self, perm):
        return _Ref(self.a.transpose(perm), self.smem, self.name)

    def __getitem__(self, i):
        return np.array(self.a[_index(i)])

    def __setitem__(self, i, v):
        view = self.a[_index(i)]
        if self.smem:
            if any(np.shares_memory(src, view) for src, _ in ST.pending):
                ST.hazard(f"write to {self.name} while a TMA store may read it")
            ST.dirty.append((view, self.name))
        v = np.asarray(v)
        assert v.shape == view.shape, (self.name, v.shape, view.shape)
        view[...] = v.astype(self.a.dtype)


def _products(shape, terms, acc=None):
    out = np.zeros(shape, np.float64) if acc is None else np.asarray(acc, np.float64).copy()
    for a, b, trans in terms:
        ST.reads(a, "wgmma")
        ST.reads(b, "wgmma")
        av = a.a if isinstance(a, _Ref) else np.asarray(a)
        bv = b.a if isinstance(b, _Ref) else np.asarray(b)
        assert av.dtype.itemsize == 2 and bv.dtype.itemsize == 2, (
            "a wgmma operand not 16-bit",
            av.dtype,
            bv.dtype,
        )
        out += av.astype(np.float64) @ (bv.T if trans else bv).astype(np.float64)
    assert out.shape == tuple(shape), (out.shape, shape)
    return out.astype(np.float32)


class _Vec(np.ndarray):
    layout = None


def _load(ref, layout=None, optimized=False):
    ST.reads(ref, "load")
    v = np.array(ref.a) if ref.a.dtype == np.int32 else np.array(ref.a).astype(np.float32)
    if layout in ("ROW", "COL"):
        v = v.view(_Vec)
        v.layout = layout
    return v


def _broadcast(v, shape, dims):
    layout = getattr(v, "layout", None)
    if v.ndim == 1 and layout is not None:
        want = "ROW" if list(dims) == [0] else "COL"
        if layout != want:
            ST.hazard(f"a {layout} vector broadcast along dims {dims} into {shape}")
    return jax.lax.broadcast_in_dim(jnp.asarray(np.asarray(v)), shape, dims)


class _Layout:
    def reduce(self, k):
        return "ROW" if k == 1 else "COL"


class _Plgpu:
    class Layout:
        WGMMA = _Layout()

    @staticmethod
    def broadcasted_iota(dtype, shape, dim, layout=None):
        return jax.lax.broadcasted_iota(dtype, shape, dim)

    @staticmethod
    def commit_smem():
        ST.dirty.clear()

    @staticmethod
    def wait_smem_to_gmem(n, wait_read_only=False):
        ST.pending[:] = ST.pending[len(ST.pending) - n :] if n else []

    @staticmethod
    def copy_smem_to_gmem(src, dst, reduction_op=None):
        ST.reads(src, "TMA store")
        if reduction_op == "add":
            dst.a[...] += src.a
        else:
            dst.a[...] = src.a.astype(dst.a.dtype)
        ST.pending.append((src.a, src.name))

    @staticmethod
    def copy_gmem_to_smem(src, dst, barrier):
        if any(b == barrier for _, b in ST.loading):
            ST.hazard(f"{barrier} armed again before its first copy was waited")
        if any(np.shares_memory(s, dst.a) for s, _ in ST.pending):
            ST.hazard(f"a TMA load into {dst.name} while a TMA store may read it")
        dst.a[...] = src.a
        ST.loading.append((dst.a, barrier))

    @staticmethod
    def barrier_wait(barrier):
        if not any(b == barrier for _, b in ST.loading):
            ST.hazard(f"a wait on {barrier}, which no copy armed")
        ST.loading[:] = [x for x in ST.loading if x[1] != barrier]

    @staticmethod
    def layout_cast(x, layout):
        return x

    class ACC:
        @staticmethod
        def init(value):
            return np.asarray(value, np.float64).copy()

    @staticmethod
    def wgmma(acc, a, b):
        acc.a[...] = _products(acc.a.shape, [(a, b, False)], acc=acc.a)


def _run_state(fn):
    def run(init):
        ref = _Ref(np.asarray(init, np.float64).copy())
        fn(ref)
        return ref.a.astype(np.float32)

    return run


def _when(cond):
    return lambda fn: fn() if cond else None


class _Barriers:
    class _At:
        def __getitem__(self, i):
            return ("barrier", i)

    at = _At()


MODULES = (Bo, T, Sc, SB, St, F, FL, FT)  # the kernels' modules the shim replaces Mosaic GPU in


def install_shim(monkeypatch, modules=MODULES):
    """The shim in place of Mosaic GPU in the kernels' `modules` (restored by `monkeypatch`);
    the shim's state, fresh."""
    global ST
    ST = _State()
    lax_shim = types.SimpleNamespace(
        axis_index=lambda name: ST.grid[name],
        div=lambda a, b: int(a) // int(b),
        rem=lambda a, b: int(a) % int(b),
        broadcast_in_dim=_broadcast,
        fori_loop=lambda lo, hi, body, init: functools.reduce(lambda v, i: body(i, v), range(lo, hi), init),
        bitcast_convert_type=jax.lax.bitcast_convert_type,  # `operand_parts`, outside the kernels
    )
    for m in modules:
        monkeypatch.setattr(m, "plgpu", _Plgpu)
        monkeypatch.setattr(m, "lax", lax_shim)
        monkeypatch.setattr(m, "pl", types.SimpleNamespace(ds=_DS, when=_when, run_state=_run_state))
        for name, fn in (("mosaic_gpu_load", _load), ("products", _products)):
            if hasattr(m, name):
                monkeypatch.setattr(m, name, fn)
    monkeypatch.setattr(T, "_load", lambda ref, rows, layout: _load(ref.at[rows], layout=layout))
    return ST


@pytest.fixture
def shim(monkeypatch):
    """The kernels' modules with the shim in place of Mosaic GPU (restored after the test)."""
    return install_shim(monkeypatch)


def _smem(tiles):
    bf16 = lambda d: jnp.dtype(d) == jnp.bfloat16  # noqa: E731
    return tuple(
        _Ref(np.zeros(s, ml_dtypes.bfloat16 if bf16(d) else np.float32), True, f"smem{k}{s}")
        for k, (s, d) in enumerate(tiles)
    )


def _run(body, ins, outs, tiles, grid, names=("batch", "heads", "chunks"), over=None):
    """`body` over the grid (`names`), block by block; the outputs' arrays. `over` (`{output
    index: input index}`, `tiles.launch`'s): the body reads that input through the output's ref
    (the output starting as the input's values)."""
    refs = [
        tuple(_Ref(np.asarray(x)) for x in a) if isinstance(a, tuple) else _Ref(np.asarray(a)) for a in ins
    ]
    out_refs = [_Ref(o) for o in outs]
    for o, i in (over or {}).items():
        out_refs[o].a[...] = refs[i].a
        refs[i] = out_refs[o]
    for index in itertools.product(*map(range, grid)):
        ST.grid.update(zip(names, index, strict=True))
        ST.dirty.clear(), ST.pending.clear(), ST.loading.clear()
        body(*refs, *out_refs, (_smem(tiles), _Barriers()))
        if ST.pending:
            ST.hazard(f"a kernel ends with {len(ST.pending)} TMA stores in flight")
        if ST.loading:
            ST.hazard(f"a kernel ends with {len(ST.loading)} TMA loads never waited")
    return [o.a for o in out_refs]


def _errors(
    q,
    b=1,
    h=2,
    g=1,
    c=2,
    p=64,
    n=64,
    wide=True,
    add=False,
    split=False,
    lean=False,
    scores=False,
    clean_x=False,
    over=False,
):
    """Each kernel's largest difference from its emulation (relative to the emulation's largest
    magnitude; a 16-bit result's less one step of its dtype at each value, where two float32
    sums round apart) at chunks of `q`: the scan, its backward, the state and the state backward.
    `split`: `B`, `C` float32, which the kernels take as two bf16 halves each (Mamba-3's).
    `lean`: the lean scan backward (`scan_backward.lean_reason`); `scores` (lean, `add`): `dg` summed per
    group in `dB`'s place, `dC` without `dg B` (`group_scores.py`). `clean_x`: `x` with non-finite
    values, which every kernel takes as 0 (the emulation is given them as 0). `over` (a 16-bit
    cotangent): the scan backward writes `dx` over `dy` (`tiles.launch`'s `over`), each block reading
    its `dy` through `dx`'s ref."""
    length, f32, bf16 = c * q, np.float32, jnp.bfloat16
    k = jax.random.split(jax.random.PRNGKey(0), 8)
    x = jax.random.normal(k[0], (b, h, length, p)).astype(bf16)
    bt, ct = (jax.random.normal(k[i], (b, g, length, n)) for i in (1, 2))
    bt, ct = (bt, ct) if split else (bt.astype(bf16), ct.astype(bf16))
    bp, cp = operands.operand_parts(bt), operands.operand_parts(ct)  # the kernels' parts
    parts = len(bp)
    dt = jax.nn.softplus(jax.random.normal(k[3], (b, h, length)))
    cum = jnp.cumsum((-dt * 0.01).reshape(b, h, c, q), -1).reshape(b, h, length)  # slow: every tile weighs
    seg = jnp.cumsum(jax.random.bernoulli(k[5], 0.03, (b, length)), axis=1).astype(jnp.int32)
    states = jax.random.normal(k[6], (b, c, h, p, n))
    dy = jax.random.normal(k[7], (b, h, length, p))
    dy = dy if wide else dy.astype(bf16)
    f, w = jnp.exp(cum), jnp.exp(cum) * dt
    kw = dict(rep=h // g, dtype=bf16, rows_of=tiles.rows_indexer(False)) | (
        {"clean_x": True} if clean_x else {}
    )
    x_read = x  # what the kernels read; the emulation takes x
    if clean_x:
        x_read = (
            x.at[0, 0, 5, 3].set(jnp.nan).at[0, -1, length - 1, 0].set(jnp.inf).at[0, 0, q + 2].set(-jnp.inf)
        )
        x = jnp.where(jnp.isfinite(x_read), x_read, 0).astype(x.dtype)  # as the kernels take it
    got, want = {}, {}
    (got["y"],) = _run(
        functools.partial(Sc._scan_kernel, add=False, **kw),
        (x_read, dt, cum, f, seg, bp, cp, states),
        [np.zeros((b, h, length, p), f32)],
        sizes.kernel_tiles("scan", p, n, parts=parts, q=q),
        (b, h, c),
    )
    want["y"] = E.emulate_chunk_scan(x, dt, cum, f, seg, bt, ct, states, q)
    heads_out = g if add else h
    # dx in x's dtype, as `chunk_scan_bwd` declares it
    outs = [np.zeros((b, h, length, p), bf16)] + [np.zeros((b, h, length), f32) for _ in range(4)]
    outs += [np.zeros((b, heads_out, length, n), f32) for _ in range(2)] + [np.zeros((b, c, h, p, n), f32)]
    if scores:
        outs[5] = np.zeros((b, g, c, q, q), f32)
    form = {"tiled": True} if q != 64 else ({"lean": True, "dg_sums": scores} if lean else {})
    form |= {"dy_in_dx": True} if over else {}
    body = functools.partial(SB._scan_bwd_kernel, add=add, **kw, **form)
    grads = _run(
        body,
        (dy, x_read, dt, cum, f, seg, bp, cp, states),
        outs,
        sizes.kernel_tiles("scan_bwd_lean" if lean else "scan_bwd", p, n, parts=parts, q=q),
        (b, h, c),
        over={0: 0} if over else None,
    )
    emulated = E.emulate_chunk_scan_bwd(
        dy.astype(jnp.float32), x, dt, cum, f, seg, bt, ct, states, q, scores=scores
    )
    for i, name in enumerate(("dx", "ddt", "dcum", "dcum_row", "df", "db", "dc", "ds")):
        e = np.asarray(emulated[i])
        summed = add and not scores and name in ("db", "dc")  # (the scores' emulation sums per group)
        got[name], want[name] = (grads[i], (e.reshape(b, g, h // g, length, n).sum(2) if summed else e))
    outs = [np.zeros((b, h, length, p), f32), np.zeros((b, h, length), f32), np.zeros((b, h, length, n), f32)]
    body = functools.partial(
        St._state_bwd_kernel, add=False, adds_dx=False, **kw, **({"blocks": q // 64} if q != 64 else {})
    )
    state_tiles = sizes.kernel_tiles("state_bwd", p, n, parts=parts)
    state_grads = _run(body, (x_read, w, bp, states), outs, state_tiles, (b, h, length // 64))
    emulated = E.emulate_chunk_state_bwd(x, w, bt, states, q)
    for name, gv, wv in zip(("state dx", "state dw", "state dB"), state_grads, emulated, strict=True):
        got[name], want[name] = gv, wv
    # the scan backward's bf16 dx in the output as the kernel starts (its input's buffer): each
    # block reads its rows, adds its own dx and writes the sum over them
    dx_in = np.asarray(jax.random.normal(k[4], (b, h, length, p)).astype(bf16))
    outs[0] = dx_in.copy()
    body = functools.partial(body, adds_dx=True)
    state_tiles = sizes.kernel_tiles("state_bwd", p, n, rows_dtype=bf16, parts=parts)
    got["state dx + dx_in"] = _run(body, (x_read, w, bp, states), outs, state_tiles, (b, h, length // 64))[0]
    want["state dx + dx_in"] = (emulated[0] + dx_in.astype(f32)).astype(bf16)
    (got["state"],) = _run(
        functools.partial(St._state_kernel, add=False, **kw),
        (x_read, w, bp),
        [np.zeros((b, c, h, p, n), f32)],
        sizes.kernel_tiles("state", p, n, parts=parts, q=q),
        (b, h, c),
    )
    want["state"] = E.emulate_chunk_state(x, w, bt, q)
    errors = {}
    for name in got:
        step = 2.0**-7 if np.asarray(got[name]).dtype == bf16 else 0.0
        gv, wv = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        assert gv.shape == wv.shape, (name, gv.shape, wv.shape)
        errors[name] = float((np.abs(gv - wv) - step * np.abs(wv)).max() / max(np.abs(wv).max(), 1e-30))
    return errors


@pytest.mark.parametrize(
    "case",
    [
        dict(q=64),
        dict(q=128),
        dict(q=256),
        dict(q=128, n=128),
        dict(q=128, wide=False),  # a bf16 cotangent: its low half left out
        # a bf16 cotangent in dx's buffer: each block reads its rows of dy before it writes dx
        # there (the tiled kernel's phase R from dy's tile in shared memory)
        dict(q=64, wide=False, over=True),
        dict(q=128, wide=False, over=True),
        dict(q=256, n=128, wide=False, over=True),
        dict(q=64, lean=True, n=128, wide=False, over=True),
        dict(q=128, h=4, g=2, add=True, wide=False, over=True),
        dict(q=128, h=4, g=2, add=True),  # dB, dC added into each group's rows
        dict(q=64, split=True),  # float32 B, C as halves: every product over both (`rounds_once`)
        dict(q=64, split=True, n=128, wide=False),
        # the lean scan backward: every result through the staging tile (`tiles.STAGE`, 64 x 64),
        # the state's low half in M's tiles
        dict(q=64, lean=True),
        dict(q=64, lean=True, n=128, wide=False),
        dict(q=64, lean=True, n=128, h=4, g=2, add=True),
        dict(q=64, lean=True, h=4, g=2, add=True),
        # dg summed per group in dB's place, dC without dg B
        dict(q=64, lean=True, h=4, g=2, add=True, scores=True),
        dict(q=64, lean=True, n=128, h=4, g=1, add=True, scores=True, wide=False),
        # x's non-finite values taken as 0 by every kernel (in its tile once copied in, and where
        # it is read into registers)
        dict(q=64, clean_x=True),
        dict(q=128, clean_x=True),
        dict(q=64, lean=True, n=128, h=4, g=1, add=True, scores=True, clean_x=True),
    ],
    ids=str,
)
def test_the_kernel_bodies_compute_their_emulation_without_hazards(shim, case):
    errors = _errors(**case)
    assert max(errors.values()) <= 1e-5, errors
    assert not shim.hazards, sorted(set(shim.hazards))


def test_the_shim_sees_a_planted_error(shim, monkeypatch):
    # the causal mask left off the backward's transposed diagonal tiles, and a commit left out
    # before a product reads what registers wrote: both seen
    original = T._decay_transposed
    monkeypatch.setattr(T, "_decay_transposed", lambda *a, diagonal: original(*a, diagonal=False))
    assert max(_errors(q=128).values()) > 1e-3
    monkeypatch.setattr(T, "_decay_transposed", original)
    monkeypatch.setattr(_Plgpu, "commit_smem", staticmethod(lambda: None))
    _errors(q=128)
    assert any("without commit_smem" in h for h in shim.hazards)


def test_the_shim_sees_the_lean_staging_tile_rewritten_in_flight(shim, monkeypatch):
    # the lean scan backward's waits for each block's copy left out: its next block overwrites
    # the staging tile the copy may still read
    monkeypatch.setattr(_Plgpu, "wait_smem_to_gmem", staticmethod(lambda n, wait_read_only=False: None))
    _errors(q=64, lean=True)
    assert any("while a TMA store may read it" in h for h in shim.hazards)


def _fused_errors(
    q,
    b=1,
    h=2,
    g=1,
    c=3,
    p=64,
    n=64,
    positions_first=False,
    clean_x=False,
    states=True,
    lean=False,
    y16=False,
    seen=False,
):
    """The fused forward's largest differences (relative to the largest magnitude) from the three
    stages' emulation at chunks of `q`: the entering states against the recurrence over the
    emulated own states, `y` against the emulated scan of the kernel's own entering states (a
    state differing in its last float32 bit may round to another bf16 value), the final state.
    `lean`: the lean fused forward (`forward_lean.py`); `y16`: `y` in bf16 (against the
    emulation's float32 `y` rounded to bf16, within one bf16 step of it). `seen`: the kernel's
    report of `x` (`forward_lean.seen_rows`) as `"seen"`, 0 where it matches (NaN exactly in the
    rows of `x` with a non-finite value), 1 where not."""
    length, f32, bf16 = c * q, np.float32, jnp.bfloat16
    k = jax.random.split(jax.random.PRNGKey(1), 9)
    x = jax.random.normal(k[0], (b, h, length, p)).astype(bf16)
    if clean_x:  # non-finite values the kernel takes as 0
        x = x.at[0, 0, 5, 3].set(jnp.nan).at[0, -1, length - 1, 0].set(jnp.inf)
    bt, ct = (jax.random.normal(k[i], (b, g, length, n)).astype(bf16) for i in (1, 2))
    dt = jax.nn.softplus(jax.random.normal(k[3], (b, h, length)))
    cum = jnp.cumsum((-dt * 0.01).reshape(b, h, c, q), -1).reshape(b, h, length)
    seg = jnp.cumsum(jax.random.bernoulli(k[5], 0.03, (b, length)), axis=1).astype(jnp.int32)
    s0 = jax.random.normal(k[6], (b, h, p, n))
    keep = jnp.exp(cum.reshape(b, h, c, q)[..., -1])
    f, w = jnp.exp(cum), jnp.exp(cum) * dt
    keep_rows = jnp.broadcast_to(keep[..., None], (b, h, c, p))
    rows = lambda a: jnp.swapaxes(a, 1, 2) if positions_first else a  # noqa: E731
    y_shape = (b, length, h, p) if positions_first else (b, h, length, p)
    y_out = np.zeros(y_shape, ml_dtypes.bfloat16 if y16 else f32)
    outs = [y_out] + [np.zeros((b, c, h, p, n), f32)] * states + [np.zeros((b, h, p, n), f32)]
    outs += [np.full((b, h, length), 7.0, f32)] * seen  # (7: a row the kernel did not write)
    kernel = FT.forward_tiled_kernel if q != 64 else (FL.forward_lean_kernel if lean else F._forward_kernel)
    body = functools.partial(kernel if states else functools.partial(F._without_states, kernel=kernel))
    got = _run(
        functools.partial(
            body,
            rep=h // g,
            dtype=bf16,
            add=False,
            rows_of=tiles.rows_indexer(positions_first),
            chunks=c,
            clean_x=clean_x,
            **({"seen": True} if seen else {}),
        ),
        (rows(x), w, dt, cum, f, keep_rows, seg, (bt,), (ct,), s0),
        outs,
        (FL.lean_forward_tiles(p, n, y_dtype=bf16 if y16 else f32) if lean else F._tiles(p, n, q=q))
        + [((q,), f32)] * seen,
        (b, h, 1),
    )
    if seen:
        report = got.pop()
        want_nan = ~np.asarray(jnp.isfinite(x.astype(f32)).all(-1))
        seen_ok = np.array_equal(np.isnan(report), want_nan) and np.all(report[~want_nan] == 0)
    y, final = rows(got[0]), got[-1]
    x_clean = jnp.where(jnp.isfinite(x), x, 0)
    own = np.asarray(E.emulate_chunk_state(x_clean, w, bt, q))
    want_states, state = [], np.asarray(s0)
    for i in range(c):
        want_states.append(state)
        state = np.asarray(keep)[:, :, i, None, None] * state + own[:, i]
    have, want = {"final": final}, {"final": state}
    if states:  # (without them, `y` is the same body's; the scan's emulation takes the entering states)
        have["states"], want["states"] = got[1], np.stack(want_states, 1)
        y_want = E.emulate_chunk_scan(x_clean, dt, cum, f, seg, bt, ct, got[1], q)
        have["y"], want["y"] = y, (y_want.astype(bf16) if y16 else y_want)
    rel = lambda a, e: float(np.abs(np.asarray(a, np.float64) - e).max() / np.abs(e).max())  # noqa: E731
    errors = {name: rel(have[name], np.asarray(want[name], np.float64)) for name in have}
    return errors | ({"seen": 0.0 if seen_ok else 1.0} if seen else {})


@pytest.mark.parametrize(
    "case",
    [
        dict(q=64),
        dict(q=128),
        dict(q=256),
        dict(q=128, n=128, h=4, g=2),  # groups: a head's rows of its group's B, C
        dict(q=128, p=128),
        dict(q=128, positions_first=True, clean_x=True),
        dict(q=128, states=False),
        # the lean fused forward: one slot of tiles, the state out by 64 x 64 blocks
        dict(q=64, lean=True),
        dict(q=64, lean=True, n=128, h=4, g=2),
        dict(q=64, lean=True, p=128),
        dict(q=64, lean=True, positions_first=True, clean_x=True),
        dict(q=64, lean=True, states=False),
        dict(q=64, lean=True, p=128, y16=True),  # y by 64-column blocks through its own bf16 tile
        dict(q=64, lean=True, n=128, y16=True),
        # the report of what the kernel read of x (NaN in the rows with a non-finite value)
        dict(q=64, clean_x=True, seen=True),
        dict(q=64, lean=True, positions_first=True, clean_x=True, seen=True),
        dict(q=128, positions_first=True, clean_x=True, seen=True),
        dict(q=64, lean=True, states=False, clean_x=True, seen=True),
    ],
    ids=str,
)
def test_the_fused_forward_body_computes_the_stages_emulation_without_hazards(shim, case):
    errors = _fused_errors(**case)
    if case.get("y16"):  # y within one bf16 step (2^-8) of the emulation's rounded y
        assert errors.pop("y") <= 2.0**-8, errors
    assert max(errors.values()) <= 1e-5, errors
    assert not shim.hazards, sorted(set(shim.hazards))


def test_the_shim_sees_errors_planted_in_the_lean_forward(shim, monkeypatch):
    # the waits for the copies out left out: the staging tiles overwritten in flight
    wait = _Plgpu.wait_smem_to_gmem
    monkeypatch.setattr(_Plgpu, "wait_smem_to_gmem", staticmethod(lambda n, wait_read_only=False: None))
    _fused_errors(q=64, lean=True, n=128)
    assert any("while a TMA store may read it" in h for h in shim.hazards)
    monkeypatch.setattr(_Plgpu, "wait_smem_to_gmem", wait)
    shim.hazards.clear()
    # B's tile refilled (here: zeroed) before the state's update has read it: the states go wrong
    update = FL.own_onto

    def refilled_early(kept, xh, xl, bs):
        bs[0].a[...] = 0
        return update(kept, xh, xl, bs)

    monkeypatch.setattr(FL, "own_onto", refilled_early)
    errors = _fused_errors(q=64, lean=True)
    assert errors["final"] > 1e-3 and errors["states"] > 1e-3, errors
