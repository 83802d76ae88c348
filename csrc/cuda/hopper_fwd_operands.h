// The operand checks that attnaux's two Hopper forward handlers share (cuda/hopper_fwd.cu, the
// dense forward; cuda/hopper_fwd_packed.cu, packed sequences as one batch entry): q and out
// [batch, q_seq, q_heads, dim], k and v [batch, kv_seq, kv_heads, dim], one dtype, bfloat16 or
// float16, dim 64, 128 or 256, q_heads a multiple of kv_heads, lse and max [batch, q_heads,
// q_seq] (float32 by the handlers' bindings).
#pragma once

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "cuda/ffi_utils.cuh"
#include "xla/ffi/api/ffi.h"

namespace attnaux_hopper {

inline xla::ffi::Error CheckForwardOperands(const char* target, const xla::ffi::AnyBuffer& q,
                                            const xla::ffi::AnyBuffer& k,
                                            const xla::ffi::AnyBuffer& v,
                                            const xla::ffi::AnyBuffer& out,
                                            attnaux::Dims lse_dims,
                                            attnaux::Dims max_dims) {
  namespace ffi = xla::ffi;
  using attnaux::BracketShape;
  using attnaux::Dims;
  using attnaux::SameDims;
  using attnaux_cuda_kernels::AttnInvalid;
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) {
    return AttnInvalid(target, "q and k must be [batch, seq, heads, dim], got q " +
                                   BracketShape(qd) + " and k " + BracketShape(kd) + ".");
  }
  const int64_t bsz = qd[0], q_seq = qd[1], q_heads = qd[2], dim = qd[3];
  const int64_t kv_heads = kd[2];
  if (kd[0] != bsz || kd[3] != dim || !SameDims(v.dimensions(), kd) ||
      !SameDims(out.dimensions(), qd)) {
    return AttnInvalid(target, "expected k and v of one shape [batch, kv_seq, kv_heads, dim] "
                               "matching q's batch and dim, and out of q's shape; got q " +
                                   BracketShape(qd) + ", k " + BracketShape(kd) + ", v " +
                                   BracketShape(v.dimensions()) + ", out " +
                                   BracketShape(out.dimensions()) + ".");
  }
  const auto dtype = q.element_type();
  if ((dtype != ffi::BF16 && dtype != ffi::F16) || k.element_type() != dtype ||
      v.element_type() != dtype || out.element_type() != dtype) {
    return AttnInvalid(target, "q, k, v and out must share one dtype, bfloat16 or float16.");
  }
  if (dim != 64 && dim != 128 && dim != 256) {
    return AttnInvalid(target, "head dim must be 64, 128 or 256, got " + std::to_string(dim) +
                                   ".");
  }
  if (kv_heads == 0 || q_heads % kv_heads != 0) {
    return AttnInvalid(target, "q_heads (" + std::to_string(q_heads) +
                                   ") must be a multiple of kv_heads (" +
                                   std::to_string(kv_heads) + ").");
  }
  const int64_t want_stats[3] = {bsz, q_heads, q_seq};
  if (!SameDims(lse_dims, Dims(want_stats, 3)) || !SameDims(max_dims, Dims(want_stats, 3))) {
    return AttnInvalid(target, "lse and max must be [batch, q_heads, q_seq] = " +
                                   BracketShape(Dims(want_stats, 3)) + ", got " +
                                   BracketShape(lse_dims) + " and " + BracketShape(max_dims) +
                                   ".");
  }
  return ffi::Error::Success();
}

}  // namespace attnaux_hopper
