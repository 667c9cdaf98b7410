// Short causal depthwise convolution as XLA FFI handlers, forward and backward.
//
// y[b, t, c] = act(bias[c] + sum_{k < W} weight[k, c] * x~[b, t - k, c]), where x~ reads the
// initial state for t - k < 0 and a tap is dropped (selected away, never multiplied by zero)
// when a change of segment id lies between t - k and t. The state's rows continue the
// sequence's first segment.
//
// AxkernShortConvFwd: x [B, S, C], weight [W, C] f32, bias [C] f32, state [B, W-1, C],
//                     segment_ids [B, S] s32 (or any array when `segments` is 0) -> y [B, S, C].
// AxkernShortConvBwd: the same inputs and dy -> dx [B, S, C], per-tile partial sums of the
//                     weight's and bias's gradients, f32 [B * tiles, W, C] and [B * tiles, C]
//                     (summed by the caller). The state's gradient is formed by the caller.
//
// Layout and grid: one thread owns N consecutive channels (a vector of 4 or 8 bytes, see
// vector_width) of `rows` consecutive positions, walking down the sequence in steps
// of kStep rows. Grid (channel blocks, tiles, B). The W - 1 inputs before a step stay in
// registers, so each input element is read from memory once, plus the W - 1 halo rows above
// its tile (a fraction (W-1)/rows).
//
// The backward forms g = dy * act'(pre) in registers (pre recomputed from the carried inputs),
// carries the last W - 1 values of g the same way and writes dx(t) = sum_k w[k] g(t + k) over the taps that
// stay in t's segment; the tile's dw[k] = sum_t g(t) x~(t - k) and dbias = sum_t g(t) are
// accumulated in registers and written once per tile. Its reads: x (tile plus 2(W-1) halo
// rows), dy (tile plus W-1 rows below it); writes: dx and the partial sums.
//
// Segment runs: run(t) = the number of positions t, t-1, ... that share t's segment, capped
// at W; tap k is kept iff k < run(t). The run is carried down the sequence from the first
// halo row, which is exact because only the last W ids matter.
#include <cuda_bf16.h>
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

template <typename T>
__device__ inline T from_f32(float v);
template <>
__device__ inline float from_f32<float>(float v) { return v; }
template <>
__device__ inline __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

template <int N, typename T>
__device__ inline void load(const T* p, float (&out)[N]) {
  const Packed<T, N> pk = *reinterpret_cast<const Packed<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f32(pk.v[i]);
}

template <int N, typename T>
__device__ inline void store(T* p, const float (&in)[N]) {
  Packed<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_f32<T>(in[i]);
  *reinterpret_cast<Packed<T, N>*>(p) = pk;
}

// sigmoid(p): 16-bit outputs use (1 + tanh(p / 2)) / 2 with one MUFU op; float32 the exact form.
__device__ inline float sigmoid(float p, bool fast) {
  if (fast) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * p));
    return 0.5f + 0.5f * t;
  }
  return 1.0f / (1.0f + expf(-p));
}

// Rows per loop step. A step first loads all its rows (addresses clamped into the tile, so
// the loads are unconditional and all in flight together), then computes them in order; the
// W - 1 rows before the step are carried in registers. Indices into the step's arrays are
// compile-time (the row and tap loops are unrolled).
constexpr int kStep = 8;

struct Problem {
  int64_t seq, channels, rows;
  bool silu, segments, fast;
};

// The segment run of a row: 1 after a change of id (or at `first`), else the previous run + 1,
// capped at W.
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
template <int W>
__device__ inline int run_at(const int (&cur)[kStep], const int (&prev)[W], int i) {
  return i >= 0 ? cur[i] : prev[W - 1 + i];
}

template <int W, int N>
__device__ inline void carry(const float (&cur)[kStep][N], float (&prev)[W][N]) {
#pragma unroll
  for (int i = 0; i < W - 1; ++i)
#pragma unroll
    for (int v = 0; v < N; ++v) prev[i][v] = cur[kStep - (W - 1) + i][v];
}

// The W - 1 inputs before a tile starting at t0 (the state's rows before position 0), the
// segment run of each, and the last id and run: what a thread carries into its first step.
template <int N, int W, bool SEG, typename T>
__device__ inline void load_halo(const T* x, const T* state, const int32_t* seg, int64_t t0, int64_t C,
                                 float (&xp)[W][N], int (&rp)[W], int32_t& idp, int& runp) {
  idp = 0;
  runp = W;
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    const int64_t u = t0 - (W - 1) + i;
    load<N>(u < 0 ? state + (u + W - 1) * C : x + u * C, xp[i]);
    if (SEG) {
      const int32_t id = seg[u < 0 ? 0 : u];
      runp = next_run(id, idp, runp, i == 0, W);
      idp = id;
    }
    rp[i] = runp;
  }
}

template <typename T, int N, int W, bool SEG>
__global__ void __launch_bounds__(kThreads) conv_fwd(const T* __restrict__ x, const float* __restrict__ weight,
                                                     const float* __restrict__ bias, const T* __restrict__ state,
                                                     const int32_t* __restrict__ seg, T* __restrict__ y,
                                                     Problem p) {
  static_assert(W - 1 <= kStep, "the carried rows fit in one step");
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (c >= p.channels) return;
  const int64_t b = blockIdx.z, C = p.channels, S = p.seq;
  const int64_t t0 = int64_t(blockIdx.y) * p.rows;
  const int64_t t1 = min(t0 + p.rows, S);
  x += b * S * C + c;
  y += b * S * C + c;
  state += b * (W - 1) * C + c;
  if constexpr (SEG) seg += b * S;

  float w[W][N], bv[N];
#pragma unroll
  for (int k = 0; k < W; ++k) load<N>(weight + k * C + c, w[k]);
  load<N>(bias + c, bv);

  float xp[W][N];
  int rp[W];
  int32_t idp;
  int runp;
  load_halo<N, W, SEG>(x, state, seg, t0, C, xp, rp, idp, runp);

  for (int64_t t = t0; t < t1; t += kStep) {
    float xc[kStep][N];
    int32_t ids[kStep];
    int rc[kStep];
#pragma unroll
    for (int j = 0; j < kStep; ++j) {
      const int64_t u = min(t + j, t1 - 1);
      load<N>(x + u * C, xc[j]);
      ids[j] = SEG ? seg[u] : 0;
    }
#pragma unroll
    for (int j = 0; j < kStep; ++j) {
      rc[j] = SEG ? next_run(ids[j], j ? ids[j - 1] : idp, j ? rc[j - 1] : runp, W == 1 && t == t0 && j == 0, W)
                         : W;
      float acc[N];
#pragma unroll
      for (int v = 0; v < N; ++v) acc[v] = bv[v];
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const bool keep = k < rc[j];
        const float(&src)[N] = row<W, N>(xc, xp, j - k);
#pragma unroll
        for (int v = 0; v < N; ++v) acc[v] = add_tap<SEG>(acc[v], w[k][v], src[v], keep);
      }
      if (p.silu) {
#pragma unroll
        for (int v = 0; v < N; ++v) acc[v] = acc[v] * sigmoid(acc[v], p.fast);
      }
      if (t + j < t1) store<N>(y + (t + j) * C, acc);
    }
    carry<W, N>(xc, xp);
    idp = ids[kStep - 1];
    runp = rc[kStep - 1];
  }
}

template <typename T, int N, int W, bool SEG>
__global__ void __launch_bounds__(kThreads) conv_bwd(const T* __restrict__ x, const float* __restrict__ weight,
                                                     const float* __restrict__ bias, const T* __restrict__ state,
                                                     const int32_t* __restrict__ seg, const T* __restrict__ dy,
                                                     T* __restrict__ dx, float* __restrict__ dw_part,
                                                     float* __restrict__ db_part, Problem p) {
  static_assert(W - 1 <= kStep, "the carried rows fit in one step");
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (c >= p.channels) return;
  const int64_t b = blockIdx.z, C = p.channels, S = p.seq;
  const int64_t tile = blockIdx.y, tiles = gridDim.y;
  const int64_t t0 = tile * p.rows;
  const int64_t t1 = min(t0 + p.rows, S);
  x += b * S * C + c;
  dy += b * S * C + c;
  dx += b * S * C + c;
  state += b * (W - 1) * C + c;
  if constexpr (SEG) seg += b * S;

  float w[W][N], bv[N];
#pragma unroll
  for (int k = 0; k < W; ++k) load<N>(weight + k * C + c, w[k]);
  load<N>(bias + c, bv);

  float dw[W][N], db[N];
#pragma unroll
  for (int k = 0; k < W; ++k)
#pragma unroll
    for (int v = 0; v < N; ++v) dw[k][v] = 0.0f;
#pragma unroll
  for (int v = 0; v < N; ++v) db[v] = 0.0f;

  // carried: the W - 1 inputs, values of g and runs before the step
  float xp[W][N], gp[W][N];
  int rp[W];
  int32_t idp;
  int runp;
  load_halo<N, W, SEG>(x, state, seg, t0, C, xp, rp, idp, runp);
#pragma unroll
  for (int i = 0; i < W - 1; ++i)
#pragma unroll
    for (int v = 0; v < N; ++v) gp[i][v] = 0.0f;

  // g rows u = t0 .. t1 + W - 2; dx(u - (W-1)) once g(u) is known
  const int64_t u_end = min(t1 + W - 1, S);
  for (int64_t u0 = t0; u0 < t1 + W - 1; u0 += kStep) {
    float xc[kStep][N], gc[kStep][N];
    int32_t ids[kStep];
    int rc[kStep];
#pragma unroll
    for (int j = 0; j < kStep; ++j) {
      const int64_t u = min(u0 + j, u_end - 1);
      load<N>(x + u * C, xc[j]);
      load<N>(dy + u * C, gc[j]);
      ids[j] = SEG ? seg[u] : 0;
    }
#pragma unroll
    for (int j = 0; j < kStep; ++j) {
      const int64_t u = u0 + j;
      rc[j] = SEG ? next_run(ids[j], j ? ids[j - 1] : idp, j ? rc[j - 1] : runp, W == 1 && u == t0, W) : W;
      if (p.silu) {
#pragma unroll
        for (int v = 0; v < N; ++v) {
          float pre = bv[v];
#pragma unroll
          for (int k = 0; k < W; ++k) pre = add_tap<SEG>(pre, w[k][v], row<W, N>(xc, xp, j - k)[v], k < rc[j]);
          const float s = sigmoid(pre, p.fast);
          gc[j][v] *= s * (1.0f + pre * (1.0f - s));
        }
      }
      const bool inside = u < S;
#pragma unroll
      for (int v = 0; v < N; ++v) gc[j][v] = inside ? gc[j][v] : 0.0f;  // selected, never multiplied
      if (u < t1) {
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const bool keep = k < rc[j];
#pragma unroll
          for (int v = 0; v < N; ++v) dw[k][v] = add_tap<SEG>(dw[k][v], gc[j][v], row<W, N>(xc, xp, j - k)[v], keep);
        }
#pragma unroll
        for (int v = 0; v < N; ++v) db[v] += gc[j][v];
      }
      const int64_t t = u - (W - 1);
      if (t >= t0 && t < t1) {
        float acc[N];
#pragma unroll
        for (int v = 0; v < N; ++v) acc[v] = 0.0f;
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const int i = j - (W - 1) + k;  // row t + k of this step
          const bool keep = k < run_at<W>(rc, rp, i);
          const float(&g)[N] = row<W, N>(gc, gp, i);
#pragma unroll
          for (int v = 0; v < N; ++v) acc[v] = add_tap<SEG>(acc[v], w[k][v], g[v], keep);
        }
        store<N>(dx + t * C, acc);
      }
    }
    carry<W, N>(xc, xp);
    carry<W, N>(gc, gp);
#pragma unroll
    for (int i = 0; i < W - 1; ++i) rp[i] = rc[kStep - (W - 1) + i];
    idp = ids[kStep - 1];
    runp = rc[kStep - 1];
  }
  const int64_t part = b * tiles + tile;
#pragma unroll
  for (int k = 0; k < W; ++k) store<N>(dw_part + (part * W + k) * C + c, dw[k]);
  store<N>(db_part + part * C + c, db);
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

struct Shape {
  int64_t batch, seq, channels, width;
};

ffi::Error check_shapes(const char* name, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weight, int64_t rows,
                        int64_t vector, Shape& s) {
  auto d = x.dimensions();
  if (d.size() != 3) return ffi::Error::InvalidArgument(std::string(name) + ": x must be [B, S, C]");
  s = {d[0], d[1], d[2], weight.dimensions()[0]};
  if (s.width < 1 || s.width > kMaxWidth) return ffi::Error::InvalidArgument(std::string(name) + ": width must be 1..8");
  if (rows < 1) return ffi::Error::InvalidArgument(std::string(name) + ": rows must be positive");
  if (s.channels % vector) return ffi::Error::InvalidArgument(std::string(name) + ": channels must be a multiple of the vector width");
  const int64_t tiles = (s.seq + rows - 1) / rows;
  if (tiles > 65535 || s.batch > 65535)
    return ffi::Error::InvalidArgument(std::string(name) + ": more than 65535 tiles or batch rows");
  return ffi::Error::Success();
}

// Channels per thread: a vector of 8 bytes for W <= 4 and 4 bytes above (float32: 8), so that
// a step's rows fit in registers with enough threads per SM to keep loads in flight (measured
// on the H200: docs/ops/short_conv.md).
template <typename T, int W>
__host__ __device__ constexpr int vector_width() {
  return sizeof(T) == 4 ? 2 : (W <= 4 ? 8 : 4) / static_cast<int>(sizeof(T));
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

ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::F32> bias,
                   ffi::AnyBuffer state, ffi::Buffer<ffi::S32> seg, ffi::Result<ffi::AnyBuffer> y, int64_t rows,
                   int64_t silu, int64_t segments) {
  const char* name = "AxkernShortConvFwd";
  return by_dtype(x.element_type(), name, [&](auto tt) {
    using T = decltype(tt);
    Shape s;
    if (auto err = check_shapes(name, x, weight, rows, 16 / sizeof(T), s); err.failure()) return err;
    if (s.batch == 0 || s.seq == 0 || s.channels == 0) return ffi::Error::Success();
    return by_width(s.width, name, [&](auto wc) {
      constexpr int W = decltype(wc)::value;
      constexpr int N = vector_width<T, W>();
      const Problem p{s.seq, s.channels, rows, silu != 0, segments != 0, sizeof(T) == 2};
      const int64_t threads_needed = s.channels / N;
      const dim3 grid((threads_needed + kThreads - 1) / kThreads, (s.seq + rows - 1) / rows, s.batch);
      auto kernel = segments ? conv_fwd<T, N, W, true> : conv_fwd<T, N, W, false>;
      kernel<<<grid, kThreads, 0, stream>>>(
          static_cast<const T*>(x.untyped_data()), weight.typed_data(), bias.typed_data(),
          static_cast<const T*>(state.untyped_data()), seg.typed_data(), static_cast<T*>(y->untyped_data()), p);
      return check_launch(name);
    });
  });
}

ffi::Error BwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::F32> bias,
                   ffi::AnyBuffer state, ffi::Buffer<ffi::S32> seg, ffi::AnyBuffer dy,
                   ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::Buffer<ffi::F32>> dw_part,
                   ffi::Result<ffi::Buffer<ffi::F32>> db_part, int64_t rows, int64_t silu, int64_t segments) {
  const char* name = "AxkernShortConvBwd";
  if (dy.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(name) + ": x and dy must share a dtype");
  return by_dtype(x.element_type(), name, [&](auto tt) {
    using T = decltype(tt);
    Shape s;
    if (auto err = check_shapes(name, x, weight, rows, 16 / sizeof(T), s); err.failure()) return err;
    const int64_t tiles = (s.seq + rows - 1) / rows;
    if (dw_part->element_count() != s.batch * tiles * s.width * s.channels ||
        db_part->element_count() != s.batch * tiles * s.channels)
      return ffi::Error::InvalidArgument(std::string(name) + ": partial sums must be [B * tiles, W, C] and [B * tiles, C]");
    if (s.batch == 0 || s.seq == 0 || s.channels == 0) return ffi::Error::Success();
    return by_width(s.width, name, [&](auto wc) {
      constexpr int W = decltype(wc)::value;
      constexpr int N = vector_width<T, W>();
      const Problem p{s.seq, s.channels, rows, silu != 0, segments != 0, sizeof(T) == 2};
      const int64_t threads_needed = s.channels / N;
      const dim3 grid((threads_needed + kThreads - 1) / kThreads, tiles, s.batch);
      auto kernel = segments ? conv_bwd<T, N, W, true> : conv_bwd<T, N, W, false>;
      kernel<<<grid, kThreads, 0, stream>>>(
          static_cast<const T*>(x.untyped_data()), weight.typed_data(), bias.typed_data(),
          static_cast<const T*>(state.untyped_data()), seg.typed_data(), static_cast<const T*>(dy.untyped_data()),
          static_cast<T*>(dx->untyped_data()), dw_part->typed_data(), db_part->typed_data(), p);
      return check_launch(name);
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernShortConvFwd, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("silu")
                                  .Attr<int64_t>("segments"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AxkernShortConvBwd, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("silu")
                                  .Attr<int64_t>("segments"));
