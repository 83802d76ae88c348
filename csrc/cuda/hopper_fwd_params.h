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
};

}  // namespace attnaux_hopper
