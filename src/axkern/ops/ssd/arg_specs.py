"""Shapes that `axkern bench ssd` uses: the Mamba-2 2.7B layer (and its variants), the same layer
alone for one TPU chip (`tpu`, its rows named after the layer), and a quick CPU one.

`--peers`: mamba_ssm's Triton `mamba_chunk_scan_combined` in a subprocess (`axkern.peers`) and, in
this process, Levanter's chunked XLA path (`levanter.kernels.pallas.ssd.ssd_chunked_forward`),
each on the case's inputs (the same `dt` softplus; chunks of the case's chunk size), the backward
a random cotangent of `y` pulled back to `x`, `dt`, `B`, `C` as for our rows."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from axkern.core.cases import Case

from .api import ssd_positional

# batch, length, heads, head_dim, state, groups, chunk
PRESETS = {
    "quick": (2, 256, 4, 16, 16, 1, 64),
    "mamba2_2.7b": (4, 4096, 80, 64, 128, 1, 256),
    # one TPU chip: the 2.7B layer alone (its other shapes left out), errors against `xla`
    "tpu": (4, 4096, 80, 64, 128, 1, 256),
}
# the model a preset's rows name (the TPU's rows compare with the GPU's of the same layer)
MODEL = {"tpu": "mamba2_2.7b"}
# the 2.7B layer's other shapes, run after it unless `--tokens` names a length:
# lengths 2048 and 16384, and head dim 128 with state 64 (40 heads: the same width)
VARIANTS = {
    "mamba2_2.7b": (
        (4, 2048, 80, 64, 128, 1, 256),
        (4, 16384, 80, 64, 128, 1, 256),
        (4, 4096, 40, 128, 64, 1, 256),
    )
}


def cases(*, preset=None, tokens=None, dtype=None):
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"ssd: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    b, l, h, p, n, g, q = PRESETS[name]
    shapes = [(b, tokens or l, h, p, n, g, q)] + ([] if tokens else list(VARIANTS.get(name, ())))
    dt_ = jnp.dtype(dtype or ("float32" if name == "quick" else "bfloat16"))
    return [case(MODEL.get(name, name), *shape, dt_) for shape in shapes]


def case(name, b, l, h, p, n, g, q, dt_) -> Case:  # noqa: E741
    def make(key):
        k = jax.random.split(key, 6)
        x = jax.random.normal(k[0], (b, l, h, p)).astype(dt_)
        dt = jax.random.normal(k[1], (b, l, h)).astype(dt_)
        A = -jnp.exp(jax.random.normal(k[2], (h,)))
        B = jax.random.normal(k[3], (b, l, g, n)).astype(dt_)
        C = jax.random.normal(k[4], (b, l, g, n)).astype(dt_)
        return x, dt, A, B, C

    def forward(impl, x, dt, A, B, C):
        kw = {"chunk_size": q} if impl == "xla" else {}  # pallas_gpu picks its own chunk
        return ssd_positional(x, dt, A, B, C, dt_softplus=True, implementation=impl, **kw)

    flops = 2.0 * b * l * q * h * (n + p)  # intra-chunk products, roughly
    # the fewest bytes: x, dt, B, C in and y out; backward those and dy in, their gradients out
    x_, dt_elems, bc = float(b) * l * h * p, float(b) * l * h, 2.0 * b * l * g * n
    return Case(
        "ssd",
        f"{name}: B={b} L={l} H={h} P={p} N={n} G={g} Q={q} {dt_.name}",
        {"batch": b, "length": l, "heads": h, "head_dim": p, "state": n, "groups": g, "chunk": q},
        dt_.name,
        make,
        forward,
        None,  # the backward pulls a random cotangent of y back (`sum(y)` would be a constant one)
        (0, 1, 3, 4),
        flops,
        2 * flops,
        bytes_forward=(2 * x_ + dt_elems + bc) * dt_.itemsize,
        bytes_backward=(3 * x_ + 2 * dt_elems + 2 * bc) * dt_.itemsize,
        peers={"levanter": _levanter_peer(q, l)},
        # the sequential scan's backward keeps a float32 state per position: past 4 GiB of them,
        # the errors are taken against the chunked float32 `xla`
        reference="xla" if b * l * h * p * n * 4 > 4 * 2**30 else "reference",
    )


def levanter_forward(x, dt, A, B, C, *, chunk_size):
    """`ssd` (no D, z, segments or states; `dt` as given, after its softplus) by Levanter's
    chunked XLA path: per (batch, head) the within-chunk sums of `dt · A`, the scale `dt`, and
    `B`, `C` repeated over each group's heads, laid out `[batch, heads, chunks, chunk, ..]`."""
    from levanter.kernels.pallas.ssd import ssd_chunked_forward

    b, length, h, p = x.shape
    rep, c = h // B.shape[2], length // chunk_size
    f32 = jnp.float32
    per_chunk = lambda a: jnp.moveaxis(a, 1, 2).reshape(b, h, c, chunk_size, *a.shape[3:])  # noqa: E731
    dt = jnp.moveaxis(dt.astype(f32), 1, 2).reshape(b, h, c, chunk_size)
    a_log_cumsum = jnp.cumsum(dt * A.astype(f32)[None, :, None, None], axis=-1)
    heads = lambda m: per_chunk(jnp.repeat(m, rep, axis=2))  # noqa: E731
    y, _ = ssd_chunked_forward(a_log_cumsum, dt, heads(B), heads(C), per_chunk(x), implementation="xla")
    return jnp.moveaxis(y.reshape(b, h, length, p), 1, 2).astype(x.dtype)


def _levanter_peer(chunk, length):
    """Levanter's chunked XLA path as a bench peer, or why it cannot run the case. Its output is
    NaN at the presets' inputs (its error column too): it scales `x` by `exp(-Σ dt·A)` within a
    chunk, which overflows float32 once a chunk of 256 decays past `e^-88` (docs/ops/ssd.md)."""
    if importlib.util.find_spec("levanter") is None:
        return "levanter is not installed"
    if length % chunk:
        return f"Levanter's chunked path needs the length ({length}) a multiple of the chunk ({chunk})"

    def forward(x, dt, A, B, C):
        return levanter_forward(x, jax.nn.softplus(dt.astype(jnp.float32)), A, B, C, chunk_size=chunk)

    return forward


# batch, heads, head_dim, state, groups
STEP_PRESETS = {"quick": [(2, 4, 16, 16, 1)], "mamba2_2.7b": [(64, 80, 64, 128, 1)]}
PRESETS_BY_OP = {"ssd": PRESETS, "ssd_step": STEP_PRESETS}  # what `axkern bench --list-presets` shows


def cases_ssd_step(*, preset=None, tokens=None, dtype=None):
    """One decode step: reads and writes the `[batch, heads, head_dim, state]` state (the bytes
    that bound it), reads `x_t`, `dt_t`, `B_t`, `C_t`."""
    from .api import ssd_step_positional

    name = preset or "quick"
    if name not in STEP_PRESETS:
        raise ValueError(f"ssd_step: unknown preset {name!r}; presets are {sorted(STEP_PRESETS)}")
    dt_ = jnp.dtype(dtype or ("float32" if name == "quick" else "bfloat16"))
    out = []
    for b, h, p, n, g in STEP_PRESETS[name]:
        b = tokens or b

        def make(key, b=b, h=h, p=p, n=n, g=g):
            k = jax.random.split(key, 6)
            x = jax.random.normal(k[0], (b, h, p)).astype(dt_)
            dt = jax.random.normal(k[1], (b, h)).astype(dt_)
            A = -jnp.exp(jax.random.normal(k[2], (h,)))
            B = jax.random.normal(k[3], (b, g, n)).astype(dt_)
            C = jax.random.normal(k[4], (b, g, n)).astype(dt_)
            s = jax.random.normal(k[5], (b, h, p, n), jnp.float32)
            return x, dt, A, B, C, s

        def forward(impl, x, dt, A, B, C, s):
            return tuple(ssd_step_positional(x, dt, A, B, C, s, dt_softplus=True, implementation=impl))

        state = float(b) * h * p * n
        out.append(
            Case(
                "ssd_step",
                f"{name}: B={b} H={h} P={p} N={n} G={g} {dt_.name}",
                {"batch": b, "heads": h, "head_dim": p, "state": n},
                dt_.name,
                make,
                forward,
                None,
                (0, 1, 3, 4, 5),
                4 * state,
                8 * state,
                bytes_forward=2 * state * 4,
                bytes_backward=3 * state * 4,
                bound="memory",
            )
        )
    return out
