"""Block sizes of attention (query rows by key columns per tile): each implementation's
heuristic and the space of candidates `axkern tune` sweeps for it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp

from axkern import masks as masks_
from axkern.core import backend
from axkern.core.blocks import BlockSizes, cdiv, grid, next_power_of_2, powers_of_two, unique_valid
from axkern.core.op import Spec

__all__ = [
    "AttentionBlockSizes",
    "bucket",
    "heuristic",
    "space",
    "pallas_gpu_heuristic",
    "pallas_gpu_space",
    "pallas_tpu_heuristic",
    "pallas_tpu_space",
    "pallas_tpu_vmem_bytes",
    "TPU_VMEM_LIMIT",
    "pallas_tpu_vmem_limit",
    "mosaic_gpu_heuristic",
    "mosaic_gpu_ping_pong",
    "mosaic_gpu_backward_tiles",
    "mosaic_gpu_dq_by",
    "MOSAIC_GPU_BACKWARD_TILINGS",
    "mosaic_gpu_space",
    "mosaic_gpu_smem_bytes",
    "mosaic_gpu_dq_smem_bytes",
    "mosaic_gpu_dkv_smem_bytes",
    "MOSAIC_GPU_SMEM",
    "GPU_MIN_BLOCK",
    "TPU_SUBLANES",
]

GPU_MIN_BLOCK = 16  # Triton tiles: powers of two of at least 16
TPU_SUBLANES = 8  # TPU blocks: multiples of the 8 sublanes


@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes(BlockSizes):
    """`block_q` query positions by `block_kv` key positions per tile; neither needs to divide
    the lengths (the last blocks are padded and masked). `pallas_gpu` also reads `num_warps`
    and `num_stages` (Triton's warps per program and software-pipelining depth; `None`:
    Triton's defaults), and gives each backward kernel its own four: `*_dq` for the kernel
    that walks key tiles per query block (`dq`), `*_dkv` for the one that walks query tiles
    per key block (`dk`, `dv`); a `None` there takes the forward's value. `pallas_tpu`, `xla`
    use `block_q`, `block_kv` for every pass. `mosaic_gpu` reads `block_q` (query rows per
    compute warpgroup; a block holds two), `block_kv`, `num_stages` (the depth of its
    shared-memory ring of key and value tiles) and `ping_pong` (how its two compute warpgroups
    share the tensor cores: `"rendezvous"`, both meeting after each `q kᵀ` and before each `p v`,
    as JAX's example kernel; `"overlap"`, FA3's overlap inside a warpgroup, one tile's softmax
    under the previous tile's `p v`, the turns handed over on a barrier each; `None`: the
    rendezvous) for its forward, and the `*_dq`, `*_dkv` `block_q`, `block_kv`, `num_stages` for
    its backward kernels, and `dq_by`: `"kernel"`, `dq` by its own kernel, or `"reduction"`, by
    the `dk, dv` kernel, which adds each tile's share to float32 zeros by TMA reductions (the
    order of those additions varies between runs; head dims up to 128); `None`:
    `mosaic_gpu_dq_by`'s choice."""

    choices: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "ping_pong": ("rendezvous", "overlap"),
        "dq_by": ("kernel", "reduction"),
    }

    block_q: int = 128
    block_kv: int = 128
    num_warps: int | None = None
    num_stages: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    num_warps_dq: int | None = None
    num_stages_dq: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    num_warps_dkv: int | None = None
    num_stages_dkv: int | None = None
    ping_pong: str | None = None
    dq_by: str | None = None

    def kernel(self, name: str) -> AttentionBlockSizes:
        """The forward's four fields for kernel `name` (`"fwd"`, `"dq"` or `"dkv"`), a `None`
        of a backward kernel filled from the forward's."""
        if name not in ("fwd", "dq", "dkv"):
            raise ValueError(f"kernel must be 'fwd', 'dq' or 'dkv', got {name!r}")
        base = {f: getattr(self, f) for f in _PER_KERNEL}
        own = {} if name == "fwd" else {f: getattr(self, f"{f}_{name}") for f in _PER_KERNEL}
        return AttentionBlockSizes(**{f: base[f] if own.get(f) is None else own[f] for f in _PER_KERNEL})


_PER_KERNEL = ("block_q", "block_kv", "num_warps", "num_stages")


def mask_kind(mask) -> str:
    """The mask's kind as tuned tables key it: "full", "causal", "window" (a sliding window,
    alone or `&` a causal mask), "documents" (any mask holding `Segments`), "prefix" (holding
    `PrefixLM`), else "other". Its tiles' mix of empty, partial and full tiles is what moves the
    best block sizes."""
    kinds = {type(m).__name__ for m in masks_.leaves(mask)}
    if "Segments" in kinds:
        return "documents"
    if "PrefixLM" in kinds:
        return "prefix"
    if kinds <= {"Full"}:
        return "full"
    if kinds == {"Causal"}:
        return "causal"
    if "SlidingWindow" in kinds and kinds <= {"SlidingWindow", "Causal"} and type(mask).__name__ != "Or":
        return "window"
    return "other"


def bucket(spec: Spec) -> dict:
    """Dims rounded up to powers of two, the dtype and the mask's kind (`mask_kind`)."""
    dims = {k: next_power_of_2(v) for k, v in spec.dims}
    return dims | {"dtype": spec.dtype, "mask": spec.flag("mask_kind") or "full"}


_LIMIT = {"gpu": 1024, "tpu": 512, "cpu": 128}


def heuristic(spec: Spec) -> AttentionBlockSizes:
    limit = _LIMIT.get(spec.platform, 128)
    return AttentionBlockSizes(
        block_q=min(limit, next_power_of_2(spec.dim("q_len"))),
        block_kv=min(limit, next_power_of_2(spec.dim("kv_len"))),
    )


def space(spec: Spec) -> list[AttentionBlockSizes]:
    """`xla`'s tiles: the three largest powers of two up to the platform's limit, each way."""
    limit = _LIMIT.get(spec.platform, 128)
    return grid(
        AttentionBlockSizes,
        spec,
        first=heuristic(spec),
        block_q=powers_of_two(spec.dim("q_len"), high=limit, count=3, low=8),
        block_kv=powers_of_two(spec.dim("kv_len"), high=limit, count=3, low=8),
    )


_HOPPER = ("nvidia_h100", "nvidia_h200", "nvidia_h800", "nvidia_gh200")


def pallas_gpu_heuristic(spec: Spec) -> AttentionBlockSizes:
    """Each Triton kernel its own tiles. On Hopper (227 KiB of shared memory a block) with
    16-bit inputs and head dims up to 128: forward 128x64 with 8 warps and 3 stages, `dq`
    128x32 with 4 and 3, `dk, dv` 64x64 with 4 and 2 (docs/decisions.md, "Attention", has the
    sweep behind them). Other GPUs: 64x64 tiles and Triton's defaults (larger tiles'
    pipelined operands would outgrow shared memory). Head dims above 128: 64x64 tiles and a
    forward of two stages (three ask for 237568 bytes of shared memory at head dim 256, more
    than a Hopper block's 232448). 32-bit inputs:
    64x64 tiles with two pipeline stages (one for `dk, dv`), as their tiles take twice the
    shared memory. Short sequences get tiles no longer than the padded length, at least 16."""
    q_len, kv_len = (next_power_of_2(spec.dim(n)) for n in ("q_len", "kv_len"))
    fit = lambda n, length: max(GPU_MIN_BLOCK, min(n, length))  # noqa: E731
    wide = jnp.dtype(spec.dtype).itemsize > 2
    hopper = spec.device_key.startswith(_HOPPER)
    if wide:
        return AttentionBlockSizes(
            block_q=fit(64, q_len),
            block_kv=fit(64, kv_len),
            num_stages=2,
            num_stages_dq=2,
            num_stages_dkv=1,
        )
    if max(spec.dim("head_dim"), spec.dim("v_dim")) > 128:
        return AttentionBlockSizes(block_q=fit(64, q_len), block_kv=fit(64, kv_len), num_stages=2)
    if not hopper:
        return AttentionBlockSizes(block_q=fit(64, q_len), block_kv=fit(64, kv_len))
    return AttentionBlockSizes(
        block_q=fit(128, q_len),
        block_kv=fit(64, kv_len),
        num_warps=8,
        num_stages=3,
        block_q_dq=fit(128, q_len),
        block_kv_dq=fit(32, kv_len),
        num_warps_dq=4,
        num_stages_dq=3,
        block_q_dkv=fit(64, q_len),
        block_kv_dkv=fit(64, kv_len),
        num_warps_dkv=4,
        num_stages_dkv=2,
    )


def pallas_gpu_space(spec: Spec) -> list[AttentionBlockSizes]:
    """One kernel at a time around the heuristic: the forward's, then `dq`'s, then `dk, dv`'s
    (64 or 128 query rows by 32 to 128 keys, 4 or 8 warps, 2 or 3 stages), the other two
    kernels kept at the heuristic's choice. A kernel's tiles barely change the others' times, so this covers
    what a full product (thousands of candidates) would find."""
    base = pallas_gpu_heuristic(spec)
    q_len, kv_len = (next_power_of_2(spec.dim(n)) for n in ("q_len", "kv_len"))
    tiles_q = [t for t in (64, 128) if t <= q_len] or [GPU_MIN_BLOCK]
    tiles_kv = [t for t in (32, 64, 128) if t <= kv_len] or [GPU_MIN_BLOCK]
    out = [base]
    for suffix in ("", "_dq", "_dkv"):
        for bq in tiles_q:
            for bk in tiles_kv:
                for warps in (4, 8):
                    for stages in (2, 3):
                        fields = {"block_q": bq, "block_kv": bk, "num_warps": warps, "num_stages": stages}
                        out.append(dataclasses.replace(base, **{f + suffix: v for f, v in fields.items()}))
    return unique_valid(out, spec)


def _tpu_tile(n: int, high: int) -> int:
    """A tile for a length `n`: a power of two; up to 128 the smallest that holds `n` (at least 8);
    beyond, the largest up to `high` that pads `n` to at most 1/8 more than 128-row tiles would
    (a padded row is computed like any other)."""
    if n <= 128:
        return max(TPU_SUBLANES, next_power_of_2(n))
    limit = cdiv(n, 128) * 128 * 9 // 8
    t = high
    while t > 128 and cdiv(n, t) * t > limit:
        t //= 2
    return t


# What the heuristic's tiles may take by `pallas_tpu_vmem_bytes`: a little above the largest
# estimate compiled on a TPU v5e (12.1 MiB: 512 by 1024 and 1024 by 512 at head dim 128, bf16),
# below the scoped limit by what the estimate leaves out
_HEURISTIC_VMEM = 25 * 1024 * 1024 // 2


def pallas_tpu_heuristic(spec: Spec) -> AttentionBlockSizes:
    """512 query rows by 1024 keys (the fastest tiles of a TPU v5e's sweep at head dim 128,
    docs/ops/attention.md: 6x the 128 by 128 tiles' speed, each grid step's overhead and the
    reloads of `q` spread over more work); smaller where a length would pad much more than
    128-row tiles (`_tpu_tile`); halved, queries first, down to 128 each way, until
    `pallas_tpu_vmem_bytes` is within `_HEURISTIC_VMEM`."""
    bq, bk = _tpu_tile(spec.dim("q_len"), 512), _tpu_tile(spec.dim("kv_len"), 1024)
    d, dv, itemsize = spec.dim("head_dim"), spec.dim("v_dim"), jnp.dtype(spec.dtype).itemsize
    while pallas_tpu_vmem_bytes(bq, bk, d, dv, itemsize) > _HEURISTIC_VMEM and max(bq, bk) > 128:
        if bq >= bk // 2 and bq > 128:
            bq //= 2
        else:
            bk //= 2
    return AttentionBlockSizes(block_q=bq, block_kv=bk)


# The scoped VMEM limit `pallas_tpu`'s kernels are compiled with (`vmem_limit_bytes`, at most
# half the chip's VMEM; Mosaic's default is 16 MiB): room beyond the estimate for what it leaves
# out (a `Full` mask's forward at 512 by 1024, head dim 128, bf16, asked Mosaic for 20.2 MiB where
# the estimate of the largest kernel is 12.1); what the tuner's tiles must fit by the estimate
TPU_VMEM_LIMIT = 32 * 1024 * 1024


def pallas_tpu_vmem_limit() -> int | None:
    """The scoped VMEM `pallas_tpu`'s kernels are compiled with: `TPU_VMEM_LIMIT`, or half the
    chip's VMEM where that is less, never below Mosaic's default (16 MiB); `TPU_VMEM_LIMIT` on a
    TPU this JAX does not describe; Mosaic's default (None) where JAX knows no TPU at all."""
    from jax.experimental.pallas import tpu as pltpu

    try:
        capacity = pltpu.get_tpu_info().vmem_capacity_bytes
    except (ValueError, RuntimeError):  # a device kind JAX's table lacks, or no TPU
        return TPU_VMEM_LIMIT if jax.default_backend() == "tpu" else None
    return max(16 * 1024 * 1024, min(TPU_VMEM_LIMIT, capacity // 2))


def pallas_tpu_vmem_bytes(block_q: int, block_kv: int, head_dim: int, v_dim: int, itemsize: int) -> int:
    """An estimate of the VMEM the largest of `pallas_tpu`'s three kernels (forward, `dq`,
    `dk, dv`) takes at these tiles: each grid step's blocks double-buffered (`q`, `k`, `v`, `dO`,
    `o` and what its rounding lost in the inputs' dtype, float32 `dq`, `dk`, `dv`; `lse`, `delta`
    and the query ids as `[block_q, 1]` columns, which take 128 lanes each, the key ids as a
    `[1, block_kv]` row of 8 sublanes), the float32 scratch (the forward's running max and sum,
    128 lanes each, and its accumulator; the backward's accumulators; with sinks the `dq`
    kernel's `Σ p·dp` column, output and scratch, counted always), and three float32
    `[block_q, block_kv]` tiles live at once (scores, probabilities, `dp` or `ds`; a partial
    tile's mask and the 16-bit copies of `p` and `ds` take the room of a fourth at most, which the
    estimate leaves out)."""
    bq, bk, d, dv, e = block_q, block_kv, head_dim, v_dim, itemsize
    column = bq * 128 * 4  # a [block_q, 1] float32 (or int32) column
    ids = 2 * column + 2 * 8 * bk * 4
    forward = 2 * (bq * d + bk * d + bk * dv + 2 * bq * dv) * e + 2 * column + ids + 2 * column + bq * dv * 4
    dq = 2 * (bq * d + bk * d + bk * dv + bq * dv) * e + 7 * column + ids + 3 * bq * d * 4
    dkv = 2 * (bq * d + bk * d + bk * dv + bq * dv) * e + 4 * column + ids + 3 * bk * (d + dv) * 4
    return max(forward, dq, dkv) + 3 * bq * bk * 4


def pallas_tpu_space(spec: Spec) -> list[AttentionBlockSizes]:
    """Tiles of 256 to 1024 each way (the three largest powers of two that fit the lengths, at
    least 8) whose `pallas_tpu_vmem_bytes` fits the limit the kernels are compiled with
    (`TPU_VMEM_LIMIT`; at head dim 128 in bf16 1024 by 1024 does, the tiles of splash
    attention's fastest blocks), and 128 by 128, after the heuristic's. The estimate leaves
    things out, so a tile near the limit may fail to compile: the tuner passes it over with its
    error."""
    first = pallas_tpu_heuristic(spec)
    itemsize = jnp.dtype(spec.dtype).itemsize
    d, dv = spec.dim("head_dim"), spec.dim("v_dim")
    fits = lambda b: pallas_tpu_vmem_bytes(b.block_q, b.block_kv, d, dv, itemsize) <= TPU_VMEM_LIMIT  # noqa: E731
    candidates = grid(
        AttentionBlockSizes,
        spec,
        first=first,
        block_q=powers_of_two(spec.dim("q_len"), high=1024, count=3, low=TPU_SUBLANES),
        block_kv=powers_of_two(spec.dim("kv_len"), high=1024, count=3, low=TPU_SUBLANES),
    )
    small = AttentionBlockSizes(block_q=128, block_kv=128)
    if min(spec.dim("q_len"), spec.dim("kv_len")) >= 128 and small not in candidates:
        candidates.append(small)
    return [b for b in candidates if b == first or fits(b)]


MOSAIC_GPU_SMEM = 227 * 1024  # shared memory a Hopper block may take


# what Mosaic GPU adds to the tiles (barriers, alignment, reduction scratch), rounded up from
# what a compile asked beyond them (docs/ops/attention.md)
_MOSAIC_GPU_SMEM_EXTRA = 4096


def mosaic_gpu_smem_bytes(
    block_q: int, block_kv: int, num_stages: int, head_dim: int, itemsize: int = 2
) -> int:
    """Shared memory of the `mosaic_gpu` forward: two warpgroups' query (then output) tiles and
    their `lse` rows, `num_stages` key and value tiles, and what Mosaic GPU adds."""
    tiles = 2 * block_q * (head_dim * itemsize + 4) + 2 * num_stages * block_kv * head_dim * itemsize
    return tiles + _MOSAIC_GPU_SMEM_EXTRA


def mosaic_gpu_dq_smem_bytes(
    block_q: int, block_kv: int, num_stages: int, head_dim: int, itemsize: int = 2
) -> int:
    """Shared memory of the `mosaic_gpu` `dq` kernel: two warpgroups' query and output-gradient
    tiles, `num_stages` key and value tiles, and what Mosaic GPU adds."""
    tiles = 2 * 2 * block_q * head_dim * itemsize + 2 * num_stages * block_kv * head_dim * itemsize
    return tiles + _MOSAIC_GPU_SMEM_EXTRA


def mosaic_gpu_dkv_smem_bytes(
    block_q: int, block_kv: int, num_stages: int, head_dim: int, itemsize: int = 2, dq: bool = False
) -> int:
    """Shared memory of the `mosaic_gpu` `dk, dv` kernel: two warpgroups' key and value tiles,
    `num_stages` query and output-gradient tiles with their `lse` and `delta` rows, and what
    Mosaic GPU adds; with `dq` (`dq_by="reduction"`) each warpgroup's `ds` tile and float32
    `dq` staging tile too."""
    tiles = 2 * 2 * block_kv * head_dim * itemsize + num_stages * block_q * (2 * head_dim * itemsize + 8)
    if dq:
        tiles += 2 * block_q * (block_kv * itemsize + head_dim * 4)
    return tiles + _MOSAIC_GPU_SMEM_EXTRA


def mosaic_gpu_ping_pong(spec: Spec) -> str:
    """The forward's `ping_pong` (`AttentionBlockSizes`): `"overlap"` from head dim 128 up under
    a causal mask or none, else `"rendezvous"` (where each was faster: docs/decisions.md,
    "Attention"). Rows with few key tiles (a window, short documents, head dim 64's 64 x 256
    tiles) favour the rendezvous: the overlap's first and last turns run alone."""
    d = max(spec.dim("head_dim"), spec.dim("v_dim"))
    kind = spec.flag("mask_kind") or "full"
    return "overlap" if d >= 128 and kind in ("causal", "full") else "rendezvous"


def mosaic_gpu_heuristic(spec: Spec) -> AttentionBlockSizes:
    """Forward: 64 query rows per compute warpgroup (128 a block) by 128 keys for head dims up
    to 128, 64 keys at 256, two ring stages, the ping-pong of `mosaic_gpu_ping_pong`; the backward
    fields `mosaic_gpu_backward_tiles`' (docs/decisions.md, "Attention", has the sweeps behind
    both)."""
    d = max(spec.dim("head_dim"), spec.dim("v_dim"))
    fwd = dict(
        block_q=64,
        block_kv=128 if d <= 128 else 64,
        num_warps=None,
        num_stages=2,
        ping_pong=mosaic_gpu_ping_pong(spec),
    )
    back = {
        f"{f}_{name}": value
        for name, tile in mosaic_gpu_backward_tiles(d).items()
        for f, value in zip(("block_q", "block_kv", "num_stages"), tile, strict=True)
    }
    return AttentionBlockSizes(**fwd, **back)


def mosaic_gpu_dq_by(head_dim: int) -> str:
    """How the Mosaic GPU backward forms `dq` where the block sizes leave `dq_by` out:
    `"reduction"` at head dim 64, `"kernel"` above it and wherever `XLA_FLAGS` asks for
    deterministic results (`backend.deterministic`: the reductions' order varies). Above 64
    each warpgroup holds `dk`'s and `dv`'s float32 accumulators (64 registers a thread each)
    beside `dq`'s, and its steps wait on one more product and a TMA reduction (the timings:
    docs/decisions.md, "Attention")."""
    return "reduction" if head_dim <= 64 and not backend.deterministic() else "kernel"


def mosaic_gpu_backward_tiles(head_dim: int) -> dict[str, tuple[int, int, int]]:
    """The Mosaic GPU backward kernels' tiles, `{"dq": ..., "dkv": ...}` as `(block_q, block_kv,
    num_stages)`, where the block sizes leave them out (`mosaic_gpu_heuristic`'s backward fields):
    up to head dim 128 `dq` 64 query rows per warpgroup by 128 keys and `dk, dv` 64 keys per
    warpgroup by 64 query rows, two stages each; at 256 the only tiles that fit shared memory,
    64 x 64 with one stage each."""
    if head_dim <= 128:
        return {"dq": (64, 128, 2), "dkv": (64, 64, 2)}
    return {"dq": (64, 64, 1), "dkv": (64, 64, 1)}


# the backward tilings `mosaic_gpu_space` tries, `((block_q, block_kv, num_stages) of dq, (...) of
# dk, dv)`, up to head dim 128 (at 256 only the heuristic's fit)
MOSAIC_GPU_BACKWARD_TILINGS = (
    ((64, 64, 2), (64, 64, 2)),
    ((64, 64, 3), (64, 64, 2)),
    ((64, 128, 2), (64, 64, 2)),
    ((64, 64, 2), (128, 64, 2)),
    ((64, 64, 2), (64, 64, 3)),
    ((64, 128, 2), (128, 64, 2)),
)


def mosaic_gpu_space(spec: Spec) -> list[AttentionBlockSizes]:
    """The forward's tiles around the heuristic: 64 or 128 rows per warpgroup, 64 to 256 keys,
    2 to 4 stages, where they fit shared memory, each with the rendezvous and the overlap
    ping-pong (the backward fields kept); then the backward's around the heuristic (its forward
    kept): each of `MOSAIC_GPU_BACKWARD_TILINGS` up to head dim 128 (their `dk, dv` tiles alone
    where `dq` is the `dk, dv` kernel's reductions), and `dq` by the other of its kernel and those
    reductions where both serve (`mosaic_gpu_dq_by`)."""
    base = mosaic_gpu_heuristic(spec)
    d = max(spec.dim("head_dim"), spec.dim("v_dim"))
    out = [base]
    for bq in (64, 128):
        for bk in (64, 128, 256):
            for stages in (2, 3, 4):
                if mosaic_gpu_smem_bytes(bq, bk, stages, d) <= MOSAIC_GPU_SMEM:
                    for form in ("rendezvous", "overlap"):
                        out.append(
                            dataclasses.replace(
                                base, block_q=bq, block_kv=bk, num_stages=stages, ping_pong=form
                            )
                        )
    if d <= 128:
        reduction = mosaic_gpu_dq_by(d) == "reduction"
        for dq, dkv in MOSAIC_GPU_BACKWARD_TILINGS:
            if reduction:  # no dq kernel runs: only the dk, dv tiles matter
                dq = (base.block_q_dq, base.block_kv_dq, base.num_stages_dq)
            fields = {
                f"{f}_{name}": value
                for name, tile in (("dq", dq), ("dkv", dkv))
                for f, value in zip(("block_q", "block_kv", "num_stages"), tile, strict=True)
            }
            out.append(dataclasses.replace(base, **fields))
        if not backend.deterministic():
            other = "kernel" if mosaic_gpu_dq_by(d) == "reduction" else "reduction"
            out.append(dataclasses.replace(base, dq_by=other))
    return unique_valid(out, spec)
