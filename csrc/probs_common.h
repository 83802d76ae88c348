// Pieces shared by the probability-saving kernels (`probs`, `small_seq`): per-row visibility, the
// dropout factors of a row, horizontal vector reductions, vectorised row conversions and a small
// register-blocked matrix product with run-time strides. Semantics: docs/kernel_abi.md.
#ifndef ATTNAUX_CSRC_PROBS_COMMON_H_
#define ATTNAUX_CSRC_PROBS_COMMON_H_

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "attention_cpu.h"  // FlashParams, Elem, FloatBuffer
#include "cpu_simd.h"
#include "philox.h"

namespace attnaux::cpu::pk {

inline constexpr float kInfP = std::numeric_limits<float>::infinity();

inline int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// ---------------------------------------------------------------------------------------------
// Reductions and conversions
// ---------------------------------------------------------------------------------------------
inline float HSum(VecF v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.0f;
  for (int x = 0; x < kLanes; ++x) s += v[x];
  return s;
#endif
}

inline float HMax(VecF v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int x = 1; x < kLanes; ++x) m = v[x] > m ? v[x] : m;
  return m;
#endif
}

inline VecI LaneIndex() {
  VecI idx;
  for (int x = 0; x < kLanes; ++x) idx[x] = x;
  return idx;
}

// n elements of type `elem` at base[offset...] -> float dst[0..n).
inline void ToFloat(Elem elem, const void* base, int64_t offset, int64_t n, float* dst) {
  switch (elem) {
    case Elem::kF32:
      std::memcpy(dst, static_cast<const float*>(base) + offset, n * sizeof(float));
      return;
    case Elem::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
      return;
    }
    case Elem::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
      }
#endif
      for (; i < n; ++i) dst[i] = HalfToFloat(src[i]);
      return;
    }
  }
}

// float src[0..n) -> n elements of type `elem` at base[offset...] (round to nearest even).
inline void FromFloat(Elem elem, void* base, int64_t offset, int64_t n, const float* src) {
  switch (elem) {
    case Elem::kF32:
      std::memcpy(static_cast<float*>(base) + offset, src, n * sizeof(float));
      return;
    case Elem::kBF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
      return;
    }
    case Elem::kF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
      }
#endif
      for (; i < n; ++i) dst[i] = FloatToHalf(src[i]);
      return;
    }
  }
}

inline void FillZero(Elem elem, void* base, int64_t offset, int64_t n) {
  if (n <= 0) return;
  const size_t size = elem == Elem::kF32 ? 4 : 2;
  std::memset(static_cast<char*>(base) + offset * size, 0, n * size);
}

// ---------------------------------------------------------------------------------------------
// Visibility of one (batch, query head): docs/kernel_abi.md's visible(i, j)
// ---------------------------------------------------------------------------------------------
struct HeadRows {
  const FlashParams* p;
  int64_t b, h;
  int64_t ql, kl, off;
  const float* bias = nullptr;  // at (b|0, h|0, 0, 0)
  const bool* mask = nullptr;
  const int32_t* q_seg = nullptr;
  const int32_t* kv_seg = nullptr;
  float sink = -kInfP;
  bool has_sink = false;
  uint32_t drop_threshold = 0;
  float drop_scale = 1.0f;

  HeadRows(const FlashParams& params, int64_t batch, int64_t head) : p(&params), b(batch), h(head) {
    ql = std::clamp<int64_t>(params.q_seqlens[b], 0, params.q_len);
    kl = std::clamp<int64_t>(params.kv_seqlens[b], 0, params.kv_len);
    off = params.causal == 2 ? kl - ql : 0;
    if (params.bias != nullptr) {
      bias = params.bias + b * params.bias_stride[0] + h * params.bias_stride[1];
    }
    if (params.mask != nullptr) {
      mask = params.mask + b * params.mask_stride[0] + h * params.mask_stride[1];
    }
    if (params.q_segment_ids != nullptr) {
      q_seg = params.q_segment_ids + b * params.q_len;
      kv_seg = params.kv_segment_ids + b * params.kv_len;
    }
    if (params.sink != nullptr) {
      sink = params.sink[h];
      has_sink = true;
    }
    if (params.rng_state != nullptr) {
      drop_threshold = DropoutThreshold(params.dropout_rate);
      drop_scale = 1.0f / (1.0f - params.dropout_rate);
    }
  }
  bool dropout() const { return p->rng_state != nullptr; }
  // Positions: row i (< ql) may see keys [Lo(i), Hi(i)); both are non-decreasing in i.
  int64_t Lo(int64_t i) const {
    return p->window_left >= 0 ? std::clamp<int64_t>(i + off - p->window_left, 0, kl) : 0;
  }
  int64_t Hi(int64_t i) const {
    int64_t hi = kl;
    if (p->causal != 0) hi = std::min(hi, i + off + 1);
    if (p->window_right >= 0) hi = std::min(hi, i + off + p->window_right + 1);
    return std::max<int64_t>(hi, 0);
  }
  bool per_element() const { return mask != nullptr || q_seg != nullptr; }
  // Mask and segments of (i, j), for j inside [Lo(i), Hi(i)).
  bool Extra(int64_t i, int64_t j) const {
    if (mask != nullptr && !mask[i * p->mask_stride[2] + j * p->mask_stride[3]]) return false;
    if (q_seg != nullptr && q_seg[i] != kv_seg[j]) return false;
    return true;
  }
  float Bias(int64_t i, int64_t j) const {
    return bias[i * p->bias_stride[2] + j * p->bias_stride[3]];
  }
  // Linear index of (b, h, i, 0) in [B, Hq, Sq, Skv] (the dropout counter).
  uint64_t RowBase(int64_t i) const {
    return static_cast<uint64_t>(((b * p->q_heads + h) * p->q_len + i) * p->kv_len);
  }
  // drop[j - j0] = keep(i, j) / (1 - rate) or 0, for j in [j0, j1).
  void DropRow(int64_t i, int64_t j0, int64_t j1, float* drop) const {
    uint64_t e = RowBase(i) + static_cast<uint64_t>(j0);
    for (int64_t j = j0; j < j1;) {
      std::array<uint32_t, 4> words = DropoutWords(p->rng_state, e);
      for (uint64_t w = e & 3u; w < 4 && j < j1; ++w, ++j, ++e) {
        drop[j - j0] = words[w] >= drop_threshold ? drop_scale : 0.0f;
      }
    }
  }
};

// lse and the probability factor from a row's max m (over visible keys, -inf if none) and
// sum = sum_j exp(s_j - m). Returns lse (-inf, or sink, for a row with no visible key).
inline float RowLse(const HeadRows& hr, float m, float sum) {
  if (hr.has_sink) {
    const float big = std::max(m, hr.sink);
    const float scaled = m == -kInfP ? 0.0f : sum * std::exp(m - big);
    return big + std::log(scaled + std::exp(hr.sink - big));
  }
  if (m == -kInfP || !(sum > 0.0f)) return -kInfP;
  return m + std::log(sum);
}

// ---------------------------------------------------------------------------------------------
// C[r, lanes] (+)= sum_{k < depth} A(r, k) * B[k, lanes],  A(r, k) = a[r * ars + k * aks]
// B rows are ldb floats apart, C rows ldc; width is in whole vectors. Fixed summation order.
// ---------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
inline constexpr int kPMaxNV = 4;
template <int NV>
inline constexpr int kPRows = NV == 4 ? 6 : NV == 3 ? 8 : NV == 2 ? 12 : 16;
#else
inline constexpr int kPMaxNV = 2;
template <int NV>
inline constexpr int kPRows = NV == 2 ? 6 : 12;
#endif

template <int R, int NV>
inline __attribute__((always_inline)) void PMicro(int64_t depth, const float* __restrict a,
                                                  int64_t ars, int64_t aks,
                                                  const float* __restrict b, int64_t ldb,
                                                  float* __restrict c, int64_t ldc,
                                                  bool accumulate) {
  VecF acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? Load(c + r * ldc + v * kLanes) : VecF{};
  }
  const float* arow[R];
  for (int r = 0; r < R; ++r) arow[r] = a + r * ars;
  for (int64_t k = 0; k < depth; ++k) {
    VecF bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = Load(b + k * ldb + v * kLanes);
    for (int r = 0; r < R; ++r) {
      VecF ar = Splat(arow[r][k * aks]);
      for (int v = 0; v < NV; ++v) acc[r][v] += ar * bv[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) Store(c + r * ldc + v * kLanes, acc[r][v]);
  }
}

template <int R, int NV>
inline void PMicroTail(int64_t rows, int64_t depth, const float* a, int64_t ars, int64_t aks,
                       const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  if constexpr (R > 1) {
    if (rows < R) {
      PMicroTail<R - 1, NV>(rows, depth, a, ars, aks, b, ldb, c, ldc, accumulate);
      return;
    }
  }
  PMicro<R, NV>(depth, a, ars, aks, b, ldb, c, ldc, accumulate);
}

template <int NV>
__attribute__((noinline)) void PPanel(int64_t rows, int64_t depth, const float* a, int64_t ars,
                                      int64_t aks, const float* b, int64_t ldb, float* c,
                                      int64_t ldc, bool accumulate) {
  constexpr int R = kPRows<NV>;
  int64_t i = 0;
  for (; i + R <= rows; i += R) {
    PMicro<R, NV>(depth, a + i * ars, ars, aks, b, ldb, c + i * ldc, ldc, accumulate);
  }
  if (i < rows) {
    PMicroTail<R - 1, NV>(rows - i, depth, a + i * ars, ars, aks, b, ldb, c + i * ldc, ldc,
                          accumulate);
  }
}

inline void PGemm(int64_t rows, int64_t depth, const float* a, int64_t ars, int64_t aks,
                  const float* b, int64_t ldb, int64_t width, float* c, int64_t ldc,
                  bool accumulate) {
  if (rows <= 0) return;
  for (int64_t v0 = 0; v0 < width; v0 += kPMaxNV) {
    const int64_t nv = std::min<int64_t>(kPMaxNV, width - v0);
    const float* bp = b + v0 * kLanes;
    float* cp = c + v0 * kLanes;
    switch (nv) {
#if defined(__AVX512F__)
      case 4:
        PPanel<4>(rows, depth, a, ars, aks, bp, ldb, cp, ldc, accumulate);
        break;
      case 3:
        PPanel<3>(rows, depth, a, ars, aks, bp, ldb, cp, ldc, accumulate);
        break;
#endif
      case 2:
        PPanel<2>(rows, depth, a, ars, aks, bp, ldb, cp, ldc, accumulate);
        break;
      default:
        PPanel<1>(rows, depth, a, ars, aks, bp, ldb, cp, ldc, accumulate);
        break;
    }
  }
}

// Outputs/inputs of the probability-saving primitives (docs/kernel_abi.md, "probs").
struct ProbsForwardOutputs {
  void* out = nullptr;
  float* lse = nullptr;
  float* max = nullptr;
  void* probs = nullptr;  // [B, Hq, Sq, Skv] in the input dtype; nullptr: not written
};

struct ProbsBackwardInputs {
  const void* dout = nullptr;    // [B, Sq, Hq, Dv]
  const void* probs = nullptr;   // [B, Hq, Sq, Skv], the forward's P
  const float* dlse = nullptr;   // [B, Hq, Sq]
  const void* dprobs = nullptr;  // [B, Hq, Sq, Skv] cotangent of P; nullptr: zero
};

}  // namespace attnaux::cpu::pk

#endif  // ATTNAUX_CSRC_PROBS_COMMON_H_
