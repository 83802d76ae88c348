// Fused softmax on the CPU: forward (scale + boolean mask + causal mask, with lse and row max) and
// backward from the saved probabilities. Semantics: docs/softmax_abi.md.
//
// Every softmax row is independent, so rows are the unit of work: a task is a chunk of whole rows
// (about kTaskElements logits), tasks are spread over XLA's intra-op pool with ParallelFor, and a
// row's reductions run in a fixed order inside one task, so results never depend on the threads.
//
// Forward, per row of length K whose visible keys lie in the prefix [0, L) (L = K, or the causal
// limit), three passes; only the first touches the input and only the last writes the output, so
// the row costs one read and one write of memory, the rest stays in L1/L2:
//   1. s = visible ? scale * x : -inf into a float32 scratch row, running vector max;
//   2. e = exp(s - max) in place, running vector sum;
//   3. probs = e * (1 / sum) in the output dtype, zeros for [L, K).
// Backward, per row: Dt = sum_j P dP - dlse, then dlogits = scale * P * (dP - Dt), where P == 0
// (masked, or underflowed) gives exactly 0 so that inf/NaN cotangents at masked positions vanish.
#ifndef ATTNAUX_CSRC_CPU_SOFTMAX_CPU_H_
#define ATTNAUX_CSRC_CPU_SOFTMAX_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu/cpu_parallel.h"
#include "cpu/cpu_simd.h"

namespace attnaux::cpu::softmax {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Logits per task: big enough that scheduling costs nothing, small enough that both cores get
// many tasks (and a row of up to this length stays in L1/L2 through the three passes).
inline constexpr int64_t kTaskElements = 16384;

typedef uint8_t VecB __attribute__((vector_size(kLanes)));
typedef uint16_t VecH __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t VecU __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// Storage types: float, and the bit patterns of bfloat16 and float16.
struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};

inline float ToFloat(float x) { return x; }
inline float ToFloat(Bf16 x) { return Bf16ToFloat(x.bits); }
inline float ToFloat(Half x) { return HalfToFloat(x.bits); }

template <typename T>
inline T FromFloat(float x);
template <>
inline float FromFloat<float>(float x) {
  return x;
}
template <>
inline Bf16 FromFloat<Bf16>(float x) {
  return Bf16{FloatToBf16(x)};
}
template <>
inline Half FromFloat<Half>(float x) {
  return Half{FloatToHalf(x)};
}

// kLanes consecutive values as float32.
inline VecF LoadVec(const float* p) { return Load(p); }
inline VecF LoadVec(const Bf16* p) {
  VecH h;
  std::memcpy(&h, p, sizeof(h));
  return (VecF)(__builtin_convertvector(h, VecU) << 16);
}
inline VecF LoadVec(const Half* p) {
#if defined(__AVX512F__)
  static_assert(kLanes == 16, "AVX-512 path expects 16 lanes");
  return (VecF)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  static_assert(kLanes == 8, "F16C path expects 8 lanes");
  return (VecF)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  VecF v;
  for (int l = 0; l < kLanes; ++l) v[l] = HalfToFloat(p[l].bits);
  return v;
#endif
}

// Stores kLanes floats in the storage type, rounding to nearest even (NaN stays NaN).
inline void StoreVec(float* p, VecF v) { Store(p, v); }
inline void StoreVec(Bf16* p, VecF v) {
  VecU u = (VecU)v;
  VecU rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  VecU quiet_nan = (u >> 16) | 0x40u;
  VecU is_nan = (VecU)((u & 0x7fffffffu) > 0x7f800000u);
  VecU bits = (is_nan & quiet_nan) | (~is_nan & rounded);
  VecH h = __builtin_convertvector(bits, VecH);
  std::memcpy(p, &h, sizeof(h));
}
inline void StoreVec(Half* p, VecF v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__) && defined(__AVX__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int l = 0; l < kLanes; ++l) p[l].bits = FloatToHalf(v[l]);
#endif
}

// Lanes whose mask byte is nonzero. GCC lowers the generic byte-to-int32 conversion to one
// scalar extract per lane (it made masked rows three times slower), so x86 widens with one
// instruction.
inline VecI MaskLanes(const uint8_t* m) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m));
  const __m512i widened = _mm512_cvtepu8_epi32(bytes);
  return (VecI)widened != 0;
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m));
  const __m256i widened = _mm256_cvtepu8_epi32(bytes);
  return (VecI)widened != 0;
#else
  VecB b;
  std::memcpy(&b, m, sizeof(b));
  return __builtin_convertvector(b, VecI) != 0;
#endif
}

inline float HorizontalMax(VecF v) {
  float m = v[0];
  for (int l = 1; l < kLanes; ++l) m = v[l] > m ? v[l] : m;
  return m;
}
inline float HorizontalSum(VecF v) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// A row sum whose rounding error does not grow with the row length: the two vector accumulators
// take at most kSumBlock elements (kSumBlock / (2 * kLanes) per lane), then their float sum is
// added to a double and they restart. A row of at most kSumBlock elements sums exactly as one
// block (the same bits as a plain two-accumulator sum); a longer one has the error of one block
// plus the double sum of the blocks, instead of an error growing linearly with its length.
constexpr int64_t kSumBlock = 4096;

class SumBlocks {
 public:
  // After the accumulators have taken the elements [0, done): flushes them at a block's end.
  void Step(int64_t done, VecF* acc0, VecF* acc1) {
    if (done % kSumBlock != 0) return;
    total_ += HorizontalSum(*acc0 + *acc1);
    *acc0 = VecF{};
    *acc1 = VecF{};
  }
  float Total(VecF acc0, VecF acc1) const {
    return static_cast<float>(total_ + HorizontalSum(acc0 + acc1));
  }

 private:
  double total_ = 0.0;
};

inline int64_t RoundDownLanes(int64_t n) { return n / kLanes * kLanes; }
inline int64_t RoundUpLanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Where a row's mask entries are: `row` points at its first byte; `per_key` says whether there is
// one byte per key (else the single byte applies to the whole row).
struct RowMask {
  const uint8_t* row = nullptr;  // nullptr: no mask
  bool per_key = false;
};

// One forward row. `x`, `out`: K values; `scratch`: RoundUpLanes(K) floats. `limit`: keys at
// j >= limit are invisible (causal); any value, clamped to [0, K].
template <typename T>
void ForwardRow(const T* x, RowMask mask, int64_t limit, int64_t K, float scale, T* out,
                float* row_lse, float* row_max, float* scratch) {
  int64_t L = std::clamp<int64_t>(limit, 0, K);
  if (mask.row != nullptr && !mask.per_key && *mask.row == 0) L = 0;
  const uint8_t* m = mask.per_key ? mask.row : nullptr;

  // Pass 1: scaled, masked logits into scratch; vector max.
  const VecF neg_inf = Splat(kNegInf);
  VecF vmax = neg_inf;
  const int64_t body = RoundDownLanes(L);
  int64_t j = 0;
  if (m == nullptr) {
    for (; j < body; j += kLanes) {
      VecF s = LoadVec(x + j) * scale;
      Store(scratch + j, s);
      vmax = Max(vmax, s);
    }
  } else {
    for (; j < body; j += kLanes) {
      VecF s = LoadVec(x + j) * scale;
      s = MaskLanes(m + j) ? s : neg_inf;
      Store(scratch + j, s);
      vmax = Max(vmax, s);
    }
  }
  float row_m = HorizontalMax(vmax);
  for (; j < L; ++j) {
    float s = (m == nullptr || m[j] != 0) ? ToFloat(x[j]) * scale : kNegInf;
    scratch[j] = s;
    row_m = s > row_m ? s : row_m;
  }
  const int64_t padded = RoundUpLanes(L);
  for (; j < padded; ++j) scratch[j] = kNegInf;

  if (!(row_m > kNegInf)) {  // no visible key (a NaN maximum falls through to the NaN result)
    if (row_m == kNegInf || L == 0) {
      std::memset(static_cast<void*>(out), 0, sizeof(T) * K);  // +0.0 is all-zero bits
      *row_lse = kNegInf;
      *row_max = kNegInf;
      return;
    }
  }

  // Pass 2: exp in place; vector sum (two accumulators, fixed order), in blocks (SumBlocks).
  const VecF vm = Splat(row_m);
  VecF acc0 = VecF{}, acc1 = VecF{};
  SumBlocks blocks;
  int64_t k = 0;
  for (; k + 2 * kLanes <= padded; k += 2 * kLanes) {
    VecF e0 = Exp(Load(scratch + k) - vm);
    VecF e1 = Exp(Load(scratch + k + kLanes) - vm);
    Store(scratch + k, e0);
    Store(scratch + k + kLanes, e1);
    acc0 += e0;
    acc1 += e1;
    blocks.Step(k + 2 * kLanes, &acc0, &acc1);
  }
  for (; k < padded; k += kLanes) {
    VecF e = Exp(Load(scratch + k) - vm);
    Store(scratch + k, e);
    acc0 += e;
  }
  const float sum = blocks.Total(acc0, acc1);  // >= 1: the maximum contributes exp(0)

  // Pass 3: normalise into the output; zeros past the visible prefix.
  const float inv = 1.0f / sum;
  k = 0;
  for (; k < body; k += kLanes) StoreVec(out + k, Load(scratch + k) * inv);
  for (; k < L; ++k) out[k] = FromFloat<T>(scratch[k] * inv);
  if (L < K) std::memset(static_cast<void*>(out + L), 0, sizeof(T) * (K - L));
  *row_lse = row_m + std::log(sum);
  *row_max = row_m;
}

// One backward row: dx = scale * P * (dP - (sum_j P dP - dlse)), 0 where P == 0.
template <typename T>
void BackwardRow(const T* p, const T* dp, float dlse, int64_t K, float scale, T* dx) {
  const VecF zero = VecF{};
  VecF acc0 = zero, acc1 = zero;
  SumBlocks blocks;
  const int64_t body = RoundDownLanes(K);
  int64_t j = 0;
  for (; j + 2 * kLanes <= body; j += 2 * kLanes) {
    VecF p0 = LoadVec(p + j), p1 = LoadVec(p + j + kLanes);
    VecF d0 = LoadVec(dp + j), d1 = LoadVec(dp + j + kLanes);
    acc0 += p0 != zero ? p0 * d0 : zero;
    acc1 += p1 != zero ? p1 * d1 : zero;
    blocks.Step(j + 2 * kLanes, &acc0, &acc1);
  }
  for (; j < body; j += kLanes) {
    VecF p0 = LoadVec(p + j), d0 = LoadVec(dp + j);
    acc0 += p0 != zero ? p0 * d0 : zero;
  }
  float dot = blocks.Total(acc0, acc1);
  for (; j < K; ++j) {
    float pj = ToFloat(p[j]);
    if (pj != 0.0f) dot += pj * ToFloat(dp[j]);
  }
  const float dt = dot - dlse;
  const VecF vdt = Splat(dt);
  j = 0;
  for (; j < body; j += kLanes) {
    VecF p0 = LoadVec(p + j), d0 = LoadVec(dp + j);
    VecF g = (p0 * scale) * (d0 - vdt);
    StoreVec(dx + j, p0 != zero ? g : zero);
  }
  for (; j < K; ++j) {
    float pj = ToFloat(p[j]);
    dx[j] = FromFloat<T>(pj != 0.0f ? (pj * scale) * (ToFloat(dp[j]) - dt) : 0.0f);
  }
}

// Shapes of one forward call (canonical form, docs/softmax_abi.md).
struct ForwardShape {
  int64_t n = 0;        // leading (batch x heads) rows of matrices
  int64_t q_seq = 0;    // rows per matrix
  int64_t kv_seq = 0;   // row length
  int64_t mask_n = 0;   // 0: no mask; else the mask's leading size
  int64_t mask_q = 1;   // 1 or q_seq
  int64_t mask_kv = 1;  // 1 or kv_seq
  int64_t mask_div = 1;
  int32_t causal = 0;  // 0 none, 1 top-left, 2 bottom-right
  float scale = 1.0f;
};

inline int64_t RowsPerTask(int64_t kv_seq) {
  return std::max<int64_t>(1, kTaskElements / std::max<int64_t>(kv_seq, 1));
}

template <typename T>
void Forward(ffi::ThreadPool* pool, const ForwardShape& s, const T* logits, const uint8_t* mask,
             T* probs, float* lse, float* row_max) {
  const int64_t rows = s.n * s.q_seq;
  if (rows == 0) return;
  if (s.kv_seq == 0) {
    std::fill(lse, lse + rows, kNegInf);
    std::fill(row_max, row_max + rows, kNegInf);
    return;
  }
  const int64_t per_task = RowsPerTask(s.kv_seq);
  const int64_t tasks = (rows + per_task - 1) / per_task;
  const int64_t causal_offset = s.causal == 2 ? s.kv_seq - s.q_seq : 0;
  ParallelFor(pool, tasks, [&](int64_t task) {
    std::unique_ptr<float[]> scratch(new float[RoundUpLanes(s.kv_seq)]);
    const int64_t first = task * per_task;
    const int64_t last = std::min(rows, first + per_task);
    for (int64_t r = first; r < last; ++r) {
      const int64_t b = r / s.q_seq;
      const int64_t i = r - b * s.q_seq;
      RowMask rm;
      if (s.mask_n > 0) {
        const int64_t mb = (b / s.mask_div) % s.mask_n;
        const int64_t mi = s.mask_q == 1 ? 0 : i;
        rm.row = mask + (mb * s.mask_q + mi) * s.mask_kv;
        rm.per_key = s.mask_kv != 1 || s.kv_seq == 1;
      }
      const int64_t limit = s.causal == 0 ? s.kv_seq : i + causal_offset + 1;
      ForwardRow(logits + r * s.kv_seq, rm, limit, s.kv_seq, s.scale, probs + r * s.kv_seq,
                 lse + r, row_max + r, scratch.get());
    }
  });
}

template <typename T>
void Backward(ffi::ThreadPool* pool, int64_t rows, int64_t kv_seq, float scale, const T* probs,
              const T* dprobs, const float* dlse, T* dlogits) {
  if (rows == 0 || kv_seq == 0) return;
  const int64_t per_task = RowsPerTask(kv_seq);
  const int64_t tasks = (rows + per_task - 1) / per_task;
  ParallelFor(pool, tasks, [&](int64_t task) {
    const int64_t first = task * per_task;
    const int64_t last = std::min(rows, first + per_task);
    for (int64_t r = first; r < last; ++r) {
      BackwardRow(probs + r * kv_seq, dprobs + r * kv_seq, dlse[r], kv_seq, scale,
                  dlogits + r * kv_seq);
    }
  });
}

}  // namespace attnaux::cpu::softmax

#endif  // ATTNAUX_CSRC_CPU_SOFTMAX_CPU_H_
