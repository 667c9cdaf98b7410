// MoE routing as an XLA FFI handler: a stable counting sort of the T*K (token, slot) pairs
// by expert id (DeepEP's layout step, producing where every pair goes).
//
//   rows[p]         row of pair p = t*K + k in the expert-major order, stable by p; pairs
//                   with an id outside [0, E) ("dropped") go after all valid ones, in p order
//   group_sizes[e]  valid pairs per expert (for jax.lax.ragged_dot)
//
// Three kernels over chunks of `chunk` consecutive pairs (at most 32 * kIdsPerLane), with E+1
// buckets (bucket E holds the dropped pairs) and a workspace of (E+1)*chunks + (E+1) int32s,
// the counts bucket-major:
//   count  one block per chunk: a shared-memory histogram -> counts[bucket, chunk]
//   scan   one block: a warp per bucket scans its row of counts over chunks (each lane a run
//          of kScanPerLane chunks, loaded together, then a warp scan), in place, the bucket
//          totals -> group_sizes; then an exclusive scan over buckets -> offsets[bucket]
//   place  one warp per chunk: its ids are loaded into registers first (all in flight), then
//          walked 32 at a time in order; lanes with the same bucket find each other with
//          __match_any_sync and take consecutive rows from a shared-memory cursor, so the order
//          within a bucket is the pair order.
// Bytes: the ids are read twice (count, place) and the rows written once, 12 bytes a pair, plus
// (E+1)·chunks counts written, scanned and read; far below a millisecond's worth of bandwidth, so
// the routing is bound by latency (launches, the scan's single block, the place walk's serial
// steps), not by bytes.
// The scan and the place kernels are launched early (`axkern::launch`): each starts its blocks
// while the one before it runs and waits for it in `wait_for_prior()`, so three short kernels
// cost about one launch latency; `moe_route` is also the first half of AxkernMoeDispatch. The
// place kernel does not release what follows it early: the dispatch's scatter is a grid of 4
// blocks an SM, and with its blocks placed while the place kernel ran the dispatch took 0.778
// ms instead of 0.706 on the H200 (e64 preset).
// The place walk is serial per chunk, so its ids are loaded before it: loaded a step at a time,
// the walk waits on a global load every 32 pairs (about 50 us for 262144 pairs on an H200).
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "launch.cuh"
#include "route.cuh"

namespace ffi = xla::ffi;

namespace {

constexpr int kCountThreads = 256;
constexpr int kScanThreads = 1024;
constexpr int kScanPerLane = 8;  // chunks a lane of the scan loads at once
constexpr int kIdsPerLane = 32;  // a chunk's ids held by each lane of the place warp

__device__ inline int bucket_of(int32_t e, int experts) { return (e < 0 || e >= experts) ? experts : e; }

__global__ void route_count(const int32_t* __restrict__ idx, int64_t pairs, int experts, int64_t chunk,
                            int32_t* __restrict__ counts) {
  axkern::release_dependents();
  extern __shared__ int32_t hist[];
  const int buckets = experts + 1;
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  const int64_t start = blockIdx.x * chunk, end = min(start + chunk, pairs);
  for (int64_t p = start + threadIdx.x; p < end; p += blockDim.x) atomicAdd(&hist[bucket_of(idx[p], experts)], 1);
  __syncthreads();
  for (int b = threadIdx.x; b < buckets; b += blockDim.x)
    counts[static_cast<int64_t>(b) * gridDim.x + blockIdx.x] = hist[b];
}

__global__ void route_scan(int32_t* __restrict__ counts, int64_t chunks, int experts,
                           int32_t* __restrict__ offsets, int32_t* __restrict__ group_sizes) {
  axkern::release_dependents();
  axkern::wait_for_prior();
  const int buckets = experts + 1;
  const int lane = threadIdx.x % 32;
  for (int b = threadIdx.x / 32; b < buckets; b += kScanThreads / 32) {
    int32_t* row = counts + static_cast<int64_t>(b) * chunks;
    int32_t carry = 0;
    for (int64_t base = 0; base < chunks; base += 32 * kScanPerLane) {
      const int64_t mine = base + lane * kScanPerLane;
      int32_t v[kScanPerLane];
#pragma unroll
      for (int j = 0; j < kScanPerLane; ++j) v[j] = mine + j < chunks ? row[mine + j] : 0;
      int32_t sum = 0;
#pragma unroll
      for (int j = 0; j < kScanPerLane; ++j) {
        const int32_t c = v[j];
        v[j] = sum;
        sum += c;
      }
      int32_t inclusive = sum;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += up;
      }
      const int32_t before = carry + inclusive - sum;
#pragma unroll
      for (int j = 0; j < kScanPerLane; ++j)
        if (mine + j < chunks) row[mine + j] = v[j] + before;
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) {
      offsets[b] = carry;
      if (b < experts) group_sizes[b] = carry;
    }
  }
  __syncthreads();
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  int32_t carry = 0;
  for (int base = 0; base < buckets; base += kScanThreads) {
    const int b = base + threadIdx.x;
    const int32_t v = b < buckets ? offsets[b] : 0;
    int32_t before, total;
    Scan(temp).ExclusiveSum(v, before, total);
    if (b < buckets) offsets[b] = before + carry;
    carry += total;
    __syncthreads();
  }
}

__global__ void route_place(const int32_t* __restrict__ idx, int64_t pairs, int experts, int64_t chunk,
                            const int32_t* __restrict__ counts, const int32_t* __restrict__ offsets,
                            int32_t* __restrict__ rows) {
  extern __shared__ int32_t cursor[];
  const int buckets = experts + 1;
  const unsigned lane = threadIdx.x;  // blockDim.x == 32: one warp per chunk
  const int64_t start = blockIdx.x * chunk, end = min(start + chunk, pairs);
  int32_t ids[kIdsPerLane];
#pragma unroll
  for (int j = 0; j < kIdsPerLane; ++j) {
    const int64_t p = start + j * 32 + lane;
    ids[j] = p < end ? idx[p] : -1;
  }
  axkern::wait_for_prior();  // the ids are an input: loaded while the scan runs
  for (int b = lane; b < buckets; b += 32)
    cursor[b] = counts[static_cast<int64_t>(b) * gridDim.x + blockIdx.x] + offsets[b];
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kIdsPerLane; ++j) {
    const int64_t p = start + j * 32 + lane;
    const unsigned active = __ballot_sync(0xffffffffu, p < end);
    if (active == 0) break;
    if (p < end) {
      const int b = bucket_of(ids[j], experts);
      const unsigned peers = __match_any_sync(active, b);
      const int first = __ffs(peers) - 1;
      const int32_t at = cursor[b];
      rows[p] = at + __popc(peers & ((1u << lane) - 1u));
      __syncwarp(active);  // every peer has read the cursor before its first lane moves it
      if (static_cast<int>(lane) == first) cursor[b] = at + __popc(peers);
    }
    __syncwarp();
  }
}

}  // namespace

namespace axkern {

int64_t moe_route_workspace(int64_t pairs, int64_t experts, int64_t chunk) {
  return ((pairs + chunk - 1) / chunk) * (experts + 1) + (experts + 1);
}

const char* moe_route_check(int64_t pairs, int64_t experts, int64_t chunk) {
  if (pairs > INT32_MAX) return "rows are int32: at most 2^31 - 1 pairs";
  if (experts < 1 || (experts + 1) * static_cast<int64_t>(sizeof(int32_t)) > 48 * 1024)
    return "need 1 <= num_experts <= 12287";
  if (chunk < 1 || chunk > 32 * kIdsPerLane) return "chunk must be in [1, 1024]";
  return nullptr;
}

cudaError_t moe_route(cudaStream_t stream, const int32_t* idx, int64_t pairs, int64_t experts, int64_t chunk,
                      int32_t* rows, int32_t* group_sizes, int32_t* workspace, bool chain) {
  if (pairs == 0) return cudaMemsetAsync(group_sizes, 0, experts * sizeof(int32_t), stream);
  const int64_t buckets = experts + 1, chunks = (pairs + chunk - 1) / chunk;
  int32_t* counts = workspace;
  int32_t* offsets = counts + chunks * buckets;
  const int e = static_cast<int>(experts);
  const size_t smem = buckets * sizeof(int32_t);
  const dim3 grid(static_cast<unsigned>(chunks));
  cudaError_t err = launch(route_count, grid, kCountThreads, smem, stream, false, idx, pairs, e, chunk, counts);
  if (err == cudaSuccess)
    err = launch(route_scan, 1, kScanThreads, 0, stream, chain, counts, chunks, e, offsets, group_sizes);
  if (err == cudaSuccess)
    err = launch(route_place, grid, 32, smem, stream, chain, idx, pairs, e, chunk, counts, offsets, rows);
  return err;
}

}  // namespace axkern

namespace {

ffi::Error RouteImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> idx, int64_t num_experts, int64_t chunk,
                     ffi::Result<ffi::Buffer<ffi::S32>> rows, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                     ffi::Result<ffi::Buffer<ffi::S32>> workspace) {
  const int64_t pairs = static_cast<int64_t>(idx.element_count());
  if (const char* bad = axkern::moe_route_check(pairs, num_experts, chunk))
    return ffi::Error::InvalidArgument(std::string("AxkernMoeRoute: ") + bad);
  if (static_cast<int64_t>(rows->element_count()) != pairs ||
      static_cast<int64_t>(group_sizes->element_count()) != num_experts)
    return ffi::Error::InvalidArgument("AxkernMoeRoute: rows must hold one entry per pair, group_sizes one per expert");
  if (static_cast<int64_t>(workspace->element_count()) != axkern::moe_route_workspace(pairs, num_experts, chunk))
    return ffi::Error::InvalidArgument("AxkernMoeRoute: workspace must hold (E+1)*chunks + (E+1) int32s");
  cudaError_t err = axkern::moe_route(stream, idx.typed_data(), pairs, num_experts, chunk, rows->typed_data(),
                                      group_sizes->typed_data(), workspace->typed_data(), axkern::chains_launches());
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("AxkernMoeRoute: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernMoeRoute, RouteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("chunk")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
