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
// - bfloat16 inputs on a CPU with AVX512_BF16 (ATTNAUX_BF16_PAIRS): every product on VDPBF16PS
//   (PairGemmLanes), as the flash kernels do, at about twice the float32 rate; without it the
//   exponentials and P's traffic would leave bfloat16 barely faster than float32. Q, K, V and dO
//   as given; P * drop and dS rounded to bfloat16 only as product operands (P as stored is the
//   float32 P rounded once, as before; in the backward the saved P is already bfloat16);
//   statistics and the gradient math in float32. Tiles whose key block (or, backward, query
//   block) holds NaN or inf keep the float32 products, so NaN and inf propagate as before. The
//   forward packs K, V and Q as pair words straight from the bfloat16 inputs (float32 copies only
//   where a block holds NaN or inf). This path is its own instantiation (the template argument
//   kPairs of the block functions, packs and drivers): the float32 instantiation is the code it
//   was, so float32 (and bfloat16 without AVX512_BF16) results and speed are unchanged.
// Both visit the flash kernels' tiles (TileKeys with the segment ids): with packed sequences,
// causal masks, windows or lengths, a (query block, key tile) pair with no visible pair costs
// nothing but writing its zeros into P (and dbias). Inputs are read only where visible, as in the
// flash kernels.
#ifndef ATTNAUX_CSRC_CPU_PROBS_CPU_H_
#define ATTNAUX_CSRC_CPU_PROBS_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
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

// 16 floats -> bfloat16 with FloatToBf16's rounding (nearest even, NaN stays a quiet NaN,
// subnormals kept: vcvtneps2bf16 would flush them, changing stored P).
inline void StoreRowBf16(uint16_t* dst, const float* src) {
  for (int64_t x = 0; x < 16; x += kLanes) {
    VecU32 u;
    std::memcpy(&u, src + x, sizeof(u));
    const VecU32 nan = (u & 0x7fffffffu) > 0x7f800000u;
    const VecU32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const VecU32 quiet = (u >> 16) | 0x40u;
    const VecBf16 h = __builtin_convertvector(nan ? quiet : rounded, VecBf16);
    std::memcpy(dst + x, &h, sizeof(h));
  }
}

// Writes tile rows r < nk (keys j0 + r) of lanes [0, valid) (query rows) into the row-major
// array `dst` whose row of lane 0 starts at element `row0` (rows `skv` elements apart). Float32
// goes through 16 x 16 register transposes, stored non-temporally where aligned (P and dbias
// are large and not read again by this pass); so does bfloat16 in the kPairs instantiation (the
// bfloat16 forward on VDPBF16PS, whose products are fast enough that P's element-by-element
// stores would weigh on it), rounded as FromFloat rounds.
template <bool kPairs = false>
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
  if constexpr (kPairs) {
    if (kHasTranspose16 && elem == Elem::kBF16) {
      uint16_t* base = static_cast<uint16_t*>(dst) + row0 + j0;
      lanes16 = valid / 16 * 16;
      keys16 = nk / 16 * 16;
      alignas(64) float block[16 * 16];
      for (int64_t l0 = 0; l0 < lanes16; l0 += 16) {
        for (int64_t r0 = 0; r0 < keys16; r0 += 16) {
          Transpose16(tile + r0 * kBlockQ + l0, kBlockQ, block, 16, false);
          for (int64_t x = 0; x < 16; ++x) {
            StoreRowBf16(base + (l0 + x) * skv + r0, block + x * 16);
          }
        }
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
// lanes >= valid. (kPairs: bfloat16 through 16 x 16 transposes too.)
template <bool kPairs = false>
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
  if constexpr (kPairs) {
    if (kHasTranspose16 && elem == Elem::kBF16) {
      const uint16_t* base = static_cast<const uint16_t*>(src) + row0 + j0;
      lanes16 = valid / 16 * 16;
      keys16 = nk / 16 * 16;
      alignas(64) float block[16 * 16];
      for (int64_t l0 = 0; l0 < lanes16; l0 += 16) {
        for (int64_t r0 = 0; r0 < keys16; r0 += 16) {
          for (int64_t x = 0; x < 16 * 16; x += kLanes) {
            Store(block + x, LoadBf16(base + (l0 + x / 16) * skv + r0 + x % 16));
          }
          Transpose16(block, 16, tile + r0 * kBlockQ + l0, kBlockQ, false);
        }
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

// Pair words of the rows 2x, 2x + 1 of a transposed block t [n][width] (leading dimension
// width, a whole number of vectors; an odd n's last partner is 0): out[x * width + c] =
// PairWord(t[2x][c], t[2x + 1][c]), PackColumnPairs' words of the untransposed rows, a vector at
// a time (that scalar loop cost as much as a tile's products).
inline void PackTransposedPairs(const float* t, int64_t n, int64_t width, uint32_t* out) {
  for (int64_t x = 0; x < (n + 1) / 2; ++x) {
    const float* lo = t + 2 * x * width;
    for (int64_t c = 0; c < width; c += kLanes) {
      VecU32 a, b = VecU32{};
      std::memcpy(&a, lo + c, sizeof(a));
      if (2 * x + 1 < n) std::memcpy(&b, lo + width + c, sizeof(b));
      const VecU32 w = (a >> 16) | (b & 0xffff0000u);
      std::memcpy(out + x * width + c, &w, sizeof(w));
    }
  }
}

// Whether no lane of a mask is set.
inline bool NoneSet(VecU32 m) {
  bool ok = true;
  for (int lane = 0; lane < kLanes; ++lane) ok &= m[lane] == 0;
  return ok;
}

// Lanes of pair words with a NaN or inf in either half: all ones.
inline VecU32 NonFinitePairs(VecU32 w) {
  return (VecU32)(((w & 0x7f800000u) == 0x7f800000u) | ((w & 0x7f80u) == 0x7f80u));
}

// Pair words straight from bfloat16 inputs (the kPairs forward): widening to float32 and taking
// the high halves back is exact, so these are the words that PackTransposedPairs and PackRowPairs
// make from the float32 rows, without converting anything. Both return whether the rows they
// read hold no NaN or inf (exponent bits all ones), as AllFinite of the float32 rows would.
//
// Rows r < count of a bfloat16 input whose row r starts at element first + r * stride, as pair
// words of neighbouring elements (2x, 2x + 1; an odd n's last partner 0): out[r * n2 + x], n2 =
// ceil(n / 2) words a row; rows >= valid zero. The rows are scattered: the next ones prefetched.
inline bool GatherPairWords(const uint16_t* src, int64_t first, int64_t stride, int64_t valid,
                            int64_t count, int64_t n, uint32_t* out) {
  constexpr int64_t kAhead = 8;
  const int64_t n2 = (n + 1) / 2, whole = n / 2;
  VecU32 bad = VecU32{};
  for (int64_t r = 0; r < std::min(kAhead, valid); ++r) {
    PrefetchBytes(reinterpret_cast<const char*>(src + first + r * stride), n * 2);
  }
  for (int64_t r = 0; r < count; ++r) {
    uint32_t* row = out + r * n2;
    if (r >= valid) {
      std::fill(row, row + n2, 0u);
      continue;
    }
    if (r + kAhead < valid) {
      PrefetchBytes(reinterpret_cast<const char*>(src + first + (r + kAhead) * stride), n * 2);
    }
    const uint16_t* in = src + first + r * stride;
    int64_t x = 0;
    for (; x + kLanes <= whole; x += kLanes) {
      VecU32 w;
      std::memcpy(&w, in + 2 * x, sizeof(w));
      bad |= NonFinitePairs(w);
      std::memcpy(row + x, &w, sizeof(w));
    }
    for (; x < n2; ++x) {
      const uint32_t lo = in[2 * x], hi = 2 * x + 1 < n ? in[2 * x + 1] : 0u;
      if ((lo & 0x7f80u) == 0x7f80u || (hi & 0x7f80u) == 0x7f80u) bad[0] = ~0u;
      row[x] = lo | hi << 16;
    }
  }
  return NoneSet(bad);
}

// Pair words of rows 2y, 2y + 1 of a bfloat16 input (rows as in GatherPairWords, count even):
// out[y * n + x] = word(row 2y [x], row 2y + 1 [x]), PackRowPairs' layout.
inline bool InterleaveRowPairs(const uint16_t* src, int64_t first, int64_t stride, int64_t valid,
                               int64_t count, int64_t n, uint32_t* out) {
  VecU32 bad = VecU32{};
  for (int64_t r = 0; r < std::min<int64_t>(valid, count); ++r) {
    PrefetchBytes(reinterpret_cast<const char*>(src + first + r * stride), n * 2);
  }
  for (int64_t y = 0; y < count / 2; ++y) {
    const uint16_t* lo = 2 * y < valid ? src + first + 2 * y * stride : nullptr;
    const uint16_t* hi = 2 * y + 1 < valid ? src + first + (2 * y + 1) * stride : nullptr;
    uint32_t* row = out + y * n;
    int64_t x = 0;
    for (; x + kLanes <= n; x += kLanes) {
      VecBf16 a = VecBf16{}, b = VecBf16{};
      if (lo != nullptr) std::memcpy(&a, lo + x, sizeof(a));
      if (hi != nullptr) std::memcpy(&b, hi + x, sizeof(b));
      const VecU32 w =
          __builtin_convertvector(a, VecU32) | __builtin_convertvector(b, VecU32) << 16;
      bad |= NonFinitePairs(w);
      std::memcpy(row + x, &w, sizeof(w));
    }
    for (; x < n; ++x) {
      const uint32_t a = lo != nullptr ? lo[x] : 0u, b = hi != nullptr ? hi[x] : 0u;
      if ((a & 0x7f80u) == 0x7f80u || (b & 0x7f80u) == 0x7f80u) bad[0] = ~0u;
      row[x] = a | b << 16;
    }
  }
  return NoneSet(bad);
}

// dst[c * ds + r] = src[r * ss + c] for 32-bit words (TransposeBlock's, bit for bit).
inline void TransposeWords(const uint32_t* src, int64_t ss, int64_t rows, int64_t cols,
                           uint32_t* dst, int64_t ds) {
  const int64_t rows16 = kHasTranspose16 ? rows / 16 * 16 : 0;
  const int64_t cols16 = kHasTranspose16 ? cols / 16 * 16 : 0;
  for (int64_t r0 = 0; r0 < rows16; r0 += 16) {
    for (int64_t c0 = 0; c0 < cols16; c0 += 16) {
      // (Transpose16 moves the bits with shuffles: any word pattern survives)
      Transpose16(reinterpret_cast<const float*>(src + r0 * ss + c0), ss,
                  reinterpret_cast<float*>(dst + c0 * ds + r0), ds, false);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = r < rows16 ? cols16 : 0; c < cols; ++c) dst[c * ds + r] = src[r * ss + c];
  }
}

// Whether n floats hold no NaN or inf (AllFinite's answer; independent chains, as the packs of
// the kPairs instantiation check every block).
inline bool FiniteFloats(const float* x, int64_t n) {
  VecU32 bad = VecU32{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VecU32 u;
    std::memcpy(&u, x + i, sizeof(u));
    bad |= (VecU32)((u & 0x7f800000u) == 0x7f800000u);
  }
  bool ok = true;
  for (; i < n; ++i) ok &= (FloatToBits(x[i]) & 0x7f800000u) != 0x7f800000u;
  return ok && NoneSet(bad);
}

// K and V of one (batch, kv head), packed for the products (the layouts of attention_cpu.h's
// KvPack, float32, zero at or beyond kv_seqlens): forward kt [nkb][D][BK] and v_rows [Skvp][Dv];
// backward k_rows [Skvp][D], vt [nkb][Dv][BK] and, with a softcap, kt. With `pairs` (the kPairs
// instantiation: bfloat16 inputs and kHasBf16Pairs) also KvPack's pair words (forward kt_pairs
// and v_pairs, backward vt_pairs and k_pairs) and nonfinite [nkb], as the flash kernels pack
// them: products of tiles whose block is all finite run on VDPBF16PS, the others on the float32
// pack, whose NaN and inf handling this leaves as it was (with a softcap the backward also has
// kt_pairs, to recompute the forward's scores). The forward's pair words come straight
// from the bfloat16 inputs, and its float32 pack is written only for blocks flagged non-finite
// (the only ones whose tiles read it); the backward's float32 pack is whole (a query block with
// NaN or inf takes the float32 products with every key block).
struct ProbsKvLayout {
  int64_t keys, d, dv;
  bool forward, kt, pairs;
  ProbsKvLayout(const AttentionParams& p, bool fwd, bool with_pairs = false)
      : keys(CeilDiv(p.kv_len, kBlockK) * kBlockK),
        d(p.head_dim),
        dv(p.v_dim),
        forward(fwd),
        kt(fwd || p.softcap > 0.0f),
        pairs(with_pairs) {}
  int64_t d2() const { return (d + 1) / 2; }
  int64_t dv2() const { return (dv + 1) / 2; }
  int64_t floats_size() const { return keys * (d + dv) + (!forward && kt ? keys * d : 0); }
  int64_t pairs_size() const {
    if (!pairs) return 0;
    const int64_t words = forward ? keys * d2() + keys / 2 * dv
                                  : keys * dv2() + keys / 2 * d + (kt ? keys * d2() : 0);
    return words + keys / kBlockK;
  }
  int64_t size() const { return floats_size() + pairs_size(); }
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
    if (pairs) {
      const uint32_t* words = reinterpret_cast<const uint32_t*>(base + floats_size());
      if (forward) {
        pack.kt_pairs = words;
        pack.v_pairs = words + keys * d2();
        pack.nonfinite = base + floats_size() + pairs_size() - keys / kBlockK;
      } else {
        pack.vt_pairs = words;
        pack.k_pairs = words + keys * dv2();
        pack.kt_pairs = kt ? pack.k_pairs + keys / 2 * d : nullptr;
        pack.nonfinite = base + floats_size() + pairs_size() - keys / kBlockK;
      }
    }
    return pack;
  }
};

template <bool kPairs>
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
    if constexpr (kPairs) {
      if (l.forward) {
        // the pair words straight from the bfloat16 inputs (K's words staged in `rows`); the
        // float32 pack only where the block holds NaN or inf (only its tiles read it)
        const int64_t jb = j0 / kBlockK;
        uint32_t* stage = reinterpret_cast<uint32_t*>(rows.get());
        const bool k_finite = GatherPairWords(static_cast<const uint16_t*>(p.k), k_first,
                                              stride_k, valid, kBlockK, d, stage);
        const bool v_finite = InterleaveRowPairs(
            static_cast<const uint16_t*>(p.v), v_first, stride_v, valid, kBlockK, dv,
            const_cast<uint32_t*>(pack.v_pairs) + jb * (kBlockK / 2) * dv);
        const bool finite = k_finite && v_finite;
        TransposeWords(stage, l.d2(), kBlockK, l.d2(),
                       const_cast<uint32_t*>(pack.kt_pairs) + jb * l.d2() * kBlockK, kBlockK);
        const_cast<float*>(pack.nonfinite)[jb] = finite ? 0.0f : 1.0f;
        if (finite) continue;
      }
    }
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
    if constexpr (kPairs) {
      // (the float32 pack above stays: tiles of blocks flagged non-finite run on it)
      auto words = [](const uint32_t* at) { return const_cast<uint32_t*>(at); };
      const int64_t jb = j0 / kBlockK;
      if (!l.forward) {
        const float* k_rows = pack.k_rows + j0 * d;
        PackTransposedPairs(pack.vt + j0 * dv, dv, kBlockK,
                            words(pack.vt_pairs) + jb * l.dv2() * kBlockK);
        PackRowPairs(k_rows, d, kBlockK, d, words(pack.k_pairs) + jb * (kBlockK / 2) * d);
        if (l.kt) {
          PackTransposedPairs(pack.kt + j0 * d, d, kBlockK,
                              words(pack.kt_pairs) + jb * l.d2() * kBlockK);
        }
        const bool finite =
            FiniteFloats(k_rows, kBlockK * d) && FiniteFloats(rows.get(), kBlockK * dv);
        const_cast<float*>(pack.nonfinite)[jb] = finite ? 0.0f : 1.0f;
      }
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

// The kPairs instantiation's scratch: also the pair words of Q^T [D2][BQ] and of one tile's
// P * drop [BK/2][BQ] (keys paired).
struct ProbsForwardPairScratch : ProbsForwardScratch {
  FloatBuffer qt_pairs, p_pairs;
  explicit ProbsForwardPairScratch(const AttentionParams& p)
      : ProbsForwardScratch(p),
        qt_pairs((p.head_dim + 1) / 2 * kBlockQ),
        p_pairs(kBlockK / 2 * kBlockQ) {}
};

template <bool kPairs>
using ForwardScratchOf = std::conditional_t<kPairs, ProbsForwardPairScratch, ProbsForwardScratch>;

#if defined(ATTNAUX_BF16_PAIRS)
// KeyPairsOfTile (attention_cpu.h) of the tile rows times factor[vector of lanes]: the same words
// as scaling the rows in place first.
inline void ScaledKeyPairsOfTile(const float* rows, const VecF* factor, int64_t jb, int64_t j0,
                                 int64_t j1, uint32_t* out, int64_t* y0, int64_t* y1) {
  const int64_t jbase = jb * kBlockK, nk = j1 - j0;
  *y0 = (j0 - jbase) / 2;
  *y1 = (j1 - jbase + 1) / 2;
  for (int64_t y = *y0; y < *y1; ++y) {
    const int64_t r = jbase + 2 * y - j0;  // row of key jbase + 2y (-1: none)
    for (int v = 0; v < kQVectors; ++v) {
      const VecF lo = r >= 0 ? Load(rows + r * kBlockQ + v * kLanes) * factor[v] : VecF{};
      const VecF hi = r + 1 < nk ? Load(rows + (r + 1) * kBlockQ + v * kLanes) * factor[v] : VecF{};
      StorePairsBf16(out + (y - *y0) * kBlockQ + v * kLanes, lo, hi);
    }
  }
}
#endif

// lse of each lane from its max m and sum l = sum exp(s - m) (flash's final statistics), and
// how P is normalised: P = e * exp(m_t - shift) * scale, dividing by the row sum
// (RowStatistics in probs_common.h); shift = +inf and scale = 0 where the row has no visible
// key or is padding, so that P = 0 there.
inline void BlockLse(const HeadView& hv, int64_t valid, const float* m_row, const float* l_row,
                     float* lse, float* shift, float* scale) {
  for (int64_t lane = 0; lane < kBlockQ; ++lane) {
    RowStats stats{hv.has_sink ? hv.sink : -kInf, kInf, 0.0f};  // padding
    if (lane < valid) stats = RowStatistics(hv, m_row[lane], l_row[lane]);
    lse[lane] = stats.lse;
    shift[lane] = stats.shift;
    scale[lane] = stats.scale;
  }
}

// One query block of query head h. kPairs (bfloat16 inputs on AVX512_BF16): the products on
// VDPBF16PS, S from the exact bfloat16 Q and K, P * drop rounded to bfloat16 as the operand of
// O^T += V^T (P * drop)^T (as flash does), unless the key block holds NaN or inf: those tiles keep
// the float32 products and their NaN handling.
template <bool kPairs>
inline void ProbsForwardBlock(const AttentionParams& p, const KvPack& kv, int64_t b, int64_t h,
                              int64_t ib, const ProbsForwardOutputs& o,
                              ForwardScratchOf<kPairs>& sc) {
  const int64_t d = p.head_dim, dv = p.v_dim, skv = p.kv_len;
  const HeadView hv(p, b, h);
  const int64_t i0 = ib * kBlockQ;
  const int64_t rows_in_block = std::min(kBlockQ, p.q_len - i0);
  const int64_t valid = std::min(hv.rows.ValidRows(i0), rows_in_block);
  float* qt = sc.qt.get();
  [[maybe_unused]] const int64_t d2 = (d + 1) / 2;
  [[maybe_unused]] uint32_t* qt_pairs = nullptr;
  [[maybe_unused]] bool have_qt = false;
  if constexpr (kPairs) {
    // Q^T's pair words straight from the bfloat16 input (staged in sc.rows); Q^T in float32
    // only once a tile of a non-finite key block needs it
    qt_pairs = reinterpret_cast<uint32_t*>(sc.qt_pairs.get());
    uint32_t* stage = reinterpret_cast<uint32_t*>(sc.rows.get());
    GatherPairWords(static_cast<const uint16_t*>(p.q), ((b * p.q_len + i0) * p.q_heads + h) * d,
                    p.q_heads * d, valid, kBlockQ, d, stage);
    TransposeWords(stage, d2, kBlockQ, d2, qt_pairs, kBlockQ);
  } else {
    GatherRows(p.elem, p.q, ((b * p.q_len + i0) * p.q_heads + h) * d, p.q_heads * d, valid,
               kBlockQ, d, sc.rows.get(), d);
    TransposeBlock(sc.rows.get(), d, kBlockQ, d, qt, kBlockQ);
  }
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
    // (with pairs the product finds the tile max as it stores the scores, when they are final:
    // the same maxima as the loop below, a pass over the tile fewer)
    VecF fused_max[kQVectors];
    bool have_max = false;
    if constexpr (kPairs) {
      const bool pairs = kv.nonfinite[jb] == 0.0f;
      if (!pairs && !have_qt) {
        GatherRows(p.elem, p.q, ((b * p.q_len + i0) * p.q_heads + h) * d, p.q_heads * d, valid,
                   kBlockQ, d, sc.rows.get(), d);
        TransposeBlock(sc.rows.get(), d, kBlockQ, d, qt, kBlockQ);
        have_qt = true;
      }
      have_max = ScoreTile(hv, i0, valid, j0, j1, kv.kt + jb * kBlockK * d, qt, st, nullptr,
                           nullptr, nullptr, pairs ? fused_max : nullptr,
                           pairs ? kv.kt_pairs + jb * kBlockK * d2 : nullptr,
                           pairs ? qt_pairs : nullptr);
    } else {
      ScoreTile(hv, i0, valid, j0, j1, kv.kt + jb * kBlockK * d, qt, st, nullptr);
    }
    for (int v = 0; v < kQVectors; ++v) {
      VecF tile_max = Splat(-kInf);
      if (have_max) {
        tile_max = fused_max[v];
      } else {
        for (int64_t r = 0; r < nk; ++r) {
          tile_max = Max(tile_max, Load(st + r * kBlockQ + v * kLanes));
        }
      }
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
#if defined(ATTNAUX_BF16_PAIRS)
    if constexpr (kPairs) {
      if (o.probs == nullptr && !hv.dropout() && kv.nonfinite[jb] == 0.0f) {
        // P only as the product's operand: rounded as it is formed, a pass over the tile fewer
        VecF factor[kQVectors];
        for (int v = 0; v < kQVectors; ++v) {
          factor[v] = Exp(Load(sc.tile_m.get() + jb * kBlockQ + v * kLanes) -
                          Load(shift + v * kLanes)) *
                      Load(scale + v * kLanes);
        }
        uint32_t* pp = reinterpret_cast<uint32_t*>(sc.p_pairs.get());
        int64_t y0, y1;
        ScaledKeyPairsOfTile(st, factor, jb, j0, j1, pp, &y0, &y1);
        PairGemmLanes<1>(dv, y1 - y0, kv.v_pairs + (jb * kBlockK / 2 + y0) * dv, dv, pp, kBlockQ,
                         kQVectors, ot, kBlockQ, true);
        continue;
      }
    }
#endif
    for (int v = 0; v < kQVectors; ++v) {
      const VecF factor = Exp(Load(sc.tile_m.get() + jb * kBlockQ + v * kLanes) -
                              Load(shift + v * kLanes)) *
                          Load(scale + v * kLanes);
      for (int64_t r = 0; r < nk; ++r) {
        float* sp = st + r * kBlockQ + v * kLanes;
        Store(sp, Load(sp) * factor);
      }
    }
    if (o.probs != nullptr) {
      StoreTileRows<kPairs>(p.elem, o.probs, row0, skv, valid, j0, nk, st);
    }
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
#if defined(ATTNAUX_BF16_PAIRS)
    if constexpr (kPairs) {
      if (kv.nonfinite[jb] == 0.0f) {
        // (a partner key outside [j0, j1) has P = 0 and a finite V row: the block is)
        uint32_t* pp = reinterpret_cast<uint32_t*>(sc.p_pairs.get());
        int64_t y0, y1;
        KeyPairsOfTile(w, jb, j0, j1, pp, &y0, &y1);
        PairGemmLanes<1>(dv, y1 - y0, kv.v_pairs + (jb * kBlockK / 2 + y0) * dv, dv, pp, kBlockQ,
                         kQVectors, ot, kBlockQ, true);
        continue;
      }
    }
#endif
    GemmLanes<1>(dv, nk, kv.v_rows + j0 * dv, dv, w, kBlockQ, kQVectors, ot, kBlockQ, true);
  }
  unvisited.Finish();
  TransposeBlock(ot, kBlockQ, dv, kBlockQ, sc.rows.get(), dv);
  for (int64_t lane = 0; lane < rows_in_block; ++lane) {
    StoreRow(p.elem, o.out, ((b * p.q_len + i0 + lane) * p.q_heads + h) * dv, dv,
             sc.rows.get() + lane * dv);
  }
}

template <bool kPairs>
inline void ProbsForwardTasks(const AttentionParams& p, const ProbsForwardOutputs& o,
                              ffi::ThreadPool* pool) {
  const ProbsKvLayout layout(p, /*fwd=*/true, kPairs);
  const int64_t chunk = BatchChunk(p.kv_heads * layout.size(), p.batch);
  FloatBuffer packed(chunk * p.kv_heads * layout.size());
  const int64_t nqb = CeilDiv(p.q_len, kBlockQ);
  for (int64_t b0 = 0; b0 < p.batch; b0 += chunk) {
    const int64_t nb = std::min(chunk, p.batch - b0);
    ParallelFor(pool, nb * p.kv_heads, [&](int64_t t) {
      PackProbsKv<kPairs>(p, b0 + t / p.kv_heads, t % p.kv_heads, layout,
                          packed.get() + t * layout.size());
    });
    ParallelFor(pool, nb * p.q_heads * nqb, [&](int64_t t) {
      const int64_t ib = t % nqb, h = (t / nqb) % p.q_heads, bl = t / (nqb * p.q_heads);
      ForwardScratchOf<kPairs> sc(p);
      const KvPack kv = layout.At(packed.get() + (bl * p.kv_heads + h / p.group()) * layout.size());
      ProbsForwardBlock<kPairs>(p, kv, b0 + bl, h, ib, o, sc);
      StreamFence();
    });
  }
}

inline void ProbsForward(const AttentionParams& params, const ProbsForwardOutputs& o,
                         ffi::ThreadPool* pool) {
  const TileSegments segment_tiles(params);
  const AttentionParams p = segment_tiles.With(params);
  if (p.batch == 0 || p.q_len == 0 || p.q_heads == 0) return;
  if (kHasBf16Pairs && p.elem == Elem::kBF16) {
    ProbsForwardTasks<kHasBf16Pairs>(p, o, pool);
  } else {
    ProbsForwardTasks<false>(p, o, pool);
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

// The kPairs instantiation's scratch: also the pair words of dO^T [Dv2][BQ] (head dims paired),
// of the Q and dO rows [BQ/2][Dp] / [BQ/2][Dvp] (rows paired), of a tile's operands P * drop
// and dS [BK][BQ/2] (lanes paired) and dS [BK/2][BQ] (keys paired), and with a softcap of Q^T
// [D2][BQ].
struct ProbsBackwardPairScratch : ProbsBackwardScratch {
  FloatBuffer dot_pairs, q_pairs, do_pairs, lane_pairs, key_pairs, qt_pairs;
  bool q_finite = true;  // the query block's Q and dO rows hold no NaN or inf
  explicit ProbsBackwardPairScratch(const AttentionParams& p)
      : ProbsBackwardScratch(p),
        dot_pairs((p.v_dim + 1) / 2 * kBlockQ),
        q_pairs(kBlockQ / 2 * dp),
        do_pairs(kBlockQ / 2 * dvp),
        lane_pairs(kBlockK * kBlockQ / 2),
        key_pairs(kBlockK / 2 * kBlockQ),
        qt_pairs(p.softcap > 0.0f ? (p.head_dim + 1) / 2 * kBlockQ : 1) {}
};

template <bool kPairs>
using BackwardScratchOf =
    std::conditional_t<kPairs, ProbsBackwardPairScratch, ProbsBackwardScratch>;

// Packs the query side of one query block (zero beyond the valid rows): q rows, dO rows, dO^T,
// and with a softcap Q^T (kPairs: also their pair words).
template <bool kPairs>
inline void PackQueryBlock(const AttentionParams& p, const ProbsBackwardInputs& in, int64_t b,
                           int64_t h, int64_t i0, int64_t valid, BackwardScratchOf<kPairs>& sc) {
  const int64_t d = p.head_dim, dv = p.v_dim;
  const int64_t token = (b * p.q_len + i0) * p.q_heads + h;
  GatherRows(p.elem, p.q, token * d, p.q_heads * d, valid, kBlockQ, d, sc.q_rows.get(), sc.dp);
  GatherRows(p.elem, in.dout, token * dv, p.q_heads * dv, valid, kBlockQ, dv, sc.do_rows.get(),
             sc.dvp);
  TransposeBlock(sc.do_rows.get(), sc.dvp, kBlockQ, dv, sc.dot.get(), kBlockQ);
  if (p.softcap > 0.0f) TransposeBlock(sc.q_rows.get(), sc.dp, kBlockQ, d, sc.qt.get(), kBlockQ);
  if constexpr (kPairs) {
    auto words = [](const FloatBuffer& buf) { return reinterpret_cast<uint32_t*>(buf.get()); };
    PackTransposedPairs(sc.dot.get(), dv, kBlockQ, words(sc.dot_pairs));
    PackRowPairs(sc.q_rows.get(), sc.dp, kBlockQ, sc.dp, words(sc.q_pairs));
    PackRowPairs(sc.do_rows.get(), sc.dvp, kBlockQ, sc.dvp, words(sc.do_pairs));
    if (p.softcap > 0.0f) PackTransposedPairs(sc.qt.get(), d, kBlockQ, words(sc.qt_pairs));
    sc.q_finite = FiniteFloats(sc.q_rows.get(), kBlockQ * sc.dp) &&
                  FiniteFloats(sc.do_rows.get(), kBlockQ * sc.dvp);
  }
}

// One query block of query head h: dq rows and dbias rows written, dK/dV of the block's keys
// accumulated into dk_acc [Skvp][Dp] / dv_acc [Skvp][Dvp]. kPairs: the products on VDPBF16PS
// (P * drop and dS rounded to bfloat16 as operands, as flash does) unless the key block or the
// query block holds NaN or inf: those tiles keep the float32 products and their NaN handling.
template <bool kPairs>
inline void ProbsBackwardBlock(const AttentionParams& p, const ProbsBackwardInputs& in,
                               const BackwardOutputs& o, const KvPack& kv, int64_t b, int64_t h,
                               int64_t ib, float* dk_acc, float* dv_acc,
                               BackwardScratchOf<kPairs>& sc) {
  const int64_t d = p.head_dim, dv = p.v_dim, skv = p.kv_len, dp = sc.dp, dvp = sc.dvp;
  const HeadView hv(p, b, h);
  const int64_t i0 = ib * kBlockQ;
  const int64_t rows_in_block = std::min(kBlockQ, p.q_len - i0);
  const int64_t valid = std::min(hv.rows.ValidRows(i0), rows_in_block);
  const int64_t row0 = ProbsRow(p, b, h, i0);
  const int64_t elem_size = p.elem == Elem::kF32 ? 4 : 2;
  PackQueryBlock<kPairs>(p, in, b, h, i0, valid, sc);
  const VecF zero = VecF{};
  [[maybe_unused]] auto pair_tile = [&](int64_t jb) {
    if constexpr (kPairs) {
      return kv.nonfinite[jb] == 0.0f && sc.q_finite;
    } else {
      return false;
    }
  };
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
    LoadTileRows<kPairs>(p.elem, in.probs, row0, skv, valid, j0, nk, pt);
#if defined(ATTNAUX_BF16_PAIRS)
    if constexpr (kPairs) {
      if (pair_tile(jb)) {
        const int64_t dv2 = (dv + 1) / 2;
        PairGemmLanes<1>(nk, dv2, kv.vt_pairs + jb * kBlockK * dv2 + key_offset, kBlockK,
                         reinterpret_cast<const uint32_t*>(sc.dot_pairs.get()), kBlockQ,
                         kQVectors, dpt, kBlockQ, false);
      } else {
        GemmLanes<1>(nk, dv, kv.vt + jb * kBlockK * dv + key_offset, kBlockK, sc.dot.get(),
                     kBlockQ, kQVectors, dpt, kBlockQ, false);
      }
    } else
#endif
    {
      GemmLanes<1>(nk, dv, kv.vt + jb * kBlockK * dv + key_offset, kBlockK, sc.dot.get(), kBlockQ,
                   kQVectors, dpt, kBlockQ, false);
    }
    float* drop = hv.dropout() ? sc.drop.get() + j0 * kBlockQ : nullptr;
    if (drop != nullptr) DropoutTile(hv, i0, valid, j0, j1, drop);
    float* g = nullptr;
    if (in.dprobs != nullptr) {
      g = sc.tile.get();
      LoadTileRows<kPairs>(p.elem, in.dprobs, row0, skv, valid, j0, nk, g);
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
      if constexpr (kPairs) {
        // the forward's scores: on the pair product where the forward's was (finite key block)
        const bool pairs = kv.nonfinite[jb] == 0.0f;
        ScoreTile(hv, i0, valid, j0, j1, kv.kt + jb * kBlockK * d, sc.qt.get(), sc.tile.get(),
                  th, nullptr, nullptr, nullptr,
                  pairs ? kv.kt_pairs + jb * kBlockK * ((d + 1) / 2) : nullptr,
                  pairs ? reinterpret_cast<const uint32_t*>(sc.qt_pairs.get()) : nullptr);
      } else {
        ScoreTile(hv, i0, valid, j0, j1, kv.kt + jb * kBlockK * d, sc.qt.get(), sc.tile.get(),
                  th);
      }
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
#if defined(ATTNAUX_BF16_PAIRS)
    if constexpr (kPairs) {
      if (pair_tile(jb)) {
        uint32_t* lane_pairs = reinterpret_cast<uint32_t*>(sc.lane_pairs.get());
        auto round_lanes = [&](const float* x) {
          uint16_t* dst = reinterpret_cast<uint16_t*>(lane_pairs);
          for (int64_t e = 0; e < n; e += kLanes) StoreBf16(dst + e, Load(x + e));
        };
        round_lanes(w);
        PairGemmLanes<kBlockQ / 2>(nk, kBlockQ / 2, lane_pairs, 1,
                                   reinterpret_cast<const uint32_t*>(sc.do_pairs.get()), dvp,
                                   dvp / kLanes, dv_acc + j0 * dvp, dvp, true);
        round_lanes(ds);
        PairGemmLanes<kBlockQ / 2>(nk, kBlockQ / 2, lane_pairs, 1,
                                   reinterpret_cast<const uint32_t*>(sc.q_pairs.get()), dp,
                                   dp / kLanes, dk_acc + j0 * dp, dp, true);
        // (a partner key outside [j0, j1) has dS = 0 and a finite K row: the block is)
        uint32_t* key_pairs = reinterpret_cast<uint32_t*>(sc.key_pairs.get());
        int64_t y0, y1;
        KeyPairsOfTile(ds, jb, j0, j1, key_pairs, &y0, &y1);
        PairGemmLanes<1>(d, y1 - y0, kv.k_pairs + (jb * kBlockK / 2 + y0) * d, d, key_pairs,
                         kBlockQ, kQVectors, dqt, kBlockQ, true);
        continue;
      }
    }
#endif
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

template <bool kPairs>
inline void ProbsBackwardTasks(const AttentionParams& p, const ProbsBackwardInputs& in,
                               const BackwardOutputs& o, ffi::ThreadPool* pool) {
  const ProbsKvLayout layout(p, /*fwd=*/false, kPairs);
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
      PackProbsKv<kPairs>(p, b0 + t / p.kv_heads, t % p.kv_heads, layout,
                          packed.get() + t * layout.size());
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
      BackwardScratchOf<kPairs> sc(p);
      const int64_t u0 = units * share / shares, u1 = units * (share + 1) / shares;
      for (int64_t u = u0; u < u1; ++u) {
        ProbsBackwardBlock<kPairs>(p, in, o, kv, b, hkv * group + u / nqb, u % nqb, dk_acc,
                                   dv_acc, sc);
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

inline void ProbsBackward(const AttentionParams& params, const ProbsBackwardInputs& in,
                          const BackwardOutputs& o, ffi::ThreadPool* pool) {
  const TileSegments segment_tiles(params);
  const AttentionParams p = segment_tiles.With(params);
  if (p.batch == 0 || p.q_heads == 0) return;
  if (kHasBf16Pairs && p.elem == Elem::kBF16) {
    ProbsBackwardTasks<kHasBf16Pairs>(p, in, o, pool);
  } else {
    ProbsBackwardTasks<false>(p, in, o, pool);
  }
}

}  // namespace attnaux::cpu::pk

#endif  // ATTNAUX_CSRC_CPU_PROBS_CPU_H_
