"""The copy rate between every ordered pair of this host's GPUs (`cudaMemcpyPeerAsync`, through
PyTorch's `Tensor.copy_` with peer access), the ceiling the expert-parallel transport is held
to (docs/ops/moe_ep.md). Each pair: a 1 GiB buffer copied `--repeats` times after a warm-up,
timed by CUDA events on the source's stream; the median and the spread. Also each GPU's own
device-to-device copy, for scale.

    OUT=<folder> python3 benchmarks/peer_copy.py [--mib 1024] [--repeats 10]

writes `$OUT/peer_copy.json`; run it in its own process (PyTorch takes the GPUs' memory it
touches), before or after the JAX runs it is compared with.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from pathlib import Path


def _rate(torch, src, dst, nbytes, repeats):
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    with torch.cuda.device(src):
        b.copy_(a)  # warm-up (and peer access, where it is enabled on first use)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    gbps = sorted(nbytes / t / 1e9 for t in times)
    return {
        "src": src,
        "dst": dst,
        "gbps_median": statistics.median(gbps),
        "gbps_min": gbps[0],
        "gbps_max": gbps[-1],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    import torch

    n = torch.cuda.device_count()
    nbytes = a.mib << 20
    pairs = []
    for src in range(n):
        for dst in range(n):
            access = src == dst or torch.cuda.can_device_access_peer(src, dst)
            row = _rate(torch, src, dst, nbytes, a.repeats)
            row["peer_access"] = bool(access)
            pairs.append(row)
            print(f"GPU {src} -> GPU {dst}: {row['gbps_median']:.0f} GB/s (peer access {access})", flush=True)
    out = {
        "command": f"python3 benchmarks/peer_copy.py --mib {a.mib} --repeats {a.repeats}",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0),
        "gpus": n,
        "bytes": nbytes,
        "pairs": pairs,
    }
    folder = Path(os.environ.get("OUT", "."))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "peer_copy.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
