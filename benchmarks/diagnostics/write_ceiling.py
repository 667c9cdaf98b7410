"""Pure-write and copy rates through torch (vectorised fill and copy kernels) at the MoE dispatch output sizes:
the ceiling of a scatter that writes K rows per row it reads. Where CuPy is importable, also a
store-only kernel of our own (16-byte stores, plain and streaming `st.global.cs`, grid-stride
over 1-32 blocks per SM), so the ceiling does not rest on torch's fill kernel alone. Run on a
CUDA machine with torch: `OUT=<folder> python3 benchmarks/diagnostics/write_ceiling.py`."""

import json
import os

import torch

STORE = r"""
extern "C" __global__ void store(uint4* out, long long n, int streaming) {
  const uint4 v = make_uint4(threadIdx.x, 1u, 2u, 3u);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    if (streaming) __stcs(out + i, v); else out[i] = v;
  }
}"""


def time(f, n=20):
    """Median ms of one call over 5 samples of `n` back-to-back calls (CUDA events)."""
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


def store_rates(out) -> dict:
    """TB/s of our own 16-byte store kernel over `out`, plain and streaming, by blocks per SM."""
    try:
        import cupy
    except ImportError:
        return {}
    kernel = cupy.RawKernel(STORE, "store")
    buf = cupy.from_dlpack(out.view(torch.int32))
    nb = out.numel() * out.element_size()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rates = {}
    for streaming in (0, 1):
        for per_sm in (1, 2, 4, 8, 16, 32):
            args = (buf, cupy.int64(nb // 16), cupy.int32(streaming))
            ms = time(lambda g=sms * per_sm, a=args: kernel((g,), (256,), a))
            rates[f"{'cs' if streaming else 'plain'}_{per_sm}"] = nb / ms / 1e9
    best = {
        "store_tbps": max(v for k, v in rates.items() if k.startswith("plain")),
        "store_cs_tbps": max(v for k, v in rates.items() if k.startswith("cs")),
    }
    return {**best, "store_by_blocks_per_sm": rates}


def main():
    res = {}
    for name, (T, D, K) in {"e64": (32768, 4096, 8), "dsv3": (8192, 7168, 8)}.items():
        out = torch.empty(T * K, D, dtype=torch.bfloat16, device="cuda")
        src = torch.randn(T * K, D, device="cuda").to(torch.bfloat16)
        nb = out.numel() * 2
        fill = time(lambda out=out: out.fill_(1.5))
        zero = time(lambda out=out: out.zero_())
        cp = time(lambda out=out, src=src: out.copy_(src))
        res[name] = dict(write_tbps=nb / fill / 1e9, zero_tbps=nb / zero / 1e9, copy_tbps=2 * nb / cp / 1e9)
        res[name].update(store_rates(out))
        print(name, res[name], flush=True)
    json.dump(res, open(os.environ.get("OUT", ".") + "/write_ceiling.json", "w"))


if __name__ == "__main__":
    main()
