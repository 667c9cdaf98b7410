"""Stage 2 of the Pallas chunk scan as kernel bodies: each chunk's own state `S = (w ∘ x)ᵀ B`
(`state_kernel`) and its backward (`state_bwd_kernel`), one program per (batch, head, chunk)
(`kernel_scan.py` has the math, the grid and the cost; `layout.py` launches them). Shared by the
Triton and TPU layouts through a `Layout` (`lay`: how each reads and writes its per-position
vectors and takes its products)."""

from __future__ import annotations

import jax.numpy as jnp


def state_kernel(x_ref, w_ref, b_ref, out_ref, *, lay, dtype):
    x = lay.x_of(x_ref)  # [Q, P]
    out_ref[0, 0, 0] = lay.dot(x * lay.col(w_ref), b_ref[0, 0], dtype, trans_a=True)  # [P, N]


def state_bwd_kernel(x_ref, w_ref, b_ref, ds_ref, dx_scan_ref, db_scan_ref, dx_ref, dw_ref, db_ref, *, lay):
    """Pull `dS` back through `S = (w ∘ x)^T B`; the chunk scan's `dx`, `dB` (float32) added, `dx`
    written in its own dtype."""
    f32 = jnp.float32
    x = lay.x_of(x_ref)
    w = lay.col(w_ref)  # [Q, 1]
    bm = b_ref[0, 0].astype(f32)
    ds = ds_ref[0, 0, 0]  # [P, N]
    dxw = lay.dot(bm, ds, f32, trans_b=True)  # [Q, P]
    lay.put_tile(dx_ref, dxw * w + lay.tile_in(dx_scan_ref))
    lay.put_col(dw_ref, jnp.sum(dxw * x, axis=1, keepdims=True))
    lay.put_group(db_ref, lay.dot(x * w, ds, f32), db_scan_ref)  # [Q, N]
