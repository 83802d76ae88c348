// The parameters of one call of an attention primitive (docs/kernel_abi.md, inputs 0..10 and the
// attributes), as the handlers' validation (common/attention_validate.h) fills them and every
// kernel reads them: the CPU kernels by reference, the CUDA kernels as a kernel argument. Plain
// data (no std:: containers, only default member values), so that one struct serves host and
// device code, as FlashAttention's Flash_fwd_params does.
#ifndef ATTNAUX_CSRC_COMMON_ATTENTION_PARAMS_H_
#define ATTNAUX_CSRC_COMMON_ATTENTION_PARAMS_H_

#include <cstdint>

#include "common/host_device.h"

namespace attnaux {

// The element type of q, k, v (and of out, dq, dk, dv).
enum class Elem { kF32, kBF16, kF16 };

// Everything the kernels read, already validated by the handler. Broadcast dims of bias/mask
// have stride 0. Optional inputs are nullptr when absent.
struct AttentionParams {
  int64_t batch = 0, q_len = 0, kv_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0, v_dim = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* bias = nullptr;
  int64_t bias_stride[4] = {0, 0, 0, 0};  // element strides, 0 on broadcast dims
  const bool* mask = nullptr;             // XLA's PRED: one byte, 0 or 1
  int64_t mask_stride[4] = {0, 0, 0, 0};
  const int32_t* q_seqlens = nullptr;
  const int32_t* kv_seqlens = nullptr;
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  const float* sink = nullptr;
  const uint32_t* rng_state = nullptr;  // non-null iff dropout_rate > 0
  float scale = 1.0f;
  float softcap = 0.0f;
  int32_t causal = 0;
  int64_t window_left = -1;  // already clamped by the handler so that i + off - wl cannot wrap
  int64_t window_right = -1;
  // With dropout: keep = Philox word >= drop_threshold, kept values times drop_scale.
  uint32_t drop_threshold = 0;
  float drop_scale = 1.0f;
  // Read by the CPU kernels only. Last, so that the fields before them keep the layout of the
  // CUDA kernels' former argument struct (the same kernel-parameter offsets, the same code).
  float dropout_rate = 0.0f;
  Elem elem = Elem::kF32;
  // CPU kernels: the smallest and largest segment id of every 64-row query tile and 64-key
  // tile, [batch, tiles, 2] (cpu/attention_mask.h's TileSegments), or nullptr.
  const int32_t* q_segment_tiles = nullptr;
  const int32_t* kv_segment_tiles = nullptr;
  // A 12-word rng_state (with or without dropout): this call is a block of a larger
  // [B, Hq, Sq, Skv] problem (a shard under SPMD, a block pair of context parallelism). Words
  // 4..10 give its origin and the global sizes (DropoutIndex), word 11 the diagonal shift of its
  // causal and window rules (DiagonalShift). nullptr for a whole problem.
  const uint32_t* block_state = nullptr;
  // CPU kernels with score_mod / mask_mod (cpu/score_program.h): the parsed program (a
  // cpu::ScoreProgram, opaque here), and mask_mod's block table, int32 [B|1, Hq|1, q tiles,
  // kv tiles] of 64 x 64 (0: every pair hidden, skipped; 1: some; 2: every pair shown),
  // strides 0 on broadcast dims; or nullptr.
  const void* score_program = nullptr;
  const int32_t* tile_mask = nullptr;
  int64_t tile_mask_stride[2] = {0, 0};

  ATTNAUX_HOST_DEVICE int64_t group() const { return kv_heads > 0 ? q_heads / kv_heads : 1; }

  // Added to the offset of the causal and window rules: key j is causally visible from query i
  // iff j <= i + off, off = (bottom-right ? kv_len - q_len : 0) + DiagonalShift(). A block whose
  // queries start at global position q0 and keys at k0 has the shift q0 - k0 (int32 in word 11).
  ATTNAUX_HOST_DEVICE int64_t DiagonalShift() const {
    return block_state == nullptr ? 0 : static_cast<int64_t>(static_cast<int32_t>(block_state[11]));
  }

  // The dropout counter of element (b, h, i, j) of this call's probabilities: its row-major
  // index in the [B, Hq, Sq, Skv] tensor of the whole problem (docs/kernel_abi.md), so a shard
  // draws the keep-mask of the unsharded call. rng_state (device memory on CUDA) is read here.
  ATTNAUX_HOST_DEVICE uint64_t DropoutIndex(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (block_state == nullptr) {
      return static_cast<uint64_t>(((b * q_heads + h) * q_len + i) * kv_len + j);
    }
    // words 4..10: batch, head, query and key origin; global heads, q_len, kv_len
    const uint32_t* o = block_state + 4;
    const uint64_t row = (uint64_t{o[0]} + b) * o[4] + o[1] + h;
    return ((row * o[5]) + o[2] + i) * o[6] + o[3] + j;
  }
};

}  // namespace attnaux

#endif  // ATTNAUX_CSRC_COMMON_ATTENTION_PARAMS_H_
