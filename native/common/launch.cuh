// Launch configuration shared by axkern's CUDA kernels: grid sizing from the SM count,
// 16-byte vector widths, arch checks. Header-only.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace axkern {

// Bytes one thread moves per access: 16 (uint4) when the row size and pointers allow it.
constexpr int kVectorBytes = 16;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 1;
  return count > 0 ? count : 1;
}

// A grid of at most `waves` blocks per SM, and no more blocks than there is work for.
inline unsigned grid_for(int64_t work_items, int items_per_block, int waves = 8) {
  int64_t blocks = (work_items + items_per_block - 1) / items_per_block;
  int64_t cap = static_cast<int64_t>(sm_count()) * waves;
  if (blocks > cap) blocks = cap;
  return static_cast<unsigned>(blocks > 0 ? blocks : 1);
}

}  // namespace axkern

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "axkern's CUDA kernels need compute capability 7.0 or newer"
#endif
