// The parameters of attnaux's own Hopper attention forward (cuda/hopper_fwd_kernel.cuh), shared by
// the host (cuda/hopper_fwd.cu fills it from the FFI call) and the device.
//
// Layouts (the padded problem of `_flash_hopper.forward`): q, out [batch, q_seq, q_heads, dim];
// k, v [batch, kv_seq, kv_heads, dim]; lse, max [batch, q_heads, q_seq] float32, natural log:
// max = scale * max_j q.k_j over the keys the row sees, lse = max + log(sum_j exp(scale q.k_j -
// max)); a row that sees no key: out 0, lse = max = -inf; a NaN the row sees: NaN in all three.
#pragma once

#include <cstdint>

namespace attnaux_hopper {

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  float* max;

  int batch, q_seq, kv_seq, q_heads, kv_heads;

  float scale, scale_log2;  // softmax scale and scale * log2(e)

  // Which (query row q, key kv) pairs are visible, as BwdParams: kv < kv_len, q < q_len, where
  // `has_upper` kv <= q + offset + upper, where `has_lower` kv >= q + offset - lower.
  int q_len, kv_len, offset, upper, lower;
  bool has_upper, has_lower;

  // The persistent CTAs' tiles (hopper_fwd_kernel.cuh): `grid` + 1 offsets, then
  // `schedule_tiles` tile indices.
  const int* schedule;
  int grid, schedule_tiles;
};

}  // namespace attnaux_hopper
