// attnaux's own CUDA kernels behind XLA FFI handlers (platform "CUDA"), same ABI and target
// names as the CPU handlers:
//
// - `attnaux_softmax_fwd` / `attnaux_softmax_bwd` (docs/softmax_abi.md): one warp per row while
//   a row fits in registers (<= 64 floats per lane, so kv_seq <= 2048), 16-byte vector loads and
//   stores when kv_seq is a multiple of the vector width; longer rows take one 512-thread block
//   per row with an online (max, sum) pass and a write pass. Float32 math for every dtype.
// - `attnaux_small_seq_fwd` / `attnaux_small_seq_bwd` (docs/kernel_abi.md): q_seq == 1 and
//   kv_seq <= 16. Forward: one warp per (batch, query head); the head dim is in the lanes, the
//   <= 16 dot products have all their loads in flight, the softmax is done redundantly in every
//   lane. Backward: one warp per (batch, kv head) that walks the group's query heads in order
//   (dq, dbias), then accumulates dk / dv in registers: no atomics, results are deterministic.
// - Dropout: Philox-4x32-10 with the counter layout of docs/kernel_abi.md (csrc/philox.h), so the
//   keep-mask is bitwise the CPU one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux_cuda_kernels {

constexpr float kInf = INFINITY;

// ------------------------------------------------------------------------------------------------
// Element conversion and vectors
// ------------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float ToF(T x);
template <>
__device__ __forceinline__ float ToF<float>(float x) { return x; }
template <>
__device__ __forceinline__ float ToF<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float ToF<__half>(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half FromF<__half>(float x) { return __float2half_rn(x); }

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void LoadF(const T* p, float* out) {
  const Vec<T, N> x = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int t = 0; t < N; ++t) out[t] = ToF<T>(x.v[t]);
}

template <typename T, int N>
__device__ __forceinline__ void StoreF(T* p, const float* in) {
  Vec<T, N> x;
#pragma unroll
  for (int t = 0; t < N; ++t) x.v[t] = FromF<T>(in[t]);
  *reinterpret_cast<Vec<T, N>*>(p) = x;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// ------------------------------------------------------------------------------------------------
// Philox-4x32-10 and the dropout keep-mask (docs/kernel_abi.md, csrc/philox.h)
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t DropoutWord(const uint32_t* rng, uint64_t e) {
  const uint64_t group = e >> 2;
  uint32_t c0 = static_cast<uint32_t>(group), c1 = static_cast<uint32_t>(group >> 32);
  uint32_t c2 = rng[2], c3 = rng[3];
  uint32_t k0 = rng[0], k1 = rng[1];
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
    const uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  switch (e & 3u) {
    case 0: return c0;
    case 1: return c1;
    case 2: return c2;
    default: return c3;
  }
}

// ================================================================================================
// Fused softmax
// ================================================================================================
struct SoftmaxArgs {
  int64_t n = 0, sq = 0, skv = 0;
  float scale = 1.0f;
  int causal = 0;
  const uint8_t* mask = nullptr;
  int64_t mask_n = 0, mask_q = 1, mask_kv = 1, mask_div = 1;
};

__device__ __forceinline__ const uint8_t* MaskRow(const SoftmaxArgs& a, int64_t row) {
  if (a.mask == nullptr) return nullptr;
  const int64_t n = row / a.sq, i = row - n * a.sq;
  const int64_t m = (n / a.mask_div) % a.mask_n;
  return a.mask + (m * a.mask_q + (a.mask_q == 1 ? 0 : i)) * a.mask_kv;
}

// One past the last positionally visible key of row i.
__device__ __forceinline__ int64_t RowEnd(const SoftmaxArgs& a, int64_t i) {
  if (a.causal == 0) return a.skv;
  const int64_t e = i + (a.causal == 2 ? a.skv - a.sq : 0) + 1;
  return e < 0 ? 0 : (e > a.skv ? a.skv : e);
}

__device__ __forceinline__ bool MaskAt(const uint8_t* mrow, int64_t mask_kv, int64_t j) {
  return mrow == nullptr || mrow[mask_kv == 1 ? 0 : j] != 0;
}

constexpr int kRowWarps = 8;  // rows (warps) per block of the warp-per-row kernels

template <typename T, int VEC, int NC, bool MASKED>
__global__ void __launch_bounds__(kRowWarps * 32)
    SoftmaxFwdWarp(SoftmaxArgs a, const T* __restrict__ x, T* __restrict__ probs,
                   float* __restrict__ lse, float* __restrict__ row_max) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= a.n * a.sq) return;
  const int64_t i = row % a.sq;
  const int64_t end = RowEnd(a, i);
  const uint8_t* mrow = MaskRow(a, row);
  const T* xr = x + row * a.skv;
  float s[NC][VEC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < end) {
      LoadF<T, VEC>(xr + j0, s[c]);
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) s[c][t] = -kInf;
    }
  }
  float m = -kInf;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      // Without mask and causal every key of an in-bounds vector is visible (skv % VEC == 0).
      const bool vis = MASKED ? (j0 + t < end && MaskAt(mrow, a.mask_kv, j0 + t)) : j0 < end;
      s[c][t] = vis ? a.scale * s[c][t] : -kInf;
      m = fmaxf(m, s[c][t]);
    }
  }
  m = WarpMax(m);
  const float shift = m == -kInf ? 0.0f : m;
  constexpr float kLog2e = 1.4426950408889634f;
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      s[c][t] = exp2f((s[c][t] - shift) * kLog2e);  // exp; exp2f is ex2.approx, ~2 ulp
      sum += s[c][t];
    }
  }
  sum = WarpSum(sum);
  const float inv = m == -kInf ? 0.0f : 1.0f / sum;
  T* pr = probs + row * a.skv;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < a.skv) {
#pragma unroll
      for (int t = 0; t < VEC; ++t) s[c][t] *= inv;
      StoreF<T, VEC>(pr + j0, s[c]);
    }
  }
  if (lane == 0) {
    lse[row] = m == -kInf ? -kInf : m + logf(sum);
    row_max[row] = m;
  }
}

constexpr int kBlockThreads = 512;

__device__ __forceinline__ void Combine(float& m, float& s, float m2, float s2) {
  const float big = fmaxf(m, m2);
  if (big == -kInf) {
    s = s + s2;  // both empty (0), or NaN that must survive
    return;
  }
  s = s * expf(m - big) + s2 * expf(m2 - big);
  m = big;
}

// (max, sum) of the block, broadcast to every thread.
__device__ __forceinline__ void BlockCombine(float& m, float& s) {
  __shared__ float sm[kBlockThreads / 32], ss[kBlockThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    Combine(m, s, m2, s2);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  m = -kInf;
  s = 0.0f;
  for (int w = 0; w < kBlockThreads / 32; ++w) Combine(m, s, sm[w], ss[w]);  // same in all threads
}

__device__ __forceinline__ float BlockSum(float x) {
  __shared__ float part[kBlockThreads / 32];
  x = WarpSum(x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) part[warp] = x;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kBlockThreads / 32; ++w) total += part[w];
  return total;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
    SoftmaxFwdBlock(SoftmaxArgs a, const T* __restrict__ x, T* __restrict__ probs,
                    float* __restrict__ lse, float* __restrict__ row_max) {
  const int64_t row = blockIdx.x;
  const int64_t i = row % a.sq;
  const int64_t end = RowEnd(a, i);
  const uint8_t* mrow = MaskRow(a, row);
  const T* xr = x + row * a.skv;
  float m = -kInf, sum = 0.0f;
  for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * VEC; j0 < end;
       j0 += static_cast<int64_t>(kBlockThreads) * VEC) {
    float s[VEC];
    LoadF<T, VEC>(xr + j0, s);
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      if (j0 + t >= end || !MaskAt(mrow, a.mask_kv, j0 + t)) continue;
      const float v = a.scale * s[t];
      if (v > m) {
        sum = sum * expf(m - v) + 1.0f;
        m = v;
      } else {
        sum += expf(v - m);
      }
    }
  }
  BlockCombine(m, sum);
  const float shift = m == -kInf ? 0.0f : m;
  const float inv = m == -kInf ? 0.0f : 1.0f / sum;
  T* pr = probs + row * a.skv;
  for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * VEC; j0 < a.skv;
       j0 += static_cast<int64_t>(kBlockThreads) * VEC) {
    float s[VEC];
    if (j0 < end) {
      LoadF<T, VEC>(xr + j0, s);
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) s[t] = 0.0f;
    }
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      const bool vis = j0 + t < end && MaskAt(mrow, a.mask_kv, j0 + t);
      s[t] = vis ? expf(a.scale * s[t] - shift) * inv : 0.0f;
    }
    StoreF<T, VEC>(pr + j0, s);
  }
  if (threadIdx.x == 0) {
    lse[row] = m == -kInf ? -kInf : m + logf(sum);
    row_max[row] = m;
  }
}

// Backward: dlogits may alias probs (each element is read by the thread that writes it, and the
// row's reduction completes before any write).
template <typename T, int VEC, int NC>
__global__ void __launch_bounds__(kRowWarps * 32)
    SoftmaxBwdWarp(int64_t rows, int64_t skv, float scale, const T* probs, const T* dprobs,
                   const float* dlse, T* dlogits) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  float p[NC][VEC], g[NC][VEC];
  float dt = 0.0f;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < skv) {
      LoadF<T, VEC>(probs + row * skv + j0, p[c]);
      LoadF<T, VEC>(dprobs + row * skv + j0, g[c]);
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) p[c][t] = g[c][t] = 0.0f;
    }
#pragma unroll
    for (int t = 0; t < VEC; ++t) dt += p[c][t] != 0.0f ? p[c][t] * g[c][t] : 0.0f;
  }
  dt = WarpSum(dt) - dlse[row];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < skv) {
#pragma unroll
      for (int t = 0; t < VEC; ++t) {
        g[c][t] = p[c][t] != 0.0f ? (p[c][t] * scale) * (g[c][t] - dt) : 0.0f;
      }
      StoreF<T, VEC>(dlogits + row * skv + j0, g[c]);
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
    SoftmaxBwdBlock(int64_t skv, float scale, const T* probs, const T* dprobs, const float* dlse,
                    T* dlogits) {
  const int64_t row = blockIdx.x;
  const T* pr = probs + row * skv;
  const T* gr = dprobs + row * skv;
  float dt = 0.0f;
  for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * VEC; j0 < skv;
       j0 += static_cast<int64_t>(kBlockThreads) * VEC) {
    float p[VEC], g[VEC];
    LoadF<T, VEC>(pr + j0, p);
    LoadF<T, VEC>(gr + j0, g);
#pragma unroll
    for (int t = 0; t < VEC; ++t) dt += p[t] != 0.0f ? p[t] * g[t] : 0.0f;
  }
  dt = BlockSum(dt) - dlse[row];
  for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * VEC; j0 < skv;
       j0 += static_cast<int64_t>(kBlockThreads) * VEC) {
    float p[VEC], g[VEC];
    LoadF<T, VEC>(pr + j0, p);
    LoadF<T, VEC>(gr + j0, g);
#pragma unroll
    for (int t = 0; t < VEC; ++t) g[t] = p[t] != 0.0f ? (p[t] * scale) * (g[t] - dt) : 0.0f;
    StoreF<T, VEC>(dlogits + row * skv + j0, g);
  }
}

constexpr int64_t kMaxRegPerLane = 64;  // floats of a row per lane in the warp kernels

template <typename T, int VEC>
cudaError_t LaunchSoftmaxFwdT(cudaStream_t stream, const SoftmaxArgs& a, const void* x, void* p,
                              float* lse, float* mx) {
  const int64_t rows = a.n * a.sq;
  const T* xt = static_cast<const T*>(x);
  T* pt = static_cast<T*>(p);
  const int64_t per_lane = (a.skv + 31) / 32;  // elements per lane
  const dim3 grid(static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps));
  const dim3 block(kRowWarps * 32);
  if (per_lane <= kMaxRegPerLane) {
    const int64_t nc = (per_lane + VEC - 1) / VEC;
    auto go = [&](auto ncv) {
      constexpr int NC = decltype(ncv)::value;
      if constexpr (NC * VEC <= kMaxRegPerLane) {
        if (a.mask != nullptr || a.causal != 0) {
          SoftmaxFwdWarp<T, VEC, NC, true><<<grid, block, 0, stream>>>(a, xt, pt, lse, mx);
        } else {
          SoftmaxFwdWarp<T, VEC, NC, false><<<grid, block, 0, stream>>>(a, xt, pt, lse, mx);
        }
      }
    };
    if (nc <= 1) go(std::integral_constant<int, 1>{});
    else if (nc <= 2) go(std::integral_constant<int, 2>{});
    else if (nc <= 4) go(std::integral_constant<int, 4>{});
    else if (nc <= 8) go(std::integral_constant<int, 8>{});
    else if (nc <= 16) go(std::integral_constant<int, 16>{});
    else if (nc <= 32) go(std::integral_constant<int, 32>{});
    else go(std::integral_constant<int, 64>{});
  } else {
    SoftmaxFwdBlock<T, VEC><<<static_cast<unsigned>(rows), kBlockThreads, 0, stream>>>(a, xt, pt, lse, mx);
  }
  return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t LaunchSoftmaxBwdT(cudaStream_t stream, int64_t rows, int64_t skv, float scale,
                              const void* p, const void* g, const float* dlse, void* out) {
  const T* pt = static_cast<const T*>(p);
  const T* gt = static_cast<const T*>(g);
  T* ot = static_cast<T*>(out);
  const int64_t per_lane = (skv + 31) / 32;
  const dim3 grid(static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps));
  const dim3 block(kRowWarps * 32);
  // Two row buffers live in registers here: half the forward's limit.
  if (per_lane <= kMaxRegPerLane / 2) {
    const int64_t nc = (per_lane + VEC - 1) / VEC;
    auto go = [&](auto ncv) {
      constexpr int NC = decltype(ncv)::value;
      if constexpr (NC * VEC <= kMaxRegPerLane / 2) {
        SoftmaxBwdWarp<T, VEC, NC><<<grid, block, 0, stream>>>(rows, skv, scale, pt, gt, dlse, ot);
      }
    };
    if (nc <= 1) go(std::integral_constant<int, 1>{});
    else if (nc <= 2) go(std::integral_constant<int, 2>{});
    else if (nc <= 4) go(std::integral_constant<int, 4>{});
    else if (nc <= 8) go(std::integral_constant<int, 8>{});
    else if (nc <= 16) go(std::integral_constant<int, 16>{});
    else go(std::integral_constant<int, 32>{});
  } else {
    SoftmaxBwdBlock<T, VEC><<<static_cast<unsigned>(rows), kBlockThreads, 0, stream>>>(skv, scale, pt, gt, dlse, ot);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchSoftmaxFwd(cudaStream_t stream, const SoftmaxArgs& a, const void* x, void* p,
                             float* lse, float* mx) {
  constexpr int kVec = 16 / sizeof(T);
  if (a.skv % kVec == 0) return LaunchSoftmaxFwdT<T, kVec>(stream, a, x, p, lse, mx);
  if (a.skv % 2 == 0) return LaunchSoftmaxFwdT<T, 2>(stream, a, x, p, lse, mx);
  return LaunchSoftmaxFwdT<T, 1>(stream, a, x, p, lse, mx);
}

template <typename T>
cudaError_t LaunchSoftmaxBwd(cudaStream_t stream, int64_t rows, int64_t skv, float scale,
                             const void* p, const void* g, const float* dlse, void* out) {
  constexpr int kVec = 16 / sizeof(T);
  if (skv % kVec == 0) return LaunchSoftmaxBwdT<T, kVec>(stream, rows, skv, scale, p, g, dlse, out);
  if (skv % 2 == 0) return LaunchSoftmaxBwdT<T, 2>(stream, rows, skv, scale, p, g, dlse, out);
  return LaunchSoftmaxBwdT<T, 1>(stream, rows, skv, scale, p, g, dlse, out);
}

// ================================================================================================
// small_seq: q_seq == 1, kv_seq <= 16
// ================================================================================================
constexpr int kSmallMaxKeys = 16;

struct AttnArgs {
  int64_t batch = 0, kv_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0, v_dim = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* bias = nullptr;
  int64_t bias_stride[4] = {0, 0, 0, 0};
  const uint8_t* mask = nullptr;
  int64_t mask_stride[4] = {0, 0, 0, 0};
  const int32_t* q_seqlens = nullptr;
  const int32_t* kv_seqlens = nullptr;
  const int32_t* q_seg = nullptr;
  const int32_t* kv_seg = nullptr;
  const float* sink = nullptr;
  const uint32_t* rng = nullptr;
  float scale = 1.0f, softcap = 0.0f;
  int causal = 0;
  int64_t window_left = -1, window_right = -1;
  uint32_t drop_threshold = 0;
  float drop_scale = 1.0f;
};

// Per (b, h) of the one query row: lengths and the bit set of visible keys (bit j = key j).
struct RowInfo {
  bool padding;
  uint32_t visible;
};

__device__ __forceinline__ RowInfo SmallRow(const AttnArgs& a, int64_t b, int64_t h, int lane) {
  const int64_t qs = a.q_seqlens[b], ks = a.kv_seqlens[b];
  const int64_t ql = qs < 1 ? 0 : 1;
  const int64_t kl = ks < 0 ? 0 : (ks > a.kv_len ? a.kv_len : ks);
  const int64_t off = a.causal == 2 ? kl - ql : 0;
  const int64_t j = lane;
  bool vis = ql > 0 && j < kl;
  if (vis && a.causal != 0) vis = j <= off;
  if (vis && a.window_left >= 0) vis = j >= off - a.window_left;
  if (vis && a.window_right >= 0) vis = j <= off + a.window_right;
  if (vis && a.mask != nullptr) {
    vis = a.mask[b * a.mask_stride[0] + h * a.mask_stride[1] + j * a.mask_stride[3]] != 0;
  }
  if (vis && a.q_seg != nullptr) vis = a.q_seg[b] == a.kv_seg[b * a.kv_len + j];
  RowInfo r;
  r.padding = ql == 0;
  r.visible = __ballot_sync(0xffffffffu, vis);
  return r;
}

// Dropout factor of key `lane` of row (b, h) (1 without dropout), one Philox call per lane.
__device__ __forceinline__ float SmallDrop(const AttnArgs& a, int64_t b, int64_t h, int lane) {
  if (a.rng == nullptr) return 1.0f;
  float f = 0.0f;
  if (lane < a.kv_len) {
    const uint64_t e = static_cast<uint64_t>((b * a.q_heads + h) * a.kv_len + lane);
    f = DropoutWord(a.rng, e) >= a.drop_threshold ? a.drop_scale : 0.0f;
  }
  return f;
}

__device__ __forceinline__ float Lane(float x, int j) { return __shfl_sync(0xffffffffu, x, j); }

// acc[j] = <x, rows[j]> (reduced over the warp; every lane gets every value) for visible j.
template <typename T, int VEC>
__device__ __forceinline__ void SmallDots(const T* x, const T* rows, int64_t row_stride,
                                          int64_t dim, uint32_t visible, int lane, float* acc) {
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) acc[j] = 0.0f;
  for (int64_t d0 = static_cast<int64_t>(lane) * VEC; d0 < dim; d0 += 32 * VEC) {
    float xv[VEC];
    LoadF<T, VEC>(x + d0, xv);
#pragma unroll
    for (int j = 0; j < kSmallMaxKeys; ++j) {
      if (visible >> j & 1u) {
        float kv[VEC];
        LoadF<T, VEC>(rows + j * row_stride + d0, kv);
#pragma unroll
        for (int t = 0; t < VEC; ++t) acc[j] = fmaf(xv[t], kv[t], acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    if (visible >> j & 1u) acc[j] = WarpSum(acc[j]);
  }
}

// out[d] = sum_j w[j] rows[j][d] for visible j, written as T.
template <typename T, int VEC>
__device__ __forceinline__ void SmallAxpy(const float* w, const T* rows, int64_t row_stride,
                                          int64_t dim, uint32_t visible, int lane, T* out) {
  for (int64_t d0 = static_cast<int64_t>(lane) * VEC; d0 < dim; d0 += 32 * VEC) {
    float acc[VEC];
#pragma unroll
    for (int t = 0; t < VEC; ++t) acc[t] = 0.0f;
#pragma unroll
    for (int j = 0; j < kSmallMaxKeys; ++j) {
      if (visible >> j & 1u) {
        float r[VEC];
        LoadF<T, VEC>(rows + j * row_stride + d0, r);
#pragma unroll
        for (int t = 0; t < VEC; ++t) acc[t] = fmaf(w[j], r[t], acc[t]);
      }
    }
    StoreF<T, VEC>(out + d0, acc);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void ZeroRow(T* out, int64_t dim, int lane) {
  float z[VEC];
#pragma unroll
  for (int t = 0; t < VEC; ++t) z[t] = 0.0f;
  for (int64_t d0 = static_cast<int64_t>(lane) * VEC; d0 < dim; d0 += 32 * VEC) StoreF<T, VEC>(out + d0, z);
}

// Final logit of key j from its raw dot (scale, softcap, bias).
__device__ __forceinline__ float SmallLogit(const AttnArgs& a, const float* bias_row, int j,
                                            float dot) {
  float s = a.softcap > 0.0f ? a.softcap * tanhf(dot * a.scale / a.softcap) : dot * a.scale;
  if (bias_row != nullptr) s += bias_row[j * a.bias_stride[3]];
  return s;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kRowWarps * 32)
    SmallSeqFwd(AttnArgs a, T* __restrict__ out, float* __restrict__ lse,
                float* __restrict__ row_max, T* __restrict__ probs) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= a.batch * a.q_heads) return;
  const int64_t b = row / a.q_heads, h = row - b * a.q_heads;
  const int64_t hk = h / (a.q_heads / a.kv_heads);
  const RowInfo info = SmallRow(a, b, h, lane);
  const float sink = a.sink != nullptr ? a.sink[h] : -kInf;
  const int64_t kv_stride = a.kv_heads * a.head_dim, vv_stride = a.kv_heads * a.v_dim;
  const T* q = static_cast<const T*>(a.q) + row * a.head_dim;  // [B, 1, Hq, D]
  const T* krows = static_cast<const T*>(a.k) + (b * a.kv_len * a.kv_heads + hk) * a.head_dim;
  const T* vrows = static_cast<const T*>(a.v) + (b * a.kv_len * a.kv_heads + hk) * a.v_dim;
  float s[kSmallMaxKeys];
  SmallDots<T, VEC>(q, krows, kv_stride, a.head_dim, info.visible, lane, s);
  const float* bias_row =
      a.bias != nullptr ? a.bias + b * a.bias_stride[0] + h * a.bias_stride[1] : nullptr;
  float m = -kInf;
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    s[j] = (info.visible >> j & 1u) ? SmallLogit(a, bias_row, j, s[j]) : -kInf;
    m = fmaxf(m, s[j]);
  }
  const float shift = m == -kInf ? 0.0f : m;
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) sum += (info.visible >> j & 1u) ? expf(s[j] - shift) : 0.0f;
  float l;
  if (a.sink != nullptr) {
    const float big = fmaxf(m, sink);
    const float scaled = m == -kInf ? 0.0f : sum * expf(m - big);
    l = big + logf(scaled + expf(sink - big));
  } else {
    l = (m == -kInf || !(sum > 0.0f)) ? -kInf : m + logf(sum);
  }
  const bool zero = l == -kInf || m == -kInf;
  const float drop = SmallDrop(a, b, h, lane);
  float w[kSmallMaxKeys];
  float pmine = 0.0f;
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    const float p = (!zero && (info.visible >> j & 1u)) ? expf(s[j] - l) : 0.0f;
    if (j == lane) pmine = p;
    w[j] = p * Lane(drop, j);
  }
  T* orow = out + row * a.v_dim;
  if (info.visible != 0) {
    SmallAxpy<T, VEC>(w, vrows, vv_stride, a.v_dim, info.visible, lane, orow);
  } else {
    ZeroRow<T, VEC>(orow, a.v_dim, lane);
  }
  if (probs != nullptr && lane < a.kv_len) probs[row * a.kv_len + lane] = FromF<T>(pmine);
  if (lane == 0) {
    lse[row] = info.padding ? sink : l;
    row_max[row] = m;
  }
}

struct SmallBwdIo {
  const void* dout = nullptr;
  const void* probs = nullptr;
  const float* dlse = nullptr;
  const void* dprobs = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* dbias = nullptr;
};

constexpr int kBwdWarps = 4;

template <typename T, int VEC>
__global__ void __launch_bounds__(kBwdWarps * 32)
    SmallSeqBwd(AttnArgs a, SmallBwdIo io) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kBwdWarps + warp;
  if (unit >= a.batch * a.kv_heads) return;
  const int64_t group = a.q_heads / a.kv_heads;
  const int64_t b = unit / a.kv_heads, hk = unit - b * a.kv_heads;
  float* dr_s = smem + static_cast<int64_t>(warp) * group * 2 * kSmallMaxKeys;  // [G][16]
  float* pd_s = dr_s + group * kSmallMaxKeys;                                  // [G][16]
  const int64_t kv_stride = a.kv_heads * a.head_dim, vv_stride = a.kv_heads * a.v_dim;
  const T* krows = static_cast<const T*>(a.k) + (b * a.kv_len * a.kv_heads + hk) * a.head_dim;
  const T* vrows = static_cast<const T*>(a.v) + (b * a.kv_len * a.kv_heads + hk) * a.v_dim;
  bool padding = true;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g, row = b * a.q_heads + h;
    const RowInfo info = SmallRow(a, b, h, lane);
    padding = info.padding;
    T* dq = static_cast<T*>(io.dq) + row * a.head_dim;
    float dr_mine = 0.0f, pd_mine = 0.0f, ds_mine = 0.0f;
    if (!info.padding && info.visible != 0) {
      const T* q = static_cast<const T*>(a.q) + row * a.head_dim;
      const T* dout = static_cast<const T*>(io.dout) + row * a.v_dim;
      float dov[kSmallMaxKeys], qk[kSmallMaxKeys];
      SmallDots<T, VEC>(dout, vrows, vv_stride, a.v_dim, info.visible, lane, dov);
      if (a.softcap > 0.0f) SmallDots<T, VEC>(q, krows, kv_stride, a.head_dim, info.visible, lane, qk);
      const float drop = SmallDrop(a, b, h, lane);
      const T* prow = static_cast<const T*>(io.probs) + row * a.kv_len;
      const T* gprow = io.dprobs != nullptr ? static_cast<const T*>(io.dprobs) + row * a.kv_len : nullptr;
      float p[kSmallMaxKeys], dpt[kSmallMaxKeys];
      float dt = 0.0f;
#pragma unroll
      for (int j = 0; j < kSmallMaxKeys; ++j) {
        const bool vis = info.visible >> j & 1u;
        p[j] = vis ? ToF<T>(prow[j]) : 0.0f;
        const float gp = (vis && gprow != nullptr) ? ToF<T>(gprow[j]) : 0.0f;
        dpt[j] = vis ? Lane(drop, j) * dov[j] + gp : 0.0f;
        if (p[j] != 0.0f) dt += p[j] * dpt[j];
      }
      dt -= io.dlse[row];
      float dr[kSmallMaxKeys];
#pragma unroll
      for (int j = 0; j < kSmallMaxKeys; ++j) {
        const float ds = p[j] != 0.0f ? p[j] * (dpt[j] - dt) : 0.0f;
        float deriv = 1.0f;
        if (a.softcap > 0.0f && p[j] != 0.0f) {
          const float t = tanhf(a.scale * qk[j] / a.softcap);
          deriv = 1.0f - t * t;
        }
        dr[j] = ds * deriv;
        const float dj = Lane(drop, j);
        if (j == lane) {
          ds_mine = ds;
          dr_mine = dr[j];
          pd_mine = p[j] * dj;
        }
      }
      float wq[kSmallMaxKeys];
#pragma unroll
      for (int j = 0; j < kSmallMaxKeys; ++j) wq[j] = a.scale * dr[j];
      SmallAxpy<T, VEC>(wq, krows, kv_stride, a.head_dim, info.visible, lane, dq);
    } else {
      ZeroRow<T, VEC>(dq, a.head_dim, lane);
    }
    if (io.dbias != nullptr && lane < a.kv_len) io.dbias[row * a.kv_len + lane] = ds_mine;
    if (lane < kSmallMaxKeys) {
      dr_s[g * kSmallMaxKeys + lane] = dr_mine;
      pd_s[g * kSmallMaxKeys + lane] = pd_mine;
    }
  }
  __syncwarp();
  // dk[j] = scale * sum_g dR[g][j] q[g];  dv[j] = sum_g (P * drop)[g][j] dout[g]
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t dim = pass == 0 ? a.head_dim : a.v_dim;
    const float* coef = pass == 0 ? dr_s : pd_s;
    const T* src = static_cast<const T*>(pass == 0 ? a.q : io.dout);
    T* dst = static_cast<T*>(pass == 0 ? io.dk : io.dv) + (b * a.kv_len * a.kv_heads + hk) * dim;
    const int64_t dst_stride = a.kv_heads * dim;
    const float post = pass == 0 ? a.scale : 1.0f;
    for (int64_t d0 = static_cast<int64_t>(lane) * VEC; d0 < dim; d0 += 32 * VEC) {
      float acc[kSmallMaxKeys][VEC];
#pragma unroll
      for (int j = 0; j < kSmallMaxKeys; ++j)
#pragma unroll
        for (int t = 0; t < VEC; ++t) acc[j][t] = 0.0f;
      if (!padding) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = b * a.q_heads + hk * group + g;
          float x[VEC];
          LoadF<T, VEC>(src + row * dim + d0, x);
#pragma unroll
          for (int j = 0; j < kSmallMaxKeys; ++j) {
            const float c = coef[g * kSmallMaxKeys + j];
#pragma unroll
            for (int t = 0; t < VEC; ++t) acc[j][t] = fmaf(c, x[t], acc[j][t]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kSmallMaxKeys; ++j) {
        if (j < a.kv_len) {
#pragma unroll
          for (int t = 0; t < VEC; ++t) acc[j][t] *= post;
          StoreF<T, VEC>(dst + j * dst_stride + d0, acc[j]);
        }
      }
    }
  }
}

template <typename T>
int SmallVec(const AttnArgs& a) {
  const int64_t widest = a.head_dim > a.v_dim ? a.head_dim : a.v_dim;
  for (int vec = static_cast<int>(16 / sizeof(T)); vec > 1; vec /= 2) {
    if (a.head_dim % vec == 0 && a.v_dim % vec == 0 && 32 * vec <= widest) return vec;
  }
  return 1;
}

template <typename T>
cudaError_t LaunchSmallFwd(cudaStream_t stream, const AttnArgs& a, void* out, float* lse,
                           float* mx, void* probs) {
  const int64_t rows = a.batch * a.q_heads;
  const dim3 grid(static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps)), block(kRowWarps * 32);
  T* o = static_cast<T*>(out);
  T* p = static_cast<T*>(probs);
  switch (SmallVec<T>(a)) {
    case 8: SmallSeqFwd<T, 8><<<grid, block, 0, stream>>>(a, o, lse, mx, p); break;
    case 4: SmallSeqFwd<T, 4><<<grid, block, 0, stream>>>(a, o, lse, mx, p); break;
    case 2: SmallSeqFwd<T, 2><<<grid, block, 0, stream>>>(a, o, lse, mx, p); break;
    default: SmallSeqFwd<T, 1><<<grid, block, 0, stream>>>(a, o, lse, mx, p); break;
  }
  return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t LaunchSmallBwdV(cudaStream_t stream, const AttnArgs& a, const SmallBwdIo& io) {
  const int64_t units = a.batch * a.kv_heads;
  const size_t smem = static_cast<size_t>(kBwdWarps) * (a.q_heads / a.kv_heads) * 2 *
                      kSmallMaxKeys * sizeof(float);
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(SmallSeqBwd<T, VEC>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  SmallSeqBwd<T, VEC><<<static_cast<unsigned>((units + kBwdWarps - 1) / kBwdWarps),
                        kBwdWarps * 32, smem, stream>>>(a, io);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchSmallBwd(cudaStream_t stream, const AttnArgs& a, const SmallBwdIo& io) {
  switch (SmallVec<T>(a)) {
    case 8: return LaunchSmallBwdV<T, 8>(stream, a, io);
    case 4: return LaunchSmallBwdV<T, 4>(stream, a, io);
    case 2: return LaunchSmallBwdV<T, 2>(stream, a, io);
    default: return LaunchSmallBwdV<T, 1>(stream, a, io);
  }
}

// ================================================================================================
// FFI handlers
// ================================================================================================
std::string Dims(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

bool Is(ffi::AnyBuffer::Dimensions d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (d[i++] != w) return false;
  }
  return true;
}

bool Absent(const ffi::AnyBuffer& b) { return b.dimensions().size() == 1 && b.dimensions()[0] == 0; }

bool IsFloat(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

template <typename Fn>
cudaError_t DispatchT(ffi::DataType t, const Fn& fn) {
  switch (t) {
    case ffi::DataType::BF16: return fn(__nv_bfloat16{});
    case ffi::DataType::F16: return fn(__half{});
    default: return fn(float{});
  }
}

ffi::Error CudaResult(const char* target, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(target) + ": CUDA error: " + cudaGetErrorString(err));
}

ffi::Error SoftmaxInvalid(const std::string& m) {
  return ffi::Error::InvalidArgument("attnaux_softmax: " + m);
}

ffi::Error SoftmaxFwdImpl(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer mask,
                          float scale, int32_t causal, int64_t mask_div,
                          ffi::Result<ffi::AnyBuffer> probs, ffi::Result<ffi::AnyBuffer> lse,
                          ffi::Result<ffi::AnyBuffer> row_max) {
  const auto ld = logits.dimensions();
  if (ld.size() != 3) return SoftmaxInvalid("`logits` must have rank 3 [N, q_seq, kv_seq]; got " + Dims(ld) + ".");
  if (!IsFloat(logits.element_type())) return SoftmaxInvalid("`logits` must be F32, BF16 or F16.");
  SoftmaxArgs a;
  a.n = ld[0];
  a.sq = ld[1];
  a.skv = ld[2];
  a.scale = scale;
  a.causal = causal;
  if (causal < 0 || causal > 2) return SoftmaxInvalid("attribute `causal` must be 0, 1 or 2; got " + std::to_string(causal) + ".");
  if (!Absent(mask)) {
    const auto md = mask.dimensions();
    if (mask.element_type() != ffi::DataType::PRED) return SoftmaxInvalid("`mask` must be PRED (bool).");
    if (md.size() != 3) return SoftmaxInvalid("`mask` must have rank 3 [mask_n, q_seq or 1, kv_seq or 1]; got " + Dims(md) + ".");
    a.mask_n = md[0];
    a.mask_q = md[1];
    a.mask_kv = md[2];
    if ((a.mask_q != 1 && a.mask_q != a.sq) || (a.mask_kv != 1 && a.mask_kv != a.skv)) {
      return SoftmaxInvalid("`mask` of shape " + Dims(md) + " does not broadcast to logits " + Dims(ld) + ".");
    }
    if (mask_div < 1) return SoftmaxInvalid("attribute `mask_div` must be >= 1; got " + std::to_string(mask_div) + ".");
    if (a.n > 0 && (a.mask_n < 1 || a.n % mask_div != 0 || (a.n / mask_div) % a.mask_n != 0)) {
      return SoftmaxInvalid("`mask` leading size " + std::to_string(a.mask_n) + " with mask_div " +
                            std::to_string(mask_div) + " does not tile logits' leading size " +
                            std::to_string(a.n) + ".");
    }
    a.mask_div = mask_div;
    a.mask = static_cast<const uint8_t*>(mask.untyped_data());
  } else if (mask.element_type() != ffi::DataType::PRED) {
    return SoftmaxInvalid("the absent `mask` placeholder must be PRED (bool) of shape (0,).");
  }
  if (probs->element_type() != logits.element_type() || !Is(probs->dimensions(), {a.n, a.sq, a.skv})) {
    return SoftmaxInvalid("output `probs` must have logits' dtype and shape " + Dims(ld) + ".");
  }
  for (auto* out : {&lse, &row_max}) {
    if ((*out)->element_type() != ffi::DataType::F32 || !Is((*out)->dimensions(), {a.n, a.sq})) {
      return SoftmaxInvalid("outputs `lse` and `max` must be F32 of shape [N, q_seq].");
    }
  }
  const int64_t rows = a.n * a.sq;
  if (rows == 0) return ffi::Error::Success();
  if (rows / kRowWarps >= (int64_t{1} << 31) - 1 || (a.skv > 32 * kMaxRegPerLane && rows >= (int64_t{1} << 31) - 1)) {
    return SoftmaxInvalid("too many rows for one launch.");
  }
  float* lse_p = static_cast<float*>(lse->untyped_data());
  float* max_p = static_cast<float*>(row_max->untyped_data());
  return CudaResult("attnaux_softmax_fwd", DispatchT(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return LaunchSoftmaxFwd<T>(stream, a, logits.untyped_data(), probs->untyped_data(), lse_p, max_p);
  }));
}

ffi::Error SoftmaxBwdImpl(cudaStream_t stream, ffi::AnyBuffer probs, ffi::AnyBuffer dprobs,
                          ffi::AnyBuffer dlse, float scale, ffi::Result<ffi::AnyBuffer> dlogits) {
  const auto pd = probs.dimensions();
  if (pd.size() != 3) return SoftmaxInvalid("`probs` must have rank 3 [N, q_seq, kv_seq]; got " + Dims(pd) + ".");
  if (!IsFloat(probs.element_type())) return SoftmaxInvalid("`probs` must be F32, BF16 or F16.");
  if (dprobs.element_type() != probs.element_type() || !Is(dprobs.dimensions(), {pd[0], pd[1], pd[2]})) {
    return SoftmaxInvalid("`dprobs` must have the dtype and shape " + Dims(pd) + " of `probs`.");
  }
  if (dlse.element_type() != ffi::DataType::F32 || !Is(dlse.dimensions(), {pd[0], pd[1]})) {
    return SoftmaxInvalid("`dlse` must be F32 of shape [N, q_seq]; got " + Dims(dlse.dimensions()) + ".");
  }
  if (dlogits->element_type() != probs.element_type() || !Is(dlogits->dimensions(), {pd[0], pd[1], pd[2]})) {
    return SoftmaxInvalid("output `dlogits` must have probs' dtype and shape " + Dims(pd) + ".");
  }
  const int64_t rows = pd[0] * pd[1], skv = pd[2];
  if (rows == 0 || skv == 0) return ffi::Error::Success();
  return CudaResult("attnaux_softmax_bwd", DispatchT(probs.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return LaunchSoftmaxBwd<T>(stream, rows, skv, scale, probs.untyped_data(), dprobs.untyped_data(),
                               static_cast<const float*>(dlse.untyped_data()), dlogits->untyped_data());
  }));
}

ffi::Error SmallInvalid(const std::string& m) {
  return ffi::Error::InvalidArgument("attnaux_small_seq: " + m);
}

// Validates inputs 0..10 and the attributes (docs/kernel_abi.md) and fills *a.
ffi::Error SmallValidate(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                         ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                         ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer sink,
                         ffi::AnyBuffer rng, float scale, float softcap, int32_t causal,
                         int64_t window_left, int64_t window_right, float dropout_rate,
                         AttnArgs* a) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return SmallInvalid("`q`, `k`, `v` must have rank 4; got " + Dims(qd) + ", " + Dims(kd) + ", " + Dims(vd) + ".");
  }
  if (!IsFloat(q.element_type()) || k.element_type() != q.element_type() || v.element_type() != q.element_type()) {
    return SmallInvalid("`q`, `k`, `v` must share one dtype among F32, BF16, F16.");
  }
  const int64_t B = qd[0], Sq = qd[1], Hq = qd[2], D = qd[3], Skv = kd[1], Hk = kd[2], Dv = vd[3];
  if (Sq != 1 || Skv > kSmallMaxKeys) {
    return SmallInvalid("needs q_seq == 1 and kv_seq <= 16, got q_seq=" + std::to_string(Sq) +
                        " and kv_seq=" + std::to_string(Skv) + ".");
  }
  if (kd[0] != B || kd[3] != D || vd[0] != B || vd[1] != Skv || vd[2] != Hk) {
    return SmallInvalid("`k` " + Dims(kd) + " / `v` " + Dims(vd) + " do not match `q` " + Dims(qd) + ".");
  }
  if (Hk < 1 || Hq % Hk != 0) return SmallInvalid("q_heads must be a multiple of kv_heads.");
  a->batch = B;
  a->kv_len = Skv;
  a->q_heads = Hq;
  a->kv_heads = Hk;
  a->head_dim = D;
  a->v_dim = Dv;
  a->q = q.untyped_data();
  a->k = k.untyped_data();
  a->v = v.untyped_data();
  const int64_t full[4] = {B, Hq, Sq, Skv};
  auto strides = [&](const ffi::AnyBuffer& buf, const char* name, int64_t* st) -> ffi::Error {
    const auto d = buf.dimensions();
    if (d.size() != 4) return SmallInvalid(std::string("`") + name + "` must have rank 4 or be (0,); got " + Dims(d) + ".");
    int64_t s = 1;
    for (int i = 3; i >= 0; --i) {
      if (d[i] != 1 && d[i] != full[i]) {
        return SmallInvalid(std::string("`") + name + "` of shape " + Dims(d) + " does not broadcast to [B, Hq, Sq, Skv].");
      }
      st[i] = d[i] == 1 ? 0 : s;
      s *= d[i];
    }
    return ffi::Error::Success();
  };
  if (!Absent(bias)) {
    if (bias.element_type() != ffi::DataType::F32) return SmallInvalid("`bias` must be F32.");
    if (auto e = strides(bias, "bias", a->bias_stride); e.failure()) return e;
    a->bias = static_cast<const float*>(bias.untyped_data());
  }
  if (!Absent(mask)) {
    if (mask.element_type() != ffi::DataType::PRED) return SmallInvalid("`mask` must be PRED.");
    if (auto e = strides(mask, "mask", a->mask_stride); e.failure()) return e;
    a->mask = static_cast<const uint8_t*>(mask.untyped_data());
  }
  if (q_seqlens.element_type() != ffi::DataType::S32 || !Is(q_seqlens.dimensions(), {B}) ||
      kv_seqlens.element_type() != ffi::DataType::S32 || !Is(kv_seqlens.dimensions(), {B})) {
    return SmallInvalid("`q_seqlens` and `kv_seqlens` must be S32 of shape [B].");
  }
  a->q_seqlens = static_cast<const int32_t*>(q_seqlens.untyped_data());
  a->kv_seqlens = static_cast<const int32_t*>(kv_seqlens.untyped_data());
  if (Absent(q_seg) != Absent(kv_seg)) return SmallInvalid("`q_segment_ids` and `kv_segment_ids` come together.");
  if (!Absent(q_seg)) {
    if (q_seg.element_type() != ffi::DataType::S32 || !Is(q_seg.dimensions(), {B, Sq}) ||
        kv_seg.element_type() != ffi::DataType::S32 || !Is(kv_seg.dimensions(), {B, Skv})) {
      return SmallInvalid("segment ids must be S32 [B, q_seq] and [B, kv_seq].");
    }
    a->q_seg = static_cast<const int32_t*>(q_seg.untyped_data());
    a->kv_seg = static_cast<const int32_t*>(kv_seg.untyped_data());
  }
  if (!Absent(sink)) {
    if (sink.element_type() != ffi::DataType::F32 || !Is(sink.dimensions(), {Hq})) return SmallInvalid("`sink` must be F32 [q_heads].");
    a->sink = static_cast<const float*>(sink.untyped_data());
  }
  if (!(dropout_rate >= 0.0f && dropout_rate < 1.0f)) return SmallInvalid("attribute `dropout_rate` must be in [0, 1).");
  if (dropout_rate > 0.0f) {
    if (rng.element_type() != ffi::DataType::U32 || !Is(rng.dimensions(), {4})) {
      return SmallInvalid("`rng_state` must be U32 [4] when dropout_rate > 0.");
    }
    a->rng = static_cast<const uint32_t*>(rng.untyped_data());
    const double t = std::floor(static_cast<double>(dropout_rate) * 4294967296.0);
    a->drop_threshold = !(t > 0.0) ? 0u : (t > 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t));
    a->drop_scale = 1.0f / (1.0f - dropout_rate);
  } else if (!Absent(rng)) {
    return SmallInvalid("`rng_state` must be (0,) when dropout_rate == 0.");
  }
  if (causal < 0 || causal > 2) return SmallInvalid("attribute `causal` must be 0, 1 or 2.");
  if (!(softcap >= 0.0f)) return SmallInvalid("attribute `softcap` must be >= 0.");
  a->scale = scale;
  a->softcap = softcap;
  a->causal = causal;
  // Clamped so that off - window_left / off + window_right cannot overflow (|off| <= 17).
  a->window_left = window_left < 0 ? -1 : (window_left > (int64_t{1} << 40) ? (int64_t{1} << 40) : window_left);
  a->window_right = window_right < 0 ? -1 : (window_right > (int64_t{1} << 40) ? (int64_t{1} << 40) : window_right);
  return ffi::Error::Success();
}

ffi::Error SmallFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens,
                        ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                        ffi::AnyBuffer sink, ffi::AnyBuffer rng, float scale, float softcap,
                        int32_t causal, int64_t window_left, int64_t window_right,
                        float dropout_rate, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> row_max,
                        ffi::Result<ffi::AnyBuffer> probs) {
  AttnArgs a;
  if (auto e = SmallValidate(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng,
                             scale, softcap, causal, window_left, window_right, dropout_rate, &a);
      e.failure()) {
    return e;
  }
  const int64_t B = a.batch, Hq = a.q_heads;
  if (out->element_type() != q.element_type() || !Is(out->dimensions(), {B, 1, Hq, a.v_dim})) {
    return SmallInvalid("output `out` must be [B, 1, Hq, Dv] of q's dtype.");
  }
  for (auto* s : {&lse, &row_max}) {
    if ((*s)->element_type() != ffi::DataType::F32 || !Is((*s)->dimensions(), {B, Hq, 1})) {
      return SmallInvalid("outputs `lse` and `max` must be F32 [B, Hq, 1].");
    }
  }
  void* probs_p = nullptr;
  if (!Absent(*probs)) {
    if (probs->element_type() != q.element_type() || !Is(probs->dimensions(), {B, Hq, 1, a.kv_len})) {
      return SmallInvalid("output `probs` must be [B, Hq, 1, kv_seq] of q's dtype, or (0,).");
    }
    probs_p = probs->untyped_data();
  }
  if (B * Hq == 0) return ffi::Error::Success();
  return CudaResult("attnaux_small_seq_fwd", DispatchT(q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return LaunchSmallFwd<T>(stream, a, out->untyped_data(), static_cast<float*>(lse->untyped_data()),
                             static_cast<float*>(row_max->untyped_data()), probs_p);
  }));
}

ffi::Error SmallBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens,
                        ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                        ffi::AnyBuffer sink, ffi::AnyBuffer rng, ffi::AnyBuffer dout,
                        ffi::AnyBuffer probs, ffi::AnyBuffer dlse, ffi::AnyBuffer dprobs,
                        float scale, float softcap, int32_t causal, int64_t window_left,
                        int64_t window_right, float dropout_rate, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dbias) {
  AttnArgs a;
  if (auto e = SmallValidate(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng,
                             scale, softcap, causal, window_left, window_right, dropout_rate, &a);
      e.failure()) {
    return e;
  }
  const int64_t B = a.batch, Hq = a.q_heads, Hk = a.kv_heads, Skv = a.kv_len;
  const auto dt = q.element_type();
  if (dout.element_type() != dt || !Is(dout.dimensions(), {B, 1, Hq, a.v_dim})) return SmallInvalid("`dout` must be [B, 1, Hq, Dv] of q's dtype.");
  if (probs.element_type() != dt || !Is(probs.dimensions(), {B, Hq, 1, Skv})) return SmallInvalid("`probs` must be [B, Hq, 1, kv_seq] of q's dtype.");
  if (dlse.element_type() != ffi::DataType::F32 || !Is(dlse.dimensions(), {B, Hq, 1})) return SmallInvalid("`dlse` must be F32 [B, Hq, 1].");
  SmallBwdIo io;
  if (!Absent(dprobs)) {
    if (dprobs.element_type() != dt || !Is(dprobs.dimensions(), {B, Hq, 1, Skv})) return SmallInvalid("`dprobs` must be like `probs` or (0,).");
    io.dprobs = dprobs.untyped_data();
  }
  if (dq->element_type() != dt || !Is(dq->dimensions(), {B, 1, Hq, a.head_dim}) ||
      dk->element_type() != dt || !Is(dk->dimensions(), {B, Skv, Hk, a.head_dim}) ||
      dv->element_type() != dt || !Is(dv->dimensions(), {B, Skv, Hk, a.v_dim})) {
    return SmallInvalid("outputs `dq`, `dk`, `dv` must have the shapes and dtype of q, k, v.");
  }
  if (a.bias != nullptr) {
    if (dbias->element_type() != ffi::DataType::F32 || !Is(dbias->dimensions(), {B, Hq, 1, Skv})) return SmallInvalid("output `dbias` must be F32 [B, Hq, 1, kv_seq].");
    io.dbias = static_cast<float*>(dbias->untyped_data());
  }
  const int64_t group = Hq / Hk;
  if (static_cast<int64_t>(kBwdWarps) * group * 2 * kSmallMaxKeys * 4 > 200 * 1024) {
    return SmallInvalid("the backward supports at most 400 query heads per kv head on GPU; got " + std::to_string(group) + ".");
  }
  io.dout = dout.untyped_data();
  io.probs = probs.untyped_data();
  io.dlse = static_cast<const float*>(dlse.untyped_data());
  io.dq = dq->untyped_data();
  io.dk = dk->untyped_data();
  io.dv = dv->untyped_data();
  if (B * Hk == 0) return ffi::Error::Success();
  return CudaResult("attnaux_small_seq_bwd", DispatchT(dt, [&](auto tag) {
    using T = decltype(tag);
    return LaunchSmallBwd<T>(stream, a, io);
  }));
}

}  // namespace attnaux_cuda_kernels

namespace ak = attnaux_cuda_kernels;

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSoftmaxFwdCuda, ak::SoftmaxFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // logits [N, Sq, Skv]
                                  .Arg<ffi::AnyBuffer>()  // mask [Mn, Sqm, Skvm] or (0,)
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("causal")
                                  .Attr<int64_t>("mask_div")
                                  .Ret<ffi::AnyBuffer>()   // probs
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Ret<ffi::AnyBuffer>());  // max

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSoftmaxBwdCuda, ak::SoftmaxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // probs
                                  .Arg<ffi::AnyBuffer>()  // dprobs
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>());  // dlogits (aliases probs)

#define ATTNAUX_SMALL_INPUTS                                                                   \
  .Arg<ffi::AnyBuffer>()      /* q */                                                          \
      .Arg<ffi::AnyBuffer>()  /* k */                                                          \
      .Arg<ffi::AnyBuffer>()  /* v */                                                          \
      .Arg<ffi::AnyBuffer>()  /* bias */                                                       \
      .Arg<ffi::AnyBuffer>()  /* mask */                                                       \
      .Arg<ffi::AnyBuffer>()  /* q_seqlens */                                                  \
      .Arg<ffi::AnyBuffer>()  /* kv_seqlens */                                                 \
      .Arg<ffi::AnyBuffer>()  /* q_segment_ids */                                              \
      .Arg<ffi::AnyBuffer>()  /* kv_segment_ids */                                             \
      .Arg<ffi::AnyBuffer>()  /* sink */                                                       \
      .Arg<ffi::AnyBuffer>()  /* rng_state */

#define ATTNAUX_SMALL_ATTRS                                                                    \
  .Attr<float>("scale")                                                                        \
      .Attr<float>("softcap")                                                                  \
      .Attr<int32_t>("causal")                                                                 \
      .Attr<int64_t>("window_left")                                                            \
      .Attr<int64_t>("window_right")                                                           \
      .Attr<float>("dropout_rate")

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSmallSeqFwdCuda, ak::SmallFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  ATTNAUX_SMALL_INPUTS ATTNAUX_SMALL_ATTRS
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Ret<ffi::AnyBuffer>()   // max
                                  .Ret<ffi::AnyBuffer>());  // probs or (0,)

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSmallSeqBwdCuda, ak::SmallBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  ATTNAUX_SMALL_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // probs
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Arg<ffi::AnyBuffer>()  // dprobs or (0,)
                                  ATTNAUX_SMALL_ATTRS
                                  .Ret<ffi::AnyBuffer>()   // dq
                                  .Ret<ffi::AnyBuffer>()   // dk
                                  .Ret<ffi::AnyBuffer>()   // dv
                                  .Ret<ffi::AnyBuffer>());  // dbias or (0,)
