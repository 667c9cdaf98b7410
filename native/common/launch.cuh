// Launch configuration shared by axkern's CUDA kernels: grid sizing from the SM count,
// 16-byte vector widths, arch checks. Header-only.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>
#include <utility>

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

// Launches `kernel` on `stream`; with `early` (Hopper and newer), as a programmatic dependent
// launch: its blocks may start before the kernel launched just before it on the stream has
// finished (once every block of that one has run `release_dependents()` or exited), so the
// launch latency between two short kernels overlaps the first. A kernel launched `early` must
// call `wait_for_prior()` before it touches anything that a kernel still running before it (the
// one launched just before, or, through a chain of early launches, any earlier one) writes, and
// before it writes anything those read; the wait returns when all of them have finished. The
// first kernel of a chain is launched without `early`, so it follows everything before it on
// the stream.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool early,
                   Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = early ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Whether this GPU takes programmatic dependent launches (compute capability 9.0 and newer).
inline bool chains_launches() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9;
}

// In a kernel launched `early`: waits until the kernel before it has finished and its writes
// are visible. Returns at once in a kernel launched plainly.
__device__ inline void wait_for_prior() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the kernel launched `early` after this one start its blocks (they wait in
// `wait_for_prior()` for this kernel to finish).
__device__ inline void release_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace axkern

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "axkern's CUDA kernels need compute capability 7.0 or newer"
#endif
