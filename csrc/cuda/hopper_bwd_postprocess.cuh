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
// thread reads those 16 bytes whole (v1, v0 at one t0, t1, t2, v2: coalesced) and puts two
// rows' column pairs into a shared tile; then each thread writes 16 bytes of one row. Writing
// the pairs straight to dq (4-byte stores, 8 rows a warp) took 1.9x FlashAttention-3's pass
// (63.5 against 33.3 us at 8192 tokens x 16 heads x 128 on an H100): each 32-byte sector was
// written half at a time.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(kPostprocessThreads)
    HopperBwdPostprocess(const __grid_constant__ BwdParams p) {
  constexpr int kHalf = kHeadDim / 2;
  static_assert(kHalf % 8 == 0);
  // 16 bytes of padding a row: a warp's pairs (rows t1, columns 2 t0) fall in 32 distinct banks
  // (a row is 4 banks past the previous one), and rows stay 16-byte aligned for the read-out.
  constexpr int kStride = kHeadDim + 16 / sizeof(T);
  __shared__ __align__(16) T tile[kPreprocessRows * kStride];
  const int m = blockIdx.x, h = blockIdx.y;
  // the tile's sums first, into registers (every tile below dq_tiles has them), so that their
  // loads overlap the lookup of the tile's rows
  constexpr int kLoads = kPreprocessRows * kHeadDim / 4 / kPostprocessThreads;
  static_assert(kLoads * 4 * kPostprocessThreads == kPreprocessRows * kHeadDim);
  const float4* sums = reinterpret_cast<const float4*>(
      p.dq_accum + (int64_t(h) * p.dq_tiles + m) * (kPreprocessRows * kHeadDim));
  float4 loaded[kLoads];
  CUTE_UNROLL
  for (int l = 0; l < kLoads; ++l) loaded[l] = sums[threadIdx.x + l * kPostprocessThreads];
  const int seq = p.tile_seq[m];
  if (seq < 0) return;  // past the sequences' tiles
  const int start = p.q_offsets[seq], in_seq = m - p.tile_base[seq];
  const int q_len = min(p.q_offsets[seq + 1] - start, p.max_seqlen_q);
  const int first_row = start + in_seq * kPreprocessRows;
  const int rows = min(q_len - in_seq * kPreprocessRows, kPreprocessRows);
  using Pair = typename cutlass::Array<T, 2>;
  CUTE_UNROLL
  for (int l = 0; l < kLoads; ++l) {
    const int i = threadIdx.x + l * kPostprocessThreads;
    const float4 four = loaded[l];
    const int wg = (4 * i) / (kPreprocessRows * kHalf);
    const int in_wg = (4 * i) % (kPreprocessRows * kHalf);
    const int t2 = in_wg / (16 * kHalf), v2 = (in_wg % (16 * kHalf)) / 128;
    const int t1 = (in_wg % 128) / 16, t0 = (in_wg % 16) / 4;
    const int row = 16 * t2 + t1, col = wg * kHalf + 8 * v2 + 2 * t0;
    Pair upper, lower;
    upper[0] = static_cast<T>(four.x * p.scale);
    upper[1] = static_cast<T>(four.y * p.scale);
    lower[0] = static_cast<T>(four.z * p.scale);
    lower[1] = static_cast<T>(four.w * p.scale);
    *reinterpret_cast<Pair*>(tile + row * kStride + col) = upper;
    *reinterpret_cast<Pair*>(tile + (row + 8) * kStride + col) = lower;
  }
  __syncthreads();
  constexpr int kChunks = kHeadDim * sizeof(T) / 16;  // a row's 16-byte pieces
  T* dq = static_cast<T*>(p.dq) + (int64_t(first_row) * p.q_heads + h) * kHeadDim;
  const int64_t row_stride = int64_t(p.q_heads) * kHeadDim;
  CUTE_UNROLL
  for (int i = threadIdx.x; i < kPreprocessRows * kChunks; i += kPostprocessThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    if (row < rows) {
      *reinterpret_cast<uint4*>(dq + row * row_stride + chunk * (16 / sizeof(T))) =
          *reinterpret_cast<const uint4*>(tile + row * kStride + chunk * (16 / sizeof(T)));
    }
  }
}

}  // namespace attnaux_hopper
