"""Shapes that `axkern bench mamba3` uses: the Mamba-3 2.7B layer (SISO, and MIMO of rank 4), the
same two for one TPU chip (`tpu`, MIMO at batch 1: rows named after the layer, errors against `xla`, as the exact
sequential reference's backward keeps a state per position, past the chip's memory), and a quick
CPU one.

`--peers`: mamba_ssm's Triton SISO kernels in a subprocess (`axkern.peers`) and, in this process,
Levanter's XLA path (`levanter.kernels.pallas.mamba3.mamba3_attentionish_forward`, SISO). Levanter's
path takes real-valued (unrotated) q and k and one q/k head per head: its row is timed without the
rotation (the angles are dropped) and with q and k repeated over each group's heads, so it computes
`mamba3` with zero angles (checked against axkern in tests/test_levanter.py)."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from axkern.core.cases import Case

from .api import mamba3_positional

# batch, length, heads, head_dim, state, groups, n_angles, rank (0: SISO), chunk
PRESETS = {
    "quick": (2, 256, 4, 16, 16, 1, 4, 0, 64),
    "mamba3_2.7b": (4, 4096, 80, 64, 128, 1, 32, 0, 64),
    "tpu": (4, 4096, 80, 64, 128, 1, 32, 0, 64),
}
# the same layer as MIMO of rank 4, run after it unless `--tokens` names a length
VARIANTS = {
    "mamba3_2.7b": ((4, 4096, 80, 64, 128, 1, 32, 4, 16),),
    # rank 4 at batch 1: at batch 4 its temporaries (19 to 46 GiB) exceed a v5e chip's 15.75 GiB
    "tpu": ((1, 4096, 80, 64, 128, 1, 32, 4, 16),),
}
# the model a preset's rows name, and the preset whose errors are taken against `xla`
MODEL = {"tpu": "mamba3_2.7b"}


def cases(*, preset=None, tokens=None, dtype=None):
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"mamba3: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    b, l, *rest = PRESETS[name]
    shapes = [(b, tokens or l, *rest)] + ([] if tokens else list(VARIANTS.get(name, ())))
    dt_ = jnp.dtype(dtype or ("float32" if name == "quick" else "bfloat16"))
    reference = "xla" if name in MODEL else "reference"
    return [case(MODEL.get(name, name), *shape, dt_, reference=reference) for shape in shapes]


def case(name, b, l, h, p, n, g, a, r, q, dt_, reference="reference") -> Case:  # noqa: E741
    rank = max(r, 1)

    def make(key):
        k = jax.random.split(key, 10)
        qk = (b, l, g, n) if not r else (b, l, r, g, n)
        bias = (h, n) if not r else (h, r, n)
        inputs = (
            jax.random.normal(k[0], qk).astype(dt_),
            jax.random.normal(k[1], qk).astype(dt_),
            jax.random.normal(k[2], (b, l, h, p)).astype(dt_),
            -jax.nn.softplus(jax.random.normal(k[3], (b, h, l))),
            jax.nn.softplus(jax.random.normal(k[4], (b, h, l)) - 2),
            jax.random.normal(k[5], (b, h, l)),
            jnp.ones(bias),
            jnp.ones(bias),
            jax.random.normal(k[6], (b, l, h, a)),
        )
        if r:
            inputs += tuple(jax.random.normal(k[7 + i], (h, r, p)) / r for i in range(3))
        return inputs

    def forward(impl, *inputs):
        mimo = tuple(inputs[9:]) or None
        kw = {"chunk_size": q} if impl == "xla" else {}
        return mamba3_positional(*inputs[:9], mimo=mimo, implementation=impl, **kw)

    flops = 2.0 * b * l * q * h * rank * rank * (n + p)  # intra-chunk products, roughly
    # the fewest bytes: q, k, v in (16-bit), the decay, step, trapezoid and angles in (float32),
    # y out; backward those and dy in, their gradients out
    qk, xv, f32 = 2.0 * b * l * rank * g * n, float(b) * l * h * p, 4.0 * b * l * h * (3 + a)
    kind = "SISO" if not r else f"MIMO R={r}"
    return Case(
        "mamba3",
        f"{name} {kind}: B={b} L={l} H={h} P={p} N={n} G={g} A={a} Q={q} {dt_.name}",
        {
            "batch": b,
            "length": l,
            "heads": h,
            "head_dim": p,
            "state": n,
            "groups": g,
            "angles": a,
            "rank": r,
            "chunk": q,
        },
        dt_.name,
        make,
        forward,
        None,
        (0, 1, 2, 3, 4, 5),
        flops,
        2 * flops,
        bytes_forward=(qk + 2 * xv) * dt_.itemsize + f32,
        bytes_backward=(2 * qk + 3 * xv) * dt_.itemsize + 2 * f32,
        peers={"levanter": _levanter_peer(r, q, l)},
        reference=reference,
    )


def levanter_forward(q, k, v, adt, dt, trap, q_bias, k_bias, *, chunk_size):
    """`mamba3` with zero angles (SISO, no D, z or states) by Levanter's XLA path: q and k repeated
    over each group's heads, the log-decay summed within each chunk as Levanter takes it."""
    from levanter.kernels.pallas.mamba3 import mamba3_attentionish_forward

    b, length, h = v.shape[:3]
    rep = h // q.shape[2]
    chunks = adt.reshape(b, h, length // chunk_size, chunk_size)
    return mamba3_attentionish_forward(
        jnp.repeat(q, rep, axis=2),
        jnp.repeat(k, rep, axis=2),
        v,
        q_bias=q_bias,
        k_bias=k_bias,
        da_cs=jnp.cumsum(chunks, axis=-1).reshape(b, h, length),
        dt=dt,
        trap=trap,
        chunk_size=chunk_size,
        implementation="xla",
    )


def _levanter_peer(rank, chunk, length):
    """Levanter's XLA SISO path as a bench peer, or why it cannot run the case."""
    if importlib.util.find_spec("levanter") is None:
        return "levanter is not installed"
    if rank:
        return "the Levanter peer is timed for SISO only"
    if length % chunk:
        return f"Levanter's chunked path needs the length ({length}) a multiple of the chunk ({chunk})"

    def forward(q, k, v, adt, dt, trap, q_bias, k_bias, angles):
        del angles  # Levanter's path does not rotate q and k
        return levanter_forward(q, k, v, adt, dt, trap, q_bias, k_bias, chunk_size=chunk)

    forward.incomparable = "zero angles (Levanter's path does not rotate q and k)"
    return forward


# batch, heads, head_dim, state, groups, n_angles
STEP_PRESETS = {"quick": [(2, 4, 16, 16, 1, 4)], "mamba3_2.7b": [(64, 80, 64, 128, 1, 32)]}
PRESETS_BY_OP = {"mamba3": PRESETS, "mamba3_step": STEP_PRESETS}


def cases_mamba3_step(*, preset=None, tokens=None, dtype=None):
    """One SISO decode step: reads and writes the `[batch, heads, head_dim, state]` state."""
    from .api import Mamba3State, mamba3_step_positional

    name = preset or "quick"
    if name not in STEP_PRESETS:
        raise ValueError(f"mamba3_step: unknown preset {name!r}; presets are {sorted(STEP_PRESETS)}")
    dt_ = jnp.dtype(dtype or ("float32" if name == "quick" else "bfloat16"))
    out = []
    for b, h, p, n, g, a in STEP_PRESETS[name]:
        b = tokens or b

        def make(key, b=b, h=h, p=p, n=n, g=g, a=a):
            k = jax.random.split(key, 10)
            return (
                jax.random.normal(k[0], (b, g, n)).astype(dt_),
                jax.random.normal(k[1], (b, g, n)).astype(dt_),
                jax.random.normal(k[2], (b, h, p)).astype(dt_),
                -jax.nn.softplus(jax.random.normal(k[3], (b, h))),
                jax.nn.softplus(jax.random.normal(k[4], (b, h))),
                jax.random.normal(k[5], (b, h)),
                jnp.ones((h, n)),
                jnp.ones((h, n)),
                jax.random.normal(k[6], (b, h, a)),
                jax.random.normal(k[7], (b, h, a)),
                jax.random.normal(k[8], (b, h, p, n)),
                jax.random.normal(k[9], (b, h, n)),
                jax.random.normal(k[0], (b, h, p)),
            )

        def forward(impl, *inputs):
            state = Mamba3State(*inputs[9:])
            y, new = mamba3_step_positional(*inputs[:9], state, implementation=impl)
            return (y, *new)

        state = float(b) * h * p * n
        out.append(
            Case(
                "mamba3_step",
                f"{name}: B={b} H={h} P={p} N={n} G={g} A={a} {dt_.name}",
                {"batch": b, "heads": h, "head_dim": p, "state": n},
                dt_.name,
                make,
                forward,
                None,
                (0, 1, 2, 10),
                6 * state,
                12 * state,
                bytes_forward=2 * state * 4,
                bytes_backward=3 * state * 4,
                bound="memory",
            )
        )
    return out
