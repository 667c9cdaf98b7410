"""`B` and `C` as the kernels take them: a 16-bit array as it is; a float32 one (Mamba-3's
rotated `k`, `q`) as two bf16 halves (`operand_parts`, `SplitOperand`); or a rotation the kernels
form themselves (`RotatedOperand`).

**A rotation**: Mamba-3's rotated, biased `k` and `q`, `rotate(u + bias, Θ)`, from the unrotated
values per group (`[b, g, L, N]`, 16-bit), the biases per head (`[h, N]`) and the angles per head
(`[b, h, L, A]`), rather than from the rotated values per head in float32 (`[b, h, L, N]`, `h / g`
times the bytes, formed and read again).

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
the Mosaic GPU layouts and their emulation): one Pallas Triton kernel (`rotation_kernel.py`) for
both operands; XLA's form of the same (`value()`, then `operand_parts`) is what the stages and
`rotation="xla"` take.

**The backward** (`cotangent`): the rotated value's cotangent `g` (per head, float32) turned back by
`-Θ` (`back`), summed over each group's heads (`du`), over batch and positions (`dbias`), and
`dΘ_i = back_{i+N/2} w_i - back_i w_{i+N/2}` against the unrotated pair, as Mamba-3's own
rotation backward (`mamba3/common`). Where the layout's backward kernels turn (the Mosaic
GPU layouts', `layout.MosaicLayout.turns_back`), the halves carry the angles (`SplitOperand.theta`)
and the kernels return `back` itself (`angles.turned_back`): XLA only sums.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from .rotation_kernel import padded_angles, parts_kernel_reason, rotated_parts

__all__ = [
    "operand_parts",
    "SplitOperand",
    "RotatedOperand",
    "finite_or_zero",
    "rotate_halves",
    "halves_to_pairs",
    "pairs_to_halves",
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
        return padded_angles(self.theta, self.u.shape[-1] // 2)

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
        return padded_angles(self.theta, -(-self.theta.shape[-1] // 32) * 32)

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
            # this, and keeps them: `[b, h, L, N/2]` float32 each; docs/ops/mamba3.md weighs
            # computing them apart)
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
    (`layout.MosaicLayout.turns_back`)."""

    hi: jax.Array
    lo: jax.Array
    theta: jax.Array | None = None

    @property
    def shape(self) -> tuple:
        return self.hi.shape

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)


def operand_parts(a) -> tuple:
    """`B` or `C` (`[b, g, L, N]`) as the kernels take it, a tuple of bf16 arrays of its shape: a
    16-bit array as its one part, a float32 one (Mamba-3's rotated `k`, `q`) as two, `hi` (`a`
    rounded to bf16) and `lo` (`a - hi` rounded to bf16), so that `hi + lo` is within `2^-16 |a|`
    of `a` (two arrays, not one stacked: XLA forms both in one pass over `a`, where a
    stack's concatenation computed `a` once for each). `hi` returns to float32 by its bits, not by
    a conversion: XLA's GPU compiler may drop a float32 -> bf16 -> float32 round trip (excess
    precision), which would make `lo` zero. A `RotatedOperand` is rotated first."""
    if isinstance(a, tuple):
        return a
    if isinstance(a, SplitOperand):
        return (a.hi, a.lo)
    if isinstance(a, RotatedOperand):  # formed in XLA here (the rotating forward forms it itself)
        a = a.value()
    if jnp.dtype(a.dtype).itemsize == 2:
        return (a,)
    a = a.astype(jnp.float32)
    hi = a.astype(jnp.bfloat16)
    bits = lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32) << 16
    return hi, (a - lax.bitcast_convert_type(bits, jnp.float32)).astype(jnp.bfloat16)
