// The `small_seq` attention primitive on CPU: one query row (q_seq == 1) against at most
// kSmallMaxKeys keys, for very large batches (decoder cross-attention). Same ABI and semantics as
// the `probs` primitive (docs/kernel_abi.md): it writes P and its backward reads P.
//
// The kernel is memory-bound by construction (per query row a handful of dot products and
// axpys over the head dim), so it is organised around how it streams memory:
// - a task owns a run of batch elements, and all the work of one batch element (every head) is
//   done together, in passes that walk its K and V blocks ([Skv, Hkv, D], contiguous) in memory
//   order, key by key and head by head. Each block is read exactly once per pass, as one linear
//   stream that the hardware prefetcher follows; software prefetches start the next block (V
//   while K is read, the next batch element's K while V is read);
// - forward: logits of every (head, key) (pass over K), the softmax of each head's <= 16 logits as
//   one vector, then out = sum_j (P * drop)_j v_j accumulated in an L1-resident row per head
//   (pass over V);
// - backward: dP = dout . v (pass over V), dS from the saved P, then one pass over K that writes
//   each (key, kv head) row of dk and dv once, straight into the outputs, in memory order, and
//   accumulates dq in L1. Nothing is zero-filled and then accumulated in memory.
// Float32 inputs with whole-vector head dims are read in place; other dtypes are converted
// per batch element into an L1/L2-resident float32 copy. Outputs of one batch element are owned
// by one task and summed in a fixed order: results do not depend on the number of threads.
#ifndef ATTNAUX_CSRC_SMALL_SEQ_CPU_H_
#define ATTNAUX_CSRC_SMALL_SEQ_CPU_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_cpu.h"
#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "probs_common.h"

namespace attnaux::cpu::pk {

inline constexpr int64_t kSmallMaxKeys = 16;
// Logits of one row: kSmallMaxKeys floats, padded to whole vectors (one vector with AVX-512).
inline constexpr int64_t kSmallKeyPad = kSmallMaxKeys < kLanes ? kLanes : kSmallMaxKeys;
// Batch elements per task: enough work to amortise scheduling, small enough to balance threads.
inline constexpr int64_t kSmallBatchPerTask = 16;
// Dot products computed side by side (independent FMA chains hide the FMA latency).
inline constexpr int kSmallPairs = 4;

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
  void Commit(int64_t r) const {
    if (!direct) FromFloat(elem, base, r * n, n, scratch);
  }
};

inline void PrefetchSpan(const void* data, int64_t bytes) {
  const char* c = static_cast<const char*>(data);
  for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(c + x, 0, 3);
}

// ---------------------------------------------------------------------------------------------
// Vector pieces
// ---------------------------------------------------------------------------------------------

// out[t] = <a[t], b[t]> over dp floats (a whole number of vectors) for N pairs side by side.
template <int N>
inline __attribute__((always_inline)) void DotPairs(const float* const* a, const float* const* b,
                                                    int64_t dp, float* out) {
  VecF acc[N];
  for (int t = 0; t < N; ++t) acc[t] = VecF{};
  for (int64_t x = 0; x < dp; x += kLanes) {
    for (int t = 0; t < N; ++t) acc[t] += Load(a[t] + x) * Load(b[t] + x);
  }
  for (int t = 0; t < N; ++t) out[t] = HSum(acc[t]);
}

// dots[h * kSmallKeyPad + j] = <rows_a(h), rows_b(j, h / group)> for every head h and key j in
// [lo, hi): one pass over rows_b in memory order (key-major, then kv head). `prefetch(j)` is
// called before key j's rows are read.
template <typename Prefetch>
inline void HeadKeyDots(const RowsF32& a, const RowsF32& b, int64_t heads, int64_t kv_heads,
                        int64_t group, int64_t lo, int64_t hi, int64_t dp, float* dots,
                        const Prefetch& prefetch) {
  const float* pa[kSmallPairs];
  const float* pb[kSmallPairs];
  float d[kSmallPairs];
  for (int64_t j = lo; j < hi; ++j) {
    prefetch(j);
    const int64_t key_row = (j - lo) * kv_heads;
    int64_t h = 0;
    for (; h + kSmallPairs <= heads; h += kSmallPairs) {
      for (int t = 0; t < kSmallPairs; ++t) {
        pa[t] = a.Row(h + t);
        pb[t] = b.Row(key_row + (h + t) / group);
      }
      DotPairs<kSmallPairs>(pa, pb, dp, d);
      for (int t = 0; t < kSmallPairs; ++t) dots[(h + t) * kSmallKeyPad + j] = d[t];
    }
    for (; h < heads; ++h) {
      pa[0] = a.Row(h);
      pb[0] = b.Row(key_row + h / group);
      DotPairs<1>(pa, pb, dp, d);
      dots[h * kSmallKeyPad + j] = d[0];
    }
  }
}

// acc[0..dp) += w * row[0..dp).
inline __attribute__((always_inline)) void AxpyRow(float w, const float* row, int64_t dp,
                                                   float* acc) {
  const VecF wv = Splat(w);
  for (int64_t x = 0; x < dp; x += kLanes) Store(acc + x, Load(acc + x) + wv * Load(row + x));
}

// dst[0..dp) = sum_t w[t] * rows[t][0..dp) over the n rows (zeros when n == 0), in order of t.
inline void WeightedSum(int64_t n, const float* w, const float* const* rows, int64_t dp,
                        float* dst) {
  if (n == 1) {  // the common case without GQA
    const VecF w0 = Splat(w[0]);
    for (int64_t x = 0; x < dp; x += kLanes) Store(dst + x, w0 * Load(rows[0] + x));
    return;
  }
  for (int64_t x = 0; x < dp; x += kLanes) {
    VecF acc = VecF{};
    for (int64_t t = 0; t < n; ++t) acc += Splat(w[t]) * Load(rows[t] + x);
    Store(dst + x, acc);
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

// Scratch of one task, reused for each of its batch elements (float32, L1/L2-sized).
struct SmallScratch {
  bool direct;
  int64_t dp, dvp, acc_pitch;
  FloatBuffer logits;   // [Hq][kSmallKeyPad]: logits, then P (forward) / dP, then dR (backward)
  FloatBuffer weights;  // [Hq][kSmallKeyPad]: P * drop
  FloatBuffer acc;      // [Hq][acc_pitch]: out (forward) / raw logits, then dq (backward)
  FloatBuffer q, dout;  // [Hq][dp], [Hq][dvp]: converted rows (not direct only)
  FloatBuffer k, v;     // [Skv * Hkv][dp], [Skv * Hkv][dvp]: converted rows (not direct only)
  FloatBuffer row;      // one output row (not direct only)
  std::vector<uint32_t> visible;  // [Hq]: keys of each head's row that are visible / P != 0
  std::vector<float> group_coef;  // [group]
  std::vector<const float*> group_rows;

  SmallScratch(const FlashParams& p, bool backward)
      : direct(p.elem == Elem::kF32 && p.head_dim % kLanes == 0 && p.v_dim % kLanes == 0),
        dp(RoundUp(p.head_dim, kLanes)),
        dvp(RoundUp(p.v_dim, kLanes)),
        acc_pitch(std::max({dp, dvp, kSmallKeyPad})),
        logits(p.q_heads * kSmallKeyPad),
        weights(p.q_heads * kSmallKeyPad),
        acc(p.q_heads * acc_pitch),
        q(direct ? 1 : p.q_heads * dp),
        dout(direct || !backward ? 1 : p.q_heads * dvp),
        k(direct ? 1 : p.kv_len * p.kv_heads * dp),
        v(direct ? 1 : p.kv_len * p.kv_heads * dvp),
        row(direct ? 1 : std::max(dp, dvp)),
        visible(p.q_heads),
        group_coef(p.group()),
        group_rows(p.group()) {}
};

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
  const FlashParams& p = *hr.p;
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
  const VecF m_use = Splat(m == -kInfP ? 0.0f : m);
  VecF sum = VecF{};
  for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) sum += Exp(Load(s + t) - m_use);
  const float lse = RowLse(hr, m, visible != 0 ? HSum(sum) : 0.0f);
  const bool empty = lse == -kInfP || m == -kInfP;
  const VecF l = Splat(empty ? 0.0f : lse);
  for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) {
    Store(s + t, empty ? VecF{} : Exp(Load(s + t) - l));  // exp(-inf) = 0 where not visible
  }
  return lse;
}

// drop[j] = the dropout factor of key j (keep / (1 - rate) or 0) over [lo, hi), 1 elsewhere and
// without dropout.
inline void SmallDropRow(const HeadRows& hr, int64_t lo, int64_t hi, float* drop) {
  std::fill(drop, drop + kSmallKeyPad, 1.0f);
  if (hr.dropout() && hi > lo) hr.DropRow(0, lo, hi, drop + lo);
}

inline void SmallForwardPadding(const FlashParams& p, const ProbsForwardOutputs& o, int64_t b) {
  for (int64_t h = 0; h < p.q_heads; ++h) {
    const int64_t row = b * p.q_heads + h;  // q_len == 1: stats, P and out rows share the index
    o.lse[row] = p.sink != nullptr ? p.sink[h] : -kInfP;
    o.max[row] = -kInfP;
    if (o.probs != nullptr) FillZero(p.elem, o.probs, row * p.kv_len, p.kv_len);
  }
  FillZero(p.elem, o.out, b * p.q_heads * p.v_dim, p.q_heads * p.v_dim);
}

inline void SmallForwardBatch(const FlashParams& p, const ProbsForwardOutputs& o, int64_t b,
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
  const int64_t size = p.elem == Elem::kF32 ? 4 : 2;
  const int64_t k_key_bytes = hkv * p.head_dim * size, v_key_bytes = hkv * p.v_dim * size;
  const char* k_bytes = static_cast<const char*>(p.k) + (b * skv) * k_key_bytes;
  const char* v_bytes = static_cast<const char*>(p.v) + (b * skv) * v_key_bytes;
  const RowsF32 q = ViewRows(p.elem, sc.direct, p.q, b * hq, hq, p.head_dim, dp, sc.q.get());
  const RowsF32 k = ViewRows(p.elem, sc.direct, p.k, (b * skv + lo) * hkv, (hi - lo) * hkv,
                             p.head_dim, dp, sc.k.get());
  // Logits of every (head, key), one pass over K; V streams in meanwhile.
  float* s = sc.logits.get();
  std::fill(s, s + hq * kSmallKeyPad, 0.0f);
  HeadKeyDots(q, k, hq, hkv, group, lo, hi, dp, s,
              [&](int64_t j) { PrefetchSpan(v_bytes + j * v_key_bytes, v_key_bytes); });
  // Softmax per head; P out; weights P * drop.
  float* w = sc.weights.get();
  for (int64_t h = 0; h < hq; ++h) {
    const HeadRows hr(p, b, h);
    const int64_t row = b * hq + h;
    sc.visible[h] = SmallVisible(hr, lo, hi);
    float* sr = s + h * kSmallKeyPad;
    o.lse[row] = SmallSoftmax(hr, sc.visible[h], lo, hi, sr, &o.max[row]);
    if (o.probs != nullptr) FromFloat(p.elem, o.probs, row * skv, skv, sr);
    float drop[kSmallKeyPad];
    SmallDropRow(hr, lo, hi, drop);
    for (int64_t t = 0; t < kSmallKeyPad; t += kLanes) {
      Store(w + h * kSmallKeyPad + t, Load(sr + t) * Load(drop + t));
    }
  }
  // out = sum_j w_j v_j, one pass over V; the next batch element's K streams in meanwhile.
  const RowsF32 v = ViewRows(p.elem, sc.direct, p.v, (b * skv + lo) * hkv, (hi - lo) * hkv,
                             p.v_dim, dvp, sc.v.get());
  const int64_t acc_pitch = sc.acc_pitch;
  float* acc = sc.acc.get();
  for (int64_t h = 0; h < hq; ++h) std::fill(acc + h * acc_pitch, acc + h * acc_pitch + dvp, 0.0f);
  const char* k_next = k_bytes + skv * k_key_bytes;
  for (int64_t j = lo; j < hi; ++j) {
    if (prefetch_next) PrefetchSpan(k_next + j * k_key_bytes, k_key_bytes);
    const int64_t key_row = (j - lo) * hkv;
    for (int64_t h = 0; h < hq; ++h) {
      if (sc.visible[h] >> j & 1u) {
        AxpyRow(w[h * kSmallKeyPad + j], v.Row(key_row + h / group), dvp, acc + h * acc_pitch);
      }
    }
  }
  const OutRowsF32 out{p.elem, sc.direct, o.out, p.v_dim, sc.row.get()};
  for (int64_t h = 0; h < hq; ++h) {
    float* dst = out.Row(b * hq + h);
    std::copy(acc + h * acc_pitch, acc + h * acc_pitch + dvp, dst);
    out.Commit(b * hq + h);
  }
}

inline void SmallBackwardPadding(const FlashParams& p, const BackwardOutputs& o, int64_t b) {
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
  const FlashParams& p = *hr.p;
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

inline void SmallBackwardBatch(const FlashParams& p, const ProbsBackwardInputs& in,
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
  const int64_t size = p.elem == Elem::kF32 ? 4 : 2;
  const int64_t k_key_bytes = hkv * d * size, v_key_bytes = hkv * dv * size;
  const char* k_bytes = static_cast<const char*>(p.k) + (b * skv) * k_key_bytes;
  const RowsF32 dout =
      ViewRows(p.elem, sc.direct, in.dout, b * hq, hq, dv, dvp, sc.dout.get());
  const RowsF32 v =
      ViewRows(p.elem, sc.direct, p.v, (b * skv + lo) * hkv, (hi - lo) * hkv, dv, dvp, sc.v.get());
  // dP of every (head, key), one pass over V; K streams in meanwhile.
  float* dpr = sc.logits.get();
  std::fill(dpr, dpr + hq * kSmallKeyPad, 0.0f);
  HeadKeyDots(dout, v, hq, hkv, group, lo, hi, dvp, dpr,
              [&](int64_t j) { PrefetchSpan(k_bytes + j * k_key_bytes, k_key_bytes); });
  const RowsF32 q = ViewRows(p.elem, sc.direct, p.q, b * hq, hq, d, dp, sc.q.get());
  const RowsF32 k =
      ViewRows(p.elem, sc.direct, p.k, (b * skv + lo) * hkv, (hi - lo) * hkv, d, dp, sc.k.get());
  // With a softcap, the raw logits (for the tanh derivative), in the accumulator scratch.
  float* raw = nullptr;
  if (p.softcap > 0.0f) {  // [Hq][kSmallKeyPad] fits in the dq accumulators, needed only later
    raw = sc.acc.get();
    std::fill(raw, raw + hq * kSmallKeyPad, 0.0f);
    HeadKeyDots(q, k, hq, hkv, group, lo, hi, dp, raw, [](int64_t) {});
  }
  float* w = sc.weights.get();
  float prob[kSmallKeyPad];
  for (int64_t h = 0; h < hq; ++h) {
    const HeadRows hr(p, b, h);
    std::fill(prob, prob + kSmallKeyPad, 0.0f);
    ToFloat(p.elem, in.probs, (b * hq + h) * skv, skv, prob);
    sc.visible[h] =
        SmallBackwardRow(hr, in, o, lo, hi, prob, raw != nullptr ? raw + h * kSmallKeyPad : nullptr,
                         dpr + h * kSmallKeyPad, w + h * kSmallKeyPad);
  }
  // One pass over K: each (key, kv head) row of dk and dv written once, in memory order; dq
  // accumulated in L1.
  float* dq = sc.acc.get();
  for (int64_t h = 0; h < hq; ++h) std::fill(dq + h * sc.acc_pitch, dq + h * sc.acc_pitch + dp, 0.0f);
  const OutRowsF32 dk_out{p.elem, sc.direct, o.dk, d, sc.row.get()};
  const OutRowsF32 dv_out{p.elem, sc.direct, o.dv, dv, sc.row.get()};
  const char* v_next = static_cast<const char*>(p.v) + ((b + 1) * skv) * v_key_bytes;
  float* coef = sc.group_coef.data();
  const float** rows = sc.group_rows.data();
  for (int64_t j = 0; j < skv; ++j) {
    if (prefetch_next) PrefetchSpan(v_next + j * v_key_bytes, v_key_bytes);
    const bool seen = j >= lo && j < hi;
    for (int64_t kh = 0; kh < hkv; ++kh) {
      const int64_t token = (b * skv + j) * hkv + kh;
      const int64_t n = seen ? group : 0;  // a key no row sees gets zero gradients
      // dk_j = scale * sum_g dR_gj q_g; dq_g += dR_gj k_j (only where P != 0).
      for (int64_t t = 0; t < n; ++t) {
        const int64_t h = kh * group + t;
        const float dr = dpr[h * kSmallKeyPad + j];
        coef[t] = p.scale * dr;
        rows[t] = q.Row(h);
        if (sc.visible[h] >> j & 1u) {
          AxpyRow(dr, k.Row((j - lo) * hkv + kh), dp, dq + h * sc.acc_pitch);
        }
      }
      WeightedSum(n, coef, rows, dp, dk_out.Row(token));
      dk_out.Commit(token);
      // dv_j = sum_g (P * drop)_gj dout_g.
      for (int64_t t = 0; t < n; ++t) {
        const int64_t h = kh * group + t;
        coef[t] = w[h * kSmallKeyPad + j];
        rows[t] = dout.Row(h);
      }
      WeightedSum(n, coef, rows, dvp, dv_out.Row(token));
      dv_out.Commit(token);
    }
  }
  const OutRowsF32 dq_out{p.elem, sc.direct, o.dq, d, sc.row.get()};
  const VecF scale = Splat(p.scale);
  for (int64_t h = 0; h < hq; ++h) {
    float* dst = dq_out.Row(b * hq + h);
    const float* src = dq + h * sc.acc_pitch;
    for (int64_t x = 0; x < dp; x += kLanes) Store(dst + x, Load(src + x) * scale);
    dq_out.Commit(b * hq + h);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

inline void SmallSeqForward(const FlashParams& p, const ProbsForwardOutputs& o,
                            ffi::ThreadPool* pool) {
  if (p.batch == 0 || p.q_heads == 0 || p.q_len == 0) return;
  ParallelFor(pool, CeilDiv(p.batch, kSmallBatchPerTask), [&](int64_t task) {
    SmallScratch sc(p, /*backward=*/false);
    const int64_t b_end = std::min(p.batch, (task + 1) * kSmallBatchPerTask);
    for (int64_t b = task * kSmallBatchPerTask; b < b_end; ++b) {
      SmallForwardBatch(p, o, b, b + 1 < b_end, sc);
    }
  });
}

inline void SmallSeqBackward(const FlashParams& p, const ProbsBackwardInputs& in,
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
  });
}

}  // namespace attnaux::cpu::pk

#endif  // ATTNAUX_CSRC_SMALL_SEQ_CPU_H_
