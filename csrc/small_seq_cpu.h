// The `small_seq` attention primitive on CPU: one query row (q_seq == 1) against at most
// kSmallMaxKeys keys, for very large batches (decoder cross-attention). Same ABI and semantics as
// the `probs` primitive (docs/kernel_abi.md): it writes P and its backward reads P.
//
// No tiles: a task owns a run of batch elements; for each (batch, kv head) the handful of visible
// K/V rows are read once (in place for float32, converted into an L1-resident buffer otherwise)
// and reused by every query head of the group. The head dimension is in the vector lanes: the
// logits are dot products of q with each key (several keys in flight for instruction-level
// parallelism), the softmax of <= 16 logits is one vector, and out = sum_j w_j v_j keeps the whole
// output row in registers. Everything is one pass over the inputs, so the kernel runs at memory
// speed. Outputs per batch element are owned by one task: results do not depend on threads.
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
inline constexpr int64_t kSmallKeyPad = kSmallMaxKeys < kLanes ? kLanes : kSmallMaxKeys;
// Batch elements per task: enough work to amortise scheduling, small enough to balance threads.
inline constexpr int64_t kSmallBatchPerTask = 16;

// out[t] = <q, rows[t]> for t < NK (dp floats, a whole number of vectors).
template <int NK>
inline __attribute__((always_inline)) void DotKeys(const float* q, const float* const* rows,
                                                   int64_t dp, float* out) {
  VecF acc[NK];
  for (int t = 0; t < NK; ++t) acc[t] = VecF{};
  for (int64_t x = 0; x < dp; x += kLanes) {
    const VecF qv = Load(q + x);
    for (int t = 0; t < NK; ++t) acc[t] += qv * Load(rows[t] + x);
  }
  for (int t = 0; t < NK; ++t) out[t] = HSum(acc[t]);
}

inline void DotMany(const float* q, const float* const* rows, int n, int64_t dp, float* out) {
  int t = 0;
  for (; t + 8 <= n; t += 8) DotKeys<8>(q, rows + t, dp, out + t);
  if (t + 4 <= n) {
    DotKeys<4>(q, rows + t, dp, out + t);
    t += 4;
  }
  if (t + 2 <= n) {
    DotKeys<2>(q, rows + t, dp, out + t);
    t += 2;
  }
  if (t < n) DotKeys<1>(q, rows + t, dp, out + t);
}

// out[0 .. NV vectors) (+)= sum_t w[t] * rows[t][0 .. NV vectors)
template <int NV>
inline __attribute__((always_inline)) void AxpyBlock(int n, const float* w,
                                                     const float* const* rows, int64_t off,
                                                     float* out, bool accumulate) {
  VecF acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = accumulate ? Load(out + off + v * kLanes) : VecF{};
  for (int t = 0; t < n; ++t) {
    const VecF wv = Splat(w[t]);
    const float* r = rows[t] + off;
    for (int v = 0; v < NV; ++v) acc[v] += wv * Load(r + v * kLanes);
  }
  for (int v = 0; v < NV; ++v) Store(out + off + v * kLanes, acc[v]);
}

inline void AxpyMany(int n, const float* w, const float* const* rows, int64_t dp, float* out,
                     bool accumulate) {
  const int64_t nv = dp / kLanes;
  int64_t v0 = 0;
  for (; v0 + 8 <= nv; v0 += 8) AxpyBlock<8>(n, w, rows, v0 * kLanes, out, accumulate);
  switch (nv - v0) {
    case 7: AxpyBlock<7>(n, w, rows, v0 * kLanes, out, accumulate); break;
    case 6: AxpyBlock<6>(n, w, rows, v0 * kLanes, out, accumulate); break;
    case 5: AxpyBlock<5>(n, w, rows, v0 * kLanes, out, accumulate); break;
    case 4: AxpyBlock<4>(n, w, rows, v0 * kLanes, out, accumulate); break;
    case 3: AxpyBlock<3>(n, w, rows, v0 * kLanes, out, accumulate); break;
    case 2: AxpyBlock<2>(n, w, rows, v0 * kLanes, out, accumulate); break;
    case 1: AxpyBlock<1>(n, w, rows, v0 * kLanes, out, accumulate); break;
    default: break;
  }
}

// Rows of one (batch, kv head) as float32 pointers: in place when the input is float32 with
// whole-vector head dims, else converted (zero-padded) into `buf`.
struct SmallRows {
  bool direct;
  int64_t dp, dvp;
  SmallRows(const FlashParams& p)
      : direct(p.elem == Elem::kF32 && p.head_dim % kLanes == 0 && p.v_dim % kLanes == 0),
        dp(RoundUp(p.head_dim, kLanes)),
        dvp(RoundUp(p.v_dim, kLanes)) {}
  // Pointer to row `token` (of width n, padded np) of `src`, converting into buf if needed.
  const float* Get(const FlashParams& p, const void* src, int64_t token, int64_t n, int64_t np,
                   float* buf) const {
    if (direct) return static_cast<const float*>(src) + token * n;
    ToFloat(p.elem, src, token * n, n, buf);
    std::fill(buf + n, buf + np, 0.0f);
    return buf;
  }
};

// Prefetches the K and V rows [0, kv_seqlens[b]) of (b, hkv) into the cache, so that the next
// (batch, kv head) streams in while this one computes: its rows are scattered (4 KiB apart for 8
// heads of 128 floats), too short for the hardware prefetcher to ramp up on its own.
inline void PrefetchKv(const FlashParams& p, int64_t b, int64_t hkv) {
  if (b >= p.batch) return;
  const int64_t kl = std::clamp<int64_t>(p.kv_seqlens[b], 0, p.kv_len);
  const int64_t size = p.elem == Elem::kF32 ? 4 : 2;
  const int64_t k_bytes = p.head_dim * size, v_bytes = p.v_dim * size;
  const char* k = static_cast<const char*>(p.k);
  const char* v = static_cast<const char*>(p.v);
  for (int64_t j = 0; j < kl; ++j) {
    const int64_t token = (b * p.kv_len + j) * p.kv_heads + hkv;
    for (int64_t x = 0; x < k_bytes; x += 64) __builtin_prefetch(k + token * k_bytes + x, 0, 3);
    for (int64_t x = 0; x < v_bytes; x += 64) __builtin_prefetch(v + token * v_bytes + x, 0, 3);
  }
}

// Visible keys of row 0 of (b, h) among the positionally visible [lo, hi): idx[0..n).
inline int VisibleKeys(const HeadRows& hr, int64_t lo, int64_t hi, int* idx) {
  int n = 0;
  for (int64_t j = lo; j < hi; ++j) {
    if (!hr.per_element() || hr.Extra(0, j)) idx[n++] = static_cast<int>(j);
  }
  return n;
}

// Final logits of the n visible keys (raw dots in s[t]) -> scale, softcap, bias.
inline void SmallLogits(const HeadRows& hr, int n, const int* idx, float* s) {
  const FlashParams& p = *hr.p;
  if (p.softcap > 0.0f) {
    const VecF cap = Splat(p.softcap), inv_cap = Splat(1.0f / p.softcap), scale = Splat(p.scale);
    for (int t = 0; t < n; t += kLanes) Store(s + t, cap * Tanh(Load(s + t) * scale * inv_cap));
  } else {
    const VecF scale = Splat(p.scale);
    for (int t = 0; t < n; t += kLanes) Store(s + t, Load(s + t) * scale);
  }
  if (hr.bias != nullptr) {
    for (int t = 0; t < n; ++t) s[t] += hr.Bias(0, idx[t]);
  }
}

// Softmax over s[0..n) (the visible keys; n may be 0): s becomes P. Returns lse; *m the max.
inline float SmallSoftmax(const HeadRows& hr, int n, float* s, float* m_out) {
  const VecI lanes = LaneIndex();
  VecF mv = Splat(-kInfP);
  for (int t = 0; t < n; t += kLanes) {
    VecF x = (lanes + t) < n ? Load(s + t) : Splat(-kInfP);
    Store(s + t, x);
    mv = Max(mv, x);
  }
  const float m = n > 0 ? HMax(mv) : -kInfP;
  *m_out = m;
  const VecF m_use = Splat(m == -kInfP ? 0.0f : m);
  VecF acc = VecF{};
  for (int t = 0; t < n; t += kLanes) acc += Exp(Load(s + t) - m_use);
  const float lse = RowLse(hr, m, n > 0 ? HSum(acc) : 0.0f);
  if (lse == -kInfP || m == -kInfP) {
    for (int t = 0; t < n; ++t) s[t] = 0.0f;
  } else {
    const VecF l = Splat(lse);
    for (int t = 0; t < n; t += kLanes) Store(s + t, Exp(Load(s + t) - l));
  }
  return lse;
}

// Dropout factors of the n visible keys of row 0 of (b, h).
inline void SmallDrop(const HeadRows& hr, int n, const int* idx, float* drop) {
  if (n == 0) return;
  float row[kSmallKeyPad];
  hr.DropRow(0, idx[0], idx[n - 1] + 1, row);
  for (int t = 0; t < n; ++t) drop[t] = row[idx[t] - idx[0]];
}

inline void SmallSeqForward(const FlashParams& p, const ProbsForwardOutputs& o,
                            ffi::ThreadPool* pool) {
  if (p.batch == 0 || p.q_heads == 0 || p.q_len == 0) return;
  const int64_t d = p.head_dim, dv = p.v_dim, skv = p.kv_len, group = p.group();
  const int64_t tasks = CeilDiv(p.batch, kSmallBatchPerTask);
  ParallelFor(pool, tasks, [&](int64_t task) {
    const SmallRows rows(p);
    const int64_t dp = rows.dp, dvp = rows.dvp;
    FloatBuffer kbuf(rows.direct ? 1 : kSmallMaxKeys * dp),
        vbuf(rows.direct ? 1 : kSmallMaxKeys * dvp), qbuf(dp), obuf(dvp);
    const float* krow[kSmallMaxKeys];
    const float* vrow[kSmallMaxKeys];
    const float* kvis[kSmallMaxKeys];
    const float* vvis[kSmallMaxKeys];
    alignas(64) float s[kSmallKeyPad];
    alignas(64) float prow[kSmallKeyPad];
    float drop[kSmallKeyPad];
    int idx[kSmallMaxKeys];
    const int64_t b_end = std::min(p.batch, (task + 1) * kSmallBatchPerTask);
    for (int64_t b = task * kSmallBatchPerTask; b < b_end; ++b) {
      for (int64_t hkv = 0; hkv < p.kv_heads; ++hkv) {
        if (hkv + 1 < p.kv_heads) {
          PrefetchKv(p, b, hkv + 1);
        } else if (b + 1 < b_end) {
          PrefetchKv(p, b + 1, 0);
        }
        const HeadRows hr0(p, b, hkv * group);
        const bool padding = hr0.ql == 0;
        const int64_t lo = padding ? 0 : hr0.Lo(0), hi = padding ? 0 : hr0.Hi(0);
        for (int64_t j = lo; j < hi; ++j) {
          const int64_t token = (b * skv + j) * p.kv_heads + hkv;
          krow[j] = rows.Get(p, p.k, token, d, dp, kbuf.get() + j * dp);
          vrow[j] = rows.Get(p, p.v, token, dv, dvp, vbuf.get() + j * dvp);
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hkv * group + g;
          const HeadRows hr(p, b, h);
          const int64_t stat = b * p.q_heads + h;  // q_len == 1
          const int64_t token = b * p.q_heads + h;
          if (padding) {
            o.lse[stat] = hr.has_sink ? hr.sink : -kInfP;
            o.max[stat] = -kInfP;
            FillZero(p.elem, o.out, token * dv, dv);
            if (o.probs != nullptr) FillZero(p.elem, o.probs, stat * skv, skv);
            continue;
          }
          const int n = VisibleKeys(hr, lo, hi, idx);
          for (int t = 0; t < n; ++t) {
            kvis[t] = krow[idx[t]];
            vvis[t] = vrow[idx[t]];
          }
          const float* q = rows.Get(p, p.q, token, d, dp, qbuf.get());
          for (int64_t t = 0; t < kSmallKeyPad; ++t) s[t] = 0.0f;
          DotMany(q, kvis, n, dp, s);
          SmallLogits(hr, n, idx, s);
          float m;
          const float lse = SmallSoftmax(hr, n, s, &m);
          o.lse[stat] = lse;
          o.max[stat] = m;
          if (o.probs != nullptr) {
            std::fill(prow, prow + skv, 0.0f);
            for (int t = 0; t < n; ++t) prow[idx[t]] = s[t];
            FromFloat(p.elem, o.probs, stat * skv, skv, prow);
          }
          if (hr.dropout()) {
            SmallDrop(hr, n, idx, drop);
            for (int t = 0; t < n; ++t) s[t] *= drop[t];
          }
          AxpyMany(n, s, vvis, dvp, obuf.get(), false);
          FromFloat(p.elem, o.out, token * dv, dv, obuf.get());
        }
      }
    }
  });
}

inline void SmallSeqBackward(const FlashParams& p, const ProbsBackwardInputs& in,
                             const BackwardOutputs& o, ffi::ThreadPool* pool) {
  if (p.batch == 0 || p.q_heads == 0) return;
  const int64_t d = p.head_dim, dv = p.v_dim, skv = p.kv_len, group = p.group();
  const int64_t tasks = CeilDiv(p.batch, kSmallBatchPerTask);
  ParallelFor(pool, tasks, [&](int64_t task) {
    const SmallRows rows(p);
    const int64_t dp = rows.dp, dvp = rows.dvp;
    FloatBuffer kbuf(rows.direct ? 1 : kSmallMaxKeys * dp),
        vbuf(rows.direct ? 1 : kSmallMaxKeys * dvp), qbuf(dp), dobuf(dvp), dqbuf(dp),
        dk(kSmallMaxKeys * dp), dvacc(kSmallMaxKeys * dvp);
    const float* krow[kSmallMaxKeys];
    const float* vrow[kSmallMaxKeys];
    const float* kvis[kSmallMaxKeys];
    const float* vvis[kSmallMaxKeys];
    alignas(64) float pv[kSmallKeyPad];
    alignas(64) float dpv[kSmallKeyPad];
    alignas(64) float sv[kSmallKeyPad];
    alignas(64) float prow[kSmallKeyPad];
    alignas(64) float grow[kSmallKeyPad];
    float drop[kSmallKeyPad];
    int idx[kSmallMaxKeys];
    const int64_t b_end = std::min(p.batch, (task + 1) * kSmallBatchPerTask);
    for (int64_t b = task * kSmallBatchPerTask; b < b_end; ++b) {
      for (int64_t hkv = 0; hkv < p.kv_heads; ++hkv) {
        if (hkv + 1 < p.kv_heads) {
          PrefetchKv(p, b, hkv + 1);
        } else if (b + 1 < b_end) {
          PrefetchKv(p, b + 1, 0);
        }
        const HeadRows hr0(p, b, hkv * group);
        const bool padding = p.q_len == 0 || hr0.ql == 0;
        const int64_t lo = padding ? 0 : hr0.Lo(0), hi = padding ? 0 : hr0.Hi(0);
        for (int64_t j = lo; j < hi; ++j) {
          const int64_t token = (b * skv + j) * p.kv_heads + hkv;
          krow[j] = rows.Get(p, p.k, token, d, dp, kbuf.get() + j * dp);
          vrow[j] = rows.Get(p, p.v, token, dv, dvp, vbuf.get() + j * dvp);
        }
        std::fill(dk.get(), dk.get() + skv * dp, 0.0f);
        std::fill(dvacc.get(), dvacc.get() + skv * dvp, 0.0f);
        for (int64_t g = 0; g < group && p.q_len > 0; ++g) {
          const int64_t h = hkv * group + g;
          const HeadRows hr(p, b, h);
          const int64_t stat = b * p.q_heads + h;
          const int64_t token = b * p.q_heads + h;
          const int n = padding ? 0 : VisibleKeys(hr, lo, hi, idx);
          if (n == 0) {
            FillZero(p.elem, o.dq, token * d, d);
            if (o.dbias != nullptr) std::fill(o.dbias + stat * skv, o.dbias + (stat + 1) * skv, 0.0f);
            continue;
          }
          for (int t = 0; t < n; ++t) {
            kvis[t] = krow[idx[t]];
            vvis[t] = vrow[idx[t]];
          }
          ToFloat(p.elem, in.probs, stat * skv, skv, prow);
          for (int t = 0; t < n; ++t) pv[t] = prow[idx[t]];
          for (int t = n; t < kSmallKeyPad; ++t) pv[t] = 0.0f;
          const float* dout = rows.Get(p, in.dout, token, dv, dvp, dobuf.get());
          for (int64_t t = 0; t < kSmallKeyPad; ++t) dpv[t] = 0.0f;
          DotMany(dout, vvis, n, dvp, dpv);
          if (hr.dropout()) {
            SmallDrop(hr, n, idx, drop);
            for (int t = 0; t < n; ++t) dpv[t] *= drop[t];
          }
          if (in.dprobs != nullptr) {
            ToFloat(p.elem, in.dprobs, stat * skv, skv, grow);
            for (int t = 0; t < n; ++t) dpv[t] += grow[idx[t]];
          }
          float dt = 0.0f;
          for (int t = 0; t < n; ++t) dt += pv[t] * dpv[t];
          dt -= in.dlse[stat];
          for (int t = 0; t < n; ++t) dpv[t] = pv[t] * (dpv[t] - dt);  // dS
          if (o.dbias != nullptr) {
            float* db = o.dbias + stat * skv;
            std::fill(db, db + skv, 0.0f);
            for (int t = 0; t < n; ++t) db[idx[t]] = dpv[t];
          }
          const float* q = rows.Get(p, p.q, token, d, dp, qbuf.get());
          if (p.softcap > 0.0f) {
            DotMany(q, kvis, n, dp, sv);
            const float inv_cap = 1.0f / p.softcap;
            for (int t = n; t < kSmallKeyPad; ++t) sv[t] = 0.0f;
            for (int t = 0; t < n; t += kLanes) {
              const VecF th = Tanh(Load(sv + t) * p.scale * inv_cap);
              Store(sv + t, 1.0f - th * th);
            }
            for (int t = 0; t < n; ++t) dpv[t] *= sv[t];  // dR
          }
          // dq = scale * sum_j dR_j k_j
          AxpyMany(n, dpv, kvis, dp, dqbuf.get(), false);
          {
            const VecF sc = Splat(p.scale);
            for (int64_t x = 0; x < dp; x += kLanes) Store(dqbuf.get() + x, Load(dqbuf.get() + x) * sc);
          }
          FromFloat(p.elem, o.dq, token * d, d, dqbuf.get());
          // dk_j += dR_j q ; dv_j += P_j drop_j dout
          for (int t = 0; t < n; ++t) {
            float* dkr = dk.get() + idx[t] * dp;
            float* dvr = dvacc.get() + idx[t] * dvp;
            const VecF r = Splat(dpv[t]);
            const VecF w = Splat(hr.dropout() ? pv[t] * drop[t] : pv[t]);
            for (int64_t x = 0; x < dp; x += kLanes) Store(dkr + x, Load(dkr + x) + r * Load(q + x));
            for (int64_t x = 0; x < dvp; x += kLanes) {
              Store(dvr + x, Load(dvr + x) + w * Load(dout + x));
            }
          }
        }
        for (int64_t j = 0; j < skv; ++j) {
          const int64_t token = (b * skv + j) * p.kv_heads + hkv;
          float* dkr = dk.get() + j * dp;
          const VecF sc = Splat(p.scale);
          for (int64_t x = 0; x < dp; x += kLanes) Store(dkr + x, Load(dkr + x) * sc);
          FromFloat(p.elem, o.dk, token * d, d, dkr);
          FromFloat(p.elem, o.dv, token * dv, dv, dvacc.get() + j * dvp);
        }
      }
    }
  });
}

}  // namespace attnaux::cpu::pk

#endif  // ATTNAUX_CSRC_SMALL_SEQ_CPU_H_
