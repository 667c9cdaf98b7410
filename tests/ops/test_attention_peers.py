"""The bench's tokamax peers of attention: the masks they take, and (where tokamax imports) that
the case's `q, k, v` reach tokamax in its layout, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axkern import masks
from axkern.ops.attention import arg_specs
from axkern.ops.attention.api import attention_positional


def test_masks_map_to_tokamax_keywords_only_where_exact():
    assert arg_specs.tokamax_mask(masks.Full()) == {}
    assert arg_specs.tokamax_mask(masks.Causal()) == {"is_causal": True}
    assert arg_specs.tokamax_mask(masks.SlidingWindow(1024)) == {"local_window_size": (1023, 0)}
    ids = jnp.zeros((2, 8), jnp.int32)
    for mask in (
        masks.Causal(offset=3),
        masks.SlidingWindow(4, offset=1),
        masks.Causal() & masks.Segments(ids, ids),
    ):
        assert isinstance(arg_specs.tokamax_mask(mask), str)


def test_every_case_carries_both_tokamax_peers():
    for c in arg_specs.cases(preset="h200"):
        assert set(arg_specs.TOKAMAX_PEERS) <= set(c.peers)
    docs = next(c for c in arg_specs.cases(preset="h200") if "docs" in c.label)
    assert all(isinstance(docs.peers[name], str) for name in arg_specs.TOKAMAX_PEERS)


@pytest.mark.parametrize("mask", [masks.Causal(), masks.SlidingWindow(5), masks.Full()], ids=repr)
def test_tokamax_xla_equals_axkern_xla_on_the_bench_layout(mask):
    pytest.importorskip("tokamax")
    peer = arg_specs.tokamax_peer("xla", mask)  # the peers' code with tokamax's CPU implementation
    assert callable(peer), peer
    q, k, v = arg_specs.case(2, 24, 4, 2, 16, dtype="float32").make(jax.random.PRNGKey(0))
    ct = jax.random.normal(jax.random.PRNGKey(1), q.shape, q.dtype)

    def ours(q, k, v):
        return attention_positional(q, k, v, mask=mask, implementation="xla")

    got, pull = jax.vjp(jax.jit(peer), q, k, v)
    want, pull_want = jax.vjp(ours, q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(pull(ct), pull_want(ct), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
