"""Fused linear cross-entropy in plain JAX: the streaming statistics (never more than one logits
tile alive) and the reduced loss with its gradients formed in the forward, both written in
`common.py`, whose paths the kernels share (the recomputing backward, the loss's gradients)."""

from __future__ import annotations

from axkern.core.op import Implementation

from .blocks import CrossEntropyBlockSizes, describe_loss, heuristic, loss_heuristic, loss_space, space
from .common import Static, loss, stream_stats


def stats(x, w, labels, *, block_sizes: CrossEntropyBlockSizes, logits_soft_cap=None, with_sum=False):
    """Per-token `(lse, label_logit, sum_logits)`, each `[N]` float32 (float64 for float64 inputs)."""
    cfg = Static(
        block_tokens=min(block_sizes.block_tokens, max(1, x.shape[0])),
        block_vocab=min(block_sizes.block_vocab, w.shape[1]),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        with_sum=bool(with_sum),
    )
    return stream_stats(cfg, x, w, labels)


IMPLEMENTATION = Implementation(
    "xla",
    stats,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=heuristic,
    space=space,
    backward="custom_vjp: recomputes each logits tile (streamed, no [tokens, vocab] buffer)",
)

LOSS_IMPLEMENTATION = Implementation(
    "xla",
    loss,
    block_sizes=CrossEntropyBlockSizes,
    heuristic=loss_heuristic,
    space=loss_space,
    backward=describe_loss,  # the dw accumulation and temporary memory of the call
)
