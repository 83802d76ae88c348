// The `probs` attention primitive on CPU: a fused forward that also writes the probabilities P
// (before dropout), and a backward that reads P instead of recomputing it. Semantics:
// docs/kernel_abi.md (section "The probability-saving primitives").
//
// Forward: K^T and V of each (batch, kv head) are packed to float32 once; then one task per
// (batch, query head, block of kRows query rows). The scores of the block
// against every key its rows may see are one small matrix product S = Q K^T (keys in the vector
// lanes), then each row gets its softmax, P = exp(s - lse), is written out, and O = (P * drop) V.
// Backward, two passes:
//   A. per (batch, query head, query block): dP = dO V^T, Dt = rowsum(P * dP_total) - dlse,
//      dS = P * (dP_total - Dt) (dbias = dS), dR = dS * softcap'(r), dQ = scale * dR K; dR is kept
//      in a float32 [B, Hq, Sq, Skv] scratch;
//   B. per (batch, kv head, block of kKeys keys): dK = scale * dR^T Q and dV = (P * drop)^T dO
//      over every query row of the group that sees a key of the block, in a fixed order.
// Every output element is owned by one task and reduced in a fixed order, so results do not
// depend on the number of threads. Inputs are read only where visible: rows and keys beyond the
// valid lengths and keys hidden from every row of a block enter no product.
#ifndef ATTNAUX_CSRC_PROBS_CPU_H_
#define ATTNAUX_CSRC_PROBS_CPU_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_cpu.h"
#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "probs_common.h"

namespace attnaux::cpu::pk {

inline constexpr int64_t kRows = 32;    // query rows per forward / pass-A task
inline constexpr int64_t kKeys = 64;    // keys per pass-B task
inline constexpr int64_t kChunk = 128;  // query rows gathered per pass-B product

// Keys that the valid rows [i0, i0 + valid) may see by position: [*ja, *ja + *nkp), ja aligned
// down to a vector, nkp a whole number of vectors (0 when no row sees a key).
inline void BlockKeys(const HeadRows& hr, int64_t i0, int64_t valid, int64_t* ja, int64_t* jhi,
                      int64_t* nkp) {
  *ja = *jhi = *nkp = 0;
  if (valid <= 0) return;
  const int64_t lo = hr.Lo(i0), hi = hr.Hi(i0 + valid - 1);
  if (hi <= lo) return;
  *ja = lo / kLanes * kLanes;
  *jhi = hi;
  *nkp = RoundUp(hi - *ja, kLanes);
}

// Final logits of row i in place over the lanes [ja, ja + nkp): scale, softcap, bias, and -inf
// where (i, j) is not visible. Returns the row max over visible keys (-inf when none).
inline float FinishLogits(const HeadRows& hr, int64_t i, int64_t ja, int64_t nkp, float* s) {
  const FlashParams& p = *hr.p;
  const int64_t lo = hr.Lo(i), hi = hr.Hi(i);
  const VecF scale = Splat(p.scale);
  if (p.softcap > 0.0f) {
    const VecF cap = Splat(p.softcap), inv_cap = Splat(1.0f / p.softcap);
    for (int64_t c = 0; c < nkp; c += kLanes) Store(s + c, cap * Tanh(Load(s + c) * scale * inv_cap));
  } else {
    for (int64_t c = 0; c < nkp; c += kLanes) Store(s + c, Load(s + c) * scale);
  }
  if (hr.per_element() || hr.bias != nullptr) {
    for (int64_t j = std::max(lo, ja); j < hi; ++j) {
      float& x = s[j - ja];
      if (hr.per_element() && !hr.Extra(i, j)) {
        x = -kInfP;
      } else if (hr.bias != nullptr) {
        x += hr.Bias(i, j);
      }
    }
  }
  const VecI lanes = LaneIndex();
  const int32_t first = static_cast<int32_t>(std::clamp<int64_t>(lo - ja, 0, nkp));
  const int32_t end = static_cast<int32_t>(std::clamp<int64_t>(hi - ja, 0, nkp));
  VecF m = Splat(-kInfP);
  for (int64_t c = 0; c < nkp; c += kLanes) {
    const VecI idx = lanes + static_cast<int32_t>(c);
    VecF x = (idx >= first) & (idx < end) ? Load(s + c) : Splat(-kInfP);
    Store(s + c, x);
    m = Max(m, x);
  }
  return end > first ? HMax(m) : -kInfP;
}

// Row softmax from final logits (-inf = invisible): s becomes P = exp(s - lse) (0 where
// invisible), computed as exp(s - m) * exp(m - lse) with one exponential per element. Returns lse.
inline float SoftmaxRow(const HeadRows& hr, float m, int64_t nkp, float* s) {
  const VecF m_use = Splat(m == -kInfP ? 0.0f : m);
  VecF acc = VecF{};
  for (int64_t c = 0; c < nkp; c += kLanes) {
    const VecF e = Exp(Load(s + c) - m_use);
    Store(s + c, e);
    acc += e;
  }
  const float lse = RowLse(hr, m, HSum(acc));
  if (lse == -kInfP || m == -kInfP) {
    std::fill(s, s + nkp, 0.0f);
  } else {
    const VecF factor = Splat(std::exp(m - lse));
    for (int64_t c = 0; c < nkp; c += kLanes) Store(s + c, Load(s + c) * factor);
  }
  return lse;
}

// Writes row i of P (the [B, Hq, Sq, Skv] output): `row` over [ja, ja + nkp), zeros elsewhere.
inline void WriteProbsRow(const HeadRows& hr, void* probs, int64_t i, int64_t ja, int64_t nkp,
                          const float* row) {
  const FlashParams& p = *hr.p;
  const int64_t base = static_cast<int64_t>(hr.RowBase(i));
  const int64_t end = std::min(ja + nkp, p.kv_len);
  FillZero(p.elem, probs, base, std::min(ja, p.kv_len));
  if (end > ja) FromFloat(p.elem, probs, base + ja, end - ja, row);
  FillZero(p.elem, probs, base + std::max(end, ja), p.kv_len - std::max(end, ja));
}

inline void WriteEmptyRow(const HeadRows& hr, const ProbsForwardOutputs& o, int64_t i) {
  const FlashParams& p = *hr.p;
  const int64_t stat = (hr.b * p.q_heads + hr.h) * p.q_len + i;
  o.lse[stat] = hr.has_sink ? hr.sink : -kInfP;
  o.max[stat] = -kInfP;
  FillZero(p.elem, o.out, ((hr.b * p.q_len + i) * p.q_heads + hr.h) * p.v_dim, p.v_dim);
  if (o.probs != nullptr) FillZero(p.elem, o.probs, static_cast<int64_t>(hr.RowBase(i)), p.kv_len);
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

// K^T and V of one (batch, kv head), float32, packed once and shared by every query block and
// query head of the group: kt [D][Skvp], v_rows [Skvp][Dvp]; keys at or beyond kv_seqlens (and
// the padding up to Skvp) are zero, so nothing stored there enters a product.
struct KvLayout {
  int64_t skvp, d, dvp;
  explicit KvLayout(const FlashParams& p)
      : skvp(RoundUp(p.kv_len, kLanes)), d(p.head_dim), dvp(RoundUp(p.v_dim, kLanes)) {}
  int64_t size() const { return skvp * (d + dvp); }
};

inline void PackKvShared(const FlashParams& p, int64_t b, int64_t hkv, const KvLayout& l,
                         float* base) {
  const int64_t d = p.head_dim, dv = p.v_dim;
  const int64_t kl = std::clamp<int64_t>(p.kv_seqlens[b], 0, p.kv_len);
  float* kt = base;
  float* v_rows = base + l.skvp * d;
  std::vector<float> row(std::max(d, dv) + 1);
  for (int64_t j = 0; j < l.skvp; ++j) {
    float* vr = v_rows + j * l.dvp;
    if (j < kl) {
      const int64_t token = (b * p.kv_len + j) * p.kv_heads + hkv;
      ToFloat(p.elem, p.k, token * d, d, row.data());
      for (int64_t x = 0; x < d; ++x) kt[x * l.skvp + j] = row[x];
      ToFloat(p.elem, p.v, token * dv, dv, vr);
      std::fill(vr + dv, vr + l.dvp, 0.0f);
    } else {
      for (int64_t x = 0; x < d; ++x) kt[x * l.skvp + j] = 0.0f;
      std::fill(vr, vr + l.dvp, 0.0f);
    }
  }
}

// Rows of (b, hkv) packed per batch chunk, so that scratch stays bounded for huge batches. The
// chunk depends only on shapes, never on threads.
inline int64_t PackChunk(int64_t per_batch_floats, int64_t batch) {
  constexpr int64_t kBudgetFloats = int64_t{1} << 26;  // 256 MiB
  return std::clamp<int64_t>(kBudgetFloats / std::max<int64_t>(per_batch_floats, 1), 1,
                             std::max<int64_t>(batch, 1));
}

inline void ProbsForwardBlock(const FlashParams& p, const ProbsForwardOutputs& o,
                              const KvLayout& l, const float* kv, int64_t b, int64_t h,
                              int64_t ib) {
  const HeadRows hr(p, b, h);
  const int64_t d = p.head_dim, dv = p.v_dim, dvp = l.dvp;
  const int64_t i0 = ib * kRows, nrows = std::min(kRows, p.q_len - i0);
  const int64_t valid = std::clamp<int64_t>(hr.ql - i0, 0, nrows);
  int64_t ja, jhi, nkp;
  BlockKeys(hr, i0, valid, &ja, &jhi, &nkp);
  const int64_t computed = nkp > 0 ? valid : 0;
  for (int64_t r = computed; r < nrows; ++r) WriteEmptyRow(hr, o, i0 + r);
  if (computed == 0) return;

  const float* kt = kv;
  const float* v_rows = kv + l.skvp * d;
  FloatBuffer qrows(valid * d), s(valid * nkp), orows(valid * dvp), drop(nkp);
  for (int64_t r = 0; r < valid; ++r) {
    ToFloat(p.elem, p.q, ((b * p.q_len + i0 + r) * p.q_heads + h) * d, d, qrows.get() + r * d);
  }
  PGemm(valid, d, qrows.get(), d, 1, kt + ja, l.skvp, nkp / kLanes, s.get(), nkp, false);
  for (int64_t r = 0; r < valid; ++r) {
    const int64_t i = i0 + r;
    float* sr = s.get() + r * nkp;
    const float m = FinishLogits(hr, i, ja, nkp, sr);
    const float lse = SoftmaxRow(hr, m, nkp, sr);
    const int64_t stat = (b * p.q_heads + h) * p.q_len + i;
    o.lse[stat] = lse;
    o.max[stat] = m;
    if (o.probs != nullptr) WriteProbsRow(hr, o.probs, i, ja, nkp, sr);
    if (hr.dropout() && m != -kInfP) {
      const int64_t lo = hr.Lo(i), hi = hr.Hi(i);
      hr.DropRow(i, lo, hi, drop.get());
      for (int64_t j = lo; j < hi; ++j) sr[j - ja] *= drop.get()[j - lo];
    }
  }
  PGemm(valid, nkp, s.get(), nkp, 1, v_rows + ja * dvp, dvp, dvp / kLanes, orows.get(), dvp,
        false);
  for (int64_t r = 0; r < valid; ++r) {
    FromFloat(p.elem, o.out, ((b * p.q_len + i0 + r) * p.q_heads + h) * dv, dv,
              orows.get() + r * dvp);
  }
}

inline void ProbsForward(const FlashParams& p, const ProbsForwardOutputs& o,
                         ffi::ThreadPool* pool) {
  if (p.batch == 0 || p.q_len == 0 || p.q_heads == 0) return;
  const KvLayout l(p);
  const int64_t nqb = CeilDiv(p.q_len, kRows);
  const int64_t chunk = PackChunk(p.kv_heads * l.size(), p.batch);
  FloatBuffer packed(chunk * p.kv_heads * l.size());
  for (int64_t b0 = 0; b0 < p.batch; b0 += chunk) {
    const int64_t nb = std::min(chunk, p.batch - b0);
    ParallelFor(pool, nb * p.kv_heads, [&](int64_t t) {
      PackKvShared(p, b0 + t / p.kv_heads, t % p.kv_heads, l, packed.get() + t * l.size());
    });
    ParallelFor(pool, nb * p.q_heads * nqb, [&](int64_t t) {
      const int64_t bl = t / (p.q_heads * nqb), h = (t / nqb) % p.q_heads;
      const float* kv = packed.get() + (bl * p.kv_heads + h / p.group()) * l.size();
      ProbsForwardBlock(p, o, l, kv, b0 + bl, h, t % nqb);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

// Reads row i of P (or of its cotangent) over [ja, ja + nkp) into dst (zero beyond Skv).
inline void ReadProbsRow(const HeadRows& hr, const void* src, int64_t i, int64_t ja, int64_t nkp,
                         float* dst) {
  const FlashParams& p = *hr.p;
  const int64_t n = std::clamp<int64_t>(p.kv_len - ja, 0, nkp);
  ToFloat(p.elem, src, static_cast<int64_t>(hr.RowBase(i)) + ja, n, dst);
  std::fill(dst + n, dst + nkp, 0.0f);
}

// K rows, V^T and (with a softcap) K^T of one (batch, kv head) for the backward, float32,
// packed once and shared by the query blocks and heads of the group: k_rows [Skvp][Dp],
// vt [Dv][Skvp], kt [D][Skvp]; zero at or beyond kv_seqlens.
struct KvBwdLayout {
  int64_t skvp, d, dp, dv;
  bool softcap;
  explicit KvBwdLayout(const FlashParams& p)
      : skvp(RoundUp(p.kv_len, kLanes)),
        d(p.head_dim),
        dp(RoundUp(p.head_dim, kLanes)),
        dv(p.v_dim),
        softcap(p.softcap > 0.0f) {}
  int64_t size() const { return skvp * (dp + dv + (softcap ? d : 0)); }
};

inline void PackKvBwd(const FlashParams& p, int64_t b, int64_t hkv, const KvBwdLayout& l,
                      float* base) {
  const int64_t d = p.head_dim, dv = p.v_dim;
  const int64_t kl = std::clamp<int64_t>(p.kv_seqlens[b], 0, p.kv_len);
  float* k_rows = base;
  float* vt = base + l.skvp * l.dp;
  float* kt = vt + l.skvp * dv;
  std::vector<float> row(std::max(d, dv) + 1);
  for (int64_t j = 0; j < l.skvp; ++j) {
    float* kr = k_rows + j * l.dp;
    if (j < kl) {
      const int64_t token = (b * p.kv_len + j) * p.kv_heads + hkv;
      ToFloat(p.elem, p.k, token * d, d, kr);
      std::fill(kr + d, kr + l.dp, 0.0f);
      if (l.softcap) {
        for (int64_t x = 0; x < d; ++x) kt[x * l.skvp + j] = kr[x];
      }
      ToFloat(p.elem, p.v, token * dv, dv, row.data());
      for (int64_t x = 0; x < dv; ++x) vt[x * l.skvp + j] = row[x];
    } else {
      std::fill(kr, kr + l.dp, 0.0f);
      if (l.softcap) {
        for (int64_t x = 0; x < d; ++x) kt[x * l.skvp + j] = 0.0f;
      }
      for (int64_t x = 0; x < dv; ++x) vt[x * l.skvp + j] = 0.0f;
    }
  }
}

// Pass A for (b, h, query block ib): dR rows into dr_all ([B, Hq, Sq, Skv] float32), dbias rows,
// dq rows.
inline void ProbsBackwardRows(const FlashParams& p, const ProbsBackwardInputs& in,
                              const BackwardOutputs& o, const KvBwdLayout& l, const float* kv,
                              float* dr_all, int64_t b, int64_t h, int64_t ib) {
  const HeadRows hr(p, b, h);
  const int64_t d = p.head_dim, dv = p.v_dim, dp = l.dp, skv = p.kv_len;
  const int64_t i0 = ib * kRows, nrows = std::min(kRows, p.q_len - i0);
  const int64_t valid = std::clamp<int64_t>(hr.ql - i0, 0, nrows);
  int64_t ja, jhi, nkp;
  BlockKeys(hr, i0, valid, &ja, &jhi, &nkp);
  const int64_t computed = nkp > 0 ? valid : 0;
  for (int64_t r = computed; r < nrows; ++r) {
    const int64_t i = i0 + r;
    const int64_t row = static_cast<int64_t>(hr.RowBase(i));
    std::fill(dr_all + row, dr_all + row + skv, 0.0f);
    if (o.dbias != nullptr) std::fill(o.dbias + row, o.dbias + row + skv, 0.0f);
    FillZero(p.elem, o.dq, ((b * p.q_len + i) * p.q_heads + h) * d, d);
  }
  if (computed == 0) return;

  const float* k_rows = kv;
  const float* vt = kv + l.skvp * dp;
  const float* kt = vt + l.skvp * dv;
  FloatBuffer pr(valid * nkp), dpr(valid * nkp), g(nkp), dorows(valid * dv), dq(valid * dp),
      drop(nkp);
  FloatBuffer qrows(l.softcap ? valid * d : 0), st(l.softcap ? valid * nkp : 0);
  for (int64_t r = 0; r < valid; ++r) {
    const int64_t i = i0 + r;
    ReadProbsRow(hr, in.probs, i, ja, nkp, pr.get() + r * nkp);
    ToFloat(p.elem, in.dout, ((b * p.q_len + i) * p.q_heads + h) * dv, dv,
            dorows.get() + r * dv);
  }
  // dP = dO V^T over the keys [ja, ja + nkp) (zero beyond kv_seqlens).
  PGemm(valid, dv, dorows.get(), dv, 1, vt + ja, l.skvp, nkp / kLanes, dpr.get(), nkp, false);
  if (l.softcap) {
    for (int64_t r = 0; r < valid; ++r) {
      ToFloat(p.elem, p.q, ((b * p.q_len + i0 + r) * p.q_heads + h) * d, d,
              qrows.get() + r * d);
    }
    PGemm(valid, d, qrows.get(), d, 1, kt + ja, l.skvp, nkp / kLanes, st.get(), nkp, false);
  }
  const VecF zero = VecF{};
  const VecF scale = Splat(p.scale), inv_cap = Splat(l.softcap ? 1.0f / p.softcap : 0.0f);
  for (int64_t r = 0; r < valid; ++r) {
    const int64_t i = i0 + r;
    const int64_t stat = (b * p.q_heads + h) * p.q_len + i;
    float* prow = pr.get() + r * nkp;
    float* dprow = dpr.get() + r * nkp;  // becomes dR
    if (hr.dropout()) {
      const int64_t j1 = std::min(ja + nkp, skv);
      hr.DropRow(i, ja, j1, drop.get());
      std::fill(drop.get() + (j1 - ja), drop.get() + nkp, 0.0f);
    }
    if (in.dprobs != nullptr) ReadProbsRow(hr, in.dprobs, i, ja, nkp, g.get());
    // dP_total = drop * dP + G, selected where P != 0; Dt = rowsum(P * dP_total) - dlse.
    VecF acc = VecF{};
    for (int64_t c = 0; c < nkp; c += kLanes) {
      const VecF pv = Load(prow + c);
      VecF t = Load(dprow + c);
      if (hr.dropout()) t *= Load(drop.get() + c);
      if (in.dprobs != nullptr) t += Load(g.get() + c);
      t = pv != zero ? t : zero;
      Store(dprow + c, t);
      acc += pv * t;
    }
    const VecF dtv = Splat(HSum(acc) - in.dlse[stat]);
    for (int64_t c = 0; c < nkp; c += kLanes) {
      const VecF pv = Load(prow + c);
      Store(dprow + c, pv != zero ? pv * (Load(dprow + c) - dtv) : zero);
    }
    const int64_t row = static_cast<int64_t>(hr.RowBase(i));
    const int64_t n = std::clamp<int64_t>(skv - ja, 0, nkp);
    if (o.dbias != nullptr) {
      std::fill(o.dbias + row, o.dbias + row + ja, 0.0f);
      std::copy(dprow, dprow + n, o.dbias + row + ja);
      std::fill(o.dbias + row + ja + n, o.dbias + row + skv, 0.0f);
    }
    if (l.softcap) {
      const float* srow = st.get() + r * nkp;
      for (int64_t c = 0; c < nkp; c += kLanes) {
        const VecF t = Tanh(Load(srow + c) * scale * inv_cap);
        const VecF pv = Load(prow + c);
        Store(dprow + c, pv != zero ? Load(dprow + c) * (1.0f - t * t) : zero);
      }
    }
    std::fill(dr_all + row, dr_all + row + ja, 0.0f);
    std::copy(dprow, dprow + n, dr_all + row + ja);
    std::fill(dr_all + row + ja + n, dr_all + row + skv, 0.0f);
  }
  // dQ = dR K.
  PGemm(valid, nkp, dpr.get(), nkp, 1, k_rows + ja * dp, dp, dp / kLanes, dq.get(), dp, false);
  for (int64_t r = 0; r < valid; ++r) {
    float* qrow = dq.get() + r * dp;
    for (int64_t x = 0; x < d; ++x) qrow[x] *= p.scale;
    FromFloat(p.elem, o.dq, ((b * p.q_len + i0 + r) * p.q_heads + h) * d, d, qrow);
  }
}

// Pass B for (b, kv head hkv, key block jb): dk, dv rows [j0, j1).
inline void ProbsBackwardKeys(const FlashParams& p, const ProbsBackwardInputs& in,
                              const BackwardOutputs& o, const float* dr_all, int64_t b,
                              int64_t hkv, int64_t jb) {
  const int64_t d = p.head_dim, dv = p.v_dim, dp = RoundUp(d, kLanes), dvp = RoundUp(dv, kLanes);
  const int64_t skv = p.kv_len, group = p.group();
  const int64_t j0 = jb * kKeys, j1 = std::min(j0 + kKeys, skv), nk = j1 - j0;
  const int64_t nkp = RoundUp(nk, kLanes);
  FloatBuffer dk(nkp * dp), dvb(nkp * dvp), qc(kChunk * dp), doc(kChunk * dvp), drc(kChunk * nkp),
      wc(kChunk * nkp), drop(nkp);
  std::fill(dk.get(), dk.get() + nkp * dp, 0.0f);
  std::fill(dvb.get(), dvb.get() + nkp * dvp, 0.0f);
  int64_t n = 0;
  auto flush = [&]() {
    PGemm(nk, n, drc.get(), 1, nkp, qc.get(), dp, dp / kLanes, dk.get(), dp, true);
    PGemm(nk, n, wc.get(), 1, nkp, doc.get(), dvp, dvp / kLanes, dvb.get(), dvp, true);
    n = 0;
  };
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hkv * group + g;
    const HeadRows hr(p, b, h);
    for (int64_t i = 0; i < hr.ql; ++i) {
      if (hr.Lo(i) >= j1 || hr.Hi(i) <= j0) continue;
      float* w = wc.get() + n * nkp;
      ReadProbsRow(hr, in.probs, i, j0, nkp, w);
      bool any = false;
      for (int64_t c = 0; c < nk; ++c) any |= w[c] != 0.0f;
      if (!any) continue;
      if (hr.dropout()) {
        hr.DropRow(i, j0, j1, drop.get());
        for (int64_t c = 0; c < nk; ++c) w[c] *= drop.get()[c];
      }
      const int64_t row = static_cast<int64_t>(hr.RowBase(i));
      float* dr = drc.get() + n * nkp;
      std::copy(dr_all + row + j0, dr_all + row + j1, dr);
      std::fill(dr + nk, dr + nkp, 0.0f);
      const int64_t token = (b * p.q_len + i) * p.q_heads + h;
      float* qr = qc.get() + n * dp;
      ToFloat(p.elem, p.q, token * d, d, qr);
      std::fill(qr + d, qr + dp, 0.0f);
      float* dor = doc.get() + n * dvp;
      ToFloat(p.elem, in.dout, token * dv, dv, dor);
      std::fill(dor + dv, dor + dvp, 0.0f);
      if (++n == kChunk) flush();
    }
  }
  if (n > 0) flush();
  for (int64_t c = 0; c < nk; ++c) {
    const int64_t token = (b * skv + j0 + c) * p.kv_heads + hkv;
    float* kr = dk.get() + c * dp;
    for (int64_t x = 0; x < d; ++x) kr[x] *= p.scale;
    FromFloat(p.elem, o.dk, token * d, d, kr);
    FromFloat(p.elem, o.dv, token * dv, dv, dvb.get() + c * dvp);
  }
}

inline void ProbsBackward(const FlashParams& p, const ProbsBackwardInputs& in,
                          const BackwardOutputs& o, ffi::ThreadPool* pool) {
  if (p.batch == 0) return;
  if (p.q_heads == 0) return;
  const int64_t nqb = CeilDiv(p.q_len, kRows);
  const int64_t nkb = CeilDiv(p.kv_len, kKeys);
  FloatBuffer dr_all(p.batch * p.q_heads * p.q_len * p.kv_len);
  const KvBwdLayout l(p);
  const int64_t chunk = PackChunk(p.kv_heads * l.size(), p.batch);
  FloatBuffer packed(chunk * p.kv_heads * l.size());
  for (int64_t b0 = 0; b0 < p.batch; b0 += chunk) {
    const int64_t nb = std::min(chunk, p.batch - b0);
    ParallelFor(pool, nb * p.kv_heads, [&](int64_t t) {
      PackKvBwd(p, b0 + t / p.kv_heads, t % p.kv_heads, l, packed.get() + t * l.size());
    });
    ParallelFor(pool, nb * p.q_heads * nqb, [&](int64_t t) {
      const int64_t bl = t / (p.q_heads * nqb), h = (t / nqb) % p.q_heads;
      const float* kv = packed.get() + (bl * p.kv_heads + h / p.group()) * l.size();
      ProbsBackwardRows(p, in, o, l, kv, dr_all.get(), b0 + bl, h, t % nqb);
    });
  }
  ParallelFor(pool, p.batch * p.kv_heads * nkb, [&](int64_t t) {
    ProbsBackwardKeys(p, in, o, dr_all.get(), t / (p.kv_heads * nkb), (t / nkb) % p.kv_heads,
                      t % nkb);
  });
}

}  // namespace attnaux::cpu::pk

#endif  // ATTNAUX_CSRC_PROBS_CPU_H_
