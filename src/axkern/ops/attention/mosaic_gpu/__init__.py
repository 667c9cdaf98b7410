"""Flash attention as Pallas Mosaic GPU kernels for Hopper (FA3-style), forward and backward, block-sparse.

**Layout.** `q [B, Sq, H, D]`, `k`, `v [B, Sk, KVH, D]` as the caller gives them (no transpose):
the tensor memory accelerator (TMA) copies `[rows, D]` slices of one head straight into
shared memory. `Sq` is padded to whole `2 · block_q` and `Sk` to whole `block_kv` (only where
they are not). The kernel writes `[B, Sqp, H, D]` and `lse [B, H, Sqp]` (float32, natural
log); `forward` returns them cut to `Sq`.

**Grid.** `(H, Sqp / (2 · block_q), B)`, the heads launched fastest and the query-tile axis
walked last to first (the heaviest causal rows start first). A block holds three warpgroups:
two compute warpgroups, each owning `block_q` query rows (registers raised to 232 a thread), and
one producer warpgroup (registers lowered to 40) that streams the key and value tiles into a
ring of `num_stages` shared-memory slots with TMA, each slot guarded by a "loaded" barrier and a
"consumed" barrier (both compute warpgroups arrive). The two compute warpgroups alternate on the
tensor cores (FA3's ping-pong: one runs its `q kᵀ` and `p v` `wgmma`s while the other does its
softmax), in one of two forms (`AttentionBlockSizes.ping_pong`, `forward_flags`):
`"rendezvous"`, as JAX's `attention_mgpu.py`, both warpgroups meeting on one barrier after each
`q kᵀ` and before each `p v`; `"overlap"` (`overlap=True`), FA3's overlap inside a warpgroup, the
tensor cores handed over on a barrier per warpgroup: a turn issues tile t's `q kᵀ` and the
previous tile's `p v` together and runs tile t's softmax under that `p v`
(`blocks.mosaic_gpu_ping_pong` chooses; docs/ops/attention.md has the timings).

**Block-sparse schedule** (`schedule`, pure numpy, tested on the CPU against brute force).
From the static mask's block kinds (`EMPTY` / `PARTIAL` / `FULL` per `block_q x block_kv`
tile) each block gets the key tiles `[clo, chi)` its producer loads (the union of its two
query tiles' visible ranges) and each compute warpgroup four bounds `lo <= flo <= fhi <= hi`:
tiles `[flo, fhi)` (the longest run of `FULL` tiles) run without any masking work, the rest
of `[lo, hi)` mask by position (`grid_visible` on the tile's indices and the key length), and
the tiles of `[clo, chi)` outside `[lo, hi)` are only released (the other warpgroup needs them).
Fully masked tiles are never loaded: where a block's seen tiles leave a gap (`|` of masks
apart, such as a window and the keys far behind; `has_gaps`) the table carries a tile list
(`schedule(..., tiles=True)`): a block walks steps over the tiles it sees, step `s` loading
the tile at column `LIST + s`, and the bounds count steps (the kernels read a step's tile only
to address its copies, `dq`'s reductions and its mask, before the step's waits). The table is a
constant `int32 [blocks, 10]` input (`[blocks, 10 + the most tiles a block sees]` with a tile
list; `[clo, chi)` then counts steps, `[0, n)`).
Masks holding arrays (`Segments`, `PrefixLM`, and `&`, `|` of them with each other and with
static masks; `schedules.lower` swaps each such leaf for a `Dynamic` placeholder naming its
kernel operands): the block kinds are computed on the device per batch row
(`device_kinds`: `Segments` empty where the blocks' id ranges do not meet, full where both
blocks hold one same id; `PrefixLM` full where every key of the tile is at or before every
query or inside the prefix, empty where every key is after every query and past it; `&` the
smaller kind, `|` the larger), the table is `[B, blocks, 10]` (`schedule_rows` is `schedule`
in jnp; ranges, no tile list: a gap there, ids that come back after other ids, is loaded and
masked), and a partial tile evaluates the lowered mask (`tiles.TileMask`: a warpgroup's rows'
ids and prefix lengths read once, each tile's columns' ids read as it comes).

**Math.** Scores `s = q kᵀ` in float32 on the tensor cores; the running max is kept in
base-2 units (`s · scale · log2 e`) so `p = exp2(s · c - m)` is one fused multiply-add and an
`ex2`; with a soft cap the scores are `tanh(s · scale / cap) · cap · log2 e` (MUFU `tanh`, one
more per score). `p` is cast to the input dtype for `p v`. A row that has seen no key yet
keeps `m = -inf` without NaN (only masked tiles can leave a row empty). Sinks join at the end:
`m' = max(m, sink · log2 e)`, `l' = l · 2^(m - m') + 2^(sink · log2 e - m')`. Output
`acc / l` (zeros for a row that saw no key and no sink), `lse = m · ln 2 + log l` (`-inf`
there).

**Cost.** `4 · B · H · D` FLOPs per visible (query, key) pair, tensor-core bound at these sizes;
`k`, `v` read once per query block that sees them (GQA: once per query head; L2 serves the
group); `q` read and `out` written once (with sinks, for the backward, `lo` written too: one
more output's bytes), `lse` 4 bytes a row. Shared memory: `blocks.mosaic_gpu_smem_bytes`.

**Non-finite input.** `p v` multiplies a masked entry's `p = 0` by `v`, so a NaN in `v`
would reach rows that cannot see its key: `api.py` runs this implementation behind the
non-finite guard (`common.guarded`), which serves inputs holding NaN or infinity with a
rule-following implementation.

**Backward** (`backward`, head dims 64, 128 and 256), two kernels of the same shape (a producer
warpgroup streaming tiles through a TMA ring past two compute warpgroups), on the forward's
residuals: `lse` goes in base-2 units with `+inf` for rows that saw no key (every `p` there is
0; with sinks `lse` holds them, so the kernels need nothing more, and the sinks' own
cotangent `-Σ exp(sink - lse) · delta` is formed in XLA) and `delta = Σ out · d_out` is formed
in XLA, less `lse`'s cotangent where the caller asked for `lse` (`∂lse/∂s = p`: the kernels
need nothing more for it). With a soft cap both kernels recompute `t = tanh(s · scale / cap)`
and multiply `ds` by `1 - t²`. The `dq` kernel (`backward_dq.py`, grid `(H, query blocks, B)`)
holds each warpgroup's query and `d_out` tiles and streams key and value tiles (the forward's
schedule): `dp = d_out vᵀ` and `s = q kᵀ` in one `wgmma` group, `p = exp2(s · scale · log2 e −
lse)`, `ds = p (dp − delta)`, `dq += ds k`. The `dk, dv` kernel (`backward_dkv.py`, grid
`(KVH, key blocks, B)`) holds each warpgroup's key and value tiles and streams, for every query
tile of `key_schedule` (the transposed mask's), the query tiles, `d_out` tiles, `lse` and
`delta` rows of each query head of the group: `sᵀ = k qᵀ`, `dv += pᵀ d_out`, `dpᵀ = v d_outᵀ`,
`dk += dsᵀ q`, so the GQA sum stays in registers and `dk`, `dv` are written once. Only partial
tiles mask. At head dim 256 the `dk` and `dv` accumulators together would fill a warpgroup's
registers, so the kernel runs twice (`SPLIT_ABOVE`): once for `dv` (`sᵀ`, `dv += pᵀ d_out`),
once for `dk` (`sᵀ`, `dpᵀ`, `dk`): 5 products instead of 4. Their tiles there fit shared
memory with one ring stage (64 x 64 tiles; a product's contraction runs over whole 128-byte
swizzle rows, so no tile is narrower than 64).

**`dq` by reduction** (`AttentionBlockSizes(dq_by="reduction")`, the default at head dim 64,
`blocks.mosaic_gpu_dq_by`): no `dq` kernel; the `dk, dv` kernel stores each step's `ds` in
shared memory and forms the step's `dq` share `dsᵀ k` (`[block_q, D]`, by column chunks of
64) beside `dk += ds q`, then adds it to a float32 `[B, Sqp, H, D]` of zeros by a TMA reduction
(`copy_smem_to_gmem(..., reduction_op="add")`, each chunk through its own staging tile); XLA
scales and rounds the sum. 10 FLOPs per visible pair and head dim instead of 14; bytes: no
`dq` kernel's reads of `k`, `v`, `q`, `d_out`, and instead each step's share, `4 · block_q · D`
(`4 · D / block_kv` bytes per visible pair: `D / 16` at 64-key tiles), added in L2, plus the
float32 `dq` written as zeros, read and rounded once by XLA; the additions' order varies between
runs (so `"kernel"` where `XLA_FLAGS` asks for deterministic results). Head dims up to 128 (at
256 the kernel already runs twice).

**Sinks' cotangent.** `-Σ exp(sink - lse) · delta` sums `out · d_out` over every row, and
rounding `out` to 16 bits puts each term off by up to 2⁻⁹ relative, which over many rows can
exceed the oracle rule's bound. With sinks the forward also writes `lo`, what the rounding
lost, and `delta` takes `out + lo` (for the sum and for the backward kernels alike); without
them nothing more is written.

**Backward cost.** `14 · B · H · D` FLOPs per visible (query, key) pair, 3.5 times the
forward's: the `dq` kernel's three products (`s`, `dp`, `dq`) and the `dk, dv` kernel's four
(`sᵀ`, `dpᵀ`, `dv`, `dk`), `2 · D` each. Bytes: the `dq` kernel reads `k`, `v` once per query
block that sees them and `q`, `d_out` once; the `dk, dv` kernel reads `q`, `d_out` and the
`lse`, `delta` rows once per key block that sees them, for every query head of its group, and
`k`, `v` once; `dq`, `dk`, `dv` are written once each (no atomics, no float32 copies). At head
dim 256 the `dk, dv` kernel's two launches each read `k`, `v`, `q`, `d_out` and the `lse` rows
(`delta` only for `dk`): 16 FLOPs per visible pair and head dim instead of 14.

**Testing.** The kernels cannot run in interpret mode on a CPU (Pallas Mosaic GPU's TMA copies
have no interpret rule). On a CPU the tests check everything around them (the schedules against
brute force, the tables, the checks, the dispatcher, the backward's tile loops emulated in
numpy) and lower every kernel for a CUDA GPU (`tests/ops/test_attention_mosaic_gpu_lowering.py`);
their values and gradients are checked against the oracle on a Hopper GPU
(`tests/gpu/test_attention_mosaic_gpu.py`).

**Files.** `schedules.py` (the tables, host and device, and the masks on index grids),
`tiles.py` (what the kernels share: the configuration, table reads, id loads, the producer of
key and value tiles), `forward.py` (the forward kernel and its launch), `backward_dq.py` and
`backward_dkv.py` (the backward kernels and their launches), `backward.py` (the backward: its
tiles, checks, operands and launches); this file the checks, the `custom_vjp` and the
`Implementation`.

**Constraints** (`supports`, or an `Unsupported` at the call): a GPU of compute capability
9.x, bf16 or fp16, head dims 64, 128 or 256 (`q`, `k`, `v` alike), every mask but `Dense`,
a positive soft cap and scale (scores are masked to `-inf` before they are scaled), one dtype
for `q`, `k`, `v`. Block sizes: `block_q` (rows per compute warpgroup, 64 or 128), `block_kv`
(64, 128 or 256), `num_stages` (ring depth, 2 to 4); their shared memory must fit 227 KiB.
Backward (`*_dq`, `*_dkv`): `dq` 64 query rows per warpgroup by 64 or 128 keys, `dk, dv` 64 keys
per warpgroup by 64 or 128 query rows, 2 to 4 stages each (1 to 4 at head dim 256).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from axkern.core import backend
from axkern.core.op import Implementation, Unsupported

from .. import common
from ..blocks import AttentionBlockSizes, mosaic_gpu_heuristic, mosaic_gpu_space
from .backward import (
    BACKWARD_HEAD_DIMS,
    SPLIT_ABOVE,
    backward,
    backward_blocks,
    backward_operands,
    check_backward,
    dq_by,
    refuse_backward,
)
from .forward import check_tiles, forward
from .schedules import (
    COMPUTE_WGS,
    CTA_HI,
    CTA_LO,
    FHI,
    FLO,
    HI,
    LIST,
    LO,
    Dynamic,
    device_kinds,
    grid_visible,
    has_gaps,
    key_schedule,
    lower,
    mask_schedule,
    operands,
    schedule,
    schedule_rows,
    schedule_table,
)
from .tiles import IMPORT_ERROR

__all__ = [
    "IMPLEMENTATION",
    "IMPORT_ERROR",
    "supports",
    "check",
    "check_backward",
    "check_inputs",
    "schedule",
    "mask_schedule",
    "key_schedule",
    "schedule_rows",
    "schedule_table",
    "device_kinds",
    "has_gaps",
    "lower",
    "grid_visible",
    "operands",
    "Dynamic",
    "forward",
    "forward_flags",
    "backward",
    "backward_blocks",
    "backward_line",
    "dq_by",
    "backward_operands",
    "attention",
    "HEAD_DIMS",
    "BACKWARD_HEAD_DIMS",
    "SPLIT_ABOVE",
    "COMPUTE_WGS",
    "CTA_LO",
    "CTA_HI",
    "LO",
    "FLO",
    "FHI",
    "HI",
    "LIST",
]

HEAD_DIMS = (64, 128, 256)


def supports(spec) -> str | None:
    reason = backend.mosaic_gpu_reason(spec, IMPORT_ERROR)
    if reason:
        return reason
    d, dv = spec.dim("head_dim"), spec.dim("v_dim")
    if d not in HEAD_DIMS or dv != d:
        return f"head dims {d} and {dv}: the Mosaic GPU kernel takes equal head dims of 64, 128 or 256"
    if spec.flag("mask") == "Dense":
        return "mask Dense: the Mosaic GPU kernels take static masks, Segments, PrefixLM and & or | of them"
    return None


_PING_PONG = {None: {}, "rendezvous": {}, "overlap": {"overlap": True}}


def _blocks(block_sizes) -> dict:
    return dict(
        block_q=block_sizes.block_q,
        block_kv=block_sizes.block_kv,
        num_stages=2 if block_sizes.num_stages is None else block_sizes.num_stages,
    )


def forward_flags(block_sizes) -> dict:
    """`forward`'s flags for the block sizes' `ping_pong` (`AttentionBlockSizes`); `Unsupported`
    for a form it does not know."""
    form = block_sizes.ping_pong
    if form not in _PING_PONG:
        raise Unsupported(f"ping_pong={form!r}: the Mosaic GPU forward takes 'rendezvous' or 'overlap'")
    return _PING_PONG[form]


def check(mask, block_sizes, head_dim, sinks=None, logits_soft_cap=None, scale=None) -> None:
    """`Unsupported` with the reason when the forward kernel cannot serve these options (the
    backward kernels: `check_backward`). A scale of 0 or below is refused: the kernels mask
    scores to `-inf` before scaling them."""
    if logits_soft_cap is not None and not float(logits_soft_cap) > 0:
        raise Unsupported(f"logits_soft_cap={logits_soft_cap}: the Mosaic GPU kernels take a positive cap")
    if scale is not None and not float(scale) > 0:
        raise Unsupported(f"scale={scale}: the Mosaic GPU kernels take a positive scale")
    b = _blocks(block_sizes)
    forward_flags(block_sizes)
    check_tiles(b["block_q"], b["block_kv"], b["num_stages"], head_dim)
    lower(mask)  # raises for a mask the kernels cannot evaluate on a tile


def check_inputs(q, k, v) -> None:
    """`Unsupported` unless `q`, `k`, `v` share one dtype (the kernels' shared-memory tiles and
    products take one)."""
    if not q.dtype == k.dtype == v.dtype:
        raise Unsupported(
            f"q, k, v are {q.dtype}, {k.dtype}, {v.dtype}: the Mosaic GPU kernels take one dtype"
        )


def attention(q, k, v, sinks, mask, *, scale, logits_soft_cap, block_sizes, return_lse=False):
    """The forward kernel under a `custom_vjp` whose backward is the Mosaic GPU `dq` and `dk, dv`
    kernels; `return_lse`: `(out, lse [B, Sq, H] float32)`, `lse`'s cotangent joining `delta`
    (`common.lse_cotangent`). Every check runs first, once (`check`, `check_inputs`, and the
    backward's: `Unsupported` before anything is traced). `sinks [H]` join each row's
    denominator in the forward (so `lse` holds them and the backward kernels need nothing
    more); their cotangent is `-Σ exp(sink - lse) · delta` over the rows, formed in XLA from
    `out` and the forward's `lo` (the module's docstring). The mask's arrays (segment ids,
    prefix lengths) are arguments of the `custom_vjp`, not closed over, so a jitted call with
    traced ones differentiates."""
    check(mask, block_sizes, q.shape[3], sinks, logits_soft_cap, scale=scale)
    check_inputs(q, k, v)
    refuse_backward(mask, block_sizes, q.shape[3])  # tiles that do not fit: the dispatcher moves on
    fwd = functools.partial(
        forward,
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        **_blocks(block_sizes),
        **forward_flags(block_sizes),
    )
    bwd = functools.partial(backward, scale=scale, block_sizes=block_sizes, logits_soft_cap=logits_soft_cap)
    leaves, treedef = jax.tree.flatten(mask)
    rebuild = functools.partial(jax.tree.unflatten, treedef)

    @jax.custom_vjp
    def fn(q, k, v, sinks, leaves):
        out, lse = fwd(q, k, v, rebuild(leaves), sinks=sinks)[:2]
        return out, common.public_lse(lse, q.shape[1])

    def fn_fwd(q, k, v, sinks, leaves):
        out, lse, *lo = fwd(q, k, v, rebuild(leaves), sinks=sinks, out_lo=sinks is not None)
        return (out, common.public_lse(lse, q.shape[1])), (q, k, v, sinks, out, lse, lo, leaves)

    def fn_bwd(res, cts):
        (d_out, d_lse), (q, k, v, sinks, out, lse, lo, leaves) = cts, res
        # with sinks `out + lo` in float32, the output before its rounding, as their sum needs
        # (the kernels read `out` only through `delta`, which takes it too: `common.unrounded`)
        out = common.unrounded(out, lo[0]) if lo else out
        dq, dk, dv = bwd(q, k, v, out, lse, d_out, mask=rebuild(leaves), d_lse=d_lse)
        d_sinks = None
        if sinks is not None:
            delta = jnp.einsum("bqhd,bqhd->bhq", out, d_out.astype(jnp.float32))
            d_sinks = common.sink_grad(sinks, lse, delta - jnp.swapaxes(d_lse.astype(jnp.float32), 1, 2))
        return dq, dk, dv, d_sinks, None

    fn.defvjp(fn_fwd, fn_bwd)
    return common.maybe_lse(fn(q, k, v, sinks, leaves), return_lse)


def backward_line(spec, block_sizes) -> str:
    """`explain`'s backward line: which kernels the backward runs for this call."""
    d = max(spec.dim("head_dim"), spec.dim("v_dim"))
    (bq1, bk1, st1), (bq2, bk2, st2) = backward_blocks(block_sizes, d)
    split = d > SPLIT_ABOVE
    reduced = dq_by(block_sizes, d) == "reduction"
    dq = (
        "dk, dv with dq (one launch; dq's tile shares added by TMA reductions into float32"
        if reduced
        else f"dq ({bq1}x{bk1} tiles, {st1} stage{'s' * (st1 > 1)}) and "
        + ("dv, then dk (two launches" if split else "dk, dv (one launch")
    )
    return (
        f"Mosaic GPU kernels: {dq}"
        + f"; {bq2}x{bk2}, {st2} stage{'s' * (st2 > 1)}, the GQA sum in registers) on this forward's "
        "residuals (out, lse); inputs or a cotangent holding NaN or infinity go to pallas_gpu (or xla), "
        "forward and backward"
    )


# `api.py` registers it behind the non-finite guard (`common.guarded`)
IMPLEMENTATION = Implementation(
    "mosaic_gpu",
    attention,
    platforms=("gpu",),
    supports=supports,
    block_sizes=AttentionBlockSizes,
    heuristic=mosaic_gpu_heuristic,
    space=mosaic_gpu_space,
    backward=backward_line,
    why_platforms="a Pallas Mosaic GPU kernel for Hopper (TMA, wgmma); it has no interpret mode here",
)
