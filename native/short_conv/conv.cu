// Short causal depthwise convolution as XLA FFI handlers, forward and backward.
//
// y[b, t, c] = act(bias[c] + sum_{k < W} weight[k, c] * x~[b, t - k, c]), where x~ reads the
// initial state for t - k < 0 and a tap is dropped (selected away, never multiplied by zero)
// when a change of segment id lies between t - k and t. The state's rows continue the
// sequence's first segment.
//
// AxkernShortConvFwd: x [B, S, C], weight [W, C], bias [C] (each float32, bfloat16 or float16),
//                     state [B, W-1, C] (any array when `has_state` is 0: the rows before
//                     position 0 are then zeros), segment_ids [B, S] s32 (any array when
//                     `segments` is 0) -> y [B, S, C].
// AxkernShortConvBwd: the same inputs and dy -> dx [B, S, C] and per-tile partial sums of the
//                     weight's and bias's gradients, f32 [B * tiles, W + 1, C] (rows 0..W-1 dw,
//                     row W dbias; summed by the caller). The state's gradient is formed by
//                     the caller.
//
// Layout and grid: one thread owns N consecutive channels (a vector of 8 bytes, see
// vector_width) of `rows` consecutive positions, walking down the sequence in steps of kStep
// rows that reach it through a shared-memory ring filled
// asynchronously (kStages, below). Grid (channel blocks, tiles, B). The W - 1 inputs before a
// step stay in registers, so each input element is read from memory once, plus the W - 1 halo
// rows above its tile (a fraction (W-1)/rows).
//
// The backward forms g = dy * act'(pre) in registers (pre recomputed from the carried inputs),
// carries the last W - 1 values of g the same way and writes dx(t) = sum_k w[k] g(t + k) over the taps that
// stay in t's segment and before S (the others selected away); the tile's dw[k] = sum_t g(t) x~(t - k)
// and dbias = sum_t g(t) are accumulated in registers and written once per tile. Its reads: x (tile plus 2(W-1) halo
// rows), dy (tile plus W-1 rows below it); writes: dx and the partial sums. With SiLU both
// kernels carry half the pre-activation (silu_half, below): the backward's g is then doubled
// and its weights halved, and the partial sums are halved once before they are written.
//
// Segment runs: run(t) = the number of positions t, t-1, ... that share t's segment, capped
// at W; tap k is kept iff k < run(t). The run is carried down the sequence from the first
// halo row, which is exact because only the last W ids matter.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 128;
constexpr int kMaxWidth = 8;

template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

__device__ inline float to_f32(float v) { return v; }
__device__ inline float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_f32(__half v) { return __half2float(v); }

template <typename T>
__device__ inline T from_f32(float v);
template <>
__device__ inline float from_f32<float>(float v) { return v; }
template <>
__device__ inline __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

template <int N, typename T>
__device__ inline void load(const T* p, float (&out)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    // a bfloat16 is the high half of its float32: per 32-bit word the low value shifted up and
    // the high one masked, one instruction each
    const Packed<uint32_t, N / 2> pk = *reinterpret_cast<const Packed<uint32_t, N / 2>*>(p);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = __uint_as_float(pk.v[i] << 16);
      out[2 * i + 1] = __uint_as_float(pk.v[i] & 0xffff0000u);
    }
  } else {
    const Packed<T, N> pk = *reinterpret_cast<const Packed<T, N>*>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_f32(pk.v[i]);
  }
}

template <int N, typename T>
__device__ inline void store_vec(T* p, const float (&in)[N]) {
  Packed<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_f32<T>(in[i]);
  *reinterpret_cast<Packed<T, N>*>(p) = pk;
}

// SiLU from half its argument. With SiLU the kernels carry h = p / 2 (weights and bias halved
// once, exactly): silu(p) = h (1 + tanh h), and twice its derivative is 1 + tanh h + h (1 - tanh² h).
// 16-bit outputs take tanh from one MUFU op; float32 the exact form through expf.
__device__ inline float tanh_mufu(float h) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(h));
  return t;
}

template <typename T>
__device__ inline float silu_half(float h) {
  if constexpr (sizeof(T) == 2) return fmaf(h, tanh_mufu(h), h);
  return 2.0f * h / (1.0f + expf(-2.0f * h));
}

// dy · 2 silu'(2h): the backward's g, doubled (its halved weights undo the factor in dx; the
// weight's and bias's gradients are halved once at the end).
template <typename T>
__device__ inline float silu_grad_half(float h, float dy) {
  if constexpr (sizeof(T) == 2) {
    const float t = tanh_mufu(h);
    const float r = fmaf(h, fmaf(-t, t, 1.0f), t);
    return fmaf(dy, r, dy);
  }
  const float s = 1.0f / (1.0f + expf(-2.0f * h));
  return 2.0f * dy * s * fmaf(2.0f * h, 1.0f - s, 1.0f);
}

// The factor the kernels apply to the weight and bias: 1/2 with SiLU (they carry p / 2), else 1.
__device__ inline float param_scale(bool silu) { return silu ? 0.5f : 1.0f; }

// Rows per loop step. A step first loads all its rows (addresses clamped into the tile, so
// the loads are unconditional and all in flight together), then computes them in order; the
// W - 1 rows before the step are carried in registers. Indices into the step's arrays are
// compile-time (the row and tap loops are unrolled).
constexpr int kStep = 8;

// The weight's and bias's element types (read as float32 in the kernels).
enum ParamType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct Problem {
  int64_t seq, channels, rows;
  bool silu, segments, has_state;
  ParamType weight_type, bias_type;
};

// N consecutive values of a weight or bias row at element offset i, as float32.
template <int N>
__device__ inline void load_param(const void* p, ParamType type, int64_t i, float (&out)[N]) {
  if (type == kF32)
    load<N>(static_cast<const float*>(p) + i, out);
  else if (type == kBF16)
    load<N>(static_cast<const __nv_bfloat16*>(p) + i, out);
  else
    load<N>(static_cast<const __half*>(p) + i, out);
}

template <int N, int W>
__device__ inline void scale_params(float f, float (&w)[W][N], float (&bv)[N]) {
#pragma unroll
  for (int v = 0; v < N; ++v) {
    bv[v] *= f;
#pragma unroll
    for (int k = 0; k < W; ++k) w[k][v] *= f;
  }
}

// The segment run of a row: 1 after a change of id (or at `first`), else the previous run + 1,
// capped at `width`.
__device__ inline int next_run(int32_t id, int32_t prev_id, int prev_run, bool first, int width) {
  return (first || id != prev_id) ? 1 : min(prev_run + 1, width);
}

// acc + w·x, or acc when the tap is dropped: selected away (a NaN in a dropped tap's input
// stays out), a plain FMA when there are no segments.
template <bool SEG>
__device__ inline float add_tap(float acc, float w, float x, bool keep) {
  if constexpr (SEG) {
    const float with = fmaf(w, x, acc);
    return keep ? with : acc;
  } else {
    return fmaf(w, x, acc);
  }
}

// Row `i` of the step (i may be negative: the carried rows before the step).
template <int W, int N>
__device__ inline const float (&row(const float (&cur)[kStep][N], const float (&prev)[W][N], int i))[N] {
  return i >= 0 ? cur[i] : prev[W - 1 + i];
}

// Segment runs, capped at W <= 8, packed four bits a row: `cur` holds the step's rows 0..7 (row j
// in bits 4j..4j+3), `prev` the step before's (row i < 0 of this step in bits 4(i+8)..), so the
// runs carried from step to step take one register.
__device__ inline int run_bits(uint32_t runs, int j) { return (runs >> (4 * j)) & 15; }
__device__ inline int run_at(uint32_t cur, uint32_t prev, int i) {
  return i >= 0 ? run_bits(cur, i) : run_bits(prev, i + kStep);
}
// Every row's run at its cap W.
template <int W>
__host__ __device__ constexpr uint32_t full_runs() {
  return uint32_t(W) * 0x11111111u;
}

template <int W, int N>
__device__ inline void carry(const float (&cur)[kStep][N], float (&prev)[W][N]) {
#pragma unroll
  for (int i = 0; i < W - 1; ++i)
#pragma unroll
    for (int v = 0; v < N; ++v) prev[i][v] = cur[kStep - (W - 1) + i][v];
}

// The W - 1 inputs before a tile starting at t0 (the state's rows before position 0), the
// segment run of each (capped at W), and the last id and its run capped at 2W (`span`, which
// tells whether the next step's rows and the W - 1 before them all keep every tap): what a
// thread carries into its first step.
template <int N, int W, bool SEG, typename T>
__device__ inline void load_halo(const T* x, const T* state, bool has_state, const int32_t* seg, int64_t t0,
                                 int64_t C, float (&xp)[W][N], uint32_t& rp, int32_t& idp, int& runp) {
  idp = 0;
  runp = W;
  rp = full_runs<W>();
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    const int64_t u = t0 - (W - 1) + i;
    if (u >= 0)
      load<N>(x + u * C, xp[i]);
    else if (has_state)
      load<N>(state + (u + W - 1) * C, xp[i]);
    else
#pragma unroll
      for (int v = 0; v < N; ++v) xp[i][v] = 0.0f;
    if (SEG) {
      const int32_t id = seg[u < 0 ? 0 : u];
      runp = next_run(id, idp, runp, i == 0, 2 * W);
      idp = id;
    }
    if (SEG) {
      const int at = 4 * (kStep - (W - 1) + i);  // row i - (W - 1) before the tile
      rp = (rp & ~(15u << at)) | (uint32_t(min(runp, W)) << at);
    }
  }
}

// Rows reach a thread through a private ring of kStages steps in shared memory: the thread
// issues asynchronous copies (cp.async) of the rows kStages - 1 steps ahead of the one it
// computes, so the bytes in flight do not depend on registers or on how many threads fit on
// an SM. A thread reads back only the slots it filled itself, so no barrier is needed; slot
// [stage][row][thread] keeps a warp's reads of one row contiguous. Segment ids come the same
// way through lanes 0..kStep-1 of each warp (one row each) and are spread by shuffles.
constexpr int kStages = 4;

template <int BYTES>
struct Bits;
template <>
struct Bits<4> {
  using type = uint32_t;
};
template <>
struct Bits<8> {
  using type = uint2;
};
template <>
struct Bits<16> {
  using type = uint4;
};

template <int BYTES>
__device__ inline void async_copy(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "n"(BYTES)
               : "memory");
#else
  using B = typename Bits<BYTES>::type;
  *reinterpret_cast<B*>(dst) = *reinterpret_cast<const B*>(src);
#endif
}
__device__ inline void async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most N of this thread's groups are still in flight.
template <int N>
__device__ inline void async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// A block's rings in dynamic shared memory: `arrays` rings of rows, then the ids' ring.
template <typename Vec>
struct Rings {
  Vec* rows;        // [arrays][kStages][kStep][kThreads]
  int32_t* ids;     // [kStages][kThreads]
  static constexpr size_t bytes(int arrays) {
    return size_t(arrays) * kStages * kStep * kThreads * sizeof(Vec) + kStages * kThreads * sizeof(int32_t);
  }
  __device__ Rings(unsigned char* smem, int arrays)
      : rows(reinterpret_cast<Vec*>(smem)),
        ids(reinterpret_cast<int32_t*>(smem + size_t(arrays) * kStages * kStep * kThreads * sizeof(Vec))) {}
  __device__ Vec* slot(int array, int stage, int row, int tid) const {
    return rows + ((size_t(array) * kStages + stage) * kStep + row) * kThreads + tid;
  }
};

// A step's changes of segment id: bit j set when row j's id differs from the row before it
// (row 0 against `idp`, the last id of the step before; or `first`). Lanes 0..kStep-1 of each
// warp hold the step's ids (`mine`), one row each; every lane gets the mask.
__device__ inline unsigned step_changes(int32_t mine, int32_t idp, bool first, int lane) {
  const int32_t above = __shfl_up_sync(0xffffffffu, mine, 1);
  const bool change = lane == 0 ? (first || mine != idp) : mine != above;
  return __ballot_sync(0xffffffffu, change) & ((1u << kStep) - 1);
}

// The run of row j of a step, capped at `cap`: from the last change at or before j, or, with
// none, continuing `span` (the run of the row before the step).
__device__ inline int run_in_step(unsigned changes, int j, int span, int cap) {
  const unsigned m = changes & ((2u << j) - 1);
  return m ? min(j - (31 - __clz(m)) + 1, cap) : min(span + j + 1, cap);
}

// The runs of a step's rows, capped at W (what the taps' selects read).
template <int W>
__device__ inline uint32_t step_runs(unsigned changes, int span) {
  uint32_t rc = 0;
#pragma unroll
  for (int j = 0; j < kStep; ++j) rc |= uint32_t(run_in_step(changes, j, span, W)) << (4 * j);
  return rc;
}

// The first channel of this thread's vector. Threads past the last channel work on the last
// vector and store nothing (every lane of a warp takes part in the shuffles).
template <int N>
__device__ inline int64_t thread_channel(const Problem& p, bool& active) {
  const int64_t c = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * N;
  active = c < p.channels;
  return active ? c : p.channels - N;
}

// Calls f with the activation as a compile-time flag, so that a step's rows hold no branch.
template <typename F>
__device__ inline void by_silu(bool silu, F&& f) {
  if (silu)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// One step of the forward: y for rows t .. t + kStep - 1, stored at ys + j·C. EDGE steps store
// only their first `valid` rows and only from active threads; the others (every row in the
// tile, an active thread: nearly all steps) check nothing per row.
template <typename T, int N, int W, bool SEG, bool SILU, bool EDGE>
__device__ inline void fwd_rows(const float (&w)[W][N], const float (&bv)[N], const float (&xc)[kStep][N],
                                const float (&xp)[W][N], uint32_t rc, T* ys, int valid, int64_t C,
                                bool store) {
#pragma unroll
  for (int j = 0; j < kStep; ++j) {
    float acc[N];
#pragma unroll
    for (int v = 0; v < N; ++v) acc[v] = bv[v];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const bool keep = !SEG || k < run_bits(rc, j);
      const float(&src)[N] = row<W, N>(xc, xp, j - k);
#pragma unroll
      for (int v = 0; v < N; ++v) acc[v] = add_tap<SEG>(acc[v], w[k][v], src[v], keep);
    }
    if constexpr (SILU) {
#pragma unroll
      for (int v = 0; v < N; ++v) acc[v] = silu_half<T>(acc[v]);
    }
    if (!EDGE || (store && j < valid)) store_vec<N>(ys + j * C, acc);
  }
}

template <typename T, int N, int W, bool SEG>
__global__ void __launch_bounds__(kThreads) conv_fwd(const T* __restrict__ x, const void* __restrict__ weight,
                                                     const void* __restrict__ bias, const T* __restrict__ state,
                                                     const int32_t* __restrict__ seg, T* __restrict__ y,
                                                     Problem p) {
  static_assert(W - 1 <= kStep, "the carried rows fit in one step");
  using Vec = Packed<T, N>;
  extern __shared__ __align__(16) unsigned char smem[];
  const Rings<Vec> ring(smem, 1);
  const int tid = threadIdx.x, lane = tid & 31;
  bool active;
  const int64_t c = thread_channel<N>(p, active);
  const int64_t b = blockIdx.z, C = p.channels, S = p.seq;
  const int c32 = static_cast<int>(C);  // check_shapes: kStep · C fits an int
  const int64_t t0 = int64_t(blockIdx.y) * p.rows;
  const int64_t t1 = min(t0 + p.rows, S);
  const int64_t steps = (t1 - t0 + kStep - 1) / kStep;
  x += b * S * C + c;
  y += b * S * C + c;
  state += b * (W - 1) * C + c;
  if constexpr (SEG) seg += b * S;

  auto issue = [&](int64_t s) {
    if (s < steps) {
      const int stage = static_cast<int>(s % kStages);
      const int64_t t = t0 + s * kStep;
      const int last = static_cast<int>(min(int64_t(kStep), t1 - t)) - 1;  // rows past the tile repeat its last
      const T* xs = x + t * C;
      if (last == kStep - 1) {  // every row: addresses one add apart
#pragma unroll
        for (int j = 0; j < kStep; ++j, xs += c32) async_copy<sizeof(Vec)>(ring.slot(0, stage, j, tid), xs);
      } else {
#pragma unroll
        for (int j = 0; j < kStep; ++j) async_copy<sizeof(Vec)>(ring.slot(0, stage, j, tid), xs + min(j, last) * c32);
      }
      if (SEG && lane < kStep) async_copy<4>(ring.ids + stage * kThreads + tid, seg + min(t + lane, t1 - 1));
    }
    async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);

  float w[W][N], bv[N];
#pragma unroll
  for (int k = 0; k < W; ++k) load_param<N>(weight, p.weight_type, k * C + c, w[k]);
  load_param<N>(bias, p.bias_type, c, bv);
  scale_params<N, W>(param_scale(p.silu), w, bv);

  float xp[W][N];
  uint32_t rp;
  int32_t idp;
  int runp;
  load_halo<N, W, SEG>(x, state, p.has_state, seg, t0, C, xp, rp, idp, runp);

  for (int64_t s = 0; s < steps; ++s) {
    issue(s + kStages - 1);
    async_wait<kStages - 1>();
    const int stage = static_cast<int>(s % kStages);
    const int64_t t = t0 + s * kStep;
    float xc[kStep][N];
#pragma unroll
    for (int j = 0; j < kStep; ++j) load<N>(reinterpret_cast<const T*>(ring.slot(0, stage, j, tid)), xc[j]);
    const int valid = static_cast<int>(min(int64_t(kStep), t1 - t));
    uint32_t rc = 0;
    bool full = true;  // every row of the step keeps all W taps: no change of id within W rows
    if constexpr (SEG) {
      const int32_t mine = ring.ids[stage * kThreads + tid];
      const unsigned changes = step_changes(mine, idp, W == 1 && s == 0, lane);
      full = changes == 0 && runp + 1 >= W;
      if (!(full && active && valid == kStep)) rc = step_runs<W>(changes, runp);
      idp = __shfl_sync(0xffffffffu, mine, kStep - 1);
      runp = run_in_step(changes, kStep - 1, runp, 2 * W);
    }
    const bool plain = full && active && valid == kStep;
    T* ys = y + t * C;
    if (plain)
      by_silu(p.silu, [&](auto silu) {
        fwd_rows<T, N, W, false, decltype(silu)::value, false>(w, bv, xc, xp, rc, ys, valid, C, active);
      });
    else
      by_silu(p.silu, [&](auto silu) {
        fwd_rows<T, N, W, SEG, decltype(silu)::value, true>(w, bv, xc, xp, rc, ys, valid, C, active);
      });
    carry<W, N>(xc, xp);
  }
}

// One step of the backward: g for the step's rows u0 + j, their dw and dbias terms, and dx
// for the rows t = u - (W - 1) that fall in the tile. EDGE steps check each row (past the
// sequence: g is 0; past the tile: no dw term; t outside the tile or an inactive thread: no
// store); the others (every u and t in the tile, an active thread: nearly all steps) check
// nothing per row and store dx(u0 - (W - 1) + j) at dxs + j·C.
template <typename T, int N, int W, bool SEG, bool SILU, bool EDGE>
__device__ inline void bwd_rows(const float (&w)[W][N], const float (&bv)[N], const float (&xc)[kStep][N],
                                const float (&xp)[W][N], float (&gc)[kStep][N], const float (&gp)[W][N],
                                uint32_t rc, uint32_t rp, float (&dw)[W][N], float (&db)[N],
                                T* dx, T* dxs, int64_t u0, int64_t t0, int64_t t1, int64_t S, int64_t C,
                                bool store) {
#pragma unroll
  for (int j = 0; j < kStep; ++j) {
    const int64_t u = u0 + j;
    if constexpr (SILU) {
#pragma unroll
      for (int v = 0; v < N; ++v) {
        float h = bv[v];  // half the pre-activation (the weights are halved)
#pragma unroll
        for (int k = 0; k < W; ++k)
          h = add_tap<SEG>(h, w[k][v], row<W, N>(xc, xp, j - k)[v], !SEG || k < run_bits(rc, j));
        gc[j][v] = silu_grad_half<T>(h, gc[j][v]);
      }
    }
    if constexpr (EDGE) {
      const bool inside = u < S;
#pragma unroll
      for (int v = 0; v < N; ++v) gc[j][v] = inside ? gc[j][v] : 0.0f;  // selected, never multiplied
    }
    if (!EDGE || u < t1) {
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const bool keep = !SEG || k < run_bits(rc, j);
#pragma unroll
        for (int v = 0; v < N; ++v) dw[k][v] = add_tap<SEG>(dw[k][v], gc[j][v], row<W, N>(xc, xp, j - k)[v], keep);
      }
#pragma unroll
      for (int v = 0; v < N; ++v) db[v] += gc[j][v];
    }
    const int64_t t = u - (W - 1);
    if (!EDGE || (store && t >= t0 && t < t1)) {
      float acc[N];
#pragma unroll
      for (int v = 0; v < N; ++v) acc[v] = 0.0f;
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const int i = j - (W - 1) + k;  // row t + k of this step
        // an output of another segment or past the sequence (EDGE steps): selected away, never
        // w[k] * 0 (NaN for a NaN weight)
        const bool keep = (!SEG || k < run_at(rc, rp, i)) && (!EDGE || t + k < S);
        const float(&g)[N] = row<W, N>(gc, gp, i);
#pragma unroll
        for (int v = 0; v < N; ++v) acc[v] = add_tap<SEG || EDGE>(acc[v], w[k][v], g[v], keep);
      }
      store_vec<N>(EDGE ? dx + t * C : dxs + j * C, acc);
    }
  }
}

// Two backward blocks per SM (up to 255 registers a thread): a step's rows, unrolled without
// branches, keep 8 rows of inputs and of g, W carried rows of each and W dw accumulators per
// channel in registers. Capped at 168 registers for three blocks an SM, the kernels spilled
// (W = 4) or ran 2 channels a thread (W = 8), and were slower at every width (H200:
// docs/ops/short_conv.md). Two is also the most: a kernel that needs fewer registers (W = 2
// takes 168) would otherwise run three blocks an SM, and that was slower too (more rows in
// flight for the same bandwidth), so bwd_smem pads the blocks' shared memory to keep a third
// block off the SM.
constexpr int kBwdBlocksPerSm = 2;

// The backward's dynamic shared memory: its rings, padded so that kBwdBlocksPerSm + 1 blocks
// do not fit on one SM of the current device.
size_t bwd_smem(size_t ring_bytes) {
  int dev = 0, per_sm = 0, reserved = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev) != cudaSuccess)
    return ring_bytes;  // the launch reports the device's error
  const int64_t pad = int64_t(per_sm) / (kBwdBlocksPerSm + 1) - reserved + 128;
  return pad > int64_t(ring_bytes) ? size_t(pad) : ring_bytes;
}

template <typename T, int N, int W, bool SEG>
__global__ void __launch_bounds__(kThreads, kBwdBlocksPerSm)
    conv_bwd(const T* __restrict__ x, const void* __restrict__ weight, const void* __restrict__ bias,
             const T* __restrict__ state, const int32_t* __restrict__ seg, const T* __restrict__ dy,
             T* __restrict__ dx, float* __restrict__ part, Problem p) {
  static_assert(W - 1 <= kStep, "the carried rows fit in one step");
  using Vec = Packed<T, N>;
  extern __shared__ __align__(16) unsigned char smem[];
  const Rings<Vec> ring(smem, 2);
  const int tid = threadIdx.x, lane = tid & 31;
  bool active;
  const int64_t c = thread_channel<N>(p, active);
  const int64_t b = blockIdx.z, C = p.channels, S = p.seq;
  const int c32 = static_cast<int>(C);  // check_shapes: kStep · C fits an int
  const int64_t tile = blockIdx.y, tiles = gridDim.y;
  const int64_t t0 = tile * p.rows;
  const int64_t t1 = min(t0 + p.rows, S);
  x += b * S * C + c;
  dy += b * S * C + c;
  dx += b * S * C + c;
  state += b * (W - 1) * C + c;
  if constexpr (SEG) seg += b * S;

  // g rows u = t0 .. t1 + W - 2; dx(u - (W-1)) once g(u) is known
  const int64_t u_end = min(t1 + W - 1, S);
  const int64_t steps = (t1 + W - 1 - t0 + kStep - 1) / kStep;
  auto issue = [&](int64_t s) {
    if (s < steps) {
      const int stage = static_cast<int>(s % kStages);
      const int64_t u0 = t0 + s * kStep;
      const int last = static_cast<int>(min(int64_t(kStep), u_end - u0)) - 1;
      const T* xs = x + u0 * C;
      const T* ds = dy + u0 * C;
      if (last == kStep - 1) {  // every row: addresses one add apart
#pragma unroll
        for (int j = 0; j < kStep; ++j, xs += c32, ds += c32) {
          async_copy<sizeof(Vec)>(ring.slot(0, stage, j, tid), xs);
          async_copy<sizeof(Vec)>(ring.slot(1, stage, j, tid), ds);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kStep; ++j) {
          const int r = min(j, last) * c32;
          async_copy<sizeof(Vec)>(ring.slot(0, stage, j, tid), xs + r);
          async_copy<sizeof(Vec)>(ring.slot(1, stage, j, tid), ds + r);
        }
      }
      if (SEG && lane < kStep) async_copy<4>(ring.ids + stage * kThreads + tid, seg + min(u0 + lane, u_end - 1));
    }
    async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);

  float w[W][N], bv[N];
#pragma unroll
  for (int k = 0; k < W; ++k) load_param<N>(weight, p.weight_type, k * C + c, w[k]);
  load_param<N>(bias, p.bias_type, c, bv);
  scale_params<N, W>(param_scale(p.silu), w, bv);

  float dw[W][N], db[N];
#pragma unroll
  for (int k = 0; k < W; ++k)
#pragma unroll
    for (int v = 0; v < N; ++v) dw[k][v] = 0.0f;
#pragma unroll
  for (int v = 0; v < N; ++v) db[v] = 0.0f;

  // carried: the W - 1 inputs, values of g and runs before the step
  float xp[W][N], gp[W][N];
  uint32_t rp;
  int32_t idp;
  int runp;
  load_halo<N, W, SEG>(x, state, p.has_state, seg, t0, C, xp, rp, idp, runp);
#pragma unroll
  for (int i = 0; i < W - 1; ++i)
#pragma unroll
    for (int v = 0; v < N; ++v) gp[i][v] = 0.0f;

  for (int64_t s = 0; s < steps; ++s) {
    issue(s + kStages - 1);
    async_wait<kStages - 1>();
    const int stage = static_cast<int>(s % kStages);
    const int64_t u0 = t0 + s * kStep;
    float xc[kStep][N], gc[kStep][N];
#pragma unroll
    for (int j = 0; j < kStep; ++j) {
      load<N>(reinterpret_cast<const T*>(ring.slot(0, stage, j, tid)), xc[j]);
      load<N>(reinterpret_cast<const T*>(ring.slot(1, stage, j, tid)), gc[j]);
    }
    // every row u of the step in the tile (so u < S), every dx row t = u - (W - 1) too
    const bool inner = active && u0 - (W - 1) >= t0 && u0 + kStep <= t1;
    uint32_t rc = 0;
    bool full = true;  // the step's rows and the W - 1 before them (the dx rows reach back) keep all taps
    if constexpr (SEG) {
      const int32_t mine = ring.ids[stage * kThreads + tid];
      const unsigned changes = step_changes(mine, idp, W == 1 && s == 0, lane);
      full = changes == 0 && runp >= 2 * W - 2;
      if (!(full && inner)) rc = step_runs<W>(changes, runp);
      idp = __shfl_sync(0xffffffffu, mine, kStep - 1);
      runp = run_in_step(changes, kStep - 1, runp, 2 * W);
    }
    const bool plain = full && inner;
    if (plain) {
      T* dxs = dx + (u0 - (W - 1)) * C;
      by_silu(p.silu, [&](auto silu) {
        bwd_rows<T, N, W, false, decltype(silu)::value, false>(w, bv, xc, xp, gc, gp, rc, rp, dw, db, dx, dxs, u0,
                                                               t0, t1, S, C, active);
      });
    } else {
      by_silu(p.silu, [&](auto silu) {
        bwd_rows<T, N, W, SEG, decltype(silu)::value, true>(w, bv, xc, xp, gc, gp, rc, rp, dw, db, dx, dx, u0, t0,
                                                            t1, S, C, active);
      });
    }
    carry<W, N>(xc, xp);
    carry<W, N>(gc, gp);
    if constexpr (SEG) rp = plain ? full_runs<W>() : rc;
  }
  if (!active) return;
  // this tile's partial sums: rows 0..W-1 of dw, row W of dbias (halved with SiLU: g was doubled)
  part += (b * tiles + tile) * (W + 1) * C + c;
  scale_params<N, W>(param_scale(p.silu), dw, db);
#pragma unroll
  for (int k = 0; k < W; ++k) store_vec<N>(part + k * C, dw[k]);
  store_vec<N>(part + W * C, db);
}

// Calls `launch` with the runtime width as a compile-time constant.
template <typename Launch>
ffi::Error by_width(int64_t width, const char* name, Launch&& launch) {
  switch (width) {
#define AXKERN_WIDTH(w) \
  case w:               \
    return launch(std::integral_constant<int, w>{});
    AXKERN_WIDTH(1)
    AXKERN_WIDTH(2)
    AXKERN_WIDTH(3)
    AXKERN_WIDTH(4)
    AXKERN_WIDTH(5)
    AXKERN_WIDTH(6)
    AXKERN_WIDTH(7)
    AXKERN_WIDTH(8)
#undef AXKERN_WIDTH
    default:
      return ffi::Error::InvalidArgument(std::string(name) + ": width must be 1..8");
  }
}

ffi::Error check_launch(const char* name) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Lets `kernel` take `bytes` of dynamic shared memory (above the default 48 KiB).
template <typename Kernel>
ffi::Error allow_smem(Kernel kernel, size_t bytes, const char* name) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

struct Shape {
  int64_t batch, seq, channels, width;
};

ffi::Error check_shapes(const char* name, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias, int64_t rows,
                        int64_t vector, Shape& s) {
  auto d = x.dimensions();
  if (d.size() != 3) return ffi::Error::InvalidArgument(std::string(name) + ": x must be [B, S, C]");
  if (weight.dimensions().size() != 2 || bias.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(std::string(name) + ": weight must be [W, C] and bias [C]");
  s = {d[0], d[1], d[2], weight.dimensions()[0]};
  if (weight.dimensions()[1] != s.channels || bias.dimensions()[0] != s.channels)
    return ffi::Error::InvalidArgument(std::string(name) + ": weight and bias must have x's channels");
  if (s.width < 1 || s.width > kMaxWidth) return ffi::Error::InvalidArgument(std::string(name) + ": width must be 1..8");
  if (s.channels > (int64_t(1) << 27))
    return ffi::Error::InvalidArgument(std::string(name) + ": more than 2^27 channels");
  if (rows < 1) return ffi::Error::InvalidArgument(std::string(name) + ": rows must be positive");
  if (s.channels % vector) return ffi::Error::InvalidArgument(std::string(name) + ": channels must be a multiple of the vector width");
  const int64_t tiles = (s.seq + rows - 1) / rows;
  if (tiles > 65535 || s.batch > 65535)
    return ffi::Error::InvalidArgument(std::string(name) + ": more than 65535 tiles or batch rows");
  return ffi::Error::Success();
}

// The kernels' code for a weight or bias element type.
ffi::Error param_type(ffi::DataType dtype, const char* name, const char* what, ParamType& out) {
  switch (dtype) {
    case ffi::DataType::F32:
      out = kF32;
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      out = kBF16;
      return ffi::Error::Success();
    case ffi::DataType::F16:
      out = kF16;
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(std::string(name) + ": " + what + " must be float32, bfloat16 or float16");
  }
}

ffi::Error problem(const char* name, const Shape& s, ffi::AnyBuffer weight, ffi::AnyBuffer bias, int64_t rows,
                   int64_t silu, int64_t segments, int64_t has_state, Problem& p) {
  p = Problem{s.seq, s.channels, rows, silu != 0, segments != 0, has_state != 0, kF32, kF32};
  if (auto err = param_type(weight.element_type(), name, "weight", p.weight_type); err.failure()) return err;
  return param_type(bias.element_type(), name, "bias", p.bias_type);
}

// Channels per thread, forward and backward: 8 bytes (16-bit inputs: 4 channels; float32: 2).
template <typename T>
__host__ __device__ constexpr int vector_width() {
  return sizeof(T) == 4 ? 2 : 8 / static_cast<int>(sizeof(T));
}

template <typename Launch>
ffi::Error by_dtype(ffi::DataType dtype, const char* name, Launch&& launch) {
  switch (dtype) {
    case ffi::DataType::BF16:
      return launch(__nv_bfloat16{});
    case ffi::DataType::F32:
      return launch(float{});
    default:
      return ffi::Error::InvalidArgument(std::string(name) + ": x must be bfloat16 or float32");
  }
}

ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                   ffi::AnyBuffer state, ffi::Buffer<ffi::S32> seg, ffi::Result<ffi::AnyBuffer> y, int64_t rows,
                   int64_t silu, int64_t segments, int64_t has_state) {
  const char* name = "AxkernShortConvFwd";
  return by_dtype(x.element_type(), name, [&](auto tt) {
    using T = decltype(tt);
    Shape s;
    if (auto err = check_shapes(name, x, weight, bias, rows, 16 / sizeof(T), s); err.failure()) return err;
    Problem p;
    if (auto err = problem(name, s, weight, bias, rows, silu, segments, has_state, p); err.failure())
      return err;
    if (s.batch == 0 || s.seq == 0 || s.channels == 0) return ffi::Error::Success();
    return by_width(s.width, name, [&](auto wc) {
      constexpr int W = decltype(wc)::value;
      constexpr int N = vector_width<T>();
      const int64_t threads_needed = s.channels / N;
      const dim3 grid((threads_needed + kThreads - 1) / kThreads, (s.seq + rows - 1) / rows, s.batch);
      auto kernel = segments ? conv_fwd<T, N, W, true> : conv_fwd<T, N, W, false>;
      const size_t smem = Rings<Packed<T, N>>::bytes(1);
      if (auto err = allow_smem(kernel, smem, name); err.failure()) return err;
      kernel<<<grid, kThreads, smem, stream>>>(static_cast<const T*>(x.untyped_data()), weight.untyped_data(),
                                               bias.untyped_data(), static_cast<const T*>(state.untyped_data()),
                                               seg.typed_data(), static_cast<T*>(y->untyped_data()), p);
      return check_launch(name);
    });
  });
}

ffi::Error BwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                   ffi::AnyBuffer state, ffi::Buffer<ffi::S32> seg, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                   ffi::Result<ffi::Buffer<ffi::F32>> part, int64_t rows, int64_t silu, int64_t segments,
                   int64_t has_state) {
  const char* name = "AxkernShortConvBwd";
  if (dy.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(name) + ": x and dy must share a dtype");
  return by_dtype(x.element_type(), name, [&](auto tt) {
    using T = decltype(tt);
    Shape s;
    if (auto err = check_shapes(name, x, weight, bias, rows, 16 / sizeof(T), s); err.failure()) return err;
    Problem p;
    if (auto err = problem(name, s, weight, bias, rows, silu, segments, has_state, p); err.failure())
      return err;
    const int64_t tiles = (s.seq + rows - 1) / rows;
    if (part->element_count() != s.batch * tiles * (s.width + 1) * s.channels)
      return ffi::Error::InvalidArgument(std::string(name) + ": partial sums must be [B * tiles, W + 1, C]");
    if (s.batch == 0 || s.seq == 0 || s.channels == 0) return ffi::Error::Success();
    return by_width(s.width, name, [&](auto wc) {
      constexpr int W = decltype(wc)::value;
      constexpr int N = vector_width<T>();
      const int64_t threads_needed = s.channels / N;
      const dim3 grid((threads_needed + kThreads - 1) / kThreads, tiles, s.batch);
      auto kernel = segments ? conv_bwd<T, N, W, true> : conv_bwd<T, N, W, false>;
      const size_t smem = bwd_smem(Rings<Packed<T, N>>::bytes(2));
      if (auto err = allow_smem(kernel, smem, name); err.failure()) return err;
      kernel<<<grid, kThreads, smem, stream>>>(
          static_cast<const T*>(x.untyped_data()), weight.untyped_data(), bias.untyped_data(),
          static_cast<const T*>(state.untyped_data()), seg.typed_data(), static_cast<const T*>(dy.untyped_data()),
          static_cast<T*>(dx->untyped_data()), part->typed_data(), p);
      return check_launch(name);
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernShortConvFwd, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("silu")
                                  .Attr<int64_t>("segments")
                                  .Attr<int64_t>("has_state"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernShortConvBwd, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("silu")
                                  .Attr<int64_t>("segments")
                                  .Attr<int64_t>("has_state"));
