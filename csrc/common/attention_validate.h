// The validation of the attention inputs shared by every attention primitive on CPU (`flash`,
// `probs`, `small_seq`): inputs 0..10 and the attributes of docs/kernel_abi.md. Defined in
// flash_cpu.cc, next to the `flash` handlers that first used it.
#ifndef ATTNAUX_CSRC_COMMON_ATTENTION_VALIDATE_H_
#define ATTNAUX_CSRC_COMMON_ATTENTION_VALIDATE_H_

#include <cstdint>
#include <string>

#include "cpu/attention_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace attnaux::cpu {

// Checks q, k, v, bias, mask, the sequence lengths, segment ids, sink, rng_state and the
// attributes exactly as the `flash` handlers do and fills *p. Error messages name `target`
// (e.g. "attnaux_probs") where the flash handlers say "attnaux_flash".
xla::ffi::Error ValidateAttentionInputs(
    const std::string& target, xla::ffi::AnyBuffer q, xla::ffi::AnyBuffer k,
    xla::ffi::AnyBuffer v, xla::ffi::Buffer<xla::ffi::F32> bias,
    xla::ffi::Buffer<xla::ffi::PRED> mask, xla::ffi::Buffer<xla::ffi::S32> q_seqlens,
    xla::ffi::Buffer<xla::ffi::S32> kv_seqlens, xla::ffi::Buffer<xla::ffi::S32> q_segment_ids,
    xla::ffi::Buffer<xla::ffi::S32> kv_segment_ids, xla::ffi::Buffer<xla::ffi::F32> sink,
    xla::ffi::Buffer<xla::ffi::U32> rng_state, float scale, float softcap, int32_t causal,
    int64_t window_left, int64_t window_right, float dropout_rate, FlashParams* p);

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_COMMON_ATTENTION_VALIDATE_H_
