"""Plain-JAX pieces every chunked form shares (SSD's and Mamba-3's, plain JAX or kernels):
segment ids, the recurrence over chunk states, the non-finite guard (`guard`, `guard_bits`,
`reaches_bits`, `clean`, `scrubbed`, `poison`; SSD's gradients: `gradient_marks`, `reached`, `nan_where`) and SSD's
layer around a scan (`layer`, `layer_around`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from axkern.core import backend
from axkern.core.compat import vary_like


def uses_segment_sums(dtype) -> bool:
    """Whether inputs of `dtype` sum each segment's decay `sum_{s < r <= t} a_r` on its own
    rather than as `cum_t - cum_s` (float32 and wider: that difference's rounding would put the
    `A` and `dt_bias` gradients outside the oracle rule; 16-bit inputs' own rounding dominates)."""
    return jnp.dtype(dtype).itemsize >= 4


def skip_and_gate(y, x, D, z):
    """`(y + D x) · silu(z)`, each part only when given, in `y`'s (float32) dtype."""
    acc = y.dtype
    if D is not None:
        y = y + x.astype(acc) * (D.astype(acc) if D.ndim == 2 else D.astype(acc)[:, None])
    if z is not None:
        y = y * jax.nn.silu(z.astype(acc))
    return y


def segment_starts(segment_ids, batch, length):
    """Internal segment ids `[b, l]` int32: a running count of the places where the id changes,
    so a reused id starts a new segment (`[0, 0, 1, 1, 0]` is three segments), whatever the
    chunk size; zeros without ids."""
    if segment_ids is None:
        return jnp.zeros((batch, length), jnp.int32)
    ids = segment_ids.astype(jnp.int32)
    change = jnp.concatenate([jnp.zeros_like(ids[:, :1]), (ids[:, 1:] != ids[:, :-1]).astype(jnp.int32)], 1)
    return jnp.cumsum(change, axis=1)


def recurrence(keep, chunk_states, initial_state):
    """The recurrence over chunk states, `state <- keep_c state + chunk_states_c` (`keep [b, h, c]`,
    `chunk_states [b, c, h, P, N]`): the state entering every chunk (`[b, c, h, P, N]`) and the
    final state."""

    def step(s, inputs):
        k, own = inputs
        return k[:, :, None, None] * s + own, s

    final, states_in = lax.scan(
        step, initial_state, (jnp.moveaxis(keep, 2, 0), jnp.moveaxis(chunk_states, 1, 0))
    )
    return jnp.moveaxis(states_in, 0, 1), final


def recurrence_bwd(keep, states_in, d_states_in, d_final):
    """Reverse of `recurrence`: gradients of the chunk states, the carries and the initial state."""

    def step(g, inputs):
        k, s_in, ds_in = inputs  # [b, h], [b, h, P, N], [b, h, P, N]
        d_keep = jnp.sum(g * s_in, axis=(2, 3))
        return k[:, :, None, None] * g + ds_in, (g, d_keep)

    xs = (jnp.moveaxis(keep, 2, 0), jnp.moveaxis(states_in, 1, 0), jnp.moveaxis(d_states_in, 1, 0))
    d_init, (d_own, d_keep) = lax.scan(step, d_final, xs, reverse=True)
    return jnp.moveaxis(d_own, 0, 1), jnp.moveaxis(d_keep, 0, 2), d_init


def reaches(events, seg, axis=1):
    """`events` (bool, time on `axis`) or-ed forward in time inside each segment: True at `t`
    when an event happened at some `s <= t` of `t`'s segment (`seg [b, l]` internal ids)."""
    length = events.shape[axis]
    t = jnp.arange(length).reshape((1, length) + (1,) * (events.ndim - 2))
    last = lax.cummax(jnp.where(events, t, -1), axis=axis)
    new = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    start = lax.cummax(jnp.where(new, jnp.arange(length)[None], 0), axis=1)
    return last >= start.reshape(start.shape + (1,) * (events.ndim - 2))


def reaches_bits(events, seg):
    """`reaches(events, seg)` (time on axis 1) for a large boolean `events` whose last axis is
    packed 8 to a byte (`jnp.packbits`'s order), returned so packed: a running OR of the bytes
    inside each segment (`lax.associative_scan`), with the length as the last axis while it runs:
    a byte for eight values, where `reaches`' running maximum of positions holds an int32 for each.
    On a TPU it is `reaches` packed afterwards, which XLA's TPU compiler kept in less temporary
    memory in the layer's forward (docs/ops/ssd.md, "Temporary memory", has both compiled)."""
    if backend.platform() == "tpu":
        return jnp.packbits(reaches(events, seg), axis=-1)
    new = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    words = jnp.moveaxis(jnp.packbits(events, axis=-1), 1, -1)  # [b, ..., W, l]
    starts = new.reshape(new.shape[:1] + (1,) * (words.ndim - 2) + new.shape[1:])

    def combine(earlier, later):
        (v, s), (w, t) = earlier, later
        return jnp.where(t, w, v | w), s | t

    ored, _ = lax.associative_scan(combine, (words, starts), axis=-1)
    return jnp.moveaxis(ored, -1, 1)


def guard(x, dt, A, B, C, seg, initial_state):
    """The non-finite rule for the chunked forms. Returns the inputs with every non-finite value
    replaced by 0 (`clean`), and where the exact recurrence would be non-finite: `y_bad
    [b, l, h, p]` (before `D` and the gate) and `final_bad [b, h, p, n]`.

    A non-finite `x[s, h, p]` reaches the state's row `p`, a non-finite `dt[s, h]` all of head
    `h`'s state (a non-finite `A[h]` too, from the first position that decays the state), a non-finite `B[s, g, n]` its column `n` for the group's heads, each from
    `s` to the end of `s`'s segment; a non-finite initial state reaches the first segment; a
    non-finite `C[t]` only `y[t]`. The chunked forms compute on the clean inputs and put NaN
    where the recurrence is non-finite: their masked terms (future positions, other segments)
    then never meet a NaN, and a NaN stays where it is in time."""
    y_bits, final_bad = guard_bits(x, dt, A, B, C, seg, initial_state)
    y_bad = jnp.unpackbits(y_bits, axis=-1, count=x.shape[-1]).astype(bool)
    return (clean(x), clean(dt), clean(A), clean(B), clean(C), clean(initial_state)), y_bad, final_bad


def guard_bits(x, dt, A, B, C, seg, initial_state):
    """`guard`'s masks, `y_bad` as bits along its last axis (`jnp.packbits`), formed so
    (`reaches_bits`): `(y_bits [b, l, h, ceil(p / 8)] uint8, final_bad [b, h, p, n])`."""
    rep = x.shape[2] // B.shape[2]
    bad = lambda a: ~jnp.isfinite(a)  # noqa: E731
    per_head = lambda a: jnp.repeat(a, rep, axis=2)  # noqa: E731 - groups -> heads
    # A acts through the decay, which a new segment's first position does not apply
    starts = jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    head = bad(dt) | (bad(A)[None, None] & ~starts[..., None])  # [b, l, h]
    b_any = per_head(bad(B).any(-1))  # [b, l, h]
    first = (seg == 0)[:, :, None, None]
    y_bits = reaches_bits(bad(x) | (head | b_any)[..., None], seg) | jnp.packbits(
        (first & bad(initial_state).any(-1)[:, None]) | per_head(bad(C).any(-1))[..., None], axis=-1
    )
    last = seg == seg[:, -1:]  # [b, l]: the sequence's last segment
    in_last = lambda a: (a & last.reshape(last.shape + (1,) * (a.ndim - 2))).any(1)  # noqa: E731
    final_bad = (
        in_last(bad(x))[..., None]
        | in_last(head)[:, :, None, None]
        | jnp.repeat(in_last(bad(B)), rep, axis=1)[:, :, None, :]
        | (bad(initial_state) & (seg[:, -1] == 0)[:, None, None, None])
    )
    return y_bits, final_bad


def gradient_marks(x, dt, A, B, C, seg, initial_state):
    """Where the gradients are NaN under the non-finite rule, per head: the inputs that reach an
    output the exact recurrence makes non-finite (`guard`'s masks, any over the head's rows).
    Returns `(reach [b, l, h]`: position `s` reaches a non-finite output of its head (at or after
    `s` in its segment, or the final state from the last segment), `at [b, l, h]`: the output at
    the position is non-finite (what `C` there reaches), `a [h]`: `A` reaches a non-finite output
    (one that is not a segment's first, or the final state)). `reached` applies them; a segment
    that no non-finite value reaches is marked nowhere, so its gradients stay numbers."""
    rep = x.shape[2] // B.shape[2]
    bad = lambda a: ~jnp.isfinite(a)  # noqa: E731
    per_head = lambda a: jnp.repeat(a, rep, axis=2)  # noqa: E731 - groups -> heads
    starts = jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    events = bad(x).any(-1) | bad(dt) | (bad(A)[None, None] & ~starts[..., None]) | per_head(bad(B).any(-1))
    init = bad(initial_state).any((-2, -1))  # [b, h]
    at = reaches(events, seg) | ((seg == 0)[..., None] & init[:, None]) | per_head(bad(C).any(-1))
    last = (seg == seg[:, -1:])[..., None]
    final = (events & last).any(1) | (init & (seg[:, -1] == 0)[:, None])  # [b, h]
    ends = jnp.zeros_like(at).at[:, -1].set(final)  # the final state, after the last position
    reach = reaches((at | ends)[:, ::-1], seg[:, ::-1])[:, ::-1]  # backwards in time, in the segment
    a = (at & ~starts[..., None]).any((0, 1)) | final.any(0)
    return reach, at, a


def reached(value, inputs, marks):
    """`value` as it is. Backward: its cotangent passes on, and the gradient of each of `inputs
    = (x, dt, A, B, C, initial_state)` gains NaN where `marks` (`gradient_marks`) say it reaches
    a non-finite output, 0 elsewhere. With `nan_where`, whose backward drops the cotangent of the
    non-finite outputs, the scan's backward computes on numbers only: no `0 · NaN` of its masked
    terms (other segments, later positions) moves a NaN across a segment boundary."""
    shapes = tuple((a.shape, jnp.dtype(a.dtype).name) for a in inputs)
    return _reached(shapes, value, inputs, marks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reached(shapes, value, inputs, marks):
    return value


def _reached_fwd(shapes, value, inputs, marks):
    return value, marks


def _reached_bwd(shapes, marks, g):
    reach, at, a = marks
    groups = shapes[3][0][2]  # B's
    per_group = lambda m: m.reshape(*m.shape[:2], groups, -1).any(-1)  # noqa: E731 - heads -> groups
    where = (reach[..., None], reach, a, per_group(reach)[..., None], per_group(at)[..., None])
    where += (reach[:, 0, :, None, None],)  # the initial state: the first segment's
    nans = tuple(
        jnp.broadcast_to(jnp.where(m, jnp.nan, 0).astype(dtype), shape)
        for m, (shape, dtype) in zip(where, shapes, strict=True)
    )
    return g, nans, None


_reached.defvjp(_reached_fwd, _reached_bwd)


def all_finite(*arrays) -> jax.Array:
    """One boolean: every value of `arrays` is finite (`a · 0` is NaN exactly where `a` is not
    finite; one float32 sum per array, which fuses into the read)."""
    total = sum(jnp.sum(lax.stop_gradient(a) * jnp.zeros((), a.dtype), dtype=jnp.float32) for a in arrays)
    return jnp.isfinite(total)


def zeroed(a):
    """`a` with its non-finite values as 0 (no gradient rule: `clean` has one)."""
    return jnp.where(jnp.isfinite(a), a, 0).astype(a.dtype)


@jax.custom_vjp
def clean(a):
    """`a` with its non-finite values as 0; their gradient is NaN."""
    return zeroed(a)


def _clean_fwd(a):
    return clean(a), jnp.isfinite(a)


def _clean_bwd(finite, g):
    # the gradient of a non-finite input is NaN: it is never reported as a number
    return (jnp.where(finite, g, jnp.nan).astype(g.dtype),)


clean.defvjp(_clean_fwd, _clean_bwd)


@jax.custom_vjp
def scrubbed(ok, a):
    """`a` as it is where `ok` (a boolean scalar) or where `a` is finite, else 0: the scan's large
    inputs. For finite inputs (`ok`) the select is the identity and fuses into the pass that
    forms `a`; unlike `clean`, no mask is kept for the backward, whose cotangent passes through
    (a non-finite value's own gradient is the cotangent of the 0 that replaced it; the outputs it
    reaches are NaN, and so are the cotangents they send back)."""
    return jnp.where(ok | jnp.isfinite(a), a, jnp.zeros((), a.dtype))


def _scrubbed_fwd(ok, a):
    return scrubbed(ok, a), None


def _scrubbed_bwd(_, g):
    return None, g


scrubbed.defvjp(_scrubbed_fwd, _scrubbed_bwd)


@jax.custom_vjp
def poison(y, bad):
    """`y` with NaN where `bad`; the cotangent of those places goes back as NaN, so the inputs
    that reach them get NaN gradients (possibly more of them than the exact recurrence's, never
    fewer: a backward that multiplies masked terms by 0 spreads it; SSD's layer uses `nan_where`
    and `reached` instead). The backward keeps `bad` as bits along the last axis, 8 to a byte (`jnp.packbits`):
    inside a differentiated conditional the other branch writes zeros into that residual's slot
    on every call (`[b, L, H, P]`: 84 MB as bytes at the Mamba-2 2.7B layer, L 4096)."""
    return jnp.where(bad, jnp.nan, y).astype(y.dtype)


def _poison_fwd(y, bad):
    return poison(y, bad), _bits(bad, y)


def _poison_bwd(bits, g):
    return jnp.where(_unbits(bits, g), jnp.nan, g).astype(g.dtype), None


def _bits(bad, y):
    """`bad` broadcast to `y`'s shape, as bits along the last axis (8 to a byte)."""
    return jnp.packbits(jnp.broadcast_to(bad, y.shape), axis=-1)


def _unbits(bits, g):
    return jnp.unpackbits(bits, axis=-1, count=g.shape[-1]).astype(bool)


poison.defvjp(_poison_fwd, _poison_bwd)


@jax.custom_vjp
def nan_where(y, bad):
    """`y` with NaN where `bad` (as `poison`); the cotangent of those places is dropped (0), so the
    backward it feeds computes on numbers only: the inputs that reach them get their NaN
    gradients from `reached`. The mask is kept as bits along the last axis (`poison`'s)."""
    return jnp.where(bad, jnp.nan, y).astype(y.dtype)


def _nan_where_fwd(y, bad):
    return nan_where(y, bad), _bits(bad, y)


def _nan_where_bwd(bits, g):
    return jnp.where(_unbits(bits, g), 0, g).astype(g.dtype), None


nan_where.defvjp(_nan_where_fwd, _nan_where_bwd)


def layer(scan, x, dt, A, B, C, D, z, segment_ids, initial_state):
    """The SSD layer around a chunked scan, `scan(x, dt, A, B, C, seg, initial_state,
    clean_x=True, x_finite=True) -> (y [b, L, H, P], final, whether x is finite)` (`dt` in the
    accumulation dtype, `seg` internal segment ids) whose kernels take `x`'s non-finite values
    as 0 (`kernel_scan.scan`); then `D` and the gate. The non-finite rule: the scan runs outside
    any conditional, on `x` as it came and on the other inputs `scrubbed` (0 where not finite,
    unless every value is: small arrays); after it, one conditional forms `guard`'s masks and
    the gradients' (`gradient_marks`) only where some value the scan reads is not finite, zeros
    (the large mask as bits) where all are.
    NaN then goes where the recurrence is non-finite, whose cotangents the backward drops
    (`nan_where`), and the inputs that reach them get NaN gradients (`reached`): the scan's
    backward meets no NaN, so none crosses a segment boundary through its masked terms. The
    masks' selects fuse into the passes over `y` and the gradients; the masks themselves (a
    running maximum over the length of `[b, L, H, P]` values) would cost about as much as the
    scan's kernels (docs/decisions.md, "The non-finite guard in a conditional"). A scan
    differentiated inside a conditional would pass every residual out through it, and its
    operands, the states entering the chunks among them, would live until the whole backward
    ends."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    batch, length, heads, p = x.shape
    seg = segment_starts(segment_ids, batch, length)
    checked = (x, dt, A, B, C, initial_state)
    small_finite = all_finite(*checked[1:])
    dt, A, B, C, initial_state_c = (scrubbed(small_finite, a) for a in checked[1:])
    # `x` finite or not, from the scan (whose forward kernel may report what it read: no pass
    # over `x` of its own)
    y, final, x_finite = scan(x, dt.astype(acc), A, B, C, seg, initial_state_c, clean_x=True, x_finite=True)
    finite = small_finite & x_finite

    def no_masks(checked, seg):  # every input finite: nothing masked (zeros, the large mask as bits)
        mask_bits = jnp.zeros((batch, length, heads, -(-p // 8)), jnp.uint8)
        marks = (jnp.zeros((batch, length, heads), bool),) * 2 + (jnp.zeros((heads,), bool),)
        return vary_like((mask_bits, jnp.zeros(initial_state.shape, bool), marks), *checked, seg)

    def masks(checked, seg):
        y_bits, final_bad = guard_bits(*checked[:5], seg, checked[5])
        marks = gradient_marks(*checked[:5], seg, checked[5])
        return vary_like((y_bits, final_bad, marks), *checked, seg)

    y_bits, final_bad, marks = lax.cond(finite, no_masks, masks, lax.stop_gradient(checked), seg)
    # (the mask unpacked here and packed again for the backward: with the conditional's bits as
    # the residual, the layer compiled to 0.16 GiB more at its peak for an H200)
    y_bad = jnp.unpackbits(y_bits, axis=-1, count=p).astype(bool)
    y = reached(nan_where(y, y_bad), checked, marks)
    return _finished(y, x, D, z), nan_where(final, final_bad).astype(initial_state.dtype)


def _finished(y, x, D, z):
    """`y` with `D` and the gate, in `x`'s dtype; without them `y` as the scan gives it (a scan
    may round it to `x`'s dtype itself)."""
    if D is None and z is None:
        return y.astype(x.dtype)
    return skip_and_gate(y.astype(jnp.promote_types(x.dtype, jnp.float32)), x, D, z).astype(x.dtype)


def layer_around(prepare, scan, x, dt, A, B, C, D, z, segment_ids, initial_state):
    """The SSD layer with the scan between two conditionals, for a scan whose residuals XLA
    would otherwise fuse or recompute (`xla`'s): `prepare(x, dt, A, B, C, initial_state)` forms
    the scan's inputs, from the inputs as they are where every value the scan reads is finite,
    else from `clean` ones (the first conditional); `scan(inputs, seg) -> (y, final)` runs on
    them outside any conditional; the second finishes `y` (`D`, the gate, the input dtype) and
    the final state, with NaN where the recurrence is non-finite (`guard`'s masks) in its second
    branch, whose backward drops those outputs' cotangents (`nan_where`); the first's gives NaN
    gradients to the inputs that reach them (`reached`), so the scan's backward meets no NaN. A scan differentiated inside a conditional (`layer`) hands every residual of its
    backward out through it, materialised in buffers sized for the larger branch; here only
    `prepare`'s outputs and the finished `y` cross one, each formed in both branches (an
    operand a branch passed out as it came, XLA would copy out)."""
    batch, length, _, _ = x.shape
    seg = segment_starts(segment_ids, batch, length)
    checked = (x, dt, A, B, C, initial_state)
    finite = all_finite(*checked)

    def cleaned(c, seg):  # `prepare`'s inputs with non-finite values as 0; NaN gradients by `reached`
        x, *rest = prepare(*(clean(a) for a in c))
        return (reached(x, c, gradient_marks(*c[:5], seg, c[5])), *rest)

    inputs = lax.cond(finite, lambda c, seg: prepare(*c), cleaned, checked, seg)
    y, final = scan(inputs, seg)

    def finish(y, final):
        return _finished(y, x, D, z), final.astype(initial_state.dtype)

    def kept(y, final, checked, seg):
        return finish(y, final)

    def poisoned(y, final, checked, seg):
        _, y_bad, final_bad = guard(*checked[:5], seg, checked[5])
        return finish(nan_where(y, y_bad), nan_where(final, final_bad))

    return lax.cond(finite, kept, poisoned, y, final, checked, seg)
