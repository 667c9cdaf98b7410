"""`dB` and `dC`'s `dg B` from `dg` summed over each group's heads
(`SSDBlockSizes(group_sums="scores")`, the lean chunk-scan backward).

**Why.** A group's heads share `B` and `C`, so over the heads `h` of a group

    Σ_h dg_h B = (Σ_h dg_h) B,    Σ_h dg_hᵀ C = (Σ_h dg_h)ᵀ C,

`dg_h` being head `h`'s `[Q, Q]` gradient of the decayed scores (rows t, columns s). With the
group sums in the kernels (`group_sums="kernels"`) each head forms `dg B` and `dgᵀ C` (four
products of `dg`'s halves with a `[Q, N]` tile) and adds two `[Q, N]` float32 tiles into its
group's rows; here each head adds its `[Q, Q]` `dg` into its group's chunk instead (16 KiB
where the two tiles are 64 at N 128) and forms only `(f ∘ dy) S_in` of `dC`, and the products
with the sums run once a group and chunk, in XLA, in float32 (`HIGHEST`: exact products where
the kernels took `dg` as two bf16 halves). Per chunk and head that leaves out `8·Q²·N`
tensor-core FLOPs of the kernel's `10·Q²·(N + P) + 10·Q·P·N` and a quarter of its reduction
bytes; XLA's products are `4·Q²·N` FLOPs a chunk and group (at the 2.7B layer, one group:
about 0.5 GFLOP in all).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["group_scores_grads", "with_group_scores"]


def group_scores_grads(dg, bt, ct):
    """`(dB, dg B)`, `[b, g, L, N]` float32, from `dg` summed over each group's heads (`[b, g,
    c, Q, Q]` float32, rows t, columns s) and the group's `B`, `C` (`[b, g, L, N]`, `L = c·Q`):
    `dB = dgᵀ C`, `dg B`, float32 products."""
    b, g, c, q, _ = dg.shape
    rows = lambda a: a.astype(jnp.float32).reshape(b, g, c, q, a.shape[-1])  # noqa: E731
    exact = lax.Precision.HIGHEST
    db = jnp.einsum("bgcts,bgctn->bgcsn", dg, rows(ct), precision=exact)
    dc = jnp.einsum("bgcts,bgcsn->bgctn", dg, rows(bt), precision=exact)
    return db.reshape(b, g, c * q, -1), dc.reshape(b, g, c * q, -1)


def with_group_scores(out, bt, ct):
    """The chunk-scan backward's outputs (`chunk_scan_bwd(..., scores=True)` or its emulation:
    `dg` summed per group in `dB`'s place, `dC` without `dg B`) with `dB` and `dC` whole."""
    out = list(out)
    out[5], dc = group_scores_grads(out[5], bt, ct)
    out[6] = out[6] + dc
    return tuple(out)
