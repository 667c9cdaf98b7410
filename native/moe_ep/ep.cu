// Expert-parallel MoE transport between the GPUs one process drives, as XLA FFI handlers. Each
// GPU of the experts' mesh axis (a "rank") runs the same handler on its own stream; the ranks
// meet through device-side barriers in small control blocks (one per GPU, allocated once,
// reached by peer access over NVLink) and move rows with plain loads and stores into each
// other's buffers. Nothing waits on the host.
//
// AxkernEpDispatch:   each sent pair (t, k) writes x[t] straight into its destination rank's
//                     `expert_x` at its row in expert-grouped order, and its received slot
//                     (source * C + slot) into that rank's `order`; every rank fills its own
//                     empty rows (zeros) and the order of its empty slots. Outputs match
//                     ops/moe_ep/xla.py's exactly.
// AxkernEpGatherSum:  out[t] = sum over t's sent pairs of w[t, k] * y_dst[row] (combine; the
//                     dispatch's backward with w = 1), each row read from its holder.
// AxkernEpCombineBwd: d_y_dst[row] = w[t, k] * dy[t] written to each holder, dw[t, k] =
//                     <dy[t], y_dst[row]> read from it; empty rows of d_y zero.
//
// A pair's row at its holder: its slot's place in the holder's `order`, inverted by the holder
// (`inv`, an extra output) and read by the pair's source.
//
// Barriers: each ordered pair of GPUs (a, b) counts the barriers a has entered with b; a
// barrier raises a's flag in b's control block to that count (a release store at system scope)
// and waits until b's flag in a's block reaches it (an acquire load), for every rank b of the
// team. Every handler enters two barriers: after publishing its buffers' addresses (and counts),
// and after its last access to a peer's memory, so no rank's buffers are reused while a peer
// still reads or writes them. A barrier that waits longer than about a minute traps (a peer that
// never arrives, such as a mesh whose ranks run different programs) rather than hanging.
//
// Layout: rows are [tokens, D] (x, dy, out) and [R*C, D] (expert_x, y, d_y, in expert-grouped
// order, empty slots last); pairs [T*K] (dst, slot, sent, expert, within, w). Grid: the row
// kernels run one 128-thread block per pair (dispatch_push) or per token (pull_sum, push_pull;
// a token's K pairs' addresses in shared memory), grid-stride over at most 8 or 16 blocks an SM,
// threads across the row in 16-byte vectors where rows allow; the tails and `invert` grid-stride
// over rows; `publish`, `dispatch_plan` and `finish` are one block. Bound: bytes, no FLOPs to
// speak of. Dispatch reads T*D and writes the sent pairs' rows (at most T*K*D, (R-1)/R of them
// over links) plus the empty rows' zeros; the combine reads the sent pairs' rows (same count,
// from their holders) and writes T*D; its backward reads dy (T*D) and the pairs' rows and writes
// them again as d_y, plus the empty rows' zeros. The barriers cost two round trips a call.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <mutex>
#include <string>

#include "launch.cuh"
#include "rows.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace axkern::rows;

constexpr int kMaxDevices = 64;    // GPU ordinals one process may drive
constexpr int kMaxRanks = 64;      // ranks on the experts' mesh axis
constexpr int kMaxExperts = 4096;  // counts a rank publishes: its sends per destination and local expert
constexpr int kMaxTopK = 16;       // a token's pairs live in registers
constexpr int kThreads = 128;
constexpr int kPtrs = 4;
constexpr unsigned long long kTimeoutNs = 60ull * 1000 * 1000 * 1000;  // a barrier waits at most a minute

// One per GPU; peers write `flags`, `ptrs` and `counts` in it over NVLink, indexed by their
// ordinal. `base` and `recv` are the GPU's own scratch between the kernels of one call.
struct Ctrl {
  unsigned long long flags[kMaxDevices];
  unsigned long long ptrs[kMaxDevices][kPtrs];
  int counts[kMaxDevices][kMaxExperts];
  int base[kMaxExperts];  // where this rank's rows for (destination, local expert) start there
  int recv[kMaxRanks + 1];  // rows received from each rank; [ranks]: their total
};

// What the kernels know of the team (by value, about 1.6 KB of parameters).
struct Team {
  Ctrl* ctrl[kMaxRanks];
  int ordinal[kMaxRanks];
  unsigned long long target[kMaxRanks];  // the count the call's first barrier with each rank reaches
  int ranks, me;
};

// ---- host: the control blocks, peer access and the barrier counts ------------------------

struct Registry {
  std::mutex mu;
  Ctrl* ctrl[kMaxDevices] = {};
  bool peer[kMaxDevices][kMaxDevices] = {};
  bool loaded[kMaxDevices] = {};
  signed char reach[kMaxDevices][kMaxDevices] = {};  // 1: peer access possible from the first to the second
  unsigned long long entered[kMaxDevices][kMaxDevices] = {};
};

Registry& registry() {
  static Registry r;
  return r;
}

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("moe_ep: ") + what + ": " + cudaGetErrorString(err));
}

// A zeroed control block on GPU p, through a stream of its own that the host waits for, so the
// zeros land before any peer's first write (XLA's streams do not wait for the legacy one).
ffi::Error new_ctrl(int p, int current, Ctrl** out) {
  Ctrl* c = nullptr;
  cudaStream_t s = nullptr;
  cudaError_t err = cudaSetDevice(p);
  if (err == cudaSuccess) err = cudaMalloc(&c, sizeof(Ctrl));
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMemsetAsync(c, 0, sizeof(Ctrl), s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (s != nullptr) cudaStreamDestroy(s);
  const cudaError_t back = cudaSetDevice(current);
  if (err != cudaSuccess) return cuda_error("allocating a control block", err);
  if (back != cudaSuccess) return cuda_error("cudaSetDevice", back);
  *out = c;
  return ffi::Error::Success();
}

// The team of `device` along mesh axis `axis` (mesh devices' ordinals row-major over
// `shape`), with control blocks allocated and peer access enabled. The barrier counts are
// taken by `enter`, once the call cannot fail before its kernels are launched.
ffi::Error make_team(int device, ffi::Span<const int64_t> ordinals, ffi::Span<const int64_t> shape, int64_t axis,
                     Team* team) {
  int64_t size = 1;
  for (int64_t s : shape) size *= s;
  if (axis < 0 || axis >= static_cast<int64_t>(shape.size()) || size != static_cast<int64_t>(ordinals.size()))
    return ffi::Error::InvalidArgument("moe_ep: the mesh attributes do not describe a mesh");
  int64_t at = -1;
  for (int64_t i = 0; i < size; ++i) {
    if (ordinals[i] < 0 || ordinals[i] >= kMaxDevices)
      return ffi::Error::InvalidArgument("moe_ep: a mesh device's ordinal is outside [0, 64)");
    if (ordinals[i] == device) {
      if (at >= 0) return ffi::Error::InvalidArgument("moe_ep: a GPU appears twice in the mesh");
      at = i;
    }
  }
  if (at < 0) return ffi::Error::InvalidArgument("moe_ep: this GPU is not in the mesh the call was lowered for");
  int64_t stride = 1;
  for (int64_t d = axis + 1; d < static_cast<int64_t>(shape.size()); ++d) stride *= shape[d];
  const int ranks = static_cast<int>(shape[axis]);
  if (ranks > kMaxRanks) return ffi::Error::InvalidArgument("moe_ep: more than 64 ranks");
  const int me = static_cast<int>((at / stride) % ranks);
  const int64_t first = at - me * stride;
  team->ranks = ranks;
  team->me = me;

  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  int current = 0;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess) return cuda_error("cudaGetDevice", err);
  for (int r = 0; r < ranks; ++r) {
    const int p = static_cast<int>(ordinals[first + r * stride]);
    team->ordinal[r] = p;
    if (reg.ctrl[p] == nullptr)  // once per GPU, on that GPU
      if (auto e = new_ctrl(p, current, &reg.ctrl[p]); e.failure()) return e;
    if (p != device && !reg.peer[device][p]) {  // this GPU's access to p's memory
      int can = 0;
      if ((err = cudaDeviceCanAccessPeer(&can, device, p)) != cudaSuccess) return cuda_error("cudaDeviceCanAccessPeer", err);
      if (!can)
        return ffi::Error::Internal("moe_ep: GPU " + std::to_string(device) + " cannot access GPU " +
                                    std::to_string(p) + "'s memory (no peer access between them)");
      err = cudaDeviceEnablePeerAccess(p, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();  // clear it: enabled is what we want
      else if (err != cudaSuccess) return cuda_error("cudaDeviceEnablePeerAccess", err);
      reg.peer[device][p] = true;
    }
    team->ctrl[r] = reg.ctrl[p];
  }
  // every pair of the team, not only this GPU's: a rank that would fail here must fail on every
  // rank, before any of them enters a barrier the failing one would never reach
  for (int a = 0; a < ranks; ++a) {
    for (int b = 0; b < ranks; ++b) {
      const int pa = team->ordinal[a], pb = team->ordinal[b];
      if (pa == pb || reg.reach[pa][pb] == 1) continue;
      int can = 0;
      if ((err = cudaDeviceCanAccessPeer(&can, pa, pb)) != cudaSuccess) return cuda_error("cudaDeviceCanAccessPeer", err);
      if (!can)
        return ffi::Error::Internal("moe_ep: GPU " + std::to_string(pa) + " cannot access GPU " + std::to_string(pb) +
                                    "'s memory (no peer access between them)");
      reg.reach[pa][pb] = 1;
    }
  }
  return ffi::Error::Success();
}

// Takes the call's `barriers` barrier counts with each rank of the team (the first one's
// target in `team->target`). Every rank of the team enters the same calls in the same order.
void enter(int device, int barriers, Team* team) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (int r = 0; r < team->ranks; ++r) {
    const int p = team->ordinal[r];
    team->target[r] = reg.entered[device][p] + 1;
    reg.entered[device][p] += barriers;
  }
}

// ---- device: barriers ----------------------------------------------------------------------

__device__ inline void store_release(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ inline unsigned long long load_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ inline unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// The call's barrier `step` (0 or 1), by one block: thread r signals rank r and waits for it.
__device__ void barrier(const Team& t, int step) {
  __syncthreads();
  __threadfence_system();
  const int r = threadIdx.x;
  if (r < t.ranks) {
    const unsigned long long want = t.target[r] + step;
    store_release(&t.ctrl[r]->flags[t.ordinal[t.me]], want);
    const unsigned long long* mine = &t.ctrl[t.me]->flags[t.ordinal[r]];
    const unsigned long long start = global_ns();
    while (load_acquire(mine) < want) {
      __nanosleep(128);
      if (global_ns() - start > kTimeoutNs) __trap();  // the context is lost: a peer never arrived
    }
  }
  __syncthreads();
}

__global__ void finish(Team t) { barrier(t, 1); }

// The address rank r published in slot i for this call (in this rank's control block).
__device__ inline void* published(const Team& t, int r, int i) {
  return reinterpret_cast<void*>(t.ctrl[t.me]->ptrs[t.ordinal[r]][i]);
}

// Publishes up to kPtrs addresses and `n` counts to every rank, then barrier 0.
__global__ void publish(Team t, unsigned long long p0, unsigned long long p1, unsigned long long p2,
                        const int* __restrict__ counts, int n, bool counts_per_rank) {
  const int mine = t.ordinal[t.me];
  for (int r = threadIdx.x; r < t.ranks; r += blockDim.x) {
    unsigned long long* slot = t.ctrl[r]->ptrs[mine];
    slot[0] = p0;
    slot[1] = p1;
    slot[2] = p2;
  }
  if (counts_per_rank) {  // rank r receives counts[r] alone
    for (int r = threadIdx.x; r < t.ranks; r += blockDim.x) t.ctrl[r]->counts[mine][0] = counts[r];
  } else {  // every rank receives all n counts
    for (int i = threadIdx.x; i < t.ranks * n; i += blockDim.x) t.ctrl[i / n]->counts[mine][i % n] = counts[i % n];
  }
  barrier(t, 0);
}

// ---- dispatch --------------------------------------------------------------------------------

// After the counts are everywhere: where this rank's rows for each (destination, local expert)
// start there, its own group sizes, rows received per source and their total.
__global__ void dispatch_plan(Team t, int local, int* __restrict__ group_sizes) {
  Ctrl* own = t.ctrl[t.me];
  const int ranks = t.ranks;
  for (int r = threadIdx.x; r < ranks; r += blockDim.x) {
    int running = 0;
    for (int e = 0; e < local; ++e) {
      int total = 0, before = 0;
      for (int s = 0; s < ranks; ++s) {
        const int c = own->counts[t.ordinal[s]][r * local + e];
        total += c;
        before += s < t.me ? c : 0;
      }
      own->base[r * local + e] = running + before;
      running += total;
    }
  }
  for (int e = threadIdx.x; e < local; e += blockDim.x) {
    int total = 0;
    for (int s = 0; s < ranks; ++s) total += own->counts[t.ordinal[s]][t.me * local + e];
    group_sizes[e] = total;
  }
  for (int s = threadIdx.x; s < ranks; s += blockDim.x) {
    int total = 0;
    for (int e = 0; e < local; ++e) total += own->counts[t.ordinal[s]][t.me * local + e];
    own->recv[s] = total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int s = 0; s < ranks; ++s) total += own->recv[s];
    own->recv[ranks] = total;
  }
}

// Each sent pair's row of x written into its destination's expert_x, its slot into that rank's
// order. One block per pair (grid-stride), threads across the row.
template <typename V>
__global__ void dispatch_push(Team t, const V* __restrict__ x, const int* __restrict__ dst,
                              const int* __restrict__ slot, const bool* __restrict__ sent,
                              const int* __restrict__ expert, const int* __restrict__ within, int64_t pairs,
                              int64_t topk, int64_t vecs, int local, int64_t capacity) {
  const Ctrl* own = t.ctrl[t.me];
  for (int64_t p = blockIdx.x; p < pairs; p += gridDim.x) {
    if (!sent[p]) continue;
    const int r = dst[p];
    const int64_t row = own->base[r * local + expert[p]] + within[p];
    V* out = static_cast<V*>(published(t, r, 0)) + row * vecs;
    const V* in = x + (p / topk) * vecs;
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) out[i] = in[i];
    if (threadIdx.x == 0) static_cast<int*>(published(t, r, 1))[row] = static_cast<int>(t.me * capacity + slot[p]);
  }
  __threadfence_system();
}

// This rank's rows past those it received: zeros, and the order of its empty slots (source by
// source, each source's slots from the first it did not fill).
template <typename V>
__global__ void dispatch_tail(Team t, V* __restrict__ expert_x, int* __restrict__ order, int64_t vecs,
                              int64_t capacity) {
  const Ctrl* own = t.ctrl[t.me];
  const int64_t total = own->recv[t.ranks], rows = t.ranks * capacity;
  for (int64_t q = total + blockIdx.x; q < rows; q += gridDim.x) {
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) expert_x[q * vecs + i] = V{};
    if (threadIdx.x == 0) {
      int64_t k = q - total;
      int s = 0;
      while (k >= capacity - own->recv[s]) k -= capacity - own->recv[s++];
      order[q] = static_cast<int>(s * capacity + own->recv[s] + k);
    }
  }
}

// ---- combine and the backward passes ----------------------------------------------------------

__global__ void invert(const int* __restrict__ order, int* __restrict__ inv, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (order[i] >= 0 && order[i] < n) inv[order[i]] = static_cast<int>(i);
}

// Token t's K pairs: each sent pair's row at its holder (`holder_rows`, published slot 0; with
// `also`, the same row of published slot `also_slot`), weights; read by threads k < K.
template <int kK>
struct Pairs {
  const void* row[kK];
  void* also[kK];
  float scale[kK];
  bool live[kK];
};

template <int kK, typename V>
__device__ void load_pairs(const Team& t, Pairs<kK>* pairs, const int* __restrict__ dst,
                           const int* __restrict__ slot, const bool* __restrict__ sent,
                           const float* __restrict__ w, int64_t token, int64_t topk, int64_t vecs,
                           int64_t capacity, int also_slot) {
  const int k = threadIdx.x;
  if (k < kK) {
    const int64_t p = token * topk + k;
    const bool live = k < topk && sent[p];
    pairs->live[k] = live;
    pairs->scale[k] = live ? w[p] : 0.0f;
    pairs->row[k] = nullptr;
    pairs->also[k] = nullptr;
    if (live) {
      const int r = dst[p];
      const int64_t row = static_cast<const int*>(published(t, r, 1))[t.me * capacity + slot[p]];
      pairs->row[k] = static_cast<const V*>(published(t, r, 0)) + row * vecs;
      if (also_slot >= 0) pairs->also[k] = static_cast<V*>(published(t, r, also_slot)) + row * vecs;
    }
  }
  __syncthreads();
}

template <typename T, typename V, int kK>
__global__ void pull_sum(Team t, const int* __restrict__ dst, const int* __restrict__ slot,
                         const bool* __restrict__ sent, const float* __restrict__ w, V* __restrict__ out,
                         int64_t tokens, int64_t topk, int64_t vecs, int64_t capacity) {
  using P = Pack<T, V>;
  __shared__ Pairs<kK> pairs;
  for (int64_t tok = blockIdx.x; tok < tokens; tok += gridDim.x) {
    load_pairs<kK, V>(t, &pairs, dst, slot, sent, w, tok, topk, vecs, capacity, -1);
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      V v[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k)
        if (pairs.live[k]) v[k] = static_cast<const V*>(pairs.row[k])[i];
      float acc[P::N] = {};
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        if (pairs.live[k]) {
          float f[P::N];
          P::unpack(v[k], f);
#pragma unroll
          for (int n = 0; n < P::N; ++n) acc[n] += pairs.scale[k] * f[n];
        }
      }
      store_stream(out + tok * vecs + i, P::pack(acc));
    }
    __syncthreads();  // `pairs` is refilled for the next token
  }
}

template <typename T, typename V, int kK>
__global__ void push_pull(Team t, const V* __restrict__ dy, const int* __restrict__ dst,
                          const int* __restrict__ slot, const bool* __restrict__ sent, const float* __restrict__ w,
                          float* __restrict__ dw, int64_t tokens, int64_t topk, int64_t vecs, int64_t capacity) {
  using P = Pack<T, V>;
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ Pairs<kK> pairs;
  for (int64_t tok = blockIdx.x; tok < tokens; tok += gridDim.x) {
    load_pairs<kK, V>(t, &pairs, dst, slot, sent, w, tok, topk, vecs, capacity, 2);
    float dot[kK] = {};
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      V v[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k)
        if (pairs.live[k]) v[k] = static_cast<const V*>(pairs.row[k])[i];
      float d[P::N];
      P::unpack(dy[tok * vecs + i], d);
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        if (pairs.live[k]) {
          float e[P::N], g[P::N];
          P::unpack(v[k], e);
#pragma unroll
          for (int n = 0; n < P::N; ++n) {
            dot[k] += d[n] * e[n];
            g[n] = pairs.scale[k] * d[n];
          }
          static_cast<V*>(pairs.also[k])[i] = P::pack(g);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      if (k >= topk) break;
      const float total = Reduce(temp).Sum(dot[k]);  // 0 for a pair not sent
      if (threadIdx.x == 0) dw[tok * topk + k] = total;
      __syncthreads();
    }
  }
  __threadfence_system();
}

// Rows of d_y past those received (no source writes them): zeros.
template <typename V>
__global__ void zero_tail(Team t, V* __restrict__ rows, int64_t vecs, int64_t capacity) {
  const Ctrl* own = t.ctrl[t.me];
  int64_t total = 0;
  for (int s = 0; s < t.ranks; ++s) total += own->counts[t.ordinal[s]][0];
  const int64_t end = t.ranks * capacity * vecs;
  for (int64_t i = total * vecs + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < end;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    rows[i] = V{};
}

// ---- handlers ----------------------------------------------------------------------------------

// Loads every kernel of this library on `device`, once: with lazy module loading (CUDA's
// default) a kernel's first launch may wait for the GPU to go idle, which a barrier kernel
// spinning there would not let it do.
template <typename T, typename V>
cudaError_t load_typed() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  for (const void* f : {reinterpret_cast<const void*>(pull_sum<T, V, 8>),
                        reinterpret_cast<const void*>(pull_sum<T, V, kMaxTopK>),
                        reinterpret_cast<const void*>(push_pull<T, V, 8>),
                        reinterpret_cast<const void*>(push_pull<T, V, kMaxTopK>),
                        reinterpret_cast<const void*>(zero_tail<V>)})
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, f);
  return e;
}

template <typename V>
cudaError_t load_raw() {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(dispatch_push<V>));
  return e == cudaSuccess ? cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(dispatch_tail<V>)) : e;
}

ffi::Error load_kernels(int device) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  if (reg.loaded[device]) return ffi::Error::Success();
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  for (const void* f : {reinterpret_cast<const void*>(publish), reinterpret_cast<const void*>(finish),
                        reinterpret_cast<const void*>(dispatch_plan), reinterpret_cast<const void*>(invert)})
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, f);
  for (auto load : {load_raw<uint4>, load_raw<uint32_t>, load_raw<uint16_t>, load_raw<uint8_t>,
                    load_typed<float, uint4>, load_typed<float, float>, load_typed<__nv_bfloat16, uint4>,
                    load_typed<__nv_bfloat16, __nv_bfloat16>, load_typed<__half, uint4>, load_typed<__half, __half>})
    if (e == cudaSuccess) e = load();
  if (e != cudaSuccess) return cuda_error("loading the kernels", e);
  reg.loaded[device] = true;
  return ffi::Error::Success();
}

// The team and its kernels loaded. The handler takes its barriers (`enter`) after its last check.
ffi::Error start(int device, ffi::Span<const int64_t> ordinals, ffi::Span<const int64_t> shape, int64_t axis,
                 Team* team) {
  if (auto e = make_team(device, ordinals, shape, axis, team); e.failure()) return e;
  return load_kernels(device);
}

bool summable(ffi::DataType t) { return t == ffi::F32 || t == ffi::BF16 || t == ffi::F16; }

ffi::Error bad(const char* what, const std::string& why) {
  return ffi::Error::InvalidArgument(std::string(what) + ": " + why);
}

// f(Tag<V>{}, vectors per row) with V the widest of 16, 4, 2, 1 bytes that divides a row and
// the rows' pointers.
template <typename F>
ffi::Error by_width(int64_t row_bytes, std::initializer_list<const void*> ptrs, F&& f) {
  auto fits = [&](int64_t w) {
    bool ok = row_bytes % w == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % w == 0;
    return ok;
  };
  if (fits(16)) return f(Tag<uint4>{}, row_bytes / 16);
  if (fits(4)) return f(Tag<uint32_t>{}, row_bytes / 4);
  if (fits(2)) return f(Tag<uint16_t>{}, row_bytes / 2);
  return f(Tag<uint8_t>{}, row_bytes);
}

// The pairs' arrays: `pairs` entries each, `tokens` rows of top-k at most 16.
ffi::Error check_pairs(const char* what, int64_t pairs, int64_t tokens, std::initializer_list<size_t> counts) {
  for (size_t n : counts)
    if (static_cast<int64_t>(n) != pairs) return bad(what, "the pairs' arrays differ in size");
  if (tokens > 0 && pairs % tokens != 0) return bad(what, "the pairs are not a whole top-k per token");
  if (tokens > 0 && pairs / tokens > kMaxTopK) return bad(what, "top-k above 16");
  return ffi::Error::Success();
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> dst,
                        ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::PRED> sent, ffi::Buffer<ffi::S32> expert,
                        ffi::Buffer<ffi::S32> within, ffi::Buffer<ffi::S32> counts, ffi::Span<const int64_t> ordinals,
                        ffi::Span<const int64_t> shape, int64_t axis, int64_t capacity,
                        ffi::Result<ffi::AnyBuffer> expert_x, ffi::Result<ffi::Buffer<ffi::S32>> order,
                        ffi::Result<ffi::Buffer<ffi::S32>> group_sizes) {
  const char* what = "AxkernEpDispatch";
  const int64_t tokens = x.dimensions()[0], pairs = static_cast<int64_t>(dst.element_count());
  const int64_t topk = tokens ? pairs / tokens : 1;
  const int64_t row_bytes = x.dimensions()[1] * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  const int64_t rows = static_cast<int64_t>(order->element_count());
  const int local = static_cast<int>(group_sizes->element_count());
  if (auto e = check_pairs(what, pairs, tokens, {slot.element_count(), sent.element_count(), expert.element_count(),
                                                  within.element_count()});
      e.failure())
    return e;
  if (expert_x->element_type() != x.element_type() || expert_x->dimensions()[0] != rows ||
      expert_x->dimensions()[1] != x.dimensions()[1])
    return bad(what, "expert_x must be [ranks * capacity, x's columns] of x's dtype");
  Team team;
  if (auto e = start(device, ordinals, shape, axis, &team); e.failure()) return e;
  if (rows != team.ranks * capacity) return bad(what, "order must hold ranks * capacity rows");
  if (static_cast<int64_t>(counts.element_count()) != static_cast<int64_t>(local) * team.ranks ||
      static_cast<int64_t>(local) * team.ranks > kMaxExperts)
    return bad(what, "counts must be [ranks, local experts], at most 4096 experts");
  enter(device, 2, &team);
  publish<<<1, kThreads, 0, stream>>>(team, reinterpret_cast<uintptr_t>(expert_x->untyped_data()),
                                      reinterpret_cast<uintptr_t>(order->typed_data()), 0, counts.typed_data(),
                                      team.ranks * local, false);
  dispatch_plan<<<1, kThreads, 0, stream>>>(team, local, group_sizes->typed_data());
  if (auto e = check_launch(what); e.failure()) return e;
  auto copy = [&](auto vt, int64_t vecs) {
    using V = typename decltype(vt)::type;
    if (pairs > 0)
      dispatch_push<V><<<axkern::grid_for(pairs, 1, 8), kThreads, 0, stream>>>(
          team, static_cast<const V*>(x.untyped_data()), dst.typed_data(), slot.typed_data(), sent.typed_data(),
          expert.typed_data(), within.typed_data(), pairs, topk, vecs, local, capacity);
    if (rows > 0)
      dispatch_tail<V><<<axkern::grid_for(rows, 1, 8), kThreads, 0, stream>>>(
          team, static_cast<V*>(expert_x->untyped_data()), order->typed_data(), vecs, capacity);
    return check_launch(what);
  };
  if (auto e = by_width(row_bytes, {x.untyped_data(), expert_x->untyped_data()}, copy); e.failure()) return e;
  finish<<<1, kThreads, 0, stream>>>(team);
  return check_launch(what);
}

ffi::Error GatherSumImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> order,
                         ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> dst, ffi::Buffer<ffi::S32> slot,
                         ffi::Buffer<ffi::PRED> sent, ffi::Span<const int64_t> ordinals, ffi::Span<const int64_t> shape,
                         int64_t axis, int64_t capacity, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Buffer<ffi::S32>> inv) {
  const char* what = "AxkernEpGatherSum";
  const int64_t tokens = out->dimensions()[0], cols = out->dimensions()[1];
  const int64_t pairs = static_cast<int64_t>(w.element_count()), topk = tokens ? pairs / tokens : 1;
  const int64_t n = static_cast<int64_t>(order.element_count());
  if (auto e = check_pairs(what, pairs, tokens, {dst.element_count(), slot.element_count(), sent.element_count()});
      e.failure())
    return e;
  if (y.dimensions()[0] != n || y.dimensions()[1] != cols || out->element_type() != y.element_type() ||
      static_cast<int64_t>(inv->element_count()) != n)
    return bad(what, "y must be [rows of order, out's columns] of out's dtype, inv like order");
  if (!summable(y.element_type())) return bad(what, "rows must be f32, bf16 or f16");
  Team team;
  if (auto e = start(device, ordinals, shape, axis, &team); e.failure()) return e;
  if (n != team.ranks * capacity) return bad(what, "order must hold ranks * capacity rows");
  enter(device, 2, &team);
  if (n > 0) invert<<<axkern::grid_for(n, kThreads, 8), kThreads, 0, stream>>>(order.typed_data(), inv->typed_data(), n);
  publish<<<1, kThreads, 0, stream>>>(team, reinterpret_cast<uintptr_t>(y.untyped_data()),
                                      reinterpret_cast<uintptr_t>(inv->typed_data()), 0, nullptr, 0, false);
  if (auto e = check_launch(what); e.failure()) return e;
  if (tokens > 0 && cols > 0) {
    auto e = by_dtype(y.element_type(), what, [&](auto tt) {
      using T = typename decltype(tt)::type;
      return with_vector<T>(cols, {y.untyped_data(), out->untyped_data()}, [&](auto vt, int64_t vecs) {
        using V = typename decltype(vt)::type;
        auto kernel = topk <= 8 ? pull_sum<T, V, 8> : pull_sum<T, V, kMaxTopK>;
        kernel<<<axkern::grid_for(tokens, 1, 16), kThreads, 0, stream>>>(
            team, dst.typed_data(), slot.typed_data(), sent.typed_data(), w.typed_data(),
            static_cast<V*>(out->untyped_data()), tokens, topk, vecs, capacity);
        return check_launch(what);
      });
    });
    if (e.failure()) return e;
  }
  finish<<<1, kThreads, 0, stream>>>(team);
  return check_launch(what);
}

ffi::Error CombineBwdImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy, ffi::AnyBuffer y,
                          ffi::Buffer<ffi::S32> order, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> dst,
                          ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::PRED> sent, ffi::Buffer<ffi::S32> sends,
                          ffi::Span<const int64_t> ordinals, ffi::Span<const int64_t> shape, int64_t axis,
                          int64_t capacity, ffi::Result<ffi::AnyBuffer> d_y, ffi::Result<ffi::Buffer<ffi::F32>> dw,
                          ffi::Result<ffi::Buffer<ffi::S32>> inv) {
  const char* what = "AxkernEpCombineBwd";
  const int64_t tokens = dy.dimensions()[0], cols = dy.dimensions()[1];
  const int64_t pairs = static_cast<int64_t>(w.element_count()), topk = tokens ? pairs / tokens : 1;
  const int64_t n = static_cast<int64_t>(order.element_count());
  if (auto e = check_pairs(what, pairs, tokens,
                           {dst.element_count(), slot.element_count(), sent.element_count(), dw->element_count()});
      e.failure())
    return e;
  if (dy.element_type() != y.element_type() || d_y->element_type() != y.element_type())
    return bad(what, "dy, y and d_y must share a dtype");
  if (y.dimensions()[0] != n || y.dimensions()[1] != cols || d_y->dimensions()[0] != n ||
      d_y->dimensions()[1] != cols || static_cast<int64_t>(inv->element_count()) != n)
    return bad(what, "y and d_y must be [rows of order, dy's columns], inv like order");
  if (!summable(y.element_type())) return bad(what, "rows must be f32, bf16 or f16");
  Team team;
  if (auto e = start(device, ordinals, shape, axis, &team); e.failure()) return e;
  if (n != team.ranks * capacity) return bad(what, "order must hold ranks * capacity rows");
  if (static_cast<int64_t>(sends.element_count()) != team.ranks) return bad(what, "sends must hold one count a rank");
  enter(device, 2, &team);
  if (n > 0) invert<<<axkern::grid_for(n, kThreads, 8), kThreads, 0, stream>>>(order.typed_data(), inv->typed_data(), n);
  publish<<<1, kThreads, 0, stream>>>(team, reinterpret_cast<uintptr_t>(y.untyped_data()),
                                      reinterpret_cast<uintptr_t>(inv->typed_data()),
                                      reinterpret_cast<uintptr_t>(d_y->untyped_data()), sends.typed_data(), 0, true);
  if (auto e = check_launch(what); e.failure()) return e;
  auto e = by_dtype(y.element_type(), what, [&](auto tt) {
    using T = typename decltype(tt)::type;
    return with_vector<T>(cols, {dy.untyped_data(), y.untyped_data(), d_y->untyped_data()}, [&](auto vt, int64_t vecs) {
      using V = typename decltype(vt)::type;
      if (tokens > 0) {  // with no columns it still writes dw (zeros)
        auto kernel = topk <= 8 ? push_pull<T, V, 8> : push_pull<T, V, kMaxTopK>;
        kernel<<<axkern::grid_for(tokens, 1, 16), kThreads, 0, stream>>>(
            team, static_cast<const V*>(dy.untyped_data()), dst.typed_data(), slot.typed_data(), sent.typed_data(),
            w.typed_data(), dw->typed_data(), tokens, topk, vecs, capacity);
      }
      if (n > 0 && cols > 0)
        zero_tail<V><<<axkern::grid_for(n * vecs, kThreads, 8), kThreads, 0, stream>>>(
            team, static_cast<V*>(d_y->untyped_data()), vecs, capacity);
      return check_launch(what);
    });
  });
  if (e.failure()) return e;
  finish<<<1, kThreads, 0, stream>>>(team);
  return check_launch(what);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernEpDispatch, DispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<ffi::Span<const int64_t>>("mesh_ordinals")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<int64_t>("axis")
                                  .Attr<int64_t>("capacity")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernEpGatherSum, GatherSumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<ffi::Span<const int64_t>>("mesh_ordinals")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<int64_t>("axis")
                                  .Attr<int64_t>("capacity")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernEpCombineBwd, CombineBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<ffi::Span<const int64_t>>("mesh_ordinals")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<int64_t>("axis")
                                  .Attr<int64_t>("capacity")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
