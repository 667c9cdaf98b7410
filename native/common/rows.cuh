// Row helpers shared by axkern's CUDA row-moving kernels: float conversions of the 16-bit
// types, rows moved as 16-byte vectors (`Pack`), streaming stores, and the host-side dispatch
// on the element type and the vector width. Header-only; everything in namespace axkern::rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace axkern::rows {

namespace ffi = xla::ffi;

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

// N elements of T moved as one V (uint4: 16 bytes; or T itself).
template <typename T, typename V>
struct Pack {
  static constexpr int N = sizeof(V) / sizeof(T);
  __device__ static void unpack(const V& v, float* f) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int n = 0; n < N; ++n) f[n] = to_f32(e[n]);
  }
  __device__ static V pack(const float* f) {
    V v;
    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int n = 0; n < N; ++n) e[n] = from_f32<T>(f[n]);
    return v;
  }
};

// Output rows are written once and not read again by this kernel: streaming stores
// (`st.global.cs`) keep them from evicting the rows still being read out of L2.
template <typename V>
__device__ inline void store_stream(V* p, const V& v) {
  if constexpr (std::is_same_v<V, uint4>) __stcs(p, v);
  else *p = v;
}

inline ffi::Error check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

template <typename T>
struct Tag {
  using type = T;
};

// f(Tag<T>{}) for the element type.
template <typename F>
ffi::Error by_dtype(ffi::DataType dtype, const char* what, F&& f) {
  switch (dtype) {
    case ffi::F32: return f(Tag<float>{});
    case ffi::BF16: return f(Tag<__nv_bfloat16>{});
    case ffi::F16: return f(Tag<__half>{});
    default: return ffi::Error::InvalidArgument(std::string(what) + ": rows must be f32, bf16 or f16");
  }
}

// f(Tag<V>{}, vectors per row) with V = uint4 when every row is a whole number of 16-byte
// vectors at 16-byte-aligned pointers, else V = T (element by element).
template <typename T, typename F>
ffi::Error with_vector(int64_t cols, std::initializer_list<const void*> ptrs, F&& f) {
  bool vec = (cols * static_cast<int64_t>(sizeof(T))) % axkern::kVectorBytes == 0;
  for (const void* p : ptrs) vec = vec && axkern::aligned16(p);
  if (vec) return f(Tag<uint4>{}, cols * static_cast<int64_t>(sizeof(T)) / axkern::kVectorBytes);
  return f(Tag<T>{}, cols);
}

}  // namespace axkern::rows
