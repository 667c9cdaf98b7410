"""PyTorch peers for `axkern bench --peers`: the kernels users would pick instead, timed on the
same shapes in the same command, so ratios come from one run.

The peers run in a subprocess started before JAX takes the GPU (JAX preallocates most of its
memory), one JSON object per line on stdout:

    python -m axkern.bench.peers fused_cross_entropy --dims '{"tokens": 16384, ...}' --dtype bfloat16

`fused_cross_entropy` peers: Liger-Kernel's `LigerFusedLinearCrossEntropyLoss`,
cut-cross-entropy's `linear_cross_entropy`, and plain PyTorch (`F.cross_entropy` on
materialised float32 logits); mean reduction, random inputs of the case's shapes. Time: the
faster of back-to-back eager calls and a CUDA graph's replays, after warm-up, median of repeats
(`_measure`). Memory: the peak allocated during a call beyond what was allocated before it,
less the gradients it returns.
A peer that is not importable (or no CUDA) is reported with the reason, not timed.

`ssd` peer: mamba_ssm's Triton `mamba_chunk_scan_combined` (chunks of the case's chunk size,
`dt_softplus=True`, 16-bit x, dt, B, C and float32 A as `axkern bench ssd` draws them; the
backward a random cotangent of the output pulled back to x, dt, B, C).

`mamba3` peer: mamba_ssm's Triton `mamba3_siso_combined` (SISO only; its MIMO kernels are
TileLang, not among the peers), importable when the `mamba_ssm` package (its Triton kernels
alone are enough) is on the subprocess's `PYTHONPATH`. Inputs drawn as `axkern bench mamba3`
draws them (16-bit q, k, v; float32 decay, step, trapezoid and angles; biases of ones); the
backward pulls a random cotangent back through the output, like the bench's JAX rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

__all__ = ["PEERS", "run"]

_CE_PEERS = ("liger", "cut_cross_entropy", "torch")
# each times the mean loss forward and forward+backward; both cross-entropy ops compare with them
PEERS = {
    "fused_cross_entropy": _CE_PEERS,
    "fused_cross_entropy_loss": _CE_PEERS,
    "mamba3": ("mamba_ssm",),
    "ssd": ("mamba_ssm",),
}


def _ce_functions():
    import torch.nn.functional as F

    fns, missing = {}, {}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        fns["liger"] = lambda x, w, y: liger(w, x, y)
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to report
        missing["liger"] = f"{type(e).__name__}: {e}"
    try:
        from cut_cross_entropy import linear_cross_entropy

        fns["cut_cross_entropy"] = lambda x, w, y: linear_cross_entropy(x, w, y)
    except Exception as e:  # noqa: BLE001
        missing["cut_cross_entropy"] = f"{type(e).__name__}: {e}"
    fns["torch"] = lambda x, w, y: F.cross_entropy((x @ w.T).float(), y)
    return fns, missing


def _measure(call, leaves, pass_, repeats, graphs=True):
    """The time of `call(backward)` and its temporary GiB; `leaves` are the tensors whose
    gradients a backward leaves behind (not counted as temporary). Timed as `axkern bench` times
    ours (`bench.time_spread`: each sample enough back-to-back calls for about 20 ms between two
    CUDA events, so one call's launch latency is not counted), and again as the replays of a
    CUDA graph of one call, which takes the host out; the faster of the two (median over the
    samples) is the peer's time, the note says which. `graphs=False`: eager calls only (a capture
    that failed once is not tried again: it can leave the stream unusable)."""
    import torch

    backward = pass_ == "fwd+bwd"

    def once():
        for t in leaves:
            t.grad = None
        if backward:
            call(True)
        else:
            with torch.no_grad():
                call(False)

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    once()
    torch.cuda.synchronize()
    grads = sum(t.numel() * t.element_size() for t in leaves) if backward else 0
    temp = (torch.cuda.max_memory_allocated() - base - grads) / 2**30
    eager = _samples(once, repeats)
    graph, why = None, "no CUDA graph (a capture failed before)"
    if graphs:
        try:
            replay = _graph(once)
        except Exception as e:  # noqa: BLE001 - a peer that cannot be captured is timed eagerly
            why = f"no CUDA graph ({type(e).__name__}: {str(e)[:80]})"
        else:
            graph, why = _samples(replay, repeats), ""
            del replay
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pick = graph if graph is not None and statistics.median(graph) < statistics.median(eager) else eager
    if pick is graph:
        note = f"CUDA graph replays (back-to-back eager calls {statistics.median(eager):.3f} ms)"
    else:
        note = "back-to-back eager calls" + (
            f" (CUDA graph replays {statistics.median(graph):.3f} ms)" if graph is not None else f"; {why}"
        )
    return {
        "ms": statistics.median(pick),
        "ms_min": min(pick),
        "ms_max": max(pick),
        "temp_gib": temp,
        "note": note,
    }


def _samples(run, repeats, batch_s=0.02):
    """ms per `run()` over `repeats` samples, each enough back-to-back runs for about `batch_s`
    seconds between two CUDA events."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    inner = max(1, min(200, int(batch_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return times


def _graph(once):
    """`once` captured as a CUDA graph (after warm-up runs on a side stream, as PyTorch asks):
    its `replay`."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            once()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        once()
    return graph.replay


def _timed_rows(name, call, leaves, repeats):
    import torch

    out, graphs = [], True
    for pass_ in ("fwd", "fwd+bwd"):
        try:
            out.append({"peer": name, "pass": pass_, **_measure(call, leaves, pass_, repeats, graphs)})
            graphs = graphs and "no CUDA graph" not in out[-1]["note"]
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: report, go on
            out.append({"peer": name, "pass": pass_, "note": f"{type(e).__name__}: {str(e)[:160]}"})
            torch.cuda.empty_cache()
    return out


def _fused_cross_entropy(dims, dtype, repeats):
    import torch

    if not torch.cuda.is_available():
        return [{"peer": p, "note": "no CUDA device for torch"} for p in _CE_PEERS]
    n, d, v = dims["tokens"], dims["embed"], dims["vocab"]
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, d, device="cuda", dtype=dt, generator=gen)
    w = torch.randn(v, d, device="cuda", dtype=dt, generator=gen) * d**-0.5
    y = torch.randint(0, v, (n,), device="cuda", generator=gen)
    fns, missing = _ce_functions()
    out = [{"peer": p, "note": f"not importable: {why}"} for p, why in missing.items()]
    for name, fn in fns.items():
        xs, ws = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

        def call(backward, fn=fn, xs=xs, ws=ws):
            loss = fn(xs, ws, y) if backward else fn(xs.detach(), ws.detach(), y)
            if backward:
                loss.backward()

        out += _timed_rows(name, call, (xs, ws), repeats)
    return out


def _mamba3(dims, dtype, repeats):
    import torch

    if dims.get("rank", 0):
        return [{"peer": "mamba_ssm", "note": "mamba_ssm's MIMO kernels (TileLang) are not among the peers"}]
    if not torch.cuda.is_available():
        return [{"peer": "mamba_ssm", "note": "no CUDA device for torch"}]
    try:
        from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to report
        return [{"peer": "mamba_ssm", "note": f"not importable: {type(e).__name__}: {e}"}]
    b, l, h, p, n = (dims[k] for k in ("batch", "length", "heads", "head_dim", "state"))
    g, a, q = dims["groups"], dims["angles"], dims["chunk"]
    dt, f32 = getattr(torch, dtype), torch.float32
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape, dtype=f32: torch.randn(*shape, device="cuda", generator=gen).to(dtype)  # noqa: E731
    leaves = [
        rand(b, l, g, n, dtype=dt),
        rand(b, l, g, n, dtype=dt),
        rand(b, l, h, p, dtype=dt),
        -torch.nn.functional.softplus(rand(b, h, l)),
        torch.nn.functional.softplus(rand(b, h, l) - 2),
        rand(b, h, l),
    ]
    leaves = [t.requires_grad_(True) for t in leaves]
    fixed = (torch.ones(h, n, device="cuda"), torch.ones(h, n, device="cuda"), rand(b, l, h, a))
    cot = rand(b, l, h, p, dtype=dt)

    def call(backward):
        out = mamba3_siso_combined(*leaves, *fixed, chunk_size=q)
        if backward:
            out.backward(cot)

    return _timed_rows("mamba_ssm", call, leaves, repeats)


def _ssd(dims, dtype, repeats):
    import torch

    if not torch.cuda.is_available():
        return [{"peer": "mamba_ssm", "note": "no CUDA device for torch"}]
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to report
        return [{"peer": "mamba_ssm", "note": f"not importable: {type(e).__name__}: {e}"}]
    b, l, h, p, n = (dims[k] for k in ("batch", "length", "heads", "head_dim", "state"))
    g, q = dims.get("groups", 1), dims.get("chunk", 256)
    dt, f32 = getattr(torch, dtype), torch.float32
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape, dtype=f32: torch.randn(*shape, device="cuda", generator=gen).to(dtype)  # noqa: E731
    x, step = rand(b, l, h, p, dtype=dt), rand(b, l, h, dtype=dt)
    B, C = rand(b, l, g, n, dtype=dt), rand(b, l, g, n, dtype=dt)
    leaves = [t.requires_grad_(True) for t in (x, step, B, C)]
    A = -torch.exp(rand(h))
    cot = rand(b, l, h, p, dtype=dt)

    def call(backward):
        out = mamba_chunk_scan_combined(x, step, A, B, C, q, dt_softplus=True)
        if backward:
            out.backward(cot)

    return _timed_rows("mamba_ssm", call, leaves, repeats)


_RUNNERS = {
    "fused_cross_entropy": _fused_cross_entropy,
    "fused_cross_entropy_loss": _fused_cross_entropy,
    "mamba3": _mamba3,
    "ssd": _ssd,
}


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m axkern.bench.peers")
    p.add_argument("op", choices=sorted(PEERS))
    p.add_argument("--dims", required=True, help="the case's dims as JSON")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError as e:
        rows = [{"peer": peer, "note": f"torch not importable: {e}"} for peer in PEERS[a.op]]
    else:
        rows = _RUNNERS[a.op](json.loads(a.dims), a.dtype, a.repeats)
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0


def run(op: str, dims: dict, dtype: str, *, repeats: int = 10, timeout: float = 1800) -> list[dict]:
    """Time `op`'s peers on `dims` in a subprocess; `[]` when the op has none."""
    if op not in PEERS:
        return []
    cmd = [sys.executable, "-m", "axkern.bench.peers", op, "--dims", json.dumps(dims), "--dtype", dtype]
    cmd += ["--repeats", str(repeats)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"peer": p, "note": f"timed out after {timeout:.0f} s"} for p in PEERS[op]]
    rows = []
    for line in proc.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not rows:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        rows = [{"peer": p, "note": f"peer run failed (exit {proc.returncode}): {why}"} for p in PEERS[op]]
    return rows


if __name__ == "__main__":
    raise SystemExit(_main())
