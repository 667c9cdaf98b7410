// MoE row movement as XLA FFI handlers. The routing (each pair's row in the dispatched
// array, `rows[t*K + k]`) comes from the routing of route.cu; dispatch (routing and scatter),
// AxkernMoeDispatch, is in scatter.cu.
//
// AxkernMoeGatherSum:   out[t, :] = sum_{k: valid[t*K+k]} w[t*K+k] * y[rows[t*K+k], :]
//                       (combine; dispatch's dx with w = 1). f32 accumulation. A dropped pair
//                       (valid false) is selected away: its row is not loaded and its weight
//                       not read; every valid pair is multiplied by its weight, so a weight of
//                       exactly 0 on a non-finite row gives 0 * NaN = NaN, as the reference does.
// AxkernMoeCombineBwd:  d_y[rows[p], :] = w[p] * dy[t, :] and dw[p] = <dy[t, :], y[rows[p], :]>
//                       for a valid pair p = t*K+k, 0 and 0 for a dropped one (its row not
//                       loaded): combine's backward in one pass over y.
//
// One block of 128 threads per token (grid-stride), threads across the row, 16-byte vectors
// when the row size allows it (`V = uint4`), element by element otherwise (`V = T`). A
// token's K rows, weights and validity are read into registers once (K <= 16) and the K row
// loads of a vector are issued together, so a thread has K loads in flight rather than one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"
#include "launch.cuh"
#include "rows.cuh"

namespace ffi = xla::ffi;

namespace {

using namespace axkern::rows;

constexpr int kThreads = 128;
constexpr int kMaxTopK = 16;  // a token's rows live in registers (supports() refuses more)

// A token's K rows, scales and validity, read once per token into registers (uniform across
// the block). `live[k]`: slot k is within top-k and, where `valid` is given, its pair is routed;
// a slot that is not live is never loaded nor weighted.
template <int kK>
struct Slots {
  int64_t row[kK];
  float scale[kK];
  bool live[kK];
  __device__ Slots(const int32_t* __restrict__ rows, const float* __restrict__ scales,
                   const bool* __restrict__ valid, int64_t t, int64_t topk) {
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const bool in = k < topk;
      row[k] = in ? static_cast<int64_t>(rows[t * topk + k]) : 0;
      scale[k] = in ? scales[t * topk + k] : 0.0f;
      live[k] = in && (valid == nullptr || valid[t * topk + k]);
    }
  }
};

// All K loads of a vector are issued before any is used, so they are in flight together; a
// dropped pair's is skipped.
template <typename T, typename V, int kK>
__global__ void gather_sum(const V* __restrict__ y, const int32_t* __restrict__ rows, const float* __restrict__ w,
                           const bool* __restrict__ valid, V* __restrict__ out, int64_t tokens, int64_t topk,
                           int64_t vecs) {
  using P = Pack<T, V>;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const Slots<kK> slot(rows, w, valid, t, topk);
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      V v[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k)
        if (slot.live[k]) v[k] = y[slot.row[k] * vecs + i];
      float acc[P::N] = {};
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        if (slot.live[k]) {
          float f[P::N];
          P::unpack(v[k], f);
#pragma unroll
          for (int n = 0; n < P::N; ++n) acc[n] += slot.scale[k] * f[n];
        }
      }
      store_stream(out + t * vecs + i, P::pack(acc));
    }
  }
}

// A dropped pair's row is written with zeros (every row of d_y is written once) and its
// weight's gradient is 0: nothing of it is loaded or accumulated.
template <typename T, typename V, int kK>
__global__ void combine_bwd(const V* __restrict__ dy, const V* __restrict__ y, const int32_t* __restrict__ rows,
                            const float* __restrict__ w, const bool* __restrict__ valid, V* __restrict__ dy_rows,
                            float* __restrict__ dw, int64_t tokens, int64_t topk, int64_t vecs) {
  using P = Pack<T, V>;
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const Slots<kK> slot(rows, w, valid, t, topk);
    float dot[kK] = {};
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      V v[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k)
        if (slot.live[k]) v[k] = y[slot.row[k] * vecs + i];
      float d[P::N];
      P::unpack(dy[t * vecs + i], d);
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        if (k >= topk) break;
        float g[P::N];
        if (slot.live[k]) {
          float e[P::N];
          P::unpack(v[k], e);
          const float wk = slot.scale[k];
#pragma unroll
          for (int n = 0; n < P::N; ++n) {
            dot[k] += d[n] * e[n];
            g[n] = wk * d[n];
          }
        } else {
#pragma unroll
          for (int n = 0; n < P::N; ++n) g[n] = 0.0f;
        }
        store_stream(dy_rows + slot.row[k] * vecs + i, P::pack(g));
      }
    }
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      if (k >= topk) break;
      const float total = Reduce(temp).Sum(dot[k]);  // 0 for a dropped pair
      if (threadIdx.x == 0) dw[t * topk + k] = total;
      __syncthreads();  // temp is reused by the next reduction
    }
  }
}

ffi::Error GatherSumImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> rows,
                         ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::PRED> valid, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t tokens = out->dimensions()[0], cols = out->dimensions()[1];
  const int64_t topk = tokens ? static_cast<int64_t>(rows.element_count()) / tokens : 0;
  if (tokens == 0 || cols == 0) return ffi::Error::Success();
  if (topk > kMaxTopK) return ffi::Error::InvalidArgument("AxkernMoeGatherSum: top-k above 16");
  return by_dtype(y.element_type(), "AxkernMoeGatherSum", [&](auto tt) {
    using T = typename decltype(tt)::type;
    return with_vector<T>(cols, {y.untyped_data(), out->untyped_data()}, [&](auto vt, int64_t vecs) {
      using V = typename decltype(vt)::type;
      auto kernel = topk <= 8 ? gather_sum<T, V, 8> : gather_sum<T, V, kMaxTopK>;
      kernel<<<axkern::grid_for(tokens, 1, 16), kThreads, 0, stream>>>(
          static_cast<const V*>(y.untyped_data()), rows.typed_data(), w.typed_data(), valid.typed_data(),
          static_cast<V*>(out->untyped_data()), tokens, topk, vecs);
      return check_launch("AxkernMoeGatherSum");
    });
  });
}

ffi::Error CombineBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> rows,
                          ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::PRED> valid, ffi::Result<ffi::AnyBuffer> dy_rows,
                          ffi::Result<ffi::Buffer<ffi::F32>> dw) {
  const int64_t tokens = dy.dimensions()[0], cols = dy.dimensions()[1];
  const int64_t topk = tokens ? static_cast<int64_t>(rows.element_count()) / tokens : 0;
  if (tokens == 0) return ffi::Error::Success();
  if (topk > kMaxTopK) return ffi::Error::InvalidArgument("AxkernMoeCombineBwd: top-k above 16");
  if (dy.element_type() != y.element_type())
    return ffi::Error::InvalidArgument("AxkernMoeCombineBwd: dy and y must share a dtype");
  return by_dtype(y.element_type(), "AxkernMoeCombineBwd", [&](auto tt) {
    using T = typename decltype(tt)::type;
    return with_vector<T>(
        cols, {dy.untyped_data(), y.untyped_data(), dy_rows->untyped_data()}, [&](auto vt, int64_t vecs) {
      using V = typename decltype(vt)::type;
          auto kernel = topk <= 8 ? combine_bwd<T, V, 8> : combine_bwd<T, V, kMaxTopK>;
          kernel<<<axkern::grid_for(tokens, 1, 16), kThreads, 0, stream>>>(
              static_cast<const V*>(dy.untyped_data()), static_cast<const V*>(y.untyped_data()),
              rows.typed_data(), w.typed_data(), valid.typed_data(), static_cast<V*>(dy_rows->untyped_data()),
              dw->typed_data(), tokens, topk, vecs);
          return check_launch("AxkernMoeCombineBwd");
        });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernMoeGatherSum, GatherSumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernMoeCombineBwd, CombineBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
