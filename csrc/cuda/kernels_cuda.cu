// attnaux's own CUDA kernels behind XLA FFI handlers (platform "CUDA"):
//
// - `attnaux_softmax_fwd` / `attnaux_softmax_bwd` (docs/softmax_abi.md): one warp per row while
//   a row fits in registers (<= 64 floats per lane, so kv_seq <= 2048), 16-byte vector loads and
//   stores when kv_seq is a multiple of the vector width; longer rows take one 512-thread block
//   per row with an online (max, sum) pass and a write pass. Float32 math for every dtype.
// - `attnaux_small_seq_fwd` / `attnaux_small_seq_bwd` (docs/kernel_abi.md, same target names and
//   ABI as the CPU handlers): q_seq == 1 and kv_seq <= 16, memory bound; see the small_seq
//   section below for the access pattern. Deterministic: no atomics.
// - `attnaux_probs_softmax_fwd` / `attnaux_probs_softmax_bwd` (GPU only): the fused softmax
//   between the GEMMs of the `probs` backend on GPU (src/attnaux/_probs_gpu.py), which leaves
//   q k^T, P v and the backward products to XLA (cuBLAS).
// - Dropout: Philox-4x32-10 with the counter layout of docs/kernel_abi.md (csrc/common/philox.h,
//   the CPU kernels' own), so the keep-mask is bitwise the CPU one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/philox.h"
#include "cuda/kernels_cuda.h"
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

// The N elements of x as floats. bf16 pairs are unpacked from their 32-bit words with one integer
// op each (the low half shifted up, the high half masked: bf16 -> float is exact), which keeps the
// packed words, not 2N 16-bit pieces, live in registers (small_seq: 120 registers instead of 180).
template <typename T, int N>
__device__ __forceinline__ void ToFloats(const Vec<T, N>& x, float* out) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    const auto* w = reinterpret_cast<const uint32_t*>(x.v);
#pragma unroll
    for (int t = 0; t < N / 2; ++t) {
      out[2 * t] = __uint_as_float(w[t] << 16);
      out[2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int t = 0; t < N; ++t) out[t] = ToF<T>(x.v[t]);
  }
}

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
// Philox-4x32-10 and the dropout keep-mask (docs/kernel_abi.md, csrc/common/philox.h)
// ------------------------------------------------------------------------------------------------
// The four words of Philox-4x32-10 for counter (group, offset) and key seed: the words of the
// elements 4 * group ... 4 * group + 3 of a row-major element index (common/philox.h).
__device__ __forceinline__ uint4 PhiloxBlock(const uint32_t* rng, uint64_t group) {
  const attnaux::PhiloxWords w = attnaux::DropoutGroupWords(rng, group);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The Philox word of element e (compared with the threshold, it gives e's keep bit).
__device__ __forceinline__ uint32_t DropoutWord(const uint32_t* rng, uint64_t e) {
  const uint4 w = PhiloxBlock(rng, e >> 2);
  switch (e & 3u) {
    case 0: return w.x;
    case 1: return w.y;
    case 2: return w.z;
    default: return w.w;
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
// row's reduction completes before any write). The row of P and of its cotangent stay in
// registers in the input dtype (converted to float where used), so one pass over memory serves
// rows of up to kBwdRowBytes per lane and tensor (2048 keys in bf16/f16, 1024 in float32).
constexpr int64_t kBwdRowBytes = 128;

template <typename T, int VEC, int NC>
__global__ void __launch_bounds__(kRowWarps * 32, 2)
    SoftmaxBwdWarp(int64_t rows, int64_t skv, float scale, const T* probs, const T* dprobs,
                   const float* dlse, T* dlogits) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  Vec<T, VEC> p_raw[NC], g_raw[NC];
  float dt = 0.0f;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < skv) {
      p_raw[c] = *reinterpret_cast<const Vec<T, VEC>*>(probs + row * skv + j0);
      g_raw[c] = *reinterpret_cast<const Vec<T, VEC>*>(dprobs + row * skv + j0);
    } else {
      p_raw[c] = g_raw[c] = Vec<T, VEC>{};  // zero bits
    }
    float p[VEC], g[VEC];
    ToFloats<T, VEC>(p_raw[c], p);
    ToFloats<T, VEC>(g_raw[c], g);
#pragma unroll
    for (int t = 0; t < VEC; ++t) dt += p[t] != 0.0f ? p[t] * g[t] : 0.0f;
  }
  dt = WarpSum(dt) - dlse[row];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < skv) {
      float p[VEC], g[VEC];
      ToFloats<T, VEC>(p_raw[c], p);
      ToFloats<T, VEC>(g_raw[c], g);
#pragma unroll
      for (int t = 0; t < VEC; ++t) g[t] = p[t] != 0.0f ? (p[t] * scale) * (g[t] - dt) : 0.0f;
      StoreF<T, VEC>(dlogits + row * skv + j0, g);
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
  if (per_lane * static_cast<int64_t>(sizeof(T)) <= kBwdRowBytes) {
    const int64_t nc = (per_lane + VEC - 1) / VEC;
    auto go = [&](auto ncv) {
      constexpr int NC = decltype(ncv)::value;
      if constexpr (NC * VEC * sizeof(T) <= kBwdRowBytes) {
        SoftmaxBwdWarp<T, VEC, NC><<<grid, block, 0, stream>>>(rows, skv, scale, pt, gt, dlse, ot);
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
// Attention arguments shared by small_seq and the probs softmax kernels (docs/kernel_abi.md)
// ================================================================================================
constexpr int kSmallMaxKeys = 16;

struct AttnArgs {
  int64_t batch = 0, q_len = 0, kv_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0, v_dim = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* bias = nullptr;
  int64_t bias_stride[4] = {0, 0, 0, 0};  // element strides, 0 on broadcast dims
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

// Keys [lo, hi) of query row i of batch b that the lengths, the causal and the window rules let
// it see (the mask and the segment ids may hide more of them); padding rows see none.
struct RowBand {
  int64_t lo = 0, hi = 0;
  bool padding = true;
};

__device__ __forceinline__ RowBand Band(const AttnArgs& a, int64_t b, int64_t i) {
  const int64_t qs = a.q_seqlens[b], ks = a.kv_seqlens[b];
  const int64_t ql = qs < 0 ? 0 : (qs > a.q_len ? a.q_len : qs);
  const int64_t kl = ks < 0 ? 0 : (ks > a.kv_len ? a.kv_len : ks);
  const int64_t off = a.causal == 2 ? kl - ql : 0;
  RowBand r;
  r.padding = i >= ql;
  int64_t lo = 0, hi = r.padding ? 0 : kl;
  if (a.causal != 0) hi = min(hi, i + off + 1);
  if (a.window_right >= 0) hi = min(hi, i + off + a.window_right + 1);
  if (a.window_left >= 0) lo = max(lo, i + off - a.window_left);
  r.lo = lo;
  r.hi = hi < lo ? lo : hi;
  return r;
}

// What hides single keys of one query row: the boolean mask and the segment ids.
struct RowHide {
  const uint8_t* mask = nullptr;  // the row of the mask, stride a.mask_stride[3]
  const int32_t* kv_seg = nullptr;
  int32_t q_seg = 0;
};

__device__ __forceinline__ RowHide Hide(const AttnArgs& a, int64_t b, int64_t h, int64_t i) {
  RowHide r;
  if (a.mask != nullptr) {
    r.mask = a.mask + b * a.mask_stride[0] + h * a.mask_stride[1] + i * a.mask_stride[2];
  }
  if (a.q_seg != nullptr) {
    r.q_seg = a.q_seg[b * a.q_len + i];
    r.kv_seg = a.kv_seg + b * a.kv_len;
  }
  return r;
}

__device__ __forceinline__ bool NotHidden(const AttnArgs& a, const RowHide& r, int64_t j) {
  if (r.mask != nullptr && r.mask[j * a.mask_stride[3]] == 0) return false;
  return r.kv_seg == nullptr || r.kv_seg[j] == r.q_seg;
}

__device__ __forceinline__ const float* BiasRow(const AttnArgs& a, int64_t b, int64_t h, int64_t i) {
  return a.bias == nullptr ? nullptr
                           : a.bias + b * a.bias_stride[0] + h * a.bias_stride[1] + i * a.bias_stride[2];
}

// Final logit of key j from its raw dot product (scale, softcap, then bias).
__device__ __forceinline__ float Logit(const AttnArgs& a, const float* bias_row, float raw, int64_t j) {
  float s = a.softcap > 0.0f ? a.softcap * tanhf(raw * a.scale / a.softcap) : raw * a.scale;
  if (bias_row != nullptr) s += bias_row[j * a.bias_stride[3]];
  return s;
}

// lse of a row from its visible maximum m and sum of exp(s - m), with the sink in the sum.
__device__ __forceinline__ float RowLse(const AttnArgs& a, int64_t h, float m, float sum) {
  if (a.sink != nullptr) {
    const float sink = a.sink[h];
    const float big = fmaxf(m, sink);
    const float scaled = m == -kInf ? 0.0f : sum * expf(m - big);
    return big + logf(scaled + expf(sink - big));
  }
  return (m == -kInf || !(sum > 0.0f)) ? -kInf : m + logf(sum);
}

// ================================================================================================
// small_seq: q_seq == 1, kv_seq <= 16
//
// Memory bound: each (batch, kv head) owns kv_seq rows of K and of V, read once. A *group* of
// LANES lanes (8, 16 or 32: a power of two, so several groups share a warp) owns one query row
// in the forward and one (batch, kv head) in the backward. Its lanes split the head dim into
// 16-byte vectors, so one load instruction of the group reads whole rows, coalesced; the kv_seq
// rows of a lane's chunk are all requested before any arithmetic (16 x 16 bytes in flight per
// lane; about 120 registers, so 16 warps per SM). The partial dot products are summed across the
// group with shuffles; each lane then holds every logit and does the softmax of the <= 16 values
// itself. Measured on an H200 at batch 30720, 8 heads, head dim 128, kv_seq 16, bf16: forward
// 83% of the device copy bandwidth, forward+backward 85% (benchmarks/gpu_kernels.py). Splitting
// the forward into a K kernel and a V kernel (one stream of loads per warp, as XLA's reference
// path runs it) measured slower (66%) and was dropped.
// ================================================================================================
constexpr int kSmallThreads = 256;
// At least two blocks (16 warps) per SM: caps registers at 128, so that ptxas does not convert
// all 16 loaded rows to float at once (which took bf16 to 180+ registers and 8 warps per SM).
constexpr int kSmallMinBlocks = 2;

template <int LANES>
__device__ __forceinline__ uint32_t GroupBallot(bool pred) {
  const uint32_t ballot = __ballot_sync(0xffffffffu, pred);
  if constexpr (LANES == 32) {
    return ballot;
  } else {
    const int first = (threadIdx.x & 31) & ~(LANES - 1);
    return (ballot >> first) & ((1u << LANES) - 1u);
  }
}

// Bit j (j < 16) = pred(j), each lane evaluating the keys j with j % LANES == its lane.
template <int LANES, typename Pred>
__device__ __forceinline__ uint32_t KeyBits(int gl, const Pred& pred) {
  uint32_t bits = 0;
#pragma unroll
  for (int j0 = 0; j0 < kSmallMaxKeys; j0 += LANES) bits |= GroupBallot<LANES>(pred(j0 + gl)) << j0;
  return bits & ((1u << kSmallMaxKeys) - 1u);
}

template <int LANES, int N>
__device__ __forceinline__ void GroupSum(float (&x)[N]) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) {
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] += __shfl_xor_sync(0xffffffffu, x[j], o);
  }
}

// out[j] = src[j] (as float) for the keys in `bits`, 0 elsewhere, in every lane of the group:
// each lane reads the keys j % LANES == its lane, the group shares them.
template <typename T, int LANES>
__device__ __forceinline__ void GroupGather(const T* src, uint32_t bits, int gl, float (&out)[kSmallMaxKeys]) {
  constexpr int kPer = (kSmallMaxKeys + LANES - 1) / LANES;
  float mine[kPer];
#pragma unroll
  for (int s = 0; s < kPer; ++s) {
    const int j = s * LANES + gl;
    mine[s] = (j < kSmallMaxKeys && (bits >> j & 1u)) ? ToF<T>(src[j]) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) out[j] = __shfl_sync(0xffffffffu, mine[j / LANES], j % LANES, LANES);
}

// Calls f(j) for the keys j < 16 that this lane writes (j % LANES == its lane); j is a constant
// after unrolling, so f may index register arrays with it.
template <int LANES, typename F>
__device__ __forceinline__ void ForOwnKeys(int gl, const F& f) {
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    if (j % LANES == gl) f(j);
  }
}

struct SmallKeys {
  uint32_t load = 0;     // keys inside the row's band: their K/V rows are read
  uint32_t visible = 0;  // of those, the keys the mask and the segment ids do not hide
  bool padding = true;
};

template <int LANES>
__device__ __forceinline__ SmallKeys SmallKeysOf(const AttnArgs& a, int64_t b, int64_t h, int gl) {
  const RowBand band = Band(a, b, 0);
  const RowHide hide = Hide(a, b, h, 0);
  SmallKeys r;
  r.padding = band.padding;
  r.load = KeyBits<LANES>(gl, [&](int j) { return j >= band.lo && j < band.hi; });
  if (a.mask != nullptr || a.q_seg != nullptr) {
    r.visible = KeyBits<LANES>(gl, [&](int j) { return j >= band.lo && j < band.hi && NotHidden(a, hide, j); });
  } else {
    r.visible = r.load;
  }
  return r;
}

// Bit j = the dropout keep bit of key j of query row `row` (all ones without dropout).
template <int LANES>
__device__ __forceinline__ uint32_t SmallKeepBits(const AttnArgs& a, int64_t row, int gl) {
  if (a.rng == nullptr) return (1u << kSmallMaxKeys) - 1u;
  return KeyBits<LANES>(gl, [&](int j) {
    return j < a.kv_len &&
           DropoutWord(a.rng, static_cast<uint64_t>(row * a.kv_len + j)) >= a.drop_threshold;
  });
}

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> LoadVec(const T* p) {
  return *reinterpret_cast<const Vec<T, VEC>*>(p);
}

// r[j] = the VEC elements at d0 of row j, for the keys in `bits` (zeros for the others).
template <typename T, int VEC>
__device__ __forceinline__ void LoadRows(const T* base, int64_t stride, int64_t d0, uint32_t bits,
                                         Vec<T, VEC> (&r)[kSmallMaxKeys]) {
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    if (bits >> j & 1u) {
      r[j] = LoadVec<T, VEC>(base + j * stride + d0);
    } else {
      r[j] = Vec<T, VEC>{};  // zero bits
    }
  }
}

// acc[j] += <x, r[j]> over this lane's VEC elements, for the keys in `bits`.
template <typename T, int VEC>
__device__ __forceinline__ void DotRows(const Vec<T, VEC>& x, const Vec<T, VEC> (&r)[kSmallMaxKeys],
                                        uint32_t bits, float (&acc)[kSmallMaxKeys]) {
  float xf[VEC];
  ToFloats<T, VEC>(x, xf);
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    if (bits >> j & 1u) {
      float rf[VEC];
      ToFloats<T, VEC>(r[j], rf);
#pragma unroll
      for (int t = 0; t < VEC; ++t) acc[j] = fmaf(xf[t], rf[t], acc[j]);
    }
  }
}

// acc = sum over the keys in `bits` of w[j] * r[j]; keys outside `bits` are skipped, not
// multiplied by 0 (their rows may hold inf or NaN).
template <typename T, int VEC>
__device__ __forceinline__ void WeightedRows(const float (&w)[kSmallMaxKeys], const Vec<T, VEC> (&r)[kSmallMaxKeys],
                                             uint32_t bits, float (&acc)[VEC]) {
#pragma unroll
  for (int t = 0; t < VEC; ++t) acc[t] = 0.0f;
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    if (bits >> j & 1u) {
      float rf[VEC];
      ToFloats<T, VEC>(r[j], rf);
#pragma unroll
      for (int t = 0; t < VEC; ++t) acc[t] = fmaf(w[j], rf[t], acc[t]);
    }
  }
}

template <typename T, int VEC, int LANES>
__global__ void __launch_bounds__(kSmallThreads, kSmallMinBlocks)
    SmallSeqFwd(AttnArgs a, T* __restrict__ out, float* __restrict__ lse, float* __restrict__ row_max,
                T* __restrict__ probs) {
  using V = Vec<T, VEC>;
  constexpr int kStep = LANES * VEC;  // head-dim elements one pass of the group covers
  const int gl = threadIdx.x % LANES;
  const int64_t rows = a.batch * a.q_heads;
  const int64_t wanted = static_cast<int64_t>(blockIdx.x) * (kSmallThreads / LANES) + threadIdx.x / LANES;
  const bool owner = wanted < rows;  // groups past the end redo the last row and write nothing
  const int64_t row = owner ? wanted : rows - 1;
  const int64_t b = row / a.q_heads, h = row - b * a.q_heads;
  const int64_t hk = h / (a.q_heads / a.kv_heads);
  const SmallKeys keys = SmallKeysOf<LANES>(a, b, h, gl);
  const uint32_t keep = SmallKeepBits<LANES>(a, row, gl);
  const int64_t k_stride = a.kv_heads * a.head_dim, v_stride = a.kv_heads * a.v_dim;
  const T* q = static_cast<const T*>(a.q) + row * a.head_dim;  // [B, 1, Hq, D]
  const T* k_rows = static_cast<const T*>(a.k) + (b * a.kv_len * a.kv_heads + hk) * a.head_dim;
  const T* v_rows = static_cast<const T*>(a.v) + (b * a.kv_len * a.kv_heads + hk) * a.v_dim;
  const int64_t d_first = static_cast<int64_t>(gl) * VEC;

  float s[kSmallMaxKeys];
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) s[j] = 0.0f;
  for (int64_t d0 = d_first; d0 < a.head_dim; d0 += kStep) {
    V rows[kSmallMaxKeys];
    LoadRows<T, VEC>(k_rows, k_stride, d0, keys.load, rows);
    DotRows<T, VEC>(LoadVec<T, VEC>(q + d0), rows, keys.load, s);
  }
  GroupSum<LANES>(s);

  const float* bias_row = BiasRow(a, b, h, 0);
  float m = -kInf;
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    s[j] = (keys.visible >> j & 1u) ? Logit(a, bias_row, s[j], j) : -kInf;
    m = fmaxf(m, s[j]);
  }
  const float shift = m == -kInf ? 0.0f : m;
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) sum += (keys.visible >> j & 1u) ? expf(s[j] - shift) : 0.0f;
  const float l = RowLse(a, h, m, sum);
  const bool empty = l == -kInf || m == -kInf;
  float p[kSmallMaxKeys], w[kSmallMaxKeys];
#pragma unroll
  for (int j = 0; j < kSmallMaxKeys; ++j) {
    p[j] = (!empty && (keys.visible >> j & 1u)) ? expf(s[j] - l) : 0.0f;
    w[j] = (keep >> j & 1u) ? p[j] * (a.rng != nullptr ? a.drop_scale : 1.0f) : 0.0f;
  }
  if (owner && probs != nullptr) {
    ForOwnKeys<LANES>(gl, [&](int j) {
      if (j < a.kv_len) probs[row * a.kv_len + j] = FromF<T>(p[j]);
    });
  }
  T* o = out + row * a.v_dim;
  for (int64_t d0 = d_first; d0 < a.v_dim; d0 += kStep) {
    V rows[kSmallMaxKeys];
    LoadRows<T, VEC>(v_rows, v_stride, d0, keys.load, rows);
    float acc[VEC];
    WeightedRows<T, VEC>(w, rows, keys.visible, acc);
    if (owner) StoreF<T, VEC>(o + d0, acc);
  }
  if (owner && gl == 0) {
    lse[row] = keys.padding ? (a.sink != nullptr ? a.sink[h] : -kInf) : l;
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

constexpr int kBwdKeysPerPass = 4;  // keys whose dk / dv one pass of a group accumulates

// Backward: a group owns one (batch, kv head). Phase 1 walks the group's query heads in order:
// dov = dout . v and (with softcap) q . k, dS and dR from the saved P, dq and dbias, and keeps
// the per-key coefficients scale * dR and P * drop in shared memory. Phase 2 forms dk and dv of
// the group's keys from them, summing over the query heads in a fixed order: no atomics, and
// every output element is written by exactly one lane.
template <typename T, int VEC, int LANES>
__global__ void __launch_bounds__(kSmallThreads, kSmallMinBlocks) SmallSeqBwd(AttnArgs a, SmallBwdIo io) {
  extern __shared__ float coef_smem[];
  using V = Vec<T, VEC>;
  constexpr int kStep = LANES * VEC;
  const int gl = threadIdx.x % LANES, slot = threadIdx.x / LANES;
  const int64_t units = a.batch * a.kv_heads, group = a.q_heads / a.kv_heads;
  const int64_t wanted = static_cast<int64_t>(blockIdx.x) * (blockDim.x / LANES) + slot;
  const bool owner = wanted < units;
  const int64_t unit = owner ? wanted : units - 1;
  const int64_t b = unit / a.kv_heads, hk = unit - b * a.kv_heads;
  // [group][2][16]: scale * dR, then P * drop, of every query head of the unit
  float* coef = coef_smem + static_cast<int64_t>(slot) * group * 2 * kSmallMaxKeys;
  const int64_t k_stride = a.kv_heads * a.head_dim, v_stride = a.kv_heads * a.v_dim;
  const T* k_rows = static_cast<const T*>(a.k) + (b * a.kv_len * a.kv_heads + hk) * a.head_dim;
  const T* v_rows = static_cast<const T*>(a.v) + (b * a.kv_len * a.kv_heads + hk) * a.v_dim;
  const int64_t d_first = static_cast<int64_t>(gl) * VEC;
  const bool softcap = a.softcap > 0.0f;

  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g, row = b * a.q_heads + h;
    const SmallKeys keys = SmallKeysOf<LANES>(a, b, h, gl);
    const uint32_t keep = SmallKeepBits<LANES>(a, row, gl);
    const T* q = static_cast<const T*>(a.q) + row * a.head_dim;
    const T* dout = static_cast<const T*>(io.dout) + row * a.v_dim;
    float dov[kSmallMaxKeys], qk[kSmallMaxKeys];
#pragma unroll
    for (int j = 0; j < kSmallMaxKeys; ++j) dov[j] = qk[j] = 0.0f;
    for (int64_t d0 = d_first; d0 < a.v_dim; d0 += kStep) {
      V rows[kSmallMaxKeys];
      LoadRows<T, VEC>(v_rows, v_stride, d0, keys.load, rows);
      DotRows<T, VEC>(LoadVec<T, VEC>(dout + d0), rows, keys.load, dov);
    }
    GroupSum<LANES>(dov);
    if (softcap) {  // the raw scores, for the derivative of the tanh
      for (int64_t d0 = d_first; d0 < a.head_dim; d0 += kStep) {
        V rows[kSmallMaxKeys];
        LoadRows<T, VEC>(k_rows, k_stride, d0, keys.load, rows);
        DotRows<T, VEC>(LoadVec<T, VEC>(q + d0), rows, keys.load, qk);
      }
      GroupSum<LANES>(qk);
    }
    float p[kSmallMaxKeys], gp[kSmallMaxKeys];
    GroupGather<T, LANES>(static_cast<const T*>(io.probs) + row * a.kv_len, keys.visible, gl, p);
    if (io.dprobs != nullptr) {
      GroupGather<T, LANES>(static_cast<const T*>(io.dprobs) + row * a.kv_len, keys.visible, gl, gp);
    } else {
#pragma unroll
      for (int j = 0; j < kSmallMaxKeys; ++j) gp[j] = 0.0f;
    }
    const float drop = a.rng != nullptr ? a.drop_scale : 1.0f;
    float dpt[kSmallMaxKeys];
    float dt = 0.0f;
#pragma unroll
    for (int j = 0; j < kSmallMaxKeys; ++j) {
      const float dj = (keep >> j & 1u) ? drop : 0.0f;
      dpt[j] = (keys.visible >> j & 1u) ? dj * dov[j] + gp[j] : 0.0f;
      if (p[j] != 0.0f) dt += p[j] * dpt[j];
    }
    dt -= io.dlse[row];
    float ds[kSmallMaxKeys], dr[kSmallMaxKeys];
#pragma unroll
    for (int j = 0; j < kSmallMaxKeys; ++j) {
      ds[j] = p[j] != 0.0f ? p[j] * (dpt[j] - dt) : 0.0f;
      float deriv = 1.0f;
      if (softcap && p[j] != 0.0f) {
        const float t = tanhf(a.scale * qk[j] / a.softcap);
        deriv = 1.0f - t * t;
      }
      dr[j] = a.scale * (ds[j] * deriv);
    }
    if (owner && io.dbias != nullptr) {
      ForOwnKeys<LANES>(gl, [&](int j) {
        if (j < a.kv_len) io.dbias[row * a.kv_len + j] = ds[j];
      });
    }
    ForOwnKeys<LANES>(gl, [&](int j) {
      coef[(g * 2) * kSmallMaxKeys + j] = dr[j];
      coef[(g * 2 + 1) * kSmallMaxKeys + j] = (keep >> j & 1u) ? p[j] * drop : 0.0f;
    });
    // dq = sum_j scale * dR[j] * k[j]
    T* dq = static_cast<T*>(io.dq) + row * a.head_dim;
    for (int64_t d0 = d_first; d0 < a.head_dim; d0 += kStep) {
      V rows[kSmallMaxKeys];
      LoadRows<T, VEC>(k_rows, k_stride, d0, keys.load, rows);
      float acc[VEC];
      WeightedRows<T, VEC>(dr, rows, keys.visible, acc);
      if (owner) StoreF<T, VEC>(dq + d0, acc);
    }
  }
  __syncwarp();

  // dk[j] = sum_g coef_dR[g][j] * q[g];  dv[j] = sum_g coef_Pdrop[g][j] * dout[g]. A zero
  // coefficient is skipped rather than multiplied, so NaN in a padding row of q or dout stays out.
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t dim = pass == 0 ? a.head_dim : a.v_dim;
    const T* src = static_cast<const T*>(pass == 0 ? a.q : io.dout) + (b * a.q_heads + hk * group) * dim;
    T* dst = static_cast<T*>(pass == 0 ? io.dk : io.dv) + (b * a.kv_len * a.kv_heads + hk) * dim;
    const int64_t dst_stride = a.kv_heads * dim;
    for (int64_t j0 = 0; j0 < a.kv_len; j0 += kBwdKeysPerPass) {
      for (int64_t d0 = d_first; d0 < dim; d0 += kStep) {
        float acc[kBwdKeysPerPass][VEC];
#pragma unroll
        for (int jj = 0; jj < kBwdKeysPerPass; ++jj)
#pragma unroll
          for (int t = 0; t < VEC; ++t) acc[jj][t] = 0.0f;
        for (int64_t g = 0; g < group; ++g) {
          float x[VEC];
          LoadF<T, VEC>(src + g * dim + d0, x);
#pragma unroll
          for (int jj = 0; jj < kBwdKeysPerPass; ++jj) {
            const float c = coef[(g * 2 + pass) * kSmallMaxKeys + j0 + jj];
            if (c != 0.0f) {
#pragma unroll
              for (int t = 0; t < VEC; ++t) acc[jj][t] = fmaf(c, x[t], acc[jj][t]);
            }
          }
        }
#pragma unroll
        for (int jj = 0; jj < kBwdKeysPerPass; ++jj) {
          if (owner && j0 + jj < a.kv_len) StoreF<T, VEC>(dst + (j0 + jj) * dst_stride + d0, acc[jj]);
        }
      }
    }
  }
}

// 16-byte vectors when the head dims allow them (and the buffers are aligned), else one element.
template <typename T>
int SmallVec(const AttnArgs& a, std::initializer_list<const void*> buffers) {
  constexpr int kWide = static_cast<int>(16 / sizeof(T));
  if (a.head_dim % kWide != 0 || a.v_dim % kWide != 0) return 1;
  for (const void* p : buffers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return kWide;
}

// Lanes per group: enough for one vector per lane over the wider head dim, 8 to 32.
inline int SmallLanes(const AttnArgs& a, int vec) {
  const int64_t widest = a.head_dim > a.v_dim ? a.head_dim : a.v_dim;
  const int64_t chunks = (widest + vec - 1) / vec;
  return chunks <= 8 ? 8 : (chunks <= 16 ? 16 : 32);
}

template <typename T, typename Fn>
cudaError_t SmallDispatch(int vec, int lanes, const Fn& fn) {
  constexpr int kWide = static_cast<int>(16 / sizeof(T));
  auto by_lanes = [&](auto vec_tag) {
    switch (lanes) {
      case 8: return fn(vec_tag, std::integral_constant<int, 8>{});
      case 16: return fn(vec_tag, std::integral_constant<int, 16>{});
      default: return fn(vec_tag, std::integral_constant<int, 32>{});
    }
  };
  if (vec == kWide) return by_lanes(std::integral_constant<int, kWide>{});
  return by_lanes(std::integral_constant<int, 1>{});
}

template <typename T>
cudaError_t LaunchSmallFwd(cudaStream_t stream, const AttnArgs& a, void* out, float* lse, float* mx,
                           void* probs) {
  const int vec = SmallVec<T>(a, {a.q, a.k, a.v, out});
  const int lanes = SmallLanes(a, vec);
  const int64_t rows = a.batch * a.q_heads;
  const int64_t per_block = kSmallThreads / lanes;
  const dim3 grid(static_cast<unsigned>((rows + per_block - 1) / per_block));
  return SmallDispatch<T>(vec, lanes, [&](auto vec_tag, auto lanes_tag) {
    constexpr int VEC = decltype(vec_tag)::value, LANES = decltype(lanes_tag)::value;
    SmallSeqFwd<T, VEC, LANES><<<grid, kSmallThreads, 0, stream>>>(
        a, static_cast<T*>(out), lse, mx, static_cast<T*>(probs));
    return cudaGetLastError();
  });
}

constexpr size_t kSmallBwdSmemLimit = 200 * 1024;

// Groups per block of the backward: all of kSmallThreads while their coefficients fit in 48 KiB
// of shared memory, fewer (down to one warp's worth) for large query-head groups.
inline int64_t SmallBwdGroupsPerBlock(const AttnArgs& a, int lanes, size_t* smem) {
  const size_t per_group = static_cast<size_t>(a.q_heads / a.kv_heads) * 2 * kSmallMaxKeys * sizeof(float);
  int64_t groups = kSmallThreads / lanes;
  while (groups > 32 / lanes && groups * per_group > 48 * 1024) groups /= 2;
  *smem = groups * per_group;
  return groups;
}

template <typename T>
cudaError_t LaunchSmallBwd(cudaStream_t stream, const AttnArgs& a, const SmallBwdIo& io) {
  const int vec = SmallVec<T>(a, {a.q, a.k, a.v, io.dout, io.dq, io.dk, io.dv});
  const int lanes = SmallLanes(a, vec);
  size_t smem = 0;
  const int64_t groups = SmallBwdGroupsPerBlock(a, lanes, &smem);
  const int64_t units = a.batch * a.kv_heads;
  if ((units + groups - 1) / groups >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>((units + groups - 1) / groups));
  const dim3 block(static_cast<unsigned>(groups * lanes));
  return SmallDispatch<T>(vec, lanes, [&](auto vec_tag, auto lanes_tag) {
    constexpr int VEC = decltype(vec_tag)::value, LANES = decltype(lanes_tag)::value;
    if (smem > 48 * 1024) {
      const cudaError_t err = cudaFuncSetAttribute(SmallSeqBwd<T, VEC, LANES>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(smem));
      if (err != cudaSuccess) return err;
    }
    SmallSeqBwd<T, VEC, LANES><<<grid, block, smem, stream>>>(a, io);
    return cudaGetLastError();
  });
}

// ================================================================================================
// probs on GPU: the softmax between XLA's GEMMs
//
// The `probs` backend on GPU leaves the products to XLA (cuBLAS): S = q k^T in float32 before
// these kernels, out = (P * drop) v after the forward one, and dP = dout v^T before / dq, dk, dv
// after the backward one. These kernels do everything in between, one warp per query row:
//
// - forward: scale, softcap, bias, every mask rule, the sink, the softmax and its statistics,
//   P (input dtype, before dropout) and, with dropout, the weights P * keep / (1 - rate) for the
//   output product (Philox layout of docs/kernel_abi.md, bitwise the CPU kernels' mask);
// - backward: from the saved P, Dt = sum_j P (drop * dP + G) - dlse, dS = P (drop * dP + G - Dt)
//   (= dbias), dR = dS * tanh' (softcap), written as scale * dR in the input dtype for the
//   products, and the weights P * drop again for dv.
// ================================================================================================

// Keep bits of the VEC elements starting at row-major element index e: with VEC = 4 the caller
// guarantees e % 4 == 0, so one Philox call gives all four words.
template <int VEC>
__device__ __forceinline__ void KeepVec(const AttnArgs& a, uint64_t e, bool (&keep)[VEC]) {
  if constexpr (VEC == 4) {
    const uint4 w = PhiloxBlock(a.rng, e >> 2);
    keep[0] = w.x >= a.drop_threshold;
    keep[1] = w.y >= a.drop_threshold;
    keep[2] = w.z >= a.drop_threshold;
    keep[3] = w.w >= a.drop_threshold;
  } else {
#pragma unroll
    for (int t = 0; t < VEC; ++t) keep[t] = DropoutWord(a.rng, e + t) >= a.drop_threshold;
  }
}

// Rows of up to 32 * VEC * kProbsRegChunks keys stay in registers (one read of each input, exp2
// with the log2(e) factor folded in); longer rows are streamed twice (NC = 0), the second read
// hitting the cache.
constexpr int kProbsRegChunks = 8;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T, int VEC, int NC>
__global__ void __launch_bounds__(kRowWarps * 32)
    ProbsSoftmaxFwd(AttnArgs a, const float* __restrict__ scores, T* __restrict__ probs,
                    T* __restrict__ weights, float* __restrict__ lse, float* __restrict__ row_max) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= a.batch * a.q_heads * a.q_len) return;  // the whole warp
  const int64_t i = row % a.q_len, bh = row / a.q_len;
  const int64_t h = bh % a.q_heads, b = bh / a.q_heads;
  const RowBand band = Band(a, b, i);
  const RowHide hide = Hide(a, b, h, i);
  const float* bias_row = BiasRow(a, b, h, i);
  const float* srow = scores + row * a.kv_len;
  T* prow = probs + row * a.kv_len;
  T* wrow = weights == nullptr ? nullptr : weights + row * a.kv_len;
  // The final logits of the VEC keys at j0 (-inf where not visible).
  auto logits = [&](int64_t j0, float (&x)[VEC]) {
    if (j0 < band.hi && j0 + VEC > band.lo) {
      LoadF<float, VEC>(srow + j0, x);
#pragma unroll
      for (int t = 0; t < VEC; ++t) {
        const int64_t j = j0 + t;
        const bool vis = j >= band.lo && j < band.hi && NotHidden(a, hide, j);
        x[t] = vis ? Logit(a, bias_row, x[t], j) : -kInf;
      }
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) x[t] = -kInf;
    }
  };
  // Writes P (and the dropout weights) of the VEC keys at j0 from their logits.
  auto write = [&](int64_t j0, float (&x)[VEC], float l, bool empty) {
    float p[VEC];
#pragma unroll
    for (int t = 0; t < VEC; ++t) p[t] = (empty || x[t] == -kInf) ? 0.0f : exp2f((x[t] - l) * kLog2e);
    StoreF<T, VEC>(prow + j0, p);
    if (wrow != nullptr) {
      bool keep[VEC];
      KeepVec<VEC>(a, static_cast<uint64_t>(row * a.kv_len + j0), keep);
#pragma unroll
      for (int t = 0; t < VEC; ++t) p[t] = keep[t] ? p[t] * a.drop_scale : 0.0f;
      StoreF<T, VEC>(wrow + j0, p);
    }
  };
  float m = -kInf, sum = 0.0f;
  if constexpr (NC > 0) {
    float x[NC][VEC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      logits((static_cast<int64_t>(c) * 32 + lane) * VEC, x[c]);
#pragma unroll
      for (int t = 0; t < VEC; ++t) m = fmaxf(m, x[c][t]);
    }
    m = WarpMax(m);
    const float shift = m == -kInf ? 0.0f : m;
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int t = 0; t < VEC; ++t) sum += x[c][t] == -kInf ? 0.0f : exp2f((x[c][t] - shift) * kLog2e);
    sum = WarpSum(sum);
    const float l = RowLse(a, h, m, sum);
    const bool empty = l == -kInf || m == -kInf;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
      if (j0 < a.kv_len) write(j0, x[c], l, empty);
    }
    if (lane == 0) {
      lse[row] = band.padding ? (a.sink != nullptr ? a.sink[h] : -kInf) : l;
      row_max[row] = m;
    }
  } else {
    for (int64_t j0 = (band.lo / VEC) * VEC + lane * VEC; j0 < band.hi; j0 += 32 * VEC) {
      float x[VEC];
      logits(j0, x);
#pragma unroll
      for (int t = 0; t < VEC; ++t) {
        const float s = x[t];
        if (s > m) {
          sum = sum * expf(m - s) + 1.0f;
          m = s;
        } else if (m != -kInf) {  // (a -inf logit while m is still -inf adds nothing, not NaN)
          sum += expf(s - m);
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, sum, o);
      Combine(m, sum, m2, s2);
    }
    const float l = RowLse(a, h, m, sum);
    const bool empty = l == -kInf || m == -kInf;
    for (int64_t j0 = static_cast<int64_t>(lane) * VEC; j0 < a.kv_len; j0 += 32 * VEC) {
      float x[VEC];
      logits(j0, x);
      write(j0, x, l, empty);
    }
    if (lane == 0) {
      lse[row] = band.padding ? (a.sink != nullptr ? a.sink[h] : -kInf) : l;
      row_max[row] = m;
    }
  }
}

struct ProbsBwdIo {
  const void* probs = nullptr;
  const float* dp = nullptr;       // dout . v^T, float32
  const void* dprobs = nullptr;    // cotangent of P, or null
  const float* dlse = nullptr;
  const float* scores = nullptr;   // raw q . k^T (softcap only)
  void* ds = nullptr;              // scale * dR, input dtype
  void* weights = nullptr;         // P * drop (dropout only)
  float* dbias = nullptr;          // dS (bias only)
};

template <typename T, int VEC, int NC>
__global__ void __launch_bounds__(kRowWarps * 32) ProbsSoftmaxBwd(AttnArgs a, ProbsBwdIo io) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= a.batch * a.q_heads * a.q_len) return;  // the whole warp
  const int64_t off = row * a.kv_len;
  const T* prow = static_cast<const T*>(io.probs) + off;
  const float* dprow = io.dp + off;
  const T* grow = io.dprobs == nullptr ? nullptr : static_cast<const T*>(io.dprobs) + off;
  T* dsrow = static_cast<T*>(io.ds) + off;
  // P and dPt = drop * dP + G of the VEC keys at j0.
  auto load = [&](int64_t j0, float (&p)[VEC], float (&dpt)[VEC]) {
    float g[VEC];
    LoadF<T, VEC>(prow + j0, p);
    LoadF<float, VEC>(dprow + j0, dpt);
    if (grow != nullptr) {
      LoadF<T, VEC>(grow + j0, g);
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) g[t] = 0.0f;
    }
    if (a.rng != nullptr) {
      bool keep[VEC];
      KeepVec<VEC>(a, static_cast<uint64_t>(off + j0), keep);
#pragma unroll
      for (int t = 0; t < VEC; ++t) dpt[t] = (keep[t] ? a.drop_scale * dpt[t] : 0.0f) + g[t];
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) dpt[t] += g[t];
    }
  };
  // Writes scale * dR, dbias and the dropout weights of the VEC keys at j0.
  auto write = [&](int64_t j0, float (&p)[VEC], const float (&dpt)[VEC], float dt) {
    float ds[VEC], dr[VEC], raw[VEC];
    if (a.softcap > 0.0f) LoadF<float, VEC>(io.scores + off + j0, raw);
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      ds[t] = p[t] != 0.0f ? p[t] * (dpt[t] - dt) : 0.0f;
      float deriv = 1.0f;
      if (a.softcap > 0.0f && p[t] != 0.0f) {
        const float th = tanhf(a.scale * raw[t] / a.softcap);
        deriv = 1.0f - th * th;
      }
      dr[t] = p[t] != 0.0f ? a.scale * (ds[t] * deriv) : 0.0f;
    }
    StoreF<T, VEC>(dsrow + j0, dr);
    if (io.dbias != nullptr) StoreF<float, VEC>(io.dbias + off + j0, ds);
    if (io.weights != nullptr) {
      bool keep[VEC];
      KeepVec<VEC>(a, static_cast<uint64_t>(off + j0), keep);
#pragma unroll
      for (int t = 0; t < VEC; ++t) p[t] = keep[t] ? p[t] * a.drop_scale : 0.0f;
      StoreF<T, VEC>(static_cast<T*>(io.weights) + off + j0, p);
    }
  };
  float dt = 0.0f;
  if constexpr (NC > 0) {
    float p[NC][VEC], dpt[NC][VEC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
      if (j0 < a.kv_len) {
        load(j0, p[c], dpt[c]);
      } else {
#pragma unroll
        for (int t = 0; t < VEC; ++t) p[c][t] = dpt[c][t] = 0.0f;
      }
#pragma unroll
      for (int t = 0; t < VEC; ++t) dt += p[c][t] != 0.0f ? p[c][t] * dpt[c][t] : 0.0f;
    }
    dt = WarpSum(dt) - io.dlse[row];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
      if (j0 < a.kv_len) write(j0, p[c], dpt[c], dt);
    }
  } else {
    for (int64_t j0 = static_cast<int64_t>(lane) * VEC; j0 < a.kv_len; j0 += 32 * VEC) {
      float p[VEC], dpt[VEC];
      load(j0, p, dpt);
#pragma unroll
      for (int t = 0; t < VEC; ++t) dt += p[t] != 0.0f ? p[t] * dpt[t] : 0.0f;
    }
    dt = WarpSum(dt) - io.dlse[row];
    for (int64_t j0 = static_cast<int64_t>(lane) * VEC; j0 < a.kv_len; j0 += 32 * VEC) {
      float p[VEC], dpt[VEC];
      load(j0, p, dpt);
      write(j0, p, dpt, dt);
    }
  }
}

// Calls fn with NC = the register chunks a row of kv_len keys needs (1, 2, 4, 8), or 0 (stream).
template <int VEC, typename Fn>
cudaError_t ByRowChunks(int64_t kv_len, const Fn& fn) {
  const int64_t chunks = (kv_len + 32 * VEC - 1) / (32 * VEC);
  if (chunks <= 1) return fn(std::integral_constant<int, 1>{});
  if (chunks <= 2) return fn(std::integral_constant<int, 2>{});
  if (chunks <= 4) return fn(std::integral_constant<int, 4>{});
  if (chunks <= kProbsRegChunks) return fn(std::integral_constant<int, kProbsRegChunks>{});
  return fn(std::integral_constant<int, 0>{});
}

// float4 reads of the scores when every row starts on a 16-byte boundary, else one element.
inline int ProbsVec(const AttnArgs& a, std::initializer_list<const void*> buffers) {
  if (a.kv_len % 4 != 0) return 1;
  for (const void* p : buffers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return 4;
}

template <typename T>
cudaError_t LaunchProbsFwd(cudaStream_t stream, const AttnArgs& a, const float* scores, void* probs,
                           void* weights, float* lse, float* mx) {
  const int64_t rows = a.batch * a.q_heads * a.q_len;
  const dim3 grid(static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps)), block(kRowWarps * 32);
  T* p = static_cast<T*>(probs);
  T* w = static_cast<T*>(weights);
  auto go = [&](auto vec_tag) {
    constexpr int VEC = decltype(vec_tag)::value;
    return ByRowChunks<VEC>(a.kv_len, [&](auto nc_tag) {
      ProbsSoftmaxFwd<T, VEC, decltype(nc_tag)::value><<<grid, block, 0, stream>>>(a, scores, p, w, lse, mx);
      return cudaGetLastError();
    });
  };
  if (ProbsVec(a, {scores, probs, weights}) == 4) return go(std::integral_constant<int, 4>{});
  return go(std::integral_constant<int, 1>{});
}

template <typename T>
cudaError_t LaunchProbsBwd(cudaStream_t stream, const AttnArgs& a, const ProbsBwdIo& io) {
  const int64_t rows = a.batch * a.q_heads * a.q_len;
  const dim3 grid(static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps)), block(kRowWarps * 32);
  auto go = [&](auto vec_tag) {
    constexpr int VEC = decltype(vec_tag)::value;
    return ByRowChunks<VEC>(a.kv_len, [&](auto nc_tag) {
      ProbsSoftmaxBwd<T, VEC, decltype(nc_tag)::value><<<grid, block, 0, stream>>>(a, io);
      return cudaGetLastError();
    });
  };
  if (ProbsVec(a, {io.probs, io.dp, io.dprobs, io.scores, io.ds, io.weights, io.dbias}) == 4) {
    return go(std::integral_constant<int, 4>{});
  }
  return go(std::integral_constant<int, 1>{});
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

ffi::Error AttnInvalid(const char* target, const std::string& m) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + m);
}

// Validates the canonical inputs 0..10 and the attributes of docs/kernel_abi.md and fills *a.
ffi::Error AttnValidate(const char* target, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens,
                        ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                        ffi::AnyBuffer sink, ffi::AnyBuffer rng, float scale, float softcap,
                        int32_t causal, int64_t window_left, int64_t window_right,
                        float dropout_rate, AttnArgs* a) {
  auto invalid = [&](const std::string& m) { return AttnInvalid(target, m); };
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return invalid("`q`, `k`, `v` must have rank 4; got " + Dims(qd) + ", " + Dims(kd) + ", " + Dims(vd) + ".");
  }
  if (!IsFloat(q.element_type()) || k.element_type() != q.element_type() || v.element_type() != q.element_type()) {
    return invalid("`q`, `k`, `v` must share one dtype among F32, BF16, F16.");
  }
  const int64_t B = qd[0], Sq = qd[1], Hq = qd[2], D = qd[3], Skv = kd[1], Hk = kd[2], Dv = vd[3];
  if (kd[0] != B || kd[3] != D || vd[0] != B || vd[1] != Skv || vd[2] != Hk) {
    return invalid("`k` " + Dims(kd) + " / `v` " + Dims(vd) + " do not match `q` " + Dims(qd) + ".");
  }
  if (Hk < 1 || Hq % Hk != 0) return invalid("q_heads must be a multiple of kv_heads.");
  a->batch = B;
  a->q_len = Sq;
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
    if (d.size() != 4) return invalid(std::string("`") + name + "` must have rank 4 or be (0,); got " + Dims(d) + ".");
    int64_t s = 1;
    for (int i = 3; i >= 0; --i) {
      if (d[i] != 1 && d[i] != full[i]) {
        return invalid(std::string("`") + name + "` of shape " + Dims(d) + " does not broadcast to [B, Hq, Sq, Skv].");
      }
      st[i] = d[i] == 1 ? 0 : s;
      s *= d[i];
    }
    return ffi::Error::Success();
  };
  if (!Absent(bias)) {
    if (bias.element_type() != ffi::DataType::F32) return invalid("`bias` must be F32.");
    if (auto e = strides(bias, "bias", a->bias_stride); e.failure()) return e;
    a->bias = static_cast<const float*>(bias.untyped_data());
  }
  if (!Absent(mask)) {
    if (mask.element_type() != ffi::DataType::PRED) return invalid("`mask` must be PRED.");
    if (auto e = strides(mask, "mask", a->mask_stride); e.failure()) return e;
    a->mask = static_cast<const uint8_t*>(mask.untyped_data());
  }
  if (q_seqlens.element_type() != ffi::DataType::S32 || !Is(q_seqlens.dimensions(), {B}) ||
      kv_seqlens.element_type() != ffi::DataType::S32 || !Is(kv_seqlens.dimensions(), {B})) {
    return invalid("`q_seqlens` and `kv_seqlens` must be S32 of shape [B].");
  }
  a->q_seqlens = static_cast<const int32_t*>(q_seqlens.untyped_data());
  a->kv_seqlens = static_cast<const int32_t*>(kv_seqlens.untyped_data());
  if (Absent(q_seg) != Absent(kv_seg)) return invalid("`q_segment_ids` and `kv_segment_ids` come together.");
  if (!Absent(q_seg)) {
    if (q_seg.element_type() != ffi::DataType::S32 || !Is(q_seg.dimensions(), {B, Sq}) ||
        kv_seg.element_type() != ffi::DataType::S32 || !Is(kv_seg.dimensions(), {B, Skv})) {
      return invalid("segment ids must be S32 [B, q_seq] and [B, kv_seq].");
    }
    a->q_seg = static_cast<const int32_t*>(q_seg.untyped_data());
    a->kv_seg = static_cast<const int32_t*>(kv_seg.untyped_data());
  }
  if (!Absent(sink)) {
    if (sink.element_type() != ffi::DataType::F32 || !Is(sink.dimensions(), {Hq})) return invalid("`sink` must be F32 [q_heads].");
    a->sink = static_cast<const float*>(sink.untyped_data());
  }
  if (!(dropout_rate >= 0.0f && dropout_rate < 1.0f)) return invalid("attribute `dropout_rate` must be in [0, 1).");
  if (dropout_rate > 0.0f) {
    if (rng.element_type() != ffi::DataType::U32 || !Is(rng.dimensions(), {4})) {
      return invalid("`rng_state` must be U32 [4] when dropout_rate > 0.");
    }
    a->rng = static_cast<const uint32_t*>(rng.untyped_data());
    const double t = std::floor(static_cast<double>(dropout_rate) * 4294967296.0);
    a->drop_threshold = !(t > 0.0) ? 0u : (t > 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t));
    a->drop_scale = 1.0f / (1.0f - dropout_rate);
  } else if (!Absent(rng)) {
    return invalid("`rng_state` must be (0,) when dropout_rate == 0.");
  }
  if (causal < 0 || causal > 2) return invalid("attribute `causal` must be 0, 1 or 2.");
  if (!(softcap >= 0.0f)) return invalid("attribute `softcap` must be >= 0.");
  a->scale = scale;
  a->softcap = softcap;
  a->causal = causal;
  // Clamped so that i + off - window_left / i + off + window_right cannot overflow.
  a->window_left = window_left < 0 ? -1 : (window_left > (int64_t{1} << 40) ? (int64_t{1} << 40) : window_left);
  a->window_right = window_right < 0 ? -1 : (window_right > (int64_t{1} << 40) ? (int64_t{1} << 40) : window_right);
  return ffi::Error::Success();
}

constexpr const char* kSmallTarget = "attnaux_small_seq";
constexpr const char* kProbsTarget = "attnaux_probs_softmax";

ffi::Error SmallInvalid(const std::string& m) { return AttnInvalid(kSmallTarget, m); }

ffi::Error SmallValidate(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                         ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                         ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer sink,
                         ffi::AnyBuffer rng, float scale, float softcap, int32_t causal,
                         int64_t window_left, int64_t window_right, float dropout_rate,
                         AttnArgs* a) {
  if (auto e = AttnValidate(kSmallTarget, q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg,
                            sink, rng, scale, softcap, causal, window_left, window_right,
                            dropout_rate, a);
      e.failure()) {
    return e;
  }
  if (a->q_len != 1 || a->kv_len > kSmallMaxKeys) {
    return SmallInvalid("needs q_seq == 1 and kv_seq <= 16, got q_seq=" + std::to_string(a->q_len) +
                        " and kv_seq=" + std::to_string(a->kv_len) + ".");
  }
  if (a->batch * a->q_heads >= (int64_t{1} << 31) * (kSmallThreads / 32)) {
    return SmallInvalid("too many rows for one launch.");
  }
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
  if (B * Hk == 0) return ffi::Error::Success();
  const int64_t group = Hq / Hk;
  if (static_cast<size_t>(group) * 2 * kSmallMaxKeys * sizeof(float) * 4 > kSmallBwdSmemLimit) {
    return SmallInvalid("the GPU backward supports at most " +
                        std::to_string(kSmallBwdSmemLimit / (2 * kSmallMaxKeys * sizeof(float) * 4)) +
                        " query heads per kv head; got " + std::to_string(group) + ".");
  }
  io.dout = dout.untyped_data();
  io.probs = probs.untyped_data();
  io.dlse = static_cast<const float*>(dlse.untyped_data());
  io.dq = dq->untyped_data();
  io.dk = dk->untyped_data();
  io.dv = dv->untyped_data();
  return CudaResult("attnaux_small_seq_bwd", DispatchT(dt, [&](auto tag) {
    using T = decltype(tag);
    return LaunchSmallBwd<T>(stream, a, io);
  }));
}

// probs softmax: inputs 0..10 as the attention ABI, then the float32 scores.
ffi::Error ProbsValidate(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                         ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                         ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer sink,
                         ffi::AnyBuffer rng, float scale, float softcap, int32_t causal,
                         int64_t window_left, int64_t window_right, float dropout_rate,
                         AttnArgs* a) {
  if (auto e = AttnValidate(kProbsTarget, q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg,
                            sink, rng, scale, softcap, causal, window_left, window_right,
                            dropout_rate, a);
      e.failure()) {
    return e;
  }
  if (a->batch * a->q_heads * a->q_len / kRowWarps >= (int64_t{1} << 31) - 1) {
    return AttnInvalid(kProbsTarget, "too many rows for one launch.");
  }
  return ffi::Error::Success();
}

// An [B, Hq, Sq, Skv] buffer of dtype t, or (0,) where `optional`.
bool IsScoreShaped(const ffi::AnyBuffer& x, const AttnArgs& a, ffi::DataType t) {
  return x.element_type() == t && Is(x.dimensions(), {a.batch, a.q_heads, a.q_len, a.kv_len});
}

ffi::Error ProbsFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens,
                        ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                        ffi::AnyBuffer sink, ffi::AnyBuffer rng, ffi::AnyBuffer scores, float scale,
                        float softcap, int32_t causal, int64_t window_left, int64_t window_right,
                        float dropout_rate, ffi::Result<ffi::AnyBuffer> probs,
                        ffi::Result<ffi::AnyBuffer> weights, ffi::Result<ffi::AnyBuffer> lse,
                        ffi::Result<ffi::AnyBuffer> row_max) {
  AttnArgs a;
  if (auto e = ProbsValidate(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng,
                             scale, softcap, causal, window_left, window_right, dropout_rate, &a);
      e.failure()) {
    return e;
  }
  auto invalid = [](const std::string& m) { return AttnInvalid(kProbsTarget, m); };
  const auto dt = q.element_type();
  if (!IsScoreShaped(scores, a, ffi::DataType::F32)) return invalid("`scores` must be F32 [B, Hq, Sq, Skv]; got " + Dims(scores.dimensions()) + ".");
  if (!IsScoreShaped(*probs, a, dt)) return invalid("output `probs` must be [B, Hq, Sq, Skv] of q's dtype.");
  void* weights_p = nullptr;
  if (a.rng != nullptr) {
    if (!IsScoreShaped(*weights, a, dt)) return invalid("output `weights` must be [B, Hq, Sq, Skv] of q's dtype with dropout.");
    weights_p = weights->untyped_data();
  } else if (!Absent(*weights)) {
    return invalid("output `weights` must be (0,) without dropout.");
  }
  for (auto* s : {&lse, &row_max}) {
    if ((*s)->element_type() != ffi::DataType::F32 || !Is((*s)->dimensions(), {a.batch, a.q_heads, a.q_len})) {
      return invalid("outputs `lse` and `max` must be F32 [B, Hq, Sq].");
    }
  }
  if (a.batch * a.q_heads * a.q_len == 0) return ffi::Error::Success();
  return CudaResult("attnaux_probs_softmax_fwd", DispatchT(dt, [&](auto tag) {
    using T = decltype(tag);
    return LaunchProbsFwd<T>(stream, a, static_cast<const float*>(scores.untyped_data()),
                             probs->untyped_data(), weights_p, static_cast<float*>(lse->untyped_data()),
                             static_cast<float*>(row_max->untyped_data()));
  }));
}

ffi::Error ProbsBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens,
                        ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                        ffi::AnyBuffer sink, ffi::AnyBuffer rng, ffi::AnyBuffer probs,
                        ffi::AnyBuffer dp, ffi::AnyBuffer dprobs, ffi::AnyBuffer dlse,
                        ffi::AnyBuffer scores, float scale, float softcap, int32_t causal,
                        int64_t window_left, int64_t window_right, float dropout_rate,
                        ffi::Result<ffi::AnyBuffer> ds, ffi::Result<ffi::AnyBuffer> weights,
                        ffi::Result<ffi::AnyBuffer> dbias) {
  AttnArgs a;
  if (auto e = ProbsValidate(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng,
                             scale, softcap, causal, window_left, window_right, dropout_rate, &a);
      e.failure()) {
    return e;
  }
  auto invalid = [](const std::string& m) { return AttnInvalid(kProbsTarget, m); };
  const auto dt = q.element_type();
  ProbsBwdIo io;
  if (!IsScoreShaped(probs, a, dt)) return invalid("`probs` must be [B, Hq, Sq, Skv] of q's dtype.");
  if (!IsScoreShaped(dp, a, ffi::DataType::F32)) return invalid("`dp` must be F32 [B, Hq, Sq, Skv].");
  if (!Absent(dprobs)) {
    if (!IsScoreShaped(dprobs, a, dt)) return invalid("`dprobs` must be like `probs` or (0,).");
    io.dprobs = dprobs.untyped_data();
  }
  if (dlse.element_type() != ffi::DataType::F32 || !Is(dlse.dimensions(), {a.batch, a.q_heads, a.q_len})) {
    return invalid("`dlse` must be F32 [B, Hq, Sq].");
  }
  if (a.softcap > 0.0f) {
    if (!IsScoreShaped(scores, a, ffi::DataType::F32)) return invalid("`scores` must be F32 [B, Hq, Sq, Skv] with softcap.");
    io.scores = static_cast<const float*>(scores.untyped_data());
  } else if (!Absent(scores)) {
    return invalid("`scores` must be (0,) without softcap.");
  }
  if (!IsScoreShaped(*ds, a, dt)) return invalid("output `ds` must be [B, Hq, Sq, Skv] of q's dtype.");
  if (a.rng != nullptr) {
    if (!IsScoreShaped(*weights, a, dt)) return invalid("output `weights` must be [B, Hq, Sq, Skv] of q's dtype with dropout.");
    io.weights = weights->untyped_data();
  } else if (!Absent(*weights)) {
    return invalid("output `weights` must be (0,) without dropout.");
  }
  if (a.bias != nullptr) {
    if (!IsScoreShaped(*dbias, a, ffi::DataType::F32)) return invalid("output `dbias` must be F32 [B, Hq, Sq, Skv] with a bias.");
    io.dbias = static_cast<float*>(dbias->untyped_data());
  } else if (!Absent(*dbias)) {
    return invalid("output `dbias` must be (0,) without a bias.");
  }
  io.probs = probs.untyped_data();
  io.dp = static_cast<const float*>(dp.untyped_data());
  io.dlse = static_cast<const float*>(dlse.untyped_data());
  io.ds = ds->untyped_data();
  if (a.batch * a.q_heads * a.q_len == 0) return ffi::Error::Success();
  return CudaResult("attnaux_probs_softmax_bwd", DispatchT(dt, [&](auto tag) {
    using T = decltype(tag);
    return LaunchProbsBwd<T>(stream, a, io);
  }));
}

}  // namespace attnaux_cuda_kernels

namespace ak = attnaux_cuda_kernels;

// Every handler below only launches kernels on XLA's stream, with no allocation and no host
// synchronisation, so it is marked command-buffer compatible: XLA may capture it into the CUDA
// graph of the surrounding kernels instead of splitting the graph around it (which cost tens of
// microseconds per call for small attention problems).

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
                                  .Ret<ffi::AnyBuffer>(),  // max
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSoftmaxBwdCuda, ak::SoftmaxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // probs
                                  .Arg<ffi::AnyBuffer>()  // dprobs
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>(),  // dlogits (aliases probs)
                              {ffi::Traits::kCmdBufferCompatible});

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
                                  .Ret<ffi::AnyBuffer>(),  // probs or (0,)
                              {ffi::Traits::kCmdBufferCompatible});

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
                                  .Ret<ffi::AnyBuffer>(),  // dbias or (0,)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxProbsSoftmaxFwdCuda, ak::ProbsFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  ATTNAUX_SMALL_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // scores: F32 q k^T [B, Hq, Sq, Skv]
                                  ATTNAUX_SMALL_ATTRS
                                  .Ret<ffi::AnyBuffer>()   // probs (before dropout)
                                  .Ret<ffi::AnyBuffer>()   // weights P * drop, or (0,)
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Ret<ffi::AnyBuffer>(),  // max
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxProbsSoftmaxBwdCuda, ak::ProbsBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  ATTNAUX_SMALL_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // probs
                                  .Arg<ffi::AnyBuffer>()  // dp: F32 dout v^T
                                  .Arg<ffi::AnyBuffer>()  // dprobs or (0,)
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Arg<ffi::AnyBuffer>()  // scores (softcap) or (0,)
                                  ATTNAUX_SMALL_ATTRS
                                  .Ret<ffi::AnyBuffer>()   // ds = scale * dR
                                  .Ret<ffi::AnyBuffer>()   // weights P * drop, or (0,)
                                  .Ret<ffi::AnyBuffer>(),  // dbias or (0,)
                              {ffi::Traits::kCmdBufferCompatible});
