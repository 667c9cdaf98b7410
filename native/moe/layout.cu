// MoE layout counts as an XLA FFI handler (DeepEP's get_dispatch_layout):
//   tokens_per_expert[e]  routed (token, slot) pairs per expert
//   (per-expert and per-rank counts are block-local shared-memory histograms, then one
//   global atomic per counter per block)
//   tokens_per_rank[r]    tokens with at least one expert on rank r (experts split evenly)
//   is_token_in_rank[t,r] whether token t sends anything to rank r
//   dropped               pairs whose expert id is outside [0, num_experts)
// One thread per token; ranks are tracked in a 64-bit mask, so num_ranks <= 64.
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "launch.cuh"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxSharedExperts = 4096;
constexpr int64_t kMaxRanks = 64;

__global__ void layout_kernel(const int32_t* __restrict__ idx, int64_t tokens, int64_t topk, int64_t experts,
                              int64_t ranks, int32_t* __restrict__ per_expert, int32_t* __restrict__ per_rank,
                              bool* __restrict__ in_rank, int32_t* __restrict__ dropped) {
  extern __shared__ int32_t counters[];  // [kMaxRanks] per-rank, then [experts] per-expert when they fit
  int32_t* rank_hist = counters;
  int32_t* hist = counters + kMaxRanks;
  const bool shared = experts <= kMaxSharedExperts;
  for (int64_t r = threadIdx.x; r < ranks; r += blockDim.x) rank_hist[r] = 0;
  if (shared)
    for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t per_rank_experts = experts / ranks;
  int32_t bad = 0;
  for (int64_t t = blockIdx.x * blockDim.x + threadIdx.x; t < tokens; t += gridDim.x * blockDim.x) {
    uint64_t mask = 0;
    for (int64_t k = 0; k < topk; ++k) {
      const int32_t e = idx[t * topk + k];
      if (e < 0 || e >= experts) {
        ++bad;
        continue;
      }
      if (shared) atomicAdd(&hist[e], 1);
      else atomicAdd(&per_expert[e], 1);
      mask |= uint64_t{1} << (e / per_rank_experts);
    }
    for (int64_t r = 0; r < ranks; ++r) {
      const bool hit = (mask >> r) & 1u;
      in_rank[t * ranks + r] = hit;
      if (hit) atomicAdd(&rank_hist[r], 1);
    }
  }
  if (bad) atomicAdd(dropped, bad);
  __syncthreads();
  for (int64_t r = threadIdx.x; r < ranks; r += blockDim.x)
    if (rank_hist[r]) atomicAdd(&per_rank[r], rank_hist[r]);
  if (shared)
    for (int64_t e = threadIdx.x; e < experts; e += blockDim.x)
      if (hist[e]) atomicAdd(&per_expert[e], hist[e]);
}

ffi::Error LayoutImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> idx, int64_t num_experts, int64_t num_ranks,
                      ffi::Result<ffi::Buffer<ffi::S32>> per_expert, ffi::Result<ffi::Buffer<ffi::S32>> per_rank,
                      ffi::Result<ffi::Buffer<ffi::PRED>> in_rank, ffi::Result<ffi::Buffer<ffi::S32>> dropped) {
  if (num_ranks < 1 || num_ranks > kMaxRanks || num_experts % num_ranks)
    return ffi::Error::InvalidArgument("AxkernMoeLayout: need 1 <= num_ranks <= 64 dividing num_experts");
  const auto dims = idx.dimensions();
  const int64_t tokens = dims[0], topk = dims[1];
  cudaMemsetAsync(per_expert->typed_data(), 0, per_expert->size_bytes(), stream);
  cudaMemsetAsync(per_rank->typed_data(), 0, per_rank->size_bytes(), stream);
  cudaMemsetAsync(dropped->typed_data(), 0, dropped->size_bytes(), stream);
  const size_t smem = (kMaxRanks + (num_experts <= kMaxSharedExperts ? num_experts : 0)) * sizeof(int32_t);
  layout_kernel<<<axkern::grid_for(tokens, kThreads, 4), kThreads, smem, stream>>>(
      idx.typed_data(), tokens, topk, num_experts, num_ranks, per_expert->typed_data(), per_rank->typed_data(),
      in_rank->typed_data(), dropped->typed_data());
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("AxkernMoeLayout: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernMoeLayout, LayoutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
