// The routing counting sort of route.cu, for the handlers that run it before their own kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace axkern {

// int32s of workspace `moe_route` needs: counts per (bucket, chunk) and an offset per bucket.
int64_t moe_route_workspace(int64_t pairs, int64_t experts, int64_t chunk);

// Why `moe_route` cannot run with these sizes, or nullptr.
const char* moe_route_check(int64_t pairs, int64_t experts, int64_t chunk);

// Launches the count, scan and place kernels on `stream` (the last two early when `chain`):
// `rows[p]` of every pair in stable expert-major order, dropped pairs (an id outside
// [0, experts)) last, and the valid pairs per expert in `group_sizes`.
cudaError_t moe_route(cudaStream_t stream, const int32_t* idx, int64_t pairs, int64_t experts, int64_t chunk,
                      int32_t* rows, int32_t* group_sizes, int32_t* workspace, bool chain);

}  // namespace axkern
