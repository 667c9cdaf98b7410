"""How the Mosaic GPU SSD kernels address a head's rows of `x`, `y`, `dy`, `dx`: `[b, h, L, d]`,
or the caller's `[b, L, h, d]` (`positions_first`), which TMA copies and loads take as a strided
tile."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _indexer(positions_first: bool):
    """A head's rows of a `[b, h, L, d]` array's ref, or (`positions_first`) of a `[b, L, h, d]`
    one (`cols`: those columns only): TMA copies and loads take the strided tile as they take the
    contiguous one."""

    def rows_of(ref, batch, head, rows, cols=None):
        index = (batch, rows, head) if positions_first else (batch, head, rows)
        return ref.at[index if cols is None else (*index, cols)]

    return rows_of


def _dims(xt, positions_first: bool):
    """`(b, h, L, P)` of `xt`, `[b, h, L, P]` or (`positions_first`) `[b, L, h, P]`."""
    b, one, two, p = xt.shape
    return (b, two, one, p) if positions_first else (b, one, two, p)


def _rows_type(b, h, lp, d, positions_first: bool, dtype=jnp.float32):
    return jax.ShapeDtypeStruct((b, lp, h, d) if positions_first else (b, h, lp, d), dtype)
