// The packed backward's last pass (FlashAttention-3's FlashAttnBwdPostprocessConvertdQ): each
// sequence's dQ tiles (dq_accum, float32, in the order of the wgmma accumulator's registers)
// out to dq in the tokens' rows, times the softmax scale, in q's dtype. In XLA (a reorder, then
// a gather of the tokens' rows) this took ~1.3x FlashAttention-3's pass at 16384 tokens on an
// H100 (89 against 67 us).
#pragma once

#include <cstdint>

#include "cuda/hopper_bwd_params.h"
#include "cuda/hopper_bwd_preprocess.cuh"

namespace attnaux_hopper {

constexpr int kPostprocessThreads = 256;

// Grid (p.dq_tiles, q_heads). A query tile's 64 x D sums are two warpgroups' 64 x D/2 halves;
// in each, lane t0 + 4 t1 of warp t2 held value v0 + 2 v1 + 4 v2 of row 16 t2 + 8 v1 + t1 and
// column 8 v2 + 2 t0 + v0, stored at (16 D/2) t2 + 128 v2 + 16 t1 + 4 t0 + 2 v1 + v0 (the
// kernel's 16-byte stores; `_flash_hopper._cuda_dq` says the same for the dense layout). A
// thread reads those 16 bytes whole (v1, v0 at one t0, t1, t2, v2: coalesced) and writes two
// rows' column pairs.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(kPostprocessThreads)
    HopperBwdPostprocess(const __grid_constant__ BwdParams p) {
  constexpr int kHalf = kHeadDim / 2;
  static_assert(kHalf % 8 == 0);
  const int m = blockIdx.x, h = blockIdx.y;
  if (m >= p.tile_base[p.num_seqs]) return;  // past the sequences' tiles
  const int2 at = TileSequence(p, m);
  const int q_len = min(p.q_offsets[at.x + 1] - p.q_offsets[at.x], p.max_seqlen_q);
  const int first_row = p.q_offsets[at.x] + at.y * kPreprocessRows;
  const int rows = min(q_len - at.y * kPreprocessRows, kPreprocessRows);
  const float4* sums = reinterpret_cast<const float4*>(
      p.dq_accum + (int64_t(h) * p.dq_tiles + m) * (kPreprocessRows * kHeadDim));
  T* dq = static_cast<T*>(p.dq) + (int64_t(first_row) * p.q_heads + h) * kHeadDim;
  const int64_t row_stride = int64_t(p.q_heads) * kHeadDim;
  CUTE_UNROLL
  for (int i = threadIdx.x; i < kPreprocessRows * kHeadDim / 4; i += kPostprocessThreads) {
    const float4 four = sums[i];
    const int wg = (4 * i) / (kPreprocessRows * kHalf);
    const int in_wg = (4 * i) % (kPreprocessRows * kHalf);
    const int t2 = in_wg / (16 * kHalf), v2 = (in_wg % (16 * kHalf)) / 128;
    const int t1 = (in_wg % 128) / 16, t0 = (in_wg % 16) / 4;
    const int row = 16 * t2 + t1, col = wg * kHalf + 8 * v2 + 2 * t0;
    using Pair = typename cutlass::Array<T, 2>;
    if (row < rows) {
      Pair pair;
      pair[0] = static_cast<T>(four.x * p.scale);
      pair[1] = static_cast<T>(four.y * p.scale);
      *reinterpret_cast<Pair*>(dq + row * row_stride + col) = pair;
    }
    if (row + 8 < rows) {
      Pair pair;
      pair[0] = static_cast<T>(four.z * p.scale);
      pair[1] = static_cast<T>(four.w * p.scale);
      *reinterpret_cast<Pair*>(dq + (row + 8) * row_stride + col) = pair;
    }
  }
}

}  // namespace attnaux_hopper
