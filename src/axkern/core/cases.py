"""`Case`: one benchmark shape of an op, as its `ops/<op>/arg_specs.py` describes it.

A case says how to make the inputs, the forward and the scalar loss whose gradient is the
backward (or none: then a random cotangent of the output is pulled back), and the FLOPs and
bytes each pass must do. `axkern bench` times cases, `axkern tune` sweeps block sizes on them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from .op import Decision, Unsupported, explain

__all__ = ["Case"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark shape of an op: its inputs, forward, loss, and the work each pass must do."""

    op: str
    label: str
    dims: dict[str, int]
    dtype: str
    make: Callable[[jax.Array], tuple]  # PRNG key -> inputs
    forward: Callable[..., Any]  # (implementation, *inputs) -> outputs
    # (implementation, *inputs) -> scalar whose gradient is the backward; None: the backward
    # pulls a fixed random cotangent of the forward's output back (`jax.vjp`), and the pass
    # returns the output too, so "fwd+bwd" moves exactly the forward's and backward's bytes
    loss: Callable[..., jax.Array] | None
    grad_argnums: tuple[int, ...]
    flops_forward: float
    flops_backward: float  # model FLOPs of the backward alone (not counting recomputation)
    bytes_forward: float = 0.0  # the fewest bytes the forward must move (memory-bound ops)
    bytes_backward: float = 0.0
    bound: str = "compute"  # "compute": held to the matmul ceiling; "memory": to the copy bandwidth
    passes: tuple[str, ...] = ("fwd", "fwd+bwd")  # e.g. ("fwd",) for ops with integer outputs
    calls: int = 1  # op calls per forward (a loop inside jit, for ops faster than host dispatch)
    # JAX peers timed in this process beside the implementations (rows "peer:<name>", with
    # `axkern bench --peers`): name -> callable taking the case's inputs like `forward`, or a
    # string saying why the peer cannot take this case; a peer callable with an attribute
    # `incomparable` (a string: why) computes something else on the inputs (e.g. a simpler
    # variant of the op) and is timed but not checked against the reference
    peers: dict[str, Callable[..., Any] | str] = dataclasses.field(default_factory=dict)
    # the implementation each row's error is taken against: the op's `reference`, or for a case
    # too large for it (a sequential scan's backward keeps every step's state) a float32 one
    reference: str = "reference"

    def shapes(self) -> tuple:
        """The inputs' shapes and dtypes (`jax.ShapeDtypeStruct`s), with nothing made: the key is
        traced too (no array can be made under an abstract mesh, as when tracing for another
        device)."""
        return jax.eval_shape(lambda: self.make(jax.random.PRNGKey(0)))

    def decision(self, implementation: str | None = None) -> Decision:
        """What the dispatcher decides for this case run by `implementation` (None: the default
        order), from `explain` on its shapes (nothing runs); where the forward calls other ops too
        (e.g. a dispatch before a combine), the decision of this case's op."""
        found = explain(lambda *a: self.forward(implementation, *a), *self.shapes())
        decisions = found if isinstance(found, tuple) else (found,)
        return next((d for d in decisions if d.op == self.op), decisions[-1])

    def forward_for(self, implementation: str) -> Callable[..., Any]:
        """`(*inputs) -> outputs` for an implementation name or "peer:<name>"."""
        if implementation.startswith("peer:"):
            peer = self.peers[implementation.removeprefix("peer:")]
            if isinstance(peer, str):
                raise Unsupported(peer)
            return peer
        return functools.partial(self.forward, implementation)
