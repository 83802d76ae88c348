// Small element-wise CUDA kernels of the GPU `flash` backend (everything else is cuDNN).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "flash_cuda.h"

namespace attnaux_cuda {
namespace {

constexpr int kThreads = 256;

__global__ void LseFromMaxSumExp(float* __restrict__ lse, const float* __restrict__ mx,
                                 int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    lse[i] = mx[i] + logf(lse[i]);
  }
}

template <typename T>
__global__ void F32ToHalf(T* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      dst[i] = __float2bfloat16_rn(src[i]);
    } else {
      dst[i] = __float2half_rn(src[i]);
    }
  }
}

template <typename T>
__global__ void HalfToF32(float* __restrict__ dst, const T* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      dst[i] = __bfloat162float(src[i]);
    } else {
      dst[i] = __half2float(src[i]);
    }
  }
}

unsigned Blocks(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

cudaError_t LaunchLseFromMaxSumExp(float* lse_inout, const float* max, int64_t n,
                                   cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  LseFromMaxSumExp<<<Blocks(n), kThreads, 0, stream>>>(lse_inout, max, n);
  return cudaGetLastError();
}

cudaError_t LaunchF32ToHalf(void* dst, const float* src, int64_t n, int dtype,
                            cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dtype == 0) {
    F32ToHalf<__nv_bfloat16><<<Blocks(n), kThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(dst), src, n);
  } else {
    F32ToHalf<__half><<<Blocks(n), kThreads, 0, stream>>>(static_cast<__half*>(dst), src, n);
  }
  return cudaGetLastError();
}

cudaError_t LaunchHalfToF32(float* dst, const void* src, int64_t n, int dtype,
                            cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dtype == 0) {
    HalfToF32<__nv_bfloat16><<<Blocks(n), kThreads, 0, stream>>>(
        dst, static_cast<const __nv_bfloat16*>(src), n);
  } else {
    HalfToF32<__half><<<Blocks(n), kThreads, 0, stream>>>(dst, static_cast<const __half*>(src), n);
  }
  return cudaGetLastError();
}

}  // namespace attnaux_cuda
