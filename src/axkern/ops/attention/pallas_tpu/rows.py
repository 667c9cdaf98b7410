"""How `pallas_tpu` attention's per-row vectors and segment ids lie in TPU memory: a TPU array's
last dimension fills 128 lanes, so a column `[B, H, Sqp, 1]` (`lse`, `delta`, the sinks' `Σ p·dp`,
the query ids) would take 128 times its bytes (256 MiB a float32 vector at B=2 S=8192 H=32);
each lies as rows `[B, H, nq, 1, bq]` (`as_rows`, `row_spec`) and a kernel transposes its block
into the column it uses (`column`)."""

from __future__ import annotations

from jax.experimental import pallas as pl

from .. import common as tiles

__all__ = ["as_rows", "column", "id_inputs", "own_block", "row_spec"]


def column(ref):
    """A per-row vector's block (`[1, bq]`, a row in memory: `row_spec`) transposed to the
    column `[bq, 1]`, as the `[bq]` vector the tile functions take."""
    return ref[...].T[:, 0]


def row_spec(bq, index):
    """The block spec of a per-row vector laid out `[B, H, nq, 1, bq]` (`as_rows`; query block
    `index(b_, x, s, t)`): rows in memory, where a column `[B, H, Sqp, 1]` would fill 128 lanes."""
    return pl.BlockSpec(
        (None, None, None, 1, bq), lambda b_, h_, x, s, t, c: (b_, h_, index(b_, x, s, t), 0, 0)
    )


def as_rows(a, bq):
    """`[B, H, Sqp]` as `[B, H, nq, 1, bq]` (`row_spec`'s layout)."""
    return a.reshape(*a.shape[:2], -1, 1, bq)


own_block = lambda b_, x, s, t: x  # noqa: E731 - the grid's own query block


def id_inputs(seg_ids, sqp, skp, q_index, k_index, bq, bk):
    """Segment-id operands and their block specs (q ids as `[B, nq, 1, bq]`, a row per query
    block that the kernel reads as a column, kv ids as `[B, 1, Skp]` rows), or nothing without
    segments."""
    if seg_ids is None:
        return [], []
    q_ids, kv_ids = tiles.padded_ids(seg_ids, sqp, skp)
    q_ids, kv_ids = q_ids.reshape(q_ids.shape[0], -1, 1, bq), kv_ids[:, None, :]
    specs = [
        pl.BlockSpec((None, None, 1, bq), lambda b_, h_, x, s, t, c: (b_, q_index(b_, x, s, t), 0, 0)),
        pl.BlockSpec((None, 1, bk), lambda b_, h_, x, s, t, c: (b_, 0, k_index(b_, x, s, t))),
    ]
    return [q_ids, kv_ids], specs
