// The validation of the attention operands shared by every attention primitive's handlers, on
// CPU (`flash`, `probs`, `small_seq`) and on CUDA (`small_seq` and the `probs` softmax): inputs
// 0..10 and the attributes of docs/kernel_abi.md, checked, then copied into AttentionParams.
// (The cuDNN `flash` handlers take other operands and keep their own checks.)
#ifndef ATTNAUX_CSRC_COMMON_ATTENTION_VALIDATE_H_
#define ATTNAUX_CSRC_COMMON_ATTENTION_VALIDATE_H_

#include <cstdint>
#include <string>

#include "common/attention_params.h"
#include "common/ffi_shapes.h"
#include "xla/ffi/api/ffi.h"

namespace attnaux {

// One operand as the validation sees it. The CPU handlers bind typed buffers (XLA has checked
// their dtype when decoding the call), the CUDA handlers untyped ones (checked here).
struct Operand {
  xla::ffi::DataType dtype;
  Dims dims;
  const void* data;

  Operand(xla::ffi::AnyBuffer b)  // NOLINT(google-explicit-constructor)
      : dtype(b.element_type()), dims(b.dimensions()), data(b.untyped_data()) {}
  template <xla::ffi::DataType kType>
  Operand(xla::ffi::Buffer<kType> b)  // NOLINT(google-explicit-constructor)
      : dtype(kType), dims(b.dimensions()), data(b.untyped_data()) {}
};

// Inputs 0..10 and the attributes of docs/kernel_abi.md, in the ABI's order.
struct AttentionInputs {
  Operand q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, sink,
      rng_state;
  float scale;
  float softcap;
  int32_t causal;
  int64_t window_left;
  int64_t window_right;
  float dropout_rate;
};

// The CPU and the CUDA handlers were written with their own checks, and callers (and tests) see
// their messages: each keeps its rules, word for word and in its order. What they accept differs
// only at the edges:
//   kCpu:  messages in Python's shape notation, "(2, 3)"; softcap must also be finite; window
//          sizes below -1 are refused; kv_heads may be 0 when q_heads is; window sizes are clamped
//          to Sq + Skv + 1.
//   kCuda: messages in the notation "[2, 3]", with the dtype of every operand checked (the CUDA
//          handlers bind them untyped); softcap = inf passes; a window size below -1 means
//          unbounded; kv_heads must be >= 1; window sizes are clamped to 2^40.
// Both clamps leave every visible key range unchanged (each only keeps i + off +- w from
// overflowing).
enum class ValidationRules { kCpu, kCuda };

// Checks `in` under `rules` and fills *p (every field, the dropout threshold and scale
// included). Error messages start with `target`, e.g. "attnaux_flash: ".
xla::ffi::Error ValidateAttentionInputs(const std::string& target, ValidationRules rules,
                                        const AttentionInputs& in, AttentionParams* p);

}  // namespace attnaux

#endif  // ATTNAUX_CSRC_COMMON_ATTENTION_VALIDATE_H_
