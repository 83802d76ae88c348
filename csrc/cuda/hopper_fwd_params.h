// The parameters of attnaux's own Hopper attention forward (cuda/hopper_fwd_kernel.cuh), shared by
// the host (cuda/hopper_fwd.cu fills it from the FFI call) and the device.
//
// Layouts (the padded problem of `_flash_hopper.forward`): q, out [batch, q_seq, q_heads, dim];
// k, v [batch, kv_seq, kv_heads, dim]; lse, max [batch, q_heads, q_seq] float32, natural log:
// max = scale * max_j q.k_j over the keys the row sees, lse = max + log(sum_j exp(scale q.k_j -
// max)); a row that sees no key: out 0, lse = max = -inf; a NaN the row sees: NaN in all three.
#pragma once

#include <cstdint>

#include "cuda/hopper_geometry.h"

namespace attnaux_hopper {

// The geometry (HopperGeometry: sizes, scale, which pairs are visible) as the backward's.
struct FwdParams : HopperGeometry {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  float* max;

  // The persistent CTAs' tiles (hopper_fwd_kernel.cuh): `grid` + 1 offsets, then
  // `schedule_tiles` tile indices.
  const int* schedule;
  int grid, schedule_tiles;

  // Packed sequences (`attnaux_hopper_fwd_packed`, HopperFwdKernel<Traits, true>): q and out
  // [1, total_q, q_heads, dim], k and v [1, total_kv, kv_heads, dim], lse and max [1, q_heads,
  // total_q]. `blocks` int32 [6, block_count]: per query block of 128 rows of a run (a
  // sequence, or tokens without keys: hopper_fwd_packed_table.cuh builds it on the device), its
  // index in the run (-1 after the last block), the run's first query token, its query tokens,
  // its first key token, its keys (within the arrays) and its sequence (-1: a run without
  // keys); tile t is block t / q_heads of head t % q_heads. The visibility fields apply
  // within each sequence (its rows and keys counted from its first token; q_len and kv_len its
  // own), `bottom_right` adding its kv_len - q_len to `offset`. The CTAs take tiles from
  // `tile_counter` (zeroed by the table's kernel). `stats`, where not null: the lse per
  // sequence as cuDNN's ragged backward reads it, float32 [num_seqs, q_heads, stats_rows]
  // (stats_rows = max_seqlen_q), +inf for a row that sees no key (its recomputed P 0) and for
  // the rows of a sequence's last block past its end; the rows past that block are not written
  // (not read). Unused (null) in the dense forward.
  const int* blocks;
  int block_count;
  bool bottom_right;
  int* tile_counter;
  float* stats;
  int stats_rows;
};

}  // namespace attnaux_hopper
