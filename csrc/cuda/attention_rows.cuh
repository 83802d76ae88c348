// What one query row of an attention primitive sees, on the device (docs/kernel_abi.md): the
// band of keys its lengths, causal and window rules allow, what the mask and the segment ids
// hide, its final logits (scale, softcap, bias) and its lse with the sink. Read by small_seq.cu
// and probs_softmax.cu from the AttentionParams of common/attention_params.h.
#ifndef ATTNAUX_CSRC_CUDA_ATTENTION_ROWS_CUH_
#define ATTNAUX_CSRC_CUDA_ATTENTION_ROWS_CUH_

#include <cstdint>

#include "common/attention_params.h"
#include "cuda/device_utils.cuh"

namespace attnaux_cuda_kernels {

using attnaux::AttentionParams;

// Keys [lo, hi) of query row i of batch b that the lengths, the causal and the window rules let
// it see (the mask and the segment ids may hide more of them); padding rows see none.
struct RowBand {
  int64_t lo = 0, hi = 0;
  bool padding = true;
};

__device__ __forceinline__ RowBand Band(const AttentionParams& a, int64_t b, int64_t i) {
  const int64_t qs = a.q_seqlens[b], ks = a.kv_seqlens[b];
  const int64_t ql = qs < 0 ? 0 : (qs > a.q_len ? a.q_len : qs);
  const int64_t kl = ks < 0 ? 0 : (ks > a.kv_len ? a.kv_len : ks);
  const int64_t off = (a.causal == 2 ? kl - ql : 0) + a.DiagonalShift();
  RowBand r;
  r.padding = i >= ql;
  int64_t lo = 0, hi = r.padding ? 0 : kl;
  if (a.causal != 0) hi = min(hi, i + off + 1);
  if (a.window_right >= 0) hi = min(hi, i + off + a.window_right + 1);
  if (a.window_left >= 0) lo = max(lo, i + off - a.window_left);
  r.lo = lo;
  r.hi = hi < lo ? lo : hi;
  return r;
}

// What hides single keys of one query row: the boolean mask and the segment ids.
struct RowHide {
  const uint8_t* mask = nullptr;  // the row of the mask, stride a.mask_stride[3]
  const int32_t* kv_seg = nullptr;
  int32_t q_seg = 0;
};

__device__ __forceinline__ RowHide Hide(const AttentionParams& a, int64_t b, int64_t h, int64_t i) {
  RowHide r;
  if (a.mask != nullptr) {
    r.mask = reinterpret_cast<const uint8_t*>(a.mask) + b * a.mask_stride[0] + h * a.mask_stride[1] + i * a.mask_stride[2];
  }
  if (a.q_segment_ids != nullptr) {
    r.q_seg = a.q_segment_ids[b * a.q_len + i];
    r.kv_seg = a.kv_segment_ids + b * a.kv_len;
  }
  return r;
}

__device__ __forceinline__ bool NotHidden(const AttentionParams& a, const RowHide& r, int64_t j) {
  if (r.mask != nullptr && r.mask[j * a.mask_stride[3]] == 0) return false;
  return r.kv_seg == nullptr || r.kv_seg[j] == r.q_seg;
}

__device__ __forceinline__ const float* BiasRow(const AttentionParams& a, int64_t b, int64_t h, int64_t i) {
  return a.bias == nullptr ? nullptr
                           : a.bias + b * a.bias_stride[0] + h * a.bias_stride[1] + i * a.bias_stride[2];
}

// Final logit of key j from its raw dot product (scale, softcap, then bias).
__device__ __forceinline__ float Logit(const AttentionParams& a, const float* bias_row, float raw, int64_t j) {
  float s = a.softcap > 0.0f ? a.softcap * tanhf(raw * a.scale / a.softcap) : raw * a.scale;
  if (bias_row != nullptr) s += bias_row[j * a.bias_stride[3]];
  return s;
}

// A row's statistics from its max m (over visible keys, -inf if none) and
// sum = sum_j exp(s_j - m): lse (-inf, or the sink, for a row with no visible key), and how its
// probabilities are normalised, P = exp(s - shift) * scale: dividing by the row sum (the sink
// term included) rather than taking exp(s - lse), whose rounding (about |lse| * 2^-24) every P
// would inherit. A row with no visible key: scale = 0.
struct RowStats {
  float lse;
  float shift;
  float scale;
};

__device__ __forceinline__ RowStats RowStatistics(const AttentionParams& a, int64_t h, float m,
                                                  float sum) {
  if (isnan(sum) || isnan(m)) {
    // A NaN the row sees: NaN, as in the reference; P NaN too
    const float nan = __int_as_float(0x7fc00000);
    return {nan, nan, nan};
  }
  const bool live = m != -kInf && sum > 0.0f;
  if (a.sink != nullptr) {
    const float sink = a.sink[h];
    const float big = fmaxf(m, sink);
    const float scaled = m == -kInf ? 0.0f : sum * expf(m - big);
    const float total = scaled + expf(sink - big);
    return {big + logf(total), big, live ? 1.0f / total : 0.0f};
  }
  if (!live) return {-kInf, 0.0f, 0.0f};
  return {m + logf(sum), m, 1.0f / sum};
}

}  // namespace attnaux_cuda_kernels

#endif  // ATTNAUX_CSRC_CUDA_ATTENTION_ROWS_CUH_
