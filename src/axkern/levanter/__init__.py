"""Drop-ins for Levanter's functions, with Levanter's signatures and meaning, backed by axkern's ops.

```python
import axkern.levanter
axkern.levanter.patch()   # every Levanter module now calls axkern's drop-ins
```

or import them by name:

```python
# from levanter.models.loss import maybe_fused_next_token_loss
# from levanter.layers.attention import dot_product_attention, AttentionMask
from axkern.levanter import AttentionMask, dot_product_attention, maybe_fused_next_token_loss
```

Each argument of Levanter's signature is accepted as Levanter means it, mapped to axkern's
nearest option, or refused with an error that names it (the table is in `docs/levanter.md`).
`AttentionMask` is Levanter's own class where Levanter is importable (its layers apply a model's
sliding window only to it), else `LevanterlessAttentionMask`, its equal. The reference is
marin-levanter 0.2.227.
"""

from __future__ import annotations

# `X as X`: names reachable here that `__all__` leaves out (the named loss, the mask class
# without Levanter and its conversion, the conv's default batch axes, Levanter's backend
# choice, what `patch` returns)
from .attention import backend_implementation as backend_implementation
from .attention import dot_product_attention
from .conv import DEFAULT_BATCH_AXES as DEFAULT_BATCH_AXES
from .conv import short_conv
from .loss import (
    fused_cross_entropy_loss_and_logsumexp_penalty,
    maybe_fused_next_token_loss,
    next_token_loss_weight,
)
from .loss import (
    named_fused_cross_entropy_loss_and_logsumexp_penalty as named_fused_cross_entropy_loss_and_logsumexp_penalty,
)
from .mask import LevanterlessAttentionMask as LevanterlessAttentionMask
from .mask import materialize as materialize
from .mask import to_axkern_mask as to_axkern_mask
from .patching import Patched as Patched
from .patching import patch, unpatch


def _attention_mask_class() -> type:
    """Levanter's `AttentionMask` where Levanter is importable, else `LevanterlessAttentionMask`."""
    try:
        from levanter.layers.attention_mask import AttentionMask as levanters
    except ImportError:
        return LevanterlessAttentionMask
    return levanters


AttentionMask = _attention_mask_class()

__all__ = [
    "fused_cross_entropy_loss_and_logsumexp_penalty",
    "maybe_fused_next_token_loss",
    "next_token_loss_weight",
    "dot_product_attention",
    "AttentionMask",
    "short_conv",
    "patch",
    "unpatch",
]
