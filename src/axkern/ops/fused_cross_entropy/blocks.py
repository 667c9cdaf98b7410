"""Block sizes of the fused cross-entropy: each implementation's heuristic (used when no tuned
entry matches) and the space of candidates `axkern tune` sweeps for it."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from axkern.core.blocks import BlockSizes, grid, next_power_of_2, powers_of_two, unique_valid
from axkern.core.op import Spec

__all__ = [
    "CrossEntropyBlockSizes",
    "DW_ACCUMULATIONS",
    "dw_strategy",
    "dw_temporary_bytes",
    "describe_loss",
    "bucket",
    "heuristic",
    "loss_heuristic",
    "pallas_gpu_heuristic",
    "pallas_tpu_heuristic",
    "mosaic_gpu_heuristic",
    "mosaic_gpu_space",
    "mosaic_gpu_smem_bytes",
    "MOSAIC_GPU_SMEM",
    "space",
    "loss_space",
    "pallas_gpu_space",
    "pallas_tpu_space",
    "pallas_tpu_loss_heuristic",
    "pallas_tpu_loss_space",
    "pallas_tpu_loss_packed",
    "pallas_tpu_loss_vmem_bytes",
    "pallas_tpu_stats_vmem_bytes",
    "pallas_tpu_vmem_bytes",
    "tpu_vmem_bytes",
]

# How the reduced loss adds each token block's share of `dw` when `w` is 16-bit (a float32 or
# float64 `w` is its own accumulator: each slab's share is added to the gradient in w's dtype):
# - "compensated": to the gradient in w's dtype, with a second w-dtype [D, V] buffer holding
#   the rounding error of each addition (a float32 sum formed per [D, block_vocab] slab);
# - "compensated_int8": the same with the compensation as an int8 count of 1/256ths of the
#   gradient's ulp (D·V bytes instead of 2·D·V);
# - "float32": to a float32 [D, V] accumulator, each block's share formed whole;
# - "plain": to the gradient in w's dtype without compensation (as Liger-Kernel does); it
#   misses the oracle rule over many token blocks, and exists to be measured against.
DW_ACCUMULATIONS = ("compensated", "compensated_int8", "float32", "plain")

# Bytes of one float32 [block_tokens, block_vocab] logits tile, per platform. On GPU a tile
# this size keeps each matmul large enough to run near the tensor-core ceiling while the
# whole forward+backward stays far below the materialised [tokens, vocab] logits (the
# measurements behind the sizes: docs/ops/fused_cross_entropy.md, "Performance").
_TILE_BYTES = {"gpu": 256 << 20, "tpu": 64 << 20, "cpu": 8 << 20}
_BLOCK_VOCAB = {"gpu": 4096, "tpu": 2048, "cpu": 1024}


@dataclasses.dataclass(frozen=True)
class CrossEntropyBlockSizes(BlockSizes):
    """Tile of the streamed logits: `block_tokens` rows by `block_vocab` columns.

    Neither needs to divide the problem: a ragged last block is handled without padding.
    The GPU kernels also read `block_embed` (the reduction step over the embedding; the TPU
    kernels' blocks span the whole embedding), `vocab_splits` (programs sharing one token
    block's vocabulary, their statistics merged afterwards; more programs for small token
    counts), `num_warps` and `num_stages` (Triton's software pipelining depth). `None` lets the
    kernel choose. The per-token op's Pallas TPU kernel reads `block_tokens` (a multiple of 128)
    and `block_vocab` (a multiple of 128, or at least the vocabulary).

    The reduced loss (`fused_cross_entropy_loss`) reads `block_tokens` (each block spans the
    whole vocabulary), `dw_accumulation` (how each block's share of `dw` is added, see
    `DW_ACCUMULATIONS`; `None`: `"float32"`) and `block_vocab` (the columns of `dw`
    updated at once by the slab-wise strategies). Its Pallas TPU kernels read `block_tokens` and
    `block_vocab` as the tile of a kernel step and `chunk_tokens` as the rows whose logits are
    held in HBM at once (a multiple of `block_tokens`).
    """

    choices: ClassVar[dict[str, tuple[str, ...]]] = {"dw_accumulation": DW_ACCUMULATIONS}

    block_tokens: int = 1024
    block_vocab: int = 2048
    block_embed: int | None = None
    vocab_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    dw_accumulation: str | None = None
    chunk_tokens: int | None = None


def bucket(spec: Spec) -> dict:
    """Key of a tuned-table entry: each size rounded up to a power of two, and the dtype."""
    return {
        "tokens": next_power_of_2(spec.dim("tokens")),
        "embed": next_power_of_2(spec.dim("embed")),
        "vocab": next_power_of_2(spec.dim("vocab")),
        "dtype": spec.dtype,
    }


def stream_tiles(platform: str, tokens: int, vocab: int) -> CrossEntropyBlockSizes:
    """The streamed logits tile for `platform`: `block_vocab` columns and as many rows as fit
    the platform's float32 tile budget (GPU: `[16384, 4096]`, 256 MiB)."""
    block_vocab = max(1, min(vocab, _BLOCK_VOCAB.get(platform, 1024)))
    budget = _TILE_BYTES.get(platform, 8 << 20) // (4 * block_vocab)
    block_tokens = max(1, min(tokens, max(8, budget)))
    return CrossEntropyBlockSizes(block_tokens=block_tokens, block_vocab=block_vocab)


def heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    return stream_tiles(spec.platform, spec.dim("tokens"), spec.dim("vocab"))


# Bytes of the float32 [block_tokens, vocab] logits block of the reduced loss (whose gradients
# are formed in the forward: the block spans the whole vocabulary), at least. Each block adds
# its share to the [D, V] dw accumulation, a read-modify-write of 8·D·V bytes (the float32
# accumulator, or the 16-bit gradient and its compensation), so the block also grows to D / 2
# rows (rounded down to a power of two): the dw traffic stays below twice the logits' own.
_LOSS_BLOCK_BYTES = {"gpu": 512 << 20, "tpu": 128 << 20, "cpu": 16 << 20}
# Columns of the dw slab the slab-wise accumulations update at once: its float32 share is a
# [D, block_vocab] buffer (128 MiB at D = 4096 on gpu), its product still large enough for
# the tensor cores.
_DW_SLAB = {"gpu": 8192, "tpu": 4096, "cpu": 1024}


def loss_heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    tokens, embed, vocab = spec.dim("tokens"), spec.dim("embed"), spec.dim("vocab")
    rows = max(_LOSS_BLOCK_BYTES.get(spec.platform, 16 << 20) // (4 * vocab), embed // 2)
    rows = max(8, 1 << max(0, rows.bit_length() - 1))  # a power of two, at least 8
    slab = min(vocab, _DW_SLAB.get(spec.platform, 1024))
    return CrossEntropyBlockSizes(block_tokens=max(1, min(tokens, rows)), block_vocab=slab)


def pallas_gpu_heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    """Triton GEMM tiles for Hopper: 128 x 256 outputs, 64-deep steps, 8 warps, 3 stages."""
    return CrossEntropyBlockSizes(
        block_tokens=128, block_vocab=256, block_embed=64, num_warps=8, num_stages=3
    )


MOSAIC_GPU_SMEM = 227 * 1024  # dynamic shared memory of a Hopper CTA


def mosaic_gpu_smem_bytes(
    tile_m: int, tile_n: int, tile_k: int, stages: int, itemsize: int = 2, stats: int = 3
) -> int:
    """Shared memory of the Mosaic GPU kernel (two consumer warpgroups of `tile_m` rows): the
    ring of `x` and `w` slices, the staged per-row statistics (`stats` of them) and 1 KiB for
    the ring's barriers."""
    ring = stages * (2 * tile_m * tile_k + tile_k * tile_n) * itemsize
    return ring + stats * 2 * tile_m * 4 + 1024


def mosaic_gpu_heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    """Hopper GEMM tiles: CTA tiles of 256 rows (128 a consumer warpgroup) by 128 vocab
    columns, 64-deep steps, a ring of 4 slots (192 KiB)."""
    return CrossEntropyBlockSizes(block_tokens=256, block_vocab=128, block_embed=64, num_stages=4)


def mosaic_gpu_space(spec: Spec) -> list[CrossEntropyBlockSizes]:
    """CTA tiles of 128 or 256 rows by 128 or 256 columns, 64-deep steps, 3 or 4 slots, those
    whose accumulator (at most 128x128 a warpgroup) fits the registers and whose ring fits a
    CTA's shared memory."""
    candidates = grid(
        CrossEntropyBlockSizes,
        spec,
        first=mosaic_gpu_heuristic(spec),
        block_tokens=(128, 256),
        block_vocab=(128, 256),
        block_embed=(64,),
        num_stages=(3, 4),
    )
    return [
        b
        for b in candidates
        if b.block_tokens // 2 * b.block_vocab <= 128 * 128
        and mosaic_gpu_smem_bytes(b.block_tokens // 2, b.block_vocab, 64, b.num_stages) <= MOSAIC_GPU_SMEM
    ]


# -- the reduced loss's Pallas TPU kernels (pallas_tpu/loss.py) ---------------------------------


def tpu_vmem_bytes(device_kind: str) -> int:
    """VMEM of one TensorCore of the TPU `device_kind` names (JAX's spelling: "TPU v5 lite" is a
    v5e); 32 MiB for a kind not listed (and off a TPU, where the kernels run in interpret mode)."""
    kind = device_kind.lower()
    if "lite" in kind or "v5e" in kind or "v6" in kind:
        return 128 << 20
    if "v5" in kind or "v7" in kind:
        return 64 << 20
    return 32 << 20


def pallas_tpu_loss_packed(spec: Spec) -> bool:
    """Whether the reduced loss's kernels hold the logits packed: `exp(z - running max)` in the
    inputs' 16-bit dtype (16-bit inputs without a soft cap), else float32 logits."""
    return jnp.dtype(spec.dtype).itemsize == 2 and spec.flag("logits_soft_cap", None) is None


def pallas_tpu_loss_vmem_bytes(
    block_tokens: int, block_vocab: int, embed: int, itemsize: int, packed: bool
) -> int:
    """VMEM the largest of the reduced loss's three kernels takes for one step: the
    double-buffered blocks (inputs, outputs, float32 `[8, block_tokens]` rows padded to whole
    tiles), the float32 accumulators (and the dw kernel's transposition of its own) and about
    four float32 `[block_vocab, block_tokens]` temporaries in the elementwise kernels."""
    bt, bv, d = block_tokens, block_vocab, embed
    rows = 2 * 8 * max(bt, 128) * 4  # a double-buffered [8, bt] float32 block (or [1, bt]: padded)
    temporaries = 4 * bt * bv * 4
    logits = 2 * bv * bt * (2 if packed else 4)
    maxima = rows if packed else 0
    stats = pallas_tpu_stats_vmem_bytes(bt, bv, d, itemsize) + logits + maxima
    dx = (
        2 * logits
        + maxima
        + 2 * d * bv * itemsize
        + 2 * bt * d * itemsize
        + bt * d * 4
        + 2 * rows
        + temporaries
    )
    dw = logits + 2 * bt * d * itemsize + 5 * bv * d * 4 + bt * bv * 4
    return max(stats, dx, dw)


def pallas_tpu_stats_vmem_bytes(block_tokens: int, block_vocab: int, embed: int, itemsize: int) -> int:
    """VMEM of the statistics kernel alone (the per-token op, the undifferentiated loss): the
    double-buffered `x` and `w` blocks, the per-token rows and four float32 `[bv, bt]` temporaries."""
    rows = 2 * 8 * max(block_tokens, 128) * 4
    return (
        2 * (block_tokens * embed + embed * block_vocab) * itemsize
        + 8 * rows
        + 4 * block_tokens * block_vocab * 4
    )


def _loss_chunk(spec: Spec, block_tokens: int) -> int:
    """Rows whose logits the TPU kernels hold at once: as many as fit the bytes of xla's logits
    block for the call (`loss_heuristic`), in whole tiles."""
    vocab = spec.dim("vocab")
    budget = loss_heuristic(spec).block_tokens * vocab * 4
    held = vocab * (2 if pallas_tpu_loss_packed(spec) else 4)
    return max(block_tokens, budget // held // block_tokens * block_tokens)


def pallas_tpu_vmem_bytes(bt: int, bv: int, embed: int, itemsize: int, *, held: bool, packed: bool) -> int:
    """VMEM of the TPU kernels at tiles of `bt` by `bv`: the three kernels of the loss's gradients
    (`held`: `pallas_tpu_loss_vmem_bytes`, the logits `packed` or not) or the statistics kernel
    alone (`pallas_tpu_stats_vmem_bytes`)."""
    if held:
        return pallas_tpu_loss_vmem_bytes(bt, bv, embed, itemsize, packed)
    return pallas_tpu_stats_vmem_bytes(bt, bv, embed, itemsize)


def _fits(spec: Spec, bt: int, bv: int, held: bool) -> bool:
    """Whether tiles of `bt` by `bv` fit three quarters of the chip's VMEM (`pallas_tpu_vmem_bytes`)."""
    itemsize, packed = jnp.dtype(spec.dtype).itemsize, pallas_tpu_loss_packed(spec)
    need = pallas_tpu_vmem_bytes(bt, bv, spec.dim("embed"), itemsize, held=held, packed=packed)
    return need <= tpu_vmem_bytes(spec.device_kind) * 3 // 4


def _tpu_tiles(spec: Spec, held: bool) -> tuple[int, int]:
    """512 tokens by 1024 vocabulary columns for embeddings up to 2560 (512 columns above: the
    `[bt, D]` and `[D, bv]` blocks, and the dw kernel's `[bv, D]` float32 accumulator), halved
    until they fit (`_fits`)."""
    bt, bv = 512, 1024 if spec.dim("embed") <= 2560 else 512
    while not _fits(spec, bt, bv, held) and bv > 128:
        bv //= 2
    while not _fits(spec, bt, bv, held) and bt > 128:
        bt //= 2
    return bt, bv


def _tpu_space(spec: Spec, first: CrossEntropyBlockSizes, held: bool, **more) -> list[CrossEntropyBlockSizes]:
    """`first`, then tiles of 256 to 1024 tokens by 512 to 2048 columns that fit the chip's VMEM;
    `more(bt)` gives each candidate's other fields."""
    candidates = [first] + [
        CrossEntropyBlockSizes(block_tokens=bt, block_vocab=bv, **{k: f(bt) for k, f in more.items()})
        for bt in (256, 512, 1024)
        for bv in (512, 1024, 2048)
        if _fits(spec, bt, bv, held)
    ]
    return unique_valid(candidates, spec)


def pallas_tpu_heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    """The per-token op's statistics kernel: `_tpu_tiles`, fitted to that kernel alone."""
    bt, bv = _tpu_tiles(spec, held=False)
    return CrossEntropyBlockSizes(block_tokens=bt, block_vocab=bv)


def pallas_tpu_space(spec: Spec) -> list[CrossEntropyBlockSizes]:
    """The per-token op's tiles (`_tpu_space`)."""
    return _tpu_space(spec, pallas_tpu_heuristic(spec), held=False)


def pallas_tpu_loss_heuristic(spec: Spec) -> CrossEntropyBlockSizes:
    """`_tpu_tiles` fitted to the loss's three kernels; the chunk as `_loss_chunk` says."""
    bt, bv = _tpu_tiles(spec, held=True)
    return CrossEntropyBlockSizes(block_tokens=bt, block_vocab=bv, chunk_tokens=_loss_chunk(spec, bt))


def pallas_tpu_loss_space(spec: Spec) -> list[CrossEntropyBlockSizes]:
    """The loss's tiles (`_tpu_space`), each with the chunk `_loss_chunk` gives it."""
    first = pallas_tpu_loss_heuristic(spec)
    return _tpu_space(spec, first, held=True, chunk_tokens=lambda bt: _loss_chunk(spec, bt))


def space(spec: Spec) -> list[CrossEntropyBlockSizes]:
    """`xla`'s streamed tiles: the four largest power-of-two row counts up to 16384 by the four
    largest column counts up to 8192 (each at most the problem's size)."""
    return grid(
        CrossEntropyBlockSizes,
        spec,
        first=heuristic(spec),
        block_tokens=powers_of_two(spec.dim("tokens"), high=16384, count=4, low=8),
        block_vocab=powers_of_two(spec.dim("vocab"), high=8192, count=4, low=8),
    )


def loss_space(spec: Spec) -> list[CrossEntropyBlockSizes]:
    """The reduced loss's row blocks (each spans the whole vocabulary): the five largest powers
    of two up to 8192 rows, with the heuristic's dw slab and accumulation (the sweep compares
    times; the choice of accumulation also weighs memory, so it is not swept)."""
    first = loss_heuristic(spec)
    return grid(
        CrossEntropyBlockSizes,
        spec,
        first=first,
        block_tokens=powers_of_two(spec.dim("tokens"), high=8192, count=5, low=8),
        block_vocab=[first.block_vocab],
    )


def pallas_gpu_space(spec: Spec) -> list[CrossEntropyBlockSizes]:
    """Triton GEMM tiles: 64 or 128 rows, 128 or 256 columns, 32- or 64-deep steps, 4 or 8
    warps, 2 or 3 stages."""
    return grid(
        CrossEntropyBlockSizes,
        spec,
        first=pallas_gpu_heuristic(spec),
        block_tokens=(64, 128),
        block_vocab=(128, 256),
        block_embed=(32, 64),
        num_warps=(4, 8),
        num_stages=(2, 3),
    )


# -- how the reduced loss accumulates dw, and what explain says of it --------------------------


def dw_strategy(w_dtype, requested: str | None) -> str:
    """The accumulation that runs for a `w` of `w_dtype` when `requested` (`None`: the
    default): "gradient" for a `w` of 32 bits or more (it is its own accumulator), else the
    request or "float32" (the one timed on a GPU at a model's size, docs/decisions.md)."""
    if jnp.dtype(w_dtype).itemsize >= 4:
        return "gradient"
    return requested or "float32"


def dw_temporary_bytes(strategy: str, embed: int, vocab: int, slab: int, w_dtype) -> int:
    """Bytes the dw accumulation holds beside the gradient: the compensation or the float32
    accumulator (`[D, V]`), and the float32 share of one slab (`[D, slab]`)."""
    w_bytes = jnp.dtype(w_dtype).itemsize
    slab_share = embed * min(slab, vocab) * max(4, w_bytes)
    return {
        "compensated": embed * vocab * w_bytes + slab_share,
        "compensated_int8": embed * vocab + slab_share,
        "float32": embed * vocab * 4,
        "plain": slab_share,
        "gradient": slab_share,
    }[strategy]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


_DW_WORDS = {
    "compensated": "accumulated in w's {w} with a {w} [D, V] compensation (Kahan), {slab}-column slabs",
    "compensated_int8": "accumulated in w's {w} with an int8 [D, V] compensation (Kahan, 1/256ths of an ulp), "
    "{slab}-column slabs",
    "float32": "accumulated in a float32 [D, V] buffer, each block's share formed whole",
    "plain": "accumulated in w's {w} without compensation (measurement only: misses the oracle rule)",
    "gradient": "accumulated in the {w} gradient itself, {slab}-column slabs",
}


def describe_loss(spec, block_sizes) -> str:
    """`explain`'s backward line for the reduced loss: how `dw` is accumulated and the
    temporary memory of one logits block and of that accumulation."""
    tokens, embed, vocab = spec.dim("tokens"), spec.dim("embed"), spec.dim("vocab")
    w_dtype = spec.flag("w_dtype", spec.dtype)
    strategy = dw_strategy(w_dtype, block_sizes.dw_accumulation)
    rows = min(block_sizes.block_tokens, max(1, tokens))
    slab = min(block_sizes.block_vocab, vocab)
    block = rows * vocab * 4 + rows * min(slab, vocab) * 2  # float32 logits block, a slab of dz
    if strategy == "float32":
        block = rows * vocab * (4 + 2)  # and the whole block's dz
    dw_bytes = dw_temporary_bytes(strategy, embed, vocab, slab, w_dtype)
    words = _DW_WORDS[strategy].format(w=jnp.dtype(w_dtype).name, slab=slab)
    return (
        "gradients formed in the forward, one [block_tokens, vocab] logits block at a time "
        f"(6·N·D·V FLOPs; the backward scales them); dw {words}; temporary memory up to "
        f"{_gib(block + dw_bytes)} (logits block {_gib(block)}, dw accumulation {_gib(dw_bytes)})"
    )
