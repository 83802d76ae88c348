// The backward's first pass (FlashAttention-3's FlashAttnBwdPreprocess): per query row the
// statistics the main kernel (hopper_bwd_kernel.cuh) loads with its Q and dO tiles, and the dQ
// accumulator zeroed, in one pass over O and dO.
//
// XLA had done this (a fusion computing rowsum(dO * O) per row in the [batch, heads, seq] order
// of the statistics, with the log2 lse stacked beside it, and a memset): 110-138 us a call on an
// H100 at 8x1024x16x128 and 4x2048x16x128 against 44-47 for FlashAttention-3's and cuDNN's
// passes, which read and write the same bytes (docs/performance.md, 2026-11-28 eleventh session).
#pragma once

#include <cstdint>

#include "cuda/hopper_bwd_params.h"

namespace attnaux_hopper {

constexpr int kPreprocessRows = 64;      // a CTA's query rows: one query tile of the main kernel
constexpr int kPreprocessThreads = 256;

// The last i in [0, count) with starts[i] <= value (0 if none), starts non-decreasing: with a
// sequence's first token as starts, the sequence holding `value` if any does (an
// empty sequence shares its start with the next, which the search passes on to).
__device__ __forceinline__ int LastAtMost(const int* starts, int count, int value) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= value) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Packed: whether token `row` lies in a sequence's first max_seqlen_q tokens.
__device__ __forceinline__ bool TokenCovered(const BwdParams& p, int row) {
  if (p.num_seqs == 0) return false;
  const int seq = LastAtMost(p.q_offsets, p.num_seqs, row);
  const int start = p.q_offsets[seq];
  return row >= start && row - start < min(p.q_offsets[seq + 1] - start, p.max_seqlen_q);
}

// Packed: dq's rows among tokens [64 m, 64 m + 64) that no sequence covers, zeroed; a row of
// kHeadDim 16-bit values by kHeadDim / 8 threads, 16 bytes each.
template <class T, int kHeadDim>
__device__ __forceinline__ void ZeroUncoveredRows(const BwdParams& p, int m, int h) {
  constexpr int kChunks = kHeadDim / 8, kRowsAPass = kPreprocessThreads / kChunks;
  const int token = m * kPreprocessRows + int(threadIdx.x) / kChunks;
  const int chunk = int(threadIdx.x) % kChunks;
  CUTE_UNROLL
  for (int pass = 0; pass < kPreprocessRows / kRowsAPass; ++pass) {
    const int row = token + pass * kRowsAPass;
    if (row < p.q_seq && !TokenCovered(p, row)) {
      *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) +
                                (int64_t(row) * p.q_heads + h) * kHeadDim + chunk * 8) =
          make_uint4(0, 0, 0, 0);
    }
  }
}

// Grid (p.dq_tiles, q_heads, batch): CTA m writes the statistics of query tile m (rows past its
// sequence's end: lse +inf and row term 0, seen by no key) and zeroes its dQ sums; packed, it
// also zeroes dq's rows among tokens [64 m, 64 m + 64) that no sequence covers (the last pass
// writes the others; dq_tiles >= q_seq / 64 + 1 CTAs reach every token), and the CTAs of the
// tiles past the sequences' last (`tile_seq[m]` -1, a bound's slack), which no kernel reads,
// do only that. Tile m holds rows [64 m, 64 m + 64) of its batch row (dense), or (kPacked) rows
// [64 j, 64 j + 64) of sequence i = tile_seq[m], j = m - tile_base[i] (its rows are tokens
// offsets[i] + 64 j + r). A row of O and dO (D 16-bit values, 2 D bytes) is read by D / 8
// threads, 16 bytes each, and summed across them by shuffles.
template <class T, int kHeadDim, bool kPacked>
__global__ void __launch_bounds__(kPreprocessThreads)
    HopperBwdPreprocess(const __grid_constant__ BwdParams p) {
  constexpr int kChunks = kHeadDim / 8;                            // 16-byte chunks a row
  constexpr int kRowsAPass = kPreprocessThreads / kChunks;
  static_assert(kChunks <= 32 && 32 % kChunks == 0, "a row's threads within one warp");
  static_assert(kPreprocessRows % kRowsAPass == 0);
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int t = threadIdx.x, chunk = t % kChunks;
  __shared__ float row_dot[kPreprocessRows];
  int first_row = m * kPreprocessRows, rows = kPreprocessRows;  // this tile's token rows
  if constexpr (kPacked) {
    const int seq = p.tile_seq[m];
    if (seq < 0) {  // (uniform in the CTA: before any barrier)
      ZeroUncoveredRows<T, kHeadDim>(p, m, h);
      return;
    }
    const int start = p.q_offsets[seq], in_seq = m - p.tile_base[seq];
    const int q_len = min(p.q_offsets[seq + 1] - start, p.max_seqlen_q);
    first_row = start + in_seq * kPreprocessRows;
    rows = min(q_len - in_seq * kPreprocessRows, kPreprocessRows);
  }
  const int64_t row_stride = int64_t(p.q_heads) * kHeadDim;
  const int64_t first = (int64_t(b) * p.q_seq + first_row) * row_stride +
                        int64_t(h) * kHeadDim + chunk * 8;
  CUTE_UNROLL
  for (int r = t / kChunks; r < kPreprocessRows; r += kRowsAPass) {
    float sum = 0.0f;
    if (r < rows) {
      const uint4 o = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.out) +
                                                           first + r * row_stride));
      const uint4 d = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) +
                                                           first + r * row_stride));
      const T* ov = reinterpret_cast<const T*>(&o);
      const T* dv = reinterpret_cast<const T*>(&d);
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) sum += static_cast<float>(ov[i]) * static_cast<float>(dv[i]);
    }
    CUTE_UNROLL
    for (int lanes = kChunks / 2; lanes > 0; lanes /= 2) {
      sum += __shfl_xor_sync(0xffffffffu, sum, lanes);
    }
    if (chunk == 0) row_dot[r] = sum;
  }
  __syncthreads();
  if (t < kPreprocessRows) {
    const int64_t bh = int64_t(b) * p.q_heads + h;
    float* stats = p.stats + bh * 2 * p.stats_seq + int64_t(m) * kPreprocessRows + t;
    if (t < rows) {
      const int64_t at = bh * p.q_seq + first_row + t;
      const float lse = p.lse[at];
      // lse in log2 units, +inf for a row that sees no key (lse -inf), so that P = 0 there
      stats[0] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
      stats[p.stats_seq] = row_dot[t] - (p.dlse != nullptr ? p.dlse[at] : 0.0f);
    } else {
      stats[0] = INFINITY;
      stats[p.stats_seq] = 0.0f;
    }
  }
  // this query tile's dQ sums, which every key block's CTA adds into
  float4* dq = reinterpret_cast<float4*>(
      p.dq_accum + ((int64_t(b) * p.q_heads + h) * p.dq_tiles + m) *
                       (kPreprocessRows * kHeadDim));
  CUTE_UNROLL
  for (int i = t; i < kPreprocessRows * kHeadDim / 4; i += kPreprocessThreads) {
    dq[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  // (last: its searches of the offsets wait on loads, which the passes above need not)
  if constexpr (kPacked) ZeroUncoveredRows<T, kHeadDim>(p, m, h);
}

}  // namespace attnaux_hopper
