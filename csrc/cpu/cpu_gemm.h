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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>  // AmxUsable: the tiles' state is the kernel's to grant
#include <unistd.h>
#endif

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

// The block's C before the products (loaded and scaled when accumulating, else 0) and after
// them (scaled, stored, its running maximum taken): shared by the float32 and the pair kernels.
template <int R, int NV, bool kFuse>
inline __attribute__((always_inline)) void LoadBlock(VecF (&acc)[R][NV], const float* c,
                                                     int64_t ldc, bool accumulate,
                                                     const GemmFuse& fuse) {
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) {
      acc[r][v] = accumulate ? Load(c + r * ldc + v * kLanes) : VecF{};
      if (kFuse && accumulate && fuse.c_scale != nullptr) acc[r][v] *= fuse.c_scale[v];
    }
  }
}

template <int R, int NV, bool kFuse>
inline __attribute__((always_inline)) void StoreBlock(VecF (&acc)[R][NV], float* c, int64_t ldc,
                                                      const GemmFuse& fuse) {
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

template <int R, int NV, int kRowStep, bool kFuse>
inline __attribute__((always_inline)) void MicroKernel(int64_t depth, const float* __restrict a,
                                                       int64_t k_step, const float* __restrict b,
                                                       int64_t ldb, float* __restrict c,
                                                       int64_t ldc, bool accumulate,
                                                       const GemmFuse& fuse) {
  VecF acc[R][NV];
  LoadBlock<R, NV, kFuse>(acc, c, ldc, accumulate, fuse);
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
  StoreBlock<R, NV, kFuse>(acc, c, ldc, fuse);
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

// The bfloat16 pair products below need VDPBF16PS and its conversions (AVX512_BF16) and vpermw
// (AVX512BW); every CPU with the former has the latter.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define ATTNAUX_BF16_PAIRS 1
#endif

#if defined(ATTNAUX_BF16_PAIRS)
// bfloat16 products on VDPBF16PS: the same shape with the reduction dimension taken in pairs.
// A(i, k) and row k of B are 32-bit words holding the bfloat16 pair of reduction indices 2k and
// 2k + 1 (the lower index in the low half), and lane l of C gains A(i, k).lo * B[k, l].lo +
// A(i, k).hi * B[k, l].hi in float32 (exact products; the instruction flushes subnormals). One
// instruction does 32 multiply-adds where an FMA does 16, so a product costs about half of its
// float32 form. `depth` counts pairs.
inline constexpr bool kHasBf16Pairs = true;

template <int R, int NV, int kRowStep, bool kFuse>
inline __attribute__((always_inline)) void PairMicroKernel(int64_t depth,
                                                           const uint32_t* __restrict a,
                                                           int64_t k_step,
                                                           const uint32_t* __restrict b,
                                                           int64_t ldb, float* __restrict c,
                                                           int64_t ldc, bool accumulate,
                                                           const GemmFuse& fuse) {
  VecF start[R][NV];
  LoadBlock<R, NV, kFuse>(start, c, ldc, accumulate, fuse);
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = (__m512)start[r][v];
  }
  for (int64_t k = 0; k < depth; ++k) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * kRowStep]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
    }
    a += k_step;
    b += ldb;
  }
  VecF out[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) out[r][v] = (VecF)acc[r][v];
  }
  StoreBlock<R, NV, kFuse>(out, c, ldc, fuse);
}

template <int R, int NV, int kRowStep, bool kFuse>
inline void PairMicroKernelTail(int64_t rows, int64_t depth, const uint32_t* a, int64_t k_step,
                                const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                                bool accumulate, const GemmFuse& fuse) {
  if constexpr (R > 1) {
    if (rows < R) {
      PairMicroKernelTail<R - 1, NV, kRowStep, kFuse>(rows, depth, a, k_step, b, ldb, c, ldc,
                                                      accumulate, fuse);
      return;
    }
  }
  PairMicroKernel<R, NV, kRowStep, kFuse>(depth, a, k_step, b, ldb, c, ldc, accumulate, fuse);
}

template <int NV, int kRowStep, bool kFuse>
__attribute__((noinline)) void PairGemmPanel(int64_t rows, int64_t depth, const uint32_t* a,
                                             int64_t k_step, const uint32_t* b, int64_t ldb,
                                             float* c, int64_t ldc, bool accumulate,
                                             GemmFuse fuse) {
  constexpr int R = kBlockRows<NV>;
  int64_t i = 0;
  for (; i + R <= rows; i += R) {
    PairMicroKernel<R, NV, kRowStep, kFuse>(depth, a + i * kRowStep, k_step, b, ldb, c + i * ldc,
                                            ldc, accumulate, fuse);
  }
  if (i < rows) {
    PairMicroKernelTail<R - 1, NV, kRowStep, kFuse>(rows - i, depth, a + i * kRowStep, k_step, b,
                                                    ldb, c + i * ldc, ldc, accumulate, fuse);
  }
}

// C[i, 0:width*kLanes] (+)= sum_{k < depth} A(i, k) . B[k, 0:width*kLanes] for i < rows, A(i, k)
// = a[i * kRowStep + k * k_step], ldb in words: GemmLanes with pair words. The summation order
// over k is fixed, as in GemmLanes.
template <int kRowStep>
inline void PairGemmLanes(int64_t rows, int64_t depth, const uint32_t* a, int64_t k_step,
                          const uint32_t* b, int64_t ldb, int64_t width, float* c, int64_t ldc,
                          bool accumulate, const GemmFuse* fuse = nullptr) {
  for (int64_t v0 = 0; v0 < width; v0 += kMaxBlockVectors) {
    const int64_t nv = std::min<int64_t>(kMaxBlockVectors, width - v0);
    const uint32_t* bp = b + v0 * kLanes;
    float* cp = c + v0 * kLanes;
    GemmFuse f;
    if (fuse != nullptr) {
      f = *fuse;
      if (f.c_scale != nullptr) f.c_scale += v0;
      if (f.row_max != nullptr) f.row_max += v0;
    }
// (as in GemmLanes, fused products only with kRowStep 1)
#define ATTNAUX_PAIR_PANEL(NV)                                                                 \
  if constexpr (kRowStep == 1) {                                                               \
    if (fuse != nullptr) {                                                                     \
      PairGemmPanel<NV, kRowStep, true>(rows, depth, a, k_step, bp, ldb, cp, ldc, accumulate, f); \
      break;                                                                                   \
    }                                                                                          \
  }                                                                                            \
  PairGemmPanel<NV, kRowStep, false>(rows, depth, a, k_step, bp, ldb, cp, ldc, accumulate, f);
    switch (nv) {
      case 4:
        ATTNAUX_PAIR_PANEL(4)
        break;
      case 3:
        ATTNAUX_PAIR_PANEL(3)
        break;
      case 2:
        ATTNAUX_PAIR_PANEL(2)
        break;
      default:
        ATTNAUX_PAIR_PANEL(1)
        break;
    }
#undef ATTNAUX_PAIR_PANEL
  }
}

// Pair words of two float rows rounded to bfloat16 (nearest even; NaN stays NaN): word l of the
// result holds lo[l] in its low half and hi[l] in its high half.
inline void StorePairsBf16(uint32_t* dst, VecF lo, VecF hi) {
  // vcvtne2ps2bf16 puts lo's 16 values below hi's; the permutation interleaves them
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both));
}

// x rounded to bfloat16 in lane order (so that pairs are neighbouring lanes), as
// StorePairsBf16 rounds.
inline void StoreBf16(uint16_t* dst, VecF x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh((__m512)x));
}
#else
inline constexpr bool kHasBf16Pairs = false;
#endif

// AMX (a Sapphire Rapids or later Xeon, built with -march=native there): bfloat16 tile products,
// TDPBF16PS, a 16 x 16 float32 tile plus a 16 x 32 by 32 x 16 bfloat16 product an instruction,
// about 16x the multiply-adds a cycle of VDPBF16PS, whose rate on these cores is that of the
// float32 FMAs (a profile of the bfloat16 forward: 83% of its time in PairGemmPanel, the forward
// no faster than its float32 form). Linux hands out the tiles' 8 KiB of register state only on
// request (arch_prctl ARCH_REQ_XCOMP_PERM), once a process: AmxUsable says whether it did.
#if defined(ATTNAUX_BF16_PAIRS) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#define ATTNAUX_AMX 1

inline bool AmxUsable() {
  static const bool usable = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

// Every tile 16 rows of 64 bytes (palette 1): C 16 x 16 float32, A 16 x 32 bfloat16, B 16 rows
// of 16 pair words. The configuration is the thread's: loaded at each product, as other code on
// XLA's threads (oneDNN) may load its own between two of ours.
inline void AmxConfigure() {
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  static const Config config = [] {
    Config c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

// C[i, 0:64] (+)= sum_{k < 2 kp} A[i, k] B(k, 0:64) for i < rows, on AMX tiles: A's rows
// bfloat16 (lda elements apart, the reduction index contiguous, so that its words are pairs),
// B as PairGemmLanes' pair words (row k2 holding k = 2 k2, 2 k2 + 1; ldb words apart), C float32
// (ldc floats apart). `rows` and `kp` multiples of 16: the caller pads A and B with zeros. With
// accumulate false C is overwritten. The tiles' summation order is fixed: results never depend
// on threads.
inline void AmxGemm64(int64_t rows, int64_t kp, const uint16_t* a, int64_t lda,
                      const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  AmxConfigure();
  const int64_t a_stride = lda * 2, b_stride = ldb * 4, c_stride = ldc * 4;
  for (int64_t i0 = 0; i0 < rows; i0 += 32) {
    const bool two = i0 + 16 < rows;  // a second row of C tiles
    float* c0 = c + i0 * ldc;
    float* c1 = c0 + 16 * ldc;
    for (int n0 = 0; n0 < 64; n0 += 32) {
      if (accumulate) {
        _tile_loadd(0, c0 + n0, c_stride);
        _tile_loadd(1, c0 + n0 + 16, c_stride);
        if (two) {
          _tile_loadd(2, c1 + n0, c_stride);
          _tile_loadd(3, c1 + n0 + 16, c_stride);
        }
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k0 = 0; k0 < kp; k0 += 16) {
        _tile_loadd(4, a + i0 * lda + 2 * k0, a_stride);
        _tile_loadd(6, b + k0 * ldb + n0, b_stride);
        _tile_loadd(7, b + k0 * ldb + n0 + 16, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, a + (i0 + 16) * lda + 2 * k0, a_stride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c0 + n0, c_stride);
      _tile_stored(1, c0 + n0 + 16, c_stride);
      if (two) {
        _tile_stored(2, c1 + n0, c_stride);
        _tile_stored(3, c1 + n0 + 16, c_stride);
      }
    }
  }
}
#else
inline bool AmxUsable() { return false; }
#endif

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_CPU_GEMM_H_
