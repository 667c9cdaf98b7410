"""The reduced loss's three Mosaic TPU kernels (`loss.py` runs them), in the transposed layout.

A chunk of `C` token rows of `x` (`[C, D]`) meets `w` (`[D, V]`) in tiles of `bt` tokens by `bv`
vocabulary columns. Between the kernels the chunk's logits are held in HBM transposed,
`zT: [V', C]` (`V'`: the vocabulary in whole tiles), in one of two forms:

- float32 `z` (soft-capped), for float32 inputs or a soft cap;
- packed: `exp(z - m)` in the inputs' 16-bit dtype, `m` the token's running max after the tile,
  kept per tile and token in `maxima: [8·ceil(V'/bv/8), C]` float32 (row `j` for tile `j`). A
  value in `[0, 1]` rounded to 16 bits loses no more than rounding `dz` to 16 bits for the
  products does, in half the bytes of a float32 logit.

Kernels (each `dimension_semantics` ("parallel", "arbitrary")):

- `logits`, grid `(C/bt, V/bv)`, tokens outer: `z = x_t @ w_v` (`[bt, bv]`, float32 accumulation)
  transposed once to `[bv, bt]`, soft-capped; per token (a `[1, bt]` lane vector) the online
  logsumexp (running max and sum of exponentials), the label's logit and the logit sum; with
  `store`, the tile of `zT` (and of `maxima`).
- `dx`, grid `(C/bt, V/bv)`, tokens outer: the tile's cotangent `dzT` (below), written over its
  logits (the buffer aliased), and `dxT[D, bt] += w_v @ dzT` in a float32 VMEM accumulator,
  written transposed at the last tile.
- `dw`, grid `(V/bv, C/bt)`, vocabulary outer, a product alone: `dwT[bv, D] += dzT @ x_t`, added
  to the previous chunks' float32 sum (`[V', D]`, transposed) or written, transposed to
  `[D, bv]`, in `w`'s dtype at the last chunk.

All three products are plain `[M, K] @ [K, N]` ones: the only transposition is the logits
tile's in `logits` (and one `[D, bt]` or `[bv, D]` accumulator at the end of a row of steps).

The cotangent of the logits, from the per-token rows `rows: [8, C]` float32 (`LSE`, `G`, `A`,
`B`, `KEEP`: `lse`, `g = coef·(1 + 2·w_z·lse)`, `a = (1 - eps)·coef`, `b = (eps/V)·coef`, 1 for a
kept token), `coef` the loss's scale on a kept token (NaN for a label outside `[0, V)`):

    dz = (g · exp(z - lse) - a · [v == label] - b) · (1 - (z/c)^2)

selected to 0 (never multiplied) on dropped tokens and past the vocabulary. Labels come as
`[1, C]` int32, -1 where outside `[0, V)`.

**Ragged edges.** Columns past `V` in the last vocabulary tile are masked out of the statistics
and of `dzT`, and zeroed in `w`'s block before `dx`'s product (that product sums over them);
their `dw` rows fall outside the gradient. Token rows: `loss.py` pads a chunk to whole tiles;
the statistics-only call takes a ragged last token tile, whose extra lanes are not written.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from axkern.core.blocks import cdiv
from axkern.core.kernels import dot

__all__ = ["Tiles", "ROWS", "LSE", "G", "A", "B", "KEEP", "logits", "dx", "dw"]

ROWS = 8  # rows of the per-token array the dx and dw kernels read (five used)
LSE, G, A, B, KEEP = range(5)


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_tokens: int  # bt: a multiple of 128, or the whole token axis of the call
    block_vocab: int  # bv: a multiple of 128, or the whole vocabulary
    vocab: int
    soft_cap: float | None
    with_sum: bool  # label smoothing: the logit sum and the `b` term
    packed: bool
    operand: str  # the products' operand dtype
    interpret: bool
    vmem_limit: int | None

    @property
    def tiles_vocab(self) -> int:
        return cdiv(self.vocab, self.block_vocab)

    @property
    def tail(self) -> int:
        """Columns of the last vocabulary tile."""
        return self.vocab - (self.tiles_vocab - 1) * self.block_vocab

    @property
    def padded_vocab(self) -> int:
        """The vocabulary in whole tiles: the rows of the held logits and of the dw sum."""
        return self.tiles_vocab * self.block_vocab

    @property
    def logits_dtype(self):
        return jnp.dtype(self.operand) if self.packed else jnp.dtype(jnp.float32)

    @property
    def maxima_rows(self) -> int:
        return 8 * cdiv(self.tiles_vocab, 8)


def _call(t: Tiles, kernel, name, grid, semantics, **kw):
    return pl.pallas_call(
        kernel,
        name=name,
        grid=grid,
        interpret=pltpu.InterpretParams(out_of_bounds_reads="uninitialized") if t.interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=t.vmem_limit),
        **kw,
    )


def _ragged(t: Tiles, j, step):
    """`step(last)` at vocabulary tile `j`: `last=True` at the last tile where it is ragged."""
    if t.tail == t.block_vocab:
        step(False)
        return
    pl.when(j < t.tiles_vocab - 1)(lambda: step(False))
    pl.when(j == t.tiles_vocab - 1)(lambda: step(True))


def _transposed_logits(t: Tiles, x, w):
    """`(x @ w).T`, float32. In interpret mode 16-bit operands are widened first (exact products,
    float32 sums as on the chip): XLA's CPU backend folds the transpose into the product and has
    no kernel for that 16-bit product with a float32 result."""
    if t.interpret:
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    return dot(x, w).T


# -- logits: statistics, and the logits tile held for the gradients -----------------------------


def _logits_kernel(labels_ref, x_ref, w_ref, *refs, t: Tiles, store: bool):
    lse_ref, ll_ref, sum_ref = refs[:3]
    held = refs[3:-4]  # zT (and maxima) with `store`
    m_ref, s_ref, ll_acc, sum_acc = refs[-4:]
    j = pl.program_id(1)
    bt, bv = ll_acc.shape[1], t.block_vocab

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        for ref in (s_ref, ll_acc, sum_acc):
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    def step(last):
        zt = _transposed_logits(t, x_ref[...], w_ref[...])  # [bv, bt]
        if t.soft_cap is not None:
            zt = t.soft_cap * jnp.tanh(zt * (1.0 / t.soft_cap))
        row = lax.broadcasted_iota(jnp.int32, (bv, bt), 0)
        inside = row < t.tail if last else None
        zm = zt if inside is None else jnp.where(inside, zt, -jnp.inf)
        m_old = m_ref[...]
        m_new = jnp.maximum(m_old, jnp.max(zm, axis=0, keepdims=True))
        e = jnp.exp(zm - m_new)
        s_ref[...] = s_ref[...] * jnp.exp(m_old - m_new) + jnp.sum(e, axis=0, keepdims=True)
        m_ref[...] = m_new
        hit = row == labels_ref[...] - j * bv
        ll_acc[...] += jnp.sum(jnp.where(hit, zt, 0.0), axis=0, keepdims=True)
        if t.with_sum:
            sum_acc[...] += jnp.sum(
                zt if inside is None else jnp.where(inside, zt, 0.0), axis=0, keepdims=True
            )
        if store and t.packed:
            held[0][...] = e.astype(held[0].dtype)
            tile = lax.broadcasted_iota(jnp.int32, held[1].shape, 0)
            held[1][...] = jnp.where(tile == j % 8, m_new, held[1][...])
        elif store:
            held[0][...] = zt

    _ragged(t, j, step)

    @pl.when(j == t.tiles_vocab - 1)
    def _():
        lse_ref[...] = m_ref[...] + jnp.log(s_ref[...])
        ll_ref[...] = ll_acc[...]
        sum_ref[...] = sum_acc[...]


def logits(t: Tiles, x, w, labels, *, store: bool):
    """`(lse, label_logit, sum_logits)`, each `[1, C]` float32, of `x: [C, D]` against `w`;
    with `store` also `zT: [V, C]` (and with `t.packed` `maxima`). `labels`: `[1, C]` int32."""
    c, d = x.shape
    bt, bv = t.block_tokens, t.block_vocab
    token = pl.BlockSpec((1, bt), lambda i, j: (0, i))
    out_shape = [jax.ShapeDtypeStruct((1, c), jnp.float32)] * 3
    out_specs = [token] * 3
    if store:
        out_shape.append(jax.ShapeDtypeStruct((t.padded_vocab, c), t.logits_dtype))
        out_specs.append(pl.BlockSpec((bv, bt), lambda i, j: (j, i)))
        if t.packed:
            out_shape.append(jax.ShapeDtypeStruct((t.maxima_rows, c), jnp.float32))
            out_specs.append(pl.BlockSpec((8, bt), lambda i, j: (j // 8, i)))
    return _call(
        t,
        functools.partial(_logits_kernel, t=t, store=store),
        "axkern_fused_cross_entropy_loss_tpu_logits" if store else "axkern_fused_cross_entropy_tpu_stats",
        (cdiv(c, bt), t.tiles_vocab),
        ("parallel", "arbitrary"),
        in_specs=[
            token,
            pl.BlockSpec((bt, d), lambda i, j: (i, 0)),
            pl.BlockSpec((d, bv), lambda i, j: (0, j)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((1, bt), jnp.float32)] * 4,
    )(labels, x, w)


# -- the cotangent of a logits tile -------------------------------------------------------------


def _cotangent(t: Tiles, j, rows_ref, labels_ref, z_ref, maxima_ref, last: bool):
    """`dzT` of the tile (`[bv, bt]`) in the operand dtype."""
    rows = rows_ref[...]
    lse, g, a, b, keep = (rows[k : k + 1, :] for k in (LSE, G, A, B, KEEP))
    z = z_ref[...].astype(jnp.float32)
    if t.packed:  # exp(z - lse) = exp(z - m) · exp(m - lse), m the tile's row of maxima
        tile = lax.broadcasted_iota(jnp.int32, maxima_ref.shape, 0)
        m = jnp.sum(jnp.where(tile == j % 8, maxima_ref[...], 0.0), axis=0, keepdims=True)
        p = z * jnp.exp(m - lse)
    else:
        p = jnp.exp(z - lse)
    row = lax.broadcasted_iota(jnp.int32, z.shape, 0)
    dz = g * p - jnp.where(row == labels_ref[...] - j * t.block_vocab, a, 0.0)
    if t.with_sum:
        dz = dz - b
    if t.soft_cap is not None:  # float32 logits only: `z` is the capped logit
        dz = dz * (1.0 - jnp.square(z * (1.0 / t.soft_cap)))
    live = keep > 0
    if last:
        live = live & (row < t.tail)
    return jnp.where(live, dz, 0.0).astype(t.operand)


# -- dx: tokens outer; the tile's cotangent written over its logits ------------------------------


def _dx_kernel(rows_ref, labels_ref, z_ref, *refs, t: Tiles):
    maxima_ref = refs[0] if t.packed else None
    w_ref, dx_ref, dz_ref, acc = refs[-4:]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    def step(last):
        dzt = _cotangent(t, j, rows_ref, labels_ref, z_ref, maxima_ref, last)
        dz_ref[...] = dzt.astype(dz_ref.dtype)
        if last:  # the product sums over the tile's columns: those past V must be 0 in w too
            w_ref[:, t.tail :] = jnp.zeros((w_ref.shape[0], t.block_vocab - t.tail), w_ref.dtype)
        acc[...] += dot(w_ref[...], dzt)  # [D, bt]

    _ragged(t, j, step)

    @pl.when(j == t.tiles_vocab - 1)
    def _():
        keep = rows_ref[KEEP : KEEP + 1, :] > 0  # a dropped token's row: 0, even where w is not finite
        dx_ref[...] = jnp.where(keep, acc[...], 0.0).T.astype(dx_ref.dtype)


def dx(t: Tiles, held, rows, labels, w, dtype):
    """`(dx, dzT)` of the chunk whose logits are `held` (`(zT,)` or `(zT, maxima)`): `dx: [C, D]`
    in `dtype`, and the cotangent of the logits `dzT` written over `zT` (its buffer and dtype)."""
    c, d = held[0].shape[1], w.shape[0]
    bt, bv = t.block_tokens, t.block_vocab
    tile = pl.BlockSpec((bv, bt), lambda i, j: (j, i))
    per_token = [pl.BlockSpec((ROWS, bt), lambda i, j: (0, i)), pl.BlockSpec((1, bt), lambda i, j: (0, i))]
    maxima = [pl.BlockSpec((8, bt), lambda i, j: (j // 8, i))] if t.packed else []
    return _call(
        t,
        functools.partial(_dx_kernel, t=t),
        "axkern_fused_cross_entropy_loss_tpu_dx",
        (cdiv(c, bt), t.tiles_vocab),
        ("parallel", "arbitrary"),
        in_specs=per_token + [tile] + maxima + [pl.BlockSpec((d, bv), lambda i, j: (0, j))],
        out_specs=[pl.BlockSpec((bt, d), lambda i, j: (i, 0)), tile],
        out_shape=[jax.ShapeDtypeStruct((c, d), dtype), jax.ShapeDtypeStruct(held[0].shape, held[0].dtype)],
        scratch_shapes=[pltpu.VMEM((d, bt), jnp.float32)],
        input_output_aliases={2: 1},
    )(rows, labels, *held, w)


# -- dw: vocabulary outer, a product alone ------------------------------------------------------


def _dw_kernel(dz_ref, x_ref, *refs, t: Tiles, accumulate: bool, final: bool):
    sum_ref, refs = (refs[0], refs[1:]) if accumulate else (None, refs)
    out_ref = refs[0]
    acc = refs[1] if final else out_ref  # a float32 running sum accumulates in its output block
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _():
        acc[...] = sum_ref[...] if accumulate else jnp.zeros(acc.shape, jnp.float32)

    acc[...] += dot(dz_ref[...].astype(t.operand), x_ref[...])  # [bv, D]
    if final:

        @pl.when(i == pl.num_programs(1) - 1)
        def _():
            out_ref[...] = acc[...].T.astype(out_ref.dtype)


def dw(t: Tiles, dzt, x, running, final_dtype):
    """The chunk's `dw = x^T dz` (from `dzT: [V', C]`) added to `running` (the previous chunks'
    float32 sum, transposed, `[V', D]`; or None): the new sum, or with `final_dtype` the gradient
    `[D, V]` in that dtype. `V'`: the vocabulary in whole tiles."""
    c, d = x.shape
    bt, bv = t.block_tokens, t.block_vocab
    in_specs = [pl.BlockSpec((bv, bt), lambda j, i: (j, i)), pl.BlockSpec((bt, d), lambda j, i: (i, 0))]
    args = [dzt, x]
    aliases = {}
    if running is not None:
        in_specs.append(pl.BlockSpec((bv, d), lambda j, i: (j, 0)))
        args.append(running)
        if final_dtype is None:
            aliases = {2: 0}
    if final_dtype is None:
        out = (
            pl.BlockSpec((bv, d), lambda j, i: (j, 0)),
            jax.ShapeDtypeStruct((t.padded_vocab, d), jnp.float32),
            [],
        )
    else:
        out = (
            pl.BlockSpec((d, bv), lambda j, i: (0, j)),
            jax.ShapeDtypeStruct((d, t.vocab), final_dtype),
            [pltpu.VMEM((bv, d), jnp.float32)],
        )
    return _call(
        t,
        functools.partial(_dw_kernel, t=t, accumulate=running is not None, final=final_dtype is not None),
        "axkern_fused_cross_entropy_loss_tpu_dw",
        (t.tiles_vocab, cdiv(c, bt)),
        ("parallel", "arbitrary"),
        in_specs=in_specs,
        out_specs=out[0],
        out_shape=out[1],
        scratch_shapes=out[2],
        input_output_aliases=aliases,
    )(*args)
