// AxkernMoeDispatch: the routing counting sort (route.cu) and then dispatch's row scatter, in
// one handler (dispatch's backward is AxkernMoeGatherSum, moe.cu).
//
//   rows, group_sizes = route(ids)
//   out[rows[t*K+k], :] = 0 <= ids[t*K+k] < num_experts ? x[t, :] : 0
//
// The scatter is a programmatic dependent launch after the routing kernels (`axkern::launch`):
// it starts as the place kernel ends, without a launch gap between them (the place kernel does
// not release it earlier; route.cu says why).
//
// `x[t]` is read once and written K times, bits copied (no arithmetic: any element type); a
// dropped pair (an expert id out of range) gets a zero row: the kernel reads the ids itself,
// so no validity mask is formed in a pass of its own. `rows` is a permutation of the output
// rows, so every output row is written exactly once. The bytes it must move: T·D elements
// read, T·K·D written.
//
// One block of 128 threads per token (grid-stride, 4 blocks per SM), threads across the row in
// 16-, 4-, 2- or 1-byte units (the widest the row size and pointers allow), each unit loaded once
// and stored K times with streaming stores. On the H200 this writes as fast as any other
// pattern measured (`benchmarks/scatter_patterns.py`: a warp per token, 8-32 warps per SM, and
// the copy engine, bulk loads into a shared-memory ring and K bulk stores, were no faster), at
// 3.7 TB/s counting T·D read and T·K·D written, against 4.5 TB/s for sequential stores alone.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "launch.cuh"
#include "route.cuh"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxTopK = 16;  // a token's rows live in registers (supports() refuses more)
constexpr int kThreads = 128;
constexpr int kBlocksPerSm = 4;  // H200: 4 and 16 within 1%

__device__ inline bool kept_pair(int32_t id, int32_t experts) { return id >= 0 && id < experts; }

template <typename U>
__device__ inline void store_stream(U* p, const U& v) {
  if constexpr (sizeof(U) == 16) __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
  else *p = v;
}

template <typename U, int kK>
__global__ void scatter_rows(const U* __restrict__ x, const int32_t* __restrict__ rows, const int32_t* __restrict__ ids,
                             int32_t experts, U* __restrict__ out, int64_t tokens, int64_t topk, int64_t units) {
  axkern::wait_for_prior();  // the rows come from the routing kernel before this one
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    int64_t row[kK];
    bool kept[kK];
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      row[k] = k < topk ? static_cast<int64_t>(rows[t * topk + k]) : 0;
      kept[k] = k < topk && kept_pair(ids[t * topk + k], experts);
    }
    const U* in = x + t * units;
    for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
      const U v = in[i];
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        if (k >= topk) break;
        store_stream(out + row[k] * units + i, kept[k] ? v : U{});
      }
    }
  }
}

template <typename U>
cudaError_t launch_threads(cudaStream_t stream, bool early, const void* x, const int32_t* rows, const int32_t* ids,
                           int32_t experts, void* out, int64_t tokens, int64_t topk, int64_t row_bytes) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
  auto kernel = topk <= 8 ? scatter_rows<U, 8> : scatter_rows<U, kMaxTopK>;
  return axkern::launch(kernel, axkern::grid_for(tokens, 1, kBlocksPerSm), kThreads, 0, stream, early,
                        static_cast<const U*>(x), rows, ids, experts, static_cast<U*>(out), tokens, topk, units);
}

bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) % n) == 0; }

ffi::Error DispatchImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, int64_t num_experts,
                        int64_t chunk, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::S32>> rows,
                        ffi::Result<ffi::Buffer<ffi::S32>> group_sizes, ffi::Result<ffi::Buffer<ffi::S32>> workspace) {
  if (x.dimensions().size() != 2) return ffi::Error::InvalidArgument("AxkernMoeDispatch: x must be [tokens, hidden]");
  const int64_t tokens = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t pairs = static_cast<int64_t>(ids.element_count());
  if (tokens == 0 ? pairs != 0 : pairs % tokens != 0)
    return ffi::Error::InvalidArgument("AxkernMoeDispatch: ids must hold top-k entries per token");
  const int64_t topk = tokens ? pairs / tokens : 0;
  if (topk > kMaxTopK) return ffi::Error::InvalidArgument("AxkernMoeDispatch: top-k above 16");
  if (const char* bad = axkern::moe_route_check(pairs, num_experts, chunk))
    return ffi::Error::InvalidArgument(std::string("AxkernMoeDispatch: ") + bad);
  if (static_cast<int64_t>(workspace->element_count()) != axkern::moe_route_workspace(pairs, num_experts, chunk))
    return ffi::Error::InvalidArgument("AxkernMoeDispatch: workspace must hold (E+1)*chunks + (E+1) int32s");
  if (out->dimensions().size() != 2 || out->dimensions()[0] != pairs || out->dimensions()[1] != cols ||
      static_cast<int64_t>(rows->element_count()) != pairs ||
      static_cast<int64_t>(group_sizes->element_count()) != num_experts)
    return ffi::Error::InvalidArgument("AxkernMoeDispatch: out must be [pairs, hidden], rows [pairs], group_sizes [E]");
  const bool chain = axkern::chains_launches();
  const int32_t* id = ids.typed_data();
  int32_t* row = rows->typed_data();
  cudaError_t err = axkern::moe_route(stream, id, pairs, num_experts, chunk, row, group_sizes->typed_data(),
                                      workspace->typed_data(), chain);
  if (err == cudaSuccess && pairs > 0 && cols > 0) {
    const int32_t experts = static_cast<int32_t>(num_experts);
    const int64_t row_bytes = cols * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
    const void* in = x.untyped_data();
    void* dst = out->untyped_data();
    auto fits = [&](uintptr_t n) {
      return row_bytes % static_cast<int64_t>(n) == 0 && aligned(in, n) && aligned(dst, n);
    };
    auto scatter = fits(16)  ? launch_threads<uint4>
                   : fits(4) ? launch_threads<uint32_t>
                   : fits(2) ? launch_threads<uint16_t>
                             : launch_threads<uint8_t>;
    err = scatter(stream, chain, in, row, id, experts, dst, tokens, topk, row_bytes);
  }
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("AxkernMoeDispatch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernMoeDispatch, DispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("chunk")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
