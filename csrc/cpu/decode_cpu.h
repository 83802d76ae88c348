// Decode on the CPU: a few query rows (q_seq <= kDecodeMaxQ) against a long KV cache, forward
// and backward, at memory speed.
//
// The tiled kernels (attention_cpu.h) put 64 query rows in the vector lanes; with one query row
// 63 of 64 lanes compute nothing and K and V stream at a tenth of what memory gives. Here one
// task owns a (batch, kv head, chunk of kDecodeChunk keys) and all the query rows that read that
// kv head (the GQA group x q_seq, "rows"), so K and V are read once for all of them; the head
// dimension is in the vector lanes: a score is a dot product (FMAs over the head dim, one
// horizontal sum), the output row accumulates p * v rows. The chunks are fixed by the shapes, never
// by the threads, and their partial results (row max, row sum, unnormalised output; and dq in the
// backward) are merged in chunk order, so results do not depend on the thread count.
//
// Served here (DecodeApplies): lengths, causal (both alignments, block shifts), window, softcap,
// sink, GQA, every dtype. Bias, mask, segment ids, dropout and score programs take the tiled
// kernels. A key or value row with NaN that a row does not see never reaches it (its p and dS are
// exactly 0 and skipped, not multiplied).
#ifndef ATTNAUX_CSRC_CPU_DECODE_CPU_H_
#define ATTNAUX_CSRC_CPU_DECODE_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>

#include "common/attention_params.h"
#include "cpu/attention_io.h"
#include "cpu/attention_mask.h"
#include "cpu/attention_tile.h"
#include "cpu/cpu_gemm.h"
#include "cpu/cpu_parallel.h"
#include "cpu/cpu_simd.h"

namespace attnaux::cpu {

inline constexpr int64_t kDecodeMaxQ = 16;     // query rows per head served here
inline constexpr int64_t kDecodeMaxRows = 64;  // GQA group x q_seq
inline constexpr int64_t kDecodeChunk = 2048;  // keys per task (fixed: thread-independent)
inline constexpr int64_t kDecodeTile = 64;     // keys converted and scored at a time
inline constexpr int64_t kDecodeGemmRows = 8;  // rows per kv head from which S is a GEMM
inline constexpr int64_t kPrefetchKeys = 8;    // how far ahead the dot path asks for K and V
inline constexpr int64_t kStreamAhead = 8192;     // bytes DotTileKeys/DotTileRows ask for ahead
// The locality of the bfloat16 products' requests for the next tile (ScoresBf16, ScoresBf16Rows4,
// ValuesBf16; from 8 rows a kv head): 2, PREFETCHT1. Zen 4, 2 cores, 16 rows from memory, K+V
// GB/s under JAX, builds taking turns (three rounds): 4x4x8192x32/8x128 12.4-14.0 with T0 (3)
// -> 15.2-15.4, 1x16x16384x8/8x128 12.2-12.7 -> 14.2-14.4; from L3 (1x16x4096) the same, ~16
// (2026-11-27 fifth session). (On a Zen 5 core, 4 rows a kv head, which now take the dot
// forms: ~18 GB/s with T1 split between the score and value products (LineAsk), ~19.7 with
// T0, ~15 and ~17 from the value products alone.)
inline constexpr int kBf16AskHint = 2;
// The locality of the dot forms' requests for K and V kStreamAhead ahead with 2 to 7 rows a kv
// head (DotTileRows, DotTileRowsBf16): 2, PREFETCHT1 (into L2), instead of non-temporal
// requests (0, which fill L1: presumably fewer lines in flight). Zen 4, 2 cores, memory at a
// ~28-34 GB/s copy, K+V GB/s under JAX, builds taking turns: bfloat16 8x1x4096x32/8x128
// 16.2-17.7 -> 26.5-28.1, float32 1x1x131072x8/2x128 14.6-15.5 -> 26.9-29.7, 2 and 6 rows
// 1.1-1.6x (docs/performance.md, 2026-11-27 fifth session). One row a kv head keeps 0:
// DotTileKeys (in memory order, already at the copy) measured no gain with T1 (float32);
// DotTileKeysBf16 was not tried. (On Intel they do take T1: OneRowAsksIntoL2.)
inline constexpr int kRowsAskHint = 2;

// Whether the one-row forms (DotTileKeys, DotTileKeysBf16) ask for K and V kStreamAhead ahead
// into L2 (T1) rather than non-temporally: on Intel CPUs. A 2-core Xeon VM with AMX, builds
// taking turns, two rounds, K+V GB/s of 8x1x4096x8/8x128, 64x1x1024x8/8x64 and
// 1x1x32768x8/8x128: float32 11.5-14.5 -> 14.3-16.3, bfloat16 8.9-11.0 -> 11.7-15.6 (torch
// SDPA forward in the same runs: 0.75-1.06x -> 1.00-1.25x); on a Zen 5 T1 measured ~0.9x NTA
// (float32 34.4-35.7 -> 31.4-31.7 GB/s), so AMD keeps NTA. Read once per process (CPUID): the
// choice moves no result, only the requests.
inline bool OneRowAsksIntoL2() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool intel = (__builtin_cpu_init(), __builtin_cpu_is("intel"));
  return intel;
#else
  return false;
#endif
}

inline bool DecodeApplies(const AttentionParams& p) {
  return p.q_len >= 1 && p.q_len <= kDecodeMaxQ && p.group() * p.q_len <= kDecodeMaxRows &&
         p.bias == nullptr && p.mask == nullptr && p.q_segment_ids == nullptr &&
         p.rng_state == nullptr && p.score_program == nullptr && p.tile_mask == nullptr;
}

namespace decode_detail {

// The sum of a vector's lanes: a shuffle tree (a lane-by-lane loop is one long add chain).
inline float HorizontalSum(VecF v) {
#if defined(__AVX512F__)
  static_assert(kLanes == 16, "AVX-512 vectors");
  __m512 x;
  std::memcpy(&x, &v, sizeof(x));
  return _mm512_reduce_add_ps(x);
#else
  float sum = 0.0f;
  for (int lane = 0; lane < kLanes; ++lane) sum += v[lane];
  return sum;
#endif
}

inline float Dot(const float* a, const float* b, int64_t n_padded) {
  // two accumulators: half the FMA latency chain, so more loads are in flight
  VecF acc0 = VecF{}, acc1 = VecF{};
  int64_t x = 0;
  for (; x + 2 * kLanes <= n_padded; x += 2 * kLanes) {
    acc0 += Load(a + x) * Load(b + x);
    acc1 += Load(a + x + kLanes) * Load(b + x + kLanes);
  }
  if (x < n_padded) acc0 += Load(a + x) * Load(b + x);
  return HorizontalSum(acc0 + acc1);
}

// Asks for the `bytes` at `p` ahead of their use (the stream of K or V rows).
inline void Prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  // into L2 (T1): a prefetch to L1 holds one of its few fill buffers for a whole trip to memory,
  // which capped a core's stream of K and V at ~2/3 of what a plain read of the rows reaches
  for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(c + x, 0, 2);
}

inline void Axpy(float alpha, const float* x, float* y, int64_t n_padded) {
  const VecF a = Splat(alpha);
  for (int64_t e = 0; e < n_padded; e += kLanes) Store(y + e, Load(y + e) + a * Load(x + e));
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
inline constexpr bool kHasBf16Dot = true;

// q . k of bfloat16 rows (d a multiple of 32) with AVX-512 BF16's pair products, accumulated
// in float32 (the products of bfloat16 values are exact in float32).
inline float DotBf16(const uint16_t* q, const uint16_t* k, int64_t d) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t x = 0;
  for (; x + 64 <= d; x += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(q + x),
                            (__m512bh)_mm512_loadu_si512(k + x));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(q + x + 32),
                            (__m512bh)_mm512_loadu_si512(k + x + 32));
  }
  if (x < d) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(q + x),
                            (__m512bh)_mm512_loadu_si512(k + x));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// y += alpha * v for a bfloat16 row v (dv a multiple of 16), widened on the fly.
inline void AxpyBf16(float alpha, const uint16_t* v, float* y, int64_t dv) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t x = 0; x < dv; x += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + x));
    const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm512_storeu_ps(y + x, _mm512_fmadd_ps(a, f, _mm512_loadu_ps(y + x)));
  }
}
#else
inline constexpr bool kHasBf16Dot = false;
inline float DotBf16(const uint16_t*, const uint16_t*, int64_t) { return 0.0f; }
inline void AxpyBf16(float, const uint16_t*, float*, int64_t) {}
#endif

// C[keys][lanes] = K[keys][depth] B[depth][lanes] with K rows `row_step` floats apart (a
// compile-time row step for the register-blocked product): staged rows (64, 128, 256) or, read
// in place, a key's rows of every kv head (kv heads x head dim). False for another step.
// One vector of lanes with rows 4 KiB or more apart: blocks of kKeyBlock keys instead of
// GemmLanes' 16 (16 rows 4 KiB apart share one set of the 12-way L1, so each broadcast missed
// it); every element's sum is the same chain of FMAs over the depth: the same bits.
inline constexpr int kKeyBlock = 8;
inline bool GemmKeyRows(int64_t row_step, int64_t rows, int64_t depth, const float* k,
                        const float* b, int64_t ldb, int64_t width, float* c, int64_t ldc) {
  switch (row_step) {
#define ATTNAUX_KEY_ROWS(STEP)                                                              \
  case STEP:                                                                                \
    if (STEP >= 1024 && width == 1 && rows % kKeyBlock == 0) {                              \
      for (int64_t i = 0; i < rows; i += kKeyBlock) {                                       \
        MicroKernel<kKeyBlock, 1, STEP, false>(depth, k + i * STEP, 1, b, ldb, c + i * ldc, \
                                               ldc, false, GemmFuse{});                     \
      }                                                                                     \
      return true;                                                                          \
    }                                                                                       \
    GemmLanes<STEP>(rows, depth, k, 1, b, ldb, width, c, ldc, false);                       \
    return true;
    ATTNAUX_KEY_ROWS(64)
    ATTNAUX_KEY_ROWS(128)
    ATTNAUX_KEY_ROWS(256)
    ATTNAUX_KEY_ROWS(512)
    ATTNAUX_KEY_ROWS(1024)
    ATTNAUX_KEY_ROWS(2048)
    ATTNAUX_KEY_ROWS(4096)
#undef ATTNAUX_KEY_ROWS
    default: return false;
  }
}

// The lines that one product call asks for (into L2) as it goes, one per step of its loop while
// any are left: `lines` lines of rows `row_lines` lines long, `stride` bytes apart, from line
// `first_col` of the row at `row`. The products of a kv head ask for the next kv head's rows
// (its keys' rows 4 KiB apart), not the next tile in memory order: a whole tile ahead (512 KiB
// of K and V with 8 kv heads, d 128) plus the tile in use fill the 1 MiB L2, and the requests
// evicted the tile's V rows before their products read them (under JAX, n 16: 24.9-28.8 ->
// 33.4-35.5 GB/s on 2 cores; the standalone harness, which lost fewer, 32-33.8 -> 33-34.8).
struct AskShare {
  const char* row = nullptr;
  int64_t lines = 0, row_lines = 1, first_col = 0, stride = 0;
};

// The cursor of an AskShare in a product's loop.
struct AskCursor {
  const char* line;
  int64_t left_in_row;
  const char* next_row;
  explicit AskCursor(const AskShare& ask)
      : line(ask.row + ask.first_col * 64), left_in_row(ask.row_lines - ask.first_col),
        next_row(ask.row + ask.stride) {}
};

inline void AskStep(const AskShare& ask, AskCursor& cursor, int64_t x) {
  if (x < ask.lines) {
    __builtin_prefetch(cursor.line, 0, 2);
    cursor.line += 64;
    if (--cursor.left_in_row == 0) {
      cursor.line = cursor.next_row;
      cursor.next_row += ask.stride;
      cursor.left_in_row = ask.row_lines;
    }
  }
}

// Lines [0, na) at `a`, then [na, na + nb) at `b` (64 bytes apart): a kv head's share of the
// next tile's K rows and then V rows, in memory order, for its products to ask for as they go:
// the K lines by its score products (ScoresBf16, ScoresBf16Rows4), the V lines by its value
// products (ValuesBf16). All of them from the value products, a quarter to a third of the time
// with 4 rows, sent the requests in bursts the memory could not serve in time (4 rows from memory
// ~15 GB/s a core, ~30 from L3); spread over both, with PREFETCHT0 (kBf16AskHint), ~20. The
// next kv head's rows instead (a tile's rows of a kv head lie a few KiB apart), or
// none, read K and V at ~10 and ~6 GB/s a core (n 16, d 128, 8 kv heads), against ~12 this way
// (also with 16 or 32 kv heads, whose two tiles do not fit the L2: the L3 holds what it lets go).
struct LineAsk {
  const char* a = nullptr;
  int64_t na = 0;
  const char* b = nullptr;
  int64_t nb = 0;
  // lines [i, i + n) that lie in one of the two runs: the first and how many, at least one
  // (else `fallback` once)
  const char* Run(int64_t i, int64_t n, const char* fallback, int64_t* count) const {
    if (i < na) {
      *count = std::min(n, na - i);
      return a + i * 64;
    }
    if (i - na < nb) {
      *count = std::min(n, nb - (i - na));
      return b + (i - na) * 64;
    }
    *count = 1;
    return fallback;
  }
  // asks for lines [first, na + nb), one request a line, with locality hint kHint
  template <int kHint>
  void AskFrom(int64_t first, const char* fallback) const {
    for (int64_t line = first; line < na + nb; ++line) {
      int64_t one;
      __builtin_prefetch(Run(line, 1, fallback, &one), 0, kHint);
    }
  }
};

#if defined(__AVX512F__)
// The sums of 16 vectors' lanes, lane 4k + i of the result the sum of a[4i + k] (a transpose
// and add tree: 30 shuffles and 15 adds for 16 dot products).
inline __attribute__((always_inline)) __m512 SumLanes16(const __m512* a) {
  __m512 v1[8], v2[4], v3[2];
  for (int m = 0; m < 8; ++m) {  // [a[2m] (8 lanes), a[2m + 1] (8)]
    v1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  }
  for (int q = 0; q < 4; ++q) {  // block k: a[4q + k] (4 lanes)
    v2[q] = _mm512_add_ps(_mm512_shuffle_f32x4(v1[2 * q], v1[2 * q + 1], 0x88),
                          _mm512_shuffle_f32x4(v1[2 * q], v1[2 * q + 1], 0xDD));
  }
  for (int t = 0; t < 2; ++t) {  // block k: a[8t + k] (2 lanes), a[8t + 4 + k] (2)
    v3[t] = _mm512_add_ps(_mm512_shuffle_ps(v2[2 * t], v2[2 * t + 1], 0x44),
                          _mm512_shuffle_ps(v2[2 * t], v2[2 * t + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(v3[0], v3[1], 0x88),
                       _mm512_shuffle_ps(v3[0], v3[1], 0xDD));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// What ScoresBf16's blocks do to their sums before storing them, when the caller asks (no softcap,
// key indices exact as floats): times the scale, -inf where a lane's row does not see the key
// (lanes see [lo, hi), hi already cut to the tile's end), and the running tile maximum per lane:
// the mask and maximum passes over the stored scores, folded in with the same rounding and the
// same maximum order (the same bits). With ExpPackBf16, K and V at 16 rows a kv head under JAX
// on 2 cores: 27.0-28.0 -> 28.5-30.1 GB/s (1x16x16384x8/8x128), 26.4-27.2 -> 27.3-27.9
// (4x4x8192x32/8x128).
struct LaneScoreMask {
  float scale = 1.0f;
  const float* lo = nullptr;  // [np]
  const float* hi = nullptr;  // [np]
  float* tile_max = nullptr;  // [np], updated
};

// LaneScoreMask's step for one key's sums of 16 rows (`key`: its index in the cache): times the
// scale, -inf where a lane's row does not see it, folded into the lanes' tile maximum.
inline __attribute__((always_inline)) __m512 MaskedLaneScores(__m512 sum, float key, __m512 lo,
                                                              __m512 hi, __m512 scale,
                                                              __m512& tile_max) {
  const __m512 at = _mm512_set1_ps(key);
  const __mmask16 seen =
      _mm512_cmp_ps_mask(at, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(at, hi, _CMP_LT_OQ);
  const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-kInf), seen, sum, scale);
  // Max(tile_max, x) of cpu_simd.h: tile_max > x ? tile_max : x (x when either is NaN)
  tile_max = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(tile_max, x, _CMP_GT_OQ), x, tile_max);
  return x;
}

// kKeys keys' scores for W vectors of rows (rows in the lanes): c[r][W * 16] = q . k_r, the
// bfloat16 key rows `rows[r]` read in place, each pair of a key's values broadcast as one 32-bit
// lane against the rows' pairs qt2[x][W * 16] (q[2x], q[2x + 1]). With one vector of rows each
// score is two sums (even and odd pairs) added at the end: 8 chains of VDPBF16PS are too few for
// its latency. With `mask`, LaneScoreMask's epilogue (key r of the block is key `first_key + r`
// of the cache).
template <int W, int kKeys>
inline __attribute__((always_inline)) void KeyBlockBf16(int64_t pairs, const uint16_t* const* rows,
                                                        const uint32_t* qt2, float* c,
                                                        const LaneScoreMask* mask,
                                                        float first_key) {
  constexpr int kSplit = W == 1 ? 2 : 1;
  __m512 acc[kSplit][kKeys][W];
  for (int s = 0; s < kSplit; ++s) {
    for (int r = 0; r < kKeys; ++r) {
      for (int w = 0; w < W; ++w) acc[s][r][w] = _mm512_setzero_ps();
    }
  }
  const uint16_t* k[kKeys];
  for (int r = 0; r < kKeys; ++r) k[r] = rows[r];
  for (int64_t x = 0; x < pairs; x += kSplit) {
    for (int s = 0; s < kSplit; ++s) {
      __m512bh qv[W];
      for (int w = 0; w < W; ++w) {
        qv[w] = (__m512bh)_mm512_loadu_si512(qt2 + ((x + s) * W + w) * 16);
      }
      for (int r = 0; r < kKeys; ++r) {
        int32_t pair;
        std::memcpy(&pair, k[r] + 2 * (x + s), sizeof(pair));
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(pair);
        for (int w = 0; w < W; ++w) acc[s][r][w] = _mm512_dpbf16_ps(acc[s][r][w], qv[w], kb);
      }
    }
  }
  if (mask == nullptr) {
    for (int r = 0; r < kKeys; ++r) {
      for (int w = 0; w < W; ++w) {
        __m512 sum = acc[0][r][w];
        if constexpr (kSplit == 2) sum = _mm512_add_ps(sum, acc[1][r][w]);
        _mm512_storeu_ps(c + (r * W + w) * 16, sum);
      }
    }
    return;
  }
  const __m512 scale = _mm512_set1_ps(mask->scale);
  for (int w = 0; w < W; ++w) {
    const __m512 lo = _mm512_loadu_ps(mask->lo + w * 16);
    const __m512 hi = _mm512_loadu_ps(mask->hi + w * 16);
    __m512 tile_max = _mm512_loadu_ps(mask->tile_max + w * 16);
    for (int r = 0; r < kKeys; ++r) {
      __m512 sum = acc[0][r][w];
      if constexpr (kSplit == 2) sum = _mm512_add_ps(sum, acc[1][r][w]);
      _mm512_storeu_ps(c + (r * W + w) * 16,
                       MaskedLaneScores(sum, first_key + static_cast<float>(r), lo, hi, scale,
                                        tile_max));
    }
    _mm512_storeu_ps(mask->tile_max + w * 16, tile_max);
  }
}

#if defined(ATTNAUX_AMX)
// S^T for 16 keys of one kv head and 16 rows (np 16) on an AMX tile: c[r][16] = q . k_r, the
// key rows read in place (`step` values apart) as the A tile, 32 head dims a product, qt2's pair
// words (KeyBlockBf16's B, [d / 2][16]) as the B tile; with `mask`, LaneScoreMask's epilogue
// over the stored sums, key by key as KeyBlockBf16's. The tile sums each pair's two products
// and the pairs in its own fixed order (not KeyBlockBf16's two chains: other roundings, still
// independent of threads).
inline void AmxScores16(const uint16_t* k, int64_t step, int64_t d, const uint32_t* qt2, float* c,
                        const LaneScoreMask* mask, float first_key) {
  _tile_zero(0);
  for (int64_t x = 0; x < d; x += 32) {
    _tile_loadd(1, k + x, step * 2);
    _tile_loadd(2, qt2 + (x / 2) * 16, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, c, 64);
  if (mask == nullptr) return;
  const __m512 scale = _mm512_set1_ps(mask->scale);
  const __m512 lo = _mm512_loadu_ps(mask->lo), hi = _mm512_loadu_ps(mask->hi);
  __m512 tile_max = _mm512_loadu_ps(mask->tile_max);
  for (int r = 0; r < 16; ++r) {
    _mm512_storeu_ps(c + r * 16, MaskedLaneScores(_mm512_loadu_ps(c + r * 16),
                                                  first_key + static_cast<float>(r), lo, hi,
                                                  scale, tile_max));
  }
  _mm512_storeu_ps(mask->tile_max, tile_max);
}
#endif

// S^T [kDecodeTile][np] = K Q^T for one kv head's bfloat16 keys [0, nk), rows `step` values
// apart, read in place (keys past nk score key nk - 1 again: the rows past the cache's end are
// not read; `mask`, or else the caller, masks those scores); qt2: [d / 2][np] (KeyBlockBf16).
// With `mask`, the scores are scaled and masked and the tile maximum taken as they are stored
// (key 0 is key `first_key` of the cache). Asks for the `ask_lines` lines from `ask` (LineAsk's
// K lines), a share with each block of keys.
__attribute__((noinline)) inline void ScoresBf16(const uint16_t* k, int64_t step, int64_t nk,
                                                 int64_t d, const uint32_t* qt2, int64_t np,
                                                 float* st, const char* ask, int64_t ask_lines,
                                                 const LaneScoreMask* mask, float first_key) {
  const int64_t per_block = CeilDiv(ask_lines, kDecodeTile / 8);
  // 16 rows and whole 16-key groups on AMX tiles where the CPU has them (AmxScores16)
  int64_t tiled_to = 0;  // keys [0, tiled_to) scored on the tiles
#if defined(ATTNAUX_AMX)
  const bool tiles = np == kLanes && d % 32 == 0 && AmxUsable();
  if (tiles) AmxConfigure();
#endif
  for (int64_t jb = 0; jb < kDecodeTile; jb += 8) {
    for (int64_t t = 0; t < per_block; ++t) {
      __builtin_prefetch(ask + std::min(jb / 8 * per_block + t, ask_lines - 1) * 64, 0,
                         kBf16AskHint);
    }
    if (jb < tiled_to) continue;
#if defined(ATTNAUX_AMX)
    if (tiles && jb + 16 <= nk) {
      AmxScores16(k + jb * step, step, d, qt2, st + jb * np, mask,
                  first_key + static_cast<float>(jb));
      tiled_to = jb + 16;
      continue;
    }
#endif
    const uint16_t* rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = k + std::min<int64_t>(jb + r, nk - 1) * step;
    float* c = st + jb * np;
    const float key = first_key + static_cast<float>(jb);
    switch (np / kLanes) {
      case 1: KeyBlockBf16<1, 8>(d / 2, rows, qt2, c, mask, key); break;
      case 2: KeyBlockBf16<2, 8>(d / 2, rows, qt2, c, mask, key); break;
      case 3: KeyBlockBf16<3, 8>(d / 2, rows, qt2, c, mask, key); break;
      default:
        KeyBlockBf16<4, 4>(d / 2, rows, qt2, c, mask, key);
        KeyBlockBf16<4, 4>(d / 2, rows + 4, qt2, c + 4 * np, mask, key + 4.0f);
        break;
    }
  }
}

// ScoresBf16 for at most 4 rows (n <= 4; lanes 0..3 of S^T, lanes past n repeat row n - 1 and
// are masked by the caller), the head dim in the lanes: each key row read once as kChunks vectors
// of 32 values for the 4 rows' VDPBF16PS against q [n][kChunks * 32], 4 keys' 16 dot products
// summed together (SumLanes16). With rows in the lanes 12 of 16 lanes computed nothing and each
// product took a broadcast of a key pair: ~42 cycles a key, against ~16 products and ~12 shuffles
// and adds here. Asks for `ask_lines` lines from `ask` as ScoresBf16 does.
template <int kChunks>
__attribute__((noinline)) void ScoresBf16Rows4(const uint16_t* k, int64_t step, int64_t nk,
                                               const uint16_t* q, int64_t n, int64_t np,
                                               float* st, const char* ask, int64_t ask_lines) {
  const int64_t per_block = CeilDiv(ask_lines, kDecodeTile / 4);
  constexpr int kD = kChunks * 32;
  __m512bh qv[4][kChunks];
  for (int r = 0; r < 4; ++r) {
    const uint16_t* row = q + std::min<int64_t>(r, n - 1) * kD;
    for (int c = 0; c < kChunks; ++c) qv[r][c] = (__m512bh)_mm512_loadu_si512(row + c * 32);
  }
  for (int64_t jb = 0; jb < kDecodeTile; jb += 4) {
    for (int64_t t = 0; t < per_block; ++t) {
      __builtin_prefetch(ask + std::min(jb / 4 * per_block + t, ask_lines - 1) * 64, 0,
                         kBf16AskHint);
    }
    __m512 a[16];  // a[4 r + key]
    for (int key = 0; key < 4; ++key) {
      const uint16_t* row = k + std::min<int64_t>(jb + key, nk - 1) * step;
      __m512bh kv[kChunks];
      for (int c = 0; c < kChunks; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(row + c * 32);
      for (int r = 0; r < 4; ++r) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < kChunks; ++c) acc = _mm512_dpbf16_ps(acc, qv[r][c], kv[c]);
        a[4 * r + key] = acc;
      }
    }
    const __m512 sums = SumLanes16(a);  // block `key`: its 4 rows
    _mm_storeu_ps(st + (jb + 0) * np, _mm512_extractf32x4_ps(sums, 0));
    _mm_storeu_ps(st + (jb + 1) * np, _mm512_extractf32x4_ps(sums, 1));
    _mm_storeu_ps(st + (jb + 2) * np, _mm512_extractf32x4_ps(sums, 2));
    _mm_storeu_ps(st + (jb + 3) * np, _mm512_extractf32x4_ps(sums, 3));
  }
}

// R rows' kVecs * 16 value columns of O' = alpha O + P V on AVX-512 BF16's pair products along
// the keys: out[r][x] = alpha[r] in[r][x] + sum_{pairs i} (p[r][2i] v[2i][x] +
// p[r][2i + 1] v[2i + 1][x]) (`ld` floats a row of in and out), the value columns in the lanes:
// the two keys' values of column x one 32-bit lane of vi[i][x] (ValuesBf16 interleaves them),
// against the row's pair pp[i][r] of P rounded to bfloat16, broadcast (each product of two
// bfloat16 values is exact in float32). Per key pair and row, kVecs instructions for 32 * kVecs
// multiply-adds: a quarter of the float32 FMAs on values split out of V with rows in the lanes,
// and no lanes left empty when a kv head has fewer than 16 rows. Adds out * 0 to `finite`. Asks
// (kBf16AskHint) for the `ask_lines` lines from `ask`, `per_pair` with each pair's products (the
// address clamped, not the request skipped: behind a branch GCC dropped the requests).
template <int R, int kVecs>
inline void ValueRowsBf16(int64_t pairs, const uint32_t* vi, int64_t vi_step, const uint32_t* pp,
                          int64_t pp_step, const float* alpha, const float* in, float* out,
                          int64_t ld, __m512* finite, const char* ask, int64_t ask_lines,
                          int64_t per_pair) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(in + r * ld + v * 16), a);
      asm("" : "+v"(acc[r][v]));  // rounded before the products add to it, as ValueBlockAsking
    }
  }
  for (int64_t i = 0; i < pairs; ++i) {
    for (int64_t t = 0; t < per_pair; ++t) {
      __builtin_prefetch(ask + std::min(i * per_pair + t, ask_lines - 1) * 64, 0,
                         kBf16AskHint);
    }
    __m512bh vv[kVecs];
    for (int v = 0; v < kVecs; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(vi + i * vi_step + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[i * pp_step + r]));
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], vv[v], pr);
    }
  }
  __m512 zero_if_finite = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      _mm512_storeu_ps(out + r * ld + v * 16, acc[r][v]);
      zero_if_finite = _mm512_fmadd_ps(acc[r][v], _mm512_setzero_ps(), zero_if_finite);
    }
  }
  *finite = _mm512_add_ps(*finite, zero_if_finite);
}

// A vector of rows' key pair of P rounded to bfloat16 (round to nearest even, VCVTNE2PS2BF16):
// lane r holds (even[r], odd[r]) (low, high), the pair ValueRowsBf16 broadcasts.
inline __attribute__((always_inline)) __m512i PackPairBf16(__m512 even, __m512 odd) {
  const __m512i by_lane = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
  return _mm512_permutexvar_epi16(by_lane, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// P = exp(S - m) for one vector of rows (columns [v, v + kLanes)) of a tile's S^T
// ([kDecodeTile][np]), in place, and P's key pairs into `pp` ([kDecodeTile / 2][np],
// PackPairBf16) as they are made: one pass, not a second one over the stored P (LaneScoreMask
// says what the two gained). Returns the row sums, added key by key as the float32 loop adds
// them.
inline VecF ExpPackBf16(float* st, int64_t np, int64_t v, VecF m_use, uint32_t* pp) {
  VecF sum = VecF{};
  for (int64_t j = 0; j < kDecodeTile; j += 2) {
    float* sp = st + j * np + v;
    const VecF even = Exp(Load(sp) - m_use);
    sum += even;
    const VecF odd = Exp(Load(sp + np) - m_use);
    sum += odd;
    Store(sp, even);
    Store(sp + np, odd);
    __m512 e, o;
    std::memcpy(&e, &even, sizeof(e));
    std::memcpy(&o, &odd, sizeof(o));
    _mm512_storeu_si512(pp + j / 2 * np + v, PackPairBf16(e, o));
  }
  return sum;
}

#if defined(ATTNAUX_AMX)
// ValuesBf16 for 16 rows on AMX tiles: O' = alpha O (rounded, as ValueRowsBf16's start), then
// P V added by TDPBF16PS, 16 key pairs a product: A the rows' P pairs (pp transposed: a row's
// pairs contiguous), B V's key pairs (vi, 16 columns a tile), C four 16-column tiles of O at a
// time, loaded from and stored to `out`. Key pairs past `pairs` up to the product's 16 are zero
// on both sides (0 * NaN would be NaN). All of `ask`'s lines are asked for first. False when the
// result is not finite.
inline bool ValuesAmx16(int64_t pairs, int64_t dv, const float* alpha, const float* in,
                        float* out, int64_t ld, const LineAsk& ask, const uint32_t* pp,
                        uint32_t* vi) {
  ask.AskFrom<kBf16AskHint>(0, reinterpret_cast<const char*>(vi));
  const int64_t padded = CeilDiv(pairs, int64_t{16}) * 16;
  for (int64_t i = pairs; i < padded; ++i) std::fill(vi + i * dv, vi + (i + 1) * dv, 0u);
  for (int r = 0; r < 16; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t x = 0; x < dv; x += 16) {
      _mm512_storeu_ps(out + r * ld + x, _mm512_mul_ps(_mm512_loadu_ps(in + r * ld + x), a));
    }
  }
  alignas(64) uint32_t pa[2][16][16];  // [k-step][row][pair]
  for (int64_t i0 = 0; i0 < padded; i0 += 16) {
    for (int i = 0; i < 16; ++i) {
      for (int r = 0; r < 16; ++r) pa[i0 / 16][r][i] = i0 + i < pairs ? pp[(i0 + i) * 16 + r] : 0u;
    }
  }
  AmxConfigure();
  const int64_t b_stride = dv * 4, c_stride = ld * 4;
  for (int64_t x0 = 0; x0 < dv; x0 += 64) {
    float* c = out + x0;
    _tile_loadd(0, c, c_stride);
    _tile_loadd(1, c + 16, c_stride);
    _tile_loadd(2, c + 32, c_stride);
    _tile_loadd(3, c + 48, c_stride);
    for (int64_t i0 = 0; i0 < padded; i0 += 16) {
      const uint32_t* b = vi + i0 * dv + x0;
      _tile_loadd(4, pa[i0 / 16], 64);
      _tile_loadd(5, b, b_stride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 16, b_stride);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 32, b_stride);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, b + 48, b_stride);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, c, c_stride);
    _tile_stored(1, c + 16, c_stride);
    _tile_stored(2, c + 32, c_stride);
    _tile_stored(3, c + 48, c_stride);
  }
  __m512 zero_if_finite = _mm512_setzero_ps();
  for (int r = 0; r < 16; ++r) {
    for (int64_t x = 0; x < dv; x += 16) {
      zero_if_finite =
          _mm512_fmadd_ps(_mm512_loadu_ps(out + r * ld + x), _mm512_setzero_ps(), zero_if_finite);
    }
  }
  return _mm512_cmpneq_ps_mask(zero_if_finite, _mm512_setzero_ps()) == 0;
}
#endif

// O' = alpha O + P V (ValueRowsBf16) for the n rows ([n][ld]) and dv columns of one kv head,
// keys [0, nk) (past nk P is 0 and the rows are not read), asking for the lines of `ask` as it
// goes; false when the result is not finite. P meets V rounded to bfloat16: `pp` holds P's key
// pairs ([kDecodeTile / 2][np], PackPairBf16); V's key pairs are interleaved into `vi`
// ([kDecodeTile / 2][dv]; past nk zero). The row sums and maxima stay those of the unrounded P.
__attribute__((noinline)) inline bool ValuesBf16(int64_t nk, const uint16_t* v, int64_t v_step,
                                                 int64_t dv, int64_t n, int64_t np,
                                                 const float* alpha, const float* in, float* out,
                                                 int64_t ld, const LineAsk& ask,
                                                 const uint32_t* pp, uint32_t* vi) {
  const int64_t pairs = (nk + 1) / 2;
  // V's key pairs: vi[i][x] = (v[2i][x], v[2i + 1][x])
  const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41,
                                              9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2,
                                              33, 1, 32, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    const uint16_t* a = v + 2 * i * v_step;
    const bool second = 2 * i + 1 < nk;
    for (int64_t x = 0; x < dv; x += 16) {
      const __m512i lo =
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + x)));
      const __m512i hi = second ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(a + v_step + x)))
                                : _mm512_setzero_si512();
      _mm512_storeu_si512(vi + i * dv + x, _mm512_permutex2var_epi16(lo, interleave, hi));
    }
  }
#if defined(ATTNAUX_AMX)
  if (n == kLanes && np == kLanes && dv % 64 == 0 && AmxUsable()) {
    return ValuesAmx16(pairs, dv, alpha, in, out, ld, ask, pp, vi);
  }
#endif
  // blocks of 4 rows x 64 columns (2 x 128 for 1 or 2 rows), then narrower ones
  __m512 finite = _mm512_setzero_ps();
  int64_t calls = 0;
  for (int64_t r = 0; r < n;) {
    const int64_t rows = std::min<int64_t>(n - r, 4);
    for (int64_t x = 0; x < dv;) {
      x += rows <= 2 && dv - x >= 128 ? 128 : dv - x >= 64 ? 64 : 16;
      ++calls;
    }
    r += rows;
  }
  const int64_t total = ask.na + ask.nb;
  int64_t line = 0, call = 0;
  for (int64_t r = 0; r < n;) {
    const int64_t rows = std::min<int64_t>(n - r, 4);
    for (int64_t x = 0; x < dv;) {
      const int64_t cols = rows <= 2 && dv - x >= 128 ? 128 : dv - x >= 64 ? 64 : 16;
      int64_t lines = 0;
      const int64_t want = total * (call + 1) / calls - line;
      const char* run = reinterpret_cast<const char*>(v);
      if (want > 0) run = ask.Run(line, want, run, &lines);
      const int64_t per_pair = CeilDiv(lines, pairs);
      const uint32_t* vx = vi + x;
      const uint32_t* pr = pp + r;
      const float* ir = in + r * ld + x;
      float* orow = out + r * ld + x;
      const float* ar = alpha + r;
#define ATTNAUX_VALUE_ROWS(R, V) \
  ValueRowsBf16<R, V>(pairs, vx, dv, pr, np, ar, ir, orow, ld, &finite, run, lines, per_pair)
      if (cols == 16) {
        switch (rows) {
          case 1: ATTNAUX_VALUE_ROWS(1, 1); break;
          case 2: ATTNAUX_VALUE_ROWS(2, 1); break;
          case 3: ATTNAUX_VALUE_ROWS(3, 1); break;
          default: ATTNAUX_VALUE_ROWS(4, 1); break;
        }
      } else if (cols == 128) {
        if (rows == 1) {
          ATTNAUX_VALUE_ROWS(1, 8);
        } else {
          ATTNAUX_VALUE_ROWS(2, 8);
        }
      } else {
        switch (rows) {
          case 1: ATTNAUX_VALUE_ROWS(1, 4); break;
          case 2: ATTNAUX_VALUE_ROWS(2, 4); break;
          case 3: ATTNAUX_VALUE_ROWS(3, 4); break;
          default: ATTNAUX_VALUE_ROWS(4, 4); break;
        }
      }
#undef ATTNAUX_VALUE_ROWS
      line += lines;
      ++call;
      x += cols;
    }
    r += rows;
  }
  ask.AskFrom<kBf16AskHint>(line, reinterpret_cast<const char*>(v));  // (left by runs' ends)
  return _mm512_cmpneq_ps_mask(finite, _mm512_setzero_ps()) == 0;
}
#else
inline bool ValuesBf16(int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                       const float*, const float*, float*, int64_t, const LineAsk&,
                       const uint32_t*, uint32_t*) {
  return false;
}
inline VecF ExpPackBf16(float*, int64_t, int64_t, VecF, uint32_t*) { return VecF{}; }
struct LaneScoreMask {
  float scale = 1.0f;
  const float* lo = nullptr;
  const float* hi = nullptr;
  float* tile_max = nullptr;
};
inline void ScoresBf16(const uint16_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t,
                       float*, const char*, int64_t, const LaneScoreMask*, float) {}
template <int kChunks>
void ScoresBf16Rows4(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                     float*, const char*, int64_t) {}
#endif

// What the score products of a whole tile of keys do to a block's dot products before they are
// stored (the scalar passes over the tile's scores cost about as much as the products): times
// the scale, -inf where a lane's row does not see the key (lanes see [lo, hi), key indices exact
// as floats), and the running tile maximum per lane. The same roundings and maximum order as
// those passes.
struct ScoreMask {
  float scale = 1.0f;
  VecF lo{}, hi{};
  VecF tile_max{};
};

// GemmKeyRows' blocks of kKeyBlock keys for one vector of rows (width 1), each block's depth
// loop also asking for its share of the next kv head's K rows (AskShare). A pass in memory order before a
// tile's products has nothing to overlap its reads (a core: ~12.5 GB/s of K and V from memory,
// ~18.7 from L3); requests spread thin between the products overlap part of them. Requests in
// bursts (a kv head's next rows, or a share of keys, at once) gained nothing. The same FMAs in
// the same order as GemmKeyRows: the same bits. With `mask` (kMasked), its epilogue on the
// block of keys from `first_key`.
template <int64_t kRowStep, bool kMasked>
inline void KeyBlockAsking(int64_t depth, const float* k, const float* b, float* c,
                           const AskShare& ask, ScoreMask* mask, float first_key) {
  VecF acc[kKeyBlock];
  for (int r = 0; r < kKeyBlock; ++r) acc[r] = VecF{};
  AskCursor cursor(ask);
  for (int64_t x = 0; x < depth; ++x) {
    AskStep(ask, cursor, x);
    const VecF bv = Load(b + x * kLanes);
    for (int r = 0; r < kKeyBlock; ++r) acc[r] += Splat(k[r * kRowStep + x]) * bv;
  }
  if constexpr (kMasked) {
    VecF tile_max = mask->tile_max;
    for (int r = 0; r < kKeyBlock; ++r) {
      const VecF key = Splat(first_key + static_cast<float>(r));
      const VecF x = acc[r] * mask->scale;
      acc[r] = key >= mask->lo && key < mask->hi ? x : Splat(-kInf);
      tile_max = Max(tile_max, acc[r]);
    }
    mask->tile_max = tile_max;
  }
  for (int r = 0; r < kKeyBlock; ++r) Store(c + r * kLanes, acc[r]);
}

// One block of kLanes value columns of O^T += V^T P^T over `keys` keys (one vector of rows):
// out[x][lanes] = alpha * in[x][lanes] + sum_k v[k * v_step + x] p[k][lanes], the output's
// rescaling folded into the accumulators' load, the loop asking for its share of the next kv
// head's V rows (AskShare). GemmLanes' FMAs in its order after the same rounded rescaling: the same bits.
// Adds out * 0 to `finite` (NaN in a lane when an output is not finite): a NaN or inf in a value
// row reaches every lane (0 * inf is NaN), so this check of the result replaces one of V's rows.
inline void ValueBlockAsking(int64_t keys, const float* v, int64_t v_step, const float* p,
                             VecF alpha, const float* in, float* out, const AskShare& ask,
                             VecF* finite) {
  constexpr int kCols = kLanes;
  VecF acc[kCols];
  for (int x = 0; x < kCols; ++x) {
    acc[x] = Load(in + x * kLanes) * alpha;
    // the rescaled value is rounded before the products add to it (no contraction into an FMA)
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    asm("" : "+v"(acc[x]));
#elif defined(__GNUC__) && defined(__aarch64__)
    asm("" : "+w"(acc[x]));
#endif
  }
  AskCursor cursor(ask);
  for (int64_t j = 0; j < keys; ++j) {
    AskStep(ask, cursor, j);
    const VecF pv = Load(p + j * kLanes);
    for (int x = 0; x < kCols; ++x) acc[x] += Splat(v[j * v_step + x]) * pv;
  }
  VecF zero_if_finite[2] = {};
  for (int x = 0; x < kCols; ++x) {
    Store(out + x * kLanes, acc[x]);
    zero_if_finite[x % 2] += acc[x] * 0.0f;
  }
  *finite += zero_if_finite[0] + zero_if_finite[1];
}

inline bool KeyRowStepCompiled(int64_t row_step) {
  return row_step >= 64 && row_step <= 4096 && (row_step & (row_step - 1)) == 0;
}

// The rows of one (batch, kv head): query head h = hkv * group + g, query index i; row r =
// g * q_len + i. Holds q (padded to whole vectors), each row's visible key range and validity.
struct DecodeRows {
  int64_t n = 0, d = 0, dp = 0;
  std::vector<float> q;       // [n][dp]
  std::vector<uint16_t> qb;  // [n][d]: the bfloat16 rows as given (bfloat16 inputs)
  std::vector<int64_t> lo, hi, head, qi;
  std::vector<char> valid;
  int64_t key_lo = 0, key_hi = 0;  // union of the valid rows' ranges

  DecodeRows(const AttentionParams& p, int64_t b, int64_t hkv)
      : n(p.group() * p.q_len), d(p.head_dim), dp(RoundUpLanes(p.head_dim)) {
    const RowRanges ranges(p, b);
    q.assign(n * dp, 0.0f);
    lo.resize(n);
    hi.resize(n);
    head.resize(n);
    qi.resize(n);
    valid.resize(n);
    key_lo = ranges.kl;
    key_hi = 0;
    for (int64_t r = 0; r < n; ++r) {
      head[r] = hkv * p.group() + r / p.q_len;
      qi[r] = r % p.q_len;
      valid[r] = qi[r] < ranges.ql;
      lo[r] = valid[r] ? ranges.Lo(qi[r]) : 0;
      hi[r] = valid[r] ? ranges.Hi(qi[r]) : 0;
      if (valid[r] && lo[r] < hi[r]) {
        key_lo = std::min(key_lo, lo[r]);
        key_hi = std::max(key_hi, hi[r]);
        const int64_t at = ((b * p.q_len + qi[r]) * p.q_heads + head[r]) * d;
        LoadRow(p.elem, p.q, at, d, q.data() + r * dp);
        if (p.elem == Elem::kBF16) {
          if (qb.empty()) qb.assign(n * d, 0);
          const uint16_t* src = static_cast<const uint16_t*>(p.q) + at;
          std::copy(src, src + d, qb.data() + r * d);
        }
      }
    }
    if (key_hi <= key_lo) key_lo = key_hi = 0;
  }
};

// Rows [j0, j1) of K (or V) of (b, hkv) as float32, each padded to `width_p` with zeros.
inline void LoadKeys(const AttentionParams& p, const void* base, int64_t width, int64_t width_p,
                     int64_t b, int64_t hkv, int64_t j0, int64_t j1, float* dst) {
  for (int64_t j = j0; j < j1; ++j) {
    float* row = dst + (j - j0) * width_p;
    LoadRow(p.elem, base, ((b * p.kv_len + j) * p.kv_heads + hkv) * width, width, row);
    std::fill(row + width, row + width_p, 0.0f);
  }
}

// The scores of rows x keys [j0, j1) with scale, softcap and the rows' ranges (-inf outside);
// `tanh_out` (when not null) keeps the softcap's tanh for the backward.
inline void DecodeScores(const AttentionParams& p, const DecodeRows& rows, const float* keys,
                         int64_t j0, int64_t j1, float* s, float* tanh_out) {
  const int64_t nk = j1 - j0;
  for (int64_t r = 0; r < rows.n; ++r) {
    float* sr = s + r * kDecodeTile;
    std::fill(sr + nk, sr + kDecodeTile, -kInf);
    const int64_t a = std::max(j0, rows.lo[r]), e = std::min(j1, rows.hi[r]);
    for (int64_t j = j0; j < j1; ++j) {
      if (j < a || j >= e) {
        sr[j - j0] = -kInf;
        continue;
      }
      float x = Dot(rows.q.data() + r * rows.dp, keys + (j - j0) * rows.dp, rows.dp) * p.scale;
      if (p.softcap > 0.0f) {
        const float t = std::tanh(x / p.softcap);
        if (tanh_out != nullptr) tanh_out[r * kDecodeTile + (j - j0)] = t;
        x = p.softcap * t;
      }
      sr[j - j0] = x;
    }
  }
}

// The keys a chunk's task covers: [c0, c1) cut to the rows' union range.
inline void ChunkKeys(const DecodeRows& rows, int64_t chunk, int64_t* c0, int64_t* c1) {
  *c0 = std::max(rows.key_lo, chunk * kDecodeChunk);
  *c1 = std::min(rows.key_hi, (chunk + 1) * kDecodeChunk);
}

// The online softmax of one tile's scores for every row of every kv head (the dot path): each
// row's m, l and output rescaled, its scores s replaced by P = exp(s - m) (exactly 0 for -inf
// and past nk, where the callers leave -inf). `states`: each kv head's m[n], l[n], o[n][width],
// one after another; s: [hk][n][kDecodeTile].
inline void TileSoftmax(int64_t hk, int64_t n, int64_t width, int64_t nk, float* states,
                        float* s) {
  const int64_t per_head = n * (width + 2);
  for (int64_t hkv = 0; hkv < hk; ++hkv) {
    float* m = states + hkv * per_head;
    float* l = m + n;
    float* o = l + n;
    for (int64_t r = 0; r < n; ++r) {
      float* sr = s + (hkv * n + r) * kDecodeTile;
      // NaN-propagating (a NaN's payload never reaches m: std::max(m, NaN) is m), a vector at a
      // time over the whole tile (past nk the scores are -inf): the scalar loop's data-dependent
      // branches cost ~12% of a bfloat16 row's time from L3
      VecF lanes_max = Splat(-kInf);
      for (int64_t j = 0; j < kDecodeTile; j += kLanes) {
        const VecF x = Load(sr + j);
        lanes_max = x > lanes_max || x != x ? x : lanes_max;
      }
      float tile_max = -kInf;
      for (int lane = 0; lane < kLanes; ++lane) {
        const float x = lanes_max[lane];
        tile_max = x > tile_max || x != x ? x : tile_max;
      }
      if (tile_max == -kInf) {
        std::fill(sr, sr + kDecodeTile, 0.0f);
        continue;
      }
      const float m_new = std::max(m[r], tile_max);
      const float alpha = std::exp(m[r] - m_new);  // 0 when m was -inf
      if (alpha != 1.0f) {
        for (int64_t x = 0; x < width; ++x) o[r * width + x] *= alpha;
      }
      const VecF mv = Splat(m_new);
      VecF sum = VecF{};
      for (int64_t j = 0; j < kDecodeTile; j += kLanes) {
        const VecF pr = Exp(Load(sr + j) - mv);  // Exp(-inf) is exactly 0
        sum += pr;
        Store(sr + j, pr);
      }
      float total = 0.0f;
      for (int lane = 0; lane < kLanes; ++lane) total += sum[lane];
      l[r] = l[r] * alpha + total;
      m[r] = m_new;
    }
  }
}

}  // namespace decode_detail

// One tile of keys [j0, j0 + nk) for every kv head's few rows (the dot path): the scores, then
// the online softmax and P V, each pass reading K (then V) in memory order, a key's heads one
// after another: strided reads (one head's keys are H * D apart) would leave the prefetchers
// idle. `states`: each kv head's m[n], l[n], o[n][dvp], one after another.
inline void DotTile(const AttentionParams& p, const std::vector<decode_detail::DecodeRows>& heads,
                    int64_t b, int64_t j0, int64_t nk, bool direct, float* states,
                    std::vector<float>& kstage, std::vector<float>& vstage, std::vector<float>& s) {
  using namespace decode_detail;
  const int64_t n = p.group() * p.q_len, d = p.head_dim, dv = p.v_dim, hk = p.kv_heads;
  const int64_t dp = RoundUpLanes(d), dvp = RoundUpLanes(dv);
  const int64_t per_head = n * (dvp + 2);
  // bfloat16 rows of whole 32-value pairs: read in place with AVX-512 BF16's dot products
  const bool bf16_dot = kHasBf16Dot && p.elem == Elem::kBF16 && d % 32 == 0 && dv % 16 == 0;
  // key j's row of K or V (`width` values, padded to `width_p` in `stage`) as float32: in place
  // when `direct`, else converted into this kv head's slot of the stage
  auto row_of = [&](const void* base, int64_t width, int64_t width_p, std::vector<float>& stage,
                    int64_t j, int64_t hkv) -> const float* {
    const int64_t token = (b * p.kv_len + j0 + j) * hk + hkv;
    if (direct) return static_cast<const float*>(base) + token * width;
    float* row = stage.data() + (hkv * kDecodeTile + j) * width_p;
    LoadRow(p.elem, base, token * width, width, row);
    return row;
  };
  // pass 1: scores, key-major
  std::fill(s.begin(), s.end(), -kInf);
  const int64_t elem_bytes = p.elem == Elem::kF32 ? 4 : 2;
  const int64_t key_bytes = hk * d * elem_bytes, value_bytes = hk * dv * elem_bytes;
  for (int64_t j = 0; j < nk; ++j) {
    // the rows kPrefetchKeys keys ahead (all kv heads: contiguous)
    if (kPrefetchKeys > 0 && j0 + j + kPrefetchKeys < p.kv_len) {
      Prefetch(static_cast<const char*>(p.k) +
                   ((b * p.kv_len + j0 + j + kPrefetchKeys) * hk) * d * elem_bytes, key_bytes);
    }
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      const DecodeRows& rows = heads[hkv];
      const int64_t token = (b * p.kv_len + j0 + j) * hk + hkv;
      const float* k = bf16_dot ? nullptr : row_of(p.k, d, dp, kstage, j, hkv);
      const uint16_t* kb = static_cast<const uint16_t*>(p.k) + token * d;
      for (int64_t r = 0; r < n; ++r) {
        if (j0 + j < rows.lo[r] || j0 + j >= rows.hi[r]) continue;
        float x = (bf16_dot ? DotBf16(rows.qb.data() + r * d, kb, d)
                            : Dot(rows.q.data() + r * dp, k, dp)) * p.scale;
        if (p.softcap > 0.0f) x = p.softcap * std::tanh(x / p.softcap);
        s[(hkv * n + r) * kDecodeTile + j] = x;
      }
    }
  }
  // the online softmax per row: rescale, P = exp(s - m)
  TileSoftmax(hk, n, dvp, nk, states, s.data());
  // pass 2: P V, key-major; a key's P of 0 is skipped, so NaN in a hidden value never enters
  for (int64_t j = 0; j < nk; ++j) {
    if (kPrefetchKeys > 0 && j0 + j + kPrefetchKeys < p.kv_len) {
      Prefetch(static_cast<const char*>(p.v) +
                   ((b * p.kv_len + j0 + j + kPrefetchKeys) * hk) * dv * elem_bytes, value_bytes);
    }
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      float* o = states + hkv * per_head + 2 * n;
      const float* v = nullptr;
      for (int64_t r = 0; r < n; ++r) {
        const float pr = s[(hkv * n + r) * kDecodeTile + j];
        if (pr == 0.0f) continue;
        if (bf16_dot) {
          const int64_t token = (b * p.kv_len + j0 + j) * hk + hkv;
          AxpyBf16(pr, static_cast<const uint16_t*>(p.v) + token * dv, o + r * dvp, dv);
          continue;
        }
        if (v == nullptr) v = row_of(p.v, dv, dvp, vstage, j, hkv);
        Axpy(pr, v, o + r * dvp, dvp);
      }
    }
  }
}

// Whether rows r .. r + count - 1 see the same keys.
inline bool SameKeys(const decode_detail::DecodeRows& rows, int64_t r, int64_t count) {
  for (int64_t i = 1; i < count; ++i) {
    if (rows.lo[r + i] != rows.lo[r] || rows.hi[r + i] != rows.hi[r]) return false;
  }
  return true;
}

// The scores of R rows (r.. r + R - 1, the same keys) against keys [j0, j0 + nk) of kv head hkv,
// K rows of NV whole vectors read in place (a key's kv heads contiguous); sr: R rows of
// kDecodeTile scores. Each key row is loaded once for the R dot products; every row's arithmetic
// and order are those of one row (two accumulators over alternate vectors, one shuffle sum).
template <int NV, int R>
inline void ScoreRows(const AttentionParams& p, const decode_detail::DecodeRows& rows, int64_t r,
                      int64_t hkv, int64_t hk, int64_t j0, int64_t nk, const float* kbase,
                      float* sr) {
  constexpr int64_t kD = NV * kLanes;
  VecF q[R][NV];
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < NV; ++v) q[i][v] = Load(rows.q.data() + (r + i) * kD + v * kLanes);
  }
  const int64_t a = std::max<int64_t>(rows.lo[r] - j0, 0);
  const int64_t e = std::min<int64_t>(rows.hi[r] - j0, nk);
  for (int64_t j = a; j < e; ++j) {
    const float* k = kbase + (j * hk + hkv) * kD;
    VecF acc[R][2] = {};
    for (int v = 0; v + 1 < NV; v += 2) {
      const VecF k0 = Load(k + v * kLanes), k1 = Load(k + (v + 1) * kLanes);
      for (int i = 0; i < R; ++i) {
        acc[i][0] += q[i][v] * k0;
        acc[i][1] += q[i][v + 1] * k1;
      }
    }
    if (NV % 2 != 0) {
      const VecF kl = Load(k + (NV - 1) * kLanes);
      for (int i = 0; i < R; ++i) acc[i][0] += q[i][NV - 1] * kl;
    }
    for (int i = 0; i < R; ++i) {
      float x = decode_detail::HorizontalSum(acc[i][0] + acc[i][1]) * p.scale;
      if (p.softcap > 0.0f) x = p.softcap * std::tanh(x / p.softcap);
      sr[i * kDecodeTile + j] = x;
    }
  }
}

// o[R rows][kD] += P V over keys [0, nk): P rows of kDecodeTile (R of them), V rows `v_step`
// floats apart; each value row loaded once for the R rows; a key whose P is 0 is skipped per row
// (NaN or inf in a value row no row sees never enters).
template <int NV, int R>
inline void AccumulateRows(const float* sr, const float* vbase, int64_t v_step, int64_t nk,
                           float* o) {
  constexpr int64_t kD = NV * kLanes;
  VecF acc[R][NV];
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < NV; ++v) acc[i][v] = Load(o + i * kD + v * kLanes);
  }
  for (int64_t j = 0; j < nk; ++j) {
    float pr[R];
    bool any = false;
    for (int i = 0; i < R; ++i) {
      pr[i] = sr[i * kDecodeTile + j];
      any |= pr[i] != 0.0f;
    }
    if (!any) continue;
    const float* vr = vbase + j * v_step;
    VecF vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = Load(vr + v * kLanes);
    for (int i = 0; i < R; ++i) {
      if (pr[i] == 0.0f) continue;
      const VecF pv = Splat(pr[i]);
      for (int v = 0; v < NV; ++v) acc[i][v] = acc[i][v] + pv * vv[v];
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < NV; ++v) Store(o + i * kD + v * kLanes, acc[i][v]);
  }
}

// Asks for the lines of the row kStreamAhead bytes after row `at` of a stream of rows of
// kRowBytes at `base`, or of row `last_row` when that is nearer: non-temporally by default
// (read once), into L2 with kLocality 2 (kRowsAskHint). The address is clamped rather than the
// call skipped: behind an early return GCC dropped the prefetches.
template <int64_t kRowBytes, int kLocality = 0>
inline void AskAhead(const void* base, int64_t at, int64_t last_row) {
  const int64_t ahead = std::min<int64_t>(at + kStreamAhead / kRowBytes, last_row);
  const char* row = static_cast<const char*>(base) + ahead * kRowBytes;
  for (int64_t x = 0; x < kRowBytes; x += 64) __builtin_prefetch(row + x, 0, kLocality);
}

// DotTile for float32 rows of NV whole vectors read in place, a few rows per kv head (GQA, or
// several query positions): K and then V in memory order, key by key, a key's kv heads one after
// another, as DotTileKeys, each row's lines kStreamAhead bytes further on asked for
// (non-temporal); a key row is loaded once for all the rows' dot products (the query rows from
// L1) and a value row once for 2 rows' outputs and 2 keys (read from and written to L1). Head by head instead (rows 4 KiB apart, the next tile asked into L2 one line
// per page, two rows per key load) a core read ~14.5 GB/s of K and V (n 4, d 128, 2 threads
// ~29); this order ~20. The arithmetic is DotTile's (Dot's two accumulators and shuffle sum,
// Axpy in key order): the same bits.
// The tile's scores past each row's visible keys [lo, hi) set to -inf (up to the whole tile,
// which TileSoftmax reads), softcap on the rest: `s` [hk][n][kDecodeTile], the tile's keys
// [j0, j0 + nk). Shared by the in-place product forms (DotTileRows, DotTileKeys and their
// bfloat16 twins), which score every key of the tile first.
inline void MaskTileScores(const AttentionParams& p,
                           const std::vector<decode_detail::DecodeRows>& heads, int64_t n,
                           int64_t j0, int64_t nk, float* s) {
  for (int64_t hkv = 0; hkv < p.kv_heads; ++hkv) {
    for (int64_t r = 0; r < n; ++r) {
      const int64_t a = std::clamp<int64_t>(heads[hkv].lo[r] - j0, 0, nk);
      const int64_t e = std::clamp<int64_t>(heads[hkv].hi[r] - j0, a, nk);
      float* sr = s + (hkv * n + r) * kDecodeTile;
      std::fill(sr, sr + a, -kInf);
      std::fill(sr + e, sr + kDecodeTile, -kInf);
      if (p.softcap > 0.0f) {
        for (int64_t i = a; i < e; ++i) sr[i] = p.softcap * std::tanh(sr[i] / p.softcap);
      }
    }
  }
}

template <int NV>
inline void DotTileRows(const AttentionParams& p,
                         const std::vector<decode_detail::DecodeRows>& heads, int64_t b,
                         int64_t j0, int64_t nk, float* states, std::vector<float>& s) {
  using namespace decode_detail;
  const int64_t n = p.group() * p.q_len, hk = p.kv_heads;
  constexpr int64_t kD = NV * kLanes;
  const int64_t per_head = n * (kD + 2);
  const float* kbase = static_cast<const float*>(p.k) + (b * p.kv_len + j0) * hk * kD;
  const float* vbase = static_cast<const float*>(p.v) + (b * p.kv_len + j0) * hk * kD;
  const int64_t last_row = (p.kv_len - j0) * hk - 1;  // this batch row's last K/V row
#if defined(__AVX512F__)
  // Every (key, head, row) dot product of the tile (those a row does not see too: set to -inf
  // below), 16 at a time summed together (SumLanes16, _mm512_reduce_add_ps's tree: the same bits
  // as ScoreRows) and scattered to s. ScoreRows' horizontal sum, range checks and query loads
  // per key and run of rows cost ~3x its FMAs: one core from L3, 4 rows, d 128: ~25 -> ~34 GB/s
  // (~175 -> ~120 cycles a key and kv head), with the value products' two keys per output load
  // and store below.
  __m512 part[16];
  int64_t dest[16];
  int queued = 0;
  alignas(64) float sums[16];
  const __m512 scale = _mm512_set1_ps(p.scale);
  auto flush = [&] {
    for (int l = queued; l < 16; ++l) part[4 * (l % 4) + l / 4] = _mm512_setzero_ps();
    _mm512_store_ps(sums, _mm512_mul_ps(SumLanes16(part), scale));
    for (int l = 0; l < queued; ++l) s[dest[l]] = sums[l];
    queued = 0;
  };
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      AskAhead<kD * 4, kRowsAskHint>(kbase, j * hk + hkv, last_row);
      const float* k = kbase + (j * hk + hkv) * kD;
      __m512 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = _mm512_loadu_ps(k + v * kLanes);
      const float* q = heads[hkv].q.data();
      for (int64_t r = 0; r < n; ++r) {
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (int v = 0; v + 1 < NV; v += 2) {
          acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * kD + v * kLanes), kv[v], acc0);
          acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * kD + (v + 1) * kLanes), kv[v + 1], acc1);
        }
        part[4 * (queued % 4) + queued / 4] = _mm512_add_ps(acc0, acc1);
        dest[queued] = (hkv * n + r) * kDecodeTile + j;
        if (++queued == 16) flush();
      }
    }
  }
  if (queued > 0) flush();
  MaskTileScores(p, heads, n, j0, nk, s.data());
#else
  // each kv head's rows in runs of 4, 2 or 1 that see the same keys: (first row, count)
  std::vector<std::pair<int64_t, int>> runs;
  std::vector<int64_t> first_run(hk + 1, 0);
  for (int64_t hkv = 0; hkv < hk; ++hkv) {
    first_run[hkv] = static_cast<int64_t>(runs.size());
    for (int64_t r = 0; r < n;) {
      const int count = r + 3 < n && SameKeys(heads[hkv], r, 4) ? 4
                        : r + 1 < n && SameKeys(heads[hkv], r, 2) ? 2 : 1;
      runs.emplace_back(r, count);
      r += count;
    }
  }
  first_run[hk] = static_cast<int64_t>(runs.size());
  std::fill(s.begin(), s.end(), -kInf);  // (keys a row does not see stay -inf)
  for (int64_t j = 0; j < nk; ++j) {
    const float* kkey = kbase + j * hk * kD;
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      AskAhead<kD * 4, kRowsAskHint>(kbase, j * hk + hkv, last_row);
      const DecodeRows& rows = heads[hkv];
      for (int64_t u = first_run[hkv]; u < first_run[hkv + 1]; ++u) {
        const int64_t r = runs[u].first;
        float* sr = s.data() + (hkv * n + r) * kDecodeTile + j;
        switch (runs[u].second) {
          case 4: ScoreRows<NV, 4>(p, rows, r, hkv, hk, j0 + j, 1, kkey, sr); break;
          case 2: ScoreRows<NV, 2>(p, rows, r, hkv, hk, j0 + j, 1, kkey, sr); break;
          default: ScoreRows<NV, 1>(p, rows, r, hkv, hk, j0 + j, 1, kkey, sr); break;
        }
      }
    }
  }
#endif
  // the online softmax per row
  TileSoftmax(hk, n, kD, nk, states, s.data());
  // P V in memory order, two keys per load and store of the output rows (the same FMAs in the
  // same order); a key's P of 0 is skipped per row
  for (int64_t j = 0; j < nk; j += 2) {
    const int64_t keys = std::min<int64_t>(2, nk - j);
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      AskAhead<kD * 4, kRowsAskHint>(vbase, j * hk + hkv, last_row);
      AskAhead<kD * 4, kRowsAskHint>(vbase, (j + 1) * hk + hkv, last_row);
      float* o = states + hkv * per_head + 2 * n;
      const float* sh = s.data() + hkv * n * kDecodeTile + j;
      const float* vr = vbase + (j * hk + hkv) * kD;
      int64_t r = 0;
      for (; r + 1 < n; r += 2) {
        AccumulateRows<NV, 2>(sh + r * kDecodeTile, vr, hk * kD, keys, o + r * kD);
      }
      for (; r < n; ++r) AccumulateRows<NV, 1>(sh + r * kDecodeTile, vr, hk * kD, keys, o + r * kD);
    }
  }
}

// DotTileRows for one row per kv head (MHA decode: q_seq 1, group 1), reading K and then V in
// memory order: key by key, a key's kv heads one after another (the tile's K is nk * hk rows of
// kD floats back to back). The query rows and the output rows are read from and written to L1
// for every (key, head) pair instead of held in registers over a head's keys, but the reads are
// one sequential stream, and each row's lines kStreamAhead bytes further on are asked for
// (non-temporal, as they are read once; into L2 on Intel, kLocality: OneRowAsksIntoL2): a core
// read K and V at ~36 GB/s here (Zen 5; d 128; ~33 for d 64),
// against ~27 (~21) in a head-by-head order (rows 4 KiB apart), with ~41 for a plain
// read; ~33 (~27) without the prefetches. (Reducing 16 pairs' partial sums together with a
// transpose-and-add tree instead of one horizontal sum each was slower on this stream: ~23 GB/s
// for the scores alone, against ~31.) Every score and output row is DotTile's: the same dot
// product (two accumulators over alternate vectors, one shuffle sum), scale, softcap and key
// order of P V: the same bits.
template <int NV, int kLocality>
inline void DotTileKeys(const AttentionParams& p,
                        const std::vector<decode_detail::DecodeRows>& heads, int64_t b,
                        int64_t j0, int64_t nk, float* states, std::vector<float>& s) {
  using namespace decode_detail;
  const int64_t hk = p.kv_heads;
  constexpr int64_t kD = NV * kLanes;
  const int64_t per_head = kD + 2;  // m, l, o[kD]
  const float* kbase = static_cast<const float*>(p.k) + (b * p.kv_len + j0) * hk * kD;
  const float* vbase = static_cast<const float*>(p.v) + (b * p.kv_len + j0) * hk * kD;
  const float scale = p.scale;
  const int64_t last_row = (p.kv_len - j0) * hk - 1;  // this batch row's last K/V row
  // the scores of every key of the tile, the ones a row does not see set to -inf below (K's rows
  // there are read, and lie in the tile anyway)
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      const float* k = kbase + (j * hk + hkv) * kD;
      AskAhead<kD * 4, kLocality>(kbase, j * hk + hkv, last_row);
      const float* q = heads[hkv].q.data();
      VecF acc0 = VecF{}, acc1 = VecF{};
      for (int v = 0; v + 1 < NV; v += 2) {
        acc0 += Load(q + v * kLanes) * Load(k + v * kLanes);
        acc1 += Load(q + (v + 1) * kLanes) * Load(k + (v + 1) * kLanes);
      }
      if (NV % 2 != 0) acc0 += Load(q + (NV - 1) * kLanes) * Load(k + (NV - 1) * kLanes);
      s[hkv * kDecodeTile + j] = HorizontalSum(acc0 + acc1) * scale;
    }
  }
  MaskTileScores(p, heads, 1, j0, nk, s.data());
  TileSoftmax(hk, 1, kD, nk, states, s.data());
  // P V in memory order; a pair whose P is 0 is skipped (NaN or inf in a value row no row sees
  // never enters)
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      AskAhead<kD * 4, kLocality>(vbase, j * hk + hkv, last_row);
      const float pr = s[hkv * kDecodeTile + j];
      if (pr == 0.0f) continue;
      float* o = states + hkv * per_head + 2;
      const float* v = vbase + (j * hk + hkv) * kD;
      const VecF pv = Splat(pr);
      for (int x = 0; x < NV; ++x) {
        Store(o + x * kLanes, Load(o + x * kLanes) + pv * Load(v + x * kLanes));
      }
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// DotTileKeys for bfloat16 K and V of kC * 32 values per row (one row per kv head), read in
// place in memory order, key by key, a key's kv heads one after another. DotTile's form (a dot
// product and an AxpyBf16 per key and head, loops and range checks around each) ran at ~30 GB/s
// a core from L3 against ~65 for float32 here: half the bytes per key in the same time. Here 16
// (key, head) dot products are summed together (SumLanes16: its tree is _mm512_reduce_add_ps's)
// and scattered, and a head's output row takes two keys' products per load and store. The
// arithmetic is DotTile's (DotBf16's two chains over alternate 32-value chunks, the same sum
// tree, times the scale; AxpyBf16's widening and FMA in key order): the same bits. `qall`: every
// kv head's query row, [hk][kC * 32].
template <int kC, int kLocality>
inline void DotTileKeysBf16(const AttentionParams& p,
                            const std::vector<decode_detail::DecodeRows>& heads, int64_t b,
                            int64_t j0, int64_t nk, float* states, std::vector<float>& s,
                            const uint16_t* qall) {
  using namespace decode_detail;
  const int64_t hk = p.kv_heads;
  constexpr int64_t kD = kC * 32;
  const int64_t per_head = kD + 2;  // m, l, o[kD]
  const uint16_t* kbase = static_cast<const uint16_t*>(p.k) + (b * p.kv_len + j0) * hk * kD;
  const uint16_t* vbase = static_cast<const uint16_t*>(p.v) + (b * p.kv_len + j0) * hk * kD;
  const int64_t last_row = (p.kv_len - j0) * hk - 1;  // this batch row's last K/V row
  const int64_t pairs = nk * hk;                      // (key, head) rows of the tile
  const __m512 scale = _mm512_set1_ps(p.scale);
  alignas(64) float sums[16];
  int64_t hkv = 0, j = 0;  // of pair u0
  for (int64_t u0 = 0; u0 < pairs; u0 += 16) {
    __m512 a[16];
    int64_t g = hkv;
    for (int l = 0; l < 16; ++l) {  // pair u0 + l into a[4 (l % 4) + l / 4]: lane l of the sums
      const int64_t u = std::min<int64_t>(u0 + l, pairs - 1);
      AskAhead<kD * 2, kLocality>(kbase, u, last_row);
      const uint16_t* k = kbase + u * kD;
      const uint16_t* q = qall + g * kD;
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      for (int c = 0; c + 1 < kC; c += 2) {
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(q + c * 32),
                                (__m512bh)_mm512_loadu_si512(k + c * 32));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(q + c * 32 + 32),
                                (__m512bh)_mm512_loadu_si512(k + c * 32 + 32));
      }
      a[4 * (l % 4) + l / 4] = _mm512_add_ps(acc0, acc1);
      if (++g == hk) g = 0;
    }
    _mm512_store_ps(sums, _mm512_mul_ps(SumLanes16(a), scale));
    const int64_t count = std::min<int64_t>(16, pairs - u0);
    for (int l = 0; l < count; ++l) {
      s[hkv * kDecodeTile + j] = sums[l];
      if (++hkv == hk) {
        hkv = 0;
        ++j;
      }
    }
  }
  MaskTileScores(p, heads, 1, j0, nk, s.data());
  TileSoftmax(hk, 1, kD, nk, states, s.data());
  // P V in memory order; a pair whose P is 0 is skipped (NaN or inf in a value row no row sees
  // never enters)
  for (int64_t i = 0; i < nk; ++i) {
    for (int64_t h = 0; h < hk; ++h) {
      const int64_t u = i * hk + h;
      AskAhead<kD * 2, kLocality>(vbase, u, last_row);
      const float pr = s[h * kDecodeTile + i];
      if (pr == 0.0f) continue;
      float* o = states + h * per_head + 2;
      const uint16_t* v = vbase + u * kD;
      const __m512 pv = _mm512_set1_ps(pr);
      for (int x = 0; x < kD; x += 16) {
        const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + x));
        const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hv), 16));
        _mm512_storeu_ps(o + x, _mm512_fmadd_ps(pv, f, _mm512_loadu_ps(o + x)));
      }
    }
  }
}

// DotTileRows for bfloat16 K and V of kC * 32 values per row, 2 to kDecodeGemmRows - 1 rows per
// kv head (padded to kR: 2, 4 or 8), read in place: the scores on VDPBF16PS with the head dim in the lanes (two chains over alternate
// 32-value chunks), kKeys = 16 / kR keys of one kv head x kR rows summed together by SumLanes16
// into each row's kKeys consecutive scores, kv heads in turn;
// the online softmax a vector of keys at a time (TileSoftmax); P (float32, unrounded) times V
// widened to float32, kValueKeys keys per load and store of an output block. The rows-in-lanes
// products (ScoresBf16Rows4, ValuesBf16) spent 16 lanes of softmax on 4 rows and interleaved P
// and V per tile: one core, 4 rows, d 128, 8 kv heads: from L3 ~28 -> ~32.5 GB/s (~72 -> ~63
// cycles a key and kv head), from memory ~19 -> ~21. (The pairs in memory order with a scalar
// transpose of the sums, or asking for this tile's V and the next tile's K into L2 instead of
// K and V kStreamAhead ahead, or asking 16 or 32 KiB ahead, or with T0 or T1: no faster, on
// the Zen 5 of that session; on a Zen 4 with slower memory T1 (kRowsAskHint) was 1.6x faster.)
// `qall`: every kv head's query rows, [hk][kR][kC * 32] (rows past n zero).
inline constexpr int kValueKeys = 4;
template <int kC, int kR>
inline void DotTileRowsBf16(const AttentionParams& p,
                            const std::vector<decode_detail::DecodeRows>& heads, int64_t b,
                            int64_t j0, int64_t nk, float* states, std::vector<float>& s,
                            const uint16_t* qall) {
  using namespace decode_detail;
  const int64_t n = p.group() * p.q_len, hk = p.kv_heads;
  constexpr int64_t kD = kC * 32;
  const int64_t per_head = n * (kD + 2);
  const uint16_t* kbase = static_cast<const uint16_t*>(p.k) + (b * p.kv_len + j0) * hk * kD;
  const uint16_t* vbase = static_cast<const uint16_t*>(p.v) + (b * p.kv_len + j0) * hk * kD;
  const int64_t last_row = (p.kv_len - j0) * hk - 1;  // this batch row's last K/V row
  auto ask = [&](const uint16_t* base, int64_t row) {
    AskAhead<kD * 2, kRowsAskHint>(base, row, last_row);
  };
  // kKeys keys of one kv head at a time (keys past nk score key nk - 1 again; masked below), kv
  // heads in turn: 16 dot products (kKeys keys x kR rows, rows past n of zero queries) summed
  // by SumLanes16 into each row's kKeys consecutive scores
  constexpr int kKeys = 16 / kR;
  const __m512 scale = _mm512_set1_ps(p.scale);
  alignas(64) float sums[16];
  for (int64_t j = 0; j < nk; j += kKeys) {
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      __m512 a[16];
      const uint16_t* q = qall + hkv * kR * kD;
      for (int i = 0; i < kKeys; ++i) {
        const int64_t u = std::min<int64_t>(j + i, nk - 1) * hk + hkv;
        ask(kbase, u);
        const uint16_t* k = kbase + u * kD;
        __m512bh kv[kC];
        for (int c = 0; c < kC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + c * 32);
        for (int r = 0; r < kR; ++r) {
          __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
          for (int c = 0; c + 1 < kC; c += 2) {
            acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(q + r * kD + c * 32),
                                    kv[c]);
            acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(q + r * kD + c * 32 + 32),
                                    kv[c + 1]);
          }
          const int l = r * kKeys + i;  // lane of the sums
          a[4 * (l % 4) + l / 4] = _mm512_add_ps(acc0, acc1);
        }
      }
      _mm512_store_ps(sums, _mm512_mul_ps(SumLanes16(a), scale));
      float* sh = s.data() + hkv * n * kDecodeTile + j;
      for (int64_t r = 0; r < n; ++r) std::memcpy(sh + r * kDecodeTile, sums + r * kKeys, sizeof(float) * kKeys);
    }
  }
  MaskTileScores(p, heads, n, j0, nk, s.data());
  TileSoftmax(hk, n, kD, nk, states, s.data());
  // P V: kValueKeys keys (hk rows apart) at a time, blocks of 64 output columns; a key whose P
  // is 0 is skipped per row (NaN or inf in a value row the row does not see never enters)
  for (int64_t j = 0; j < nk; j += kValueKeys) {
    const int64_t keys = std::min<int64_t>(kValueKeys, nk - j);
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      for (int64_t i = 0; i < kValueKeys; ++i) ask(vbase, (j + i) * hk + hkv);
      float* o = states + hkv * per_head + 2 * n;
      const float* sh = s.data() + hkv * n * kDecodeTile + j;
      const uint16_t* v = vbase + (j * hk + hkv) * kD;
      for (int64_t x = 0; x < kD; x += 64) {
        __m512 vv[kValueKeys][4];
        for (int64_t i = 0; i < kValueKeys; ++i) {
          const uint16_t* row = v + std::min(i, keys - 1) * hk * kD + x;
          for (int c = 0; c < 4; ++c) {
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 16));
            vv[i][c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
          }
        }
        for (int64_t r = 0; r < n; ++r) {
          float* orow = o + r * kD + x;
          __m512 acc[4];
          for (int c = 0; c < 4; ++c) acc[c] = _mm512_loadu_ps(orow + c * 16);
          for (int64_t i = 0; i < keys; ++i) {
            const float pr = sh[r * kDecodeTile + i];
            if (pr == 0.0f) continue;
            const __m512 pv = _mm512_set1_ps(pr);
            for (int c = 0; c < 4; ++c) acc[c] = _mm512_fmadd_ps(pv, vv[i][c], acc[c]);
          }
          for (int c = 0; c < 4; ++c) _mm512_storeu_ps(orow + c * 16, acc[c]);
        }
      }
    }
  }
}
#else
template <int kC, int kLocality>
inline void DotTileKeysBf16(const AttentionParams&, const std::vector<decode_detail::DecodeRows>&,
                            int64_t, int64_t, int64_t, float*, std::vector<float>&,
                            const uint16_t*) {}
template <int kC, int kR>
inline void DotTileRowsBf16(const AttentionParams&, const std::vector<decode_detail::DecodeRows>&,
                            int64_t, int64_t, int64_t, float*, std::vector<float>&,
                            const uint16_t*) {}
#endif

// Forward: out, lse, max. One task per (batch row, chunk of keys) for every kv head. With few
// rows per kv head, a score is one dot product over the head dim, read straight from K (float32)
// or from the tile's converted rows; with kDecodeGemmRows or more, the rows sit in the vector
// lanes, as in the tiled kernel: S^T = K Q^T and O^T += V^T P^T are small matrix products.
inline void DecodeForward(const AttentionParams& p, const ForwardOutputs& outputs,
                          ffi::ThreadPool* pool) {
  using namespace decode_detail;
  const int64_t n = p.group() * p.q_len, d = p.head_dim, dv = p.v_dim, hk = p.kv_heads;
  const int64_t dp = RoundUpLanes(d), dvp = RoundUpLanes(dv), np = RoundUpLanes(n);
  const int64_t chunks = std::max<int64_t>(CeilDiv(p.kv_len, kDecodeChunk), 1);
  const int64_t per_head = n * (dvp + 2);  // m[n], l[n], o[n][dvp]
  const bool lanes_shape = dp == 64 || dp == 128 || dp == 256;
  // bfloat16 K and V read in place by the products (ScoresBf16, ValuesBf16): a tile converted to
  // float32 first cost as much as the products (16 rows: ~5 GB/s a core), and from 2 rows per kv
  // head these products also beat DotTile's dot products (2-4 rows: ~10-12 -> ~13-14 GB/s a core).
  // P meets V rounded to bfloat16 (ValuesBf16); up to 4 rows score with the head dim in the lanes
  // (ScoresBf16Rows4). One core from L3 (d 128, 8 kv heads): 4 rows ~146 -> ~80 cycles a key and
  // kv head, 16 rows values ~70 -> ~50 (scores unchanged, ~42)
  // bfloat16 K and V rows of 64, 128 or 256 values with fewer than kDecodeGemmRows rows per kv
  // head: DotTileKeysBf16 (one row) or DotTileRowsBf16; the products above from 8 rows (their
  // FLOPs per key are then the lanes' own) or when K and V rows differ in length
  // (4 to 7 rows took the product forms for float32 with 8 or more kv heads and bfloat16 with 4
  // or fewer while the dot forms asked for K and V non-temporally; with kRowsAskHint the dot
  // forms are as fast or faster there too: Zen 4, 2 cores, K+V GB/s, float32 8x1x4096x32/8x128
  // 22.1-22.3 -> 27.9-28.5, bfloat16 1x1x131072x8/2x128 16.7-17.6 -> 24.8-30.4, 6 rows with 8
  // kv heads float32 22.0-22.3 -> 21.8-23.1; docs/performance.md, 2026-11-27 fifth session)
  const bool bf16_keys = kHasBf16Dot && p.elem == Elem::kBF16 && n < kDecodeGemmRows &&
                         d == dv && (d == 64 || d == 128 || d == 256);
  const bool bf16_lanes = kHasBf16Dot && lanes_shape && p.elem == Elem::kBF16 && d % 4 == 0 &&
                          dv % kLanes == 0 && n >= 2 && !bf16_keys;
  const int64_t rows_padded = n == 1 ? 1 : n == 2 ? 2 : n <= 4 ? 4 : 8;  // (DotTileRowsBf16's kR)
  const bool gemm = (n >= kDecodeGemmRows && lanes_shape) || bf16_lanes;
  // float32 rows of whole vectors are read in place; others are converted per tile
  const bool direct = p.elem == Elem::kF32 && d == dp && dv == dvp && !gemm;
  const bool exact_keys = p.kv_len < (int64_t{1} << 24);  // key indices exact as float32
  FloatBuffer partial(p.batch * chunks * hk * per_head);
  auto state = [&](int64_t b, int64_t chunk, int64_t hkv) {
    return partial.get() + ((b * chunks + chunk) * hk + hkv) * per_head;
  };
  auto state_of_chunk = [&](int64_t b, int64_t chunk) { return state(b, chunk, 0); };
  ParallelFor(pool, p.batch * chunks, [&](int64_t t) {
    const int64_t chunk = t % chunks, b = t / chunks;
    std::vector<DecodeRows> heads;
    heads.reserve(hk);
    int64_t c0 = p.kv_len, c1 = 0;
    for (int64_t hkv = 0; hkv < hk; ++hkv) {
      heads.emplace_back(p, b, hkv);
      int64_t a, e;
      ChunkKeys(heads.back(), chunk, &a, &e);
      if (a < e) {
        c0 = std::min(c0, a);
        c1 = std::max(c1, e);
      }
      float* m = state(b, chunk, hkv);
      std::fill(m, m + n, -kInf);
      std::fill(m + n, m + per_head, 0.0f);
    }
    // every kv head's rows of a tile when converted (the dot path's DotTile), or one row's
    // (direct); the products' stage only once a tile is not read in place (most tasks never
    // convert one: 2 x 256 KiB zeroed per task otherwise)
    std::vector<float> kstage, vstage;
    // bf16_keys: every kv head's query rows, [hk][rows_padded][d] (rows past n zero)
    std::vector<uint16_t> qall;
    if (bf16_keys) {
      qall.assign(hk * rows_padded * d, 0);
      for (int64_t hkv = 0; hkv < hk; ++hkv) {
        const std::vector<uint16_t>& qb = heads[hkv].qb;
        if (!qb.empty()) std::copy(qb.begin(), qb.end(), qall.data() + hkv * rows_padded * d);
      }
    } else if (!gemm) {
      kstage.assign((direct ? 1 : hk) * kDecodeTile * dp, 0.0f);
      vstage.assign((direct ? 1 : hk) * kDecodeTile * dvp, 0.0f);
    }
    std::vector<float> s(hk * n * kDecodeTile);
    // the lane layout (gemm): q^T [d][np], O^T [dvp][np], row max and sum [np] per kv head;
    // O^T twice per kv head: ValueBlockAsking writes a tile's result next to the one it read
    // (which stays for a redo when the result is not finite), `o_second` says which is current;
    // bf16_lanes keeps O instead ([n][dvp], ValuesBf16)
    std::vector<float> qt, ot, ml, ll, st, range_lo, range_hi;
    std::vector<uint32_t> qt2;  // bf16_lanes: [hk][d / 2][np], a row's pair per lane
    // bf16_lanes: a tile's P and V in key pairs (ValuesBf16): [kDecodeTile / 2][np], [..][dv]
    std::vector<uint32_t> pairs_p, pairs_v;
    std::vector<char> o_second;
    std::vector<VecF> finite_sums;  // x * 0 summed over a tile's V rows, per kv head
    if (gemm) {
      qt.assign(hk * d * np, 0.0f);
      if (bf16_lanes) {
        qt2.assign(hk * (d / 2) * np, 0);
        pairs_p.assign(kDecodeTile / 2 * np, 0);
        pairs_v.assign(kDecodeTile / 2 * dv, 0);
        for (int64_t hkv = 0; hkv < hk; ++hkv) {
          if (heads[hkv].qb.empty()) continue;  // no row sees a key
          for (int64_t r = 0; r < n; ++r) {
            const uint16_t* q = heads[hkv].qb.data() + r * d;
            for (int64_t x = 0; x < d / 2; ++x) {
              qt2[(hkv * (d / 2) + x) * np + r] = q[2 * x] | uint32_t{q[2 * x + 1]} << 16;
            }
          }
        }
      }
      ot.assign(2 * hk * dvp * np, 0.0f);
      o_second.assign(hk, 0);
      ml.assign(hk * np, -kInf);
      ll.assign(hk * np, 0.0f);
      st.assign(kDecodeTile * np, 0.0f);
      for (int64_t hkv = 0; hkv < hk; ++hkv) {
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t x = 0; x < d; ++x) qt[(hkv * d + x) * np + r] = heads[hkv].q[r * dp + x];
        }
      }
      // each lane's visible keys [lo, hi) as floats (exact for key indices below 2**24,
      // `exact_keys`; longer caches take the scalar loop); padding lanes and invalid rows see
      // none
      range_lo.assign(hk * np, kInf);
      range_hi.assign(hk * np, -kInf);
      for (int64_t hkv = 0; hkv < hk; ++hkv) {
        for (int64_t r = 0; r < n; ++r) {
          range_lo[hkv * np + r] = static_cast<float>(heads[hkv].lo[r]);
          range_hi[hkv * np + r] = static_cast<float>(heads[hkv].hi[r]);
        }
      }
    }
    const bool into_l2 = OneRowAsksIntoL2();  // (the one-row forms' requests)
    int64_t asked_tile = -1;  // the tile the products of the one before asked for, if any
    for (int64_t j0 = c0; j0 < c1; j0 += kDecodeTile) {
      const int64_t j1 = std::min(j0 + kDecodeTile, c1), nk = j1 - j0;
      if (!gemm) {
        float* states = state_of_chunk(b, chunk);
        if (bf16_keys && n == 1) {
#define ATTNAUX_KEYS_BF16(L)                                                           \
  switch (d / 32) {                                                                   \
    case 2: DotTileKeysBf16<2, L>(p, heads, b, j0, nk, states, s, qall.data()); break; \
    case 4: DotTileKeysBf16<4, L>(p, heads, b, j0, nk, states, s, qall.data()); break; \
    default: DotTileKeysBf16<8, L>(p, heads, b, j0, nk, states, s, qall.data()); break; \
  }
          if (into_l2) {
            ATTNAUX_KEYS_BF16(2)
          } else {
            ATTNAUX_KEYS_BF16(0)
          }
#undef ATTNAUX_KEYS_BF16
        } else if (bf16_keys) {
#define ATTNAUX_ROWS_BF16(R)                                                              \
  switch (d / 32) {                                                                      \
    case 2: DotTileRowsBf16<2, R>(p, heads, b, j0, nk, states, s, qall.data()); break; \
    case 4: DotTileRowsBf16<4, R>(p, heads, b, j0, nk, states, s, qall.data()); break; \
    default: DotTileRowsBf16<8, R>(p, heads, b, j0, nk, states, s, qall.data()); break; \
  }
          if (rows_padded == 2) {
            ATTNAUX_ROWS_BF16(2)
          } else if (rows_padded == 4) {
            ATTNAUX_ROWS_BF16(4)
          } else {
            ATTNAUX_ROWS_BF16(8)
          }
#undef ATTNAUX_ROWS_BF16
        } else if (direct && dp == dvp && n == 1 && dp == 8 * kLanes) {
          if (into_l2) {
            DotTileKeys<8, 2>(p, heads, b, j0, nk, state_of_chunk(b, chunk), s);
          } else {
            DotTileKeys<8, 0>(p, heads, b, j0, nk, state_of_chunk(b, chunk), s);
          }
        } else if (direct && dp == dvp && n == 1 && dp == 4 * kLanes) {
          if (into_l2) {
            DotTileKeys<4, 2>(p, heads, b, j0, nk, state_of_chunk(b, chunk), s);
          } else {
            DotTileKeys<4, 0>(p, heads, b, j0, nk, state_of_chunk(b, chunk), s);
          }
        } else if (direct && dp == dvp && dp == 8 * kLanes) {
          DotTileRows<8>(p, heads, b, j0, nk, state_of_chunk(b, chunk), s);
        } else if (direct && dp == dvp && dp == 4 * kLanes) {
          DotTileRows<4>(p, heads, b, j0, nk, state_of_chunk(b, chunk), s);
        } else {
          DotTile(p, heads, b, j0, nk, direct, state_of_chunk(b, chunk), kstage, vstage, s);
        }
        continue;
      }
      // K and V: float32 rows of whole vectors of a whole tile are read in place by the
      // products (their arithmetic overlaps the reads from memory); otherwise the tile's rows of
      // every kv head are read in memory order (a key's heads are contiguous) and converted to
      // float32: [hk][kDecodeTile][dp] (keys past nk zero).
      const bool in_place = p.elem == Elem::kF32 && d == dp && dv == dvp &&
                            nk == kDecodeTile && KeyRowStepCompiled(hk * d);
      const int64_t k_step = in_place ? hk * d : dp, v_step = in_place ? hk * dv : dvp;
      std::vector<char> bad(hk, 0);
      // whole tiles of rows 1024 or 2048 floats per key (every kv head) and one vector of rows
      // (np == kLanes): the products ask for the next kv head's rows as they go (KeyBlockAsking,
      // ValueBlockAsking), and check their results instead of V's rows; otherwise, and for the
      // task's first tile, one pass in memory order first
      const bool asking = in_place && np == kLanes && (k_step == 1024 || k_step == 2048) &&
                          d % kKeyBlock == 0;
      const bool asked = asking && asked_tile == j0;
      // the score products scale, mask and take the tile maximum themselves (ScoreMask)
      const bool masked = asking && p.softcap == 0.0f && exact_keys;
      asked_tile = -1;
      // each kv head's products ask for the next kv head's K rows (the score blocks) and V rows
      // (the value blocks), the last one's for the next tile's first kv head, a share per call
      const bool ask_next = asking && j1 + kDecodeTile <= c1;
      auto share = [&](const void* base, int64_t width, int64_t step, int64_t hkv_now,
                       int64_t call, int64_t calls) {
        AskShare ask;
        const int64_t g = hkv_now + 1;
        if (g == hk && !ask_next) return ask;
        const int64_t key = g == hk ? j1 : j0;
        ask.row = reinterpret_cast<const char*>(static_cast<const float*>(base) +
                                                (b * p.kv_len + key) * step + g % hk * width);
        ask.row_lines = CeilDiv(width * 4, int64_t{64});
        ask.stride = step * 4;
        const int64_t total = kDecodeTile * ask.row_lines;
        const int64_t from = total * call / calls, to = total * (call + 1) / calls;
        ask.row += from / ask.row_lines * ask.stride;
        ask.first_col = from % ask.row_lines;
        ask.lines = to - from;
        return ask;
      };
      if (in_place && !asked) {  // V's rows in memory order; one look at the lanes per kv head
        // K's rows are asked for (into L2) in the same memory-order pass: the products read
        // them head by head, 4 KiB apart, which the prefetchers follow poorly
        const float* vbase = static_cast<const float*>(p.v) + (b * p.kv_len + j0) * hk * dv;
        const char* kbytes = static_cast<const char*>(p.k) + (b * p.kv_len + j0) * hk * d * 4;
        finite_sums.assign(hk, VecF{});
        for (int64_t j = 0; j < nk; ++j) {
          for (int64_t hkv = 0; hkv < hk; ++hkv) {
            const char* krow = kbytes + (j * hk + hkv) * d * 4;
            for (int64_t x = 0; x < d * 4; x += 64) __builtin_prefetch(krow + x, 0, 2);
            const float* row = vbase + (j * hk + hkv) * dv;
            VecF acc = finite_sums[hkv];
            for (int64_t e = 0; e < dvp; e += kLanes) acc += Load(row + e) * 0.0f;
            finite_sums[hkv] = acc;
          }
        }
        for (int64_t hkv = 0; hkv < hk; ++hkv) {
          for (int lane = 0; lane < kLanes; ++lane) bad[hkv] |= finite_sums[hkv][lane] != 0.0f;
        }
      } else if (!in_place && !bf16_lanes) {
        if (kstage.empty()) {
          kstage.assign(hk * kDecodeTile * dp, 0.0f);
          vstage.assign(hk * kDecodeTile * dvp, 0.0f);
        } else if (nk < kDecodeTile) {
          std::fill(kstage.begin(), kstage.end(), 0.0f);
          std::fill(vstage.begin(), vstage.end(), 0.0f);
        }
        for (int64_t j = 0; j < nk; ++j) {
          for (int64_t hkv = 0; hkv < hk; ++hkv) {
            const int64_t token = (b * p.kv_len + j0 + j) * hk + hkv;
            float* krow_j = kstage.data() + (hkv * kDecodeTile + j) * dp;
            float* vrow_j = vstage.data() + (hkv * kDecodeTile + j) * dvp;
            LoadRow(p.elem, p.k, token * d, d, krow_j);
            LoadRow(p.elem, p.v, token * dv, dv, vrow_j);
            if (!AllFinite(vrow_j, dvp)) bad[hkv] = 1;
          }
        }
      }
      for (int64_t hkv = 0; hkv < hk; ++hkv) {
        const DecodeRows& rows = heads[hkv];
        LineAsk next_ask;  // bf16_lanes: this kv head's share of the next tile (of the task)
        // ScoresBf16 masks the scores and takes the tile maximum (LaneScoreMask): hi cut to the
        // tile's end, the maximum per lane
        bool lane_masked = false;
        float hi_cut[kDecodeMaxRows], lane_max[kDecodeMaxRows];
        const float* kh = in_place
            ? static_cast<const float*>(p.k) + ((b * p.kv_len + j0) * hk + hkv) * d
            : kstage.data() + hkv * kDecodeTile * dp;
        const float* vh = in_place
            ? static_cast<const float*>(p.v) + ((b * p.kv_len + j0) * hk + hkv) * dv
            : vstage.data() + hkv * kDecodeTile * dvp;
        // Rows in the lanes: S^T [keys][np] = K Q^T
        ScoreMask mask;
        if (masked) {
          mask.scale = p.scale;
          mask.lo = Load(range_lo.data() + hkv * np);
          mask.hi = Load(range_hi.data() + hkv * np);
          mask.tile_max = Splat(-kInf);
        }
        if (asking) {
          for (int64_t jb = 0; jb < kDecodeTile; jb += kKeyBlock) {
            const float* q = qt.data() + hkv * d * np;
            float* c = st.data() + jb * np;
            const AskShare ask =
                share(p.k, d, k_step, hkv, jb / kKeyBlock, kDecodeTile / kKeyBlock);
            const float first_key = static_cast<float>(j0 + jb);
#define ATTNAUX_KEY_BLOCK(STEP)                                                          \
  if (masked) {                                                                          \
    KeyBlockAsking<STEP, true>(d, kh + jb * k_step, q, c, ask, &mask, first_key);        \
  } else {                                                                               \
    KeyBlockAsking<STEP, false>(d, kh + jb * k_step, q, c, ask, nullptr, first_key);     \
  }
            if (k_step == 1024) {
              ATTNAUX_KEY_BLOCK(1024)
            } else {
              ATTNAUX_KEY_BLOCK(2048)
            }
#undef ATTNAUX_KEY_BLOCK
          }
          if (ask_next && hkv == hk - 1) asked_tile = j1;
        } else if (bf16_lanes) {
          if (j1 < c1) {  // this kv head's share of the next tile (of the task)
            const int64_t keys = std::min(c1, j1 + kDecodeTile) - j1;
            const int64_t k_lines = CeilDiv(keys * hk * d * 2, int64_t{64});
            const int64_t v_lines = CeilDiv(keys * hk * dv * 2, int64_t{64});
            const int64_t k0 = k_lines * hkv / hk, v0 = v_lines * hkv / hk;
            next_ask.a = reinterpret_cast<const char*>(static_cast<const uint16_t*>(p.k) +
                                                       (b * p.kv_len + j1) * hk * d) + k0 * 64;
            next_ask.na = k_lines * (hkv + 1) / hk - k0;
            next_ask.b = reinterpret_cast<const char*>(static_cast<const uint16_t*>(p.v) +
                                                       (b * p.kv_len + j1) * hk * dv) + v0 * 64;
            next_ask.nb = v_lines * (hkv + 1) / hk - v0;
          }
          const uint16_t* kb =
              static_cast<const uint16_t*>(p.k) + ((b * p.kv_len + j0) * hk + hkv) * d;
          const int64_t chunks32 = d % 32 == 0 && n <= 4 && !rows.qb.empty() ? d / 32 : 0;
          // the scores ask for the K lines of the share, the value products for the V lines
          const char* k_ask = next_ask.na > 0 ? next_ask.a : reinterpret_cast<const char*>(kb);
          const int64_t k_ask_lines = next_ask.na;
          next_ask.na = 0;
          if (chunks32 == 2) {
            ScoresBf16Rows4<2>(kb, hk * d, nk, rows.qb.data(), n, np, st.data(), k_ask,
                                 k_ask_lines);
          } else if (chunks32 == 4) {
            ScoresBf16Rows4<4>(kb, hk * d, nk, rows.qb.data(), n, np, st.data(), k_ask,
                                 k_ask_lines);
          } else if (chunks32 == 8) {
            ScoresBf16Rows4<8>(kb, hk * d, nk, rows.qb.data(), n, np, st.data(), k_ask,
                                 k_ask_lines);
          } else {
            lane_masked = p.softcap == 0.0f && exact_keys;
            LaneScoreMask lane_mask;
            if (lane_masked) {
              const float tile_end = static_cast<float>(j1);
              for (int64_t r = 0; r < np; ++r) {
                hi_cut[r] = std::min(range_hi[hkv * np + r], tile_end);
                lane_max[r] = -kInf;
              }
              lane_mask.scale = p.scale;
              lane_mask.lo = range_lo.data() + hkv * np;
              lane_mask.hi = hi_cut;
              lane_mask.tile_max = lane_max;
            }
            ScoresBf16(kb, hk * d, nk, d, qt2.data() + hkv * (d / 2) * np, np, st.data(), k_ask,
                       k_ask_lines, lane_masked ? &lane_mask : nullptr,
                       static_cast<float>(j0));
          }
        } else {
          GemmKeyRows(k_step, kDecodeTile, d, kh, qt.data() + hkv * d * np, np,
                      np / kLanes, st.data(), np);
        }
        if (masked || lane_masked) {
          // done by the products
        } else if (p.softcap > 0.0f || !exact_keys) {
          for (int64_t j = 0; j < kDecodeTile; ++j) {
            float* sj = st.data() + j * np;
            for (int64_t r = 0; r < np; ++r) {
              const bool seen = r < n && j < nk && j0 + j >= rows.lo[r] && j0 + j < rows.hi[r];
              float x = sj[r] * p.scale;
              if (seen) x = p.softcap * std::tanh(x / p.softcap);
              sj[r] = seen ? x : -kInf;
            }
          }
        } else {  // the same, a vector of rows at a time (a scalar loop cost as much as the GEMM)
          const float* lo = range_lo.data() + hkv * np;
          const float* hi = range_hi.data() + hkv * np;
          for (int64_t j = 0; j < kDecodeTile; ++j) {
            float* sj = st.data() + j * np;
            if (j >= nk) {
              std::fill(sj, sj + np, -kInf);
              continue;
            }
            const VecF key = Splat(static_cast<float>(j0 + j));
            for (int64_t v = 0; v < np; v += kLanes) {
              const VecF x = Load(sj + v) * p.scale;
              Store(sj + v, key >= Load(lo + v) && key < Load(hi + v) ? x : Splat(-kInf));
            }
          }
        }
        float* m = ml.data() + hkv * np;
        float* l = ll.data() + hkv * np;
        float* oth = ot.data() + (o_second[hkv] * hk + hkv) * dvp * np;
        VecF alpha_asking{};  // the rescaling of a vector of rows (np == kLanes when asking)
        float alphas[kDecodeMaxRows];  // every vector of rows' (bf16_lanes)
        for (int64_t v = 0; v < np; v += kLanes) {
          VecF tile_max = mask.tile_max;
          if (lane_masked) {
            tile_max = Load(lane_max + v);
          } else if (!masked) {
            tile_max = Splat(-kInf);
            for (int64_t j = 0; j < kDecodeTile; ++j) tile_max = Max(tile_max, Load(st.data() + j * np + v));
          }
          const VecF m_old = Load(m + v);
          const VecF m_new = Max(m_old, tile_max);
          const VecF m_use = m_new == -kInf ? VecF{} : m_new;
          const VecF alpha = Exp(m_old - m_use);
          VecF sum = VecF{};
          if (bf16_lanes) {  // P's key pairs for ValuesBf16 as P is made (one pass, not two)
            sum = ExpPackBf16(st.data(), np, v, m_use, pairs_p.data());
          } else {
            for (int64_t j = 0; j < kDecodeTile; ++j) {
              float* sp = st.data() + j * np + v;
              const VecF pr = Exp(Load(sp) - m_use);
              sum += pr;
              Store(sp, pr);
            }
          }
          Store(l + v, Load(l + v) * alpha + sum);
          Store(m + v, m_new);
          if (asking || bf16_lanes) {  // (ValueBlockAsking and ValuesBf16 rescale)
            alpha_asking = alpha;
            Store(alphas + v, alpha);
            continue;
          }
          for (int64_t x = 0; x < dvp; ++x) Store(oth + x * np + v, Load(oth + x * np + v) * alpha);
        }
        if (bf16_lanes) {  // O' = alpha O + P V ([n][dvp]) into the other copy; a redo if not finite
          const uint16_t* vb =
              static_cast<const uint16_t*>(p.v) + ((b * p.kv_len + j0) * hk + hkv) * dv;
          float* next = ot.data() + ((1 - o_second[hkv]) * hk + hkv) * dvp * np;
          const bool finite = ValuesBf16(nk, vb, hk * dv, dv, n, np, alphas, oth, next, dvp,
                                         next_ask, pairs_p.data(), pairs_v.data());
          o_second[hkv] ^= 1;
          if (!finite) {  // NaN or inf somewhere: only the keys a row sees (P unrounded)
            for (int64_t r = 0; r < n; ++r) {
              for (int64_t x = 0; x < dv; ++x) next[r * dvp + x] = oth[r * dvp + x] * alphas[r];
            }
            for (int64_t j = 0; j < nk; ++j) {
              for (int64_t r = 0; r < n; ++r) {
                const float pr = st[j * np + r];
                if (pr == 0.0f) continue;
                for (int64_t x = 0; x < dv; ++x) {
                  next[r * dvp + x] += pr * Bf16ToFloat(vb[j * hk * dv + x]);
                }
              }
            }
          }
        } else if (asking) {  // O^T' = alpha O^T + V^T P^T into the other copy; a redo if not finite
          float* next = ot.data() + ((1 - o_second[hkv]) * hk + hkv) * dvp * np;
          VecF finite{};
          for (int64_t x = 0; x < dv; x += kLanes) {
            ValueBlockAsking(kDecodeTile, vh + x, v_step, st.data(), alpha_asking, oth + x * np,
                             next + x * np, share(p.v, dv, v_step, hkv, x / kLanes, dv / kLanes),
                             &finite);
          }
          o_second[hkv] ^= 1;
          bool all_finite = true;
          for (int lane = 0; lane < kLanes; ++lane) all_finite &= finite[lane] == 0.0f;
          if (!all_finite) {  // NaN or inf somewhere: only the keys a row sees
            for (int64_t x = 0; x < dvp; ++x) Store(next + x * np, Load(oth + x * np) * alpha_asking);
            for (int64_t j = 0; j < nk; ++j) {
              for (int64_t r = 0; r < n; ++r) {
                const float pr = st[j * np + r];
                if (pr == 0.0f) continue;
                for (int64_t x = 0; x < dv; ++x) next[x * np + r] += pr * vh[j * v_step + x];
              }
            }
          }
        } else if (!bad[hkv]) {  // O^T += V^T P^T (keys past nk have P = 0 and zero rows)
          GemmLanes<1>(dv, kDecodeTile, vh, v_step, st.data(), np, np / kLanes, oth, np, true);
        } else {  // a value row holds NaN or inf: only the keys a row sees
          for (int64_t j = 0; j < nk; ++j) {
            for (int64_t r = 0; r < n; ++r) {
              const float pr = st[j * np + r];
              if (pr == 0.0f) continue;
              for (int64_t x = 0; x < dv; ++x) oth[x * np + r] += pr * vh[j * v_step + x];
            }
          }
        }
      }
    }
    if (gemm) {  // the lane state into the chunk's partial results
      for (int64_t hkv = 0; hkv < hk; ++hkv) {
        float* m = state(b, chunk, hkv);
        for (int64_t r = 0; r < n; ++r) {
          m[r] = ml[hkv * np + r];
          m[n + r] = ll[hkv * np + r];
          const float* oth = ot.data() + (o_second[hkv] * hk + hkv) * dvp * np;
          for (int64_t x = 0; x < dv; ++x) {
            m[2 * n + r * dvp + x] = bf16_lanes ? oth[r * dvp + x] : oth[x * np + r];
          }
        }
      }
    }
  });
  // Merge the chunks in order; write out, lse, max.
  ParallelFor(pool, p.batch * hk, [&](int64_t t) {
    const int64_t hkv = t % hk, b = t / hk;
    const DecodeRows rows(p, b, hkv);
    std::vector<float> out_row(dvp);
    for (int64_t r = 0; r < n; ++r) {
      float mx = -kInf;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, state(b, c, hkv)[r]);
      float sum = 0.0f;
      std::fill(out_row.begin(), out_row.end(), 0.0f);
      if (mx != -kInf) {
        for (int64_t c = 0; c < chunks; ++c) {
          const float* m = state(b, c, hkv);
          if (m[r] == -kInf) continue;
          const float w = std::exp(m[r] - mx);
          sum += m[n + r] * w;
          const float* orow = m + 2 * n + r * dvp;
          for (int64_t x = 0; x < dv; ++x) out_row[x] += orow[x] * w;
        }
      }
      const int64_t h = rows.head[r], i = rows.qi[r];
      const bool has_sink = p.sink != nullptr;
      const float sink = has_sink ? p.sink[h] : -kInf;
      const RowEnd end = FinishRow(rows.valid[r], mx, sum, has_sink, sink);
      const float factor = end.factor;
      const int64_t stat = (b * p.q_heads + h) * p.q_len + i;
      outputs.lse[stat] = end.lse;
      outputs.max[stat] = end.max;
      for (int64_t x = 0; x < dv; ++x) out_row[x] = factor == 0.0f ? 0.0f : out_row[x] * factor;
      StoreRow(p.elem, outputs.out, ((b * p.q_len + i) * p.q_heads + h) * dv, dv,
               out_row.data());
    }
  });
}

// Backward: dq, dk, dv from the saved lse (FA2's formulas, as attention_cpu.h).
inline void DecodeBackward(const AttentionParams& p, const BackwardInputs& in,
                           const BackwardOutputs& outputs, ffi::ThreadPool* pool) {
  using namespace decode_detail;
  const int64_t n = p.group() * p.q_len, d = p.head_dim, dv = p.v_dim;
  const int64_t dp = RoundUpLanes(d), dvp = RoundUpLanes(dv);
  const int64_t chunks = std::max<int64_t>(CeilDiv(p.kv_len, kDecodeChunk), 1);
  const int64_t tasks = p.batch * p.kv_heads * chunks;
  FloatBuffer dq_partial(tasks * n * dp);
  ParallelFor(pool, tasks, [&](int64_t t) {
    const int64_t chunk = t % chunks, hkv = (t / chunks) % p.kv_heads;
    const int64_t b = t / (chunks * p.kv_heads);
    float* dq = dq_partial.get() + t * n * dp;
    std::fill(dq, dq + n * dp, 0.0f);
    const DecodeRows rows(p, b, hkv);
    // this chunk's keys; the rows' union range can be narrower: keys outside it get zeros
    const int64_t k0 = std::min(chunk * kDecodeChunk, p.kv_len);
    const int64_t k1 = std::min(k0 + kDecodeChunk, p.kv_len);
    int64_t c0, c1;
    ChunkKeys(rows, chunk, &c0, &c1);
    std::vector<float> zeros(std::max(d, dv), 0.0f);
    auto zero_rows = [&](int64_t a, int64_t e) {
      for (int64_t j = a; j < e; ++j) {
        const int64_t token = (b * p.kv_len + j) * p.kv_heads + hkv;
        StoreRow(p.elem, outputs.dk, token * d, d, zeros.data());
        StoreRow(p.elem, outputs.dv, token * dv, dv, zeros.data());
      }
    };
    if (c1 <= c0) {
      zero_rows(k0, k1);
      return;
    }
    zero_rows(k0, c0);
    zero_rows(c1, k1);
    // per row: dO (padded), lse, D = dO . O - dlse
    std::vector<float> dout(n * dvp, 0.0f), lse(n, kInf), drow(n, 0.0f), tmp(dv);
    for (int64_t r = 0; r < n; ++r) {
      if (!rows.valid[r]) continue;
      const int64_t token = (b * p.q_len + rows.qi[r]) * p.q_heads + rows.head[r];
      LoadRow(p.elem, in.dout, token * dv, dv, dout.data() + r * dvp);
      LoadRow(p.elem, in.out, token * dv, dv, tmp.data());
      float dot = 0.0f;
      for (int64_t x = 0; x < dv; ++x) dot += dout[r * dvp + x] * tmp[x];
      const int64_t stat = (b * p.q_heads + rows.head[r]) * p.q_len + rows.qi[r];
      drow[r] = dot - in.dlse[stat];
      lse[r] = in.lse[stat] == -kInf ? kInf : in.lse[stat];
    }
    std::vector<float> keys(kDecodeTile * dp), values(kDecodeTile * dvp);
    std::vector<float> s(n * kDecodeTile), th(p.softcap > 0.0f ? n * kDecodeTile : 0);
    std::vector<float> dk_row(dp), dv_row(dvp);
    for (int64_t j0 = c0; j0 < c1; j0 += kDecodeTile) {
      const int64_t j1 = std::min(j0 + kDecodeTile, c1);
      LoadKeys(p, p.k, d, dp, b, hkv, j0, j1, keys.data());
      LoadKeys(p, p.v, dv, dvp, b, hkv, j0, j1, values.data());
      DecodeScores(p, rows, keys.data(), j0, j1, s.data(), th.empty() ? nullptr : th.data());
      for (int64_t r = 0; r < n; ++r) {  // P = exp(s - lse), in place, a vector at a time
        float* sr = s.data() + r * kDecodeTile;
        const VecF lv = Splat(lse[r]);
        for (int64_t j = 0; j < kDecodeTile; j += kLanes) Store(sr + j, Exp(Load(sr + j) - lv));
      }
      for (int64_t j = j0; j < j1; ++j) {
        const float* kj = keys.data() + (j - j0) * dp;
        const float* vj = values.data() + (j - j0) * dvp;
        std::fill(dk_row.begin(), dk_row.end(), 0.0f);
        std::fill(dv_row.begin(), dv_row.end(), 0.0f);
        for (int64_t r = 0; r < n; ++r) {
          const float pr = s[r * kDecodeTile + (j - j0)];
          if (pr == 0.0f) continue;  // exactly nothing reaches this key from this row
          Axpy(pr, dout.data() + r * dvp, dv_row.data(), dvp);
          float ds = pr * (Dot(dout.data() + r * dvp, vj, dvp) - drow[r]);
          if (!th.empty()) {
            const float tv = th[r * kDecodeTile + (j - j0)];
            ds *= 1.0f - tv * tv;
          }
          if (ds == 0.0f) continue;
          Axpy(ds, rows.q.data() + r * dp, dk_row.data(), dp);
          Axpy(ds, kj, dq + r * dp, dp);
        }
        const int64_t token = (b * p.kv_len + j) * p.kv_heads + hkv;
        for (int64_t x = 0; x < d; ++x) dk_row[x] *= p.scale;
        StoreRow(p.elem, outputs.dk, token * d, d, dk_row.data());
        StoreRow(p.elem, outputs.dv, token * dv, dv, dv_row.data());
      }
    }
  });
  // dq: the chunks' shares in chunk order.
  ParallelFor(pool, p.batch * p.kv_heads, [&](int64_t t) {
    const int64_t hkv = t % p.kv_heads, b = t / p.kv_heads;
    std::vector<float> row(dp);
    for (int64_t r = 0; r < n; ++r) {
      std::fill(row.begin(), row.end(), 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = dq_partial.get() + ((t * chunks + c) * n + r) * dp;
        for (int64_t x = 0; x < d; ++x) row[x] += part[x];
      }
      for (int64_t x = 0; x < d; ++x) row[x] *= p.scale;
      const int64_t h = hkv * p.group() + r / p.q_len, i = r % p.q_len;
      StoreRow(p.elem, outputs.dq, ((b * p.q_len + i) * p.q_heads + h) * d, d, row.data());
    }
  });
}

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_DECODE_CPU_H_
