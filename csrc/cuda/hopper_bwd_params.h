// The parameters of attnaux's own Hopper attention backward (cuda/hopper_bwd_kernel.cuh), shared by
// the host (cuda/hopper_bwd.cu fills it from the FFI call) and the device (passed by value as a
// __grid_constant__).
//
// Layouts (the padded problem of `_flash_hopper.backward`): q, dout [batch, q_seq, q_heads, dim];
// k, v, dk, dv [batch, kv_seq, kv_heads, dim]; dq_accum [batch, q_heads, q_seq / 64, 2, 64 * dim / 2]
// float32, the unscaled dS K summed by every key block's CTA, a query tile's two column halves in
// the order of the wgmma accumulator's registers (`_flash_hopper._cuda_dq` reorders it); out
// [batch, q_seq, q_heads, dim] (the forward's, q's dtype); lse, dlse [batch, q_heads, q_seq]
// float32 (natural log, and its cotangent); stats [batch, q_heads, 2, q_seq] float32, written by
// the first pass (hopper_bwd_preprocess.cuh) and read by the main kernel: per row the lse in
// log2 units (+inf for a row that sees nothing, so that P = 0 there) and the row term D - dlse,
// D = rowsum(dO * O).
#pragma once

#include <cstdint>

#include "cuda/hopper_geometry.h"

namespace attnaux_hopper {

// The geometry (HopperGeometry) as the forward's; scale is dK's factor (dQ's is applied to
// dq_accum by the caller).
struct BwdParams : HopperGeometry {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const void* out;
  const float* lse;
  const float* dlse;
  float* stats;
  float* dq_accum;
  void* dk;
  void* dv;
  // (batch, kv head) pairs a section of the CTAs' order (hopper_bwd_kernel.cuh, BwdTileOf)
  int section;
  // the query tiles of 64 rows in dq_accum's and stats' layouts (q_seq / 64; packed: each
  // sequence's tiles one after another from `tile_base[seq]`, so that TMA loads a tile's
  // statistics from an aligned start: its innermost coordinate must be a multiple of 16 bytes)
  // and the rows of stats' (64 dq_tiles)
  int dq_tiles, stats_seq;

  // Packed sequences (hopper_bwd_packed.cu; batch 1, the seq dims the tokens): the block table
  // of the key side (hopper_fwd_packed_table.cuh, built from the key offsets: each run's
  // 128-key blocks with its query span), a sequence's first dq tile, and whether each
  // sequence's causal diagonal is bottom-right aligned
  const int* blocks;
  int block_count;
  const int* tile_base;
  // each dQ tile's sequence [dq_tiles] (-1 past the last sequence's tiles): the first and last
  // passes find a tile's rows with one load rather than a search of tile_base
  const int* tile_seq;
  bool bottom_right;
  // the query offsets [num_seqs + 1] and the bound on a sequence's queries (the first pass
  // finds each dQ tile's rows from them)
  const int* q_offsets;
  int num_seqs, max_seqlen_q;
  // dQ in q's layout and dtype, written by the last pass (hopper_bwd_postprocess.cuh) from
  // dq_accum, times `scale`; its rows that no sequence covers zeroed by the first pass
  void* dq;
};

}  // namespace attnaux_hopper
