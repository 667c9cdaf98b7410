"""attention's `mosaic_gpu` implementation on the CPU: its block-sparse tile schedule against brute
force over the mask, its refusals (`supports`, `check`) and its place in the dispatcher, its
block sizes, the backward kernels' tile loops emulated in numpy, and the non-finite guard around
it (its checks run once, its other branch without the dispatcher). The kernel itself needs a
Hopper GPU: tests/gpu/test_attention_mosaic_gpu.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axkern
from axkern import masks
from axkern.ops.attention import OP, mosaic_gpu, pallas_gpu, pallas_tpu
from axkern.ops.attention.blocks import (
    MOSAIC_GPU_SMEM,
    AttentionBlockSizes,
    mosaic_gpu_heuristic,
    mosaic_gpu_smem_bytes,
    mosaic_gpu_space,
)
from axkern.positional import attention
from tests.cases.attention import inputs as _inputs

WGS = mosaic_gpu.COMPUTE_WGS

SCHEDULE_MASKS = {
    "full": masks.Full(),
    "causal": masks.Causal(),
    "causal+5": masks.Causal(offset=5),
    "causal-9": masks.Causal(offset=-9),
    "window6": masks.SlidingWindow(6),
    "window20+3": masks.SlidingWindow(20, offset=3),
    "causal&window13": masks.Causal() & masks.SlidingWindow(13),
    "window3|causal-30": masks.SlidingWindow(3) | masks.Causal(offset=-30),
    "causal-40|full": masks.Causal(offset=-40) | masks.Full(),
    # the keys just behind each query and those more than 40 behind: a gap between them
    "window8|causal-40": masks.SlidingWindow(8) | masks.Causal(offset=-40),
}


def _steps(row, nk):
    """A table row's step -> tile map: its tile list where the table has one, else the tiles."""
    if row.size > mosaic_gpu.LIST:
        return row[mosaic_gpu.LIST :]
    return np.arange(nk)


def _longest_run(flags) -> int:
    best = run = 0
    for f in flags:
        run = run + 1 if f else 0
        best = max(best, run)
    return best


def _brute_force(mask, sq, sk, bq, bk):
    """`(any visible, all visible)` per (query tile, key tile) from the dense mask; a tile
    reaching past a length is never all visible."""
    dense = np.asarray(mask.dense(sq, sk))[0]
    nq, nk = -(-sq // bq), -(-sk // bk)
    nq = -(-nq // WGS) * WGS
    any_ = np.zeros((nq, nk), bool)
    all_ = np.zeros((nq, nk), bool)
    for i in range(nq):
        for t in range(nk):
            tile = dense[i * bq : (i + 1) * bq, t * bk : (t + 1) * bk]
            any_[i, t] = tile.any()
            all_[i, t] = tile.size == bq * bk and tile.all()
    return any_, all_


@pytest.mark.parametrize("name", list(SCHEDULE_MASKS))
@pytest.mark.parametrize("sq,sk,bq,bk", [(64, 64, 8, 8), (61, 77, 8, 16), (100, 37, 16, 8), (5, 90, 8, 8)])
def test_schedule_against_brute_force(name, sq, sk, bq, bk):
    mask = SCHEDULE_MASKS[name]
    table = mosaic_gpu.mask_schedule(mask, sq, sk, bq, bk)
    any_, all_ = _brute_force(mask, sq, sk, bq, bk)
    _check_table(table, any_, all_)


def _check_table(table, any_, all_):
    # steps are tiles, or with a tile list (where a block's seen tiles leave a gap) the block's
    # seen tiles in order; the bounds count steps
    nk = any_.shape[1]
    gaps = mosaic_gpu.has_gaps(any_.astype(int))
    width = max(1, any_.reshape(-1, WGS, nk).any(1).sum(1).max()) if gaps else 0  # the longest list
    assert table.dtype == np.int32 and table.shape == (any_.shape[0] // WGS, 2 + 4 * WGS + width)
    for c, row in enumerate(table):
        clo, chi = row[mosaic_gpu.CTA_LO], row[mosaic_gpu.CTA_HI]
        steps = _steps(row, nk)
        block = any_[c * WGS : (c + 1) * WGS].any(0)
        if gaps:  # the producer loads exactly the tiles its warpgroups see, nothing between
            assert (clo, chi) == (0, block.sum()) and list(steps[:chi]) == list(np.flatnonzero(block)), row
        live = []
        for w in range(WGS):
            i = c * WGS + w
            lo, flo, fhi, hi = row[2 + 4 * w : 6 + 4 * w]
            # every warpgroup walks [clo, chi) in five loops: release, mask, full, mask, release
            assert clo <= lo <= flo <= fhi <= hi <= chi, (c, w, row)
            seen = np.flatnonzero(any_[i])
            if seen.size == 0:
                assert lo == hi, (c, w, row)
                continue
            live.append((lo, hi))
            # the visited steps run from the first tile with a visible pair to the last one
            assert (steps[lo], steps[hi - 1]) == (seen[0], seen[-1]), (c, w, row)
            # the unmasked run holds only fully visible tiles, and it is the longest such run
            assert all_[i, steps[flo:fhi]].all(), (c, w, row)
            assert fhi - flo == _longest_run(all_[i, steps[lo:hi]]), (c, w, row)
        # the producer loads exactly the union of its warpgroups' ranges (nothing when empty)
        if live:
            assert (clo, chi) == (min(r[0] for r in live), max(r[1] for r in live)), row
        else:
            assert clo == chi, row


def test_a_gap_between_seen_tiles_is_never_loaded():
    # each query sees the 8 keys up to it and every key 40 or more behind it: in 8 x 8 tiles
    # the blocks' rows leave empty tiles between the two parts, which the tile list skips
    mask = SCHEDULE_MASKS["window8|causal-40"]
    table = mosaic_gpu.mask_schedule(mask, 128, 128, 8, 8)
    assert table.shape == (8, mosaic_gpu.LIST + 14)  # the last block sees 14 of the 16 key tiles
    any_, _ = _brute_force(mask, 128, 128, 8, 8)
    loaded = sum(int(r[mosaic_gpu.CTA_HI] - r[mosaic_gpu.CTA_LO]) for r in table)
    assert loaded == sum(any_[2 * c : 2 * c + 2].any(0).sum() for c in range(8)) < 72  # 72: ranges
    # the last block: query tiles 14, 15 see key tiles 0-10 and 13-15; 11 and 12 are not loaded
    assert list(table[-1][mosaic_gpu.LIST :][: table[-1][1]]) == [*range(11), 13, 14, 15]
    # no gap, no list: the causal table keeps its ranges
    assert mosaic_gpu.mask_schedule(masks.Causal(), 128, 128, 8, 8).shape == (8, mosaic_gpu.LIST)


def test_schedule_skips_empty_tiles_and_masking_work_for_causal():
    # 512 causal queries and keys in 64 x 64 tiles: block c's warpgroups own query tiles 2c
    # and 2c + 1; tiles past the diagonal are never loaded, those before it never masked
    table = mosaic_gpu.mask_schedule(masks.Causal(), 512, 512, 64, 64)
    for c, row in enumerate(table):
        i = 2 * c  # warpgroup 0's query tile: full tiles [0, i), the diagonal tile i masked
        wg0 = [0, 0, i, i + 1] if i else [0, 1, 1, 1]  # no full tile: flo == fhi == hi
        assert list(row) == [0, i + 2, *wg0, 0, 0, i + 1, i + 2]
    full = mosaic_gpu.mask_schedule(masks.Full(), 300, 256, 64, 128)
    # 300 queries in 64-row tiles: tile 4 reaches past them (partial everywhere), tile 5 is
    # padding (an empty row: lo == hi == clo)
    assert [list(r) for r in full] == [
        [0, 2, 0, 0, 2, 2, 0, 0, 2, 2],
        [0, 2, 0, 0, 2, 2, 0, 0, 2, 2],
        [0, 2, 0, 2, 2, 2, 0, 0, 0, 0],
    ]


def test_schedule_of_kinds_directly():
    E, P, F = masks.EMPTY, masks.PARTIAL, masks.FULL
    kinds = np.array(
        [[E, P, F, F, P, F, E], [E, E, E, E, E, E, E], [F, F, P, E, E, E, E], [E, E, E, P, E, E, E]]
    )
    table = mosaic_gpu.schedule(kinds)
    assert list(table[0]) == [1, 6, 1, 2, 4, 6, 1, 1, 1, 1]  # the second row is empty
    assert list(table[1]) == [0, 4, 0, 0, 2, 3, 3, 4, 4, 4]  # no FULL tile: flo == fhi == hi
    with pytest.raises(ValueError, match="multiple of 2"):
        mosaic_gpu.schedule(kinds[:3])


def _spec(dtype=jnp.bfloat16, d=128, dv=None, device_key="nvidia_h200", **flags):
    dims = {
        "batch": 1,
        "q_len": 256,
        "kv_len": 256,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": d,
        "v_dim": dv or d,
    }
    base = dict(soft_cap=False, sinks=False, mask="Causal")
    spec = OP.spec(dims, dtype, **(base | flags))
    return dataclasses.replace(spec, platform="gpu", device_key=device_key, device_kind=device_key)


def test_supports_refuses_with_reasons():
    assert mosaic_gpu.supports(_spec()) is None
    assert mosaic_gpu.supports(_spec(jnp.float16, d=64)) is None
    assert mosaic_gpu.supports(_spec(d=256, mask="Full")) is None
    assert mosaic_gpu.supports(_spec(mask="And")) is None  # static or not: decided at the call
    assert "Hopper" in mosaic_gpu.supports(_spec(device_key="nvidia_a100"))
    assert "bf16 or fp16" in mosaic_gpu.supports(_spec(jnp.float32))
    assert "head dims 96" in mosaic_gpu.supports(_spec(d=96))
    assert "head dims 128 and 64" in mosaic_gpu.supports(_spec(d=128, dv=64))
    assert mosaic_gpu.supports(_spec(soft_cap=True, sinks=True)) is None
    for m in ("Segments", "PrefixLM", "Or"):
        assert mosaic_gpu.supports(_spec(mask=m)) is None
    assert "mask Dense" in mosaic_gpu.supports(_spec(mask="Dense"))


def test_check_refuses_masks_and_blocks_it_cannot_take():
    bs = AttentionBlockSizes(block_q=64, block_kv=128, num_stages=2)
    mosaic_gpu.check(masks.Causal() & masks.SlidingWindow(100), bs, 128)
    ids = jnp.zeros((1, 256), jnp.int32)
    mosaic_gpu.check(masks.Causal() & masks.Segments(ids, ids), bs, 128)
    mosaic_gpu.check(masks.Causal() | masks.Segments(ids, ids), bs, 128)
    mosaic_gpu.check(masks.SlidingWindow(64) | masks.PrefixLM(jnp.array([3])), bs, 128, sinks=jnp.zeros(4))
    mosaic_gpu.check(masks.PrefixLM(jnp.array([3])) & masks.Segments(ids, ids), bs, 128, logits_soft_cap=30.0)
    with pytest.raises(axkern.Unsupported, match="not Dense"):
        mosaic_gpu.check(masks.Causal() & masks.Dense(jnp.ones((1, 256, 256), bool)), bs, 128)
    with pytest.raises(axkern.Unsupported, match="positive cap"):
        mosaic_gpu.check(masks.Causal(), bs, 128, logits_soft_cap=0.0)
    with pytest.raises(axkern.Unsupported, match="positive scale"):  # scores are masked before scaling
        mosaic_gpu.check(masks.Causal(), bs, 128, scale=-0.5)
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    mosaic_gpu.check_inputs(q, q, q)
    with pytest.raises(axkern.Unsupported, match="one dtype"):
        mosaic_gpu.check_inputs(q, q.astype(jnp.float16), q)
    # where an input is not finite, the guard's other branch: pallas_gpu only for the masks it takes
    from axkern.ops.attention import common

    assert common.pallas_mask(masks.Causal() & masks.Segments(ids, ids))
    assert not common.pallas_mask(masks.PrefixLM(jnp.array([3])))
    assert not common.pallas_mask(masks.Causal() | masks.Segments(ids, ids))
    with pytest.raises(axkern.Unsupported, match="block_q=32"):
        mosaic_gpu.check(masks.Causal(), dataclasses.replace(bs, block_q=32), 128)
    with pytest.raises(axkern.Unsupported, match="num_stages=5"):
        mosaic_gpu.check(masks.Causal(), dataclasses.replace(bs, num_stages=5), 128)
    with pytest.raises(axkern.Unsupported, match="shared memory"):
        mosaic_gpu.check(masks.Causal(), dataclasses.replace(bs, block_kv=256, num_stages=4), 256)


def test_heuristic_and_space_fit_shared_memory():
    for d in (64, 128, 256):
        spec = _spec(d=d)
        bs = mosaic_gpu_heuristic(spec)
        assert (bs.block_q, bs.block_kv, bs.num_stages) == (64, 128 if d <= 128 else 64, 2)
        # the backward fields: the Mosaic backward kernels' tiles, dq 64 x 128 and dk, dv 64 x 64 with
        # two stages up to head dim 128, 64 x 64 with one stage each at 256 (all that fits there)
        for name in ("dq", "dkv"):
            got = bs.kernel(name)
            want = ((64, 128, 2) if name == "dq" else (64, 64, 2)) if d <= 128 else (64, 64, 1)
            assert (got.block_q, got.block_kv, got.num_stages, got.num_warps) == (*want, None)
        assert mosaic_gpu.check_backward(masks.Causal(), bs, d) is None
        # with no backward fields the kernels take the same tiles
        assert mosaic_gpu.backward_blocks(AttentionBlockSizes(block_q=64), d) == mosaic_gpu.backward_blocks(
            bs, d
        )
        space = mosaic_gpu_space(spec)
        assert space[0] == bs and len(space) >= (1 if d == 256 else 4)  # 256: only 64 x 64 x 2 fits
        for c in space:
            assert mosaic_gpu_smem_bytes(c.block_q, c.block_kv, c.num_stages, d) <= MOSAIC_GPU_SMEM
            mosaic_gpu.check(masks.Causal(), c, d)
            assert mosaic_gpu.check_backward(masks.Causal(), c, d) is None, c
        # the backward's forms too: its tilings and dq by the other of its kernel and the reductions
        backward = {(mosaic_gpu.backward_blocks(c, d), mosaic_gpu.dq_by(c, d)) for c in space}
        assert len(backward) == (1 if d == 256 else 4 if d == 64 else 7), backward


def test_ping_pong_is_the_overlap_where_it_was_faster_and_bad_forms_refuse():
    # the heuristic: the overlap from head dim 128 up under a causal mask or none, else the rendezvous
    for d, kind, want in [
        (128, "causal", "overlap"),
        (256, "causal", "overlap"),
        (128, "full", "overlap"),
        (64, "causal", "rendezvous"),
        (128, "window", "rendezvous"),
        (128, "documents", "rendezvous"),
        (256, "prefix", "rendezvous"),
    ]:
        assert mosaic_gpu_heuristic(_spec(d=d, mask_kind=kind)).ping_pong == want, (d, kind)
    # the space holds both forms of each tile
    space = mosaic_gpu_space(_spec(d=128, mask_kind="causal"))
    tiles = {(c.block_q, c.block_kv, c.num_stages) for c in space}
    got = {(c.block_q, c.block_kv, c.num_stages, c.ping_pong) for c in space}
    assert len(tiles) >= 4 and got == {(*t, f) for t in tiles for f in ("rendezvous", "overlap")}
    # each form's flags for the forward; None is the rendezvous
    flags = {
        f: mosaic_gpu.forward_flags(AttentionBlockSizes(ping_pong=f)) for f in (None, "rendezvous", "overlap")
    }
    assert flags == {None: {}, "rendezvous": {}, "overlap": {"overlap": True}}
    bad = AttentionBlockSizes(block_q=64, block_kv=128, num_stages=2, ping_pong="pingpong")
    assert "ping_pong must be one of 'rendezvous', 'overlap'" in bad.validate()
    with pytest.raises(axkern.Unsupported, match="ping_pong='pingpong'"):
        mosaic_gpu.check(masks.Causal(), bad, 128)
    # the Triton and TPU kernels refuse the field rather than ignore it
    q = jnp.zeros((1, 64, 2, 64), jnp.float32)
    for impl in (pallas_gpu, pallas_tpu):
        with pytest.raises(axkern.Unsupported, match="ping_pong='overlap'"):
            impl.attention(
                q, q, q, None, masks.Causal(), scale=0.1, logits_soft_cap=None,
                block_sizes=AttentionBlockSizes(block_q=64, block_kv=64, ping_pong="overlap"), interpret=True,
            )  # fmt: skip
    # the shipped table: the overlap where the variant sweep timed it faster, each entry valid
    from axkern.core.blocks import load_table

    for e in load_table("axkern.ops.attention", "nvidia_h200"):
        if e["implementation"] == "mosaic_gpu":
            bs = AttentionBlockSizes.from_dict(e["block_sizes"])
            assert bs.validate() is None and bs.ping_pong in ("rendezvous", "overlap"), e["bucket"]


def test_backward_refuses_pallas_gpus_warps_and_tiles_that_do_not_fit():
    bs = mosaic_gpu_heuristic(_spec(d=256))
    why = mosaic_gpu.check_backward(masks.Causal(), dataclasses.replace(bs, num_warps_dq=8), 256)
    assert "num_warps_dq" in why and "pallas_gpu" in why
    # two stages do not fit at head dim 256; the message names the range
    why = mosaic_gpu.check_backward(masks.Causal(), dataclasses.replace(bs, num_stages_dkv=2), 256)
    assert why is not None and "shared memory" in why
    bs = mosaic_gpu_heuristic(_spec(d=128))
    why = mosaic_gpu.check_backward(masks.Causal(), dataclasses.replace(bs, num_stages_dq=5), 128)
    assert "num_stages_dq=5" in why and "2 to 4" in why
    # a zero is refused, not taken for the default (the forward's stages too)
    why = mosaic_gpu.check_backward(masks.Causal(), dataclasses.replace(bs, num_stages_dkv=0), 128)
    assert "num_stages_dkv=0" in why
    with pytest.raises(axkern.Unsupported, match="num_stages=0"):
        mosaic_gpu.check(masks.Causal(), dataclasses.replace(bs, num_stages=0), 128)


def test_dispatch_on_cpu_skips_it_with_the_reason():
    a = _inputs(0, 1, 64, 64, 2, 2, 64, "bfloat16")
    d = axkern.explain(
        lambda q, k, v: attention(q, k, v, mask=masks.Causal(), implementation=("mosaic_gpu", "xla")),
        a["q"],
        a["k"],
        a["v"],
    )
    assert d.implementation == "xla"
    assert d.rejected[0].implementation == "mosaic_gpu" and "runs on gpu, not cpu" in d.rejected[0].reason
    assert "no interpret mode" in d.rejected[0].reason
    with pytest.raises(axkern.Unsupported, match="mosaic_gpu"):
        attention(a["q"], a["k"], a["v"], implementation="mosaic_gpu")
    # on Hopper after cuDNN (faster where it serves), before pallas_gpu
    assert OP.default_order["gpu"][:3] == ("cudnn", "mosaic_gpu", "pallas_gpu")
    line = OP.implementations["mosaic_gpu"].backward
    assert "dq (64x128 tiles, 2 stages)" in line(_spec(), mosaic_gpu_heuristic(_spec()))
    assert "dq (64x64 tiles, 1 stage) and dv, then dk (two launches" in line(
        _spec(d=256), mosaic_gpu_heuristic(_spec(d=256))
    )


@pytest.mark.parametrize("name", list(SCHEDULE_MASKS))
@pytest.mark.parametrize("sq,sk,bq,bk", [(64, 64, 8, 8), (61, 77, 8, 16), (100, 37, 16, 8)])
def test_key_schedule_against_brute_force(name, sq, sk, bq, bk):
    # the dk, dv kernel's table: per block of key tiles, the query tiles each warpgroup visits
    mask = SCHEDULE_MASKS[name]
    table = mosaic_gpu.key_schedule(mask, sq, sk, bq, bk)
    any_, all_ = _brute_force(mask, sq, sk, bq, bk)
    nq = -(-sq // bq)
    nk = -(-any_.shape[1] // WGS) * WGS  # key tiles by query tiles, in whole blocks
    pad = lambda a: np.pad(a[:nq].T, [(0, nk - a.shape[1]), (0, 0)])  # noqa: E731
    _check_table(table, pad(any_), pad(all_))


def _table(mask, *args, **kw):
    """`schedule_table` as one compiled call (op by op, each of its small ops compiles alone)."""
    return jax.jit(lambda m: mosaic_gpu.schedule_table(m, *args, **kw))(mask)


def _emulated_backward(q, k, v, out, lse, d_out, mask, scale, blocks, soft_cap=None):
    """The Mosaic backward kernels' tile loops in float64 numpy: the same tables, operands
    (padding, base-2 lse, delta, the mask's arrays), the same lowered mask evaluated on the
    tiles, masking of partial tiles only, soft cap, scale and GQA grouping."""
    (bq1, bk1, _), (bq2, bk2, _) = mosaic_gpu.backward_blocks(blocks, q.shape[3])
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    mq, mk = max(WGS * bq1, bq2), max(bk1, WGS * bk2)
    sqp, skp = -(-sq // mq) * mq, -(-sk // mk) * mk
    ops = jax.jit(functools.partial(mosaic_gpu.backward_operands, sqp=sqp, skp=skp))(q, k, v, out, lse, d_out)
    qp, kp, vp, dop, lse2, delta = (np.asarray(a, np.float64) for a in ops)
    lowered, leaves = mosaic_gpu.lower(mask)
    mask_ops = [np.asarray(a) for a in mosaic_gpu.operands(leaves, b, sqp, skp)]

    def dynamic(leaf, qi, kj):  # [b, rows, cols], as the kernels' TileMask per batch row
        if leaf.kind == "prefix":
            return (kj <= qi)[None] | (kj[None] < mask_ops[leaf.index][:, None, None])
        q_ids, k_ids = mask_ops[leaf.index][:, qi[:, 0]], mask_ops[leaf.index + 1][:, kj[0]]
        return q_ids[:, :, None] == k_ids[:, None, :]

    kp, vp = np.repeat(kp, g, axis=2), np.repeat(vp, g, axis=2)  # per query head
    c = scale * np.log2(np.e)
    dq, dk, dv = np.zeros(qp.shape), np.zeros(kp.shape), np.zeros(vp.shape)

    def tile(q0, bq, k0, bk, masked):
        rows, keys = slice(q0, q0 + bq), slice(k0, k0 + bk)
        s = np.einsum("bqhd,bkhd->bhqk", qp[:, rows], kp[:, keys])
        t = None
        if soft_cap is None:
            s = s * c
        else:
            t = np.tanh(s * scale / soft_cap)
            s = t * soft_cap * np.log2(np.e)
        if masked:
            qi, kj = np.meshgrid(np.arange(q0, q0 + bq), np.arange(k0, k0 + bk), indexing="ij")
            vis = mosaic_gpu.grid_visible(lowered, qi, kj, dynamic)  # as the kernels' TileMask.visible
            if sk % bk:  # keys past the length
                vis = kj < sk if vis is None else vis & (kj < sk)
            if vis is not None:
                vis = vis[:, None] if np.ndim(vis) == 3 else vis  # over heads
                s = np.where(vis, s, -np.inf)
        with np.errstate(invalid="ignore"):
            p = np.exp2(s - lse2[:, :, rows, None])
        dp = np.einsum("bqhd,bkhd->bhqk", dop[:, rows], vp[:, keys])
        ds = p * (dp - delta[:, :, rows, None])
        if t is not None:
            ds = ds * (1 - t * t)
        return rows, keys, p, ds

    def visits(table):  # (batch row or None, block, warpgroup, tile, masked)
        table = np.asarray(table)
        rows = [(None, table)] if table.ndim == 2 else list(enumerate(table))
        for r, t in rows:
            for blk, row in enumerate(t):
                steps = _steps(row, row[mosaic_gpu.CTA_HI])
                for w in range(WGS):
                    lo, flo, fhi, hi = row[2 + 4 * w : 6 + 4 * w]
                    for i in range(lo, hi):
                        yield r, blk * WGS + w, steps[i], not flo <= i < fhi

    def at(a, r):  # one batch row (kept as a batch of one) or all
        return a if r is None else a[r : r + 1]

    for r, own, t, masked in visits(_table(mask, sq, sk, bq1, bk1, b)):
        rows, keys, _, ds = tile(own * bq1, bq1, t * bk1, bk1, masked)
        at(dq, r)[:, rows] += np.einsum("bhqk,bkhd->bqhd", at(ds, r), at(kp, r)[:, keys])
    for r, own, t, masked in visits(_table(mask, sq, sk, bq2, bk2, b, keys=True)):
        rows, keys, p, ds = tile(t * bq2, bq2, own * bk2, bk2, masked)
        at(dk, r)[:, keys] += np.einsum("bhqk,bqhd->bkhd", at(ds, r), at(qp, r)[:, rows])
        at(dv, r)[:, keys] += np.einsum("bhqk,bqhd->bkhd", at(p, r), at(dop, r)[:, rows])
    group = lambda a: a.reshape(b, skp, kvh, g, d).sum(3)[:, :sk]  # noqa: E731
    return dq[:, :sq] * scale, group(dk) * scale, group(dv)


_PREFIX = masks.PrefixLM(jnp.array([70, 9]))


@pytest.mark.parametrize(
    "mask,sq,sk,extra",
    [
        (masks.Causal(), 150, 150, {}),
        (masks.Causal(offset=-20), 100, 140, {}),  # the first 20 queries see no key
        (masks.SlidingWindow(40) & masks.Causal(), 200, 200, {}),
        # a gap between the seen key tiles: the tables' tile lists (the dk, dv kernel's too)
        (masks.SlidingWindow(20) | masks.Causal(offset=-400), 700, 700, {"soft_cap": 2.0}),
        (masks.Full(), 70, 190, {}),
        ("docs", 140, 140, {}),  # packed documents, causal, a run-time schedule per batch row
        ("docs-only", 110, 110, {}),
        (_PREFIX, 150, 150, {}),  # prefix-LM: a run-time schedule from each row's prefix length
        (masks.SlidingWindow(30) | _PREFIX, 150, 150, {"soft_cap": 2.0}),
        ("docs|window", 140, 140, {"sinks": True}),
        ("prefix&docs", 140, 140, {"soft_cap": 3.0, "sinks": True}),
        (masks.Causal(offset=-20), 100, 140, {"sinks": True}),  # sinks on rows that see no key
    ],
)
def test_emulated_backward_tiles_give_the_gradients(mask, sq, sk, extra):
    # the kernels' schedule, operands and per-tile arithmetic, run in numpy, against autodiff
    # of the reference (GQA 2, lengths no tile divides, rows that see no key); with sinks the
    # forward's lse holds them (the kernels need nothing more), with a soft cap the scores are
    # capped and the derivative of the cap joins ds
    b = 2 if isinstance(mask, str) or mask is _PREFIX or isinstance(mask, masks.Or) else 1
    if isinstance(mask, str):  # documents of 37, 64, 13, ... positions in row 0, 90, ... in row 1
        ids = jnp.stack([jnp.arange(sq) // 37 + (jnp.arange(sq) >= 101), jnp.arange(sq) // 90])
        seg = masks.Segments(ids, ids)
        mask = {
            "docs": masks.Causal() & seg,
            "docs-only": seg,
            "docs|window": seg | masks.SlidingWindow(20),
            "prefix&docs": _PREFIX & seg,
        }[mask]
    a = _inputs(11, b, sq, sk, 4, 2, 16, "float32")
    q, k, v = a["q"], a["k"], a["v"]
    scale, cap = 0.25, extra.get("soft_cap")
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0]) if extra.get("sinks") else None

    def ref(q, k, v):
        return attention(
            q, k, v, mask=mask, scale=scale, logits_soft_cap=cap, sinks=sinks, implementation="reference"
        )

    d_out = jnp.sin(jnp.arange(b * sq * 4 * 16, dtype=jnp.float32)).reshape(b, sq, 4, 16)
    out, want = jax.jit(lambda q, k, v: (ref(q, k, v), jax.vjp(ref, q, k, v)[1](d_out)))(q, k, v)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2)) * scale
    s = s if cap is None else cap * jnp.tanh(s / cap)
    s = jnp.where(mask.dense(sq, sk)[:, None], s, -jnp.inf)
    if sinks is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))], -1)
    lse = jax.nn.logsumexp(s, axis=-1)
    blocks = AttentionBlockSizes(block_q_dq=64, block_kv_dq=64, block_q_dkv=128, block_kv_dkv=64)
    got = _emulated_backward(q, k, v, out, lse, d_out, mask, scale, blocks, soft_cap=cap)
    for name, g_, w_ in zip(("dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g_, np.asarray(w_), rtol=1e-4, atol=1e-4, err_msg=name)


def test_backward_tiles_that_do_not_fit_refuse_the_call():
    # up to head dim 128 the backward is Mosaic's own: tiles it cannot take refuse the whole
    # implementation (the dispatcher moves on) rather than reaching another kernel
    a = _inputs(0, 1, 256, 256, 2, 2, 128, "bfloat16")
    bs = AttentionBlockSizes(block_q=64, block_kv=128, num_stages=2, block_kv_dq=128, num_stages_dq=3)
    with pytest.raises(axkern.Unsupported, match="dq kernel's tiles need 266240 bytes"):
        OP.implementations["mosaic_gpu"].fn(
            a["q"], a["k"], a["v"], None, masks.Causal(), scale=0.1, logits_soft_cap=None, block_sizes=bs
        )
    with pytest.raises(axkern.Unsupported, match="dk, dv tiles 64x128"):
        mosaic_gpu.backward(
            *(a[n] for n in "qkv"),
            a["q"],
            jnp.zeros((1, 2, 256)),
            a["q"],
            mask=masks.Causal(),
            scale=0.1,
            block_sizes=AttentionBlockSizes(block_kv_dkv=128),
        )


def test_schedule_rows_on_the_device_matches_the_host_schedule():
    rng = np.random.default_rng(0)
    for n, nk in ((4, 7), (6, 1), (2, 12)):
        kinds = rng.choice([masks.EMPTY, masks.PARTIAL, masks.FULL], size=(3, n, nk), p=[0.4, 0.3, 0.3])
        kinds[0, 1] = masks.EMPTY  # a warpgroup with nothing to do
        kinds[1, :2] = masks.EMPTY  # a block with nothing to do
        got = np.asarray(mosaic_gpu.schedule_rows(jnp.asarray(kinds, jnp.int32)))
        for r in range(3):
            np.testing.assert_array_equal(got[r], mosaic_gpu.schedule(kinds[r]), err_msg=f"{n}x{nk} row {r}")


def test_run_time_schedule_covers_every_visible_pair_and_runs_only_full_tiles():
    # packed documents, prefix-LM and & | of them: the run-time table may visit a tile it need not (id ranges overlap),
    # never skip one with a visible pair, and never run a tile without masking unless every
    # pair in it is visible
    ids = jnp.stack([jnp.repeat(jnp.arange(5), 40)[:173], jnp.repeat(jnp.arange(3), 61)[:173]])
    seg, prefix = masks.Segments(ids, ids), masks.PrefixLM(jnp.array([50, 0]))
    for mask in (
        seg,
        masks.Causal() & seg,
        prefix,
        masks.SlidingWindow(20) | prefix,
        (prefix & seg) | masks.SlidingWindow(9, offset=4),
        masks.Causal(offset=-10) & (seg | prefix),
    ):
        dense = np.asarray(mask.dense(173, 173))
        for keys in (False, True):
            table = np.asarray(_table(mask, 173, 173, 16, 32, 2, keys=keys))
            assert table.shape[0] == 2
            for r in range(2):
                vis = dense[r].T if keys else dense[r]
                b_row, b_col = (32, 16) if keys else (16, 32)
                for blk, row in enumerate(table[r]):
                    for w in range(WGS):
                        i = blk * WGS + w
                        lo, flo, fhi, hi = row[2 + 4 * w : 6 + 4 * w]
                        tiles = vis[i * b_row : (i + 1) * b_row]
                        for t in range(-(-vis.shape[1] // b_col)):
                            tile = tiles[:, t * b_col : (t + 1) * b_col]
                            if tile.any():
                                assert lo <= t < hi, (keys, r, i, t, row)
                            if flo <= t < fhi:
                                assert tile.size == b_row * b_col and tile.all(), (keys, r, i, t, row)


def test_the_guarded_call_checks_once_and_its_other_branch_skips_the_dispatcher(monkeypatch):
    # the registered implementation traced as the dispatcher runs it (forward and backward):
    # the Mosaic checks run once, and the branch for inputs that are not finite (here `xla`'s:
    # the mask is not pallas_gpu's) is called directly, not through the dispatcher a second time
    if mosaic_gpu.IMPORT_ERROR is not None:
        pytest.skip(f"Pallas Mosaic GPU: {mosaic_gpu.IMPORT_ERROR}")
    calls = {"check": 0, "dispatch": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(mosaic_gpu, "check", counting("check", mosaic_gpu.check))
    monkeypatch.setattr(type(OP), "__call__", counting("dispatch", type(OP).__call__))
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    ids = jnp.zeros((1, 256), jnp.int32).at[:, 100:].set(1)
    mask = masks.PrefixLM(jnp.array([30])) | masks.Segments(ids, ids)
    bs = mosaic_gpu_heuristic(_spec(d=64))

    def loss(q, k, v):
        out = OP.implementations["mosaic_gpu"].fn(
            q, k, v, None, mask, scale=0.125, logits_soft_cap=None, block_sizes=bs
        )
        return jnp.sum(out.astype(jnp.float32))

    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)
    assert calls == {"check": 1, "dispatch": 0}, calls
    jax.eval_shape(loss, q, q, q)  # the forward alone
    assert calls == {"check": 2, "dispatch": 0}, calls
