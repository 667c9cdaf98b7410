"""Shapes that `axkern bench attention` uses. FLOPs count the visible part of `q k^T` and `p v`
(`4·B·H·D` per visible (query, key) pair forward, 2.5 times that backward).

Peers (`--peers`, timed in this process): tokamax's `dot_product_attention` with
`implementation="mosaic"` (`tokamax_mosaic`) and `"cudnn"` (`tokamax_cudnn`) on the case's
`q, k, v` as they are: tokamax takes the same `[batch, length, heads, head_dim]` layout, and
grouped kv heads as `[batch, length, kv_heads, head_dim]`. The case's mask maps onto tokamax's
keywords only where it does exactly (`tokamax_mask`): no mask, `Causal()` as `is_causal=True`,
`SlidingWindow(size)` as `local_window_size=(size - 1, 0)`; the scale is passed as
`head_dim ** -0.5`. tokamax has no segment ids, so the packed-documents case gets a row saying
so rather than a dense `[B, 1, L, L]` mask (a different computation). tokamax is found by
import: install its wheel (it needs Python >= 3.12 and jax >= 0.11.1) and put a stand-in for
its profiler package on `PYTHONPATH`, as `benchmarks/gpu.sh` does; where it is absent or does
not import, its rows say why.

The TPU presets (`tpu`: causal, a window of 1024 and packed documents of 1024 at B2 S8192 H32
D128; `tpu_shapes`: grouped kv heads 32/8, head dims 64 and 256) are sized for one chip's memory:
their errors are taken against `xla` (the dense reference's scores alone would not fit), and
their peers are JAX's own splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`,
the kernel Levanter runs on TPU): `splash` with its default block sizes, and `splash_best`, the
fastest of a sweep of block sizes (`SPLASH_SWEEP`, or `AXKERN_SPLASH_SWEEP`), whose note names
the winner and every size's time. Splash runs per batch row (`vmap`) on `[heads, length,
head_dim]`: the case's `[batch, length, heads, head_dim]` inputs are transposed and `q` scaled
by `head_dim ** -0.5` inside the timed function, as Levanter calls it (our kernels transpose
too). The masks map exactly (`splash_mask`): `Causal(offset)` to `CausalMask`,
`SlidingWindow(size, offset)` to `LocalMask((size - 1, 0), offset)`, `Segments` to splash's
`SegmentIds`. Off a TPU splash runs only in interpret mode (`axkern.use(interpret=True)`).
"""

from __future__ import annotations

import functools
import importlib.util
import operator
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from axkern import masks
from axkern.core import backend, config
from axkern.core.cases import Case
from axkern.core.op import Unsupported

from .api import attention_positional

# batch, length, heads, kv_heads, head_dim, mask
PRESETS = {
    "quick": [(1, 256, 4, 2, 32, "causal")],
    "h200": [
        (2, 8192, 32, 32, 128, "causal"),
        (2, 8192, 32, 8, 128, "causal"),
        (2, 8192, 32, 32, 64, "causal"),
        (2, 8192, 32, 32, 128, "window1024"),
        (2, 8192, 32, 32, 128, "docs1024"),
        (2, 8192, 32, 32, 256, "causal"),
    ],
    # the Hopper forward's two headline cases: causal and no mask
    "h200_core": [
        (2, 8192, 32, 32, 128, "causal"),
        (2, 8192, 32, 32, 128, "full"),
    ],
    # one TPU chip: timed beside splash attention (its default and its best block sizes)
    "tpu": [
        (2, 8192, 32, 32, 128, "causal"),
        (2, 8192, 32, 32, 128, "window1024"),
        (2, 8192, 32, 32, 128, "docs1024"),
    ],
    "tpu_shapes": [
        (2, 8192, 32, 8, 128, "causal"),
        (2, 8192, 32, 32, 64, "causal"),
        (2, 8192, 32, 32, 256, "causal"),
    ],
}


def _mask(name, batch, length):
    if name == "full":
        return masks.Full()
    if name == "window1024":
        return masks.SlidingWindow(1024)
    if name == "docs1024":  # packed documents of 1024 tokens, causal within each
        ids = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) // 1024, (batch, length))
        return masks.Causal() & masks.Segments(ids, ids)
    return masks.Causal()


def visible_pairs(name: str, length: int) -> int:
    """The (query, key) pairs `_mask(name, ..)` leaves visible in one batch row, counted in closed
    form (the dense mask of a long sequence takes seconds to build on a CPU)."""
    causal = lambda n: n * (n + 1) // 2  # noqa: E731
    if name == "full":
        return length * length
    if name == "window1024":
        w = min(1024, length)
        return causal(w) + (length - w) * w
    if name == "docs1024":
        docs, rest = divmod(length, 1024)
        return docs * causal(1024) + causal(rest)
    return causal(length)


def case(
    batch, length, heads, kv_heads, head_dim, mask_name="causal", dtype="bfloat16", *, tpu=False
) -> Case:
    """One shape; `tpu`: splash attention's peers instead of tokamax's, errors against `xla`."""
    dt = jnp.dtype(dtype)
    mask = _mask(mask_name, batch, length)

    def make(key):
        k = jax.random.split(key, 3)
        q = jax.random.normal(k[0], (batch, length, heads, head_dim), jnp.float32).astype(dt)
        kk = jax.random.normal(k[1], (batch, length, kv_heads, head_dim), jnp.float32).astype(dt)
        v = jax.random.normal(k[2], (batch, length, kv_heads, head_dim), jnp.float32).astype(dt)
        return q, kk, v

    def forward(impl, q, k, v):
        return attention_positional(q, k, v, mask=mask, implementation=impl)

    visible = float(visible_pairs(mask_name, length))

    flops = 4.0 * batch * heads * head_dim * visible
    # the fewest bytes: q, k, v in and o out; backward q, k, v, o, dO in and dq, dk, dv out
    q_side, kv_side = float(batch) * length * heads * head_dim, float(batch) * length * kv_heads * head_dim
    if tpu:
        peers = splash_peers(mask, length)
    else:
        peers = {name: tokamax_peer(impl, mask) for name, impl in TOKAMAX_PEERS.items()}
    return Case(
        op="attention",
        label=f"B={batch} L={length} H={heads}/{kv_heads} D={head_dim} {mask_name} {dt.name}",
        dims={"batch": batch, "length": length, "heads": heads},
        dtype=dt.name,
        make=make,
        forward=forward,
        loss=None,  # the backward pulls a random cotangent back
        grad_argnums=(0, 1, 2),
        flops_forward=flops,
        flops_backward=2.5 * flops,
        bytes_forward=(2 * q_side + 2 * kv_side) * dt.itemsize,
        bytes_backward=(4 * q_side + 4 * kv_side) * dt.itemsize,
        peers=peers,
        reference="xla" if tpu else "reference",
    )


# peer name -> tokamax's `implementation=`
TOKAMAX_PEERS = {"tokamax_mosaic": "mosaic", "tokamax_cudnn": "cudnn"}


def tokamax_mask(mask: masks.Mask, q_len: int | None = None) -> dict[str, Any] | str:
    """The keywords of `tokamax.dot_product_attention` that express `mask` exactly, or why none do.
    With `q_len`, a window no query outreaches (`size >= q_len`) is causal."""
    if isinstance(mask, masks.Full):
        return {}
    if isinstance(mask, masks.Causal) and mask.offset == 0:
        return {"is_causal": True}
    if isinstance(mask, masks.SlidingWindow) and mask.offset == 0:
        if q_len is not None and mask.size >= q_len:
            return {"is_causal": True}
        # tokamax's (before, after) window keeps keys q - before <= k <= q + after; ours
        # q - size < k <= q
        return {"local_window_size": (mask.size - 1, 0)}
    return (
        f"tokamax.dot_product_attention cannot take the mask {mask!r} exactly: it takes is_causal "
        "(offset 0), a local window and dense mask arrays, no segment ids or offsets"
    )


def tokamax_peer(implementation: str, mask: masks.Mask) -> Callable[..., Any] | str:
    """`(q, k, v) -> tokamax.dot_product_attention(q, k, v, ..., implementation=implementation)`
    under `mask`, or why it cannot run (tokamax is imported at the first call: building cases
    does not import it). Differentiable: tokamax's own backward runs under `jax.vjp`."""
    if importlib.util.find_spec("tokamax") is None:
        return "tokamax is not installed"
    keywords = tokamax_mask(mask)
    if isinstance(keywords, str):
        return keywords

    def forward(q, k, v):
        try:
            import tokamax
        except Exception as e:  # noqa: BLE001 - any import failure: the peer is absent
            raise Unsupported(f"tokamax did not import: {type(e).__name__}: {e}") from None
        try:
            return tokamax.dot_product_attention(
                q,
                k,
                v,
                scale=q.shape[-1] ** -0.5,
                implementation=implementation,
                **tokamax_mask(mask, q.shape[1]),
            )
        except NotImplementedError as e:  # tokamax's way of saying a backend cannot take the call
            raise Unsupported(f"tokamax {implementation}: {e}") from None

    return forward


def cases(*, preset=None, tokens=None, dtype=None):
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"attention: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    dtype = dtype or ("float32" if name == "quick" else "bfloat16")
    tpu = name.startswith("tpu")
    return [case(b, tokens or n, h, kvh, d, m, dtype, tpu=tpu) for b, n, h, kvh, d, m in PRESETS[name]]


# splash's block sizes the `splash_best` peer sweeps, "Q/KV" or "Q/KV/KV_COMPUTE": the query
# block, key block and key sub-block of the forward kernel and of both backward kernels (dq and
# dk/dv); `AXKERN_SPLASH_SWEEP` (blank-separated, e.g. "512/512 1024/1024/512") replaces them.
# Sizes that do not divide the length are skipped.
SPLASH_SWEEP = ("512/512", "512/1024", "1024/512", "1024/1024")


def splash_sweep(length: int) -> list[tuple[str, tuple[int, int, int]]]:
    """`(label, (block_q, block_kv, block_kv_compute))` of the sweep that fit `length`; a
    `ValueError` names a malformed entry."""
    out = []
    for text in os.environ.get("AXKERN_SPLASH_SWEEP", "").split() or SPLASH_SWEEP:
        parts = text.split("/")
        if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"splash sweep: expected Q/KV or Q/KV/KV_COMPUTE (positive ints), got {text!r}")
        q, kv, kvc = (int(p) for p in (parts + parts[1:])[:3])
        if kv % kvc:
            raise ValueError(
                f"splash sweep: the key block {kv} is no multiple of its sub-block {kvc} ({text!r})"
            )
        if length % q or length % kv:
            continue
        out.append((f"q{q} kv{kv}" + (f" kvc{kvc}" if kvc != kv else ""), (q, kv, kvc)))
    return out


def splash_mask(mask: masks.Mask) -> tuple[Callable[[tuple[int, int]], Any], masks.Segments | None] | str:
    """`(static, segments)` that express `mask` exactly in splash's terms: `static(shape)` is
    splash's mask of one head for `(q_len, kv_len)`, `segments` the `Segments` it is and-ed with
    (splash's `SegmentIds`) or None; or why splash cannot take `mask`."""
    parts, stack = [], [mask]
    while stack:
        m = stack.pop()
        if type(m) is masks.And:
            stack += [m.b, m.a]
        else:
            parts.append(m)
    segments = [m for m in parts if isinstance(m, masks.Segments)]
    statics = [m for m in parts if not isinstance(m, (masks.Segments, masks.Full))]
    if len(segments) > 1 or not all(isinstance(m, (masks.Causal, masks.SlidingWindow)) for m in statics):
        return (
            f"splash attention cannot take the mask {mask!r} exactly: it takes causal and local "
            "masks, and-ed with one set of segment ids"
        )

    def static(shape):
        from jax.experimental.pallas.ops.tpu import splash_attention as sa

        def one(m):
            if isinstance(m, masks.Causal):
                return sa.CausalMask(shape, offset=m.offset)
            # ours: offset - size < k - q <= offset; splash's: -left <= k - (q + offset) <= right
            return sa.LocalMask(shape, window_size=(m.size - 1, 0), offset=m.offset)

        return functools.reduce(operator.and_, map(one, statics)) if statics else sa.FullMask(shape)

    return static, (segments[0] if segments else None)


def splash_peer(mask: masks.Mask, blocks: tuple[int, int, int] | None = None) -> Callable[..., Any] | str:
    """`(q, k, v) -> splash attention of q, k, v` under `mask` (the case's layout in and out),
    with `blocks` `(block_q, block_kv, block_kv_compute)` for its forward and backward kernels
    (None: splash's defaults), or why it cannot take `mask`. The kernel is built at the first
    trace of each shape; off a TPU it runs only in interpret mode."""
    found = splash_mask(mask)
    if isinstance(found, str):
        return found
    static, segments = found
    kernels: dict[tuple, Any] = {}

    def kernel(q_len, kv_len, heads, interpret):
        from jax.experimental.pallas.ops.tpu import splash_attention as sa

        key = (q_len, kv_len, heads, interpret)
        if key not in kernels:
            sizes = None
            if blocks is not None:
                q, kv, kvc = blocks
                sizes = sa.BlockSizes(
                    block_q=q, block_kv=kv, block_kv_compute=kvc,
                    block_q_dkv=q, block_kv_dkv=kv, block_kv_dkv_compute=kvc,
                    block_q_dq=q, block_kv_dq=kv,
                )  # fmt: skip
            head = static((q_len, kv_len))
            with jax.ensure_compile_time_eval():  # its tables concrete: it outlives this trace
                kernels[key] = sa.make_splash_mha(
                    sa.MultiHeadMask([head] * heads),
                    block_sizes=sizes,
                    head_shards=1,
                    q_seq_shards=1,
                    interpret=interpret,
                )
        return kernels[key]

    def forward(q, k, v):
        from jax.experimental.pallas.ops.tpu import splash_attention as sa

        interpret = bool(config.current().interpret)
        if backend.platform() != "tpu" and not interpret:
            raise Unsupported(
                f"splash attention is a Mosaic TPU kernel: it runs on a TPU, not {backend.platform()} "
                "(or in interpret mode: axkern.use(interpret=True))"
            )
        run = jax.vmap(kernel(q.shape[1], k.shape[1], q.shape[2], interpret))
        scaled = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
        qt, kt, vt = (jnp.swapaxes(a, 1, 2) for a in (scaled, k, v))
        if segments is None:
            out = run(qt, kt, vt)
        else:
            out = run(qt, kt, vt, sa.SegmentIds(q=segments.q_ids, kv=segments.kv_ids))
        return jnp.swapaxes(out, 1, 2)

    return forward


def splash_peers(mask: masks.Mask, length: int) -> dict[str, Callable[..., Any] | str]:
    """`splash` (its default block sizes) and `splash_best` (the fastest of `splash_sweep`'s,
    as `variants`: the bench times each and reports the fastest), or why each cannot run."""
    default = splash_peer(mask)
    if isinstance(default, str):
        return {"splash": default, "splash_best": default}
    sweep = splash_sweep(length)
    if not sweep:
        return {
            "splash": default,
            "splash_best": f"no block sizes of the splash sweep divide the length {length}",
        }
    variants = {label: splash_peer(mask, blocks) for label, blocks in sweep}

    def best(q, k, v):  # called alone, the sweep's first sizes
        return variants[sweep[0][0]](q, k, v)

    best.variants = variants
    return {"splash": default, "splash_best": best}
