// The problem and visibility fields that attnaux's own Hopper forward and backward share
// (FwdParams and BwdParams derive from it), and their filling from an FFI call's attributes.
#pragma once

#include <cstdint>

namespace attnaux_hopper {

struct HopperGeometry {
  int batch, q_seq, kv_seq, q_heads, kv_heads;

  // softmax scale and scale * log2(e)
  float scale, scale_log2;

  // Which (query row q, key kv) pairs are visible, in the padded problem's coordinates:
  // kv < kv_len, q < q_len, and where `has_upper` kv <= q + offset + upper (causal: upper = 0),
  // where `has_lower` kv >= q + offset - lower (a window's left size).
  int q_len, kv_len, offset, upper, lower;
  bool has_upper, has_lower;
};

// The fields from the operands' sizes and the FFI attributes (`_flash_hopper._geometry_attrs`);
// the handlers have checked the sizes against int32 first.
inline void SetGeometry(HopperGeometry& g, int64_t batch, int64_t q_seq, int64_t kv_seq,
                        int64_t q_heads, int64_t kv_heads, float scale, int64_t q_len,
                        int64_t kv_len, int64_t offset, int32_t has_upper, int64_t upper,
                        int32_t has_lower, int64_t lower) {
  g.batch = int(batch);
  g.q_seq = int(q_seq);
  g.kv_seq = int(kv_seq);
  g.q_heads = int(q_heads);
  g.kv_heads = int(kv_heads);
  g.scale = scale;
  g.scale_log2 = scale * 1.4426950408889634f;
  g.q_len = int(q_len);
  g.kv_len = int(kv_len);
  g.offset = int(offset);
  g.has_upper = has_upper != 0;
  g.upper = int(upper);
  g.has_lower = has_lower != 0;
  g.lower = int(lower);
}

}  // namespace attnaux_hopper
