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

// Grid (max(tiles of the rows, p.dq_tiles), q_heads, batch): CTA m writes the statistics of
// rows [64 m, 64 m + 64) below q_seq (if any) and zeroes dQ tile m (if m < dq_tiles). A row of O
// and dO (D 16-bit values, 2 D bytes) is read by D / 8 threads, 16 bytes each, and summed across
// them by shuffles.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(kPreprocessThreads)
    HopperBwdPreprocess(const __grid_constant__ BwdParams p) {
  constexpr int kChunks = kHeadDim / 8;                            // 16-byte chunks a row
  constexpr int kRowsAPass = kPreprocessThreads / kChunks;
  static_assert(kChunks <= 32 && 32 % kChunks == 0, "a row's threads within one warp");
  static_assert(kPreprocessRows % kRowsAPass == 0);
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int t = threadIdx.x, chunk = t % kChunks;
  const int first_row = m * kPreprocessRows;
  __shared__ float row_dot[kPreprocessRows];

  if (first_row < p.q_seq) {  // (the same for the whole CTA: its barrier is met by all)
    const int64_t row_stride = int64_t(p.q_heads) * kHeadDim;
    const int64_t first = (int64_t(b) * p.q_seq + first_row) * row_stride +
                          int64_t(h) * kHeadDim + chunk * 8;
    CUTE_UNROLL
    for (int r = t / kChunks; r < kPreprocessRows; r += kRowsAPass) {
      float sum = 0.0f;
      if (first_row + r < p.q_seq) {
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
    if (t < kPreprocessRows && first_row + t < p.q_seq) {
      const int64_t bh = int64_t(b) * p.q_heads + h;
      const int64_t at = bh * p.q_seq + first_row + t;
      const float lse = p.lse[at];
      float* stats = p.stats + bh * 2 * p.stats_seq + first_row + t;
      // lse in log2 units, +inf for a row that sees no key (lse -inf), so that P = 0 there
      stats[0] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
      stats[p.stats_seq] = row_dot[t] - p.dlse[at];
    }
  }
  if (m < p.dq_tiles) {  // this query tile's dQ sums, which every key block's CTA adds into
    float4* dq = reinterpret_cast<float4*>(
        p.dq_accum + ((int64_t(b) * p.q_heads + h) * p.dq_tiles + m) *
                         (kPreprocessRows * kHeadDim));
    CUTE_UNROLL
    for (int i = t; i < kPreprocessRows * kHeadDim / 4; i += kPreprocessThreads) {
      dq[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
}

// The first pass's grid: the rows' 64-row tiles or dq's tiles, whichever are more.
inline dim3 PreprocessGrid(const BwdParams& p) {
  const int row_tiles = (p.q_seq + kPreprocessRows - 1) / kPreprocessRows;
  return dim3(unsigned(row_tiles > p.dq_tiles ? row_tiles : p.dq_tiles), unsigned(p.q_heads),
              unsigned(p.batch));
}

}  // namespace attnaux_hopper
