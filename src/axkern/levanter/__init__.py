"""Drop-ins for Levanter's functions, with Levanter's signatures and meaning, backed by axkern's ops.

```python
# from levanter.models.loss import maybe_fused_next_token_loss
# from levanter.layers.attention import dot_product_attention, AttentionMask
from axkern.levanter import AttentionMask, dot_product_attention, maybe_fused_next_token_loss
```

Each argument of Levanter's signature is accepted as Levanter means it, mapped to axkern's
nearest option, or refused with a `ValueError` / `TypeError` that names it (the table is in
`docs/levanter.md`). The reference is marin-levanter 0.2.227.
"""

from __future__ import annotations

# `X as X`: names reachable here that `__all__` leaves out (the named loss, the mask
# conversion, the conv's default batch axes)
from .attention import AttentionMask, dot_product_attention
from .attention import to_axkern_mask as to_axkern_mask
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

__all__ = [
    "fused_cross_entropy_loss_and_logsumexp_penalty",
    "maybe_fused_next_token_loss",
    "next_token_loss_weight",
    "dot_product_attention",
    "AttentionMask",
    "short_conv",
]
