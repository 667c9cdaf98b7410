"""Row scatters of the MoE dispatch's shape against the store ceiling: which way of writing a
token's K rows reaches the rate of plain sequential stores. A diagnostic for
`native/moe/scatter.cu`, not a bench table.

`out[rows[t*K + k]] = x[t]` for T tokens of D bf16 values, K = 8 pairs a token routed to 64
experts at random (top-8 of random scores) and placed in expert order (a stable sort), as
`axkern.moe_dispatch` lays them out. Bytes counted as the bench counts them: `T·D` read and
`T·K·D` written. Kernels (CuPy, 16-byte units, each checked bit for bit against torch's
indexed copy):

- `store`: sequential 16-byte stores of the whole output (no reads): the ceiling;
- `block_token`: a block of 128 threads a token, each unit loaded once and stored K times
  (the thread path of scatter.cu), 4 or 16 blocks per SM;
- `warp_token`: a warp a token, each lane loading all of its units first (all loads in
  flight), then storing them to the K rows in turn, plain or streaming (`st.global.cs`)
  stores, 8 to 32 warps per SM;
- `row_major`: a warp an output row, reading its token's row (K times the reads, written in
  output order);
- `bulk`: the copy engine (one warp a block, lane 0 driving it): a token's row into a
  shared-memory ring of 4 rows by one bulk load, out by K bulk stores, 2 or 4 blocks per SM.

Run on a CUDA machine with torch and CuPy: `OUT=<folder> python3 benchmarks/diagnostics/scatter_patterns.py`
(writes `$OUT/sweep_scatter_patterns.json`).
"""

from __future__ import annotations

import json
import os

import torch
from write_ceiling import STORE, time

KERNELS = r"""
#define UNITS (ROW_BYTES / 16)
#define PER_LANE (UNITS / 32)

extern "C" __global__ void block_token(const uint4* __restrict__ x, const int* __restrict__ rows,
                                      uint4* __restrict__ out, long long tokens, int streaming) {
  for (long long t = blockIdx.x; t < tokens; t += gridDim.x) {
    long long row[K];
    for (int k = 0; k < K; ++k) row[k] = rows[t * K + k];
    for (int i = threadIdx.x; i < UNITS; i += blockDim.x) {
      const uint4 v = x[t * UNITS + i];
      for (int k = 0; k < K; ++k) {
        uint4* p = out + row[k] * UNITS + i;
        if (streaming) __stcs(p, v); else *p = v;
      }
    }
  }
}

extern "C" __global__ void warp_token(const uint4* __restrict__ x, const int* __restrict__ rows,
                                     uint4* __restrict__ out, long long tokens, int streaming) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; t < tokens; t += warps) {
    uint4 v[PER_LANE];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) v[u] = x[t * UNITS + u * 32 + lane];
    const int mine = lane < K ? rows[t * K + lane] : 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const long long row = __shfl_sync(0xffffffffu, mine, k);
#pragma unroll
      for (int u = 0; u < PER_LANE; ++u) {
        uint4* p = out + row * UNITS + u * 32 + lane;
        if (streaming) __stcs(p, v[u]); else *p = v[u];
      }
    }
  }
}

extern "C" __global__ void row_major(const uint4* __restrict__ x, const int* __restrict__ token_of_row,
                                    uint4* __restrict__ out, long long out_rows) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < out_rows; r += warps) {
    const long long t = token_of_row[r];
    uint4 v[PER_LANE];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) v[u] = x[t * UNITS + u * 32 + lane];
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) __stcs(out + r * UNITS + u * 32 + lane, v[u]);
  }
}
extern "C" __global__ void __launch_bounds__(32) bulk(const char* __restrict__ x, const int* __restrict__ rows,
                                                     char* __restrict__ out, long long tokens) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);
  unsigned char* ring = smem + 128;
  if (threadIdx.x != 0) return;
  for (int s = 0; s < STAGES; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"((unsigned)__cvta_generic_to_shared(&bar[s])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const long long first = blockIdx.x, step = gridDim.x;
  const long long n = first < tokens ? (tokens - 1 - first) / step + 1 : 0;
  auto load = [&](long long i) {
    const int s = (int)(i % STAGES);
    const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(ROW_BYTES) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"((unsigned)__cvta_generic_to_shared(ring + s * ROW_BYTES)), "l"(x + (first + i * step) * ROW_BYTES),
                 "r"(ROW_BYTES), "r"(b) : "memory");
  };
  for (long long i = 0; i < n && i < STAGES; ++i) load(i);
  for (long long i = 0; i < n; ++i) {
    const int s = (int)(i % STAGES);
    const long long t = first + i * step;
    int row[K];
    for (int k = 0; k < K; ++k) row[k] = rows[t * K + k];
    const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
    const unsigned parity = (unsigned)((i / STAGES) & 1);
    asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n"
                 ::"r"(b), "r"(parity) : "memory");
    for (int k = 0; k < K; ++k)
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(out + (long long)row[k] * ROW_BYTES),
                   "r"((unsigned)__cvta_generic_to_shared(ring + s * ROW_BYTES)), "r"(ROW_BYTES) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (i >= 1 && i - 1 + STAGES < n) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(i - 1 + STAGES);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def routing(tokens: int, experts: int, topk: int, seed: int = 0):
    """`rows [T·K]` int32, the output row of each (token, k) pair in expert order, and its inverse
    `token_of_row [T·K]`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand(tokens, experts, device="cuda", generator=g).topk(topk, dim=1).indices.reshape(-1)
    order = torch.argsort(idx, stable=True)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device="cuda")
    return rows.to(torch.int32), (order // topk).to(torch.int32)


def sweep(name, tokens, hidden, experts, topk):
    import cupy

    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    rows, token_of_row = routing(tokens, experts, topk)
    want = torch.empty(tokens * topk, hidden, dtype=x.dtype, device="cuda")
    want[rows.long()] = x.repeat_interleave(topk, dim=0)
    out = torch.empty_like(want)
    row_bytes = hidden * 2
    opts = ("-std=c++17", f"-DROW_BYTES={row_bytes}", f"-DK={topk}", "-DSTAGES=4")
    mod = cupy.RawModule(code=KERNELS, options=opts)
    cx, crows, ctok, cout = (cupy.from_dlpack(a.view(torch.int32)) for a in (x, rows, token_of_row, out))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes = (tokens + tokens * topk) * row_bytes
    res = {"tokens": tokens, "hidden": hidden, "experts": experts, "topk": topk, "bytes": nbytes, "rates": {}}

    def record(key, fn, check=True):
        out.zero_()
        fn()
        torch.cuda.synchronize()
        exact = bool(torch.equal(out, want)) if check else None
        ms = time(fn)
        res["rates"][key] = {"ms": ms, "tbps": nbytes / ms / 1e9, "exact": exact}
        print(name, key, res["rates"][key], flush=True)

    store = cupy.RawKernel(STORE, "store")
    record(
        "store",
        lambda: store((sms,), (256,), (cout, cupy.int64(out.numel() * 2 // 16), cupy.int32(1))),
        False,
    )
    block_token, warp_token, row_major = (
        mod.get_function(k) for k in ("block_token", "warp_token", "row_major")
    )
    for per_sm in (4, 16):
        for cs in (0, 1):
            args = (cx, crows, cout, cupy.int64(tokens), cupy.int32(cs))
            record(
                f"block_token_{per_sm}_{'cs' if cs else 'plain'}",
                lambda a=args, g=sms * per_sm: block_token((g,), (128,), a),
            )
    for warps_per_sm in (8, 16, 32):
        for cs in (0, 1):
            args = (cx, crows, cout, cupy.int64(tokens), cupy.int32(cs))
            grid = sms * warps_per_sm // 4
            record(
                f"warp_token_{warps_per_sm}_{'cs' if cs else 'plain'}",
                lambda a=args, g=grid: warp_token((g,), (128,), a),
            )
    args = (cx, ctok, cout, cupy.int64(tokens * topk))
    record("row_major_16", lambda a=args: row_major((sms * 4,), (128,), a))
    bulk = mod.get_function("bulk")
    smem = 128 + 4 * row_bytes
    bulk.max_dynamic_shared_size_bytes = smem
    for per_sm in (2, 4):
        args = (cx, crows, cout, cupy.int64(tokens))
        record(f"bulk_{per_sm}", lambda a=args, g=sms * per_sm: bulk((g,), (32,), a, shared_mem=smem))
    return res


def main():
    cases = {"e64": (32768, 4096, 64, 8), "dsv3": (8192, 7168, 256, 8)}
    res = {
        "command": "OUT=<folder> python3 benchmarks/diagnostics/scatter_patterns.py",
        "device": torch.cuda.get_device_name(0),
        "note": "TB/s count T*D read plus T*K*D written (bf16), as axkern bench counts dispatch's bytes; "
        "'store' writes only; exact: the output equals torch's indexed copy bit for bit",
        "cases": {name: sweep(name, *shape) for name, shape in cases.items()},
    }
    json.dump(res, open(os.environ.get("OUT", ".") + "/sweep_scatter_patterns.json", "w"), indent=1)


if __name__ == "__main__":
    main()
