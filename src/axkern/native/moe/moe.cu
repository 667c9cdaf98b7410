// MoE row movement as XLA FFI handlers: dispatch (gather rows into expert order) and
// combine (weighted gather-sum back into token order). The routing itself (which row goes
// where) is computed by XLA and passed in as `src` indices.
//
// AxkernMoeGatherRows: out[j, :] = scale[j] * x[src[j], :]          (scale 0 drops a row)
// AxkernMoeGatherSum:  out[t, :] = sum_k w[t*K+k] * y[rows[t*K+k], :]  (f32 accumulation)
//
// Rows are moved with 16-byte vectors when the row size and pointers allow it; one block
// per row (grid-stride), threads across the row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "launch.cuh"

namespace ffi = xla::ffi;

namespace {

template <typename T>
__device__ inline float to_f32(T v) { return static_cast<float>(v); }
template <>
__device__ inline float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ inline float to_f32<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ inline T from_f32(float v) { return static_cast<T>(v); }
template <>
__device__ inline __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ inline __half from_f32<__half>(float v) { return __float2half(v); }

// out[j] = scale[j] * x[src[j]]; a scale of exactly 1 copies bits (16-byte vectors).
template <typename T>
__global__ void gather_rows(const T* __restrict__ x, const int32_t* __restrict__ src,
                            const float* __restrict__ scale, T* __restrict__ out, int64_t rows,
                            int64_t cols, bool vectorised) {
  for (int64_t j = blockIdx.x; j < rows; j += gridDim.x) {
    const float s = scale[j];
    const T* in_row = x + static_cast<int64_t>(src[j]) * cols;
    T* out_row = out + j * cols;
    if (vectorised && s == 1.0f) {
      const int64_t vecs = cols * sizeof(T) / 16;
      const uint4* a = reinterpret_cast<const uint4*>(in_row);
      uint4* b = reinterpret_cast<uint4*>(out_row);
      for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) b[i] = a[i];
    } else {
      for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
        out_row[i] = from_f32<T>(s == 0.0f ? 0.0f : s * to_f32(in_row[i]));
    }
  }
}

// out[t] = sum_k w[t*K + k] * y[rows[t*K + k]], accumulated in f32.
template <typename T>
__global__ void gather_sum(const T* __restrict__ y, const int32_t* __restrict__ rows,
                           const float* __restrict__ w, T* __restrict__ out, int64_t tokens, int64_t topk,
                           int64_t cols) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      float acc = 0.0f;
      for (int64_t k = 0; k < topk; ++k) {
        const float wk = w[t * topk + k];
        if (wk != 0.0f) acc += wk * to_f32(y[static_cast<int64_t>(rows[t * topk + k]) * cols + i]);
      }
      out[t * cols + i] = from_f32<T>(acc);
    }
  }
}

ffi::Error check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

template <typename T>
ffi::Error launch_gather_rows(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src,
                              ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = out->dimensions();
  const int64_t rows = dims[0], cols = dims[1];
  const bool vec = (cols * sizeof(T)) % 16 == 0 && axkern::aligned16(x.untyped_data()) &&
                   axkern::aligned16(out->untyped_data());
  gather_rows<T><<<axkern::grid_for(rows, 1), 128, 0, stream>>>(
      static_cast<const T*>(x.untyped_data()), src.typed_data(), scale.typed_data(),
      static_cast<T*>(out->untyped_data()), rows, cols, vec);
  return check_launch("AxkernMoeGatherRows");
}

template <typename T>
ffi::Error launch_gather_sum(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> rows,
                             ffi::Buffer<ffi::F32> w, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = out->dimensions();
  const int64_t tokens = dims[0], cols = dims[1];
  const int64_t topk = static_cast<int64_t>(rows.element_count()) / (tokens > 0 ? tokens : 1);
  gather_sum<T><<<axkern::grid_for(tokens, 1), 128, 0, stream>>>(
      static_cast<const T*>(y.untyped_data()), rows.typed_data(), w.typed_data(),
      static_cast<T*>(out->untyped_data()), tokens, topk, cols);
  return check_launch("AxkernMoeGatherSum");
}

ffi::Error GatherRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> src,
                          ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> out) {
  switch (x.element_type()) {
    case ffi::F32: return launch_gather_rows<float>(stream, x, src, scale, out);
    case ffi::BF16: return launch_gather_rows<__nv_bfloat16>(stream, x, src, scale, out);
    case ffi::F16: return launch_gather_rows<__half>(stream, x, src, scale, out);
    default: return ffi::Error::InvalidArgument("AxkernMoeGatherRows: x must be f32, bf16 or f16");
  }
}

ffi::Error GatherSumImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> rows,
                         ffi::Buffer<ffi::F32> w, ffi::Result<ffi::AnyBuffer> out) {
  switch (y.element_type()) {
    case ffi::F32: return launch_gather_sum<float>(stream, y, rows, w, out);
    case ffi::BF16: return launch_gather_sum<__nv_bfloat16>(stream, y, rows, w, out);
    case ffi::F16: return launch_gather_sum<__half>(stream, y, rows, w, out);
    default: return ffi::Error::InvalidArgument("AxkernMoeGatherSum: y must be f32, bf16 or f16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernMoeGatherRows, GatherRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernMoeGatherSum, GatherSumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());
