// Blocked flash attention on the CPU: forward (online softmax) and backward (FA2-style, from the
// saved lse). Semantics: docs/kernel_abi.md.
//
// Layout choice: query rows live in the vector lanes. A tile is kBlockK keys x kBlockQ queries
// stored key-major ("S^T"), so the row max, row sum and rescaling of the online softmax are plain
// vertical vector operations, and every matrix product is the broadcast-scalar x vector shape of
// cpu_gemm.h:
//   S^T  = K Q^T      (A = K^T tile,     B = Q^T  [D x BQ])
//   O^T += V^T P^T    (A = V rows,       B = P^T  [keys x BQ])
//   dP^T = V dO^T     (A = V^T tile,     B = dO^T [Dv x BQ])
//   dV  += P dO       (A = P^T,          B = dO rows, head dim in lanes)
//   dK  += dS Q       (A = dS^T,         B = Q rows,  head dim in lanes)
//   dQ^T += K^T dS^T  (A = K rows,       B = dS^T)
// K and V (and in the backward also Q, dO) are converted to float32 once into packed, zero-padded
// buffers; rows beyond the valid lengths are packed as zeros, so NaN/inf there never enters a
// product. Rows that a mask or the segment ids hide are not known at packing time: packing flags
// the blocks that hold a non-finite value, and a tile of such a block zeroes, in a copy, the rows
// it hides before its products (HiddenInTile), so that 0 * NaN never reaches an output or a
// gradient. Finite inputs never take that path. Scratch is linear in the sequence lengths; the
// Sq x Skv score matrix never exists.
//
// bfloat16 inputs on a CPU with AVX512_BF16 (ATTNAUX_BF16_PAIRS) also get packs of pair words, and
// every product runs on VDPBF16PS (cpu_gemm.h, PairGemmLanes): Q, K, V and dO as given, P and dS
// rounded to bfloat16 as operands (as FlashAttention does on GPUs), float32 accumulation and
// statistics. Where the CPU also has AMX (ATTNAUX_AMX, AmxUsable) and the head dims suit its
// tiles (AmxDims), every product runs on them instead (AmxGemm64, A from bfloat16 packs of K's
// rows, V^T (forward), V's rows and K^T (backward), or of the tile's P^T and dS^T rows); a
// backward whose head dims do not suit them keeps its float32 products there (PairProducts says
// why). Tiles of blocks flagged non-finite keep the float32 path above (and its NaN handling);
// so does every other build and dtype.
//
// Tile sizes and scratch: attention_tile.h. What a tile sees (band, mask, segments, dropout) and
// its scores: attention_mask.h. Packing, forward and backward drivers: here.
#ifndef ATTNAUX_CSRC_CPU_ATTENTION_CPU_H_
#define ATTNAUX_CSRC_CPU_ATTENTION_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/attention_params.h"
#include "cpu/attention_io.h"
#include "cpu/attention_mask.h"
#include "cpu/attention_tile.h"
#include "cpu/cpu_gemm.h"
#include "cpu/cpu_parallel.h"
#include "cpu/cpu_simd.h"
#include "cpu/score_program.h"

namespace attnaux::cpu {

// Packed float32 K and V of one (batch, kv head); keys at or beyond kv_seqlens are zero.
//   kt: [nkb][D][BK]   (K^T per key block)      v_rows: [nkb*BK][Dv]
//   k_rows: [nkb*BK][D] and vt: [nkb][Dv][BK]   (backward only)
//   with bfloat16 inputs and kHasBf16Pairs, PairGemmLanes' operands, 32-bit words of two bfloat16
//   (D2, Dv2 = ceil(D/2), ceil(Dv/2); an odd dim's partner is 0):
//     kt_pairs: [nkb][D2][BK]   (K^T, head dims 2x, 2x + 1 paired)
//     v_pairs: [nkb][BK/2][Dv]   (V rows, keys 2y, 2y + 1 paired; forward only)
//     vt_pairs: [nkb][Dv2][BK] and k_pairs: [nkb][BK/2][D]   (likewise; backward only)
//   with pairs, AMX (AmxUsable) and AmxDims, AmxGemm64's A operands in bfloat16:
//     k_amx: [nkb*BK + BK][D]   (K rows; a block of zero rows after the last, as a tile's
//                                product runs to a multiple of 16 rows past its first key)
//     vt_amx: [nkb][Dv][BK]     (V^T per key block; forward only)
//     v_amx: [nkb*BK + BK][Dv] and kt_amx: [nkb][D][BK]   (V rows, K^T; backward only)
//   nonfinite: [nkb]   1 where a key or value row of the block holds NaN or inf, else 0
// Head dims whose products AmxGemm64 takes whole: the reduction in tiles of 32 and C's rows in
// tiles of 16 (forward), and the backward's dK and dV with the head dim in its 64 lanes.
inline bool AmxDims(const AttentionParams& p, bool backward) {
  return backward ? p.head_dim % 64 == 0 && p.v_dim % 64 == 0
                  : p.head_dim % 32 == 0 && p.v_dim % 16 == 0;
}

// Whether a pass runs its products on bfloat16 pair words (PairGemmLanes, VDPBF16PS; with
// KvPackLayout::amx the tiles take them): bfloat16 inputs on a CPU with AVX512_BF16. Not a
// backward that the tiles cannot take on a CPU with AMX: there (a Sapphire Rapids Xeon, 2 cores)
// VDPBF16PS ran at the rate of the float32 FMAs and the backward's pair products with their
// conversions at 0.8x its float32 ones (120 against 150 GFLOP/s at 1 x 2048 x 8 x 64,
// benchmarks/cpu_vs_torch.py), so such a backward keeps its float32 products.
inline bool PairProducts(const AttentionParams& p, bool backward) {
  return kHasBf16Pairs && p.elem == Elem::kBF16 &&
         !(backward && AmxUsable() && !AmxDims(p, backward));
}

struct KvPackLayout {
  int64_t num_blocks, d, dv;
  bool backward, pairs, amx;
  KvPackLayout(const AttentionParams& p, bool bwd)
      : num_blocks(CeilDiv(p.kv_len, kBlockK)),
        d(p.head_dim),
        dv(p.v_dim),
        backward(bwd),
        pairs(PairProducts(p, bwd)),
        amx(pairs && AmxDims(p, bwd) && AmxUsable()) {}
  int64_t keys() const { return num_blocks * kBlockK; }
  int64_t d2() const { return (d + 1) / 2; }
  int64_t dv2() const { return (dv + 1) / 2; }
  int64_t kt_size() const { return keys() * d; }
  int64_t v_size() const { return keys() * dv; }
  int64_t floats_size() const {
    return backward ? 2 * (kt_size() + v_size()) : kt_size() + v_size();
  }
  int64_t pairs_size() const {
    if (!pairs) return 0;
    return keys() * d2() + (backward ? keys() * dv2() + keys() / 2 * d : keys() / 2 * dv);
  }
  // (in floats: two bfloat16 a float; d and dv are even here)
  int64_t amx_size() const {
    if (!amx) return 0;
    const int64_t rows = keys() + kBlockK;
    return (backward ? rows * d + rows * dv + keys() * d : rows * d + keys() * dv) / 2;
  }
  int64_t size() const { return floats_size() + pairs_size() + amx_size() + num_blocks; }
};

struct KvPack {
  const float* kt;
  const float* v_rows;
  const float* k_rows;
  const float* vt;
  const uint32_t* kt_pairs;  // null unless layout.pairs
  const uint32_t* v_pairs;
  const uint32_t* vt_pairs;
  const uint32_t* k_pairs;
  const uint16_t* k_amx;  // null unless layout.amx
  const uint16_t* vt_amx;
  const uint16_t* v_amx;
  const uint16_t* kt_amx;
  const float* nonfinite;
};

inline KvPack KvPackAt(const KvPackLayout& layout, float* base) {
  KvPack pack;
  pack.kt = base;
  pack.v_rows = base + layout.kt_size();
  pack.k_rows = layout.backward ? base + layout.kt_size() + layout.v_size() : nullptr;
  pack.vt = layout.backward ? base + 2 * layout.kt_size() + layout.v_size() : nullptr;
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(base + layout.floats_size());
  const uint32_t* after_kt = pairs + layout.keys() * layout.d2();
  const bool fwd = layout.pairs && !layout.backward, bwd = layout.pairs && layout.backward;
  pack.kt_pairs = layout.pairs ? pairs : nullptr;
  pack.v_pairs = fwd ? after_kt : nullptr;
  pack.vt_pairs = bwd ? after_kt : nullptr;
  pack.k_pairs = bwd ? after_kt + layout.keys() * layout.dv2() : nullptr;
  const uint16_t* amx =
      reinterpret_cast<const uint16_t*>(base + layout.floats_size() + layout.pairs_size());
  const int64_t rows = layout.keys() + kBlockK;
  const bool fwd_amx = layout.amx && !layout.backward, bwd_amx = layout.amx && layout.backward;
  pack.k_amx = layout.amx ? amx : nullptr;
  pack.vt_amx = fwd_amx ? amx + rows * layout.d : nullptr;
  pack.v_amx = bwd_amx ? amx + rows * layout.d : nullptr;
  pack.kt_amx = bwd_amx ? amx + rows * (layout.d + layout.dv) : nullptr;
  pack.nonfinite = base + layout.size() - layout.num_blocks;
  return pack;
}

// The word of two bfloat16-exact floats (as widened from bfloat16, or 0): lo in the low half.
inline uint32_t PairWord(float lo, float hi) {
  return (FloatToBits(lo) >> 16) | (FloatToBits(hi) & 0xffff0000u);
}

// n rows of `width` bfloat16-exact floats (leading dimension ld) -> pair words of their
// transpose, columns 2x, 2x + 1 paired: out[x2 * n + r] (kt_pairs' layout).
inline void PackColumnPairs(const float* rows, int64_t ld, int64_t n, int64_t width,
                            uint32_t* out) {
  for (int64_t x2 = 0; x2 < (width + 1) / 2; ++x2) {
    for (int64_t r = 0; r < n; ++r) {
      const float* row = rows + r * ld;
      out[x2 * n + r] = PairWord(row[2 * x2], 2 * x2 + 1 < width ? row[2 * x2 + 1] : 0.0f);
    }
  }
}

// n (even) rows of `width` bfloat16-exact floats (leading dimension ld) -> rows 2y, 2y + 1
// paired: out[y * width + x] (v_pairs' layout).
inline void PackRowPairs(const float* rows, int64_t ld, int64_t n, int64_t width, uint32_t* out) {
  for (int64_t y = 0; y < n / 2; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      out[y * width + x] = PairWord(rows[2 * y * ld + x], rows[(2 * y + 1) * ld + x]);
    }
  }
}

#if defined(ATTNAUX_BF16_PAIRS)
// A tile's P^T or dS^T (rows: keys [j0, j1) of block jb, lanes: queries) rounded to bfloat16, in
// pair words of the block's keys 2y, 2y + 1 for y in [*y0, *y1): the pairing of v_pairs and
// k_pairs, so that those are read where they were packed. A partner outside [j0, j1) is 0.
inline void KeyPairsOfTile(const float* rows, int64_t jb, int64_t j0, int64_t j1, uint32_t* out,
                           int64_t* y0, int64_t* y1) {
  const int64_t jbase = jb * kBlockK, nk = j1 - j0;
  *y0 = (j0 - jbase) / 2;
  *y1 = (j1 - jbase + 1) / 2;
  for (int64_t y = *y0; y < *y1; ++y) {
    const int64_t r = jbase + 2 * y - j0;  // row of key jbase + 2y (-1: none)
    for (int v = 0; v < kQVectors; ++v) {
      const VecF lo = r >= 0 ? Load(rows + r * kBlockQ + v * kLanes) : VecF{};
      const VecF hi = r + 1 < nk ? Load(rows + (r + 1) * kBlockQ + v * kLanes) : VecF{};
      StorePairsBf16(out + (y - *y0) * kBlockQ + v * kLanes, lo, hi);
    }
  }
}

// KeyPairsOfTile for all the block's kBlockK / 2 key pairs, those outside [j0, j1) 0: the B
// operand of an AMX product whose reduction runs over the whole block (out[y * kBlockQ + lane]).
inline void BlockKeyPairs(const float* rows, int64_t jb, int64_t j0, int64_t j1, uint32_t* out) {
  int64_t y0, y1;
  KeyPairsOfTile(rows, jb, j0, j1, out + (j0 - jb * kBlockK) / 2 * kBlockQ, &y0, &y1);
  std::fill(out, out + y0 * kBlockQ, 0u);
  std::fill(out + y1 * kBlockQ, out + kBlockK / 2 * kBlockQ, 0u);
}
#endif

// n rows of `width` bfloat16-exact floats (leading dimension ld) -> their transpose in bfloat16,
// out[x * n + r] (the floats' upper halves: exact).
inline void TransposeToBf16(const float* rows, int64_t ld, int64_t n, int64_t width,
                            uint16_t* out) {
  for (int64_t x = 0; x < width; ++x) {
    for (int64_t r = 0; r < n; ++r) {
      out[x * n + r] = static_cast<uint16_t>(FloatToBits(rows[r * ld + x]) >> 16);
    }
  }
}

// rows [kBlockK][width] (leading dimension ld) -> cols [width][kBlockK]: 16 x 16 blocks in
// registers, then 16 columns at a time (both sides in L1) for what is left.
inline void TransposeKeys(const float* rows, int64_t ld, int64_t width, float* cols) {
  static_assert(kBlockK % 16 == 0, "whole 16 x 16 blocks of keys");
  const int64_t width16 = kHasTranspose16 ? width / 16 * 16 : 0;
  for (int64_t x0 = 0; x0 < width16; x0 += 16) {
    for (int64_t jj = 0; jj < kBlockK; jj += 16) {
      Transpose16(rows + jj * ld + x0, ld, cols + x0 * kBlockK + jj, kBlockK, false);
    }
  }
  for (int64_t x0 = width16; x0 < width; x0 += 16) {
    const int64_t x1 = std::min<int64_t>(x0 + 16, width);
    for (int64_t jj = 0; jj < kBlockK; ++jj) {
      for (int64_t x = x0; x < x1; ++x) cols[x * kBlockK + jj] = rows[jj * ld + x];
    }
  }
}

// cols [width][kBlockQ] -> rows [kBlockQ][width] (TransposeKeys' inverse).
inline void TransposeLanes(const float* cols, int64_t width, float* rows) {
  static_assert(kBlockQ % 16 == 0, "whole 16 x 16 blocks of lanes");
  const int64_t width16 = kHasTranspose16 ? width / 16 * 16 : 0;
  for (int64_t x0 = 0; x0 < width16; x0 += 16) {
    for (int64_t lane = 0; lane < kBlockQ; lane += 16) {
      Transpose16(cols + x0 * kBlockQ + lane, kBlockQ, rows + lane * width + x0, width, false);
    }
  }
  for (int64_t lane = 0; lane < kBlockQ; ++lane) {
    for (int64_t x = width16; x < width; ++x) rows[lane * width + x] = cols[x * kBlockQ + lane];
  }
}

// Key block jb of every kv head of batch row b: heads + hkv * layout.size() is head hkv's pack.
// Key j's heads are contiguous in K and V ([b, s, h, d]), so the block is read in memory order
// (one head's rows alone are H * D apart: every row a new page, too far apart for the
// prefetchers), staged, then transposed head by head.
inline void PackKvBlock(const AttentionParams& p, int64_t b, int64_t jb,
                        const KvPackLayout& layout, float* heads, std::vector<float>& stage) {
  const int64_t d = p.head_dim, dv = p.v_dim, hk = p.kv_heads;
  const int64_t kl = RowRanges(p, b).kl;
  const int64_t j0 = jb * kBlockK;
  // stage: K rows [hk][kBlockK][d], then (backward) V rows [hk][kBlockK][dv]
  stage.resize(hk * kBlockK * (d + (layout.backward ? dv : 0)));
  float* kstage = stage.data();
  float* vstage = layout.backward ? kstage + hk * kBlockK * d : nullptr;
  auto pack_of = [&](int64_t hkv) { return heads + hkv * layout.size(); };
  for (int64_t hkv = 0; hkv < hk; ++hkv) pack_of(hkv)[layout.size() - layout.num_blocks + jb] = 0.0f;
  for (int64_t jj = 0; jj < kBlockK; ++jj) {
    const int64_t j = j0 + jj;
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      float* base = pack_of(hkv);
      float* k_row = kstage + (hkv * kBlockK + jj) * d;
      float* v_row = base + layout.kt_size() + j * dv;  // v_rows, in place
      if (j < kl) {
        LoadRow(p.elem, p.k, ((b * p.kv_len + j) * hk + hkv) * d, d, k_row);
        LoadRow(p.elem, p.v, ((b * p.kv_len + j) * hk + hkv) * dv, dv, v_row);
        if (!AllFinite(k_row, d) || !AllFinite(v_row, dv)) {
          base[layout.size() - layout.num_blocks + jb] = 1.0f;
        }
      } else {
        std::fill(k_row, k_row + d, 0.0f);
        std::fill(v_row, v_row + dv, 0.0f);
      }
      if (layout.backward) {
        std::copy(k_row, k_row + d, base + layout.kt_size() + layout.v_size() + j * d);
        std::copy(v_row, v_row + dv, vstage + (hkv * kBlockK + jj) * dv);
      }
    }
  }
  for (int64_t hkv = 0; hkv < hk; ++hkv) {
    float* base = pack_of(hkv);
    TransposeKeys(kstage + hkv * kBlockK * d, d, d, base + jb * d * kBlockK);
    if (layout.backward) {
      float* vt = base + 2 * layout.kt_size() + layout.v_size();
      TransposeKeys(vstage + hkv * kBlockK * dv, dv, dv, vt + jb * dv * kBlockK);
    }
    if (layout.pairs) {
      // the float32 pack above stays: tiles of blocks flagged non-finite run on it
      const KvPack pack = KvPackAt(layout, base);
      auto words = [](const uint32_t* at) { return const_cast<uint32_t*>(at); };
      const float* k_rows = kstage + hkv * kBlockK * d;
      PackColumnPairs(k_rows, d, kBlockK, d, words(pack.kt_pairs) + jb * layout.d2() * kBlockK);
      if (layout.backward) {
        PackColumnPairs(vstage + hkv * kBlockK * dv, dv, kBlockK, dv,
                        words(pack.vt_pairs) + jb * layout.dv2() * kBlockK);
        PackRowPairs(k_rows, d, kBlockK, d, words(pack.k_pairs) + jb * (kBlockK / 2) * d);
      } else {
        PackRowPairs(pack.v_rows + j0 * dv, dv, kBlockK, dv,
                     words(pack.v_pairs) + jb * (kBlockK / 2) * dv);
      }
    }
    if (layout.amx) {
      // K rows and V^T in bfloat16 (the floats are bfloat16-exact: their upper halves)
      const KvPack pack = KvPackAt(layout, base);
      auto half = [](float x) { return static_cast<uint16_t>(FloatToBits(x) >> 16); };
      uint16_t* k_amx = const_cast<uint16_t*>(pack.k_amx) + j0 * d;
      const float* k_rows = kstage + hkv * kBlockK * d;
      for (int64_t x = 0; x < kBlockK * d; ++x) k_amx[x] = half(k_rows[x]);
      if (jb == layout.num_blocks - 1) {
        std::fill(k_amx + kBlockK * d, k_amx + 2 * kBlockK * d, uint16_t{0});
      }
      const float* v_rows = pack.v_rows + j0 * dv;
      if (!layout.backward) {
        TransposeToBf16(v_rows, dv, kBlockK, dv,
                        const_cast<uint16_t*>(pack.vt_amx) + jb * dv * kBlockK);
      } else {
        uint16_t* v_amx = const_cast<uint16_t*>(pack.v_amx) + j0 * dv;
        for (int64_t x = 0; x < kBlockK * dv; ++x) v_amx[x] = half(v_rows[x]);
        if (jb == layout.num_blocks - 1) {
          std::fill(v_amx + kBlockK * dv, v_amx + 2 * kBlockK * dv, uint16_t{0});
        }
        TransposeToBf16(k_rows, d, kBlockK, d,
                        const_cast<uint16_t*>(pack.kt_amx) + jb * d * kBlockK);
      }
    }
  }
}

// The keys of a tile that none of its rows sees and the rows that see none of its keys (every
// score -inf after ScoreTile). Such a key or row still enters the tile's products with weight 0;
// when its packed values are not finite, 0 * NaN would leak into outputs and gradients that never
// looked at it, so the tile zeroes it in a copy (CleanRows). Only tiles of blocks flagged
// non-finite at packing ask, so finite inputs pay nothing.
struct HiddenInTile {
  bool keys[kBlockK];
  bool rows[kBlockQ];
  bool any_key = false, any_row = false;

  HiddenInTile() = default;  // nothing hidden (any_key = any_row = false)
  HiddenInTile(const float* st, int64_t nk, int64_t valid) {
    for (int64_t lane = 0; lane < kBlockQ; ++lane) rows[lane] = lane < valid;
    for (int64_t r = 0; r < nk; ++r) {
      bool hidden = true;
      for (int64_t lane = 0; lane < valid; ++lane) {
        const bool seen = st[r * kBlockQ + lane] != -kInf;
        hidden &= !seen;
        rows[lane] &= !seen;
      }
      keys[r] = hidden;
      any_key |= hidden;
    }
    for (int64_t lane = 0; lane < valid; ++lane) any_row |= rows[lane];
  }
};

// `n` rows of `width` floats (leading dimension `ld`) copied into `scratch`, the rows with
// hidden[r] zeroed; returns the copy (leading dimension `width`).
inline const float* CleanRows(const float* rows, int64_t ld, int64_t n, int64_t width,
                              const bool* hidden, std::vector<float>& scratch) {
  if (static_cast<int64_t>(scratch.size()) < n * width) scratch.resize(n * width);
  for (int64_t r = 0; r < n; ++r) {
    float* dst = scratch.data() + r * width;
    if (hidden[r]) {
      std::fill(dst, dst + width, 0.0f);
    } else {
      std::copy(rows + r * ld, rows + r * ld + width, dst);
    }
  }
  return scratch.data();
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

// The running state of one query block in the forward: Q^T, the unnormalised O^T, and the online
// softmax's row max and sum (one lane per query row).
struct ForwardRows {
  int64_t i0 = 0, rows_in_block = 0, valid = 0;
  float* qt = nullptr;  // [D][BQ], zero beyond the valid rows
  uint32_t* qt_pairs = nullptr;  // [D2][BQ] pair words of Q^T (KvPackLayout::pairs), or null
  float* ot = nullptr;  // [Dv][BQ]
  VecF m[kQVectors], l[kQVectors];
};

inline void ForwardRowsBegin(const AttentionParams& p, const HeadView& hv, int64_t b, int64_t h,
                             int64_t ib, ForwardRows& st) {
  const int64_t d = p.head_dim, dv = p.v_dim;
  st.i0 = ib * kBlockQ;
  st.rows_in_block = std::min(kBlockQ, p.q_len - st.i0);
  st.valid = std::min(hv.rows.ValidRows(st.i0), st.rows_in_block);
  // the block's rows (zero beyond the valid ones), then Q^T = their transpose
  std::vector<float> rows(kBlockQ * d, 0.0f);
  for (int64_t lane = 0; lane < st.valid; ++lane) {
    LoadRow(p.elem, p.q, ((b * p.q_len + st.i0 + lane) * p.q_heads + h) * d, d,
            rows.data() + lane * d);
  }
  static_assert(kBlockQ == kBlockK, "TransposeKeys transposes kBlockK rows");
  TransposeKeys(rows.data(), d, d, st.qt);
  if (st.qt_pairs != nullptr) PackColumnPairs(rows.data(), d, kBlockQ, d, st.qt_pairs);
  std::fill(st.ot, st.ot + dv * kBlockQ, 0.0f);
  for (int v = 0; v < kQVectors; ++v) {
    st.m[v] = Splat(-kInf);
    st.l[v] = VecF{};
  }
}

// Key block jb of one query block: scores, online softmax update, O^T += V^T P^T.
inline void ForwardRowsTile(const AttentionParams& p, const KvPack& kv, const HeadView& hv,
                            int64_t jb, ForwardRows& rs, TileScratch& scratch) {
  const int64_t d = p.head_dim, dv = p.v_dim;
  const int64_t i0 = rs.i0, valid = rs.valid;
  float* st = scratch.scores.get();
  float* drop = scratch.drop.get();
  int64_t j0, j1;
  TileKeys(hv, i0, valid, jb, &j0, &j1);
  if (j0 >= j1) return;
  const int64_t nk = j1 - j0;
  // bfloat16 products unless the block holds NaN or inf (those take the float32 path, which
  // keeps them out of rows and keys that do not see them)
  const bool pairs = kv.kt_pairs != nullptr && kv.nonfinite[jb] == 0.0f;
  VecF fused_max[kQVectors];
  const bool amx = pairs && kv.k_amx != nullptr;
  const bool have_max =
      ScoreTile(hv, i0, valid, j0, j1, kv.kt + jb * kBlockK * d, rs.qt, st, nullptr, nullptr,
                &scratch.program_regs, fused_max,
                pairs ? kv.kt_pairs + jb * kBlockK * ((d + 1) / 2) : nullptr, rs.qt_pairs,
                amx ? kv.k_amx + j0 * d : nullptr);
  const float* v_tile = kv.v_rows + j0 * dv;
  if (kv.nonfinite[jb] != 0.0f) {
    const HiddenInTile hidden(st, nk, valid);
    if (hidden.any_key) v_tile = CleanRows(v_tile, dv, nk, dv, hidden.keys, scratch.clean);
  }
  // Online softmax update, per lane (= query row).
  VecF alpha[kQVectors];
  for (int v = 0; v < kQVectors; ++v) {
    VecF tile_max = Splat(-kInf);
    if (have_max) {
      tile_max = fused_max[v];
    } else {
      for (int64_t r = 0; r < nk; ++r) {
        tile_max = Max(tile_max, Load(st + r * kBlockQ + v * kLanes));
      }
    }
    VecF m_new = Max(rs.m[v], tile_max);
    // A row that has seen no visible key yet keeps m = -inf; subtract 0 instead (exp(-inf) = 0).
    VecF m_use = m_new == -kInf ? VecF{} : m_new;
    alpha[v] = Exp(rs.m[v] - m_use);
    VecF sum = VecF{};
    for (int64_t r = 0; r < nk; ++r) {
      float* sp = st + r * kBlockQ + v * kLanes;
      VecF pr = Exp(Load(sp) - m_use);
      sum += pr;
      Store(sp, pr);
    }
    rs.l[v] = rs.l[v] * alpha[v] + sum;
    rs.m[v] = m_new;
  }
  if (hv.dropout()) {
    DropoutTile(hv, i0, valid, j0, j1, drop);
    for (int64_t x = 0; x < nk * kBlockQ; x += kLanes) {
      Store(st + x, Load(st + x) * Load(drop + x));
    }
  }
  // O^T = O^T * alpha + V^T P^T (the rescale as the product loads O^T)
  GemmFuse fuse;
  fuse.c_scale = alpha;
#if defined(ATTNAUX_AMX)
  if (amx) {
    // P^T's pair words for all the block's keys (those outside [j0, j1) 0, their V rows
    // finite: the block is), so that the product's reduction is whole tiles of 32 keys; O^T
    // rescaled first, as the fused product would as it loads it
    static_assert(kBlockQ == 64 && kBlockK % 32 == 0, "AmxGemm64: 64 lanes, 32-key tiles");
    uint32_t* pt = reinterpret_cast<uint32_t*>(scratch.probs.get());
    BlockKeyPairs(st, jb, j0, j1, pt);
    for (int64_t x = 0; x < dv; ++x) {
      for (int v = 0; v < kQVectors; ++v) {
        float* o = rs.ot + x * kBlockQ + v * kLanes;
        Store(o, Load(o) * alpha[v]);
      }
    }
    AmxGemm64(dv, kBlockK / 2, kv.vt_amx + jb * dv * kBlockK, kBlockK, pt, kBlockQ, rs.ot,
              kBlockQ, true);
    return;
  }
#endif
#if defined(ATTNAUX_BF16_PAIRS)
  if (pairs) {
    // P rounded to bfloat16, as flash attention on GPUs does (its partner outside [j0, j1) has
    // P = 0, and a finite V row: the block is)
    uint32_t* pt = reinterpret_cast<uint32_t*>(scratch.probs.get());
    int64_t y0, y1;
    KeyPairsOfTile(st, jb, j0, j1, pt, &y0, &y1);
    PairGemmLanes<1>(dv, y1 - y0, kv.v_pairs + (jb * kBlockK / 2 + y0) * dv, dv, pt, kBlockQ,
                     kQVectors, rs.ot, kBlockQ, true, &fuse);
    return;
  }
#endif
  GemmLanes<1>(dv, nk, v_tile, dv, st, kBlockQ, kQVectors, rs.ot, kBlockQ, true, &fuse);
}

// Final statistics and output rows of one query block.
inline void ForwardRowsEnd(const AttentionParams& p, const HeadView& hv, int64_t b, int64_t h,
                           const ForwardRows& rs, const ForwardOutputs& outputs) {
  const int64_t dv = p.v_dim;
  float m_row[kBlockQ], l_row[kBlockQ];
  for (int v = 0; v < kQVectors; ++v) {
    Store(m_row + v * kLanes, rs.m[v]);
    Store(l_row + v * kLanes, rs.l[v]);
  }
  // O's rows: the transpose of O^T ([Dv][BQ] -> [BQ][Dv])
  std::vector<float> o_rows(kBlockQ * dv), out_row(dv);
  TransposeLanes(rs.ot, dv, o_rows.data());
  for (int64_t lane = 0; lane < rs.rows_in_block; ++lane) {
    const int64_t i = rs.i0 + lane;
    const RowEnd end =
        FinishRow(lane < rs.valid, m_row[lane], l_row[lane], hv.has_sink, hv.sink);
    const float mx = end.max, lse = end.lse, factor = end.factor;
    const int64_t stat = (b * p.q_heads + h) * p.q_len + i;
    outputs.lse[stat] = lse;
    outputs.max[stat] = mx;
    const float* o_row = o_rows.data() + lane * dv;
    for (int64_t x = 0; x < dv; ++x) out_row[x] = factor == 0.0f ? 0.0f : o_row[x] * factor;
    StoreRow(p.elem, outputs.out, ((b * p.q_len + i) * p.q_heads + h) * dv, dv, out_row.data());
  }
}

// Query blocks [ib0, ib0 + nblocks) of one (batch, query head): online softmax over the visible
// key blocks, every query block against a key block before the next key block, so that K and V
// stream from memory once for all of them (then from L2). Each query block's arithmetic is that
// of a group of one: results do not depend on the grouping. qt_all / ot_all: nblocks x
// [D][BQ] / [Dv][BQ] of scratch.
inline void ForwardBlocks(const AttentionParams& p, const KvPack& kv, int64_t b, int64_t h,
                          int64_t ib0, int64_t nblocks, const ForwardOutputs& outputs,
                          TileScratch& scratch, float* qt_all, float* ot_all,
                          uint32_t* qt_pairs_all = nullptr) {
  constexpr int64_t kMaxGroup = 8;
  const HeadView hv(p, b, h);
  ForwardRows rows[kMaxGroup];
  nblocks = std::min(nblocks, kMaxGroup);
  for (int64_t g = 0; g < nblocks; ++g) {
    rows[g].qt = qt_all + g * p.head_dim * kBlockQ;
    rows[g].ot = ot_all + g * p.v_dim * kBlockQ;
    if (qt_pairs_all != nullptr) {
      rows[g].qt_pairs = qt_pairs_all + g * ((p.head_dim + 1) / 2) * kBlockQ;
    }
    ForwardRowsBegin(p, hv, b, h, ib0 + g, rows[g]);
  }
  const int64_t num_kv_blocks = CeilDiv(p.kv_len, kBlockK);
  for (int64_t jb = 0; jb < num_kv_blocks; ++jb) {
    for (int64_t g = 0; g < nblocks; ++g) ForwardRowsTile(p, kv, hv, jb, rows[g], scratch);
  }
  for (int64_t g = 0; g < nblocks; ++g) ForwardRowsEnd(p, hv, b, h, rows[g], outputs);
}

// Query blocks that one forward task takes through the key blocks together (ForwardBlocks).
inline constexpr int64_t kForwardGroup = 4;

// Rows of K/V packed per batch chunk, so that scratch stays bounded for huge batches. The chunk
// depends only on shapes, never on threads.
inline int64_t BatchChunk(int64_t per_batch_floats, int64_t batch) {
  constexpr int64_t kBudgetFloats = int64_t{1} << 27;  // 512 MiB
  return std::clamp<int64_t>(kBudgetFloats / std::max<int64_t>(per_batch_floats, 1), 1,
                             std::max<int64_t>(batch, 1));
}

inline void FlashForward(const AttentionParams& params, const ForwardOutputs& outputs,
                         ffi::ThreadPool* pool) {
  const TileSegments segment_tiles(params);
  const AttentionParams p = segment_tiles.With(params);
  if (p.batch == 0 || p.q_len == 0) return;
  const KvPackLayout layout(p, /*bwd=*/false);
  const int64_t chunk = BatchChunk(p.kv_heads * layout.size(), p.batch);
  FloatBuffer packed(chunk * p.kv_heads * layout.size());
  const int64_t num_q_blocks = CeilDiv(p.q_len, kBlockQ);
  for (int64_t b0 = 0; b0 < p.batch; b0 += chunk) {
    const int64_t nb = std::min(chunk, p.batch - b0);
    ParallelFor(pool, nb * layout.num_blocks, [&](int64_t t) {
      const int64_t bl = t / layout.num_blocks, jb = t % layout.num_blocks;
      std::vector<float> stage;
      PackKvBlock(p, b0 + bl, jb, layout, packed.get() + bl * p.kv_heads * layout.size(), stage);
    });
    // Query blocks per task: when a kv head's packed K and V outgrow half an L2 (2 MiB per core
    // here), several query blocks share each K/V tile's trip from memory (then the tile is in
    // L2 for the others), as long as there are still a few tasks per thread. The grouping never
    // changes what a block computes.
    const int64_t threads = pool != nullptr ? std::max<int64_t>(pool->num_threads(), 1) : 1;
    const int64_t all_blocks = nb * p.q_heads * num_q_blocks;
    const bool big_kv = (layout.kt_size() + layout.v_size()) * static_cast<int64_t>(sizeof(float)) >
                        (int64_t{1} << 20);
    const int64_t group =
        big_kv ? std::clamp<int64_t>(all_blocks / (8 * threads), 1, kForwardGroup) : 1;
    const int64_t tasks_per_head = CeilDiv(num_q_blocks, group);
    ParallelFor(pool, nb * p.q_heads * tasks_per_head, [&](int64_t t) {
      const int64_t ib = (t % tasks_per_head) * group;
      const int64_t h = (t / tasks_per_head) % p.q_heads;
      const int64_t bl = t / (tasks_per_head * p.q_heads);
      const int64_t hkv = h / p.group();
      const int64_t n = std::min(group, num_q_blocks - ib);
      TileScratch scratch;
      FloatBuffer qt(n * p.head_dim * kBlockQ), ot(n * p.v_dim * kBlockQ);
      FloatBuffer qt_pairs(layout.pairs ? n * layout.d2() * kBlockQ : 0);
      const KvPack kv = KvPackAt(layout, packed.get() + (bl * p.kv_heads + hkv) * layout.size());
      ForwardBlocks(p, kv, b0 + bl, h, ib, n, outputs, scratch, qt.get(), ot.get(),
                    layout.pairs ? reinterpret_cast<uint32_t*>(qt_pairs.get()) : nullptr);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

// Packed float32 query side of one (batch, query head); rows at or beyond q_seqlens are zero,
// with lse_eff = +inf (so that P = 0 there) and Dt = 0.
//   qt: [nqb][D][BQ]  q_rows: [nqb*BQ][Dp]  dot: [nqb][Dv][BQ]  do_rows: [nqb*BQ][Dvp]
//   lse_eff, dt: [nqb*BQ]   (Dp, Dvp: head dims rounded up to whole vectors)
//   nonfinite: [nqb]   1 where a query row of the block holds NaN or inf, else 0
//   with KvPackLayout::pairs, the pair words of (D2, Dv2 = ceil(D/2), ceil(Dv/2))
//     qt_pairs: [nqb][D2][BQ]  dot_pairs: [nqb][Dv2][BQ]   (head dims 2x, 2x + 1 paired)
//     q_pairs: [nqb*BQ/2][Dp]  do_pairs: [nqb*BQ/2][Dvp]   (rows 2y, 2y + 1 paired)
struct QPackLayout {
  int64_t num_blocks, d, dv, dp, dvp;
  bool pairs;
  explicit QPackLayout(const AttentionParams& p)
      : num_blocks(CeilDiv(p.q_len, kBlockQ)),
        d(p.head_dim),
        dv(p.v_dim),
        dp(RoundUpLanes(p.head_dim)),
        dvp(RoundUpLanes(p.v_dim)),
        pairs(PairProducts(p, /*backward=*/true)) {}
  int64_t rows() const { return num_blocks * kBlockQ; }
  int64_t floats_size() const { return rows() * (d + dp + dv + dvp + 2) + num_blocks; }
  int64_t pairs_size() const {
    return pairs ? rows() * ((d + 1) / 2 + (dv + 1) / 2) + rows() / 2 * (dp + dvp) : 0;
  }
  int64_t size() const { return floats_size() + pairs_size(); }
};

struct QPack {
  float* qt;
  float* q_rows;
  float* dot;
  float* do_rows;
  float* lse_eff;
  float* dt;
  float* nonfinite;
  uint32_t* qt_pairs;  // null unless layout.pairs
  uint32_t* dot_pairs;
  uint32_t* q_pairs;
  uint32_t* do_pairs;
};

inline QPack QPackAt(const QPackLayout& layout, float* base) {
  QPack pack;
  const int64_t n = layout.rows();
  pack.qt = base;
  pack.q_rows = pack.qt + n * layout.d;
  pack.dot = pack.q_rows + n * layout.dp;
  pack.do_rows = pack.dot + n * layout.dv;
  pack.lse_eff = pack.do_rows + n * layout.dvp;
  pack.dt = pack.lse_eff + n;
  pack.nonfinite = pack.dt + n;
  pack.qt_pairs = pack.dot_pairs = pack.q_pairs = pack.do_pairs = nullptr;
  if (layout.pairs) {
    pack.qt_pairs = reinterpret_cast<uint32_t*>(base + layout.floats_size());
    pack.dot_pairs = pack.qt_pairs + n * ((layout.d + 1) / 2);
    pack.q_pairs = pack.dot_pairs + n * ((layout.dv + 1) / 2);
    pack.do_pairs = pack.q_pairs + n / 2 * layout.dp;
  }
  return pack;
}

// Rows PackQ asks for ahead of its loads, and the request: every cache line of [p, p + n).
inline constexpr int64_t kPackAhead = 4;
inline void PrefetchBytes(const char* p, int64_t n) {
  for (int64_t x = 0; x < n; x += 64) __builtin_prefetch(p + x);
}

inline void PackQ(const AttentionParams& p, const BackwardInputs& in, int64_t b, int64_t h,
                  const QPackLayout& layout, float* base) {
  const int64_t d = p.head_dim, dv = p.v_dim;
  const QPack pack = QPackAt(layout, base);
  std::fill(base, base + layout.floats_size(), 0.0f);  // (the pair words are all written below)
  const int64_t ql = RowRanges(p, b).ql;
  std::vector<float> q_row(d), do_row(dv), out_row(dv);
  const int64_t elem_bytes = p.elem == Elem::kF32 ? 4 : 2;
  for (int64_t i = 0; i < layout.rows(); ++i) {
    if (i >= ql) {
      pack.lse_eff[i] = kInf;
      continue;
    }
    const int64_t token = (b * p.q_len + i) * p.q_heads + h;
    if (i + kPackAhead < ql) {
      // one head's rows are H * D apart, a new page every few rows: the loads below waited on
      // memory (half of PackQ's time) until the rows a few tokens on were asked for early
      const int64_t ahead = token + kPackAhead * p.q_heads;
      PrefetchBytes(static_cast<const char*>(p.q) + ahead * d * elem_bytes, d * elem_bytes);
      PrefetchBytes(static_cast<const char*>(in.dout) + ahead * dv * elem_bytes, dv * elem_bytes);
      PrefetchBytes(static_cast<const char*>(in.out) + ahead * dv * elem_bytes, dv * elem_bytes);
    }
    LoadRow(p.elem, p.q, token * d, d, q_row.data());
    LoadRow(p.elem, in.dout, token * dv, dv, do_row.data());
    LoadRow(p.elem, in.out, token * dv, dv, out_row.data());
    const int64_t ib = i / kBlockQ, lane = i % kBlockQ;
    if (!AllFinite(q_row.data(), d)) pack.nonfinite[ib] = 1.0f;
    for (int64_t x = 0; x < d; ++x) pack.qt[(ib * d + x) * kBlockQ + lane] = q_row[x];
    std::copy(q_row.begin(), q_row.end(), pack.q_rows + i * layout.dp);
    for (int64_t x = 0; x < dv; ++x) pack.dot[(ib * dv + x) * kBlockQ + lane] = do_row[x];
    std::copy(do_row.begin(), do_row.end(), pack.do_rows + i * layout.dvp);
    float dot = 0.0f;
    for (int64_t x = 0; x < dv; ++x) dot += do_row[x] * out_row[x];
    const int64_t stat = (b * p.q_heads + h) * p.q_len + i;
    pack.dt[i] = dot - in.dlse[stat];
    const float lse = in.lse[stat];
    pack.lse_eff[i] = lse == -kInf ? kInf : lse;
  }
  if (layout.pairs) {
    const int64_t d2 = (d + 1) / 2, dv2 = (dv + 1) / 2;
    for (int64_t ib = 0; ib < layout.num_blocks; ++ib) {
      // pairs of neighbouring head dims from the transposed [D][BQ] blocks' rows
      for (int64_t x2 = 0; x2 < d2; ++x2) {
        const float* lo = pack.qt + (ib * d + 2 * x2) * kBlockQ;
        for (int64_t lane = 0; lane < kBlockQ; ++lane) {
          pack.qt_pairs[(ib * d2 + x2) * kBlockQ + lane] =
              PairWord(lo[lane], 2 * x2 + 1 < d ? lo[kBlockQ + lane] : 0.0f);
        }
      }
      for (int64_t x2 = 0; x2 < dv2; ++x2) {
        const float* lo = pack.dot + (ib * dv + 2 * x2) * kBlockQ;
        for (int64_t lane = 0; lane < kBlockQ; ++lane) {
          pack.dot_pairs[(ib * dv2 + x2) * kBlockQ + lane] =
              PairWord(lo[lane], 2 * x2 + 1 < dv ? lo[kBlockQ + lane] : 0.0f);
        }
      }
    }
    PackRowPairs(pack.q_rows, layout.dp, layout.rows(), layout.dp, pack.q_pairs);
    PackRowPairs(pack.do_rows, layout.dvp, layout.rows(), layout.dvp, pack.do_pairs);
  }
}

// One tile of the backward pass. dk_block/dv_block ([BK][Dp] / [BK][Dvp] of key block jb) are
// accumulated when non-null; dqt ([D][BQ] of query block ib) and dbias when dqt is non-null.
// Never inlined: both backward schemes must run the very same machine code (with contraction
// into FMAs decided once), or they would differ in the last bit.
// With a score program, `dconsts` (when not null) accumulates its consts' gradients.
__attribute__((noinline)) inline void BackwardTile(const HeadView& hv, const KvPack& kv,
                                                   const QPack& qs, const QPackLayout& ql,
                                                   int64_t ib, int64_t jb, float* dk_block,
                                                   float* dv_block, float* dqt, float* dbias,
                                                   TileScratch& scratch,
                                                   float* dconsts = nullptr) {
  const AttentionParams& p = hv.p;
  const int64_t d = p.head_dim, dv = p.v_dim;
  const int64_t i0 = ib * kBlockQ;
  const int64_t valid = std::min(hv.rows.ValidRows(i0), p.q_len - i0);
  int64_t j0, j1;
  TileKeys(hv, i0, valid, jb, &j0, &j1);
  if (j0 >= j1) return;
  const int64_t nk = j1 - j0, key_offset = j0 - jb * kBlockK;
  const int64_t n = nk * kBlockQ;
  float* st = scratch.scores.get();
  float* th = p.softcap > 0.0f ? scratch.tanh.get() : nullptr;
  float* pr = scratch.probs.get();
  float* ds = scratch.dprobs.get();
  float* drop = scratch.drop.get();
  float* raw = nullptr;
  if (hv.program != nullptr) {
    scratch.raw.resize(kBlockK * kBlockQ);
    raw = scratch.raw.data();
  }
  const bool check_hidden = kv.nonfinite[jb] != 0.0f || qs.nonfinite[ib] != 0.0f;
  // bfloat16 products (P and dS rounded to bfloat16 as operands, as flash attention on GPUs
  // does), unless the tile holds NaN or inf: those take the float32 path, which keeps them out of
  // the rows and keys that do not see them.
  const bool pairs = kv.kt_pairs != nullptr && !check_hidden;
  // (and on AMX tiles where the pack has their operands: AmxDims)
  [[maybe_unused]] const bool amx = pairs && kv.k_amx != nullptr;
  [[maybe_unused]] const int64_t d2 = (d + 1) / 2, dv2 = (dv + 1) / 2;
  ScoreTile(hv, i0, valid, j0, j1, kv.kt + jb * kBlockK * d, qs.qt + ib * d * kBlockQ, st, th,
            raw, &scratch.program_regs, nullptr,
            pairs ? kv.kt_pairs + jb * kBlockK * d2 : nullptr,
            pairs ? qs.qt_pairs + ib * d2 * kBlockQ : nullptr,
            amx ? kv.k_amx + j0 * d : nullptr);
  // Non-finite packed rows: which keys and rows the tile hides (their products are cleaned below).
  const HiddenInTile hidden = check_hidden ? HiddenInTile(st, nk, valid) : HiddenInTile();
#if defined(ATTNAUX_BF16_PAIRS)
  // the tile's rows of P or dS in bfloat16, lanes in order: query pairs for dV and dK
  uint32_t* lane_pairs = reinterpret_cast<uint32_t*>(scratch.words.get());
  auto round_lanes = [&](const float* x) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(lane_pairs);
    for (int64_t e = 0; e < n; e += kLanes) StoreBf16(dst + e, Load(x + e));
  };
#endif
#if defined(ATTNAUX_AMX)
  // AmxGemm64 with the head dim in C's lanes (dV += P dO, dK += dS Q): A the block's P^T or dS^T
  // rows in bfloat16, all kBlockK of them (the keys outside [j0, j1) 0, so that C's rows past
  // the tile's gain 0), B the query pairs of dO's or Q's rows, 64 lanes of C a product
  auto amx_head_lanes = [&](const float* x, const uint32_t* b_rows, int64_t width, float* c) {
    static_assert(kBlockQ == 64 && kBlockK % 16 == 0, "AmxGemm64: 64 lanes, 16-row tiles");
    uint16_t* a = reinterpret_cast<uint16_t*>(lane_pairs);
    std::fill(a, a + key_offset * kBlockQ, uint16_t{0});
    for (int64_t e = 0; e < n; e += kLanes) StoreBf16(a + key_offset * kBlockQ + e, Load(x + e));
    std::fill(a + (key_offset + nk) * kBlockQ, a + kBlockK * kBlockQ, uint16_t{0});
    for (int64_t c0 = 0; c0 < width; c0 += 64) {
      AmxGemm64(kBlockK, kBlockQ / 2, a, kBlockQ, b_rows + c0, width, c + c0, width, true);
    }
  };
#endif
  for (int64_t r = 0; r < nk; ++r) {
    for (int v = 0; v < kQVectors; ++v) {
      const int64_t x = r * kBlockQ + v * kLanes;
      Store(pr + x, Exp(Load(st + x) - Load(qs.lse_eff + i0 + v * kLanes)));
    }
  }
  if (hv.dropout()) DropoutTile(hv, i0, valid, j0, j1, drop);
  // dP^T = V dO^T
#if defined(ATTNAUX_AMX)
  if (amx) {  // (rows past nk: into ds's spare rows, never read)
    AmxGemm64((nk + 15) / 16 * 16, dv / 2, kv.v_amx + j0 * dv, dv,
              qs.dot_pairs + ib * dv2 * kBlockQ, kBlockQ, ds, kBlockQ, false);
  } else
#endif
#if defined(ATTNAUX_BF16_PAIRS)
  if (pairs) {
    PairGemmLanes<1>(nk, dv2, kv.vt_pairs + jb * kBlockK * dv2 + key_offset, kBlockK,
                     qs.dot_pairs + ib * dv2 * kBlockQ, kBlockQ, kQVectors, ds, kBlockQ, false);
  } else
#endif
  {
    GemmLanes<1>(nk, dv, kv.vt + jb * kBlockK * dv + key_offset, kBlockK,
                 qs.dot + ib * dv * kBlockQ, kBlockQ, kQVectors, ds, kBlockQ, false);
  }
  if (dv_block != nullptr) {
    // dV += (P * drop) dO; st is free now and holds P * drop.
    const float* pd = pr;
    if (hv.dropout()) {
      for (int64_t x = 0; x < n; x += kLanes) Store(st + x, Load(pr + x) * Load(drop + x));
      pd = st;
    }
#if defined(ATTNAUX_AMX)
    if (amx) {
      amx_head_lanes(pd, qs.do_pairs + i0 / 2 * ql.dvp, ql.dvp, dv_block);
    } else
#endif
#if defined(ATTNAUX_BF16_PAIRS)
    if (pairs) {
      round_lanes(pd);
      PairGemmLanes<kBlockQ / 2>(nk, kBlockQ / 2, lane_pairs, 1, qs.do_pairs + i0 / 2 * ql.dvp,
                                 ql.dvp, ql.dvp / kLanes, dv_block + key_offset * ql.dvp, ql.dvp,
                                 true);
    } else
#endif
    {
      GemmLanes<kBlockQ>(nk, kBlockQ, pd, 1, qs.do_rows + i0 * ql.dvp, ql.dvp, ql.dvp / kLanes,
                         dv_block + key_offset * ql.dvp, ql.dvp, true);
    }
  }
  // dS = P * (dP * drop - Dt)
  for (int64_t r = 0; r < nk; ++r) {
    for (int v = 0; v < kQVectors; ++v) {
      const int64_t x = r * kBlockQ + v * kLanes;
      VecF dp = Load(ds + x);
      if (hv.dropout()) dp *= Load(drop + x);
      Store(ds + x, Load(pr + x) * (dp - Load(qs.dt + i0 + v * kLanes)));
    }
  }
  if (hidden.any_key || hidden.any_row) {
    // dS of a hidden key or row is 0 * (dP - Dt), and dP there may be 0 * NaN: make it 0.
    for (int64_t r = 0; r < nk; ++r) {
      for (int64_t lane = 0; lane < kBlockQ; ++lane) {
        if (hidden.keys[r] || hidden.rows[lane]) ds[r * kBlockQ + lane] = 0.0f;
      }
    }
  }
  if (dqt != nullptr && dbias != nullptr) {
    for (int64_t lane = 0; lane < valid; ++lane) {
      float* row = dbias + (i0 + lane) * p.kv_len;
      for (int64_t r = 0; r < nk; ++r) row[j0 + r] = ds[r * kBlockQ + lane];
    }
  }
  if (hv.program != nullptr) {
    // dS of the scores score_mod read (softcapped), and its captured arrays' share
    ScoreProgramBackward(*hv.program, hv.Site(i0, j0), nk, raw, ds, dconsts,
                         scratch.program_regs, scratch.program_adj);
  }
  if (th != nullptr) {
    for (int64_t x = 0; x < n; x += kLanes) {
      VecF t = Load(th + x);
      Store(ds + x, Load(ds + x) * (1.0f - t * t));
    }
  }
#if defined(ATTNAUX_AMX)
  if (amx) {
    if (dk_block != nullptr) amx_head_lanes(ds, qs.q_pairs + i0 / 2 * ql.dp, ql.dp, dk_block);
    if (dqt != nullptr) {
      // dS^T's key pairs of the whole block (0 outside [j0, j1)), then dQ^T += K^T dS^T
      uint32_t* key_pairs = lane_pairs + kBlockK * kBlockQ / 2;
      BlockKeyPairs(ds, jb, j0, j1, key_pairs);
      AmxGemm64(d, kBlockK / 2, kv.kt_amx + jb * d * kBlockK, kBlockK, key_pairs, kBlockQ, dqt,
                kBlockQ, true);
    }
    return;
  }
#endif
#if defined(ATTNAUX_BF16_PAIRS)
  if (pairs) {
    if (dk_block != nullptr) {
      round_lanes(ds);
      PairGemmLanes<kBlockQ / 2>(nk, kBlockQ / 2, lane_pairs, 1, qs.q_pairs + i0 / 2 * ql.dp,
                                 ql.dp, ql.dp / kLanes, dk_block + key_offset * ql.dp, ql.dp,
                                 true);
    }
    if (dqt != nullptr) {
      // (a partner outside [j0, j1) has dS = 0 and a finite K row)
      uint32_t* key_pairs = lane_pairs + kBlockK * kBlockQ / 2;
      int64_t y0, y1;
      KeyPairsOfTile(ds, jb, j0, j1, key_pairs, &y0, &y1);
      PairGemmLanes<1>(d, y1 - y0, kv.k_pairs + (jb * kBlockK / 2 + y0) * d, d, key_pairs,
                       kBlockQ, kQVectors, dqt, kBlockQ, true);
    }
    return;
  }
#endif
  if (dk_block != nullptr) {
    const float* q_tile = qs.q_rows + i0 * ql.dp;
    if (hidden.any_row) {
      q_tile = CleanRows(q_tile, ql.dp, kBlockQ, ql.dp, hidden.rows, scratch.clean);
    }
    GemmLanes<kBlockQ>(nk, kBlockQ, ds, 1, q_tile, ql.dp, ql.dp / kLanes,
                       dk_block + key_offset * ql.dp, ql.dp, true);
  }
  if (dqt != nullptr) {
    const float* k_tile = kv.k_rows + j0 * d;
    if (hidden.any_key) k_tile = CleanRows(k_tile, d, nk, d, hidden.keys, scratch.clean);
    GemmLanes<1>(d, nk, k_tile, d, ds, kBlockQ, kQVectors, dqt, kBlockQ, true);
  }
}

// Writes rows [j0, j1) of dk/dv (kv head hkv) from float32 accumulators, times `scale` for dk.
inline void StoreKvGrads(const AttentionParams& p, const BackwardOutputs& outputs, int64_t b,
                         int64_t hkv, int64_t j0, int64_t j1, const float* dk_rows,
                         int64_t ldk, const float* dv_rows, int64_t ldv) {
  std::vector<float> row(p.head_dim);
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t token = (b * p.kv_len + j) * p.kv_heads + hkv;
    for (int64_t x = 0; x < p.head_dim; ++x) row[x] = dk_rows[(j - j0) * ldk + x] * p.scale;
    StoreRow(p.elem, outputs.dk, token * p.head_dim, p.head_dim, row.data());
    StoreRow(p.elem, outputs.dv, token * p.v_dim, p.v_dim, dv_rows + (j - j0) * ldv);
  }
}

// Writes rows [i0, i1) of dq (query head h) from dQ^T blocks ([D][BQ] each), times scale.
inline void StoreQGrads(const AttentionParams& p, const BackwardOutputs& outputs, int64_t b,
                        int64_t h, int64_t i0, int64_t i1, const float* dqt_blocks) {
  std::vector<float> row(p.head_dim);
  for (int64_t i = i0; i < i1; ++i) {
    const float* blk = dqt_blocks + ((i - i0) / kBlockQ) * p.head_dim * kBlockQ;
    const int64_t lane = (i - i0) % kBlockQ;
    for (int64_t x = 0; x < p.head_dim; ++x) row[x] = blk[x * kBlockQ + lane] * p.scale;
    StoreRow(p.elem, outputs.dq, ((b * p.q_len + i) * p.q_heads + h) * p.head_dim, p.head_dim,
             row.data());
  }
}

// Backward: pack K/V and Q/dO sides, then either
//  - one task per (batch, kv head) that owns dK/dV of its kv head and dQ of its query heads
//    (kv blocks outer; query heads, then query blocks inner), or, when there are fewer of those
//    than threads,
//  - two passes: dK/dV per (batch, kv head, kv block), then dQ per (batch, head, query block).
// Both visit the same tiles and accumulate every output in the same order (dK/dV: query head,
// then query block; dQ: key block), so they give bitwise identical results.
inline void FlashBackward(const AttentionParams& params, const BackwardInputs& in,
                          const BackwardOutputs& outputs, ffi::ThreadPool* pool) {
  const TileSegments segment_tiles(params);
  const AttentionParams p = segment_tiles.With(params);
  if (p.batch == 0) return;
  const int64_t d = p.head_dim, group = p.group();
  const KvPackLayout kv_layout(p, /*bwd=*/true);
  const QPackLayout q_layout(p);
  const int64_t nqb = q_layout.num_blocks, nkb = kv_layout.num_blocks;
  const int64_t dqt_size = nqb * d * kBlockQ;  // per query head
  // The consts' gradient of a score program: one partial sum per (batch, head, query block),
  // each accumulated over key blocks in ascending order by both schemes, then summed over query
  // blocks in order, so the result does not depend on the scheme (or the threads).
  const ScoreProgram* program = static_cast<const ScoreProgram*>(p.score_program);
  const int64_t n_consts = outputs.dconsts != nullptr ? program->data_size : 0;
  const bool const_grads = n_consts > 0 && program->any_gradient_const;
  const int64_t dconst_size = const_grads ? nqb * n_consts : 0;  // per query head
  const int64_t per_batch = p.kv_heads * kv_layout.size() +
                            p.q_heads * (q_layout.size() + dqt_size + dconst_size);
  const int64_t chunk = BatchChunk(per_batch, p.batch);
  FloatBuffer kv_packed(chunk * p.kv_heads * kv_layout.size());
  FloatBuffer q_packed(chunk * p.q_heads * q_layout.size());
  FloatBuffer dqt_all(chunk * p.q_heads * dqt_size);
  FloatBuffer dconst_all(chunk * p.q_heads * dconst_size);
  if (outputs.dconsts != nullptr && !const_grads) {
    std::fill(outputs.dconsts, outputs.dconsts + p.batch * p.q_heads * n_consts, 0.0f);
  }
  auto dconst_block = [&](int64_t bl, int64_t h, int64_t ib) -> float* {
    if (!const_grads) return nullptr;
    float* at = dconst_all.get() + ((bl * p.q_heads + h) * nqb + ib) * n_consts;
    return at;
  };
  const int64_t threads = pool != nullptr ? pool->num_threads() : 0;
  const int64_t dp = q_layout.dp, dvp = q_layout.dvp;

  for (int64_t b0 = 0; b0 < p.batch; b0 += chunk) {
    const int64_t nb = std::min(chunk, p.batch - b0);
    const int64_t kv_tasks = nb * kv_layout.num_blocks;
    ParallelFor(pool, kv_tasks + nb * p.q_heads, [&](int64_t t) {
      if (t < kv_tasks) {
        const int64_t bl = t / kv_layout.num_blocks, jb = t % kv_layout.num_blocks;
        std::vector<float> stage;
        PackKvBlock(p, b0 + bl, jb, kv_layout,
                    kv_packed.get() + bl * p.kv_heads * kv_layout.size(), stage);
      } else {
        t -= kv_tasks;
        PackQ(p, in, b0 + t / p.q_heads, t % p.q_heads, q_layout,
              q_packed.get() + t * q_layout.size());
      }
    });
    auto kv_pack = [&](int64_t bl, int64_t hkv) {
      return KvPackAt(kv_layout, kv_packed.get() + (bl * p.kv_heads + hkv) * kv_layout.size());
    };
    auto q_pack = [&](int64_t bl, int64_t h) {
      return QPackAt(q_layout, q_packed.get() + (bl * p.q_heads + h) * q_layout.size());
    };
    auto dbias_head = [&](int64_t b, int64_t h) {
      return outputs.dbias != nullptr ? outputs.dbias + (b * p.q_heads + h) * p.q_len * p.kv_len
                                      : nullptr;
    };

    if (nb * p.kv_heads >= threads) {
      ParallelFor(pool, nb * p.kv_heads, [&](int64_t t) {
        const int64_t bl = t / p.kv_heads, hkv = t % p.kv_heads, b = b0 + bl;
        const KvPack kv = kv_pack(bl, hkv);
        TileScratch scratch;
        FloatBuffer dk_block(kBlockK * dp), dv_block(kBlockK * dvp);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hkv * group + g;
          float* dqt = dqt_all.get() + (bl * p.q_heads + h) * dqt_size;
          std::fill(dqt, dqt + dqt_size, 0.0f);
          if (float* db = dbias_head(b, h)) std::fill(db, db + p.q_len * p.kv_len, 0.0f);
          if (const_grads && nqb > 0) {
            std::fill(dconst_block(bl, h, 0), dconst_block(bl, h, 0) + dconst_size, 0.0f);
          }
        }
        for (int64_t jb = 0; jb < nkb; ++jb) {
          std::fill(dk_block.get(), dk_block.get() + kBlockK * dp, 0.0f);
          std::fill(dv_block.get(), dv_block.get() + kBlockK * dvp, 0.0f);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = hkv * group + g;
            const HeadView hv(p, b, h);
            const QPack qs = q_pack(bl, h);
            float* dqt = dqt_all.get() + (bl * p.q_heads + h) * dqt_size;
            for (int64_t ib = 0; ib < nqb; ++ib) {
              BackwardTile(hv, kv, qs, q_layout, ib, jb, dk_block.get(), dv_block.get(),
                           dqt + ib * d * kBlockQ, dbias_head(b, h), scratch,
                           dconst_block(bl, h, ib));
            }
          }
          const int64_t j0 = jb * kBlockK, j1 = std::min(j0 + kBlockK, p.kv_len);
          StoreKvGrads(p, outputs, b, hkv, j0, j1, dk_block.get(), dp, dv_block.get(), dvp);
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hkv * group + g;
          StoreQGrads(p, outputs, b, h, 0, p.q_len,
                      dqt_all.get() + (bl * p.q_heads + h) * dqt_size);
        }
      });
    } else {
      // Pass 1: dK/dV per (batch, kv head, kv block).
      ParallelFor(pool, nb * p.kv_heads * nkb, [&](int64_t t) {
        const int64_t jb = t % nkb, hkv = (t / nkb) % p.kv_heads, bl = t / (nkb * p.kv_heads);
        const int64_t b = b0 + bl;
        const KvPack kv = kv_pack(bl, hkv);
        TileScratch scratch;
        FloatBuffer dk_block(kBlockK * dp), dv_block(kBlockK * dvp);
        std::fill(dk_block.get(), dk_block.get() + kBlockK * dp, 0.0f);
        std::fill(dv_block.get(), dv_block.get() + kBlockK * dvp, 0.0f);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hkv * group + g;
          const HeadView hv(p, b, h);
          const QPack qs = q_pack(bl, h);
          for (int64_t ib = 0; ib < nqb; ++ib) {
            BackwardTile(hv, kv, qs, q_layout, ib, jb, dk_block.get(), dv_block.get(), nullptr,
                         nullptr, scratch);
          }
        }
        const int64_t j0 = jb * kBlockK, j1 = std::min(j0 + kBlockK, p.kv_len);
        StoreKvGrads(p, outputs, b, hkv, j0, j1, dk_block.get(), dp, dv_block.get(), dvp);
      });
      // Pass 2: dQ (and dbias) per (batch, query head, query block).
      ParallelFor(pool, nb * p.q_heads * nqb, [&](int64_t t) {
        const int64_t ib = t % nqb, h = (t / nqb) % p.q_heads, bl = t / (nqb * p.q_heads);
        const int64_t b = b0 + bl;
        const KvPack kv = kv_pack(bl, h / group);
        const QPack qs = q_pack(bl, h);
        const HeadView hv(p, b, h);
        TileScratch scratch;
        float* dqt = dqt_all.get() + (bl * p.q_heads + h) * dqt_size + ib * d * kBlockQ;
        std::fill(dqt, dqt + d * kBlockQ, 0.0f);
        const int64_t i0 = ib * kBlockQ, i1 = std::min(i0 + kBlockQ, p.q_len);
        float* db = dbias_head(b, h);
        if (db != nullptr) std::fill(db + i0 * p.kv_len, db + i1 * p.kv_len, 0.0f);
        float* dc = dconst_block(bl, h, ib);
        if (dc != nullptr) std::fill(dc, dc + n_consts, 0.0f);
        for (int64_t jb = 0; jb < nkb; ++jb) {
          BackwardTile(hv, kv, qs, q_layout, ib, jb, nullptr, nullptr, dqt, db, scratch, dc);
        }
        StoreQGrads(p, outputs, b, h, i0, i1, dqt);
      });
    }
    if (const_grads) {
      ParallelFor(pool, nb * p.q_heads, [&](int64_t t) {
        const int64_t bl = t / p.q_heads, h = t % p.q_heads;
        float* dst = outputs.dconsts + ((b0 + bl) * p.q_heads + h) * n_consts;
        if (nqb == 0) {
          std::fill(dst, dst + n_consts, 0.0f);
          return;
        }
        std::copy(dconst_block(bl, h, 0), dconst_block(bl, h, 0) + n_consts, dst);
        for (int64_t ib = 1; ib < nqb; ++ib) {
          const float* src = dconst_block(bl, h, ib);
          for (int64_t x = 0; x < n_consts; ++x) dst[x] += src[x];
        }
      });
    }
  }
}

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_ATTENTION_CPU_H_
