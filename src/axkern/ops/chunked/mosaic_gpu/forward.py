"""The chunked layer's forward as one Mosaic GPU kernel (`SSDBlockSizes(forward="fused")`):
stages 2 to 4 (each chunk's own state, the recurrence between chunks, each chunk's output) for
one (batch row, head) per block, the chunks in order, the state carried in registers.

**Why.** In three stages the float32 chunk states (`[b, c, h, P, N]`: at chunks of 64 four times
mamba_ssm's at 256) cross memory four times: the own states written and read by the recurrence,
the entering states written and read by the scan. Fused, only the entering states are written (the backward's
residual) and the own states never leave the block; the price is parallelism, `batch · heads`
blocks walking their chunks in order, with the next chunk's `C`, `B`, `x` copied by TMA into the
second of two slots while the block computes on the first.

**A chunk's step**, the state `S` (`[P, N]` float32, WGMMA layout) entering it: `S` out to the
entering states (through shared memory, by TMA) and in as a 16-bit tile; `y` as the chunk-scan
kernel computes it (`C Bᵀ`, its decay, `M x` from `M`'s two 16-bit halves, `f ∘ (C S_inᵀ)`), out by TMA;
then `S ← keep · S + (w ∘ x)ᵀ B`, the own state's two products (`w ∘ x` as two 16-bit halves)
accumulated straight onto `keep · S`. The arithmetic is the three stages' (`state.py`,
`scan.py`), the recurrence's sum `keep · S + own` now one accumulator (the own state not rounded on its own).

**Grid** `(batch, heads)`, heads on CUDA's x axis; one warpgroup a block. **Cost** per chunk and
head (Q = 64): `2·Q²·N` (`C Bᵀ`) + `4·Q²·P` (`M x`, two halves) + `2·Q·P·N` (`C S_inᵀ`) + `4·Q·P·N`
(the own state, two halves) tensor-core FLOPs, as the three stages'; bytes: `x`, `B`, `C` read
once (bf16), `y` written (float32, `Q·P·4`), the entering state written once (`P·N·4`), where
the stages also write the own state and read both states back (`3·P·N·4` more).

**Reporting `x`** (`seen=True`): each chunk's rows of `x` as read, times 0 and summed
(`forward_lean.seen_rows`, `Q` values, NaN where a row holds a non-finite value) out by TMA
through a `[Q]` float32 tile, `Q·4` bytes a chunk and head more, so that no pass of XLA's reads
`x` to check it.

**Without residuals** (`states=False`: the layer's forward when nothing differentiates it, the
`custom_vjp`'s primal) the entering states are not written: `y` and the final state are all it
sends out.

**Rotating** (`B`, `C` as `RotatedOperand`s, `operands.py`; Mamba-3): each chunk's step starts by
forming `C`'s and `B`'s halves itself: `Θ` (`[Q, N/2]`, float32), the unrotated `q`, `k` rows
(`[Q, N]`, bf16, the head's group) copied in by TMA while the previous chunk computed, `cos` and
`sin` of `Θ` (`Q·N` special-function results), the bias added and the pairs turned (about 12
float32 operations an element of `q` and of `k`, with the split into halves), four 16-bit tiles
stored. Bytes a chunk and head: `Q·N/2·4` of angles and `2·Q·N·2` of `q`, `k` (shared by the
group's heads, mostly from L2) in place of `4·Q·N·2` of halves; one slot of halves rather than
two (212 KiB at P 64, N 128). This work runs on the block's one warpgroup between the chunk's
products, not beside them (docs/ops/mamba3.md has what it costs).

**Other forms**: in one slot of tiles (`forward_lean.py`, `SSDBlockSizes(forward="lean")`), and
at chunks of `64 r` by tiles of 64 rows (`forward_tiled.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load
from axkern.core.op import Unsupported

from .body import halves, part_copies, parts_of, put_last
from .forward_lean import (
    chunk_rows,
    forward_lean_kernel,
    lean_forward_reason,
    lean_forward_tiles,
    own_onto,
    split_seen,
)
from .forward_tiled import forward_tiled_kernel
from .operands import RotatedOperand, finite_or_zero, operand_parts
from .scan import chunk_output
from .sizes import walk_setup
from .tiles import CHUNK, SMEM, dims, launch, plgpu, rows_type, tile_bytes

__all__ = ["fused_forward", "fused_smem_bytes", "fused_fits", "rotation_reason"]


def _tiles(p: int, n: int, dtype=jnp.bfloat16, y_dtype=jnp.float32, parts=1, rotate=False, q=CHUNK) -> list:
    """Shared-memory tiles `(shape, dtype)`: two slots of C, B (each `parts` tiles, slot-major),
    x; w ∘ x's halves; the entering state as 16 bits; staging for y (`y_dtype`) and for the
    float32 state. `rotate` (`operands.RotatedOperand`): one slot of C's and B's two halves, which the
    block forms, and the unrotated `q`, `k` rows and the angles they are copied into. Chunks of
    `q = 64 r` (`forward_tiled.py`): tiles of 64 rows, one slot of C's `r` row blocks (each
    refilled as soon as the chunk's output has read it), two of B's and x's; w ∘ x's halves and
    y's staging for one row block."""
    if q != CHUNK:
        r, t, f32 = q // CHUNK, CHUNK, jnp.float32
        bc = lambda slots: ((slots * r * parts, t, n), dtype)  # noqa: E731
        return [bc(1), bc(2), ((2 * r, t, p), dtype), ((t, p), dtype), ((t, p), dtype)] + [
            ((p, n), dtype),
            ((t, p), y_dtype),
            ((p, n), f32),
        ]
    q, f32 = CHUNK, jnp.float32
    extra = [((2, q, n), dtype), ((q, n // 2), f32)] if rotate else []
    slots = 1 if rotate else 2
    return [
        ((slots * parts, q, n), dtype),
        ((slots * parts, q, n), dtype),
        ((2, q, p), dtype),
        ((q, p), dtype),
        ((q, p), dtype),
        ((p, n), dtype),
        ((q, p), y_dtype),
        ((p, n), f32),
    ] + extra


def fused_smem_bytes(p: int, n: int, parts: int = 1, rotate: bool = False, chunk: int = CHUNK) -> int:
    return tile_bytes(_tiles(p, n, parts=parts, rotate=rotate, q=chunk))


def fused_fits(p: int, n: int, parts: int = 1, rotate: bool = False, chunk: int = CHUNK) -> bool:
    """Whether the fused forward's tiles (float32 `y`) at chunks of `chunk` fit a Hopper block's
    shared memory."""
    return fused_smem_bytes(p, n, parts, rotate, chunk) <= SMEM


def rotation_reason(p: int, n: int) -> str | None:
    """Why the fused forward cannot rotate `B`, `C` itself at head dim `p` and state `n`, or
    None: each column half a whole 64-column tile, and the tiles within shared memory."""
    if n % 128:
        return f"state={n}: the kernel turns column halves of whole 64-column tiles (a multiple of 128)"
    if not fused_fits(p, n, 2, True):
        return f"head_dim={p}, state={n}: the rotating forward's tiles exceed shared memory"
    return None


def _rotated_tiles(u_smem, th_smem, bias_refs, head, dsts, dtype):
    """The rotation's turn (`operands.py`) in registers: for `q` and `k` (`u_smem.at[i]`, `[Q, N]` 16-bit, the
    angles `th_smem` `[Q, N/2]` float32, the biases `bias_refs[i]` `[h, N]`), the rotated value's
    two 16-bit halves into `dsts[i]` (`[2, Q, N]`: `hi`, `lo`), column half by column half."""
    f32, layout = jnp.float32, plgpu.Layout.WGMMA
    n2 = th_smem.shape[-1]
    column_halves = (pl.ds(0, n2), pl.ds(n2, n2))
    th = mosaic_gpu_load(th_smem, layout=layout, optimized=False)
    cos, sin = jnp.cos(th), jnp.sin(th)
    for i, (bias_ref, dst) in enumerate(zip(bias_refs, dsts, strict=True)):
        w = []
        for cols in column_halves:
            u = mosaic_gpu_load(u_smem.at[i, :, cols], layout=layout, optimized=False).astype(f32)
            bias = mosaic_gpu_load(bias_ref.at[head, cols], layout=layout.reduce(0), optimized=False)
            w.append(u + lax.broadcast_in_dim(bias, u.shape, [1]))
        for j, cols in enumerate(column_halves):  # one turned half at a time (fewer registers live)
            r = w[0] * cos - w[1] * sin if j == 0 else w[0] * sin + w[1] * cos
            r = finite_or_zero(r)  # non-finite as 0, as the caller scrubs
            hi, lo = halves(r, dtype)
            dst.at[0, :, cols][...] = hi
            dst.at[1, :, cols][...] = lo


def _forward_kernel(*refs, rep, dtype, add, rows_of, chunks, rotate=False, clean_x=False, seen=False):
    """The refs: `x, w, dt, cum, f, keep, seg, B, C, s0`, the outputs `y, states, final` (and
    `seen`'s, `split_seen`), the scoped tiles and barriers. `add` (the backward kernels' group
    sums) is False here; `states_ref` None: the entering states are not written
    (`_without_states`). `rotate`: `b_ref`, `c_ref` are `(u, bias, Θ)`
    (`operands.RotatedOperand`), the block forms C's and B's halves in its one slot of them. `clean_x`:
    `x`'s non-finite values as 0 (the register copy the block reads anyway, stored over the
    chunk's `x` tile before the products read it). `seen`: each chunk's `seen_rows` out."""
    x_ref, w_ref, dt_ref, cum_ref, f_ref, keep_ref, seg_ref, b_ref, c_ref, s0_ref = refs[:10]
    (y_ref, states_ref, final_ref), seen_ref, scoped, seen_smem = split_seen(refs[10:], seen)
    (c_smem, b_smem, x_smem, xh_smem, xl_smem, s16_smem, y_smem, st_smem, *raw), loaded = scoped
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    q, p = x_smem.shape[1:]
    n = c_smem.shape[-1]
    parts = 2 if rotate else c_smem.shape[0] // 2
    copies = 1 if rotate else 2 * parts + 1  # a slot's copies: (C's and B's parts), x
    group = lax.div(head, jnp.int32(rep))
    wgmma_layout = plgpu.Layout.WGMMA
    row = wgmma_layout.reduce(1)

    def slot_parts(smem, slot):
        return parts_of(smem, 0 if rotate else slot * parts, parts)

    def fetch(chunk, slot):
        """The chunk's (C, B,) x into `slot`, a barrier per copy."""
        rows = pl.ds(chunk * q, q)
        pieces = []
        if not rotate:
            pieces += part_copies(c_ref, slot_parts(c_smem, slot), batch, group, rows)
            pieces += part_copies(b_ref, slot_parts(b_smem, slot), batch, group, rows)
        pieces.append((rows_of(x_ref, batch, head, rows), x_smem.at[slot]))
        for i, (src, dst) in enumerate(pieces):
            plgpu.copy_gmem_to_smem(src, dst, loaded.at[copies * slot + i])

    def fetch_raw(chunk):
        """`rotate`: the chunk's unrotated `q`, `k` rows and the head's angles (one slot,
        barriers after the two slots')."""
        rows = pl.ds(chunk * q, q)
        u_smem, th_smem = raw
        pieces = [
            (c_ref[0].at[batch, group, rows], u_smem.at[0]),
            (b_ref[0].at[batch, group, rows], u_smem.at[1]),
        ]
        pieces.append((c_ref[2].at[batch, head, rows], th_smem))
        for i, (src, dst) in enumerate(pieces):
            plgpu.copy_gmem_to_smem(src, dst, loaded.at[2 * copies + i])

    fetch(0, 0)
    if rotate:
        fetch_raw(0)

    def step(chunk, state):
        slot = lax.rem(chunk, 2)

        @pl.when(chunk + 1 < chunks)
        def _():
            fetch(chunk + 1, 1 - slot)

        def state_out():  # the staging tiles' last copies out have been read; the entering state out and in
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            st_smem[...] = state
            s16_smem[...] = state.astype(dtype)

        rows = pl.ds(chunk * q, q)
        if rotate:  # C's and B's halves from this chunk's rows first, with few registers live
            # (the state stored first; ptxas spilled registers with the vectors and x loaded too)
            state_out()
            for i in range(3):
                plgpu.barrier_wait(loaded.at[2 * copies + i])
            _rotated_tiles(*raw, (c_ref[1], b_ref[1]), head, (c_smem, b_smem), dtype)
        vectors, w_t, x, *seen_t = chunk_rows(
            (x_ref, w_ref, dt_ref, cum_ref, f_ref, seg_ref), batch, head, rows, rows_of, clean_x, seen
        )
        if not rotate:
            state_out()
        xh_smem[...], xl_smem[...] = halves(x * lax.broadcast_in_dim(w_t, x.shape, [0]), dtype)
        if seen:  # (the previous chunk's copy out of the tile read it: waited in `state_out`)
            seen_smem[...] = seen_t[0]
        plgpu.commit_smem()  # (its warpgroup barrier: every read of the unrotated rows is done)
        if seen:
            plgpu.copy_smem_to_gmem(seen_smem, seen_ref.at[batch, head, rows])
        if rotate:

            @pl.when(chunk + 1 < chunks)
            def _():
                fetch_raw(chunk + 1)

        if states_ref is not None:
            plgpu.copy_smem_to_gmem(st_smem, states_ref.at[batch, chunk, head])
        for i in range(copies):
            plgpu.barrier_wait(loaded.at[copies * slot + i])
        cs, bs, xs = slot_parts(c_smem, slot), slot_parts(b_smem, slot), x_smem.at[slot]
        if clean_x:  # over the tile its copy has filled, before the products read it
            xs[...] = x.astype(dtype)
            plgpu.commit_smem()

        y = chunk_output(cs, bs, xs, s16_smem, *vectors, dtype=dtype)  # as the chunk-scan kernel
        y_smem[...] = y.astype(y_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_smem, rows_of(y_ref, batch, head, rows))

        # S <- keep S + (w ∘ x)ᵀ B, the entering state read back from its staging tile (its copy
        # out only reads it), so that its registers are free while the output is formed; keep:
        # one value along S's rows
        keep = mosaic_gpu_load(keep_ref.at[batch, head, chunk], layout=row, optimized=False)
        return own_onto(st_smem[...] * lax.broadcast_in_dim(keep, (p, n), [0]), xh_smem, xl_smem, bs)

    s0 = mosaic_gpu_load(s0_ref.at[batch, head], layout=wgmma_layout, optimized=False)
    put_last(st_smem, lax.fori_loop(0, chunks, step, s0), final_ref.at[batch, head])


def _without_states(*refs, kernel=_forward_kernel, **kw):
    """`kernel` with no entering states' output (refs: the ten inputs, `y`, `final`, `seen`'s
    where the kernel takes it, the scoped tiles)."""
    kernel(*refs[:11], None, *refs[11:], **kw)


def fused_forward(
    xt,
    w,
    dt,
    cum,
    f,
    keep,
    seg,
    bt,
    ct,
    initial_state,
    *,
    positions_first=False,
    y_dtype=jnp.float32,
    states=True,
    clean_x=False,
    chunk=CHUNK,
    lean=False,
    seen=False,
):
    """`(y [b, h, L, P], final [b, h, P, N], states_in [b, c, h, P, N])`, float32 (`y` in
    `y_dtype`), of the chunks
    (`xt [b, h, L, P]` bf16, `bt, ct [b, g, L, N]` bf16 or float32 (`operand_parts`), or both
    `RotatedOperand`s by the same angles (`bt`'s are read), which the kernel turns itself
    (`operands.py`); `w, dt,
    cum, f [b, h, L]` float32; `keep [b,
    h, c]`; `seg [b, L]` int32; `initial_state [b, h, P, N]` float32; `L = c · chunk`) by the
    fused kernel. `positions_first`: `xt` and `y` are `[b, L, h, P]`; `y_dtype`: `y` rounded to
    it in the kernel; `states=False`: `states_in` is None, the kernel does not write the
    entering states (the backward's residual; `P·N·4` bytes a chunk and head, the largest of
    its writes); `clean_x`: `x`'s non-finite values taken as 0 (no cleaned copy to write).
    `chunk`: 64, or a multiple of 64 by tiles of 64 rows (`forward_tiled.py`; not rotating).
    `lean`: in one slot of tiles (`forward_lean.py`; chunks of 64, 16-bit `B`, `C`). `seen`: a
    fourth result, `[b, h, L]` float32, each position's `x` as it came times 0 summed over its
    row (`forward_lean.seen_rows`: NaN where a value is not finite, else 0), written by the
    kernel that reads `x` anyway (no pass of XLA's over `x` to check it)."""
    f32, dtype = jnp.float32, xt.dtype
    rotate = isinstance(bt, RotatedOperand)
    if rotate and chunk != CHUNK:
        raise Unsupported(f"chunk_size={chunk}: the rotating forward runs chunks of {CHUNK}")
    if rotate:  # `(u, bias, Θ)` each; the parts' shapes and dtypes checked as `u`'s
        p, n = dims(xt, positions_first)[3], bt.u.shape[-1]
        reason = rotation_reason(p, n) or _rotation_dtypes(bt, ct)
        if reason:
            raise Unsupported(reason)
        theta = bt.angles()
        bt, ct, checked = (bt.u, bt.bias, theta), (ct.u, ct.bias, theta), ((bt.u,), (ct.u,))
    else:
        bt, ct = operand_parts(bt), operand_parts(ct)
        checked = (bt, ct)
    parts = 2 if rotate else len(bt)
    reason = lean and lean_forward_reason(parts, chunk, rotate)
    if reason:
        raise Unsupported(f"the lean fused forward: {reason}")
    if lean:
        tiles = lean_forward_tiles(xt.shape[-1], bt[0].shape[-1], dtype, y_dtype)
    else:
        tiles = _tiles(xt.shape[-1], bt[0].shape[-1], dtype, y_dtype, parts, rotate, chunk)
    setup = walk_setup(
        xt,
        checked[0],
        keep,
        tiles,
        "the fused forward",
        checked[1],
        positions_first=positions_first,
        chunk=chunk,
    )
    b, h, lp, p, n, c, keep_rows = setup
    if seen:
        tiles = [*tiles, ((chunk,), f32)]
    y_type, final_type = (
        rows_type(b, h, lp, p, positions_first, y_dtype),
        jax.ShapeDtypeStruct((b, h, p, n), f32),
    )
    if states:
        out_type = (y_type, jax.ShapeDtypeStruct((b, c, h, p, n), f32), final_type)
    else:
        out_type = (y_type, final_type)
    if seen:
        out_type = (*out_type, jax.ShapeDtypeStruct((b, h, lp), f32))
    if lean:  # C, x, B: one barrier each
        barrier, kernel, kw = plgpu.Barrier(num_barriers=3), forward_lean_kernel, {}
    elif chunk != CHUNK:  # C's row blocks, then each slot's row blocks of B's parts and x
        r = chunk // CHUNK
        barrier, kernel, kw = (
            plgpu.Barrier(num_barriers=r * parts + 2 * r * (parts + 1)),
            forward_tiled_kernel,
            {},
        )
    else:
        barrier = plgpu.Barrier(num_barriers=2 + 3 if rotate else 2 * (len(bt) + len(ct) + 1))
        kernel, kw = _forward_kernel, {"rotate": rotate}
    call = launch(
        "forward_lean" if lean else "forward",
        kernel if states else functools.partial(_without_states, kernel=kernel),
        out_type,
        xt,
        bt,
        barrier,
        tiles,
        positions_first=positions_first,
        chunks=c,
        clean_x=clean_x,
        **kw,
        **({"seen": True} if seen else {}),
    )
    out = call(xt, w, dt, cum, f, keep_rows, seg.astype(jnp.int32), bt, ct, initial_state.astype(f32))
    more = (out[-1],) if seen else ()
    out = out[:-1] if seen else out
    if states:
        y, states_in, final = out
        return (y, final, states_in, *more)
    y, final = out
    return (y, final, None, *more)


def _rotation_dtypes(bt, ct) -> str | None:
    """Why `bt`, `ct` (`RotatedOperand`s) are not what the rotating kernel takes, or None: `u`
    bf16, the biases and angles float32, the same angles' shape."""
    if not isinstance(ct, RotatedOperand) or bt.theta.shape != ct.theta.shape:
        return "the rotating forward takes B and C both as rotations by the same angles"
    for name, op in (("B", bt), ("C", ct)):
        if op.u.dtype != jnp.bfloat16 or op.bias.dtype != jnp.float32 or op.theta.dtype != jnp.float32:
            return f"{name}'s rotation takes u in bf16 and its bias and angles in float32"
    return None
