"""The fused forward in less shared memory (`SSDBlockSizes(forward="lean")`): the fused
forward's walk (`forward.py`: one block per batch row and head, its chunks of 64 in order, the
state carried in registers) with one slot of each chunk tile where the fused kernel keeps two,
and the entering state sent out through the float32 staging tile (`tiles.STAGE`, `[64, 64]`)
block by block (`body.staged`), where the fused kernel stages it whole.

**Why.** At P 64, N 128 the fused kernel's shared memory is 155 KiB (`tile_bytes`; bf16 `y`, 163
with float32 `y`), so one block runs per SM, one warpgroup with nothing to overlap its waits.
These tiles take 99 KiB (91), so two blocks share an SM (`lean_forward_shares_an_sm`; at P 128,
N 64 107 and 99 KiB where the fused kernel's take 163 and 179): each hides the other's waits,
and a layer's `batch · heads` blocks take fewer rounds of the SMs.

**A chunk's step**, `S` (`[P, N]` float32, registers) the state entering it: the copies out of
the previous chunk waited for having read their tiles; `S` into shared memory in 16 bits (for
`C S_inᵀ`) and, where the entering states are written, block by block through the staging
tile; `w ∘ x`'s halves stored; the chunk's `C`, `x`, `B` copies waited; `B`'s two readers
first, `C Bᵀ` and `S ← keep · S + (w ∘ x)ᵀ B`, after which the next chunk's `B` is copied in
while the rest of `y` is formed as the chunk-scan kernel forms it (`scan.chunk_output`:
the decay, `C S_inᵀ` from the 16-bit entering state, `M x`); then the next chunk's `C` and `x`;
`y` out by TMA. What the one slot costs: the next chunk's `C` and `x` copies start at the end of
a step's products and are waited near the start of the next (`B`'s overlap the output's
products); the other block on the SM is what hides them. The state stays in registers through
the output (the fused kernel reads it back from its float32 staging tile instead).

**Cost** as the fused forward's (`forward.py`), the roundings the same (`M x` accumulated onto
`f ∘ (C S_inᵀ)`: the float32 sums in another order). `y` leaves by blocks of the staging tile's
width, through the state's staging tile where it is float32 (else by 64-column blocks through
its own). Chunks of 64, 16-bit `B` and `C`, not rotating (`lean_forward_reason`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.compat import mosaic_gpu_load

from .body import halves, pairs, products, staged
from .operands import finite_or_zero
from .scan import chunk_output, scan_vectors
from .tiles import CHUNK, STAGE, blocks_per_sm, plgpu

__all__ = ["lean_forward_tiles", "lean_forward_reason", "lean_forward_shares_an_sm", "forward_lean_kernel"]


def lean_forward_tiles(p: int, n: int, dtype=jnp.bfloat16, y_dtype=jnp.float32) -> list:
    """Shared-memory tiles `(shape, dtype)`: one slot of C, B, x; w ∘ x's halves; the entering
    state in 16 bits; the float32 staging tile for the state's blocks (`STAGE`), which `y`'s
    blocks share when `y` is float32, and otherwise a 64 × 64 staging tile in `y_dtype`."""
    q, f32 = CHUNK, jnp.float32
    y_stage = [] if jnp.dtype(y_dtype) == f32 else [((CHUNK, CHUNK), y_dtype)]
    return [
        ((1, q, n), dtype),
        ((1, q, n), dtype),
        ((q, p), dtype),
        ((q, p), dtype),
        ((q, p), dtype),
        ((p, n), dtype),
        STAGE,
        *y_stage,
    ]


def lean_forward_reason(parts: int, chunk: int = CHUNK, rotate: bool = False) -> str | None:
    """Why the lean fused forward cannot serve (`B`, `C` in `parts` tiles each, chunks of `chunk`,
    `B`, `C` formed by a rotation in the kernel), or None."""
    if parts != 1:
        return "B and C as float32 halves: the lean forward takes 16-bit B, C"
    if chunk != CHUNK:
        return f"chunk_size={chunk}: the lean forward runs chunks of {CHUNK}"
    if rotate:
        return "B, C as rotations: the lean forward does not turn them"
    return None


def lean_forward_shares_an_sm(p: int, n: int, y_dtype=jnp.float32) -> bool:
    """Whether two blocks of the lean fused forward fit a Hopper SM's 228 KiB of shared memory
    (each with the 1 KiB the system keeps a block) at head dim `p`, state `n`: at the three
    sizes the kernels take, where the fused kernel's tiles leave one a SM but at P and N 64."""
    return blocks_per_sm(lean_forward_tiles(p, n, y_dtype=y_dtype)) >= 2


def chunk_rows(refs, batch, head, rows, rows_of, clean_x, seen=False):
    """A walking forward's per-chunk reads into registers (`refs`: `x`, `w`, `dt`, `cum`, `f`, the
    segment ids): the output's vectors (`scan.scan_vectors`), `w` along rows and `x` (`[Q, P]`
    float32, WGMMA layout; non-finite values as 0 where `clean_x`); with `seen`, a fourth: `x`'s
    rows as they came times 0, summed (`seen_rows`)."""
    x_ref, w_ref, dt_ref, cum_ref, f_ref, seg_ref = refs
    layout = plgpu.Layout.WGMMA
    vectors = scan_vectors(dt_ref, cum_ref, f_ref, seg_ref, batch, head, rows)
    w_t = mosaic_gpu_load(w_ref.at[batch, head, rows], layout=layout.reduce(1), optimized=False)
    x = mosaic_gpu_load(rows_of(x_ref, batch, head, rows), layout=layout, optimized=False).astype(jnp.float32)
    out = (vectors, w_t, finite_or_zero(x) if clean_x else x)
    return (*out, seen_rows(x)) if seen else out


def seen_rows(x):
    """Each row of `x` (`[Q, P]` float32, registers) times 0, summed (`[Q]`, along rows): 0 where
    every value of the row is finite, NaN where one is not, as `chunks.all_finite` reads its
    inputs (the kernel's report of what it read: `Layout.reports_x`)."""
    return jnp.sum(x * 0.0, axis=1)


def split_seen(refs, seen):
    """A walking forward's refs after its inputs (its outputs, then its scoped tiles and
    barriers), where `seen` adds `seen_rows`' output (`[b, h, L]` float32) after the others and
    its `[Q]` float32 tile after the others: `(outputs, seen_ref, scoped, seen_tile)`, the
    second and last None without `seen`."""
    *outs, scoped = refs
    if not seen:
        return outs, None, scoped, None
    tiles, loaded = scoped
    return outs[:-1], outs[-1], (tiles[:-1], loaded), tiles[-1]


def own_onto(kept, xh_smem, xl_smem, bs):
    """`kept + (w ∘ x)ᵀ B` (`[P, N]` float32, registers), `w ∘ x` as its two halves in shared
    memory (transposed as the left operand), `B` as its parts `bs`; the products waited for."""

    def run(acc_ref):
        for a, b, _ in pairs((xh_smem.transpose((1, 0)), xl_smem.transpose((1, 0))), bs):
            plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(run)(plgpu.ACC.init(kept))


def forward_lean_kernel(*refs, rep, dtype, add, rows_of, chunks, clean_x=False, seen=False):
    """The fused forward's walk in one slot of tiles (the module's docstring), with its
    refs (`b_ref`, `c_ref` one 16-bit part each; `states_ref` None: the entering states are not
    written). Barriers: `C`, `x`, `B`, each armed and waited once a chunk. `seen`: each chunk's
    `seen_rows` out (`split_seen`)."""
    outs, seen_ref, scoped, seen_smem = split_seen(refs[10:], seen)
    x_ref, w_ref, dt_ref, cum_ref, f_ref, keep_ref, seg_ref, b_ref, c_ref, s0_ref = refs[:10]
    y_ref, states_ref, final_ref = outs
    (c_smem, b_smem, x_smem, xh_smem, xl_smem, s16_smem, stage, *y_stage), loaded = scoped
    (b_ref,), (c_ref,) = b_ref, c_ref
    head, batch = lax.axis_index("heads"), lax.axis_index("batch")
    q, p = x_smem.shape
    group = lax.div(head, jnp.int32(rep))
    wgmma_layout = plgpu.Layout.WGMMA
    row = wgmma_layout.reduce(1)
    cs, bs = (c_smem.at[0],), (b_smem.at[0],)

    def fetch_c_x(chunk):
        rows = pl.ds(chunk * q, q)
        plgpu.copy_gmem_to_smem(c_ref.at[batch, group, rows], cs[0], loaded.at[0])
        plgpu.copy_gmem_to_smem(rows_of(x_ref, batch, head, rows), x_smem, loaded.at[1])

    def fetch_b(chunk):
        plgpu.copy_gmem_to_smem(b_ref.at[batch, group, pl.ds(chunk * q, q)], bs[0], loaded.at[2])

    fetch_c_x(0)
    fetch_b(0)

    def step(chunk, state):
        rows = pl.ds(chunk * q, q)
        vectors, w_t, x, *seen_t = chunk_rows(
            (x_ref, w_ref, dt_ref, cum_ref, f_ref, seg_ref), batch, head, rows, rows_of, clean_x, seen
        )
        keep = mosaic_gpu_load(keep_ref.at[batch, head, chunk], layout=row, optimized=False)
        # the previous chunk's copies out have read the y, staging and seen tiles; its products,
        # which read the 16-bit state and w ∘ x's halves, were waited for
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        s16_smem[...] = state.astype(dtype)
        xh_smem[...], xl_smem[...] = halves(x * lax.broadcast_in_dim(w_t, x.shape, [0]), dtype)
        if seen:
            seen_smem[...] = seen_t[0]
        plgpu.commit_smem()
        if seen:
            plgpu.copy_smem_to_gmem(seen_smem, seen_ref.at[batch, head, rows])
        send = staged(stage)  # (the tile's copies read: waited above)
        if states_ref is not None:
            send(state, lambda r, cols: states_ref.at[batch, chunk, head, pl.ds(r, CHUNK), cols])
        for i in range(3):
            plgpu.barrier_wait(loaded.at[i])
        if clean_x:  # over the tile its copy has filled, before the products read it
            x_smem[...] = x.astype(dtype)
            plgpu.commit_smem()
        # B's two readers first, C Bᵀ and the state's update S <- keep S + (w ∘ x)ᵀ B (the entering
        # state is in the 16-bit tile for C S_inᵀ), so that the next chunk's B is copied in while
        # the output is formed
        scores = products((q, q), pairs(cs, bs, True))
        state = own_onto(state * lax.broadcast_in_dim(keep, state.shape, [0]), xh_smem, xl_smem, bs)

        @pl.when(chunk + 1 < chunks)
        def _():
            fetch_b(chunk + 1)

        # as the chunk-scan kernel, M x accumulated onto f ∘ (C S_inᵀ)
        y = chunk_output(cs, bs, x_smem, s16_smem, *vectors, dtype=dtype, scores=scores, onto=True)

        @pl.when(chunk + 1 < chunks)
        def _():  # C's and x's last readers (the output's products) are done
            fetch_c_x(chunk + 1)

        # y out by blocks: through the state's staging tile where float32, else its own
        y_send = staged(y_stage[0]) if y_stage else send
        y_send(y.astype(y_ref.dtype), lambda r, cols: rows_of(y_ref, batch, head, rows, cols))
        return state

    s0 = mosaic_gpu_load(s0_ref.at[batch, head], layout=wgmma_layout, optimized=False)
    final = lax.fori_loop(0, chunks, step, s0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    staged(stage)(final, lambda r, cols: final_ref.at[batch, head, pl.ds(r, CHUNK), cols])
    plgpu.wait_smem_to_gmem(0)
