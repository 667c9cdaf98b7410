"""The fused state backward's kernel body (`state_backward.py`, whole and over the state's columns) run on the
CPU through the Mosaic GPU shim of `test_ssd_mosaic_bodies.py`, block by block over (batch row,
head), against the reverse recurrence (float32, in the kernel's order) and the chunk state
backward's emulation: values, and the hazards the shim checks (commits, waits, TMA stores in
flight, loads never waited)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axkern.ops.chunked.mosaic_gpu import emulate as E
from axkern.ops.chunked.mosaic_gpu import state_backward as S
from axkern.ops.chunked.mosaic_gpu import tiles as K
from tests.gpu_lowering import lower_for_cuda
from tests.ops import test_ssd_mosaic_bodies as bodies
from tests.ops.test_ssd_mosaic_gpu import needs_mosaic


@pytest.fixture
def shim(monkeypatch):
    """`test_ssd_mosaic_bodies`' shim, in `state_backward.py` too."""
    return bodies.install_shim(monkeypatch, (*bodies.MODULES, S))


def _errors(b=1, h=2, g=1, c=3, p=64, n=64, add=False, positions_first=False, columns=1, clean_x=False):
    """The kernel's largest differences (relative to the largest magnitude) from the recurrence's
    and the chunk state backward's emulation: `dx`, `dw`, `dB` (per head, or `add`: summed into
    each group's rows), `d keep`'s row sums and the initial state's gradient. `columns`: the
    kernel a block per `n / columns` of the state's columns, adding `dx` onto a given one
    (`dx_in`) and `dw` onto zeros. `clean_x`: `x` with non-finite values, which the kernel takes as
    0 (the emulation is given them as 0)."""
    q, f32, bf16 = K.CHUNK, np.float32, jnp.bfloat16
    length = c * q
    k = jax.random.split(jax.random.PRNGKey(2), 7)
    x = jax.random.normal(k[0], (b, h, length, p)).astype(bf16)
    bt = jax.random.normal(k[1], (b, g, length, n)).astype(bf16)
    w = np.asarray(jax.nn.softplus(jax.random.normal(k[2], (b, h, length))), f32)
    keep = np.asarray(jax.random.uniform(k[3], (b, h, c), minval=0.1, maxval=0.9), f32)
    states_in, d_states_in = (np.asarray(jax.random.normal(k[i], (b, c, h, p, n)), f32) for i in (4, 5))
    d_final = np.asarray(jax.random.normal(k[6], (b, h, p, n)), f32)
    keep_rows = np.broadcast_to(keep[..., None], (b, h, c, p)).astype(f32)
    x_read = x  # what the kernel reads
    if clean_x:
        x_read = x.at[0, 0, 5, 3].set(jnp.nan).at[0, -1, length - 1, 0].set(-jnp.inf)
        x = jnp.where(jnp.isfinite(x_read), x_read, 0).astype(x.dtype)  # as the kernel takes it

    # the reverse recurrence in float32, in the kernel's order
    g_run, d_own, d_keep_rows = d_final.copy(), np.zeros_like(states_in), np.zeros((b, h, c, p), f32)
    for i in reversed(range(c)):
        d_own[:, i] = g_run
        d_keep_rows[:, :, i] = (g_run * states_in[:, i]).sum(-1)
        g_run = g_run * keep[:, :, i, None, None] + d_states_in[:, i]
    want = dict(zip(("dx", "dw", "dB"), E.emulate_chunk_state_bwd(x, w, bt, d_own, q), strict=True))
    want |= {"d keep rows": d_keep_rows, "d initial": g_run}
    dx_in = np.asarray(jax.random.normal(k[0], (b, h, length, p)), f32) if columns > 1 else 0
    want["dx"] = np.asarray(want["dx"]) + dx_in
    if add:
        want["dB"] = np.asarray(want["dB"]).reshape(b, g, h // g, length, n).sum(2)

    rows = lambda a: np.swapaxes(np.asarray(a), 1, 2) if positions_first else np.asarray(a)  # noqa: E731
    outs = [
        rows(np.zeros((b, h, length, p), f32) + dx_in),
        np.zeros((b, h, length), f32),
        np.zeros((b, g if add else h, length, n), f32),
        np.zeros((b, h, c, columns * p), f32),
        np.zeros((b, h, p, n), f32),
    ]
    # (`add` as `tiles.launch` gives it: some output added into; `sums`: dB into its group's rows)
    kw = dict(
        rep=h // g, dtype=bf16, chunks=c, add=add or columns > 1, rows_of=K.rows_indexer(positions_first)
    )
    body = functools.partial(S._kernel, **kw, column_blocks=columns, sums=add, clean_x=clean_x)
    args = (rows(x_read), w, (bt,), keep_rows, states_in, d_states_in, d_final)
    names = ("batch", "heads", "columns")
    got = bodies._run(body, args, outs, S._tiles(p, n // columns), (b, h, columns), names)
    got[0] = rows(got[0])
    got[3] = got[3].reshape(b, h, c, columns, p).sum(3)
    errors = {}
    for name, a in zip(want, got, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(want[name], np.float64)
        assert a.shape == e.shape, (name, a.shape, e.shape)
        errors[name] = float(np.abs(a - e).max() / np.abs(e).max())
    return errors


CASES = [
    dict(),
    dict(n=128),
    dict(p=128),
    dict(n=128, h=4, g=2, add=True),  # dB added into each group's rows
    dict(positions_first=True),
    dict(n=128, clean_x=True),  # x's non-finite values taken as 0
]
# the kernel a block per 64 of the state's columns
COLUMNS = [
    dict(n=128, columns=2),
    dict(n=128, columns=2, h=4, g=2, add=True, positions_first=True),
    dict(n=128, columns=2, c=1),
    dict(n=128, columns=2, clean_x=True),
]


@pytest.mark.parametrize("case", CASES + COLUMNS, ids=str)
def test_the_fused_state_backward_body_computes_its_emulation_without_hazards(shim, case):
    errors = _errors(**case)
    # dB = (w ∘ x) dS rounds dS once to bf16: the recurrence here and the kernel's may differ in
    # float32's last bit (the kernel's sums run through jax on the shim), which can move one
    # term of dB by a bf16 step; the other gradients take dS as two halves
    assert errors.pop("dB") <= 1e-4, errors
    assert max(errors.values()) <= 1e-5, errors
    assert not shim.hazards, sorted(set(shim.hazards))


def test_the_shim_sees_errors_planted_in_the_fused_state_backward(shim, monkeypatch):
    # the waits for the copies out left out: the staging tile rewritten while a copy reads it
    wait = bodies._Plgpu.wait_smem_to_gmem
    monkeypatch.setattr(
        bodies._Plgpu, "wait_smem_to_gmem", staticmethod(lambda n, wait_read_only=False: None)
    )
    _errors(n=128)
    assert any("while a TMA store may read it" in h for h in shim.hazards)
    monkeypatch.setattr(bodies._Plgpu, "wait_smem_to_gmem", wait)
    shim.hazards.clear()
    # a chunk's B read before its copy was waited for: seen
    monkeypatch.setattr(bodies._Plgpu, "barrier_wait", staticmethod(lambda barrier: None))
    _errors()
    assert any("before its TMA load was waited" in h for h in shim.hazards)


@needs_mosaic
@pytest.mark.parametrize("group_sums", [False, True])
@pytest.mark.parametrize("form", ["lean", "columns"])
def test_the_launch_gives_the_kernel_the_group_sums_flag(monkeypatch, form, group_sums):
    # the kernel adds dB into its group's rows exactly where the group sums ask: the columns
    # form adds dx and dw into buffers without them (`tiles.launch`'s `add` then says so)
    seen = []
    kernel = S._kernel

    def recording(*refs, **kw):
        seen.append((kw["sums"], kw["add"]))
        return kernel(*refs, **kw)

    monkeypatch.setattr(S, "_kernel", recording)
    b, h, g, c, p, n = 1, 2, 1, 2, 64, 128
    x, bt = (
        jax.ShapeDtypeStruct((b, h, c * 64, p), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, g, c * 64, n), jnp.bfloat16),
    )
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (x, f32(b, h, c * 64), bt, f32(b, h, c), f32(b, c, h, p, n), f32(b, c, h, p, n), f32(b, h, p, n))
    kw = dict(group_sums=group_sums, columns=2 if form == "columns" else 1)
    lower_for_cuda(functools.partial(S.fused_state_bwd, **kw), *args)
    assert seen and all(dB_added == group_sums for dB_added, _ in seen), seen
    assert all(added == (group_sums or form == "columns") for _, added in seen), seen


def test_two_blocks_of_the_fused_state_backward_share_an_sm():
    assert S.lean_state_bwd_shares_an_sm(64, 128) and S.lean_state_bwd_shares_an_sm(128, 64)
    assert K.blocks_per_sm(S._tiles(64, 128)) == 2


def test_the_fused_state_backward_refuses_float32_b():
    from axkern.core.op import Unsupported

    x, w = jnp.zeros((1, 1, 64, 64), jnp.bfloat16), jnp.ones((1, 1, 64))
    bt = jnp.zeros((1, 1, 64, 64), jnp.float32)  # Mamba-3's: taken as two bf16 halves
    keep, s = jnp.ones((1, 1, 1)), jnp.zeros((1, 1, 1, 64, 64))
    with pytest.raises(Unsupported, match="16-bit B"):
        S.fused_state_bwd(x, w, bt, keep, s, s, s[:, 0])
