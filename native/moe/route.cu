// MoE routing as an XLA FFI handler: a stable counting sort of the T*K (token, slot) pairs
// by expert id (DeepEP's layout step, producing where every pair goes).
//
//   rows[p]         row of pair p = t*K + k in the expert-major order, stable by p; pairs
//                   with an id outside [0, E) ("dropped") go after all valid ones, in p order
//   group_sizes[e]  valid pairs per expert (for jax.lax.ragged_dot)
//
// Three kernels over chunks of `chunk` consecutive pairs, with E+1 buckets (bucket E holds
// the dropped pairs) and a workspace of chunks*(E+1) + (E+1) int32s:
//   count  one block per chunk: a shared-memory histogram -> counts[chunk, bucket]
//   scan   one block: per bucket an exclusive scan over chunks (in place), the bucket
//          totals -> group_sizes, and an exclusive scan over buckets -> offsets[bucket]
//   place  one warp per chunk walks its pairs 32 at a time in order; lanes with the same
//          bucket find each other with __match_any_sync and take consecutive rows from a
//          shared-memory cursor, so the order within a bucket is the pair order.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "launch.cuh"

namespace ffi = xla::ffi;

namespace {

constexpr int kCountThreads = 256;
constexpr int kScanThreads = 1024;

__device__ inline int bucket_of(int32_t e, int experts) { return (e < 0 || e >= experts) ? experts : e; }

__global__ void route_count(const int32_t* __restrict__ idx, int64_t pairs, int experts, int64_t chunk,
                            int32_t* __restrict__ counts) {
  extern __shared__ int32_t hist[];
  const int buckets = experts + 1;
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  const int64_t start = blockIdx.x * chunk, end = min(start + chunk, pairs);
  for (int64_t p = start + threadIdx.x; p < end; p += blockDim.x) atomicAdd(&hist[bucket_of(idx[p], experts)], 1);
  __syncthreads();
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) counts[static_cast<int64_t>(blockIdx.x) * buckets + b] = hist[b];
}

__global__ void route_scan(int32_t* __restrict__ counts, int64_t chunks, int experts,
                           int32_t* __restrict__ offsets, int32_t* __restrict__ group_sizes) {
  const int buckets = experts + 1;
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) {
    int32_t run = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t v = counts[c * buckets + b];
      counts[c * buckets + b] = run;
      run += v;
    }
    offsets[b] = run;
    if (b < experts) group_sizes[b] = run;
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
  for (int b = lane; b < buckets; b += 32) cursor[b] = counts[static_cast<int64_t>(blockIdx.x) * buckets + b] + offsets[b];
  __syncwarp();
  const int64_t start = blockIdx.x * chunk, end = min(start + chunk, pairs);
  for (int64_t p0 = start; p0 < end; p0 += 32) {
    const int64_t p = p0 + lane;
    const unsigned active = __ballot_sync(0xffffffffu, p < end);
    if (p < end) {
      const int b = bucket_of(idx[p], experts);
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

ffi::Error RouteImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> idx, int64_t num_experts, int64_t chunk,
                     ffi::Result<ffi::Buffer<ffi::S32>> rows, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                     ffi::Result<ffi::Buffer<ffi::S32>> workspace) {
  const int64_t pairs = static_cast<int64_t>(idx.element_count());
  const int64_t buckets = num_experts + 1;
  if (num_experts < 1 || buckets * sizeof(int32_t) > 48 * 1024)
    return ffi::Error::InvalidArgument("AxkernMoeRoute: need 1 <= num_experts <= 12287");
  if (chunk < 1) return ffi::Error::InvalidArgument("AxkernMoeRoute: chunk must be positive");
  const int64_t chunks = (pairs + chunk - 1) / chunk;
  if (static_cast<int64_t>(workspace->element_count()) != chunks * buckets + buckets)
    return ffi::Error::InvalidArgument("AxkernMoeRoute: workspace must hold chunks*(E+1) + (E+1) int32s");
  if (pairs == 0) {
    cudaMemsetAsync(group_sizes->typed_data(), 0, group_sizes->size_bytes(), stream);
    return ffi::Error::Success();
  }
  int32_t* counts = workspace->typed_data();
  int32_t* offsets = counts + chunks * buckets;
  const int e = static_cast<int>(num_experts);
  const size_t smem = buckets * sizeof(int32_t);
  route_count<<<chunks, kCountThreads, smem, stream>>>(idx.typed_data(), pairs, e, chunk, counts);
  route_scan<<<1, kScanThreads, 0, stream>>>(counts, chunks, e, offsets, group_sizes->typed_data());
  route_place<<<chunks, 32, smem, stream>>>(idx.typed_data(), pairs, e, chunk, counts, offsets, rows->typed_data());
  cudaError_t err = cudaGetLastError();
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
