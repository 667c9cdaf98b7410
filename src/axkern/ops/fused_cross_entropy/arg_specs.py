"""Shapes that `axkern bench fused_cross_entropy` and tuning use.

Presets are real models' (embed, vocab), each run at N = 8192, 16384 and 32768 tokens (or
`--tokens`); `quick` is small enough for a CPU in seconds. `tpu` runs llama3 and gemma at N = 8192
(or `--tokens`), sized for one TPU chip: its errors are taken against `xla` (the reference's
float32 logits and their gradient would not fit the chip's memory).
FLOPs count the model's work: `2·N·D·V` forward, `4·N·D·V` backward (a recomputing backward
does a further `2·N·D·V`, which is not counted); bytes the fewest moved: `x`, `W` and the labels
read forward, `x`, `W` read again and `dx`, `dW` written backward.

`fused_cross_entropy` cases differentiate the mean of the per-token losses (the statistics'
recomputing backward); `fused_cross_entropy_loss` cases differentiate the reduced loss, as a
training step does (gradients formed in the forward), which is what Liger-Kernel and
cut-cross-entropy compute.

Peer of `fused_cross_entropy_loss` (`--peers`, timed in this process): Levanter's
`fused_cross_entropy_loss_and_logsumexp_penalty` (mean reduction; its own choice of
implementation and block sizes for the platform, as a Levanter model calls it). Where
Levanter is not installed, or does not import, its rows say so.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from axkern.core.cases import Case
from axkern.core.op import Unsupported

from .api import LOSS_NAME, NAME, fused_cross_entropy_loss_positional, fused_cross_entropy_positional

PRESETS = {
    "quick": (512, 256, 4096),
    "llama3": (16384, 4096, 128256),
    "llama2": (16384, 4096, 32000),
    "qwen2": (16384, 3584, 151936),
    "gemma": (16384, 2304, 262144),
}
# one TPU chip: (model preset, tokens) pairs, errors against `xla`
TPU_PRESETS = {"tpu": (("llama3", 8192), ("gemma", 8192))}
PRESETS_BY_OP = {NAME: {**PRESETS, **TPU_PRESETS}, LOSS_NAME: {**PRESETS, **TPU_PRESETS}}


def case(
    tokens: int,
    embed: int,
    vocab: int,
    dtype: str = "bfloat16",
    label: str | None = None,
    op: str = NAME,
    reference: str = "reference",
) -> Case:
    dt = jnp.dtype(dtype)

    def make(key):
        kx, kw, kl = jax.random.split(key, 3)
        x = jax.random.normal(kx, (tokens, embed), jnp.float32).astype(dt)
        w = (jax.random.normal(kw, (embed, vocab), jnp.float32) * embed**-0.5).astype(dt)
        labels = jax.random.randint(kl, (tokens,), 0, vocab)
        return x, w, labels

    def forward(impl, x, w, labels):
        return fused_cross_entropy_positional(x, w, labels, reduction=None, implementation=impl)

    peers = {"levanter": levanter_peer()} if op == LOSS_NAME else {}

    def loss(impl, x, w, labels):
        if isinstance(impl, str) and impl.startswith("peer:"):
            peer = peers[impl.removeprefix("peer:")]
            if isinstance(peer, str):
                raise Unsupported(peer)
            return peer(x, w, labels)
        if op == LOSS_NAME:
            return fused_cross_entropy_loss_positional(x, w, labels, implementation=impl)
        return jnp.mean(fused_cross_entropy_positional(x, w, labels, reduction=None, implementation=impl))

    if op == LOSS_NAME:
        forward = loss

    nvd = float(tokens) * embed * vocab
    return Case(
        op=op,
        label=label or f"N={tokens} D={embed} V={vocab} {dt.name}",
        dims={"tokens": tokens, "embed": embed, "vocab": vocab},
        dtype=dt.name,
        make=make,
        forward=forward,
        loss=loss,
        grad_argnums=(0, 1),
        flops_forward=2 * nvd,
        flops_backward=4 * nvd,
        bytes_forward=(float(tokens) * embed + float(embed) * vocab) * dt.itemsize + 4.0 * tokens,
        bytes_backward=2 * (float(tokens) * embed + float(embed) * vocab) * dt.itemsize,
        peers=peers,
        reference=reference,
    )


def levanter_peer():
    """Levanter's mean fused cross-entropy loss on the case's `(x, w, labels)`, or why it
    cannot run (imported at the first call: building cases does not import Levanter)."""
    if importlib.util.find_spec("levanter") is None:
        return "levanter is not installed"

    def levanter_loss(x, w, labels):
        try:
            from levanter.kernels.pallas.fused_cross_entropy_loss import (
                fused_cross_entropy_loss_and_logsumexp_penalty,
            )
        except Exception as e:  # noqa: BLE001 - any import failure: the peer is absent
            raise Unsupported(f"levanter did not import: {type(e).__name__}: {e}") from None
        return fused_cross_entropy_loss_and_logsumexp_penalty(x, labels, w, reduction="mean")

    return levanter_loss


# a model preset runs at each of these token counts unless `--tokens` names one
MODEL_TOKENS = (8192, 16384, 32768)


def cases_fused_cross_entropy(*, preset=None, tokens=None, dtype=None, op: str = NAME) -> list[Case]:
    name = preset or "quick"
    if name in TPU_PRESETS:
        dtype = dtype or "bfloat16"
        return [
            case(t, d, v, dtype, label=f"{model}: N={t} D={d} V={v} {dtype}", op=op, reference="xla")
            for model, n in TPU_PRESETS[name]
            for t, (_, d, v) in [(tokens or n, PRESETS[model])]
        ]
    if name not in PRESETS:
        known = sorted({**PRESETS, **TPU_PRESETS})
        raise ValueError(f"fused_cross_entropy: unknown preset {name!r}; presets are {known}")
    n, d, v = PRESETS[name]
    dtype = dtype or ("float32" if name == "quick" else "bfloat16")
    counts = (tokens,) if tokens else (n,) if name == "quick" else MODEL_TOKENS
    return [case(t, d, v, dtype, label=f"{name}: N={t} D={d} V={v} {dtype}", op=op) for t in counts]


def cases_fused_cross_entropy_loss(*, preset=None, tokens=None, dtype=None) -> list[Case]:
    return cases_fused_cross_entropy(preset=preset, tokens=tokens, dtype=dtype, op=LOSS_NAME)
