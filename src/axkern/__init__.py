"""axkern: fast JAX kernels for LLM and SSM training, as named-axis functions over haliax arrays.

```python
import axkern
loss = axkern.fused_cross_entropy(x, lm_head, labels, Embed="embed", Vocab="vocab")
print(axkern.explain(axkern.fused_cross_entropy, x, lm_head, labels))
```
"""

from . import masks, positional
from .core.config import use
from .core.named import StepResult, WithFinalState
from .core.op import Decision, FallbackWarning, Unsupported, explain
from .ops.attention import AttentionBlockSizes, attention
from .ops.cross_entropy import cross_entropy
from .ops.fused_cross_entropy import CrossEntropyBlockSizes, CrossEntropyOutput, fused_cross_entropy
from .ops.mamba3 import Mamba3BlockSizes, Mamba3State, mamba3, mamba3_step
from .ops.moe import MoeDispatch, MoeLayout, MoeRouting, moe_combine, moe_dispatch, moe_layout
from .ops.moe_ep import EpDispatch, EpLayout, moe_ep_combine, moe_ep_dispatch
from .ops.short_conv import ConvBlockSizes, short_conv, short_conv_step
from .ops.ssd import SSDBlockSizes, ssd, ssd_step

# after the op packages: the function, not the `axkern.ops` subpackage, is `axkern.ops`
from .core.op import implementations, ops  # noqa: E402  isort: skip
from .core.tuning import register_autotuner  # noqa: E402  isort: skip

__version__ = "0.1.0"


def _autotune(op, implementation, spec, arrays, options):
    """The sweep the dispatcher runs on a tuning miss under `use(autotune=True)`: the benchmark
    harness's `autotune`, imported on the first such call."""
    from .bench.tune import autotune

    return autotune(op, implementation, spec, arrays, options)


register_autotuner(_autotune)

__all__ = [
    "attention",
    "AttentionBlockSizes",
    "masks",
    "cross_entropy",
    "fused_cross_entropy",
    "CrossEntropyBlockSizes",
    "CrossEntropyOutput",
    "short_conv",
    "short_conv_step",
    "ConvBlockSizes",
    "WithFinalState",
    "StepResult",
    "ssd",
    "ssd_step",
    "SSDBlockSizes",
    "mamba3",
    "mamba3_step",
    "Mamba3State",
    "Mamba3BlockSizes",
    "moe_layout",
    "moe_dispatch",
    "moe_combine",
    "MoeDispatch",
    "MoeLayout",
    "MoeRouting",
    "moe_ep_dispatch",
    "moe_ep_combine",
    "EpDispatch",
    "EpLayout",
    "explain",
    "use",
    "implementations",
    "ops",
    "Decision",
    "FallbackWarning",
    "Unsupported",
    "positional",
]
