"""`B` or `C` given as a rotation the kernels form themselves: Mamba-3's rotated, biased `k` and
`q`, `rotate(u + bias, Θ)`, from the unrotated values per group (`[b, g, L, N]`, 16-bit), the
biases per head (`[h, N]`) and the angles per head (`[b, h, L, A]`), rather than from the rotated
values per head in float32 (`[b, h, L, N]`, `h / g` times the bytes, formed and read again).

**The pairs.** Column `i` turns with column `i + N/2` by `Θ_i` (`i < A`; the other columns pass
through): `(w_i, w_{i+N/2}) -> (w_i cos Θ_i - w_{i+N/2} sin Θ_i, w_i sin Θ_i + w_{i+N/2} cos Θ_i)`,
`w = u + bias`. Mamba-3 SISO pairs neighbouring columns `(2i, 2i+1)`; the caller reorders the
state's columns (evens, then odds) around the whole scan, which a scan does not notice (every
product with `B` or `C` sums over the state, and the states keep the order).

**In the fused forward kernel** (`forward.py`, `state / 2` a multiple of 64): TMA copies each
chunk's `u` rows of `q` and `k` and the head's `Θ` rows (padded with zero angles to `N/2`
columns) into shared memory; the warpgroup loads the two column halves of each, adds the bias,
turns them (`cos`, `sin` on the chip's approximate units, absolute error about `2^-21`), sets
non-finite results to 0 (as the caller's `scrubbed` does) and stores each rotated value as its
two bf16 halves (`operand_parts`) in the tiles its products read. That is the forward nothing
differentiates; a differentiated one forms the halves once (`parts`, `parts_with`), runs the
kernels on them and keeps them for the backward's kernels, which take them as they are.

**The differentiated forward's halves** (`parts_with(kernel=True)`, where the layout asks for it:
the Mosaic GPU layouts and their emulation): one Pallas Triton kernel (`rotated_parts`) reads
`q`'s and `k`'s `u` per group, their biases and the angles they share and writes the two bf16
halves of each per head: per head and position `4 N` bytes of halves written for each operand
and `4 T` bytes of angles read for both (`T = turned_columns(A, N/2)`, the angles' columns
widened to a power of two; the pairs past them pass through), the group's `u` and the biases
from the cache. XLA's form of the same (`value()`, then `operand_parts`, which the stages and
`rotation="xla"` take) keeps `cos Θ`, `sin Θ` (`[b, h, L, N/2]` float32 each) and the rotated
values in float32 in memory between its passes: on the H200, both operands at the 2.7B layer,
1.77 ms against the kernel's 0.57 in one run (docs/ops/mamba3.md).

**The backward** (`cotangent`): the rotated value's cotangent `g` (per head, float32) turned back by
`-Θ` (`back`), summed over each group's heads (`du`), over batch and positions (`dbias`), and
`dΘ_i = back_{i+N/2} w_i - back_i w_{i+N/2}` against the unrotated pair, as Mamba-3's own
rotation backward (`mamba3/common`). Where the layout's backward kernels turn (the Mosaic
GPU layouts', `kernels.Layout.turns_back`), the halves carry the angles (`SplitOperand.theta`)
and the kernels return `back` itself (`angles._turned_back`): XLA only sums.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = [
    "RotatedOperand",
    "SplitOperand",
    "halves_to_pairs",
    "pairs_to_halves",
    "parts_kernel_reason",
    "rotate_halves",
    "rotated_parts",
]

_MAX = float(jnp.finfo(jnp.float32).max)


def pairs_to_halves(a):
    """`a [.., N]` with its neighbouring pairs `(2i, 2i+1)` moved to `(i, i + N/2)`."""
    n = a.shape[-1]
    return jnp.swapaxes(a.reshape(*a.shape[:-1], n // 2, 2), -1, -2).reshape(a.shape)


def halves_to_pairs(a):
    """`pairs_to_halves` undone."""
    n = a.shape[-1]
    return jnp.swapaxes(a.reshape(*a.shape[:-1], 2, n // 2), -1, -2).reshape(a.shape)


def rotate_halves(w, cos, sin):
    """`w [.., N]` (float32) turned on the pairs `(i, i + N/2)` by the angles whose `cos`, `sin`
    (`[.., N/2]`, 1 and 0 for the columns that pass through) are given; non-finite results as 0.
    One elementwise expression over `w` viewed as `[.., 2, N/2]` (each element's partner is the
    other row of its column): no slices or concatenation for XLA to materialise."""
    x = w.reshape(*w.shape[:-1], 2, w.shape[-1] // 2)
    sign = jnp.array([-1, 1], w.dtype)[:, None]  # the pair's first element takes -sin, the second +sin
    out = (x * cos[..., None, :] + jnp.flip(x, -2) * (sin[..., None, :] * sign)).reshape(w.shape)
    return finite_or_zero(out)


def finite_or_zero(a):
    """`a` with its non-finite values (and, from a rotation, overflows) as 0: the rule the
    rotation and its backward keep in XLA and in the kernels alike."""
    return jnp.where(jnp.abs(a) <= _MAX, a, 0.0)


def _padded_angles(theta, n2):
    return jnp.pad(theta, [(0, 0)] * (theta.ndim - 1) + [(0, n2 - theta.shape[-1])])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RotatedOperand:
    """`B` or `C` (`[b, h, L, N]`, float32) as `rotate_halves(u + bias, Θ)`: `u [b, g, L, N]`
    16-bit (its group's value for each head), `bias [h, N]` float32, `theta [b, h, L, A]`
    float32 (`A <= N/2`). A pytree: padding, residuals and cotangents keep this form (a
    cotangent's leaves are `du`, `dbias`, `dΘ`). `same_angles`: `theta` is also the other
    operand's of its scan (Mamba-3's `q` and `k` turn by the same `Θ`), so `parts_with` forms
    both operands' halves in one kernel, `cos` and `sin` once."""

    u: jax.Array
    bias: jax.Array
    theta: jax.Array
    same_angles: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def shape(self) -> tuple:
        """The rotated value's shape, per head: `(b, h, L, N)`."""
        b, _, length, n = self.u.shape
        return (b, self.bias.shape[0], length, n)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    def padded(self, pad: int) -> RotatedOperand:
        """`pad` more positions (zero `u`, zero angles)."""
        if not pad:
            return self
        rows = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, pad), (0, 0)])  # noqa: E731
        return dataclasses.replace(self, u=rows(self.u), theta=rows(self.theta))

    def angles(self):
        """`Θ` padded with zero angles to `N/2` columns (the kernel's tiles), in XLA (the pad
        fuses into the pass that cleans `Θ`): in the kernel a TMA copy fills a whole contiguous
        tile, not a column slice of a wider one, and Mosaic GPU (jax 0.10-0.11, lane semantics)
        neither slices a 64-column 16-bit tile at 32 columns nor concatenates register arrays,
        so the turn takes `cos`, `sin` as wide as a column half."""
        return _padded_angles(self.theta, self.u.shape[-1] // 2)

    def value(self):
        """The rotated value, `[b, h, L, N]` float32."""
        cos, sin = self._turns()
        return rotate_halves(_biased(self.u, self.bias), cos, sin)

    def _turns(self):
        a = self.angles()
        return jnp.cos(a), jnp.sin(a)

    def parts(self, angles: bool = False, kernel: bool = False, interpret: bool = False) -> SplitOperand:
        """The rotated value as the kernels' two bf16 halves (`operand_parts`): in XLA, or with
        `kernel` by `rotated_parts` where it takes the sizes (`parts_kernel_reason`; in interpret
        mode with `interpret`); `angles`: with `Θ` (its columns padded with zero angles to a
        multiple of 32: the kernels turn whole float32 tiles), for backward kernels that return
        the cotangent turned back (`SplitOperand.theta`)."""
        from .kernels import operand_parts  # (kernels.py imports this module)

        theta = self._backward_angles() if angles else None
        if kernel and parts_kernel_reason(self) is None:
            return SplitOperand(*rotated_parts(self, interpret=interpret), theta)
        return SplitOperand(*operand_parts(self.value()), theta)

    def parts_with(self, other, angles: bool = False, kernel: bool = False, interpret: bool = False) -> tuple:
        """`(self.parts(...), other.parts(...))` (`other` as it is where it has no `parts`): with
        `kernel`, where both turn by the same angles (`same_angles`), by one `rotated_parts`
        call for both, which reads the angles and forms their `cos`, `sin` once."""
        pair = isinstance(other, RotatedOperand) and self.same_angles and other.same_angles
        if kernel and pair and parts_kernel_reason(self, other) is None:
            theta = self._backward_angles() if angles else None
            hb, lb, hc, lc = rotated_parts(self, other, interpret=interpret)
            return SplitOperand(hb, lb, theta), SplitOperand(hc, lc, theta)
        formed = lambda o: o.parts(angles, kernel, interpret) if hasattr(o, "parts") else o  # noqa: E731
        return formed(self), formed(other)

    def _backward_angles(self):
        """`Θ` with its columns padded with zero angles to a multiple of 32 (`SplitOperand.theta`)."""
        return _padded_angles(self.theta, -(-self.theta.shape[-1] // 32) * 32)

    def cotangent(self, g, turned: bool = False) -> RotatedOperand:
        """This operand's cotangent (`du`, `dbias`, `dΘ`) from the rotated value's `g` (per head,
        float32): `g` turned back by `-Θ` (the transpose of the turn: `back`; `turned`: `g` is
        `back` already, as backward kernels given the angles return it), summed over each
        group's heads and over batch and positions, and `dΘ_i = back_{i+N/2} w_i - back_i w_{i+N/2}`
        against the unrotated pair `w`. A rotated value set to 0 (non-finite) passes its
        cotangent on as a finite one would: the caller's guard puts NaN where it belongs."""
        b, groups, length, n = self.u.shape
        h, a = self.bias.shape[0], self.theta.shape[-1]
        if turned:
            back = g.astype(jnp.float32)
        else:
            # the forward's `cos Θ`, `sin Θ` (XLA forms them once, for the forward's halves and
            # this, and keeps them: `[b, h, L, N/2]` float32 each; computed apart, behind barriers,
            # they took less memory and more time: benchmarks/mamba3_rotation_forms.py)
            cos, sin = self._turns()
            back = rotate_halves(g.astype(jnp.float32), cos, -sin)
        du = back.reshape(b, groups, h // groups, length, n).sum(2)
        w = _biased(self.u, self.bias).reshape(b, h, length, 2, n // 2)
        bv = back.reshape(b, h, length, 2, n // 2)
        d_theta = (bv[..., 1, :] * w[..., 0, :] - bv[..., 0, :] * w[..., 1, :])[..., :a]
        return dataclasses.replace(
            self,
            u=du.astype(self.u.dtype),
            bias=back.sum((0, 2)).astype(self.bias.dtype),
            theta=d_theta.astype(self.theta.dtype),
        )


# a `rotated_parts` program: positions, and Triton warps
PARTS_ROWS, PARTS_WARPS = 32, 4


def turned_columns(a: int, half: int) -> int:
    """The columns of each half `rotated_parts` turns: `A` widened (with zero angles) to a power
    of two whose rest of the half is 0 or a power of two too (Triton's blocks are powers of two),
    so the pass-through columns are no angles' work. `half` a power of two, `A <= half`."""
    if not 0 <= a <= half or half & (half - 1):
        raise ValueError(f"{a} angles do not fit a half of {half} columns (a power of two)")
    turned = 1 << max(a - 1, 0).bit_length()
    while (half - turned) & (half - turned - 1):
        turned *= 2
    return turned


def parts_kernel_reason(*ops: RotatedOperand, rows: int | None = None) -> str | None:
    """Why `rotated_parts` cannot form the halves of `ops` (one operand, or two turned by the same
    angles), or None: Triton's blocks are powers of two (`N/2` columns a half), its rows whole
    blocks of `rows` positions, `u` 16-bit."""
    rows = rows or PARTS_ROWS
    op = ops[0]
    b, g, length, n = op.u.shape
    h, a, half = op.bias.shape[0], op.theta.shape[-1], n // 2
    if any(o.u.shape != op.u.shape or o.bias.shape != op.bias.shape for o in ops):
        return "the operands differ in shape"
    if any(o.theta.shape != (b, h, length, a) for o in ops):
        return f"the angles are not [batch, heads, length, A] = {(b, h, length, a)} for every operand"
    if h % g:
        return f"{h} heads are not a multiple of {g} groups"
    if a == 0:
        return "no angles: nothing to turn"
    if n % 2 or half & (half - 1) or half < 16:
        return f"state {n}: the kernel turns column halves of a power of two, at least 16"
    if a > half:
        return f"{a} angles for a state of {n}: at most {half}"
    if length % rows:
        return f"length {length} is not a multiple of {rows}"
    if jnp.dtype(op.u.dtype).itemsize != 2:
        return f"u is {op.u.dtype}, not 16-bit"
    return None


def _parts_kernel(*refs, count):
    """One (batch, head, rows) block of `count` operands turned by the same angles: `w = u + bias`
    turned on the pairs `(i, i + N/2)` by `Θ` (`[rows, T]`, `T = turned_columns`), the other
    columns as they are, non-finite results as 0, each value stored as `hi` (rounded to bf16)
    and `lo` (what that lost, rounded); `cos`, `sin` once for all the operands."""
    us, biases, theta_ref, outs = (
        refs[:count],
        refs[count : 2 * count],
        refs[2 * count],
        refs[2 * count + 1 :],
    )
    half, turned = us[0].shape[-1] // 2, theta_ref.shape[-1]
    f32 = jnp.float32
    theta = theta_ref[...]
    cos, sin = jnp.cos(theta), jnp.sin(theta)

    def store(hi_ref, lo_ref, cols, value):
        value = jnp.where(jnp.abs(value) <= _MAX, value, 0.0)
        hi = value.astype(jnp.bfloat16)
        # `hi` back to float32 by its bits (`operand_parts`: a compiler may drop the round trip)
        back = lax.bitcast_convert_type(
            lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32) << 16, f32
        )
        hi_ref[:, cols] = hi
        lo_ref[:, cols] = (value - back).astype(jnp.bfloat16)

    for u_ref, bias_ref, hi_ref, lo_ref in zip(us, biases, outs[::2], outs[1::2], strict=True):

        def w(start, width, u_ref=u_ref, bias_ref=bias_ref):
            cols = pl.ds(start, width)
            return cols, u_ref[:, cols].astype(f32) + bias_ref[cols][None, :]

        (c0, w0), (c1, w1) = w(0, turned), w(half, turned)
        store(hi_ref, lo_ref, c0, w0 * cos - w1 * sin)
        store(hi_ref, lo_ref, c1, w0 * sin + w1 * cos)
        if turned < half:  # the columns no angle turns: `w · 1 + partner · 0`, as XLA's turn
            (c2, w2), (c3, w3) = w(turned, half - turned), w(half + turned, half - turned)
            store(hi_ref, lo_ref, c2, w2 + w3 * 0.0)  # (NaN, then 0, where the partner is not finite)
            store(hi_ref, lo_ref, c3, w3 + w2 * 0.0)


def rotated_parts(*ops: RotatedOperand, interpret: bool = False, rows=None, warps=None, stages=1) -> tuple:
    """`operand_parts(op.value())` of each of `ops` (one, or two turned by the same angles:
    Mamba-3's `q` and `k`), `(hi, lo)` per operand in one tuple, by one Pallas Triton kernel:
    grid (batch, head, `L / rows`), each program reading its group's `[rows, N]` of each `u`, the
    head's biases and `[rows, T]` angles (`T = turned_columns(A, N/2)`, `A` widened with zero
    angles in XLA where it is not such a power of two) and writing `[rows, N]` of each `hi`
    and `lo` (bf16, `[b, h, L, N]`). Memory bound: per head and position 4 bytes a rotated value
    written and `4 T` bytes of angles read for all the operands (`u`, per group, is read `h / g`
    times from the cache); `cos`, `sin` of each angle once. `rows`, `warps`: the programs' tiles
    (`PARTS_ROWS`, `PARTS_WARPS` unless given), `stages` Triton's pipeline stages."""
    rows, warps = rows or PARTS_ROWS, warps or PARTS_WARPS
    reason = parts_kernel_reason(*ops, rows=rows)
    if reason:
        raise ValueError(f"rotated_parts cannot form these halves: {reason}")
    op = ops[0]
    b, g, length, n = op.u.shape
    h = op.bias.shape[0]
    rep, count = h // g, len(ops)
    turned = turned_columns(op.theta.shape[-1], n // 2)
    theta = _padded_angles(op.theta.astype(jnp.float32), turned)
    u_spec = pl.BlockSpec((None, None, rows, n), lambda i, j, c: (i, j // rep, c, 0))
    out = pl.BlockSpec((None, None, rows, n), lambda i, j, c: (i, j, c, 0))
    shape = jax.ShapeDtypeStruct((b, h, length, n), jnp.bfloat16)
    return tuple(
        pl.pallas_call(
            functools.partial(_parts_kernel, count=count),
            name="axkern_ssd_rotated_parts",
            grid=(b, h, length // rows),
            in_specs=[u_spec] * count
            + [pl.BlockSpec((None, n), lambda i, j, c: (j, 0))] * count
            + [pl.BlockSpec((None, None, rows, turned), lambda i, j, c: (i, j, c, 0))],
            out_specs=[out] * (2 * count),
            out_shape=[shape] * (2 * count),
            interpret=interpret,
            compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        )(*(o.u for o in ops), *(o.bias.astype(jnp.float32) for o in ops), theta)
    )


def _biased(u, bias):
    """`u + bias` per head, float32: `u [b, g, L, N]`, `bias [h, N]` -> `[b, h, L, N]`."""
    rep = bias.shape[0] // u.shape[1]
    return jnp.repeat(u.astype(jnp.float32), rep, axis=1) + bias[:, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitOperand:
    """A float32 `B` or `C` held as its two bf16 halves (`operand_parts`: `hi`, `lo`), with the
    value's shape and dtype: what `RotatedOperand.parts` forms once for the differentiated
    forward's kernels and keeps for the backward's. `theta` (`[b, h, L, A']` float32, `A'` the
    angles' count padded to a multiple of 32, at most `N/2`; or None): the angles the value was
    turned by, with which the backward kernels return its cotangent turned back
    (`kernels.Layout.turns_back`)."""

    hi: jax.Array
    lo: jax.Array
    theta: jax.Array | None = None

    @property
    def shape(self) -> tuple:
        return self.hi.shape

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)
