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

// Grid (q_seq / 64, q_heads, batch). A row of O and dO (D 16-bit values, 2 D bytes) is read by
// D / 8 threads, 16 bytes each, and summed across them by shuffles.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(kPreprocessThreads)
    HopperBwdPreprocess(const __grid_constant__ BwdParams p) {
  constexpr int kChunks = kHeadDim / 8;                            // 16-byte chunks a row
  constexpr int kRowsAPass = kPreprocessThreads / kChunks;
  static_assert(kChunks <= 32 && 32 % kChunks == 0, "a row's threads within one warp");
  static_assert(kPreprocessRows % kRowsAPass == 0);
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int t = threadIdx.x, chunk = t % kChunks;
  __shared__ float row_dot[kPreprocessRows];

  const int64_t row_stride = int64_t(p.q_heads) * kHeadDim;
  const int64_t first = (int64_t(b) * p.q_seq + int64_t(m) * kPreprocessRows) * row_stride +
                        int64_t(h) * kHeadDim + chunk * 8;
  CUTE_UNROLL
  for (int r = t / kChunks; r < kPreprocessRows; r += kRowsAPass) {
    const uint4 o = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.out) + first +
                                                         r * row_stride));
    const uint4 d = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + first +
                                                         r * row_stride));
    const T* ov = reinterpret_cast<const T*>(&o);
    const T* dv = reinterpret_cast<const T*>(&d);
    float sum = 0.0f;
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) sum += static_cast<float>(ov[i]) * static_cast<float>(dv[i]);
    CUTE_UNROLL
    for (int lanes = kChunks / 2; lanes > 0; lanes /= 2) {
      sum += __shfl_xor_sync(0xffffffffu, sum, lanes);
    }
    if (chunk == 0) row_dot[r] = sum;
  }
  __syncthreads();
  if (t < kPreprocessRows) {
    const int64_t bh = int64_t(b) * p.q_heads + h;
    const int64_t at = bh * p.q_seq + int64_t(m) * kPreprocessRows + t;
    const float lse = p.lse[at];
    float* stats = p.stats + bh * 2 * p.q_seq + int64_t(m) * kPreprocessRows + t;
    // lse in log2 units, +inf for a row that sees no key (lse -inf), so that P = 0 there
    stats[0] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
    stats[p.q_seq] = row_dot[t] - p.dlse[at];
  }
  // this query tile's dQ sums, which every key block's CTA adds into
  float4* dq = reinterpret_cast<float4*>(
      p.dq_accum + ((int64_t(b) * p.q_heads + h) * (p.q_seq / kPreprocessRows) + m) *
                       (kPreprocessRows * kHeadDim));
  CUTE_UNROLL
  for (int i = t; i < kPreprocessRows * kHeadDim / 4; i += kPreprocessThreads) {
    dq[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

}  // namespace attnaux_hopper
