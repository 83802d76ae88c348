// The `small_seq` attention primitive on CPU: one query row (q_seq == 1) against at most
// kSmallMaxKeys keys, for very large batches (decoder cross-attention). Same ABI and semantics as
// the `probs` primitive (docs/kernel_abi.md): it writes P and its backward reads P.
//
// Per query row the work is a handful of dot products and axpys over the head dim, so the
// kernel is bound by memory traffic, and by the load ports of the core when the data is cached.
// It is organised for both:
// - a task owns a run of batch elements and does all the work of one batch element (every head)
//   together. The K and V blocks of the next batch element ([Skv, Hkv, D], contiguous) are
//   prefetched while the current one computes, so the memory system streams ahead of the core;
// - per query head, the dot products with all its keys keep the head's query vector loaded once
//   per chunk and one accumulator per key in registers, and their horizontal sums are one
//   transposing reduction that yields the row's logits as a vector; the softmax of <= 16 logits
//   is one vector; out = sum_j (P * drop)_j v_j is accumulated in registers over the visible
//   keys and stored once, straight into the output;
// - backward: dP = dout . v per head the same way, dS from the saved P, dq = sum_j dR_j k_j per
//   head in registers, and each (key, kv head) row of dk and dv = sums over the group's heads,
//   written once, in memory order, straight into the outputs (nothing is zero-filled and then
//   accumulated in memory).
// Float32 inputs with whole-vector head dims are read in place; other dtypes are converted per
// batch element into a small float32 copy. Outputs of one batch element are owned by one task and
// summed in a fixed order: results do not depend on the number of threads.
#ifndef ATTNAUX_CSRC_CPU_SMALL_SEQ_CPU_H_
#define ATTNAUX_CSRC_CPU_SMALL_SEQ_CPU_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/attention_cpu.h"
#include "cpu/cpu_parallel.h"
#include "cpu/cpu_simd.h"
#include "cpu/probs_common.h"

namespace attnaux::cpu::pk {

inline constexpr int64_t kSmallMaxKeys = 16;
// Logits of one row: kSmallMaxKeys floats, padded to whole vectors (one vector with AVX-512).
inline constexpr int64_t kSmallKeyPad = kSmallMaxKeys < kLanes ? kLanes : kSmallMaxKeys;
// Batch elements per task: enough work to amortise scheduling, small enough to balance threads.
inline constexpr int64_t kSmallBatchPerTask = 64;

static_assert(kSmallMaxKeys <= 32, "visibility is a 32-bit set per row");

// ---------------------------------------------------------------------------------------------
// Rows as float32
// ---------------------------------------------------------------------------------------------

// Rows [first, first + count) of a row-major [*, n] input as float32 rows `pitch` floats apart:
// the input itself when it is float32 and rows are whole vectors, else a zero-padded copy.
struct RowsF32 {
  const float* base = nullptr;
  int64_t pitch = 0;
  const float* Row(int64_t r) const { return base + r * pitch; }
};

inline RowsF32 ViewRows(Elem elem, bool direct, const void* src, int64_t first, int64_t count,
                        int64_t n, int64_t np, float* buf) {
  if (direct) return {static_cast<const float*>(src) + first * n, n};
  for (int64_t r = 0; r < count; ++r) {
    ToFloat(elem, src, (first + r) * n, n, buf + r * np);
    std::fill(buf + r * np + n, buf + (r + 1) * np, 0.0f);
  }
  return {buf, np};
}

// Output rows of width n: written in place when the output is float32 and rows are whole
// vectors, else through one float32 scratch row that Commit converts.
struct OutRowsF32 {
  Elem elem;
  bool direct;
  void* base;
  int64_t n;
  float* scratch;
  float* Row(int64_t r) const { return direct ? static_cast<float*>(base) + r * n : scratch; }
  // Whether rows are the output itself (stored non-temporally), not the scratch row.
  bool stream() const { return direct; }
  void Commit(int64_t r) const {
    if (!direct) FromFloat(elem, base, r * n, n, scratch);
  }
};

// Streams the next batch element's blocks into the cache while the current one computes: a few
// spans of bytes, walked a fixed number of cache lines per Step so that the prefetches are spread
// over the work (a burst would overflow the core's miss buffers and be dropped).
#ifndef ATTNAUX_SMALL_PF_STRIDE
#define ATTNAUX_SMALL_PF_STRIDE 64
#endif
class Prefetcher {
 public:
  void Add(const void* data, int64_t bytes) {
    if (n_ < kMaxSpans && data != nullptr && bytes > 0) {
      const char* c = static_cast<const char*>(data);
      spans_[n_++] = {c, c + bytes};
      lines_ += CeilDiv(bytes, kStride);
    }
  }
  // Spreads the lines evenly over `steps` calls of Step().
  void Plan(int64_t steps) {
    per_step_ = n_ == 0 ? 0 : CeilDiv(lines_, std::max<int64_t>(steps, 1)) * kStride;
  }
  void Step() {
    int64_t budget = per_step_;
    while (budget > 0 && span_ < n_) {
      Span& s = spans_[span_];
      const char* end = std::min(s.end, s.next + budget);
      budget -= end - s.next;
      for (const char* c = s.next; c < end; c += kStride) __builtin_prefetch(c, 0, 3);
      s.next = end;
      if (end >= s.end) ++span_;
    }
  }

 private:
  static constexpr int kMaxSpans = 6;
  static constexpr int64_t kStride = ATTNAUX_SMALL_PF_STRIDE;
  struct Span {
    const char* next;
    const char* end;
  };
  Span spans_[kMaxSpans];
  int n_ = 0, span_ = 0;
  int64_t lines_ = 0, per_step_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Vector pieces
// ---------------------------------------------------------------------------------------------

#if defined(__AVX512F__)
// Sums of lanes of several vectors at once, by a transposing reduction: four levels of
// shuffle + add turn 16 accumulators into the vector of their 16 sums (45 instructions instead
// of 16 separate horizontal sums). Fixed order, so results depend only on the shapes.
inline __m512 SumPairs(__m512 a, __m512 b) {  // per 128-bit group: a0+a2, b0+b2, a1+a3, b1+b3
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline __m512 SumQuads(__m512 a, __m512 b) {  // per 128-bit group: the 4 sums of 4 vectors
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
inline __m512 SumGroups(__m512 a, __m512 b) {  // adjacent 128-bit groups of a, then of b
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
// Lane t of the result = the sum of the lanes of acc[t], t < 16.
inline VecF TransposeSum16(const VecF* acc) {
  __m512 l1[8], l2[4];
  for (int i = 0; i < 8; ++i) l1[i] = SumPairs((__m512)acc[2 * i], (__m512)acc[2 * i + 1]);
  for (int i = 0; i < 4; ++i) l2[i] = SumQuads(l1[2 * i], l1[2 * i + 1]);
  return (VecF)SumGroups(SumGroups(l2[0], l2[1]), SumGroups(l2[2], l2[3]));
}
#endif

// out[t] = the sum of the lanes of acc[t], t < NK.
template <int NK>
inline __attribute__((always_inline)) void SumLanes(const VecF* acc, float* out) {
#if defined(__AVX512F__)
  if constexpr (NK >= 8) {
    VecF all[16];
    for (int t = 0; t < 16; ++t) all[t] = acc[t % NK];
    alignas(64) float sums[16];
    Store(sums, TransposeSum16(all));
    for (int t = 0; t < NK; ++t) out[t] = sums[t];
    return;
  }
#endif
  for (int t = 0; t < NK; ++t) out[t] = HSum(acc[t]);
}

// out[t] = <a, rows[t]> over dp floats (whole vectors) for t < NK: a is loaded once per vector
// and shared by the NK accumulators.
template <int NK>
inline void DotRows(const float* a, const float* const* rows, int64_t dp, float* out) {
  VecF acc[NK];
  for (int t = 0; t < NK; ++t) acc[t] = VecF{};
  for (int64_t x = 0; x < dp; x += kLanes) {
    const VecF av = Load(a + x);
    for (int t = 0; t < NK; ++t) acc[t] += av * Load(rows[t] + x);
  }
  SumLanes<NK>(acc, out);
}

// out[t] = <a, rows[t]> for t < n <= kSmallMaxKeys. The rows array (kSmallMaxKeys entries) is
// padded with `zero_row` up to the next power of two, which fixes the summation order by n.
inline void DotRowsAny(const float* a, const float** rows, int64_t n, int64_t dp,
                       const float* zero_row, float* out) {
  float sums[kSmallMaxKeys];
  const int64_t nk = n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : n <= 8 ? 8 : 16;
  for (int64_t t = n; t < nk; ++t) rows[t] = zero_row;
  switch (nk) {
    case 1: DotRows<1>(a, rows, dp, sums); break;
    case 2: DotRows<2>(a, rows, dp, sums); break;
    case 4: DotRows<4>(a, rows, dp, sums); break;
    case 8: DotRows<8>(a, rows, dp, sums); break;
    default: DotRows<16>(a, rows, dp, sums); break;
  }
  std::copy(sums, sums + n, out);
}
static_assert(kSmallMaxKeys <= 16, "DotRowsAny handles at most 16 keys");

// dst[x0 .. x0 + NV vectors) = sum_t w[t] * rows[t][same], accumulated in registers.
template <int NV>
inline __attribute__((always_inline)) void WeightedBlock(int64_t n, const float* w,
                                                         const float* const* rows, int64_t x0,
                                                         float* dst, bool stream) {
  VecF acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = VecF{};
  for (int64_t t = 0; t < n; ++t) {
    const VecF wv = Splat(w[t]);
    const float* r = rows[t] + x0;
    for (int v = 0; v < NV; ++v) acc[v] += wv * Load(r + v * kLanes);
  }
  if (stream) {
    for (int v = 0; v < NV; ++v) StoreStream(dst + x0 + v * kLanes, acc[v]);
  } else {
    for (int v = 0; v < NV; ++v) Store(dst + x0 + v * kLanes, acc[v]);
  }
}

// dst[0..dp) = sum_t w[t] * rows[t][0..dp) over the n rows (zeros when n == 0), in order of t;
// with `stream`, stored non-temporally (when dst is aligned).
inline __attribute__((always_inline)) void WeightedSum(int64_t n, const float* w,
                                                       const float* const* rows, int64_t dp,
                                                       float* dst, bool stream = false) {
  stream = stream && StreamAligned(dst);
  const int64_t nv = dp / kLanes;
  int64_t v0 = 0;
  for (; v0 + 8 <= nv; v0 += 8) WeightedBlock<8>(n, w, rows, v0 * kLanes, dst, stream);
  switch (nv - v0) {
    case 7: WeightedBlock<7>(n, w, rows, v0 * kLanes, dst, stream); break;
    case 6: WeightedBlock<6>(n, w, rows, v0 * kLanes, dst, stream); break;
    case 5: WeightedBlock<5>(n, w, rows, v0 * kLanes, dst, stream); break;
    case 4: WeightedBlock<4>(n, w, rows, v0 * kLanes, dst, stream); break;
    case 3: WeightedBlock<3>(n, w, rows, v0 * kLanes, dst, stream); break;
    case 2: WeightedBlock<2>(n, w, rows, v0 * kLanes, dst, stream); break;
    case 1: WeightedBlock<1>(n, w, rows, v0 * kLanes, dst, stream); break;
    default: break;
  }
}

// Lanes [t, t + kLanes) of a 32-bit set as a vector mask (true where the bit is set).
inline auto BitsLanes(uint32_t bits, int64_t t) {
  const VecI lanes = LaneIndex() + static_cast<int32_t>(t);
  const VecI shifted = (VecI{} + static_cast<int32_t>(bits)) >> (lanes & 31);
  return (shifted & 1) != 0 && lanes < 32;
}

// ---------------------------------------------------------------------------------------------
// One batch element
// ---------------------------------------------------------------------------------------------

// Scratch of one task, reused for each of its batch elements (float32, L1-sized).
struct SmallScratch {
  bool direct;
  int64_t dp, dvp;
  FloatBuffer logits;   // [Hq][kSmallKeyPad]: logits, then P (forward) / dP, then dR (backward)
  FloatBuffer weights;  // [Hq][kSmallKeyPad]: P * drop
  FloatBuffer raw;      // [Hq][kSmallKeyPad]: raw logits (backward with a softcap)
  FloatBuffer zero;     // [max(dp, dvp)] zeros: the row that pads DotRowsAny's rows
  FloatBuffer q, dout;  // [Hq][dp], [Hq][dvp]: converted rows (not direct only)
  FloatBuffer k, v;     // [Skv * Hkv][dp], [Skv * Hkv][dvp]: converted rows (not direct only)
  FloatBuffer row;      // one output row (not direct only)
  std::vector<uint32_t> keys;  // [Hq]: keys of each head's row that enter its sums, as bit sets
  std::vector<float> coef;     // [max(group, kSmallMaxKeys)]: weights of a WeightedSum
  std::vector<const float*> rows;

  SmallScratch(const AttentionParams& p, bool backward)
      : direct(p.elem == Elem::kF32 && p.head_dim % kLanes == 0 && p.v_dim % kLanes == 0),
        dp(RoundUp(p.head_dim, kLanes)),
        dvp(RoundUp(p.v_dim, kLanes)),
        logits(p.q_heads * kSmallKeyPad),
        weights(p.q_heads * kSmallKeyPad),
        raw(backward && p.softcap > 0.0f ? p.q_heads * kSmallKeyPad : 1),
        zero(std::max(dp, dvp)),
        q(direct ? 1 : p.q_heads * dp),
        dout(direct || !backward ? 1 : p.q_heads * dvp),
        k(direct ? 1 : p.kv_len * p.kv_heads * dp),
        v(direct ? 1 : p.kv_len * p.kv_heads * dvp),
        row(direct ? 1 : std::max(dp, dvp)),
        keys(p.q_heads),
        coef(std::max(p.group(), kSmallMaxKeys)),
        rows(std::max(p.group(), kSmallMaxKeys)) {
    std::fill(zero.get(), zero.get() + std::max(dp, dvp), 0.0f);
  }
};

// The rows of one block's keys [lo, hi) for kv head kv, into rows[0 .. hi - lo).
inline void KeyRows(const RowsF32& block, int64_t kv_heads, int64_t kv, int64_t n,
                    const float** rows) {
  for (int64_t t = 0; t < n; ++t) rows[t] = block.Row(t * kv_heads + kv);
}

// dots[h * kSmallKeyPad + j] = <a_h, block(j, h / group)> for every head h and key j in [lo, hi).
// One prefetch step per head.
inline void HeadKeyDots(const RowsF32& a, const RowsF32& block, const AttentionParams& p,
                        int64_t lo, int64_t hi, int64_t width, SmallScratch& sc, float* dots,
                        Prefetcher& prefetch) {
  const int64_t group = p.group();
  for (int64_t h = 0; h < p.q_heads; ++h) {
    prefetch.Step();
    KeyRows(block, p.kv_heads, h / group, hi - lo, sc.rows.data());
    DotRowsAny(a.Row(h), sc.rows.data(), hi - lo, width, sc.zero.get(),
               dots + h * kSmallKeyPad + lo);
  }
}

// Keys [lo, hi) that row 0 of batch element b may see by position (the same for every head).
inline void SmallKeyRange(const HeadRows& hr, int64_t* lo, int64_t* hi) {
  *lo = hr.ql == 0 ? 0 : hr.Lo(0);
  *hi = hr.ql == 0 ? 0 : std::max(hr.Hi(0), *lo);
}

// Visible keys of row 0 of (b, h) among [lo, hi), as a bit set.
inline uint32_t SmallVisible(const HeadRows& hr, int64_t lo, int64_t hi) {
  uint32_t bits = 0;
  for (int64_t j = lo; j < hi; ++j) {
    if (!hr.per_element() || hr.Extra(0, j)) bits |= uint32_t{1} << j;
  }
  return bits;
}

// Final logits of one row in place (raw dots in s over [lo, hi)): scale, softcap, bias, -inf
// where not visible; then the softmax: s becomes P (0 where not visible). Returns lse; *m the
// max over visible keys.
inline float SmallSoftmax(const HeadRows& hr, uint32_t visible, int64_t lo, int64_t hi, float* s,
                          float* m_out) {
  const AttentionParams& p = *hr.p;
  const VecF scale = Splat(p.scale);
  for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) {
    VecF x = Load(s + t) * scale;
    if (p.softcap > 0.0f) x = p.softcap * Tanh(x * (1.0f / p.softcap));  // as the backward
    Store(s + t, x);
  }
  if (hr.bias != nullptr) {
    for (int64_t j = lo; j < hi; ++j) s[j] += hr.Bias(0, j);
  }
  VecF mv = Splat(-kInfP);
  for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) {
    const VecF x = BitsLanes(visible, t) ? Load(s + t) : Splat(-kInfP);
    Store(s + t, x);
    mv = Max(mv, x);
  }
  const float m = visible != 0 ? HMax(mv) : -kInfP;
  *m_out = m;
  // P = exp(s - m) divided by the row sum (RowStatistics): one vector exponential
  // (exp(-inf) = 0 where not visible).
  const VecF m_use = Splat(m == -kInfP ? 0.0f : m);
  VecF sum = VecF{};
  for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) {
    const VecF e = Exp(Load(s + t) - m_use);
    Store(s + t, e);
    sum += e;
  }
  const float row_sum = visible != 0 ? HSum(sum) : 0.0f;
  const RowStats stats = RowStatistics(hr, m, row_sum);
  const VecF factor = Splat(stats.scale == 0.0f ? 0.0f : std::exp(m - stats.shift) * stats.scale);
  for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) Store(s + t, Load(s + t) * factor);
  return stats.lse;
}

// drop[j] = the dropout factor of key j (keep / (1 - rate) or 0) over [lo, hi), 1 elsewhere and
// without dropout.
inline void SmallDropRow(const HeadRows& hr, int64_t lo, int64_t hi, float* drop) {
  std::fill(drop, drop + kSmallKeyPad, 1.0f);
  if (hr.dropout() && hi > lo) hr.DropRow(0, lo, hi, drop + lo);
}

inline void SmallForwardPadding(const AttentionParams& p, const ProbsForwardOutputs& o, int64_t b) {
  for (int64_t h = 0; h < p.q_heads; ++h) {
    const int64_t row = b * p.q_heads + h;  // q_len == 1: stats, P and out rows share the index
    o.lse[row] = p.sink != nullptr ? p.sink[h] : -kInfP;
    o.max[row] = -kInfP;
    if (o.probs != nullptr) FillZero(p.elem, o.probs, row * p.kv_len, p.kv_len);
  }
  FillZero(p.elem, o.out, b * p.q_heads * p.v_dim, p.q_heads * p.v_dim);
}

// Batch element b's block of a [B, rows, width] array of `size`-byte elements.
struct Block {
  const char* base;
  Block(const void* data, int64_t b, int64_t rows, int64_t width, int64_t size)
      : base(static_cast<const char*>(data) + b * rows * width * size) {}
};

inline void SmallForwardBatch(const AttentionParams& p, const ProbsForwardOutputs& o, int64_t b,
                              bool prefetch_next, SmallScratch& sc) {
  const int64_t hq = p.q_heads, hkv = p.kv_heads, group = p.group(), skv = p.kv_len;
  const int64_t dp = sc.dp, dvp = sc.dvp;
  const HeadRows hr0(p, b, 0);
  int64_t lo, hi;
  SmallKeyRange(hr0, &lo, &hi);
  if (hr0.ql == 0) {
    SmallForwardPadding(p, o, b);
    return;
  }
  // The next batch element's q, K, V (and output rows) stream in while this one computes.
  const int64_t size = p.elem == Elem::kF32 ? 4 : 2;
  Prefetcher prefetch;
  if (prefetch_next) {
    prefetch.Add(Block(p.q, b + 1, hq, p.head_dim, size).base, hq * p.head_dim * size);
    prefetch.Add(Block(p.k, b + 1, skv * hkv, p.head_dim, size).base, skv * hkv * p.head_dim * size);
    prefetch.Add(Block(p.v, b + 1, skv * hkv, p.v_dim, size).base, skv * hkv * p.v_dim * size);
    prefetch.Plan(3 * hq);
  }
  const RowsF32 q = ViewRows(p.elem, sc.direct, p.q, b * hq, hq, p.head_dim, dp, sc.q.get());
  const RowsF32 k = ViewRows(p.elem, sc.direct, p.k, (b * skv + lo) * hkv, (hi - lo) * hkv,
                             p.head_dim, dp, sc.k.get());
  // Logits of every (head, key).
  float* s = sc.logits.get();
  std::fill(s, s + hq * kSmallKeyPad, 0.0f);
  HeadKeyDots(q, k, p, lo, hi, dp, sc, s, prefetch);
  // Softmax per head; P out; weights P * drop.
  float* w = sc.weights.get();
  for (int64_t h = 0; h < hq; ++h) {
    prefetch.Step();
    const HeadRows hr(p, b, h);
    const int64_t row = b * hq + h;
    sc.keys[h] = SmallVisible(hr, lo, hi);
    float* sr = s + h * kSmallKeyPad;
    o.lse[row] = SmallSoftmax(hr, sc.keys[h], lo, hi, sr, &o.max[row]);
    if (o.probs != nullptr) FromFloat(p.elem, o.probs, row * skv, skv, sr);
    float drop[kSmallKeyPad];
    SmallDropRow(hr, lo, hi, drop);
    for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) {
      Store(w + h * kSmallKeyPad + t, Load(sr + t) * Load(drop + t));
    }
  }
  // out = sum over visible keys of w_j v_j, per head, straight into the output row.
  const RowsF32 v = ViewRows(p.elem, sc.direct, p.v, (b * skv + lo) * hkv, (hi - lo) * hkv,
                             p.v_dim, dvp, sc.v.get());
  const OutRowsF32 out{p.elem, sc.direct, o.out, p.v_dim, sc.row.get()};
  for (int64_t h = 0; h < hq; ++h) {
    prefetch.Step();
    int64_t n = 0;
    for (int64_t j = lo; j < hi; ++j) {
      if (sc.keys[h] >> j & 1u) {
        sc.coef[n] = w[h * kSmallKeyPad + j];
        sc.rows[n++] = v.Row((j - lo) * hkv + h / group);
      }
    }
    WeightedSum(n, sc.coef.data(), sc.rows.data(), dvp, out.Row(b * hq + h), out.stream());
    out.Commit(b * hq + h);
  }
}

inline void SmallBackwardPadding(const AttentionParams& p, const BackwardOutputs& o, int64_t b) {
  const int64_t hq = p.q_heads, skv = p.kv_len;
  FillZero(p.elem, o.dq, b * hq * p.head_dim, hq * p.head_dim);
  FillZero(p.elem, o.dk, b * skv * p.kv_heads * p.head_dim, skv * p.kv_heads * p.head_dim);
  FillZero(p.elem, o.dv, b * skv * p.kv_heads * p.v_dim, skv * p.kv_heads * p.v_dim);
  if (o.dbias != nullptr) std::fill(o.dbias + b * hq * skv, o.dbias + (b + 1) * hq * skv, 0.0f);
}

// dS of one row from P (its saved probabilities), dP = dout . v and the cotangents of lse and P;
// with a softcap, times the tanh derivative at the raw logits `raw` (= dR). `dp_row` becomes dR,
// w the weights P * drop of dv; dbias (if any) gets dS. Entries with P = 0 are selected away
// (docs/kernel_abi.md). Returns the keys with P != 0 as a bit set.
inline uint32_t SmallBackwardRow(const HeadRows& hr, const ProbsBackwardInputs& in,
                                 const BackwardOutputs& o, int64_t lo, int64_t hi,
                                 const float* prob, const float* raw, float* dp_row, float* w) {
  const AttentionParams& p = *hr.p;
  const int64_t row = hr.b * p.q_heads + hr.h, skv = p.kv_len;
  float drop[kSmallKeyPad];
  SmallDropRow(hr, lo, hi, drop);
  float g[kSmallKeyPad] = {};
  if (in.dprobs != nullptr) ToFloat(p.elem, in.dprobs, row * skv, skv, g);
  const VecF zero = VecF{};
  VecF acc = VecF{};
  for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) {
    const VecF pv = Load(prob + t), dv = Load(drop + t);
    Store(w + t, pv * dv);
    const VecF total = Load(dp_row + t) * dv + Load(g + t);
    const VecF sel = pv != zero ? total : zero;
    Store(dp_row + t, sel);
    acc += pv * sel;
  }
  const VecF dt = Splat(HSum(acc) - in.dlse[row]);
  for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) {
    const VecF pv = Load(prob + t);
    Store(dp_row + t, pv != zero ? pv * (Load(dp_row + t) - dt) : zero);  // dS
  }
  if (o.dbias != nullptr) std::copy(dp_row, dp_row + skv, o.dbias + row * skv);
  if (raw != nullptr) {  // softcap: dR = dS * (1 - tanh^2(scale * raw / softcap))
    for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) {
      const VecF th = Tanh(Load(raw + t) * p.scale * (1.0f / p.softcap));
      Store(dp_row + t, Load(dp_row + t) * (1.0f - th * th));
    }
  }
  uint32_t nonzero = 0;
  for (int64_t j = 0; j < skv; ++j) nonzero |= prob[j] != 0.0f ? uint32_t{1} << j : 0u;
  return nonzero;
}

inline void SmallBackwardBatch(const AttentionParams& p, const ProbsBackwardInputs& in,
                               const BackwardOutputs& o, int64_t b, bool prefetch_next,
                               SmallScratch& sc) {
  const int64_t hq = p.q_heads, hkv = p.kv_heads, group = p.group(), skv = p.kv_len;
  const int64_t d = p.head_dim, dv = p.v_dim, dp = sc.dp, dvp = sc.dvp;
  const HeadRows hr0(p, b, 0);
  int64_t lo, hi;
  SmallKeyRange(hr0, &lo, &hi);
  if (hr0.ql == 0) {
    SmallBackwardPadding(p, o, b);
    return;
  }
  // The next batch element's inputs (and output rows) stream in while this one computes.
  const int64_t size = p.elem == Elem::kF32 ? 4 : 2;
  Prefetcher prefetch;
  if (prefetch_next) {
    prefetch.Add(Block(in.dout, b + 1, hq, dv, size).base, hq * dv * size);
    prefetch.Add(Block(in.probs, b + 1, hq, skv, size).base, hq * skv * size);
    prefetch.Add(Block(p.v, b + 1, skv * hkv, dv, size).base, skv * hkv * dv * size);
    prefetch.Add(Block(p.q, b + 1, hq, d, size).base, hq * d * size);
    prefetch.Add(Block(p.k, b + 1, skv * hkv, d, size).base, skv * hkv * d * size);
    prefetch.Plan(3 * hq + skv);
  }
  const RowsF32 dout = ViewRows(p.elem, sc.direct, in.dout, b * hq, hq, dv, dvp, sc.dout.get());
  const RowsF32 v =
      ViewRows(p.elem, sc.direct, p.v, (b * skv + lo) * hkv, (hi - lo) * hkv, dv, dvp, sc.v.get());
  const RowsF32 q = ViewRows(p.elem, sc.direct, p.q, b * hq, hq, d, dp, sc.q.get());
  const RowsF32 k =
      ViewRows(p.elem, sc.direct, p.k, (b * skv + lo) * hkv, (hi - lo) * hkv, d, dp, sc.k.get());
  // dP of every (head, key).
  float* dpr = sc.logits.get();
  std::fill(dpr, dpr + hq * kSmallKeyPad, 0.0f);
  HeadKeyDots(dout, v, p, lo, hi, dvp, sc, dpr, prefetch);
  // With a softcap, the raw logits (for the tanh derivative), computed as in the forward.
  float* raw = nullptr;
  if (p.softcap > 0.0f) {
    raw = sc.raw.get();
    std::fill(raw, raw + hq * kSmallKeyPad, 0.0f);
    Prefetcher none;
    HeadKeyDots(q, k, p, lo, hi, dp, sc, raw, none);
  }
  float* w = sc.weights.get();
  alignas(64) float prob[kSmallKeyPad];
  for (int64_t h = 0; h < hq; ++h) {
    prefetch.Step();
    const HeadRows hr(p, b, h);
    std::fill(prob, prob + kSmallKeyPad, 0.0f);
    if (p.elem == Elem::kF32) {  // a handful of floats: no call to memcpy
      const float* src = static_cast<const float*>(in.probs) + (b * hq + h) * skv;
      for (int64_t j = 0; j < skv; ++j) prob[j] = src[j];
    } else {
      ToFloat(p.elem, in.probs, (b * hq + h) * skv, skv, prob);
    }
    sc.keys[h] =
        SmallBackwardRow(hr, in, o, lo, hi, prob, raw != nullptr ? raw + h * kSmallKeyPad : nullptr,
                         dpr + h * kSmallKeyPad, w + h * kSmallKeyPad);
  }
  // dq = scale * sum_j dR_j k_j over the keys with P != 0, per head, straight into the output.
  const OutRowsF32 dq_out{p.elem, sc.direct, o.dq, d, sc.row.get()};
  for (int64_t h = 0; h < hq; ++h) {
    prefetch.Step();
    int64_t n = 0;
    for (int64_t j = lo; j < hi; ++j) {
      if (sc.keys[h] >> j & 1u) {
        sc.coef[n] = p.scale * dpr[h * kSmallKeyPad + j];
        sc.rows[n++] = k.Row((j - lo) * hkv + h / group);
      }
    }
    WeightedSum(n, sc.coef.data(), sc.rows.data(), dp, dq_out.Row(b * hq + h), dq_out.stream());
    dq_out.Commit(b * hq + h);
  }
  // dk_j = scale * sum_g dR_gj q_g and dv_j = sum_g (P * drop)_gj dout_g over the group's heads g:
  // each (key, kv head) row written once, in memory order (zeros for keys no row sees).
  const OutRowsF32 dk_out{p.elem, sc.direct, o.dk, d, sc.row.get()};
  const OutRowsF32 dv_out{p.elem, sc.direct, o.dv, dv, sc.row.get()};
  for (int64_t j = 0; j < skv; ++j) {
    prefetch.Step();
    const int64_t n = j >= lo && j < hi ? group : 0;
    for (int64_t kh = 0; kh < hkv; ++kh) {
      const int64_t token = (b * skv + j) * hkv + kh;
      for (int64_t g = 0; g < n; ++g) {
        sc.coef[g] = p.scale * dpr[(kh * group + g) * kSmallKeyPad + j];
        sc.rows[g] = q.Row(kh * group + g);
      }
      WeightedSum(n, sc.coef.data(), sc.rows.data(), dp, dk_out.Row(token), dk_out.stream());
      dk_out.Commit(token);
      for (int64_t g = 0; g < n; ++g) {
        sc.coef[g] = w[(kh * group + g) * kSmallKeyPad + j];
        sc.rows[g] = dout.Row(kh * group + g);
      }
      WeightedSum(n, sc.coef.data(), sc.rows.data(), dvp, dv_out.Row(token), dv_out.stream());
      dv_out.Commit(token);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

inline void SmallSeqForward(const AttentionParams& p, const ProbsForwardOutputs& o,
                            ffi::ThreadPool* pool) {
  if (p.batch == 0 || p.q_heads == 0 || p.q_len == 0) return;
  ParallelFor(pool, CeilDiv(p.batch, kSmallBatchPerTask), [&](int64_t task) {
    SmallScratch sc(p, /*backward=*/false);
    const int64_t b_end = std::min(p.batch, (task + 1) * kSmallBatchPerTask);
    for (int64_t b = task * kSmallBatchPerTask; b < b_end; ++b) {
      SmallForwardBatch(p, o, b, b + 1 < b_end, sc);
    }
    StreamFence();
  });
}

inline void SmallSeqBackward(const AttentionParams& p, const ProbsBackwardInputs& in,
                             const BackwardOutputs& o, ffi::ThreadPool* pool) {
  if (p.batch == 0 || p.q_heads == 0) return;
  if (p.q_len == 0) {  // no query row: every gradient is zero (q and dq are empty)
    ParallelFor(pool, CeilDiv(p.batch, kSmallBatchPerTask), [&](int64_t task) {
      const int64_t b_end = std::min(p.batch, (task + 1) * kSmallBatchPerTask);
      for (int64_t b = task * kSmallBatchPerTask; b < b_end; ++b) {
        const int64_t n = p.kv_len * p.kv_heads;
        FillZero(p.elem, o.dk, b * n * p.head_dim, n * p.head_dim);
        FillZero(p.elem, o.dv, b * n * p.v_dim, n * p.v_dim);
      }
    });
    return;
  }
  ParallelFor(pool, CeilDiv(p.batch, kSmallBatchPerTask), [&](int64_t task) {
    SmallScratch sc(p, /*backward=*/true);
    const int64_t b_end = std::min(p.batch, (task + 1) * kSmallBatchPerTask);
    for (int64_t b = task * kSmallBatchPerTask; b < b_end; ++b) {
      SmallBackwardBatch(p, in, o, b, b + 1 < b_end, sc);
    }
    StreamFence();
  });
}

}  // namespace attnaux::cpu::pk

#endif  // ATTNAUX_CSRC_CPU_SMALL_SEQ_CPU_H_
