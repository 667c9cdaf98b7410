"""The Mosaic GPU SSD kernels (the package's docstring has their math, layout, grid, precision
and cost): the chunk state and the chunk scan forward, each with the function that launches it,
the shared memory of all four (`backward.py` has the backward kernels) and their launcher."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load
from axkern.core.kernels import swizzled_smem
from axkern.core.op import Unsupported

from .rotation import RotatedOperand, SplitOperand
from .rows import _dims, _indexer, _rows_type  # noqa: F401 - the kernels' modules take them from here

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means the kernels cannot serve
    plgpu, _IMPORT_ERROR = None, e

__all__ = ["CHUNK", "smem_bytes", "dims_reason", "chunk_state", "chunk_scan", "operand_parts"]

CHUNK = 64  # positions per chunk: one warpgroup's wgmma rows
# the lean kernels' staging tiles (`backward._staged`: through them in turn; two 64 x 32 work too)
STAGES = [((CHUNK, CHUNK), jnp.float32)]


_SMEM = 227 * 1024  # shared memory a Hopper block may take
_SMEM_EXTRA = 1024 + 2048  # barriers and alignment, rounded up; Mosaic GPU's scratch for cross-warp sums


def _tiles(kernel: str, p: int, n: int, dtype=jnp.bfloat16, rows_dtype=jnp.float32, parts=1, q=CHUNK) -> list:
    """Shared-memory tiles of `kernel` at head dim `p` and state `n` as `(shape, dtype)`, in the
    order its body takes them (`rows_dtype`: the scan's `y`, the state backward's `dx`; `parts`:
    `B` and `C` as one 16-bit tile each or two, `operand_parts`; `q`: the rows a block takes)."""
    f32 = jnp.float32
    bc = ((parts, q, n), dtype)
    return {
        # B, w ∘ x's halves, the float32 state
        "state": [bc, ((q, p), dtype), ((q, p), dtype), ((p, n), f32)],
        # C, B, x, the incoming state, y
        "scan": [bc, bc, ((q, p), dtype), ((p, n), dtype), ((q, p), rows_dtype)],
        # B, dS's halves, dx, float32 dB and dw
        "state_bwd": [
            bc,
            ((p, n), dtype),
            ((p, n), dtype),
            ((q, p), rows_dtype),
            ((q, n), f32),
            ((q,), f32),
        ],
        # C, B, x; the halves of the state, of dy (then f ∘ dy), of M (then dg); float32 dx, dB
        # (then dC), dS_in, and the four vectors ddt, dcum, df, dcum_row
        "scan_bwd": [bc, bc, ((q, p), dtype)]
        + [((p, n), dtype)] * 2
        + [((q, p), dtype)] * 2
        + (
            [((q, q), dtype)] * 2 + [((q, p), f32), ((q, n), f32), ((p, n), f32), ((4, q), f32)]
            if q == CHUNK  # above: staging by tiles of 64 rows (`tiled.py`), dB, dC and dS_in in one
            else [((CHUNK, p), f32), ((max(CHUNK, p), n), f32), ((4, q), f32)]
        ),
        # the lean form (chunks of 64, P 64): one tile of the state (its low half in M's), `STAGES`
        "scan_bwd_lean": [bc, bc, ((q, p), dtype), ((p, n), dtype), *[((q, p), dtype)] * 2]
        + [((q, q), dtype)] * 2
        + [*STAGES, ((4, q), f32)],
    }[kernel]


def _smem(tiles) -> list:
    """Tiles `(shape, dtype)` as Mosaic GPU shared memory: swizzled where they are `wgmma` or TMA
    tiles (8 rows or more, in slots or not), plain for the vectors."""
    swizzled = lambda shape: len(shape) >= 2 and shape[-2] % 8 == 0  # noqa: E731
    return [swizzled_smem(shape, d) if swizzled(shape) else plgpu.SMEM(shape, d) for shape, d in tiles]


def smem_bytes(p: int, n: int, parts: int = 1) -> int:
    """Shared memory of the largest of the four kernels at head dim `p` and state `n` (bf16
    inputs; `parts`: `B`, `C` as one tile each or two): their `_tiles` and what Mosaic GPU adds."""
    kernels = ("state", "scan", "state_bwd", "scan_bwd")
    return max(tile_bytes(_tiles(k, p, n, parts=parts)) for k in kernels)


def _walk_setup(xt, bt, keep, tiles, what, *rest, positions_first, chunk=CHUNK):
    """What a kernel walking one (batch row, head)'s chunks (`forward.py`, `state_backward.py`)
    does first: its operands checked (`x`, `B`, `rest` bf16, `B` and `rest` as `operand_parts`
    gives them) and its `tiles` against shared memory; `(b, h, L, P, N, chunks, keep_rows)`,
    `keep_rows [b, h, c, P]` float32 the carries with one value per row of a `[P, N]` state."""
    _check_operands(xt, bt, *rest, positions_first=positions_first, chunk=chunk)
    b, h, lp, p = _dims(xt, positions_first)
    n, c = bt[0].shape[-1], lp // chunk
    if tile_bytes(tiles) > _SMEM:
        raise Unsupported(f"head_dim={p}, state={n}, chunk={chunk}: {what}'s tiles exceed shared memory")
    keep_rows = jnp.broadcast_to(keep[..., None], (b, h, c, p)).astype(jnp.float32)
    return b, h, lp, p, n, c, keep_rows


def tile_bytes(tiles) -> int:
    """Shared memory of tiles `(shape, dtype)` and what Mosaic GPU adds."""
    return sum(math.prod(s) * jnp.dtype(d).itemsize for s, d in tiles) + _SMEM_EXTRA


def blocks_per_sm(tiles) -> int:
    """How many blocks of `tiles` a Hopper SM's 228 KiB of shared memory hold at once (the
    system keeps 1 KiB of it a block)."""
    return 228 * 1024 // (tile_bytes(tiles) + 1024)


def dims_reason(p: int, n: int, parts: int = 1) -> str | None:
    """Why the kernels cannot take head dim `p` and state `n` (`B`, `C` in `parts` tiles each),
    or None."""
    for name, d in (("head_dim", p), ("state", n)):
        if d % 64 or d > 256:
            return f"{name}={d}: the Mosaic GPU kernels take multiples of 64 up to 256"
    if smem_bytes(p, n, parts) > _SMEM:
        split = f" with B and C as {parts} 16-bit halves each" if parts > 1 else ""
        return (
            f"head_dim={p}, state={n}: the Mosaic GPU kernels{split} would take "
            f"{smem_bytes(p, n, parts)} bytes of shared memory, more than a Hopper block's {_SMEM}"
        )
    return None


def _params():
    """The kernels' compiler parameters: lane semantics (each array's layout is the one the code
    names: jax 0.11's default, warpgroup semantics, infers them and finds no solution for these
    bodies), fast approximate `exp`."""
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)


def _decay(cum_t, cum_s, seg_t, seg_s, diagonal=True):
    """`Λ[t, s] = exp(cum_t - cum_s)` for `s <= t` in one segment, else 0 (`[Q, Q]`, WGMMA
    layout, from per-row `_t` and per-column `_s` vectors), and the broadcast of a per-column
    vector onto it. `diagonal=False`: a tile whose columns all precede its rows (only the
    segments mask)."""
    q = cum_t.shape[0]
    shape, layout = (q, q), plgpu.Layout.WGMMA
    if diagonal:
        t_idx = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
        s_idx = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    on_rows = lambda v: lax.broadcast_in_dim(v, shape, [0])  # noqa: E731
    on_cols = lambda v: lax.broadcast_in_dim(v, shape, [1])  # noqa: E731
    if diagonal:
        visible = (s_idx <= t_idx) & (on_rows(seg_t) == on_cols(seg_s))
    else:
        visible = on_rows(seg_t) == on_cols(seg_s)
    return jnp.exp(jnp.where(visible, on_rows(cum_t) - on_cols(cum_s), -jnp.inf)), on_cols


def _scan_kernel(
    x_ref, dt_ref, cum_ref, f_ref, seg_ref, b_ref, c_ref, s_ref, y_ref, scoped, *, rep, dtype, add, rows_of
):
    (c_smem, b_smem, x_smem, s16_smem, y_smem), loaded = scoped
    chunk, head, batch = lax.axis_index("chunks"), lax.axis_index("heads"), lax.axis_index("batch")
    q, p = x_smem.shape
    base = chunk * q
    group = lax.div(head, jnp.int32(rep))
    rows = pl.ds(base, q)
    cs, bs = parts_of(c_smem), parts_of(b_smem)
    copies = _copy_chunk_in(
        (c_ref, cs), (b_ref, bs), (x_ref, x_smem), batch, group, head, rows, rows_of, loaded
    )

    if q == CHUNK:
        vectors = _scan_vectors(dt_ref, cum_ref, f_ref, seg_ref, batch, head, rows)
    state = mosaic_gpu_load(s_ref.at[batch, chunk, head], layout=plgpu.Layout.WGMMA, optimized=False)
    s16_smem[...] = state.astype(dtype)  # [P, N]
    plgpu.commit_smem()
    for i in range(copies):
        plgpu.barrier_wait(loaded.at[i])
    if q == CHUNK:
        y_smem[...] = _chunk_output(cs, bs, x_smem, s16_smem, *vectors, dtype=dtype).astype(y_smem.dtype)
    else:
        from .tiled import chunk_output_tiled, chunk_tiles, into_rows  # noqa: PLC0415 - builds on this module

        refs, tiles = (dt_ref, cum_ref, f_ref, seg_ref), chunk_tiles(cs, bs, x_smem)
        chunk_output_tiled(tiles, s16_smem, into_rows(y_smem), refs, batch, head, base, dtype=dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(y_smem, rows_of(y_ref, batch, head, rows))
    plgpu.wait_smem_to_gmem(0)


def _scan_vectors(dt_ref, cum_ref, f_ref, seg_ref, batch, head, rows):
    """The chunk's per-position vectors the output takes, along the `[Q, Q]` tile's rows (`_t`)
    or columns (`_s`): `cum_t, cum_s, dt_s, f_t, seg_t, seg_s`."""
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    vec = lambda ref, layout: mosaic_gpu_load(ref.at[batch, head, rows], layout=layout, optimized=False)  # noqa: E731
    cum_t, cum_s, dt_s, f_t = vec(cum_ref, row), vec(cum_ref, col), vec(dt_ref, col), vec(f_ref, row)
    seg_t = mosaic_gpu_load(seg_ref.at[batch, rows], layout=row, optimized=False)
    seg_s = mosaic_gpu_load(seg_ref.at[batch, rows], layout=col, optimized=False)
    return cum_t, cum_s, dt_s, f_t, seg_t, seg_s


def _copy_chunk_in(c, b, x, batch, group, head, rows, rows_of, loaded) -> int:
    """TMA copies of a chunk's `rows` of `C`, `B` (`(refs, tiles)`: their parts, the head's group) and
    `x` (`(ref, tile)`) into shared memory, a barrier each (arrived on once, with its bytes); how many."""
    copies = _part_copies(*c, batch, group, rows) + _part_copies(*b, batch, group, rows)
    copies.append((rows_of(x[0], batch, head, rows), x[1]))
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])
    return len(copies)


def _part_copies(refs, dsts, batch, group, rows) -> list:
    """The TMA copies `(source, destination)` of a group's `rows` of `B` or `C` (`refs`: its
    parts, `[b, g, L, N]` each) into the tiles `dsts` (`[Q, N]` each, `parts_of`), one per part."""
    return [(ref.at[batch, group, rows], dst) for ref, dst in zip(refs, dsts, strict=True)]


def parts_of(smem, first=0, parts=None) -> tuple:
    """The 16-bit tiles of one operand held as `parts` consecutive tiles of `smem` from `first`
    (all of them where `parts` is None)."""
    parts = smem.shape[0] if parts is None else parts
    return tuple(smem.at[first + k] for k in range(parts))


def pairs(left, right, trans=False) -> list:
    """The `wgmma` operands `(left, right, transpose the right?)` of a product whose two operands
    are each one 16-bit tile or a float32 value's two halves (`hi`, `lo`): every pair of parts
    but `lo · lo` (`|lo_a lo_b| <= 2^-16 |a b|`, the size of the halves' own rounding)."""
    return [(a, b, trans) for i, a in enumerate(left) for j, b in enumerate(right) if i + j <= 1]


def _chunk_output(
    cs, bs, x_smem, s16_smem, cum_t, cum_s, dt_s, f_t, seg_t, seg_s, *, dtype, scores=None, onto=False
):
    """A chunk's `y` (`[Q, P]` float32) from its tiles in shared memory (`cs`, `bs`: `C` and `B`
    as their parts; `s16_smem` the entering state in 16 bits): `C Bᵀ` (or `scores`, formed
    before) and its decayed scores first, then `C S_inᵀ` (fewer registers live at once), `M x`
    from `M`'s two 16-bit halves (`onto`: accumulated onto `f ∘ (C S_inᵀ)`, one `[Q, P]` float32
    value fewer live)."""
    q, p = x_smem.shape
    s = _products((q, q), pairs(cs, bs, True)) if scores is None else scores  # [Q, Q]
    decay, on_cols = _decay(cum_t, cum_s, seg_t, seg_s)
    m = s * decay * on_cols(dt_s)
    m_hi, m_lo = _halves(m, dtype)
    inc = _products((q, p), pairs(cs, (s16_smem,), True))  # [Q, P]
    terms = [(m_hi, x_smem, False), (m_lo, x_smem, False)]
    if onto:
        return _products((q, p), terms, acc=inc * lax.broadcast_in_dim(f_t, (q, p), [0]))
    y = _products((q, p), terms)
    return y + inc * lax.broadcast_in_dim(f_t, (q, p), [0])


def _state_kernel(x_ref, w_ref, b_ref, own_ref, scoped, *, rep, dtype, add, rows_of):
    (b_smem, xh_smem, xl_smem, own_smem), loaded = scoped
    chunk, head, batch = lax.axis_index("chunks"), lax.axis_index("heads"), lax.axis_index("batch")
    q = b_smem.shape[1]
    rows = pl.ds(chunk * q, q)
    copies = _part_copies(b_ref, parts_of(b_smem), batch, lax.div(head, jnp.int32(rep)), rows)
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, loaded.at[i])
    # w ∘ x in registers (w per row), as two 16-bit halves in shared memory, 64 rows at a time
    # (the whole tiles at chunks of 64)
    blocks = [(rows, xh_smem, xl_smem)]
    if q > CHUNK:
        at = lambda k: pl.ds(k * CHUNK, CHUNK)  # noqa: E731
        blocks = [
            (pl.ds(chunk * q + k * CHUNK, CHUNK), xh_smem.at[at(k)], xl_smem.at[at(k)])
            for k in range(q // CHUNK)
        ]
    for r, xh, xl in blocks:
        x = mosaic_gpu_load(rows_of(x_ref, batch, head, r), layout=plgpu.Layout.WGMMA, optimized=False)
        w = mosaic_gpu_load(w_ref.at[batch, head, r], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        xh[...], xl[...] = _halves(x.astype(jnp.float32) * lax.broadcast_in_dim(w, x.shape, [0]), dtype)
    plgpu.commit_smem()
    for i in range(len(copies)):
        plgpu.barrier_wait(loaded.at[i])
    # (w ∘ x)ᵀ B: [P, N]
    xw = (xh_smem.transpose((1, 0)), xl_smem.transpose((1, 0)))
    own_smem[...] = _products(own_smem.shape, pairs(xw, parts_of(b_smem)))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(own_smem, own_ref.at[batch, chunk, head])
    plgpu.wait_smem_to_gmem(0)


def _check_operands(xt, bt, *rest, positions_first=False, chunk=CHUNK):
    """`x` (`[b, h, L, P]` or `positions_first`) and `B` and `rest` as `operand_parts` gives them
    (tuples of `[b, g, L, N]`), bf16, at a length of whole chunks and dimensions the kernels take."""
    b, h, lp, p = _dims(xt, positions_first)
    if chunk % CHUNK:
        raise ValueError(f"chunk={chunk}: the Mosaic GPU kernels take chunks of a multiple of {CHUNK}")
    if lp % chunk:
        raise ValueError(f"length {lp} is not a multiple of the chunk ({chunk})")
    reason = dims_reason(p, bt[0].shape[-1], len(bt))
    if reason:
        raise Unsupported(reason)
    arrays = (xt, *bt, *(a for parts in rest for a in parts))
    if any(a.dtype != jnp.bfloat16 for a in arrays):
        dtypes = ", ".join(str(a.dtype) for a in arrays)
        raise Unsupported(f"x, B, C are {dtypes}: the Mosaic GPU kernels take bf16")


def operand_parts(a) -> tuple:
    """`B` or `C` (`[b, g, L, N]`) as the kernels take it, a tuple of bf16 arrays of its shape: a
    16-bit array as its one part, a float32 one (Mamba-3's rotated `k`, `q`) as two, `hi` (`a`
    rounded to bf16) and `lo` (`a - hi` rounded to bf16), so that `hi + lo` is within `2^-16 |a|`
    of `a` (two arrays, not one stacked: XLA forms both in one pass over `a`, where a
    stack's concatenation computed `a` once for each). `hi` returns to float32 by its bits, not by
    a conversion: XLA's GPU compiler may drop a float32 -> bf16 -> float32 round trip (excess
    precision), which would make `lo` zero. A `RotatedOperand` is rotated first."""
    if isinstance(a, tuple):
        return a
    if isinstance(a, SplitOperand):
        return (a.hi, a.lo)
    if isinstance(a, RotatedOperand):  # formed in XLA here (the rotating forward forms it itself)
        a = a.value()
    if jnp.dtype(a.dtype).itemsize == 2:
        return (a,)
    a = a.astype(jnp.float32)
    hi = a.astype(jnp.bfloat16)
    bits = lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32) << 16
    return hi, (a - lax.bitcast_convert_type(bits, jnp.float32)).astype(jnp.bfloat16)


def chunk_state(xt, w, bt, *, positions_first=False, chunk=CHUNK):
    """Each chunk's own state `[b, c, h, P, N]` float32, `(w ∘ x)ᵀ B` (`xt [b, h, L, P]` bf16,
    `bt [b, g, L, N]` bf16 or float32 (`operand_parts`), `w [b, h, L]` float32, `L = c · chunk`)
    by the Mosaic GPU kernel: `w ∘ x` as two 16-bit halves (`bf16x2`), `B` as its parts.
    `positions_first`: `xt` is `[b, L, h, P]` (here and in the other three kernels: `x`, `y`,
    `dy`, `dx` so). `chunk`: a multiple of 64, the block's product taking the chunk's rows at once
    (its tiles within shared memory)."""
    bt = operand_parts(bt)
    _check_operands(xt, bt, positions_first=positions_first, chunk=chunk)
    b, h, lp, p = _dims(xt, positions_first)
    _check_tiles("state", p, bt, chunk)
    out = jax.ShapeDtypeStruct((b, lp // chunk, h, p, bt[0].shape[-1]), jnp.float32)
    barrier = plgpu.Barrier(num_barriers=len(bt))
    launch = _launch(
        "state", _state_kernel, out, xt, bt, barrier, positions_first=positions_first, rows=chunk
    )
    return launch(xt, w, bt)


def chunk_reason(p, n, chunk, parts=1, kinds=("state", "scan", "scan_bwd")) -> str | None:
    """Why the `kinds` of kernel cannot run chunks of `chunk` (a multiple of 64) at head dim `p`, state
    `n`, or None: their tiles exceed shared memory (the state backward's are 64's at any chunk)."""
    for kind in kinds:
        used = tile_bytes(_tiles(kind, p, n, parts=parts, q=chunk))
        if used > _SMEM:
            return (
                f"chunk={chunk}, head_dim={p}, state={n}: the {kind} kernel's tiles take {used} bytes "
                f"of shared memory, more than a Hopper block's {_SMEM}"
            )
    return None


def _check_tiles(kind: str, p: int, bt, chunk: int) -> None:
    """`Unsupported` where `kind`'s tiles at chunks of `chunk` exceed shared memory (64: `dims_reason`)."""
    if chunk != CHUNK and (reason := chunk_reason(p, bt[0].shape[-1], chunk, len(bt), (kind,))):
        raise Unsupported(reason)


def chunk_scan(
    xt, dt, cum, f, seg, bt, ct, states_in, *, positions_first=False, y_dtype=jnp.float32, chunk=CHUNK
):
    """`y [b, h, L, P]` (float32, or rounded to `y_dtype` in the kernel) of the chunks (`xt [b,
    h, L, P]` bf16, `bt, ct [b, g, L, N]` bf16 or float32 (`operand_parts`); `dt, cum, f [b, h,
    L]` float32; `seg [b, L]` int32; `states_in [b, c, h, P, N]` float32, `L = c · chunk`) by the
    Mosaic GPU kernel. `chunk`: a multiple of 64, above 64 by tiles of 64 rows (`tiled.py`)."""
    bt, ct = operand_parts(bt), operand_parts(ct)
    _check_operands(xt, bt, ct, positions_first=positions_first, chunk=chunk)
    _check_tiles("scan", _dims(xt, positions_first)[3], bt, chunk)
    out = jax.ShapeDtypeStruct(xt.shape, y_dtype)
    barrier = plgpu.Barrier(num_barriers=len(bt) + len(ct) + 1)
    kw = dict(positions_first=positions_first, rows_dtype=y_dtype, rows=chunk)
    launch = _launch("scan", _scan_kernel, out, xt, bt, barrier, **kw)
    return launch(xt, dt, cum, f, seg.astype(jnp.int32), bt, ct, states_in)


def _launch(
    kind,
    body,
    out_type,
    xt,
    bt,
    barrier,
    *,
    into=None,
    positions_first=False,
    tiles=None,
    rows_dtype=jnp.float32,
    rows=CHUNK,
    columns=1,
    **kw,
):
    """The Mosaic GPU kernel `body` of `kind` ("state", "scan", ...) over the grid (batch, heads,
    chunks), the chunks on CUDA's x axis (the others take at most 65535), with `_tiles(kind)`
    and `barrier` in shared memory; `rep` heads a group of `bt`. `into` (`{output index: input
    index}`): those outputs are their inputs' buffers (zeros the body adds into; the body sees
    only the output): the outputs are then refs the kernel writes (`pl.run_state`, the others
    starting uninitialised), as `plgpu.kernel` takes no aliases and jax 0.11.2 no longer
    lowers `pallas_call` to Mosaic GPU.
    `positions_first`: `x`, `y`, `dy`, `dx` are `[b, L, h, d]` (`rows_of`). `tiles`: a fused
    kernel's shared memory, over the grid (batch, heads) (heads on CUDA's x axis: blocks
    launched together share a group's `B` and `C`), or (batch, heads, `columns`) where `columns`
    > 1 (a block a part of the state's columns); `rows_dtype` the output rows' tile (`_tiles`);
    `kw` more of the body's arguments. `rows`: the positions a block of the grid over chunks
    takes (the grid's last axis `L / rows`). `bt`: `B`'s parts (`operand_parts`); an argument of the
    launch that is a tuple of arrays (`B`'s, `C`'s parts) reaches the body as a tuple of refs."""
    b, h, lp, p = _dims(xt, positions_first)
    g, n = bt[0].shape[1], bt[0].shape[-1]
    skip = set((into or {}).values())
    scratch = _smem(tiles if tiles is not None else _tiles(kind, p, n, xt.dtype, rows_dtype, len(bt), rows))
    names = (
        ("batch", "heads", "columns")[: 2 + (columns > 1)]
        if tiles is not None
        else ("batch", "heads", "chunks")
    )
    grid = (b, h, lp // rows if tiles is None else columns)[: len(names)]
    name = f"axkern_ssd_mosaic_gpu_{kind}"

    def entry(counts, *refs):
        pl.run_scoped(
            lambda *scoped: body(
                *_regroup(refs, counts),
                scoped,
                rep=h // g,
                dtype=xt.dtype,
                add=bool(into),
                rows_of=_indexer(positions_first),
                **kw,
            ),
            scratch,
            barrier,
        )

    def call(*args):
        inputs = [a for i, a in enumerate(args) if i not in skip]
        counts = tuple(len(a) if isinstance(a, tuple) else 0 for a in inputs)
        flat = [x for a in inputs for x in (a if isinstance(a, tuple) else (a,))]
        if not into:
            return plgpu.kernel(
                functools.partial(entry, counts),
                out_type=out_type,
                grid=grid,
                grid_names=names,
                compiler_params=_params(),
                kernel_name=name,
            )(*flat)
        launch = pl.kernel(  # every output a ref operand: `plgpu.kernel`'s batching wrapper takes no refs
            functools.partial(entry, counts),
            out_type=(),
            mesh=plgpu.Mesh(grid=grid, grid_names=names, kernel_name=name),
            compiler_params=_params(),
            name=name,
        )
        first = tuple(
            args[into[o]] if o in into else lax.empty(t.shape, t.dtype) for o, t in enumerate(out_type)
        )
        return pl.run_state(lambda refs: launch(*flat, *refs))(first)

    return call


def _regroup(refs, counts) -> list:
    """The kernel's flat `refs` with the inputs that were tuples (`counts[i]` arrays; 0: one
    array) as tuples again; the refs past the inputs (outputs) as they are."""
    out, i = [], 0
    for c in counts:
        out.append(refs[i] if c == 0 else tuple(refs[i : i + c]))
        i += max(c, 1)
    return out + list(refs[i:])


def _put_last(smem, value, ref):
    """A walking kernel's last result `value` (registers) out through its staging tile `smem` by
    TMA to `ref`, once the copies in flight have read the tile; waited for."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    smem[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, ref)
    plgpu.wait_smem_to_gmem(0)


def _halves(a, dtype):
    """`a` (float32) as `hi + lo`, both in `dtype`: `lo` what the rounding to `hi` lost."""
    hi = a.astype(dtype)
    return hi, (a - hi.astype(jnp.float32)).astype(dtype)


def _products(shape, terms, acc=None):
    """`Σ a @ b` over `terms` (left, right, transpose the right?) into a zeroed float32
    accumulator of `shape` (or `acc`, a running sum in registers, added in place), waited for."""

    def run(acc_ref):
        for a, b, trans in terms:
            plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if trans else b)

    if acc is None:
        acc = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    return pl.run_state(run)(plgpu.ACC.init(acc))
