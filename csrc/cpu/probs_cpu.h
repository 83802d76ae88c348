// The `probs` attention primitive on CPU: a fused forward that also writes the probabilities P
// (before dropout), and a backward that reads P instead of recomputing it. Semantics:
// docs/kernel_abi.md (section "The probability-saving primitives").
//
// Built from the flash kernels' tiles (attention_cpu.h): a block of kBlockQ query rows lives in
// the vector lanes, key tiles of kBlockK keys, K/V packed once per (batch, kv head), and the same
// register-blocked products, masks and dropout counters. What differs:
// - Forward without P to write (inference): the flash forward itself, which computes exactly
//   out, lse and max.
// - Forward with P: per query block, pass 1 computes every visible score tile, keeps
//   e = exp(s - m_t) (m_t: the running row max when tile t was reached, as in the online
//   softmax) in an L2-sized [keys x kBlockQ] buffer and finds lse; pass 2 turns each tile into
//   P = e * exp(m_t - lse) (one multiply per element, no second exponential), writes it to the
//   row-major output and accumulates O^T += V^T (P * drop)^T, already normalised.
// - Backward: the flash backward's four products (dP = dO V^T, dV += (P * drop)^T dO,
//   dK += dS^T Q, dQ += dS K) without its fifth (recomputing S = Q K^T) and the exponentials:
//   P tiles are read from the saved P. Dt = rowsum(P * dPt) - dlse needs a whole row of dP, so
//   per query block pass 1 computes and keeps the dP tiles and Dt, pass 2 forms dS and the
//   three gradient products. A task owns dK/dV of one (batch, kv head) (or a fixed share of its
//   query blocks, summed in order afterwards, when there are few of them), so every output is
//   reduced in a fixed order and results do not depend on the number of threads.
// Both visit the flash kernels' tiles (TileKeys with the segment ids): with packed sequences,
// causal masks, windows or lengths, a (query block, key tile) pair with no visible pair costs
// nothing but writing its zeros into P (and dbias). Inputs are read only where visible, as in the
// flash kernels.
#ifndef ATTNAUX_CSRC_CPU_PROBS_CPU_H_
#define ATTNAUX_CSRC_CPU_PROBS_CPU_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/attention_cpu.h"
#include "cpu/cpu_gemm.h"
#include "cpu/cpu_parallel.h"
#include "cpu/cpu_simd.h"
#include "cpu/probs_common.h"

namespace attnaux::cpu::pk {

// ---------------------------------------------------------------------------------------------
// Tiles of P (keys x query lanes) <-> rows of a row-major [.., Sq, Skv] array
// ---------------------------------------------------------------------------------------------

// Writes tile rows r < nk (keys j0 + r) of lanes [0, valid) (query rows) into the row-major
// array `dst` whose row of lane 0 starts at element `row0` (rows `skv` elements apart). Float32
// goes through 16 x 16 register transposes, stored non-temporally where aligned (P and dbias
// are large and not read again by this pass).
inline void StoreTileRows(Elem elem, void* dst, int64_t row0, int64_t skv, int64_t valid,
                          int64_t j0, int64_t nk, const float* tile) {
  int64_t lanes16 = 0, keys16 = 0;
  if (kHasTranspose16 && elem == Elem::kF32) {
    float* base = static_cast<float*>(dst) + row0 + j0;
    const bool stream = StreamAligned(base) && skv % 16 == 0;
    lanes16 = valid / 16 * 16;
    keys16 = nk / 16 * 16;
    for (int64_t l0 = 0; l0 < lanes16; l0 += 16) {
      for (int64_t r0 = 0; r0 < keys16; r0 += 16) {
        Transpose16(tile + r0 * kBlockQ + l0, kBlockQ, base + l0 * skv + r0, skv, stream);
      }
    }
  }
  // The rest (other dtypes, ragged edges) one row at a time.
  alignas(64) float row[kBlockK];
  for (int64_t lane = 0; lane < valid; ++lane) {
    const int64_t r_begin = lane < lanes16 ? keys16 : 0;
    if (r_begin >= nk) continue;
    for (int64_t r = r_begin; r < nk; ++r) row[r - r_begin] = tile[r * kBlockQ + lane];
    FromFloat(elem, dst, row0 + lane * skv + j0 + r_begin, nk - r_begin, row);
  }
}

// The transpose of StoreTileRows: tile[r * kBlockQ + lane] = src(row lane, key j0 + r), zero for
// lanes >= valid.
inline void LoadTileRows(Elem elem, const void* src, int64_t row0, int64_t skv, int64_t valid,
                         int64_t j0, int64_t nk, float* tile) {
  int64_t lanes16 = 0, keys16 = 0;
  if (kHasTranspose16 && elem == Elem::kF32) {
    const float* base = static_cast<const float*>(src) + row0 + j0;
    lanes16 = valid / 16 * 16;
    keys16 = nk / 16 * 16;
    for (int64_t l0 = 0; l0 < lanes16; l0 += 16) {
      for (int64_t r0 = 0; r0 < keys16; r0 += 16) {
        Transpose16(base + l0 * skv + r0, skv, tile + r0 * kBlockQ + l0, kBlockQ, false);
      }
    }
  }
  alignas(64) float row[kBlockK];
  for (int64_t lane = 0; lane < kBlockQ; ++lane) {
    const int64_t r_begin = lane < lanes16 ? keys16 : 0;
    if (r_begin >= nk) continue;
    if (lane < valid) {
      ToFloat(elem, src, row0 + lane * skv + j0 + r_begin, nk - r_begin, row);
    } else {
      std::fill(row, row + nk - r_begin, 0.0f);
    }
    for (int64_t r = r_begin; r < nk; ++r) tile[r * kBlockQ + lane] = row[r - r_begin];
  }
}

// Prefetches rows [0, valid) x keys [j0, j0 + nk) of a row-major float32 array (the next tile).
inline void PrefetchTileRows(const void* src, int64_t row0, int64_t skv, int64_t valid,
                             int64_t j0, int64_t nk, int64_t size) {
  const char* base = static_cast<const char*>(src) + (row0 + j0) * size;
  for (int64_t lane = 0; lane < valid; ++lane) {
    const char* row = base + lane * skv * size;
    for (int64_t x = 0; x < nk * size; x += 64) __builtin_prefetch(row + x, 0, 3);
  }
}

// dst[c * ds + r] = src[r * ss + c] for r < rows, c < cols: whole 16 x 16 blocks in registers,
// the ragged edges one element at a time.
inline void TransposeBlock(const float* src, int64_t ss, int64_t rows, int64_t cols, float* dst,
                           int64_t ds) {
  const int64_t rows16 = kHasTranspose16 ? rows / 16 * 16 : 0;
  const int64_t cols16 = kHasTranspose16 ? cols / 16 * 16 : 0;
  for (int64_t r0 = 0; r0 < rows16; r0 += 16) {
    for (int64_t c0 = 0; c0 < cols16; c0 += 16) {
      Transpose16(src + r0 * ss + c0, ss, dst + c0 * ds + r0, ds, false);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = r < rows16 ? cols16 : 0; c < cols; ++c) dst[c * ds + r] = src[r * ss + c];
  }
}

// Rows r < count of an input whose row r starts at element first + r * stride, as float32 rows
// `pitch` floats apart: rows < valid converted (zero-padded from n to pitch), the others zero.
// The rows are scattered (one token's head among all heads): the next ones are prefetched.
inline void GatherRows(Elem elem, const void* src, int64_t first, int64_t stride, int64_t valid,
                       int64_t count, int64_t n, float* dst, int64_t pitch) {
  constexpr int64_t kAhead = 8;
  const int64_t size = elem == Elem::kF32 ? 4 : 2;
  const char* bytes = static_cast<const char*>(src);
  for (int64_t r = 0; r < std::min(kAhead, valid); ++r) {
    PrefetchBytes(bytes + (first + r * stride) * size, n * size);
  }
  for (int64_t r = 0; r < count; ++r) {
    float* row = dst + r * pitch;
    if (r < valid) {
      if (r + kAhead < valid) PrefetchBytes(bytes + (first + (r + kAhead) * stride) * size, n * size);
      LoadRow(elem, src, first + r * stride, n, row);
      std::fill(row + n, row + pitch, 0.0f);
    } else {
      std::fill(row, row + pitch, 0.0f);
    }
  }
}

// K and V of one (batch, kv head), packed for the products (the layouts of attention_cpu.h's
// KvPack, float32, zero at or beyond kv_seqlens): forward kt [nkb][D][BK] and v_rows [Skvp][Dv];
// backward k_rows [Skvp][D], vt [nkb][Dv][BK] and, with a softcap, kt.
struct ProbsKvLayout {
  int64_t keys, d, dv;
  bool forward, kt;
  ProbsKvLayout(const AttentionParams& p, bool fwd)
      : keys(CeilDiv(p.kv_len, kBlockK) * kBlockK),
        d(p.head_dim),
        dv(p.v_dim),
        forward(fwd),
        kt(fwd || p.softcap > 0.0f) {}
  int64_t size() const { return keys * (d + dv) + (!forward && kt ? keys * d : 0); }
  KvPack At(float* base) const {
    KvPack pack{};
    if (forward) {
      pack.kt = base;
      pack.v_rows = base + keys * d;
    } else {
      pack.k_rows = base;
      pack.vt = base + keys * d;
      pack.kt = kt ? base + keys * (d + dv) : nullptr;
    }
    return pack;
  }
};

inline void PackProbsKv(const AttentionParams& p, int64_t b, int64_t hkv, const ProbsKvLayout& l,
                        float* base) {
  const int64_t d = p.head_dim, dv = p.v_dim, stride_k = p.kv_heads * d, stride_v = p.kv_heads * dv;
  const int64_t kl = std::clamp<int64_t>(p.kv_seqlens[b], 0, p.kv_len);
  const KvPack pack = l.At(base);
  FloatBuffer rows(kBlockK * std::max(d, dv));
  for (int64_t j0 = 0; j0 < l.keys; j0 += kBlockK) {
    const int64_t valid = std::clamp<int64_t>(kl - j0, 0, kBlockK);
    const int64_t k_first = ((b * p.kv_len + j0) * p.kv_heads + hkv) * d;
    const int64_t v_first = ((b * p.kv_len + j0) * p.kv_heads + hkv) * dv;
    if (l.forward) {
      GatherRows(p.elem, p.k, k_first, stride_k, valid, kBlockK, d, rows.get(), d);
      TransposeBlock(rows.get(), d, kBlockK, d, const_cast<float*>(pack.kt) + j0 * d, kBlockK);
      GatherRows(p.elem, p.v, v_first, stride_v, valid, kBlockK, dv,
                 const_cast<float*>(pack.v_rows) + j0 * dv, dv);
    } else {
      float* k_rows = const_cast<float*>(pack.k_rows) + j0 * d;
      GatherRows(p.elem, p.k, k_first, stride_k, valid, kBlockK, d, k_rows, d);
      if (l.kt) TransposeBlock(k_rows, d, kBlockK, d, const_cast<float*>(pack.kt) + j0 * d, kBlockK);
      GatherRows(p.elem, p.v, v_first, stride_v, valid, kBlockK, dv, rows.get(), dv);
      TransposeBlock(rows.get(), dv, kBlockK, dv, const_cast<float*>(pack.vt) + j0 * dv, kBlockK);
    }
  }
}

// Zeroes the entries of a query block's rows of a [.., Sq, Skv] output (P, dbias) that no tile
// writes: the keys between and around the visited tiles of rows [0, valid) (no visible pair
// there, so the value is exactly 0), and whole rows [valid, rows). Tiles are visited in key
// order: Tile(j0, j1) before writing keys [j0, j1), Finish() after the last one. With unsorted
// segment ids a skipped tile can sit between two visited ones, hence gaps and not only edges.
class UnvisitedKeys {
 public:
  UnvisitedKeys(Elem elem, void* dst, int64_t row0, int64_t skv, int64_t valid, int64_t rows)
      : elem_(elem), dst_(dst), row0_(row0), skv_(skv), valid_(valid), rows_(rows) {}
  void Tile(int64_t j0, int64_t j1) {
    Zero(next_, j0);
    next_ = j1;
  }
  void Finish() {
    if (dst_ == nullptr) return;
    Zero(next_, skv_);
    for (int64_t lane = valid_; lane < rows_; ++lane) {
      FillZero(elem_, dst_, row0_ + lane * skv_, skv_);
    }
  }

 private:
  void Zero(int64_t j_begin, int64_t j_end) const {
    if (dst_ == nullptr || j_begin >= j_end) return;
    for (int64_t lane = 0; lane < valid_; ++lane) {
      FillZero(elem_, dst_, row0_ + lane * skv_ + j_begin, j_end - j_begin);
    }
  }
  Elem elem_;
  void* dst_;
  int64_t row0_, skv_, valid_, rows_;
  int64_t next_ = 0;
};

// Element index of (b, h, i, 0) in a [B, Hq, Sq, Skv] array.
inline int64_t ProbsRow(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  return ((b * p.q_heads + h) * p.q_len + i) * p.kv_len;
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

struct ProbsForwardScratch {
  FloatBuffer scores;     // [Skvp][BQ]: e = exp(s - m_t), then P
  FloatBuffer tile_m;     // [nkb][BQ]: m_t of every tile
  FloatBuffer weights;    // [BK][BQ]: P * drop of one tile
  FloatBuffer drop;       // [BK][BQ]
  FloatBuffer qt, ot;     // [D][BQ], [Dv][BQ]
  FloatBuffer rows;       // [BQ][max(D, Dv)]: q rows in, out rows out
  explicit ProbsForwardScratch(const AttentionParams& p)
      : scores(CeilDiv(p.kv_len, kBlockK) * kBlockK * kBlockQ),
        tile_m(CeilDiv(p.kv_len, kBlockK) * kBlockQ),
        weights(p.rng_state != nullptr ? kBlockK * kBlockQ : 1),
        drop(p.rng_state != nullptr ? kBlockK * kBlockQ : 1),
        qt(p.head_dim * kBlockQ),
        ot(p.v_dim * kBlockQ),
        rows(kBlockQ * std::max(p.head_dim, p.v_dim)) {}
};

// lse of each lane from its max m and sum l = sum exp(s - m) (flash's final statistics), and
// how P is normalised: P = e * exp(m_t - shift) * scale, dividing by the row sum (see
// RowStatistics in probs_common.h); shift = +inf and scale = 0 where the row has no visible
// key or is padding, so that P = 0 there.
inline void BlockLse(const HeadView& hv, int64_t valid, const float* m_row, const float* l_row,
                     float* lse, float* shift, float* scale) {
  for (int64_t lane = 0; lane < kBlockQ; ++lane) {
    const float mx = m_row[lane], sum = l_row[lane];
    float value = hv.has_sink ? hv.sink : -kInf;
    shift[lane] = kInf;
    scale[lane] = 0.0f;
    if (lane < valid) {
      if (hv.has_sink) {
        const float big = std::max(mx, hv.sink);
        const float scaled = mx == -kInf ? 0.0f : sum * std::exp(mx - big);
        const float total = scaled + std::exp(hv.sink - big);
        value = big + std::log(total);
        if (mx != -kInf) {
          shift[lane] = big;
          scale[lane] = 1.0f / total;
        }
      } else if (mx != -kInf && sum > 0.0f) {
        value = mx + std::log(sum);
        shift[lane] = mx;
        scale[lane] = 1.0f / sum;
      }
    }
    lse[lane] = value;
  }
}

inline void ProbsForwardBlock(const AttentionParams& p, const KvPack& kv, int64_t b, int64_t h,
                              int64_t ib, const ProbsForwardOutputs& o, ProbsForwardScratch& sc) {
  const int64_t d = p.head_dim, dv = p.v_dim, skv = p.kv_len;
  const HeadView hv(p, b, h);
  const int64_t i0 = ib * kBlockQ;
  const int64_t rows_in_block = std::min(kBlockQ, p.q_len - i0);
  const int64_t valid = std::min(hv.rows.ValidRows(i0), rows_in_block);
  float* qt = sc.qt.get();
  GatherRows(p.elem, p.q, ((b * p.q_len + i0) * p.q_heads + h) * d, p.q_heads * d, valid, kBlockQ,
             d, sc.rows.get(), d);
  TransposeBlock(sc.rows.get(), d, kBlockQ, d, qt, kBlockQ);
  // Pass 1: scores, the online max and sum, e = exp(s - m_t) kept per tile.
  VecF m[kQVectors], l[kQVectors];
  for (int v = 0; v < kQVectors; ++v) {
    m[v] = Splat(-kInf);
    l[v] = VecF{};
  }
  // Tiles (and edge keys) that no row of the block sees are skipped (TileKeys with the segment
  // ids, as in flash): their scores would be -inf, adding exp(-inf) = 0 to the sums and leaving
  // the running max, so skipping them changes no bit of lse, max, P or out.
  const int64_t nkb = CeilDiv(skv, kBlockK);
  for (int64_t jb = 0; jb < nkb; ++jb) {
    int64_t j0, j1;
    TileKeys(hv, i0, valid, jb, &j0, &j1);
    if (j0 >= j1) continue;
    const int64_t nk = j1 - j0;
    float* st = sc.scores.get() + j0 * kBlockQ;
    ScoreTile(hv, i0, valid, j0, j1, kv.kt + jb * kBlockK * d, qt, st, nullptr);
    for (int v = 0; v < kQVectors; ++v) {
      VecF tile_max = Splat(-kInf);
      for (int64_t r = 0; r < nk; ++r) tile_max = Max(tile_max, Load(st + r * kBlockQ + v * kLanes));
      const VecF m_new = Max(m[v], tile_max);
      const VecF m_use = m_new == -kInf ? VecF{} : m_new;  // no visible key yet: exp(-inf) = 0
      VecF sum = VecF{};
      for (int64_t r = 0; r < nk; ++r) {
        float* sp = st + r * kBlockQ + v * kLanes;
        const VecF e = Exp(Load(sp) - m_use);
        sum += e;
        Store(sp, e);
      }
      l[v] = l[v] * Exp(m[v] - m_use) + sum;
      m[v] = m_new;
      Store(sc.tile_m.get() + jb * kBlockQ + v * kLanes, m_use);
    }
  }
  alignas(64) float m_row[kBlockQ], l_row[kBlockQ], lse[kBlockQ], shift[kBlockQ], scale[kBlockQ];
  for (int v = 0; v < kQVectors; ++v) {
    Store(m_row + v * kLanes, m[v]);
    Store(l_row + v * kLanes, l[v]);
  }
  BlockLse(hv, valid, m_row, l_row, lse, shift, scale);
  for (int64_t lane = 0; lane < rows_in_block; ++lane) {
    const int64_t stat = (b * p.q_heads + h) * p.q_len + i0 + lane;
    o.lse[stat] = lse[lane];
    o.max[stat] = lane < valid ? m_row[lane] : -kInf;
  }
  // Pass 2: P = e * exp(m_t - shift) * scale, written out, and O^T += V^T (P * drop)^T.
  float* ot = sc.ot.get();
  std::fill(ot, ot + dv * kBlockQ, 0.0f);
  const int64_t row0 = ProbsRow(p, b, h, i0);
  UnvisitedKeys unvisited(p.elem, o.probs, row0, skv, valid, rows_in_block);
  for (int64_t jb = 0; jb < nkb; ++jb) {
    int64_t j0, j1;
    TileKeys(hv, i0, valid, jb, &j0, &j1);
    if (j0 >= j1) continue;
    unvisited.Tile(j0, j1);
    const int64_t nk = j1 - j0;
    float* st = sc.scores.get() + j0 * kBlockQ;
    for (int v = 0; v < kQVectors; ++v) {
      const VecF factor = Exp(Load(sc.tile_m.get() + jb * kBlockQ + v * kLanes) -
                              Load(shift + v * kLanes)) *
                          Load(scale + v * kLanes);
      for (int64_t r = 0; r < nk; ++r) {
        float* sp = st + r * kBlockQ + v * kLanes;
        Store(sp, Load(sp) * factor);
      }
    }
    if (o.probs != nullptr) StoreTileRows(p.elem, o.probs, row0, skv, valid, j0, nk, st);
    const float* w = st;
    if (hv.dropout()) {
      float* drop = sc.drop.get();
      float* wt = sc.weights.get();
      DropoutTile(hv, i0, valid, j0, j1, drop);
      for (int64_t x = 0; x < nk * kBlockQ; x += kLanes) {
        Store(wt + x, Load(st + x) * Load(drop + x));
      }
      w = wt;
    }
    GemmLanes<1>(dv, nk, kv.v_rows + j0 * dv, dv, w, kBlockQ, kQVectors, ot, kBlockQ, true);
  }
  unvisited.Finish();
  TransposeBlock(ot, kBlockQ, dv, kBlockQ, sc.rows.get(), dv);
  for (int64_t lane = 0; lane < rows_in_block; ++lane) {
    StoreRow(p.elem, o.out, ((b * p.q_len + i0 + lane) * p.q_heads + h) * dv, dv,
             sc.rows.get() + lane * dv);
  }
}

inline void ProbsForward(const AttentionParams& params, const ProbsForwardOutputs& o,
                         ffi::ThreadPool* pool) {
  const TileSegments segment_tiles(params);
  const AttentionParams p = segment_tiles.With(params);
  if (p.batch == 0 || p.q_len == 0 || p.q_heads == 0) return;
  const ProbsKvLayout layout(p, /*fwd=*/true);
  const int64_t chunk = BatchChunk(p.kv_heads * layout.size(), p.batch);
  FloatBuffer packed(chunk * p.kv_heads * layout.size());
  const int64_t nqb = CeilDiv(p.q_len, kBlockQ);
  for (int64_t b0 = 0; b0 < p.batch; b0 += chunk) {
    const int64_t nb = std::min(chunk, p.batch - b0);
    ParallelFor(pool, nb * p.kv_heads, [&](int64_t t) {
      PackProbsKv(p, b0 + t / p.kv_heads, t % p.kv_heads, layout, packed.get() + t * layout.size());
    });
    ParallelFor(pool, nb * p.q_heads * nqb, [&](int64_t t) {
      const int64_t ib = t % nqb, h = (t / nqb) % p.q_heads, bl = t / (nqb * p.q_heads);
      ProbsForwardScratch sc(p);
      const KvPack kv = layout.At(packed.get() + (bl * p.kv_heads + h / p.group()) * layout.size());
      ProbsForwardBlock(p, kv, b0 + bl, h, ib, o, sc);
      StreamFence();
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

struct ProbsBackwardScratch {
  int64_t dp, dvp;
  FloatBuffer probs;    // [Skvp][BQ]: P tiles of the query block
  FloatBuffer dprobs;   // [Skvp][BQ]: dPt = dP * drop + G, then dS, then dR
  FloatBuffer drop;     // [Skvp][BQ] (dropout only)
  FloatBuffer tile;     // [BK][BQ]: G, scores (softcap) or P * drop of one tile
  FloatBuffer tanh;     // [BK][BQ] (softcap only)
  FloatBuffer qt;       // [D][BQ] (softcap only)
  FloatBuffer q_rows;   // [BQ][Dp]
  FloatBuffer dot;      // [Dv][BQ]: dO^T
  FloatBuffer do_rows;  // [BQ][Dvp]
  FloatBuffer dqt;      // [D][BQ]
  explicit ProbsBackwardScratch(const AttentionParams& p)
      : dp(RoundUpLanes(p.head_dim)),
        dvp(RoundUpLanes(p.v_dim)),
        probs(CeilDiv(p.kv_len, kBlockK) * kBlockK * kBlockQ),
        dprobs(CeilDiv(p.kv_len, kBlockK) * kBlockK * kBlockQ),
        drop(p.rng_state != nullptr ? CeilDiv(p.kv_len, kBlockK) * kBlockK * kBlockQ : 1),
        tile(kBlockK * kBlockQ),
        tanh(p.softcap > 0.0f ? kBlockK * kBlockQ : 1),
        qt(p.softcap > 0.0f ? p.head_dim * kBlockQ : 1),
        q_rows(kBlockQ * dp),
        dot(p.v_dim * kBlockQ),
        do_rows(kBlockQ * dvp),
        dqt(p.head_dim * kBlockQ) {}
};

// Packs the query side of one query block (zero beyond the valid rows): q rows, dO rows, dO^T,
// and with a softcap Q^T.
inline void PackQueryBlock(const AttentionParams& p, const ProbsBackwardInputs& in, int64_t b,
                           int64_t h, int64_t i0, int64_t valid, ProbsBackwardScratch& sc) {
  const int64_t d = p.head_dim, dv = p.v_dim;
  const int64_t token = (b * p.q_len + i0) * p.q_heads + h;
  GatherRows(p.elem, p.q, token * d, p.q_heads * d, valid, kBlockQ, d, sc.q_rows.get(), sc.dp);
  GatherRows(p.elem, in.dout, token * dv, p.q_heads * dv, valid, kBlockQ, dv, sc.do_rows.get(),
             sc.dvp);
  TransposeBlock(sc.do_rows.get(), sc.dvp, kBlockQ, dv, sc.dot.get(), kBlockQ);
  if (p.softcap > 0.0f) TransposeBlock(sc.q_rows.get(), sc.dp, kBlockQ, d, sc.qt.get(), kBlockQ);
}

// One query block of query head h: dq rows and dbias rows written, dK/dV of the block's keys
// accumulated into dk_acc [Skvp][Dp] / dv_acc [Skvp][Dvp].
inline void ProbsBackwardBlock(const AttentionParams& p, const ProbsBackwardInputs& in,
                               const BackwardOutputs& o, const KvPack& kv, int64_t b, int64_t h,
                               int64_t ib, float* dk_acc, float* dv_acc,
                               ProbsBackwardScratch& sc) {
  const int64_t d = p.head_dim, dv = p.v_dim, skv = p.kv_len, dp = sc.dp, dvp = sc.dvp;
  const HeadView hv(p, b, h);
  const int64_t i0 = ib * kBlockQ;
  const int64_t rows_in_block = std::min(kBlockQ, p.q_len - i0);
  const int64_t valid = std::min(hv.rows.ValidRows(i0), rows_in_block);
  const int64_t row0 = ProbsRow(p, b, h, i0);
  const int64_t elem_size = p.elem == Elem::kF32 ? 4 : 2;
  PackQueryBlock(p, in, b, h, i0, valid, sc);
  const VecF zero = VecF{};
  // Pass 1: P tiles, dPt = dP * drop + G (where P != 0), and Dt = rowsum(P * dPt) - dlse.
  const int64_t nkb = CeilDiv(skv, kBlockK);
  VecF dt[kQVectors];
  for (int v = 0; v < kQVectors; ++v) dt[v] = VecF{};
  // The tiles of the forward (TileKeys with the segment ids): P is 0 on the others, so their dS
  // and their terms of Dt and of every gradient are exactly 0 and not computed.
  for (int64_t jb = 0; jb < nkb; ++jb) {
    int64_t j0, j1;
    TileKeys(hv, i0, valid, jb, &j0, &j1);
    if (j0 >= j1) continue;
    const int64_t nk = j1 - j0, key_offset = j0 - jb * kBlockK;
    float* pt = sc.probs.get() + j0 * kBlockQ;
    float* dpt = sc.dprobs.get() + j0 * kBlockQ;
    if (jb + 1 < nkb) {  // P rows are 4 * Skv bytes apart: too sparse for the hardware prefetcher
      int64_t n0, n1;
      TileKeys(hv, i0, valid, jb + 1, &n0, &n1);
      if (n0 < n1) PrefetchTileRows(in.probs, row0, skv, valid, n0, n1 - n0, elem_size);
    }
    LoadTileRows(p.elem, in.probs, row0, skv, valid, j0, nk, pt);
    GemmLanes<1>(nk, dv, kv.vt + jb * kBlockK * dv + key_offset, kBlockK, sc.dot.get(), kBlockQ,
                 kQVectors, dpt, kBlockQ, false);
    float* drop = hv.dropout() ? sc.drop.get() + j0 * kBlockQ : nullptr;
    if (drop != nullptr) DropoutTile(hv, i0, valid, j0, j1, drop);
    float* g = nullptr;
    if (in.dprobs != nullptr) {
      g = sc.tile.get();
      LoadTileRows(p.elem, in.dprobs, row0, skv, valid, j0, nk, g);
    }
    for (int64_t r = 0; r < nk; ++r) {
      for (int v = 0; v < kQVectors; ++v) {
        const int64_t x = r * kBlockQ + v * kLanes;
        const VecF pv = Load(pt + x);
        VecF t = Load(dpt + x);
        if (drop != nullptr) t *= Load(drop + x);
        if (g != nullptr) t += Load(g + x);
        t = pv != zero ? t : zero;
        Store(dpt + x, t);
        dt[v] += pv * t;
      }
    }
  }
  alignas(64) float dlse[kBlockQ] = {};
  for (int64_t lane = 0; lane < valid; ++lane) {
    dlse[lane] = in.dlse[(b * p.q_heads + h) * p.q_len + i0 + lane];
  }
  for (int v = 0; v < kQVectors; ++v) dt[v] -= Load(dlse + v * kLanes);
  // Pass 2: dS = P * (dPt - Dt) (= dbias), dR (softcap), and the three gradient products.
  float* dqt = sc.dqt.get();
  std::fill(dqt, dqt + d * kBlockQ, 0.0f);
  UnvisitedKeys unvisited(Elem::kF32, o.dbias, row0, skv, valid, rows_in_block);
  for (int64_t jb = 0; jb < nkb; ++jb) {
    int64_t j0, j1;
    TileKeys(hv, i0, valid, jb, &j0, &j1);
    if (j0 >= j1) continue;
    unvisited.Tile(j0, j1);
    const int64_t nk = j1 - j0, n = nk * kBlockQ;
    const float* pt = sc.probs.get() + j0 * kBlockQ;
    float* ds = sc.dprobs.get() + j0 * kBlockQ;
    for (int64_t r = 0; r < nk; ++r) {
      for (int v = 0; v < kQVectors; ++v) {
        const int64_t x = r * kBlockQ + v * kLanes;
        const VecF pv = Load(pt + x);
        Store(ds + x, pv != zero ? pv * (Load(ds + x) - dt[v]) : zero);
      }
    }
    if (o.dbias != nullptr) StoreTileRows(Elem::kF32, o.dbias, row0, skv, valid, j0, nk, ds);
    if (p.softcap > 0.0f) {
      float* th = sc.tanh.get();
      ScoreTile(hv, i0, valid, j0, j1, kv.kt + jb * kBlockK * d, sc.qt.get(), sc.tile.get(), th);
      for (int64_t x = 0; x < n; x += kLanes) {
        const VecF t = Load(th + x);
        Store(ds + x, Load(ds + x) * (1.0f - t * t));
      }
    }
    const float* w = pt;
    if (hv.dropout()) {
      float* wt = sc.tile.get();
      const float* drop = sc.drop.get() + j0 * kBlockQ;
      for (int64_t x = 0; x < n; x += kLanes) Store(wt + x, Load(pt + x) * Load(drop + x));
      w = wt;
    }
    GemmLanes<kBlockQ>(nk, kBlockQ, w, 1, sc.do_rows.get(), dvp, dvp / kLanes,
                       dv_acc + j0 * dvp, dvp, true);
    GemmLanes<kBlockQ>(nk, kBlockQ, ds, 1, sc.q_rows.get(), dp, dp / kLanes, dk_acc + j0 * dp,
                       dp, true);
    GemmLanes<1>(d, nk, kv.k_rows + j0 * d, d, ds, kBlockQ, kQVectors, dqt, kBlockQ, true);
  }
  unvisited.Finish();
  StoreQGrads(p, o, b, h, i0, i0 + rows_in_block, dqt);
}

// Query blocks of one (batch, kv head) are split into this many shares (each with its own dK/dV
// partial sums, added in order afterwards) when there are too few (batch, kv head) pairs to keep
// the threads busy. A function of the shapes only, so results never depend on threads.
inline int64_t BackwardShares(const AttentionParams& p, int64_t units) {
  constexpr int64_t kMinTasks = 16;
  const int64_t pairs = std::max<int64_t>(p.batch * p.kv_heads, 1);
  return std::clamp<int64_t>(CeilDiv(kMinTasks, pairs), 1, std::max<int64_t>(units, 1));
}

inline void ProbsBackward(const AttentionParams& params, const ProbsBackwardInputs& in,
                          const BackwardOutputs& o, ffi::ThreadPool* pool) {
  const TileSegments segment_tiles(params);
  const AttentionParams p = segment_tiles.With(params);
  if (p.batch == 0 || p.q_heads == 0) return;
  const ProbsKvLayout layout(p, /*fwd=*/false);
  const int64_t group = p.group(), nqb = CeilDiv(p.q_len, kBlockQ);
  const int64_t units = group * nqb;  // (query head of the group, query block) pairs
  const int64_t shares = BackwardShares(p, units);
  const int64_t dp = RoundUpLanes(p.head_dim), dvp = RoundUpLanes(p.v_dim);
  const int64_t acc_size = layout.keys * (dp + dvp);
  const int64_t chunk = BatchChunk(p.kv_heads * (layout.size() + shares * acc_size), p.batch);
  FloatBuffer packed(chunk * p.kv_heads * layout.size());
  FloatBuffer partial(shares > 1 ? chunk * p.kv_heads * shares * acc_size : 1);
  for (int64_t b0 = 0; b0 < p.batch; b0 += chunk) {
    const int64_t nb = std::min(chunk, p.batch - b0);
    ParallelFor(pool, nb * p.kv_heads, [&](int64_t t) {
      PackProbsKv(p, b0 + t / p.kv_heads, t % p.kv_heads, layout, packed.get() + t * layout.size());
    });
    ParallelFor(pool, nb * p.kv_heads * shares, [&](int64_t t) {
      const int64_t share = t % shares, pair = t / shares;
      const int64_t bl = pair / p.kv_heads, hkv = pair % p.kv_heads, b = b0 + bl;
      const KvPack kv = layout.At(packed.get() + pair * layout.size());
      FloatBuffer own(shares > 1 ? 1 : acc_size);
      float* acc = shares > 1 ? partial.get() + t * acc_size : own.get();
      std::fill(acc, acc + acc_size, 0.0f);
      float* dk_acc = acc;
      float* dv_acc = acc + layout.keys * dp;
      ProbsBackwardScratch sc(p);
      const int64_t u0 = units * share / shares, u1 = units * (share + 1) / shares;
      for (int64_t u = u0; u < u1; ++u) {
        ProbsBackwardBlock(p, in, o, kv, b, hkv * group + u / nqb, u % nqb, dk_acc, dv_acc, sc);
      }
      if (shares == 1) {
        StoreKvGrads(p, o, b, hkv, 0, p.kv_len, dk_acc, dp, dv_acc, dvp);
      }
      StreamFence();
    });
    if (shares > 1) {
      // dK/dV of each (batch, kv head): the shares' partial sums, added in share order.
      ParallelFor(pool, nb * p.kv_heads, [&](int64_t pair) {
        float* total = partial.get() + pair * shares * acc_size;
        for (int64_t s = 1; s < shares; ++s) {
          const float* part = total + s * acc_size;
          for (int64_t x = 0; x < acc_size; ++x) total[x] += part[x];
        }
        StoreKvGrads(p, o, b0 + pair / p.kv_heads, pair % p.kv_heads, 0, p.kv_len, total, dp,
                     total + layout.keys * dp, dvp);
      });
    }
  }
}

}  // namespace attnaux::cpu::pk

#endif  // ATTNAUX_CSRC_CPU_PROBS_CPU_H_
