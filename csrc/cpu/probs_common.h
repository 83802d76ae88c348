// Pieces shared by the probability-saving kernels (`probs`, `small_seq`): per-row visibility, the
// dropout factors of a row, horizontal vector reductions, vectorised row conversions,
// non-temporal stores and a 16 x 16 transpose. Semantics: docs/kernel_abi.md.
#ifndef ATTNAUX_CSRC_CPU_PROBS_COMMON_H_
#define ATTNAUX_CSRC_CPU_PROBS_COMMON_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "common/philox.h"
#include "cpu/attention_cpu.h"  // AttentionParams, Elem, FloatBuffer
#include "cpu/cpu_simd.h"

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
// Non-temporal stores and transposes
// ---------------------------------------------------------------------------------------------

// Stores a vector that is not read again soon, bypassing the caches where the ISA allows (p
// aligned to the vector size). Large outputs written once (out, dq, dk, dv, P) save the
// read-for-ownership of each line and leave the cache to the inputs. Work that streams ends with
// StreamFence, so its outputs are visible before it reports done.
inline void StoreStream(float* p, VecF v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, (__m512)v);
#elif defined(__AVX__)
  _mm256_stream_ps(p, (__m256)v);
#else
  std::memcpy(p, &v, sizeof(v));
#endif
}

inline void StreamFence() {
#if defined(__AVX__) || defined(__AVX512F__)
  _mm_sfence();
#endif
}

// Prefetches the cache lines of [data, data + bytes).
inline void PrefetchBytes(const void* data, int64_t bytes) {
  const char* c = static_cast<const char*>(data);
  for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(c + x, 0, 3);
}

inline bool StreamAligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (kLanes * sizeof(float)) == 0;
}

// Transpose16, kHasTranspose16: attention_tile.h

// ---------------------------------------------------------------------------------------------
// Visibility of one (batch, query head): docs/kernel_abi.md's visible(i, j)
// ---------------------------------------------------------------------------------------------
struct HeadRows {
  const AttentionParams* p;
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

  HeadRows(const AttentionParams& params, int64_t batch, int64_t head)
      : p(&params), b(batch), h(head) {
    ql = std::clamp<int64_t>(params.q_seqlens[b], 0, params.q_len);
    kl = std::clamp<int64_t>(params.kv_seqlens[b], 0, params.kv_len);
    off = (params.causal == 2 ? kl - ql : 0) + params.DiagonalShift();
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
  // The dropout counter of (b, h, i, 0) (AttentionParams::DropoutIndex).
  uint64_t RowBase(int64_t i) const { return p->DropoutIndex(b, h, i, 0); }
  // drop[j - j0] = keep(i, j) / (1 - rate) or 0, for j in [j0, j1).
  void DropRow(int64_t i, int64_t j0, int64_t j1, float* drop) const {
    uint64_t e = RowBase(i) + static_cast<uint64_t>(j0);
    for (int64_t j = j0; j < j1;) {
      const PhiloxWords words = DropoutWords(p->rng_state, e);
      for (uint64_t w = e & 3u; w < 4 && j < j1; ++w, ++j, ++e) {
        drop[j - j0] = words[w] >= drop_threshold ? drop_scale : 0.0f;
      }
    }
  }
};

// A row's statistics from its max m (over visible keys, -inf if none) and
// sum = sum_j exp(s_j - m): lse (-inf, or the sink, for a row with no visible key), and how its
// probabilities are normalised, P = exp(s - m) * exp(m - shift) * scale, with `shift` the row
// max (or the sink, when larger) and `scale` 1 / the row's sum exp(s - shift), the sink term
// included. P thus divides by the row sum; taking exp(m - lse) instead would make every P
// inherit the rounding of lse, about |lse| * 2^-24, which grows with |lse|. A row with no
// visible key gets shift = +inf and scale = 0 (P = 0).
struct RowStats {
  float lse;
  float shift;
  float scale;
};

// `Rows`: anything with the row's `has_sink` and `sink` (HeadRows here, the flash kernels'
// HeadView in probs_cpu.h's BlockLse).
template <typename Rows>
inline RowStats RowStatistics(const Rows& hr, float m, float sum) {
  if (std::isnan(sum) || std::isnan(m)) {
    // A NaN the row sees: NaN, as in the reference; P NaN too
    const float nan = std::numeric_limits<float>::quiet_NaN();
    return {nan, nan, nan};
  }
  const bool live = m != -kInfP && sum > 0.0f;
  if (hr.has_sink) {
    const float big = std::max(m, hr.sink);
    const float scaled = m == -kInfP ? 0.0f : sum * std::exp(m - big);
    const float total = scaled + std::exp(hr.sink - big);
    const float lse = big + std::log(total);
    return live ? RowStats{lse, big, 1.0f / total} : RowStats{lse, kInfP, 0.0f};
  }
  if (!live) return {-kInfP, kInfP, 0.0f};
  return {m + std::log(sum), m, 1.0f / sum};
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

#endif  // ATTNAUX_CSRC_CPU_PROBS_COMMON_H_
