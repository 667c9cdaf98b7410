"""Attention masks as small composable objects: which keys each query may attend to.

```python
from axkern import masks
mask = masks.Causal() & masks.Segments(doc_ids, doc_ids)    # packed documents, causal
mask = masks.SlidingWindow(1024) | masks.PrefixLM(prefix_lengths)
```

A mask answers two questions:

- `visible(q_idx, k_idx)`: for query positions `q_idx [Q]` and key positions `k_idx [K]`
  (integer arrays, traced or not), a boolean `[B or 1, Q, K]`: may query `i` see key `j`.
  Positions count from 0 in the query and in the key sequence; a batch-free mask returns a
  leading axis of 1.
- `block_kinds(q_len, kv_len, block_q, block_kv)`: for each `(q block, kv block)` tile,
  `EMPTY` (nothing visible: a kernel skips it), `FULL` (everything visible: no masking work)
  or `PARTIAL`, as an int `[B or 1, q blocks, kv blocks]` array. Positions past the end of
  a sequence count as not visible.

Masks combine with `&` (both allow) and `|` (either allows). `Segments`, `PrefixLM` and `Dense`
hold arrays (they may be traced); the others are static.

Offsets and window sizes are static ints of any size: the masks compare them with `k - q`
(clamped to the positions' integer type, which is exact), never add them to a position. Host
(numpy, Python) arrays of wider integers than JAX keeps (64-bit ones without x64) keep their
meaning: prefix lengths are clipped to int32's range, segment ids that do not fit are
renumbered (their ranks among both arrays' ids: every equality and order kept).
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
import numpy as np

from axkern.core import compat

__all__ = [
    "Mask",
    "Full",
    "Causal",
    "SlidingWindow",
    "Segments",
    "PrefixLM",
    "Dense",
    "And",
    "Or",
    "EMPTY",
    "PARTIAL",
    "FULL",
    "leaf_roles",
    "leaves",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


class Mask:
    """Base class: subclasses define `visible(q_idx, k_idx) -> bool [B or 1, Q, K]`.

    A mask that holds arrays lists, in `ROLES`, the named-axis roles of each of its arrays
    (in `tree_flatten` order): `"batch"` (the batch axes), `"QPos"`, `"KPos"`.
    """

    ROLES: tuple[tuple[str, ...], ...] = ()

    def visible(self, q_idx, k_idx):
        raise NotImplementedError

    def batch_size(self) -> int | None:
        """The batch size the mask's arrays fix, or None for a batch-free mask."""
        return None

    def check(self, q_len: int, kv_len: int, batch: int) -> None:
        """Raise `ValueError` naming the problem when the mask does not fit these shapes."""
        b = self.batch_size()
        if b is not None and b != batch:
            raise ValueError(f"{self!r}: the mask's batch size {b} differs from the inputs' {batch}")

    def visible_2d(self, q_idx, k_idx):
        """`visible` without the batch axis, `[Q, K]`, in 2-D operations only (inside kernels).
        Static masks only."""
        raise NotImplementedError(f"{type(self).__name__} holds arrays: it has no batch-free form")

    def dense(self, q_len: int, kv_len: int):
        """The whole `[B or 1, q_len, kv_len]` boolean mask (tests, the reference)."""
        return self.visible(jnp.arange(q_len), jnp.arange(kv_len))

    def block_kinds(self, q_len: int, kv_len: int, block_q: int, block_kv: int):
        """`EMPTY` / `PARTIAL` / `FULL` per tile, `[B or 1, cdiv(q_len, block_q), cdiv(kv_len, block_kv)]`."""
        nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
        qi, kj = jnp.arange(nq * block_q), jnp.arange(nk * block_kv)
        vis = self.visible(qi, kj) & (qi < q_len)[:, None] & (kj < kv_len)[None, :]
        tiles = vis.reshape(vis.shape[0], nq, block_q, nk, block_kv)
        any_, all_ = tiles.any((2, 4)), tiles.all((2, 4))
        return jnp.where(all_, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(jnp.int32)

    def __and__(self, other: Mask) -> Mask:
        return And(self, other)

    def __or__(self, other: Mask) -> Mask:
        return Or(self, other)


def _grid(q_idx, k_idx):
    return jnp.asarray(q_idx)[None, :, None], jnp.asarray(k_idx)[None, None, :]


def _integer(owner: str, name: str, value) -> int:
    """`value` as a Python int, or a `ValueError` naming the argument."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{owner}: {name} must be a static int, got {value!r}") from None


def _distance(q, k):
    """`k - q` of non-negative positions (broadcast), exact in their signed integer type. The
    static masks compare it with their bounds rather than adding an offset to a position, so no
    offset or window size overflows the positions' type."""
    return jnp.asarray(k) - jnp.asarray(q)


def _bound(value: int, distance) -> int:
    """`value` clamped to what `distance`'s integer type holds: exact in a comparison with the
    distance of two non-negative positions, which lies strictly inside that range (a bound past
    its top is above every distance, one past its bottom below every distance)."""
    info = jnp.iinfo(distance.dtype)
    return max(int(info.min), min(int(info.max), value))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Full(Mask):
    """Every key visible to every query."""

    def visible(self, q_idx, k_idx):
        return self.visible_2d(q_idx, k_idx)[None]

    def visible_2d(self, q_idx, k_idx):
        return jnp.full((jnp.shape(q_idx)[0], jnp.shape(k_idx)[0]), True)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Causal(Mask):
    """Key `j` visible to query `i` when `j <= i + offset`. `offset=0` aligns the first query
    with the first key (as `jax.nn.dot_product_attention(is_causal=True)`); with a cache of
    `kv_len - q_len` earlier keys, `offset = kv_len - q_len` aligns the last ones. `offset` is a
    static int of any size (one past every key's distance sees all keys, or none)."""

    offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "offset", _integer("Causal", "offset", self.offset))

    def visible(self, q_idx, k_idx):
        return self.visible_2d(q_idx, k_idx)[None]

    def visible_2d(self, q_idx, k_idx):
        return self.visible_grid(jnp.asarray(q_idx)[:, None], jnp.asarray(k_idx)[None, :])

    def visible_grid(self, q, k):
        """`visible` elementwise on index arrays of one (broadcast) shape, e.g. a kernel's tile
        grids: `k - q <= offset`, exact for any offset (`_bound`)."""
        d = _distance(q, k)
        return d <= _bound(self.offset, d)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SlidingWindow(Mask):
    """Causal within a window: key `j` visible to query `i` when `i - size < j <= i` (with
    `offset` as in `Causal`). A two-sided window of `w` keys either side of the query's own:
    `SlidingWindow(2 * w + 1, offset=w)`. `size` and `offset` are static ints of any size (a
    window longer than the keys is `Causal(offset)`)."""

    size: int
    offset: int = 0

    def __post_init__(self):
        try:
            size = _integer("SlidingWindow", "size", self.size)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"SlidingWindow: size must be a positive int, got {self.size!r}")
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "offset", _integer("SlidingWindow", "offset", self.offset))

    def visible(self, q_idx, k_idx):
        return self.visible_2d(q_idx, k_idx)[None]

    def visible_2d(self, q_idx, k_idx):
        return self.visible_grid(jnp.asarray(q_idx)[:, None], jnp.asarray(k_idx)[None, :])

    def visible_grid(self, q, k):
        """`visible` elementwise on index arrays of one (broadcast) shape, e.g. a kernel's tile
        grids: `offset - size < k - q <= offset`, exact for any offset and size (`_bound`)."""
        d = _distance(q, k)
        return (d <= _bound(self.offset, d)) & (d > _bound(self.offset - self.size, d))


def _is_named(a) -> bool:
    from haliax import NamedArray  # local: masks stay importable without haliax loaded first

    return isinstance(a, NamedArray)


def _kept(a) -> np.dtype | None:
    """The signed integer type JAX keeps a host integer array `a` in (int32 unless x64 is on),
    where that type is narrower than `a`'s or `a` is unsigned of its width (a plain conversion
    would wrap values past its range); else None."""
    if not isinstance(a, np.ndarray) or not np.issubdtype(a.dtype, np.integer):
        return None
    kept, n = np.dtype(jax.dtypes.canonicalize_dtype(np.int64)), a.dtype.itemsize
    return kept if n > kept.itemsize or (n == kept.itemsize and a.dtype.kind == "u") else None


def int32_lengths(a):
    """Integer positions or lengths as int32, values past its range clipped to it: exact in a
    comparison with a position, which int32 holds (the kernels' operands)."""
    a = jnp.asarray(a)
    info = np.iinfo(np.int32)
    if a.dtype.itemsize >= 4 and jnp.issubdtype(a.dtype, jnp.unsignedinteger):
        a = jnp.minimum(a, jnp.asarray(info.max, a.dtype))
    elif a.dtype.itemsize > 4:
        a = jnp.clip(a, int(info.min), int(info.max))
    return a.astype(jnp.int32)


def int32_ids(q_ids, kv_ids):
    """Segment ids as int32 with each pair's equality kept (the kernels' operands, which compare
    ids and their blocks' ranges): a plain conversion where both fit 32 bits (unsigned ones wrap,
    one to one), else each id's rank among all of them (order kept too; a sort of both)."""
    q_ids, kv_ids = jnp.asarray(q_ids), jnp.asarray(kv_ids)
    if q_ids.dtype.itemsize <= 4 and kv_ids.dtype.itemsize <= 4:
        return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    both = jnp.sort(jnp.concatenate([q_ids.ravel(), kv_ids.ravel()]))
    return tuple(jnp.searchsorted(both, a).astype(jnp.int32) for a in (q_ids, kv_ids))


def _host_ids(q_ids, kv_ids):
    """Host (numpy, Python) ids JAX would keep in a narrower type (`_kept`): converted to it
    where their values fit, else replaced by their ranks among both arrays' ids (which keep
    every equality and order). JAX arrays pass as they are (in kernels: `int32_ids`)."""
    host = [a if isinstance(a, jax.Array) or _is_named(a) else np.asarray(a) for a in (q_ids, kv_ids)]
    kept = [_kept(a) for a in host]
    if kept == [None, None]:
        return host
    if any(isinstance(a, jax.core.Tracer) or _is_named(a) for a in host):
        raise ValueError(
            "Segments: ids wider than JAX keeps (64-bit without x64) must come with the other side's "
            "as host or concrete arrays (they are renumbered together)"
        )
    host = [np.asarray(a) for a in host]
    kind = kept[0] if kept[0] is not None else kept[1]
    info = np.iinfo(kind)
    if all(a.size == 0 or (a.min() >= info.min and a.max() <= info.max) for a in host):
        return [a.astype(kind) for a in host]
    flat = [a.ravel() for a in host]
    if np.result_type(*flat).kind == "f":  # uint64 with int64: compared as Python ints
        flat = [a.astype(object) for a in flat]
    ranks = np.unique(np.concatenate(flat), return_inverse=True)[1].astype(kind)
    return [ranks[: host[0].size].reshape(host[0].shape), ranks[host[0].size :].reshape(host[1].shape)]


def _host_lengths(a):
    """Host prefix lengths JAX would keep in a narrower type (`_kept`): clipped to its range
    (exact: every position lies inside it)."""
    a = a if isinstance(a, jax.Array) or _is_named(a) else np.asarray(a)
    if (kept := _kept(a)) is None:
        return a
    top = np.iinfo(kept).max  # an unsigned array's values past it as well as a signed one's
    return (np.minimum(a, np.uint64(top)) if a.dtype.kind == "u" else np.clip(a, -top - 1, top)).astype(kept)


def _ids(name, ids):
    if _is_named(ids):  # resolved against q's and k's axes by axkern.attention
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name}: ids must be integers, got {ids.dtype}")
        return ids
    ids = jnp.asarray(ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"{name}: ids must be an integer [batch, length] array, got {ids.dtype}{list(ids.shape)}"
        )
    return ids


@jax.tree_util.register_pytree_node_class
class Segments(Mask):
    """Packed documents: key `j` visible to query `i` of batch row `b` when
    `q_ids[b, i] == kv_ids[b, j]`. `q_ids [B, Q]`, `kv_ids [B, K]` (integers; may be traced).

    With `axkern.attention` the ids may be `NamedArray`s: `q_ids` over q's batch axes (any
    subset, any order) and its position axis, `kv_ids` over k's batch axes and key position
    axis. Plain arrays lead with the batch axes flattened in q's axis order. Host ids wider than
    JAX keeps whose values do not fit are renumbered together (`q_ids`, `kv_ids` then hold their
    ranks); the kernels compare 64-bit JAX ids (x64) by their ranks too (`int32_ids`).
    """

    ROLES = (("batch", "QPos"), ("batch", "KPos"))

    def __init__(self, q_ids, kv_ids):
        q_ids, kv_ids = _host_ids(q_ids, kv_ids)
        self.q_ids, self.kv_ids = _ids("Segments", q_ids), _ids("Segments", kv_ids)
        if _is_named(self.q_ids) or _is_named(self.kv_ids):
            return
        if self.q_ids.shape[0] != self.kv_ids.shape[0]:
            raise ValueError(
                f"Segments: q_ids has batch {self.q_ids.shape[0]} and kv_ids {self.kv_ids.shape[0]}"
            )

    def __repr__(self):
        return f"Segments(q_ids{list(self.q_ids.shape)}, kv_ids{list(self.kv_ids.shape)})"

    def tree_flatten(self):
        return (self.q_ids, self.kv_ids), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.q_ids, obj.kv_ids = children
        return obj

    def batch_size(self):
        return self.q_ids.shape[0]

    def check(self, q_len, kv_len, batch):
        super().check(q_len, kv_len, batch)
        if self.q_ids.shape[1] != q_len or self.kv_ids.shape[1] != kv_len:
            raise ValueError(
                f"Segments: q_ids is {list(self.q_ids.shape)} and kv_ids {list(self.kv_ids.shape)}, "
                f"but the queries have length {q_len} and the keys {kv_len}"
            )

    def visible(self, q_idx, k_idx):
        qi = jnp.clip(jnp.asarray(q_idx), 0, self.q_ids.shape[1] - 1)
        kj = jnp.clip(jnp.asarray(k_idx), 0, self.kv_ids.shape[1] - 1)
        return self.q_ids[:, qi][:, :, None] == self.kv_ids[:, kj][:, None, :]


@jax.tree_util.register_pytree_node_class
class PrefixLM(Mask):
    """Causal, except that the first `prefix_lengths[b]` keys of batch row `b` are visible to
    every query (bidirectional prefix). `prefix_lengths [B]` (integers; may be traced; host
    lengths past what JAX keeps are clipped to its range, which every position lies inside)."""

    ROLES = (("batch",),)

    def __init__(self, prefix_lengths):
        if _is_named(prefix_lengths):
            if not jnp.issubdtype(prefix_lengths.dtype, jnp.integer):
                raise ValueError(f"PrefixLM: prefix_lengths must be integers, got {prefix_lengths.dtype}")
            self.prefix_lengths = prefix_lengths
            return
        p = jnp.asarray(_host_lengths(prefix_lengths))
        if p.ndim != 1 or not jnp.issubdtype(p.dtype, jnp.integer):
            raise ValueError(
                f"PrefixLM: prefix_lengths must be an integer [batch] array, got {p.dtype}{list(p.shape)}"
            )
        self.prefix_lengths = p

    def __repr__(self):
        return f"PrefixLM(prefix_lengths{list(self.prefix_lengths.shape)})"

    def tree_flatten(self):
        return (self.prefix_lengths,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        (obj.prefix_lengths,) = children
        return obj

    def batch_size(self):
        return self.prefix_lengths.shape[0]

    def visible(self, q_idx, k_idx):
        q, k = _grid(q_idx, k_idx)
        p = self.prefix_lengths
        if jnp.issubdtype(p.dtype, jnp.unsignedinteger) and p.dtype.itemsize >= k.dtype.itemsize:
            p = jnp.minimum(p, jnp.asarray(jnp.iinfo(k.dtype).max, p.dtype)).astype(k.dtype)  # no wrap
        return (k <= q) | (k < p[:, None, None])


@jax.tree_util.register_pytree_node_class
class Dense(Mask):
    """An explicit boolean `[B or 1, Q, K]` mask (`True`: visible), e.g. one built elsewhere. It
    holds the whole array, so no tile is ever skipped: prefer the structured masks."""

    ROLES = (("batch", "QPos", "KPos"),)

    def __init__(self, visible):
        if _is_named(visible):
            if visible.dtype != jnp.bool_:
                raise ValueError(f"Dense: visible must be bool, got {visible.dtype}")
            self.array = visible
            return
        v = jnp.asarray(visible)
        if v.ndim != 3 or v.dtype != jnp.bool_:
            raise ValueError(
                f"Dense: visible must be a bool [batch or 1, q_len, kv_len] array, got {v.dtype}{list(v.shape)}"
            )
        self.array = v

    def __repr__(self):
        return f"Dense(visible{list(self.array.shape)})"

    def tree_flatten(self):
        return (self.array,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        (obj.array,) = children
        return obj

    def batch_size(self):
        return None if self.array.shape[0] == 1 else self.array.shape[0]

    def check(self, q_len, kv_len, batch):
        super().check(q_len, kv_len, batch)
        if self.array.shape[1:] != (q_len, kv_len):
            raise ValueError(f"{self!r}: the queries have length {q_len} and the keys {kv_len}")

    def visible(self, q_idx, k_idx):
        qi = jnp.clip(jnp.asarray(q_idx), 0, self.array.shape[1] - 1)
        kj = jnp.clip(jnp.asarray(k_idx), 0, self.array.shape[2] - 1)
        return self.array[:, qi][:, :, kj]


@jax.tree_util.register_pytree_node_class
class And(Mask):
    """Visible where both masks allow."""

    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def __repr__(self):
        return f"({self.a!r} & {self.b!r})"

    def tree_flatten(self):
        return (self.a, self.b), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def batch_size(self):
        return self.a.batch_size() or self.b.batch_size()

    def check(self, q_len, kv_len, batch):
        self.a.check(q_len, kv_len, batch)
        self.b.check(q_len, kv_len, batch)

    def visible(self, q_idx, k_idx):
        return self.a.visible(q_idx, k_idx) & self.b.visible(q_idx, k_idx)

    def visible_2d(self, q_idx, k_idx):
        return self.a.visible_2d(q_idx, k_idx) & self.b.visible_2d(q_idx, k_idx)


@jax.tree_util.register_pytree_node_class
class Or(And):
    """Visible where either mask allows."""

    def __repr__(self):
        return f"({self.a!r} | {self.b!r})"

    def visible(self, q_idx, k_idx):
        return self.a.visible(q_idx, k_idx) | self.b.visible(q_idx, k_idx)

    def visible_2d(self, q_idx, k_idx):
        return self.a.visible_2d(q_idx, k_idx) | self.b.visible_2d(q_idx, k_idx)


def leaves(mask: Mask) -> list[Mask]:
    """The masks an `&` / `|` tree combines, left to right (a mask that is no `&` or `|`: itself)."""
    if isinstance(mask, And):  # and Or
        return leaves(mask.a) + leaves(mask.b)
    return [mask]


def leaf_roles(mask: Mask) -> list[tuple[str, ...]]:
    """The roles of each array a mask holds, in `jax.tree_util.tree_leaves` order."""
    if isinstance(mask, And):
        return leaf_roles(mask.a) + leaf_roles(mask.b)
    return list(mask.ROLES)


def is_static(mask: Mask) -> bool:
    """Whether the mask holds no arrays (its block kinds can be computed before tracing)."""
    return not jax.tree_util.tree_leaves(mask)


def static_block_kinds(mask: Mask, q_len: int, kv_len: int, block_q: int, block_kv: int) -> np.ndarray | None:
    """`block_kinds` as a numpy array when the mask is static, else None."""
    if not is_static(mask):
        return None
    # constants, even while tracing a jitted function, and outside the caller's mesh
    # (`compat.no_mesh`: under `shard_map` with a static mask they failed)
    with jax.ensure_compile_time_eval(), compat.no_mesh():
        return np.asarray(mask.block_kinds(q_len, kv_len, block_q, block_kv))
