"""Pure-write and copy rates through torch (vectorised fill and copy kernels) at the MoE dispatch output sizes:
the ceiling of a scatter that writes K rows per row it reads. Run on a CUDA machine with torch:
`OUT=<folder> python3 benchmarks/write_ceiling.py`."""

import json
import os

import torch

res = {}
for name, (T, D, K) in {"e64": (32768, 4096, 8), "dsv3": (8192, 7168, 8)}.items():
    out = torch.empty(T * K, D, dtype=torch.bfloat16, device="cuda")
    src = torch.randn(T * K, D, device="cuda").to(torch.bfloat16)

    def time(f, n=20):
        for _ in range(3):
            f()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(5):
            s.record()
            [f() for _ in range(n)]
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / n)
        ts.sort()
        return ts[len(ts) // 2]

    nb = out.numel() * 2
    fill = time(lambda out=out: out.fill_(1.5))
    zero = time(lambda out=out: out.zero_())
    cp = time(lambda out=out, src=src: out.copy_(src))
    res[name] = dict(write_tbps=nb / fill / 1e9, zero_tbps=nb / zero / 1e9, copy_tbps=2 * nb / cp / 1e9)
    print(name, res[name], flush=True)
json.dump(res, open(os.environ.get("OUT", ".") + "/write_ceiling.json", "w"))
