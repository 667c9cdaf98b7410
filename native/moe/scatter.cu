// AxkernMoeScatterRows: dispatch's row scatter (its backward is AxkernMoeGatherSum, moe.cu).
//
//   out[rows[t*K+k], :] = keep[t*K+k] != 0 ? x[t, :] : 0
//
// `x[t]` is read once and written K times, bits copied (no arithmetic: any element type); a
// dropped pair (keep 0) gets a zero row. `rows` is a permutation of the output rows, so every
// output row is written exactly once. The bytes it must move: T·D elements read, T·K·D written.
//
// On Hopper (compute capability 9.0 and newer, rows a whole number of 16-byte units at
// 16-byte-aligned addresses) the copy engine moves the rows: one warp per block, lane 0
// driving it. `x[t]` comes into a shared-memory ring of `kStages` rows by one bulk load
// (`cp.async.bulk` global -> shared, completing on the stage's mbarrier) and leaves by K bulk
// stores (shared -> global, one per pair; a zero row in shared memory for a dropped pair),
// committed as one bulk group per token. A stage is refilled once its group has been read out
// of shared memory (`wait_group.read`), so the loads of the next `kStages - 1` tokens are in
// flight while a token's stores drain.
//
// Elsewhere threads copy: one block of 128 threads per token (grid-stride), threads across the
// row in 16-, 4- or 2-byte units (the widest the row size and pointers allow), each unit
// loaded once and stored K times with streaming stores.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "launch.cuh"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxTopK = 16;  // a token's rows live in registers (supports() refuses more)
constexpr int kThreads = 128;
constexpr int kHeader = 128;  // bytes of shared memory before the rows: the stages' mbarriers
constexpr int kStages = 4;    // shared-memory ring, in rows
constexpr int kBlocksPerSm = 2;  // bulk-copy blocks per SM (H200 sweep, sweep_scatter.json: 2-8 within noise)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ inline uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ inline void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}
__device__ inline void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ inline void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ inline void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ inline void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ inline void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
#endif

template <int kStages>
__global__ void __launch_bounds__(32) scatter_rows_bulk(const char* __restrict__ x, const int32_t* __restrict__ rows,
                                                        const float* __restrict__ keep, char* __restrict__ out,
                                                        int64_t tokens, int64_t topk, uint32_t row_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  unsigned char* zero = smem + kHeader;
  unsigned char* ring = zero + row_bytes;
  for (uint32_t i = threadIdx.x * 16; i < row_bytes; i += 32 * 16) *reinterpret_cast<uint4*>(zero + i) = uint4{};
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the zero row, visible to the copy engine
  __syncwarp();
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kStages; ++s) mbar_init(&bar[s]);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");

  const int64_t first = blockIdx.x, step = gridDim.x;
  const int64_t n = first < tokens ? (tokens - 1 - first) / step + 1 : 0;
  auto load = [&](int64_t i) {
    const int s = static_cast<int>(i % kStages);
    bulk_load(ring + s * row_bytes, x + (first + i * step) * row_bytes, row_bytes, &bar[s]);
  };
  for (int64_t i = 0; i < n && i < kStages; ++i) load(i);
  for (int64_t i = 0; i < n; ++i) {
    const int s = static_cast<int>(i % kStages);
    const int64_t t = first + i * step;
    int32_t row[kMaxTopK];
    bool kept[kMaxTopK];
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      if (k < topk) {
        row[k] = rows[t * topk + k];
        kept[k] = keep[t * topk + k] != 0.0f;
      }
    }
    mbar_wait(&bar[s], static_cast<uint32_t>((i / kStages) & 1));
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k)
      if (k < topk) bulk_store(out + static_cast<int64_t>(row[k]) * row_bytes, kept[k] ? ring + s * row_bytes : zero, row_bytes);
    bulk_commit();
    if (i >= 1 && i - 1 + kStages < n) {  // token i-1's stage, read out: refill it
      bulk_wait_read<1>();
      load(i - 1 + kStages);
    }
  }
  bulk_wait_all();
#endif
}


template <typename U>
__device__ inline void store_stream(U* p, const U& v) {
  if constexpr (sizeof(U) == 16) __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
  else *p = v;
}

template <typename U, int kK>
__global__ void scatter_rows(const U* __restrict__ x, const int32_t* __restrict__ rows, const float* __restrict__ keep,
                             U* __restrict__ out, int64_t tokens, int64_t topk, int64_t units) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    int64_t row[kK];
    bool kept[kK];
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      row[k] = k < topk ? static_cast<int64_t>(rows[t * topk + k]) : 0;
      kept[k] = k < topk && keep[t * topk + k] != 0.0f;
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

bool hopper() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9;
}

ffi::Error launched(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// The copy-engine path; false when a ring of rows does not fit a block's shared memory.
bool launch_bulk(cudaStream_t stream, const void* x, const int32_t* rows, const float* keep, void* out,
                 int64_t tokens, int64_t topk, int64_t row_bytes) {
  const size_t bytes = kHeader + static_cast<size_t>(row_bytes) * (kStages + 1);
  auto kernel = scatter_rows_bulk<kStages>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) !=
      cudaSuccess) {
    cudaGetLastError();  // clear it: the thread path serves instead
    return false;
  }
  int fit = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, 32, bytes) != cudaSuccess || fit < 1) {
    cudaGetLastError();
    return false;
  }
  int64_t grid = static_cast<int64_t>(axkern::sm_count()) * (fit < kBlocksPerSm ? fit : kBlocksPerSm);
  if (grid > tokens) grid = tokens;
  kernel<<<static_cast<unsigned>(grid), 32, bytes, stream>>>(static_cast<const char*>(x), rows, keep,
                                                             static_cast<char*>(out), tokens, topk,
                                                             static_cast<uint32_t>(row_bytes));
  return true;
}

template <typename U>
void launch_threads(cudaStream_t stream, const void* x, const int32_t* rows, const float* keep, void* out,
                    int64_t tokens, int64_t topk, int64_t row_bytes) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
  auto kernel = topk <= 8 ? scatter_rows<U, 8> : scatter_rows<U, kMaxTopK>;
  kernel<<<axkern::grid_for(tokens, 1, 16), kThreads, 0, stream>>>(static_cast<const U*>(x), rows, keep,
                                                                    static_cast<U*>(out), tokens, topk, units);
}

bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) % n) == 0; }

ffi::Error ScatterRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rows,
                           ffi::Buffer<ffi::F32> keep, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t tokens = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t topk = tokens ? static_cast<int64_t>(rows.element_count()) / tokens : 0;
  if (tokens == 0 || cols == 0 || topk == 0) return ffi::Error::Success();
  if (topk > kMaxTopK) return ffi::Error::InvalidArgument("AxkernMoeScatterRows: top-k above 16");
  const int64_t row_bytes = cols * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  const void* in = x.untyped_data();
  void* dst = out->untyped_data();
  auto fits = [&](uintptr_t n) { return row_bytes % static_cast<int64_t>(n) == 0 && aligned(in, n) && aligned(dst, n); };
  if (fits(16) && hopper() && launch_bulk(stream, in, rows.typed_data(), keep.typed_data(), dst, tokens, topk, row_bytes))
    return launched("AxkernMoeScatterRows");
  if (fits(16)) launch_threads<uint4>(stream, in, rows.typed_data(), keep.typed_data(), dst, tokens, topk, row_bytes);
  else if (fits(4)) launch_threads<uint32_t>(stream, in, rows.typed_data(), keep.typed_data(), dst, tokens, topk, row_bytes);
  else if (fits(2)) launch_threads<uint16_t>(stream, in, rows.typed_data(), keep.typed_data(), dst, tokens, topk, row_bytes);
  else launch_threads<uint8_t>(stream, in, rows.typed_data(), keep.typed_data(), dst, tokens, topk, row_bytes);
  return launched("AxkernMoeScatterRows");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernMoeScatterRows, ScatterRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());
