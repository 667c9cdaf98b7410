"""MoE routing's cases (`moe_dispatch`, `moe_combine`; `moe_layout` counts the same routing),
shared by the CPU tests (tests/ops/test_moe.py) and the GPU tests (tests/gpu/test_moe_gpu.py):
random routings of three kinds, and a runner for a MoE layer (dispatch, an expert function,
combine) returning the dispatched rows, the group sizes and the layer's output, and the
gradients of the tokens, the routing weights and the experts' weights where given."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from axkern.positional import moe_combine, moe_dispatch
from tests.harness import jit

KINDS = ["random", "duplicates", "sparse"]


def make(seed, tokens, topk, experts, dtype="float32", *, hidden=6, kind="random", out=None):
    """`x [tokens, hidden]`, `idx [tokens, topk]` (int32) and `w [tokens, topk]` (uniform), and
    with `out` the experts' weights `weights [experts, hidden, out]`. Kinds: "random" ids;
    "duplicates": ids from a quarter of the experts, so a token may send several slots to one;
    "sparse": ids 0 and `experts - 1` only, so most experts get no token. NumPy draws them: no
    compilation per shape."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    if kind == "duplicates":
        idx = rng.integers(0, max(1, experts // 4), (tokens, topk))
    elif kind == "sparse":
        idx = rng.integers(0, 2, (tokens, topk)) * (experts - 1)
    else:
        idx = rng.integers(0, experts, (tokens, topk))
    arrays = dict(
        x=rng.standard_normal((tokens, hidden), np.float32).astype(dt),
        idx=idx.astype(np.int32),
        w=rng.random((tokens, topk), np.float32).astype(dt),
    )
    if out is not None:
        arrays["weights"] = (rng.standard_normal((experts, hidden, out), np.float32) * hidden**-0.5).astype(
            dt
        )
    return {k: jnp.asarray(a) for k, a in arrays.items()}


@functools.cache
def _runner(impl, experts, weights):
    """The layer's value and gradients for `impl` as one jitted function of `(diff, idx)`: the
    cases of one shape and dtype (whatever their routing) compile once."""

    def f(d, idx):
        ex, gs, routing = moe_dispatch(d["x"], idx, num_experts=experts, implementation=impl)
        h = jax.lax.ragged_dot(ex, d["weights"], gs) if weights else jnp.sin(ex)
        y = moe_combine(h, d["w"], routing, implementation=impl)
        return jnp.sum(y.astype(jnp.float32) ** 2), (ex, gs, y)

    return jit(jax.value_and_grad(f, has_aux=True))


def run(impl, arrays, *, experts):
    """`((expert_x, group_sizes, y), grads)` of the layer `y = combine(f(dispatch(x)), w)`, with
    `f = sin`, or `ragged_dot` with the experts' `weights` where given; gradients of `sum(y^2)`
    w.r.t. x and w (and weights)."""
    diff = {k: arrays[k] for k in ("x", "w", "weights") if k in arrays}
    (_, out), grads = _runner(impl, experts, "weights" in diff)(diff, arrays["idx"])
    return out, tuple(grads[k] for k in diff)
