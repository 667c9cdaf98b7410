"""Mamba-3's rotated `B`, `C` turned inside the Pallas TPU chunk kernels (`pallas_tpu.TpuLayout`,
`takes_rotations`), from a `mosaic_gpu.operands.RotatedOperand`: the unrotated values per group
`u [b, g, L, N]`, the biases per head `[h, N]` and the angles per head `Θ [b, h, L, A]`, where XLA's
rotation writes per-head float32 `[b, h, L, N]` arrays (640 MiB each at the Mamba-3 2.7B layer),
keeps them for the backward and reads them in every kernel.

**Forward** (`Turned`, what the bodies read as `b_ref[0, 0]`): `rotate_halves(u + bias, Θ)`, the
pairs `(i, i + N/2)` turned by `Θ_i` for `i < A`. `u` enters as `[b, g, N, L]` and `Θ` as `[b, h, A,
L]` (transposed in XLA: `u` per group is small, and `Θ`'s `A` columns on the lanes would take `128 /
A` times their bytes in HBM), so the turn runs on `[N, Q]` tiles, where the pairs are rows: slices
at multiples of 8 sublanes and one concatenation, no lane shuffles; one transpose gives the bodies
their `[Q, N]`. Where `B` and `C` turn by the same angles (`q`, `k`), a kernel reads `Θ` once and
forms `cos`, `sin` once.

**Backward** (`TurnedBack`, what the bodies write through `lay.put_group`): the head's `[Q, N]`
cotangent `g` turned back by `-Θ` (`back`), added into its group's `du` block (heads innermost in
the grid, as the layout's group sums), `Σ_t back` per chunk (`dbias` partials) and `dΘ_i =
back_{i+N/2} w_i - back_i w_{i+N/2}` with `w = u + bias` (`RotatedOperand.cotangent`'s), gathered as
a `TurnedCotangent`.

**Grid** the layout's, `(batch, chunks, heads)` with heads innermost (`arbitrary`): a group's
`u` tile is copied in once for its heads, and its `du` block stays in VMEM while they add into it.

**Cost** per kernel, head and chunk: `2·A·Q` `cos`/`sin` and about `6·N·Q` elementwise FLOPs per
turned operand (`8·N·Q` turning back), against the kernels' `O(Q²·N)` products; bytes: `u` per group
(`1 / rep` of a per-head operand's, in its 16-bit dtype), `Θ` (`A / N` of it in float32) and, turned
back, `du` per group, `dΘ` (`A / N`) and `dbias` (`1 / Q`) in place of a per-head float32 `dB`, `dC`.

**Constraints** (`pallas_tpu.rotation_reason`): chunks of a multiple of 128 positions, a state of a multiple of
16, angles a multiple of 8 and at most `N/2`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["Back", "TurnedBack", "TurnedCotangent", "expand", "group_tiles", "is_rotation"]


def is_rotation(a) -> bool:
    """Whether `a` is a rotation the kernels turn (`mosaic_gpu.operands.RotatedOperand`'s form:
    `u`, `bias`, `theta`), not an array."""
    return all(hasattr(a, name) for name in ("u", "bias", "theta"))


def turn(w, cos, sin):
    """`w` (`[N, Q]`, the pairs `(i, i + N/2)` as rows) turned on its first `A` pairs by the
    angles whose `cos`, `sin` (`[A, Q]`) are given (`sin` negated: turned back); row slices at
    whole sublanes and one concatenation, no lane shuffles."""
    half, a = w.shape[0] // 2, cos.shape[0]
    if not a:
        return w
    first, second = w[:half], w[half:]
    pieces = [first[:a] * cos - second[:a] * sin, first[a:], first[:a] * sin + second[:a] * cos, second[a:]]
    return jnp.concatenate([x for x in pieces if x.shape[0]], axis=0)


class Turned:
    """A kernel's `B` or `C` ref as the bodies read it (`ref[0, 0]`): the rotated `[Q, N]`
    float32 tile `rotate_halves(u + bias, Θ)` from the refs of the group's `uᵀ` (`[N, Q]`), the
    head's bias (`[1, N]`) and the head's `Θᵀ` (`[A, Q]`); `turns` holds `cos`, `sin` of a `Θ`
    ref once formed, shared by the kernel's other operand that turns by the same angles. Once
    read, `w` (`u + bias`, `[N, Q]`), `cos` and `sin` stay for the cotangent's turn back
    (`TurnedBack`)."""

    def __init__(self, u_ref, bias_ref, theta_ref, turns):
        self.refs, self.turns = (u_ref, bias_ref, theta_ref), turns

    def __getitem__(self, index):
        u_ref, bias_ref, theta_ref = self.refs
        if id(theta_ref) not in self.turns:
            theta = theta_ref[0, 0]  # [A, Q]
            self.turns[id(theta_ref)] = (jnp.cos(theta), jnp.sin(theta))
        self.cos, self.sin = self.turns[id(theta_ref)]
        # [N, Q]: the bias a row, turned to a column
        self.w = u_ref[0, 0].astype(jnp.float32) + bias_ref[0].T
        turned = turn(self.w, self.cos, self.sin)
        # non-finite values (and a turn's overflow) as 0, as `operands.finite_or_zero`
        turned = jnp.where(jnp.abs(turned) <= jnp.finfo(jnp.float32).max, turned, 0.0)
        return turned.T  # [Q, N]


class Back:
    """An output of a backward kernel: the cotangent of the rotation `operand` among the call's
    arguments, as `TurnedCotangent`'s three arrays (`TurnedBack` in the kernel)."""

    def __init__(self, operand):
        self.operand = operand


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TurnedCotangent:
    """A rotation's cotangent as the backward kernels leave it (`TpuLayout.chunk_scan_bwd`,
    `chunk_state_bwd`): the rotated value's cotangent turned back by `-Θ` and summed over each
    group's heads (`du`, `[b, g, N, L]`, as `uᵀ` enters), its sums over each chunk's positions
    per head (`dbias`, `[b, c, h, 1, N]`) and `dΘ` (`[b, h, A, L]`), float32."""

    du: jax.Array
    dbias: jax.Array
    dtheta: jax.Array

    def plus_partials(self, other: TurnedCotangent) -> TurnedCotangent:
        """`du` as it is (the kernel added `other`'s), `dbias` and `dΘ` with `other`'s added."""
        return TurnedCotangent(self.du, self.dbias + other.dbias, self.dtheta + other.dtheta)

    def cotangent_of(self, operand):
        """`operand`'s cotangent (`RotatedOperand`'s form: `du`, `dbias`, `dΘ`)."""
        return dataclasses.replace(
            operand,
            u=jnp.swapaxes(self.du, 2, 3).astype(operand.u.dtype),
            bias=self.dbias.sum((0, 1))[:, 0].astype(operand.bias.dtype),
            theta=jnp.swapaxes(self.dtheta, 2, 3).astype(operand.theta.dtype),
        )


class TurnedBack:
    """A backward kernel's `dB` or `dC` ref as the bodies write it (`lay.put_group`): the head's
    `[Q, N]` cotangent turned back by `-Θ` (the `Turned` input's angles), added into its
    group's `du` block (heads innermost: the group's first head writes it, with the base's tile
    where given), its positions' sum into `dbias` and `dΘ_i = back_{i+N/2} w_i - back_i w_{i+N/2}`
    into `dΘ` (as `RotatedOperand.cotangent`)."""

    def __init__(self, du_ref, dbias_ref, dtheta_ref, turned, rep):
        self.refs, self.turned, self.rep = (du_ref, dbias_ref, dtheta_ref), turned, rep

    def put(self, value, base_ref, add):
        """Turn `value` back and write it; `add(ref, tile, base_ref, rep)` adds a tile into its
        group's block (`TpuLayout.add_into_group`)."""
        du_ref, dbias_ref, dtheta_ref = self.refs
        t = self.turned
        back = turn(value.T, t.cos, -t.sin)  # [N, Q]
        half, a = back.shape[0] // 2, t.cos.shape[0]
        if a:
            dtheta_ref[0, 0] = back[half : half + a] * t.w[:a] - back[:a] * t.w[half : half + a]
        dbias_ref[0, 0, 0] = jnp.sum(back, axis=1, keepdims=True).T  # [1, N]
        add(du_ref, back, base_ref, self.rep)


def group_tiles(n: int, q: int, rep: int):
    """The block spec (indexed `(b, h, c)`) of a `[b, g, N, L]` array's `[N, Q]` tile of head
    `h`'s group (`rep` heads a group): `uᵀ` in, `du` out."""
    return pl.BlockSpec((1, 1, n, q), lambda b, h, c: (b, h // rep, 0, c))


def head_tiles(a: int, q: int):
    """The block spec (indexed `(b, h, c)`) of a `[b, h, A, L]` array's `[A, Q]` tile: `Θᵀ` in,
    `dΘ` out."""
    return pl.BlockSpec((1, 1, a, q), lambda b, h, c: (b, h, 0, c))


def expand(q, kernel, in_specs, outs, args):
    """A launch at chunks of `q` positions with its rotations expanded: `(kernel, in_specs, outs,
    args, results)` with each rotation among `args` as the arrays its tiles come from (its specs
    indexed `(b, h, c)`), and `kernel` reading it through a `Turned` ref: `uᵀ` per group, the
    biases as rows, `Θᵀ` per head (once where two rotations share it); each `Back` among `outs`
    as the three outputs of a `TurnedCotangent`, which `kernel` writes through a `TurnedBack` ref
    and `results` (applied to the launch's results) gathers."""
    if not any(is_rotation(a) for a in args):
        return kernel, in_specs, outs, args, lambda r: r
    specs, flat, where, thetas = [], [], [], {}
    for spec, arg in zip(in_specs, args, strict=True):
        if not is_rotation(arg):
            where.append(len(flat))
            specs.append(spec), flat.append(arg)
            continue
        _, groups, _, n = arg.u.shape
        rep, a = arg.bias.shape[0] // groups, arg.theta.shape[-1]
        at = [len(flat), len(flat) + 1]
        specs += [group_tiles(n, q, rep), pl.BlockSpec((1, 1, n), lambda b, h, c: (h, 0, 0))]
        flat += [jnp.swapaxes(arg.u, 2, 3), arg.bias.astype(jnp.float32)[:, None]]
        if id(arg.theta) not in thetas:
            thetas[id(arg.theta)] = len(flat)
            specs.append(head_tiles(a, q))
            flat.append(jnp.swapaxes(arg.theta, 2, 3).astype(jnp.float32))
        where.append((*at, thetas[id(arg.theta)]))
    count = len(flat)
    out_flat, out_where = [], []
    for out in outs:
        if not isinstance(out, Back):
            out_where.append(len(out_flat))
            out_flat.append(out)
            continue
        op = out.operand
        (b, groups, lp, n), (h, a) = op.u.shape, (op.bias.shape[0], op.theta.shape[-1])
        f32 = jnp.float32
        out_where.append((len(out_flat), next(i for i, arg in enumerate(args) if arg is op), h // groups))
        out_flat += [
            (group_tiles(n, q, h // groups), jax.ShapeDtypeStruct((b, groups, n, lp), f32)),
            (
                pl.BlockSpec((1, 1, 1, 1, n), lambda b, h, c: (b, c, h, 0, 0)),
                jax.ShapeDtypeStruct((b, lp // q, h, 1, n), f32),
            ),
            (head_tiles(a, q), jax.ShapeDtypeStruct((b, h, a, lp), f32)),
        ]

    def body(*refs, lay):
        ins, out_refs, turns = refs[:count], refs[count:], {}
        regrouped = [ins[i] if isinstance(i, int) else Turned(*(ins[j] for j in i), turns) for i in where]
        written = [
            out_refs[i]
            if isinstance(i, int)
            else TurnedBack(*out_refs[i[0] : i[0] + 3], regrouped[i[1]], i[2])
            for i in out_where
        ]
        return kernel(*regrouped, *written, lay=lay)

    body.__name__ = getattr(kernel, "func", kernel).__name__  # the launch names its kernel so

    def results(got):
        got = [got] if len(out_flat) == 1 else list(got)
        out = [got[i] if isinstance(i, int) else TurnedCotangent(*got[i[0] : i[0] + 3]) for i in out_where]
        return out[0] if len(outs) == 1 else out

    return body, specs, out_flat, flat, results
