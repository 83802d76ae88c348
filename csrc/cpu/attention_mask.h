// What a tile of the CPU flash kernels may see (docs/kernel_abi.md, visible()): the key band of
// each query row (lengths, causal, window), the per-head view of bias, mask, segment ids, sink and
// dropout, the keys of a tile, its scores with every rule applied, and its dropout factors.
#ifndef ATTNAUX_CSRC_CPU_ATTENTION_MASK_H_
#define ATTNAUX_CSRC_CPU_ATTENTION_MASK_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/attention_params.h"
#include "common/philox.h"
#include "cpu/attention_tile.h"
#include "cpu/cpu_gemm.h"
#include "cpu/cpu_simd.h"
#include "cpu/score_program.h"

namespace attnaux::cpu {

// Visible key range of each query row of one batch element (positions only; mask and segments
// are checked per element): keys [Lo(i), Hi(i)) for rows i < ql, see the ABI's visible().
struct RowRanges {
  int64_t ql = 0, kl = 0, off = 0;
  int32_t causal = 0;
  int64_t window_left = -1, window_right = -1;

  RowRanges(const AttentionParams& p, int64_t b) {
    ql = std::clamp<int64_t>(p.q_seqlens[b], 0, p.q_len);
    kl = std::clamp<int64_t>(p.kv_seqlens[b], 0, p.kv_len);
    off = (p.causal == 2 ? kl - ql : 0) + p.DiagonalShift();
    causal = p.causal;
    window_left = p.window_left;
    window_right = p.window_right;
  }
  int64_t Lo(int64_t i) const {
    return window_left >= 0 ? std::clamp<int64_t>(i + off - window_left, 0, kl) : 0;
  }
  int64_t Hi(int64_t i) const {
    int64_t hi = kl;
    if (causal != 0) hi = std::min(hi, i + off + 1);
    if (window_right >= 0) hi = std::min(hi, i + off + window_right + 1);
    return std::max<int64_t>(hi, 0);
  }
  // Query rows of block ib that are valid (i < ql): [i0, i0 + count).
  int64_t ValidRows(int64_t i0) const { return std::clamp<int64_t>(ql - i0, 0, kBlockQ); }
};

// Per (batch, query head) view of the optional inputs.
struct HeadView {
  const AttentionParams& p;
  int64_t b, h;
  RowRanges rows;
  const float* bias = nullptr;  // bias at (b|0, h|0, 0, 0)
  const bool* mask = nullptr;
  const int32_t* q_seg = nullptr;
  const int32_t* kv_seg = nullptr;
  const int32_t* q_seg_tiles = nullptr;   // (min, max) q id per query tile, or nullptr
  const int32_t* kv_seg_tiles = nullptr;  // (min, max) kv id per key tile, or nullptr
  float sink = -kInf;
  bool has_sink = false;
  uint32_t drop_threshold = 0;
  float drop_scale = 1.0f;
  const ScoreProgram* program = nullptr;  // score_mod / mask_mod, or nullptr
  const int32_t* tiles = nullptr;         // this head's [q tiles, kv tiles] of tile_mask
  int64_t kv_tiles = 0;

  HeadView(const AttentionParams& params, int64_t batch, int64_t head)
      : p(params), b(batch), h(head), rows(params, batch) {
    if (p.bias != nullptr) bias = p.bias + b * p.bias_stride[0] + h * p.bias_stride[1];
    if (p.mask != nullptr) mask = p.mask + b * p.mask_stride[0] + h * p.mask_stride[1];
    if (p.q_segment_ids != nullptr) {
      q_seg = p.q_segment_ids + b * p.q_len;
      kv_seg = p.kv_segment_ids + b * p.kv_len;
      if (p.kv_segment_tiles != nullptr) {
        q_seg_tiles = p.q_segment_tiles + b * 2 * ((p.q_len + kBlockQ - 1) / kBlockQ);
        kv_seg_tiles = p.kv_segment_tiles + b * 2 * ((p.kv_len + kBlockK - 1) / kBlockK);
      }
    }
    if (p.sink != nullptr) {
      sink = p.sink[h];
      has_sink = true;
    }
    if (p.rng_state != nullptr) {
      drop_threshold = DropoutThreshold(p.dropout_rate);
      drop_scale = 1.0f / (1.0f - p.dropout_rate);
    }
    program = static_cast<const ScoreProgram*>(p.score_program);
    kv_tiles = (p.kv_len + kBlockK - 1) / kBlockK;
    if (p.tile_mask != nullptr) {
      tiles = p.tile_mask + b * p.tile_mask_stride[0] + h * p.tile_mask_stride[1];
    }
  }
  bool dropout() const { return p.rng_state != nullptr; }
  // Where the tile with first query row i0 and first key j0 sits in the whole problem (a shard
  // of a larger one starts at the block state's origin): the indices score_mod sees.
  ProgramSite Site(int64_t i0, int64_t j0) const {
    int64_t origin[4] = {0, 0, 0, 0};
    if (p.block_state != nullptr) {
      for (int x = 0; x < 4; ++x) origin[x] = p.block_state[4 + x];
    }
    return ProgramSite{static_cast<float>(b + origin[0]), static_cast<float>(h + origin[1]),
                       i0 + origin[2], j0 + origin[3]};
  }
};

// The keys of block jb that query block ib (starting at row i0, `valid` rows) may see:
// [*j0, *j1). Empty when *j0 >= *j1. Forward and both backward schemes use this one predicate,
// so they visit the same tiles.
inline void TileKeys(const RowRanges& rows, int64_t i0, int64_t valid, int64_t jb, int64_t* j0,
                     int64_t* j1) {
  if (valid <= 0) {
    *j0 = *j1 = 0;
    return;
  }
  *j0 = std::max(jb * kBlockK, rows.Lo(i0));
  *j1 = std::min(jb * kBlockK + kBlockK, rows.Hi(i0 + valid - 1));
}

// TileKeys, narrowed by the segment ids (the flash kernels' tile predicate, forward and both
// backward schemes alike): keys whose segment no valid row of the tile has cannot be visible, so
// they are trimmed from both ends of [*j0, *j1), and a tile whose keys all lie outside the rows'
// segment range is skipped. With packed sequences (sorted ids) only the tiles that straddle a
// document boundary are scanned past their first key; those of other documents cost a 64-key
// scan instead of their matrix products.
inline void TileKeys(const HeadView& hv, int64_t i0, int64_t valid, int64_t jb, int64_t* j0,
                     int64_t* j1) {
  TileKeys(hv.rows, i0, valid, jb, j0, j1);
  if (hv.tiles != nullptr && *j0 < *j1 && hv.tiles[(i0 / kBlockQ) * hv.kv_tiles + jb] == 0) {
    *j1 = *j0;  // mask_mod hides every pair of the tile (its block table)
    return;
  }
  if (hv.q_seg == nullptr || *j0 >= *j1) return;
  int32_t lo = hv.q_seg[i0], hi = hv.q_seg[i0];
  if (hv.q_seg_tiles != nullptr && i0 % kBlockQ == 0) {
    // the whole query tile's range (a superset when `valid` stops short: still exact, as only
    // keys outside it are trimmed)
    lo = hv.q_seg_tiles[2 * (i0 / kBlockQ)];
    hi = hv.q_seg_tiles[2 * (i0 / kBlockQ) + 1];
  } else {
    for (int64_t r = 1; r < valid; ++r) {
      lo = std::min(lo, hv.q_seg[i0 + r]);
      hi = std::max(hi, hv.q_seg[i0 + r]);
    }
  }
  if (hv.kv_seg_tiles != nullptr) {
    const int32_t* ids = hv.kv_seg_tiles + 2 * jb;
    if (ids[1] < lo || ids[0] > hi) {  // no key of the tile in the rows' id range
      *j1 = *j0;
      return;
    }
  }
  int64_t a = *j0, e = *j1;
  while (a < e && (hv.kv_seg[a] < lo || hv.kv_seg[a] > hi)) ++a;
  while (e > a && (hv.kv_seg[e - 1] < lo || hv.kv_seg[e - 1] > hi)) --e;
  *j0 = a;
  *j1 = e;
}

// The smallest and largest segment id of every query tile and key tile, per batch row: with
// them TileKeys finds a query tile's id range in O(1) and rejects a key tile of other documents
// in O(1), instead of scanning 64 rows and 64 keys per (query tile, key tile) pair (which made
// packed rows cost O(S^2 / 64) scans). Built once per kernel call by its entry, which runs on
// `With(params)`.
class TileSegments {
 public:
  explicit TileSegments(const AttentionParams& p) {
    if (p.q_segment_ids == nullptr || p.q_len == 0 || p.kv_len == 0) return;
    Fill(p.q_segment_ids, p.batch, p.q_len, kBlockQ, &q_);
    Fill(p.kv_segment_ids, p.batch, p.kv_len, kBlockK, &kv_);
  }
  AttentionParams With(const AttentionParams& p) const {
    AttentionParams with = p;
    with.q_segment_tiles = q_.empty() ? nullptr : q_.data();
    with.kv_segment_tiles = kv_.empty() ? nullptr : kv_.data();
    return with;
  }

 private:
  static void Fill(const int32_t* all_ids, int64_t batch, int64_t len, int64_t tile,
                   std::vector<int32_t>* ranges) {
    const int64_t tiles = (len + tile - 1) / tile;
    ranges->resize(static_cast<size_t>(batch * tiles * 2));
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t* ids = all_ids + b * len;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t end = std::min(len, (t + 1) * tile);
        int32_t lo = ids[t * tile], hi = lo;
        for (int64_t j = t * tile + 1; j < end; ++j) {
          lo = std::min(lo, ids[j]);
          hi = std::max(hi, ids[j]);
        }
        (*ranges)[(b * tiles + t) * 2] = lo;
        (*ranges)[(b * tiles + t) * 2 + 1] = hi;
      }
    }
  }
  std::vector<int32_t> q_, kv_;
};

// Whether the segment ids leave every (row, key) pair of the tile visible: no ids, or one
// segment for all its valid rows and keys (inside a packed document), so that the tile needs no
// per-element mask for them.
inline bool OneSegment(const HeadView& hv, int64_t i0, int64_t valid, int64_t j0, int64_t j1) {
  if (hv.q_seg == nullptr) return true;
  const int32_t s = hv.q_seg[i0];
  bool same = true;
  for (int64_t r = 1; r < valid; ++r) same &= hv.q_seg[i0 + r] == s;
  for (int64_t j = j0; j < j1; ++j) same &= hv.kv_seg[j] == s;
  return same;
}

// Scores of keys [j0, j1) x the query block in lanes: st[(j - j0) * BQ + lane] = s(i0 + lane, j)
// with scale, softcap, score program, bias and visibility applied (invisible: -inf). Lanes >=
// valid are left as computed from zero queries (finite) unless the tile needs masking or runs a
// program (then -inf). With a program, `raw` (when not null) keeps the scores it read.
// `tile_max` (when not null): if the product's scaled scores are the final ones (no softcap,
// program, bias or mask on this tile), their maximum over the keys per vector of lanes, found by
// the product as it stores them; the return value says whether it was.
// `kt_pairs` / `qt_pairs` (when not null; kHasBf16Pairs): the bfloat16 pair words of the key block
// ([ceil(D/2)][BK]) and of the query block ([ceil(D/2)][BQ]), for a product on PairGemmLanes
// instead of the float32 one (then kt_block and qt are not read). `k_amx` (when not null;
// ATTNAUX_AMX, with qt_pairs): the bfloat16 rows of K from key j0 on, for a product on AMX tiles
// (AmxGemm64) instead.
inline bool ScoreTile(const HeadView& hv, int64_t i0, int64_t valid, int64_t j0, int64_t j1,
                      const float* kt_block, const float* qt, float* st, float* tanh_out,
                      float* raw = nullptr, std::vector<float>* program_regs = nullptr,
                      VecF* tile_max = nullptr, const uint32_t* kt_pairs = nullptr,
                      const uint32_t* qt_pairs = nullptr, const uint16_t* k_amx = nullptr) {
  const AttentionParams& p = hv.p;
  const int64_t nk = j1 - j0;
  const int64_t jb_start = (j0 / kBlockK) * kBlockK;
  const RowRanges& rows = hv.rows;
  const bool positions_ok =
      j0 >= rows.Lo(i0 + valid - 1) && j1 <= rows.Hi(i0);
  const bool needs_mask = hv.mask != nullptr || !OneSegment(hv, i0, valid, j0, j1) || !positions_ok;
  const bool plain = !needs_mask && hv.bias == nullptr && hv.program == nullptr &&
                     !(p.softcap > 0.0f);
  // S^T = K Q^T, times the scale as the product stores it (and its maximum when plain)
  GemmFuse fuse;
  fuse.out_scale = p.scale;
  fuse.scale_out = true;
  if (plain && tile_max != nullptr) {
    for (int v = 0; v < kQVectors; ++v) tile_max[v] = Splat(-kInf);
    fuse.row_max = tile_max;
  }
#if defined(ATTNAUX_AMX)
  if (k_amx != nullptr) {
    // on AMX tiles, whole tiles of 16 keys (the rows past nk, zero keys or the next ones, are
    // stored in st's spare rows and never read), then the store's scale and maximum
    static_assert(kBlockQ == 64, "AmxGemm64's 64 lanes");
    AmxGemm64((nk + 15) / 16 * 16, p.head_dim / 2, k_amx, p.head_dim, qt_pairs, kBlockQ, st,
              kBlockQ, false);
    const VecF scale = Splat(p.scale);
    for (int64_t r = 0; r < nk; ++r) {
      for (int v = 0; v < kQVectors; ++v) {
        const VecF x = Load(st + r * kBlockQ + v * kLanes) * scale;
        Store(st + r * kBlockQ + v * kLanes, x);
        if (fuse.row_max != nullptr) fuse.row_max[v] = Max(fuse.row_max[v], x);
      }
    }
  } else
#endif
#if defined(ATTNAUX_BF16_PAIRS)
  if (kt_pairs != nullptr) {
    PairGemmLanes<1>(nk, (p.head_dim + 1) / 2, kt_pairs + (j0 - jb_start), kBlockK, qt_pairs,
                     kBlockQ, kQVectors, st, kBlockQ, false, &fuse);
  } else
#endif
  {
    GemmLanes<1>(nk, p.head_dim, kt_block + (j0 - jb_start), kBlockK, qt, kBlockQ, kQVectors, st,
                 kBlockQ, false, &fuse);
  }
  if (p.softcap > 0.0f) {
    const VecF cap = Splat(p.softcap), inv_cap = Splat(1.0f / p.softcap);
    for (int64_t x = 0; x < nk * kBlockQ; x += kLanes) {
      VecF t = Tanh(Load(st + x) * inv_cap);
      if (tanh_out != nullptr) Store(tanh_out + x, t);
      Store(st + x, cap * t);
    }
  }
  if (hv.program != nullptr) {
    // a tile that mask_mod shows whole (2 in its block table) needs no mask from it
    const bool whole = hv.tiles != nullptr &&
                       hv.tiles[(i0 / kBlockQ) * hv.kv_tiles + j0 / kBlockK] == 2;
    ApplyScoreProgram(*hv.program, hv.Site(i0, j0), nk, st, raw, *program_regs, !whole);
    // lanes past the valid rows: whatever the function made of them (NaN, inf) stays out
    for (int64_t r = 0; r < nk; ++r) {
      std::fill(st + r * kBlockQ + valid, st + (r + 1) * kBlockQ, -kInf);
    }
  }
  if (!needs_mask) {
    if (hv.bias == nullptr) return plain && tile_max != nullptr;
    for (int64_t lane = 0; lane < valid; ++lane) {
      const float* brow = hv.bias + (i0 + lane) * p.bias_stride[2];
      for (int64_t r = 0; r < nk; ++r) st[r * kBlockQ + lane] += brow[(j0 + r) * p.bias_stride[3]];
    }
    return false;
  }
  if (hv.mask == nullptr && hv.q_seg == nullptr) {
    // Positions only (causal diagonal, window edge, valid lengths): the lanes that see key j form
    // one interval, so the select is a vector compare against the lane index.
    if (hv.bias != nullptr) {
      for (int64_t lane = 0; lane < valid; ++lane) {
        const float* brow = hv.bias + (i0 + lane) * p.bias_stride[2];
        for (int64_t r = 0; r < nk; ++r) {
          st[r * kBlockQ + lane] += brow[(j0 + r) * p.bias_stride[3]];
        }
      }
    }
    VecI lane_index;
    for (int x = 0; x < kLanes; ++x) lane_index[x] = x;
    for (int64_t r = 0; r < nk; ++r) {
      const int64_t j = j0 + r;
      int64_t first = i0, end = i0 + valid;  // visible query rows [first, end)
      if (rows.causal != 0) first = std::max(first, j - rows.off);
      if (rows.window_right >= 0) first = std::max(first, j - rows.off - rows.window_right);
      if (rows.window_left >= 0) end = std::min(end, j - rows.off + rows.window_left + 1);
      const int32_t lane_first = static_cast<int32_t>(std::clamp<int64_t>(first - i0, 0, kBlockQ));
      const int32_t lane_end = static_cast<int32_t>(std::clamp<int64_t>(end - i0, 0, kBlockQ));
      for (int v = 0; v < kQVectors; ++v) {
        VecI lanes = lane_index + v * kLanes;
        float* sp = st + r * kBlockQ + v * kLanes;
        Store(sp, (lanes >= lane_first) & (lanes < lane_end) ? Load(sp) : Splat(-kInf));
      }
    }
    return false;
  }
  for (int64_t lane = 0; lane < kBlockQ; ++lane) {
    const int64_t i = i0 + lane;
    if (lane >= valid) {
      for (int64_t r = 0; r < nk; ++r) st[r * kBlockQ + lane] = -kInf;
      continue;
    }
    const int64_t lo = rows.Lo(i), hi = rows.Hi(i);
    const float* brow = hv.bias != nullptr ? hv.bias + i * p.bias_stride[2] : nullptr;
    const bool* mrow = hv.mask != nullptr ? hv.mask + i * p.mask_stride[2] : nullptr;
    const int32_t segment = hv.q_seg != nullptr ? hv.q_seg[i] : 0;
    for (int64_t r = 0; r < nk; ++r) {
      const int64_t j = j0 + r;
      bool visible = j >= lo && j < hi;
      if (mrow != nullptr) visible = visible && mrow[j * p.mask_stride[3]];
      if (hv.kv_seg != nullptr) visible = visible && hv.kv_seg[j] == segment;
      float s = st[r * kBlockQ + lane];
      if (brow != nullptr && visible) s += brow[j * p.bias_stride[3]];
      st[r * kBlockQ + lane] = visible ? s : -kInf;
    }
  }
  return false;
}

// Dropout factors of the tile: keep / (1 - rate), or 0. Lanes >= valid get 0.
inline void DropoutTile(const HeadView& hv, int64_t i0, int64_t valid, int64_t j0, int64_t j1,
                        float* drop) {
  const AttentionParams& p = hv.p;
  const int64_t nk = j1 - j0;
  std::fill(drop, drop + nk * kBlockQ, 0.0f);
  for (int64_t lane = 0; lane < valid; ++lane) {
    uint64_t e = p.DropoutIndex(hv.b, hv.h, i0 + lane, j0);
    for (int64_t r = 0; r < nk;) {
      const PhiloxWords words = DropoutWords(p.rng_state, e);
      for (uint64_t w = e & 3u; w < 4 && r < nk; ++w, ++r, ++e) {
        drop[r * kBlockQ + lane] = words[w] >= hv.drop_threshold ? hv.drop_scale : 0.0f;
      }
    }
  }
}

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_ATTENTION_MASK_H_
