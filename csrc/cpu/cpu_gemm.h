// Register-blocked "broadcast scalar x vector" matrix products for the attention kernels.
//
// Every product in the forward and backward pass has the shape
//     C[i, :] (+)= sum_k A(i, k) * B[k, :]
// where B's rows and C's rows are contiguous vectors (the "lane" dimension) and A is read one
// scalar at a time, A(i, k) = a[i * kRowStep + k * k_step]. The micro-kernel keeps an R x NV
// block of C in registers and, for each k, loads NV vectors of B and broadcasts R scalars of A.
// kRowStep is a compile-time constant so that the R scalars sit at fixed offsets from a single
// moving pointer.
#ifndef ATTNAUX_CSRC_CPU_CPU_GEMM_H_
#define ATTNAUX_CSRC_CPU_CPU_GEMM_H_

#include <algorithm>
#include <cstdint>

#include "cpu/cpu_simd.h"

namespace attnaux::cpu {

// Widest register block in vectors, and rows per block for each width: R * NV accumulators plus
// NV loaded B vectors and one broadcast must fit the register file (32 with AVX-512, else 16).
#if defined(__AVX512F__)
inline constexpr int kMaxBlockVectors = 4;
template <int NV>
inline constexpr int kBlockRows = NV == 4 ? 6 : NV == 3 ? 8 : NV == 2 ? 12 : 16;
#else
inline constexpr int kMaxBlockVectors = 2;
template <int NV>
inline constexpr int kBlockRows = NV == 2 ? 6 : 12;
#endif

// What a product may do besides C (+)= A B, in the same pass over C (the forward's online
// softmax would otherwise make passes of its own): C's rows scaled per vector of lanes before the
// accumulation (c_scale[vector], when accumulating), the result times out_scale before the store,
// and the running maximum of the stored rows, per vector of lanes (row_max[vector], the rows in
// ascending order, as a loop over them would). The same roundings as those passes.
struct GemmFuse {
  const VecF* c_scale = nullptr;
  float out_scale = 1.0f;
  bool scale_out = false;
  VecF* row_max = nullptr;
};

template <int R, int NV, int kRowStep, bool kFuse>
inline __attribute__((always_inline)) void MicroKernel(int64_t depth, const float* __restrict a,
                                                       int64_t k_step, const float* __restrict b,
                                                       int64_t ldb, float* __restrict c,
                                                       int64_t ldc, bool accumulate,
                                                       const GemmFuse& fuse) {
  VecF acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) {
      acc[r][v] = accumulate ? Load(c + r * ldc + v * kLanes) : VecF{};
      if (kFuse && accumulate && fuse.c_scale != nullptr) acc[r][v] *= fuse.c_scale[v];
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    VecF bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = Load(b + v * kLanes);
    for (int r = 0; r < R; ++r) {
      VecF ar = Splat(a[r * kRowStep]);
      for (int v = 0; v < NV; ++v) acc[r][v] += ar * bv[v];
    }
    a += k_step;
    b += ldb;
  }
  if (kFuse && fuse.scale_out) {
    const VecF scale = Splat(fuse.out_scale);
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < NV; ++v) acc[r][v] *= scale;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) Store(c + r * ldc + v * kLanes, acc[r][v]);
  }
  if (kFuse && fuse.row_max != nullptr) {
    for (int v = 0; v < NV; ++v) {
      VecF mx = fuse.row_max[v];
      for (int r = 0; r < R; ++r) mx = Max(mx, acc[r][v]);
      fuse.row_max[v] = mx;
    }
  }
}

// Rows fewer than a full block: pick the kernel with exactly `rows` rows.
template <int R, int NV, int kRowStep, bool kFuse>
inline void MicroKernelTail(int64_t rows, int64_t depth, const float* a, int64_t k_step,
                            const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                            const GemmFuse& fuse) {
  if constexpr (R > 1) {
    if (rows < R) {
      MicroKernelTail<R - 1, NV, kRowStep, kFuse>(rows, depth, a, k_step, b, ldb, c, ldc,
                                                  accumulate, fuse);
      return;
    }
  }
  MicroKernel<R, NV, kRowStep, kFuse>(depth, a, k_step, b, ldb, c, ldc, accumulate, fuse);
}

template <int NV, int kRowStep, bool kFuse>
__attribute__((noinline)) void GemmPanel(int64_t rows, int64_t depth, const float* a,
                                         int64_t k_step, const float* b, int64_t ldb, float* c,
                                         int64_t ldc, bool accumulate, GemmFuse fuse) {
  constexpr int R = kBlockRows<NV>;
  int64_t i = 0;
  for (; i + R <= rows; i += R) {
    MicroKernel<R, NV, kRowStep, kFuse>(depth, a + i * kRowStep, k_step, b, ldb, c + i * ldc, ldc,
                                        accumulate, fuse);
  }
  if (i < rows) {
    MicroKernelTail<R - 1, NV, kRowStep, kFuse>(rows - i, depth, a + i * kRowStep, k_step, b, ldb,
                                                c + i * ldc, ldc, accumulate, fuse);
  }
}

// C[i, 0:width*kLanes] (+)= sum_{k < depth} a[i * kRowStep + k * k_step] * B[k, 0:width*kLanes]
// for i < rows; B and C rows are ldb / ldc floats apart. With accumulate false C is overwritten
// (also when depth is 0). The summation order over k is fixed: results never depend on threads.
// `fuse` (optional): GemmFuse, its vectors indexed from C's first lane.
template <int kRowStep>
inline void GemmLanes(int64_t rows, int64_t depth, const float* a, int64_t k_step, const float* b,
                      int64_t ldb, int64_t width, float* c, int64_t ldc, bool accumulate,
                      const GemmFuse* fuse = nullptr) {
  for (int64_t v0 = 0; v0 < width; v0 += kMaxBlockVectors) {
    int64_t nv = std::min<int64_t>(kMaxBlockVectors, width - v0);
    const float* bp = b + v0 * kLanes;
    float* cp = c + v0 * kLanes;
    GemmFuse f;
    if (fuse != nullptr) {
      f = *fuse;
      if (f.c_scale != nullptr) f.c_scale += v0;
      if (f.row_max != nullptr) f.row_max += v0;
    }
// (fused products are only asked for with kRowStep 1: the others are not instantiated)
#define ATTNAUX_GEMM_PANEL(NV)                                                                \
  if constexpr (kRowStep == 1) {                                                              \
    if (fuse != nullptr) {                                                                    \
      GemmPanel<NV, kRowStep, true>(rows, depth, a, k_step, bp, ldb, cp, ldc, accumulate, f);  \
      break;                                                                                  \
    }                                                                                         \
  }                                                                                           \
  GemmPanel<NV, kRowStep, false>(rows, depth, a, k_step, bp, ldb, cp, ldc, accumulate, f);
    switch (nv) {
#if defined(__AVX512F__)
      case 4:
        ATTNAUX_GEMM_PANEL(4)
        break;
      case 3:
        ATTNAUX_GEMM_PANEL(3)
        break;
#endif
      case 2:
        ATTNAUX_GEMM_PANEL(2)
        break;
      default:
        ATTNAUX_GEMM_PANEL(1)
        break;
    }
#undef ATTNAUX_GEMM_PANEL
  }
}

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_CPU_GEMM_H_
