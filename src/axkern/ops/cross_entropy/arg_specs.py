"""Shapes that `axkern bench cross_entropy` uses: a model's `[tokens, vocab]` logits.

Memory bound: the forward reads the logits and writes the gradient it forms (`2·N·V`
elements), the backward reads that gradient and writes `d logits` (`2·N·V`). FLOPs are
negligible beside the bytes (a few per logit), counted as `6·N·V` forward and `2·N·V` backward.
The `fwd+bwd` pass differentiates the mean loss, as a training step does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axkern.core.cases import Case

from .api import NAME, cross_entropy_positional

# name: (tokens, vocab)
PRESETS = {
    "quick": [(512, 4096)],
    "llama3": [(8192, 128256), (16384, 128256)],
    "gemma": [(8192, 262144)],
}


def case(tokens: int, vocab: int, dtype: str = "bfloat16", label: str | None = None) -> Case:
    dt = jnp.dtype(dtype)

    def make(key):
        kz, kl = jax.random.split(key)
        logits = (jax.random.normal(kz, (tokens, vocab), jnp.float32) * 2).astype(dt)
        labels = jax.random.randint(kl, (tokens,), 0, vocab)
        return logits, labels

    def forward(impl, logits, labels):
        return cross_entropy_positional(logits, labels, reduction=None, implementation=impl)

    def loss(impl, logits, labels):
        return cross_entropy_positional(logits, labels, implementation=impl)

    nv = float(tokens) * vocab
    return Case(
        op=NAME,
        label=label or f"N={tokens} V={vocab} {dt.name}",
        dims={"tokens": tokens, "vocab": vocab},
        dtype=dt.name,
        make=make,
        forward=forward,
        loss=loss,
        grad_argnums=(0,),
        flops_forward=6 * nv,
        flops_backward=2 * nv,
        bytes_forward=2 * nv * dt.itemsize,
        bytes_backward=2 * nv * dt.itemsize,
        bound="memory",
    )


def cases(*, preset=None, tokens=None, dtype=None) -> list[Case]:
    name = preset or "quick"
    if name not in PRESETS:
        raise ValueError(f"{NAME}: unknown preset {name!r}; presets are {sorted(PRESETS)}")
    dtype = dtype or ("float32" if name == "quick" else "bfloat16")
    return [
        case(tokens or n, v, dtype, label=f"{name}: N={tokens or n} V={v} {dtype}") for n, v in PRESETS[name]
    ]
