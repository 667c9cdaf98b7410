"""benchmarks/ssd_mosaic_forward.py's `unguarded` form: while it traces, the layer's finiteness
check is a constant, so the compiled program has neither the finiteness sums nor the conditional
(the guard's cost is what the form saves); other forms, and the layer after it, keep both."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from axkern.ops.ssd.arg_specs import case
from axkern.ops.chunked import chunks
from axkern.positional import ssd

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "ssd_mosaic_forward.py"
_spec = importlib.util.spec_from_file_location("ssd_mosaic_forward", _PATH)
forms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(forms)


def _compiled(form, args):
    def run(x, dt, A, B, C):
        with forms.unguarded(form):
            y = ssd(x, dt, A, B, C, dt_softplus=True, implementation="xla")
        return y

    def both(x, dt, A, B, C):
        y, pull = jax.vjp(run, x, dt, A, B, C)
        return y, pull(jnp.ones_like(y))

    return jax.jit(both).lower(*args).compile().as_text(), jax.jit(both)(*args)


def test_the_unguarded_form_compiles_without_the_check_and_the_conditional():
    c = case("t", 1, 128, 2, 16, 16, 1, 64, jnp.dtype("float32"))
    args = c.make(jax.random.PRNGKey(0))
    guarded, want = _compiled("group_scores", args)
    assert " conditional(" in guarded
    saved = chunks.all_finite
    unguarded, got = _compiled("unguarded", args)
    assert chunks.all_finite is saved  # restored after the trace
    assert " conditional(" not in unguarded and " is-finite(" not in unguarded
    # on finite inputs the fast branch alone gives the guarded layer's values and gradients
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    # and a layer traced after it is guarded again
    again, _ = _compiled("group_scores", args)
    assert " conditional(" in again
