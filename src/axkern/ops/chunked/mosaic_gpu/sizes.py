"""What sizes the Mosaic GPU kernels take: the shared-memory tiles of the four kernels over a
chunk's rows (the chunk state and the chunk scan, forward and backward), the head dims, states
and chunks whose tiles fit a Hopper block, and the checks each launch makes of its operands."""

from __future__ import annotations

import jax.numpy as jnp

from axkern.core.op import Unsupported

from .tiles import CHUNK, SMEM, STAGE, dims, tile_bytes

__all__ = [
    "kernel_tiles",
    "smem_bytes",
    "dims_reason",
    "chunk_reason",
    "check_operands",
    "check_tiles",
    "walk_setup",
]


def kernel_tiles(
    kernel: str, p: int, n: int, dtype=jnp.bfloat16, rows_dtype=jnp.float32, parts=1, q=CHUNK
) -> list:
    """Shared-memory tiles of `kernel` at head dim `p` and state `n` as `(shape, dtype)`, in the
    order its body takes them (`rows_dtype`: the scan's `y`, the state backward's `dx`; `parts`:
    `B` and `C` as one 16-bit tile each or two, `operands.operand_parts`; `q`: the rows a block
    takes)."""
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
        # C, B, x; the halves of the state, of dy (then f ∘ dy), of M (then dg); dx in the input
        # dtype; float32 dB (then dC), dS_in, and the four vectors ddt, dcum, df, dcum_row
        "scan_bwd": [bc, bc, ((q, p), dtype)]
        + [((p, n), dtype)] * 2
        + [((q, p), dtype)] * 2
        + (
            [((q, q), dtype)] * 2 + [((q, p), dtype), ((q, n), f32), ((p, n), f32), ((4, q), f32)]
            if q == CHUNK  # above: staging by tiles of 64 rows (`tiled.py`), dB, dC and dS_in in one
            else [((CHUNK, p), dtype), ((max(CHUNK, p), n), f32), ((4, q), f32)]
        ),
        # the lean form (chunks of 64, P 64): one tile of the state (its low half in M's), `STAGE`
        # (dx leaves through x's tile, read by then)
        "scan_bwd_lean": [bc, bc, ((q, p), dtype), ((p, n), dtype), *[((q, p), dtype)] * 2]
        + [((q, q), dtype)] * 2
        + [STAGE, ((4, q), f32)],
    }[kernel]


def smem_bytes(p: int, n: int, parts: int = 1) -> int:
    """Shared memory of the largest of the four kernels at head dim `p` and state `n` (bf16
    inputs; `parts`: `B`, `C` as one tile each or two): their `kernel_tiles` and what Mosaic GPU
    adds."""
    kernels = ("state", "scan", "state_bwd", "scan_bwd")
    return max(tile_bytes(kernel_tiles(k, p, n, parts=parts)) for k in kernels)


def dims_reason(p: int, n: int, parts: int = 1) -> str | None:
    """Why the kernels cannot take head dim `p` and state `n` (`B`, `C` in `parts` tiles each),
    or None."""
    for name, d in (("head_dim", p), ("state", n)):
        if d % 64 or d > 256:
            return f"{name}={d}: the Mosaic GPU kernels take multiples of 64 up to 256"
    if smem_bytes(p, n, parts) > SMEM:
        split = f" with B and C as {parts} 16-bit halves each" if parts > 1 else ""
        return (
            f"head_dim={p}, state={n}: the Mosaic GPU kernels{split} would take "
            f"{smem_bytes(p, n, parts)} bytes of shared memory, more than a Hopper block's {SMEM}"
        )
    return None


def chunk_reason(p, n, chunk, parts=1, kinds=("state", "scan", "scan_bwd")) -> str | None:
    """Why the `kinds` of kernel cannot run chunks of `chunk` (a multiple of 64) at head dim `p`, state
    `n`, or None: their tiles exceed shared memory (the state backward's are 64's at any chunk)."""
    for kind in kinds:
        used = tile_bytes(kernel_tiles(kind, p, n, parts=parts, q=chunk))
        if used > SMEM:
            return (
                f"chunk={chunk}, head_dim={p}, state={n}: the {kind} kernel's tiles take {used} bytes "
                f"of shared memory, more than a Hopper block's {SMEM}"
            )
    return None


def check_operands(xt, bt, *rest, positions_first=False, chunk=CHUNK):
    """`x` (`[b, h, L, P]` or `positions_first`) and `B` and `rest` as `operand_parts` gives them
    (tuples of `[b, g, L, N]`), bf16, at a length of whole chunks and dimensions the kernels take."""
    b, h, lp, p = dims(xt, positions_first)
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


def check_tiles(kind: str, p: int, bt, chunk: int) -> None:
    """`Unsupported` where `kind`'s tiles at chunks of `chunk` exceed shared memory (64: `dims_reason`)."""
    if chunk != CHUNK and (reason := chunk_reason(p, bt[0].shape[-1], chunk, len(bt), (kind,))):
        raise Unsupported(reason)


def walk_setup(xt, bt, keep, tiles, what, *rest, positions_first, chunk=CHUNK):
    """What a kernel walking one (batch row, head)'s chunks (`forward.py`, `state_backward.py`)
    does first: its operands checked (`x`, `B`, `rest` bf16, `B` and `rest` as `operand_parts`
    gives them) and its `tiles` against shared memory; `(b, h, L, P, N, chunks, keep_rows)`,
    `keep_rows [b, h, c, P]` float32 the carries with one value per row of a `[P, N]` state."""
    check_operands(xt, bt, *rest, positions_first=positions_first, chunk=chunk)
    b, h, lp, p = dims(xt, positions_first)
    n, c = bt[0].shape[-1], lp // chunk
    if tile_bytes(tiles) > SMEM:
        raise Unsupported(f"head_dim={p}, state={n}, chunk={chunk}: {what}'s tiles exceed shared memory")
    keep_rows = jnp.broadcast_to(keep[..., None], (b, h, c, p)).astype(jnp.float32)
    return b, h, lp, p, n, c, keep_rows
