"""`axkern.bench.peers`' timing logic against a stand-in `torch` (no GPU here): the faster of
back-to-back eager calls and a CUDA graph's replays, and what the note says."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest

from axkern.bench import peers


def _fake_torch(eager_ms, graph_ms, capture_fails=False):
    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, end):
            return end.t - self.t

    class Graph:
        def replay(self):
            clock[0] += graph_ms

    @contextlib.contextmanager
    def capture(graph):
        if capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        yield

    cuda = types.SimpleNamespace(
        Event=Event,
        CUDAGraph=Graph,
        graph=capture,
        Stream=lambda: types.SimpleNamespace(wait_stream=lambda s: None),
        stream=lambda s: contextlib.nullcontext(),
        current_stream=lambda: types.SimpleNamespace(wait_stream=lambda s: None),
        synchronize=lambda: None,
        empty_cache=lambda: None,
        reset_peak_memory_stats=lambda: None,
        memory_allocated=lambda: 0,
        max_memory_allocated=lambda: 2**30,
    )
    torch = types.SimpleNamespace(cuda=cuda, no_grad=contextlib.nullcontext)

    def call(backward):
        clock[0] += eager_ms * (2 if backward else 1)

    return torch, call


@pytest.mark.parametrize(
    "eager, graph, fails, want, says",
    [
        (2.0, 1.5, False, 1.5, "CUDA graph replays (back-to-back eager calls 2.000 ms)"),
        (1.0, 1.5, False, 1.0, "back-to-back eager calls (CUDA graph replays 1.500 ms)"),
        (1.0, 0.5, True, 1.0, "back-to-back eager calls; no CUDA graph (RuntimeError"),
    ],
)
def test_the_peer_takes_the_faster_of_eager_calls_and_graph_replays(
    monkeypatch, eager, graph, fails, want, says
):
    torch, call = _fake_torch(eager, graph, fails)
    monkeypatch.setitem(sys.modules, "torch", torch)
    got = peers._measure(call, [], "fwd", repeats=3)
    assert got["ms"] == pytest.approx(want) and got["ms_min"] == pytest.approx(want)
    assert got["note"].startswith(says) and got["temp_gib"] == pytest.approx(1.0)
    rows = peers._timed_rows("p", call, [], repeats=2)
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    # the backward's eager calls take twice as long here; its graph replays as long as the forward's
    assert rows[1]["ms"] == pytest.approx(min(2 * eager, graph) if not fails else 2 * eager)
    # a capture that failed is not tried again for the same peer
    assert ("a capture failed before" in rows[1]["note"]) == fails
