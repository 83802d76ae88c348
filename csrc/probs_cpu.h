// The `probs` attention primitive on CPU: a fused forward that also writes the probabilities P
// (before dropout), and a backward that reads P instead of recomputing it. Semantics:
// docs/kernel_abi.md (section "The probability-saving primitives").
//
// Forward: one task per (batch, query head, block of kRows query rows). The scores of the block
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
// invisible). Returns lse.
inline float SoftmaxRow(const HeadRows& hr, float m, int64_t nkp, float* s) {
  const VecF m_use = Splat(m == -kInfP ? 0.0f : m);
  VecF acc = VecF{};
  for (int64_t c = 0; c < nkp; c += kLanes) acc += Exp(Load(s + c) - m_use);
  const float lse = RowLse(hr, m, HSum(acc));
  if (lse == -kInfP || m == -kInfP) {
    std::fill(s, s + nkp, 0.0f);
  } else {
    const VecF l = Splat(lse);
    for (int64_t c = 0; c < nkp; c += kLanes) Store(s + c, Exp(Load(s + c) - l));
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

// Packs K^T of keys [ja, ja + nkp) as [d][nkp] (zero beyond jhi, which is <= kl).
inline void PackKt(const FlashParams& p, int64_t b, int64_t hkv, int64_t ja, int64_t jhi,
                   int64_t nkp, float* row, float* kt) {
  const int64_t d = p.head_dim;
  for (int64_t c = 0; c < nkp; ++c) {
    const int64_t j = ja + c;
    if (j < jhi) {
      ToFloat(p.elem, p.k, ((b * p.kv_len + j) * p.kv_heads + hkv) * d, d, row);
      for (int64_t x = 0; x < d; ++x) kt[x * nkp + c] = row[x];
    } else {
      for (int64_t x = 0; x < d; ++x) kt[x * nkp + c] = 0.0f;
    }
  }
}

// Packs rows of K or V (`src`, last dim n, padded to np) for the keys [ja, ja + nkp) whose
// column is used; zeros elsewhere.
inline void PackRows(const FlashParams& p, const void* src, int64_t n, int64_t np, int64_t b,
                     int64_t hkv, int64_t ja, int64_t nkp, const char* used, float* dst) {
  for (int64_t c = 0; c < nkp; ++c) {
    float* r = dst + c * np;
    if (used[c]) {
      ToFloat(p.elem, src, ((b * p.kv_len + ja + c) * p.kv_heads + hkv) * n, n, r);
      std::fill(r + n, r + np, 0.0f);
    } else {
      std::fill(r, r + np, 0.0f);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
inline void ProbsForwardBlock(const FlashParams& p, const ProbsForwardOutputs& o, int64_t b,
                              int64_t h, int64_t ib) {
  const HeadRows hr(p, b, h);
  const int64_t d = p.head_dim, dv = p.v_dim, dvp = RoundUp(dv, kLanes);
  const int64_t hkv = h / p.group();
  const int64_t i0 = ib * kRows, nrows = std::min(kRows, p.q_len - i0);
  const int64_t valid = std::clamp<int64_t>(hr.ql - i0, 0, nrows);
  int64_t ja, jhi, nkp;
  BlockKeys(hr, i0, valid, &ja, &jhi, &nkp);
  const int64_t computed = nkp > 0 ? valid : 0;
  for (int64_t r = computed; r < nrows; ++r) WriteEmptyRow(hr, o, i0 + r);
  if (computed == 0) return;

  FloatBuffer qrows(valid * d), kt(d * nkp), s(valid * nkp), vrows(nkp * dvp), orows(valid * dvp),
      tmp(std::max(d, dv) + kLanes), drop(nkp);
  std::vector<char> used(nkp, 0);
  for (int64_t r = 0; r < valid; ++r) {
    ToFloat(p.elem, p.q, ((b * p.q_len + i0 + r) * p.q_heads + h) * d, d, qrows.get() + r * d);
  }
  PackKt(p, b, hkv, ja, jhi, nkp, tmp.get(), kt.get());
  PGemm(valid, d, qrows.get(), d, 1, kt.get(), nkp, nkp / kLanes, s.get(), nkp, false);
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
    for (int64_t c = 0; c < nkp; ++c) used[c] |= sr[c] != 0.0f;
  }
  PackRows(p, p.v, dv, dvp, b, hkv, ja, nkp, used.data(),
           vrows.get());
  PGemm(valid, nkp, s.get(), nkp, 1, vrows.get(), dvp, dvp / kLanes, orows.get(), dvp, false);
  for (int64_t r = 0; r < valid; ++r) {
    FromFloat(p.elem, o.out, ((b * p.q_len + i0 + r) * p.q_heads + h) * dv, dv,
              orows.get() + r * dvp);
  }
}

inline void ProbsForward(const FlashParams& p, const ProbsForwardOutputs& o,
                         ffi::ThreadPool* pool) {
  if (p.batch == 0 || p.q_len == 0 || p.q_heads == 0) return;
  const int64_t nqb = CeilDiv(p.q_len, kRows);
  ParallelFor(pool, p.batch * p.q_heads * nqb, [&](int64_t t) {
    ProbsForwardBlock(p, o, t / (p.q_heads * nqb), (t / nqb) % p.q_heads, t % nqb);
  });
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

// Pass A for (b, h, query block ib): dR rows into dr_all ([B, Hq, Sq, Skv] float32), dbias rows,
// dq rows.
inline void ProbsBackwardRows(const FlashParams& p, const ProbsBackwardInputs& in,
                              const BackwardOutputs& o, float* dr_all, int64_t b, int64_t h,
                              int64_t ib) {
  const HeadRows hr(p, b, h);
  const int64_t d = p.head_dim, dv = p.v_dim, dp = RoundUp(d, kLanes), skv = p.kv_len;
  const int64_t hkv = h / p.group();
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

  FloatBuffer pr(valid * nkp), dpr(valid * nkp), g(nkp), dorows(valid * dv), vt(dv * nkp),
      krows(nkp * dp), dq(valid * dp), tmp(std::max(d, dv) + kLanes), drop(nkp);
  FloatBuffer qrows(p.softcap > 0.0f ? valid * d : 0), kt(p.softcap > 0.0f ? d * nkp : 0),
      st(p.softcap > 0.0f ? valid * nkp : 0);
  std::vector<char> used(nkp, 0);
  for (int64_t r = 0; r < valid; ++r) {
    const int64_t i = i0 + r;
    ReadProbsRow(hr, in.probs, i, ja, nkp, pr.get() + r * nkp);
    ToFloat(p.elem, in.dout, ((b * p.q_len + i) * p.q_heads + h) * dv, dv,
            dorows.get() + r * dv);
    for (int64_t c = 0; c < nkp; ++c) used[c] |= pr.get()[r * nkp + c] != 0.0f;
  }
  // dP = dO V^T over the keys [ja, jhi); NaN in other keys' columns is selected away below.
  for (int64_t c = 0; c < nkp; ++c) {
    const int64_t j = ja + c;
    if (j < jhi) {
      ToFloat(p.elem, p.v, ((b * skv + j) * p.kv_heads + hkv) * dv, dv, tmp.get());
      for (int64_t x = 0; x < dv; ++x) vt.get()[x * nkp + c] = tmp.get()[x];
    } else {
      for (int64_t x = 0; x < dv; ++x) vt.get()[x * nkp + c] = 0.0f;
    }
  }
  PGemm(valid, dv, dorows.get(), dv, 1, vt.get(), nkp, nkp / kLanes, dpr.get(), nkp, false);
  if (p.softcap > 0.0f) {
    for (int64_t r = 0; r < valid; ++r) {
      ToFloat(p.elem, p.q, ((b * p.q_len + i0 + r) * p.q_heads + h) * d, d,
              qrows.get() + r * d);
    }
    PackKt(p, b, hkv, ja, jhi, nkp, tmp.get(), kt.get());
    PGemm(valid, d, qrows.get(), d, 1, kt.get(), nkp, nkp / kLanes, st.get(), nkp, false);
  }
  const VecF zero = VecF{};
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
    if (in.dprobs != nullptr) {
      ReadProbsRow(hr, in.dprobs, i, ja, nkp, g.get());
    }
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
    const float dt = HSum(acc) - in.dlse[stat];
    const VecF dtv = Splat(dt);
    const VecF scale = Splat(p.scale), inv_cap = Splat(p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f);
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
    if (p.softcap > 0.0f) {
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
  // dQ = dR K over the keys some row of the block sees.
  PackRows(p, p.k, d, dp, b, hkv, ja, nkp, used.data(),
           krows.get());
  PGemm(valid, nkp, dpr.get(), nkp, 1, krows.get(), dp, dp / kLanes, dq.get(), dp, false);
  for (int64_t r = 0; r < valid; ++r) {
    float* row = dq.get() + r * dp;
    for (int64_t x = 0; x < d; ++x) row[x] *= p.scale;
    FromFloat(p.elem, o.dq, ((b * p.q_len + i0 + r) * p.q_heads + h) * d, d, row);
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
  ParallelFor(pool, p.batch * p.q_heads * nqb, [&](int64_t t) {
    ProbsBackwardRows(p, in, o, dr_all.get(), t / (p.q_heads * nqb), (t / nqb) % p.q_heads,
                      t % nqb);
  });
  ParallelFor(pool, p.batch * p.kv_heads * nkb, [&](int64_t t) {
    ProbsBackwardKeys(p, in, o, dr_all.get(), t / (p.kv_heads * nkb), (t / nkb) % p.kv_heads,
                      t % nkb);
  });
}

}  // namespace attnaux::cpu::pk

#endif  // ATTNAUX_CSRC_PROBS_CPU_H_
