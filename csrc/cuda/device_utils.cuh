// Device helpers shared by attnaux's CUDA kernels (softmax.cu, small_seq.cu, probs_softmax.cu):
// element conversion and 16-byte vectors, warp reductions, the online (max, sum) merge and the
// dropout words of common/philox.h in the kernels' uint4 form.
#ifndef ATTNAUX_CSRC_CUDA_DEVICE_UTILS_CUH_
#define ATTNAUX_CSRC_CUDA_DEVICE_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/philox.h"

namespace attnaux_cuda_kernels {

constexpr float kInf = INFINITY;

constexpr int kRowWarps = 8;  // rows (warps) per block of the warp-per-row kernels

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

// Merges the online-softmax state (m2, s2) into (m, s): max and sum of exp(x - max).
__device__ __forceinline__ void Combine(float& m, float& s, float m2, float s2) {
  const float big = fmaxf(m, m2);
  if (big == -kInf) {
    s = s + s2;  // both empty (0), or NaN that must survive
    return;
  }
  s = s * expf(m - big) + s2 * expf(m2 - big);
  m = big;
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

}  // namespace attnaux_cuda_kernels

#endif  // ATTNAUX_CSRC_CUDA_DEVICE_UTILS_CUH_
