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
"""

from __future__ import annotations

import dataclasses

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
    `kv_len - q_len` earlier keys, `offset = kv_len - q_len` aligns the last ones."""

    offset: int = 0

    def visible(self, q_idx, k_idx):
        return self.visible_2d(q_idx, k_idx)[None]

    def visible_2d(self, q_idx, k_idx):
        q, k = jnp.asarray(q_idx)[:, None], jnp.asarray(k_idx)[None, :]
        return k <= q + self.offset


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SlidingWindow(Mask):
    """Causal within a window: key `j` visible to query `i` when `i - size < j <= i` (with
    `offset` as in `Causal`). A two-sided window of `w` keys either side of the query's own:
    `SlidingWindow(2 * w + 1, offset=w)`."""

    size: int
    offset: int = 0

    def __post_init__(self):
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"SlidingWindow: size must be a positive int, got {self.size!r}")

    def visible(self, q_idx, k_idx):
        return self.visible_2d(q_idx, k_idx)[None]

    def visible_2d(self, q_idx, k_idx):
        q, k = jnp.asarray(q_idx)[:, None] + self.offset, jnp.asarray(k_idx)[None, :]
        return (k <= q) & (k > q - self.size)


def _is_named(a) -> bool:
    from haliax import NamedArray  # local: masks stay importable without haliax loaded first

    return isinstance(a, NamedArray)


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
    axis. Plain arrays lead with the batch axes flattened in q's axis order.
    """

    ROLES = (("batch", "QPos"), ("batch", "KPos"))

    def __init__(self, q_ids, kv_ids):
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
    every query (bidirectional prefix). `prefix_lengths [B]` (integers; may be traced)."""

    ROLES = (("batch",),)

    def __init__(self, prefix_lengths):
        if _is_named(prefix_lengths):
            if not jnp.issubdtype(prefix_lengths.dtype, jnp.integer):
                raise ValueError(f"PrefixLM: prefix_lengths must be integers, got {prefix_lengths.dtype}")
            self.prefix_lengths = prefix_lengths
            return
        p = jnp.asarray(prefix_lengths)
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
        return (k <= q) | (k < self.prefix_lengths[:, None, None])


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
