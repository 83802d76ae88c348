// Qualifiers for functions that both the host compiler and nvcc compile (params, Philox): plain C++
// sees `inline` and no pragma; nvcc sees __host__ __device__ __forceinline__ (as the CUDA kernels'
// own helpers are) and #pragma unroll.
#ifndef ATTNAUX_CSRC_COMMON_HOST_DEVICE_H_
#define ATTNAUX_CSRC_COMMON_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define ATTNAUX_HOST_DEVICE __host__ __device__ __forceinline__
#define ATTNAUX_PRAGMA_UNROLL _Pragma("unroll")
#else
#define ATTNAUX_HOST_DEVICE inline
#define ATTNAUX_PRAGMA_UNROLL
#endif

#endif  // ATTNAUX_CSRC_COMMON_HOST_DEVICE_H_
