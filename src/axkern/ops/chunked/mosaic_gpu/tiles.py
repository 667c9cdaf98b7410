"""What every Mosaic GPU kernel of the chunked engine shares around its body: the Mosaic GPU
import, the chunk of one warpgroup's rows, shared-memory tiles and their bytes, how a head's
rows of `x`, `y`, `dy`, `dx` are addressed, and the launch over a grid of (batch, heads,
chunks) or (batch, heads[, column blocks])."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from axkern.core.kernels import swizzled_smem

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means the kernels cannot serve
    plgpu, IMPORT_ERROR = None, e

__all__ = [
    "plgpu",
    "IMPORT_ERROR",
    "CHUNK",
    "STAGE",
    "SMEM",
    "tile_bytes",
    "blocks_per_sm",
    "rows_indexer",
    "dims",
    "rows_type",
    "launch",
    "batch_folding",
]

CHUNK = 64  # positions per chunk: one warpgroup's wgmma rows
# the lean kernels' float32 staging tile, through which their results leave block by block
# (`body.staged`)
STAGE = ((CHUNK, CHUNK), jnp.float32)

SMEM = 227 * 1024  # shared memory a Hopper block may take
_SMEM_EXTRA = 1024 + 2048  # barriers and alignment, rounded up; Mosaic GPU's scratch for cross-warp sums


def tile_bytes(tiles) -> int:
    """Shared memory of tiles `(shape, dtype)` and what Mosaic GPU adds."""
    return sum(math.prod(s) * jnp.dtype(d).itemsize for s, d in tiles) + _SMEM_EXTRA


def blocks_per_sm(tiles) -> int:
    """How many blocks of `tiles` a Hopper SM's 228 KiB of shared memory hold at once (the
    system keeps 1 KiB of it a block)."""
    return 228 * 1024 // (tile_bytes(tiles) + 1024)


def _scratch(tiles) -> list:
    """Tiles `(shape, dtype)` as Mosaic GPU shared memory: swizzled where they are `wgmma` or TMA
    tiles (8 rows or more, in slots or not), plain for the vectors."""
    swizzled = lambda shape: len(shape) >= 2 and shape[-2] % 8 == 0  # noqa: E731
    return [swizzled_smem(shape, d) if swizzled(shape) else plgpu.SMEM(shape, d) for shape, d in tiles]


def rows_indexer(positions_first: bool):
    """A head's rows of a `[b, h, L, d]` array's ref, or (`positions_first`) of a `[b, L, h, d]`
    one (`cols`: those columns only): TMA copies and loads take the strided tile as they take the
    contiguous one."""

    def rows_of(ref, batch, head, rows, cols=None):
        index = (batch, rows, head) if positions_first else (batch, head, rows)
        return ref.at[index if cols is None else (*index, cols)]

    return rows_of


def dims(xt, positions_first: bool):
    """`(b, h, L, P)` of `xt`, `[b, h, L, P]` or (`positions_first`) `[b, L, h, P]`."""
    b, one, two, p = xt.shape
    return (b, two, one, p) if positions_first else (b, one, two, p)


def rows_type(b, h, lp, d, positions_first: bool, dtype=jnp.float32):
    """The type of a `[b, h, L, d]` output, or (`positions_first`) a `[b, L, h, d]` one."""
    return jax.ShapeDtypeStruct((b, lp, h, d) if positions_first else (b, h, lp, d), dtype)


def _params():
    """The kernels' compiler parameters: lane semantics (each array's layout is the one the code
    names: jax 0.11's default, warpgroup semantics, infers them and finds no solution for these
    bodies), fast approximate `exp`."""
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)


def launch(
    kind,
    body,
    out_type,
    xt,
    bt,
    barrier,
    tiles,
    *,
    rows=None,
    into=None,
    over=None,
    positions_first=False,
    columns=1,
    **kw,
):
    """The Mosaic GPU kernel `body` (named `axkern_ssd_mosaic_gpu_<kind>`) with `tiles` (`(shape,
    dtype)`, in the order the body takes them) and `barrier` in shared memory; `rep` heads a
    group of `bt` (`B`'s parts, `operands.operand_parts`). `rows`: a kernel over the grid (batch,
    heads, chunks), the chunks on CUDA's x axis (the others take at most 65535), each block
    `rows` positions (the grid's last axis `L / rows`); `rows` None: a kernel walking one (batch
    row, head)'s chunks, over (batch, heads) (heads on CUDA's x axis: blocks launched together
    share a group's `B` and `C`), or (batch, heads, `columns`) where `columns` > 1 (a block a
    part of the state's columns). `into` (`{output index: input index}`): those outputs are
    their inputs' buffers (zeros the body adds into, or values it reads and writes over; the
    body sees only the output): the outputs are then refs the kernel writes (`pl.run_state`,
    the others starting uninitialised), as `plgpu.kernel` takes no aliases and jax 0.11.2 no
    longer lowers `pallas_call` to Mosaic GPU. The body's `add` (whether it adds `dB`, `dC` into
    a group's rows) is whether there is an `into`, unless `kw` gives it. `over` (`{output index:
    input index}`, inputs before any of `into`'s): those outputs too are their inputs' buffers,
    and the body sees the output's ref in the input's place as well, so that it reads the input
    there and writes the output over it (each block reading its own rows before writing them).
    `positions_first`: `x`, `y`, `dy`, `dx` are `[b, L, h, d]` (`rows_indexer`). `kw`: more of
    the body's arguments. An argument of the launch that is a tuple of arrays (`B`'s, `C`'s
    parts) reaches the body as a tuple of refs."""
    b, h, lp, _ = dims(xt, positions_first)
    g = bt[0].shape[1]
    aliases = (into or {}) | (over or {})
    skip = set(aliases.values())
    scratch = _scratch(tiles)
    if rows is None:
        names = ("batch", "heads", "columns")[: 2 + (columns > 1)]
        grid = (b, h, columns)[: len(names)]
    else:
        names, grid = ("batch", "heads", "chunks"), (b, h, lp // rows)
    name = f"axkern_ssd_mosaic_gpu_{kind}"

    def entry(counts, *refs):
        refs = _regroup(refs, counts)
        ins, outs = refs[: len(counts)], refs[len(counts) :]
        for o, i in sorted((over or {}).items(), key=lambda oi: oi[1]):
            ins.insert(i, outs[o])  # the body reads the input through the output's ref
        pl.run_scoped(
            lambda *scoped: body(
                *ins,
                *outs,
                scoped,
                rep=h // g,
                dtype=xt.dtype,
                rows_of=rows_indexer(positions_first),
                **({"add": bool(into)} | kw),
            ),
            scratch,
            barrier,
        )

    def call(*args):
        inputs = [a for i, a in enumerate(args) if i not in skip]
        counts = tuple(len(a) if isinstance(a, tuple) else 0 for a in inputs)
        flat = [x for a in inputs for x in (a if isinstance(a, tuple) else (a,))]
        if not aliases:
            return plgpu.kernel(
                functools.partial(entry, counts),
                out_type=out_type,
                grid=grid,
                grid_names=names,
                compiler_params=_params(),
                kernel_name=name,
            )(*flat)
        kernel = pl.kernel(  # every output a ref operand: `plgpu.kernel`'s batching wrapper takes no refs
            functools.partial(entry, counts),
            out_type=(),
            mesh=plgpu.Mesh(grid=grid, grid_names=names, kernel_name=name),
            compiler_params=_params(),
            name=name,
        )
        first = tuple(
            args[aliases[o]] if o in aliases else lax.empty(t.shape, t.dtype) for o, t in enumerate(out_type)
        )
        return pl.run_state(lambda refs: kernel(*flat, *refs))(first)

    return call


def _regroup(refs, counts) -> list:
    """The kernel's flat `refs` with the inputs that were tuples (`counts[i]` arrays; 0: one
    array) as tuples again; the refs past the inputs (outputs) as they are."""
    out, i = [], 0
    for c in counts:
        out.append(refs[i] if c == 0 else tuple(refs[i : i + c]))
        i += max(c, 1)
    return out + list(refs[i:])


def batch_folding(fn):
    """`fn`, whose arrays (arguments, their leaves, and results) all lead with the batch axis,
    under `vmap` by folding the mapped axis into the batch axis: a `pl.kernel` over refs (for
    in-place outputs) batches only a mapped axis of size 1, where `plgpu.kernel` batches any."""
    folded = jax.custom_batching.custom_vmap(fn)

    @folded.def_vmap
    def rule(axis_size, in_batched, *args):
        args = jax.tree.map(
            lambda a, bat: a if bat else jnp.broadcast_to(a, (axis_size, *a.shape)),
            list(args),
            list(in_batched),
        )
        outs = folded(*jax.tree.map(lambda a: a.reshape(axis_size * a.shape[1], *a.shape[2:]), args))
        outs = jax.tree.map(lambda o: o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return folded
