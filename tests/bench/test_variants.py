"""A bench peer with `variants` (e.g. a kernel under each block size of a sweep): one row per pass,
its fastest variant's, the note naming it and every variant's time or failure."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axkern.bench import Case, measure
from axkern.core.op import Unsupported


def _slow(x):
    return jax.lax.fori_loop(0, 16, lambda i, y: jnp.tanh(y @ y.T) * 0 + y, x) * 2


def _broken(x):
    raise Unsupported("these sizes do not fit")


def _case(peer):
    return Case(
        op="test",
        label="x2",
        dims={"n": 256},
        dtype="float32",
        make=lambda key: (jax.random.normal(key, (256, 256)),),
        forward=lambda impl, x: x * 2,
        loss=None,
        grad_argnums=(0,),
        flops_forward=1.0,
        flops_backward=1.0,
        bytes_forward=2.0 * 256 * 256 * 4,
        peers={"doubled": peer},
        reference="xla",
    )


def test_a_peer_with_variants_reports_its_fastest_and_names_every_one():
    def peer(x):
        return x * 2

    peer.variants = {"slow": _slow, "broken": _broken, "fast": lambda x: x * 2}
    rows = measure(_case(peer), ["peer:doubled"], repeats=2)
    assert [(r.implementation, r.pass_) for r in rows] == [
        ("peer:doubled", "fwd"),
        ("peer:doubled", "fwd+bwd"),
    ]
    for r in rows:
        assert r.ms is not None and r.max_rel_error == 0.0 and r.gbps is not None
        assert r.note.startswith("fast, fastest of 3: slow "), r.note
        assert "; broken unsupported: these sizes do not fit; fast " in r.note


def test_a_peer_whose_variants_all_fail_says_why():
    def peer(x):
        return x * 2

    peer.variants = {"broken": _broken}
    (row,) = measure(_case(peer), ["peer:doubled"], passes=("fwd",), repeats=1)
    assert row.ms is None and row.note == "no variant ran: broken unsupported: these sizes do not fit"
