"""Mamba-3's cases, shared by the CPU tests (tests/ops/test_mamba3.py): random inputs in mamba_ssm's
layouts, and a runner returning outputs and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axkern.positional import mamba3
from tests.harness import jit

STATE = ("angle_state", "ssm_state", "k_state", "v_state")
WEIGHTS = ("W_x", "W_z", "W_o")


def make(seed, b, l, h, p, g, n, a, rank, dtype, *, segments=True, extras=True):  # noqa: E741
    """Inputs as a dict (MIMO when `rank`), and segment ids (or None). `q, k, v, z` in `dtype`;
    the per-position scalars, angles, biases, weights and states in float32."""
    k = jax.random.split(jax.random.PRNGKey(seed), 20)
    dt_ = jnp.dtype(dtype)
    qk = (b, l, g, n) if not rank else (b, l, rank, g, n)
    bias = (h, n) if not rank else (h, rank, n)
    arrays = dict(
        q=jax.random.normal(k[0], qk).astype(dt_),
        k=jax.random.normal(k[1], qk).astype(dt_),
        v=jax.random.normal(k[2], (b, l, h, p)).astype(dt_),
        adt=-jax.nn.softplus(jax.random.normal(k[3], (b, h, l))) * 0.5,
        dt=jax.nn.softplus(jax.random.normal(k[4], (b, h, l))) * 0.5,
        trap=jax.random.normal(k[5], (b, h, l)),
        q_bias=jax.random.normal(k[6], bias) * 0.5,
        k_bias=jax.random.normal(k[7], bias) * 0.5,
        angles=jax.random.normal(k[8], (b, l, h, a)),
    )
    if extras:
        arrays |= dict(
            D=jax.random.normal(k[9], (h,)),
            z=jax.random.normal(k[10], (b, l, h, p)).astype(dt_),
            angle_state=jax.random.uniform(k[11], (b, h, a), maxval=6.0),
            ssm_state=jax.random.normal(k[12], (b, h, p, n)),
            k_state=jax.random.normal(k[13], (b, h, n) if not rank else (b, rank, h, n)),
            v_state=jax.random.normal(k[14], (b, h, p)),
        )
    if rank:
        arrays |= {w: 1 + 0.5 * jax.random.normal(k[15 + i], (h, rank, p)) for i, w in enumerate(WEIGHTS)}
    seg = jnp.cumsum(jax.random.bernoulli(k[19], 0.1, (b, l)), axis=1).astype(jnp.int32) if segments else None
    return arrays, seg


def call(impl, kw, seg=None, chunk_size=None):
    """`mamba3` on the dict `kw` (as `make` gives it): `(y, Mamba3State)`."""
    kw = dict(kw)
    args = [kw.pop(name) for name in ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles")]
    state = tuple(kw.pop(s) for s in STATE) if "ssm_state" in kw else None
    mimo = tuple(kw.pop(w) for w in WEIGHTS) if "W_x" in kw else None
    return mamba3(
        *args,
        initial_state=state,
        mimo=mimo,
        segment_ids=seg,
        return_final_state=True,
        implementation=impl,
        # `chunk_size` may be a `Mamba3BlockSizes`
        **(
            {"chunk_size": chunk_size}
            if chunk_size is None or isinstance(chunk_size, int)
            else {"block_sizes": chunk_size}
        ),
        **kw,
    )


forward = jit(call, static_argnums=(0, 3))  # `call`, compiled once per case's shapes


def run(impl, arrays, seg, chunk_size=None):
    """`((y, final_state), gradients)`: the gradients of every input of a random-cotangent sum of
    `y` and the final states (one jitted call: one compilation rather than one per primitive)."""
    names = sorted(arrays)

    def f(*vals):
        y, final = call(impl, dict(zip(names, vals, strict=True)), seg, chunk_size)
        cot = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
        loss = jnp.sum(y.astype(jnp.float32) * cot)
        loss += sum(jnp.sum(jnp.sin(s.astype(jnp.float32))) for s in final)
        return loss, (y, tuple(final))

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(names))), has_aux=True))(
        *[arrays[k] for k in names]
    )
    return out, grads
