// The fused softmax of the `probs` backend on GPU (`attnaux_probs_softmax_fwd` / `_bwd`, GPU-only
// targets, see src/attnaux/_probs_gpu.py): everything between the GEMMs, which XLA (cuBLAS) runs.
// Dropout uses the Philox layout of docs/kernel_abi.md (common/philox.h), so the keep-mask is
// bitwise the CPU one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "common/attention_params.h"
#include "common/attention_validate.h"
#include "cuda/attention_rows.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/ffi_utils.cuh"
#include "cuda/kernels_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux_cuda_kernels {

using attnaux::ValidationRules;

// ================================================================================================
// probs on GPU: the softmax between XLA's GEMMs
//
// The `probs` backend on GPU leaves the products to XLA (cuBLAS): S = q k^T in float32 before
// these kernels, out = (P * drop) v after the forward one, and dP = dout v^T before / dq, dk, dv
// after the backward one. These kernels do everything in between, one warp per query row:
//
// - forward: scale, softcap, bias, every mask rule, the sink, the softmax and its statistics,
//   P (input dtype, before dropout) and, with dropout, the weights P * keep / (1 - rate) for the
//   output product (Philox layout of docs/kernel_abi.md, bitwise the CPU kernels' mask);
// - backward: from the saved P, Dt = sum_j P (drop * dP + G) - dlse, dS = P (drop * dP + G - Dt)
//   (= dbias), dR = dS * tanh' (softcap), written as scale * dR in the input dtype for the
//   products, and the weights P * drop again for dv.
// ================================================================================================

// Keep bits of the VEC elements starting at dropout counter e (AttentionParams::DropoutIndex):
// with VEC = 4 and e % 4 == 0 (always so for a whole call with kv_len % 4 == 0; a block of a
// larger problem may start elsewhere) one Philox call gives all four words.
template <int VEC>
__device__ __forceinline__ void KeepVec(const AttentionParams& a, uint64_t e, bool (&keep)[VEC]) {
  if constexpr (VEC == 4) {
    if ((e & 3u) == 0) {
      const uint4 w = PhiloxBlock(a.rng_state, e >> 2);
      keep[0] = w.x >= a.drop_threshold;
      keep[1] = w.y >= a.drop_threshold;
      keep[2] = w.z >= a.drop_threshold;
      keep[3] = w.w >= a.drop_threshold;
      return;
    }
  }
#pragma unroll
  for (int t = 0; t < VEC; ++t) keep[t] = DropoutWord(a.rng_state, e + t) >= a.drop_threshold;
}

// Rows of up to 32 * VEC * kProbsRegChunks keys stay in registers (one read of each input, exp2
// with the log2(e) factor folded in); longer rows are streamed twice (NC = 0), the second read
// hitting the cache.
constexpr int kProbsRegChunks = 8;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T, int VEC, int NC>
__global__ void __launch_bounds__(kRowWarps * 32)
    ProbsSoftmaxFwd(AttentionParams a, const float* __restrict__ scores, T* __restrict__ probs,
                    T* __restrict__ weights, float* __restrict__ lse, float* __restrict__ row_max) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= a.batch * a.q_heads * a.q_len) return;  // the whole warp
  const int64_t i = row % a.q_len, bh = row / a.q_len;
  const int64_t h = bh % a.q_heads, b = bh / a.q_heads;
  const RowBand band = Band(a, b, i);
  const RowHide hide = Hide(a, b, h, i);
  const float* bias_row = BiasRow(a, b, h, i);
  const float* srow = scores + row * a.kv_len;
  T* prow = probs + row * a.kv_len;
  T* wrow = weights == nullptr ? nullptr : weights + row * a.kv_len;
  // The final logits of the VEC keys at j0 (-inf where not visible).
  auto logits = [&](int64_t j0, float (&x)[VEC]) {
    if (j0 < band.hi && j0 + VEC > band.lo) {
      LoadF<float, VEC>(srow + j0, x);
#pragma unroll
      for (int t = 0; t < VEC; ++t) {
        const int64_t j = j0 + t;
        const bool vis = j >= band.lo && j < band.hi && NotHidden(a, hide, j);
        x[t] = vis ? Logit(a, bias_row, x[t], j) : -kInf;
      }
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) x[t] = -kInf;
    }
  };
  // Writes P (and the dropout weights) of the VEC keys at j0 from their logits, normalised as
  // RowStatistics says (scale 0: a row with no visible key).
  auto write = [&](int64_t j0, float (&x)[VEC], float shift, float scale) {
    float p[VEC];
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      p[t] = (scale == 0.0f || x[t] == -kInf) ? 0.0f : exp2f((x[t] - shift) * kLog2e) * scale;
    }
    StoreF<T, VEC>(prow + j0, p);
    if (wrow != nullptr) {
      bool keep[VEC];
      KeepVec<VEC>(a, a.DropoutIndex(b, h, i, j0), keep);
#pragma unroll
      for (int t = 0; t < VEC; ++t) p[t] = keep[t] ? p[t] * a.drop_scale : 0.0f;
      StoreF<T, VEC>(wrow + j0, p);
    }
  };
  float m = -kInf, sum = 0.0f;
  if constexpr (NC > 0) {
    float x[NC][VEC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      logits((static_cast<int64_t>(c) * 32 + lane) * VEC, x[c]);
#pragma unroll
      for (int t = 0; t < VEC; ++t) m = fmaxf(m, x[c][t]);
    }
    m = WarpMax(m);
    const float shift = m == -kInf ? 0.0f : m;
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int t = 0; t < VEC; ++t) sum += x[c][t] == -kInf ? 0.0f : exp2f((x[c][t] - shift) * kLog2e);
    sum = WarpSum(sum);
    const RowStats st = RowStatistics(a, h, m, sum);
    const float l = st.lse;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
      if (j0 < a.kv_len) write(j0, x[c], st.shift, st.scale);
    }
    if (lane == 0) {
      lse[row] = band.padding ? (a.sink != nullptr ? a.sink[h] : -kInf) : l;
      row_max[row] = m;
    }
  } else {
    for (int64_t j0 = (band.lo / VEC) * VEC + lane * VEC; j0 < band.hi; j0 += 32 * VEC) {
      float x[VEC];
      logits(j0, x);
#pragma unroll
      for (int t = 0; t < VEC; ++t) {
        const float s = x[t];
        if (s > m) {
          sum = sum * expf(m - s) + 1.0f;
          m = s;
        } else if (m != -kInf) {  // (a -inf logit while m is still -inf adds nothing, not NaN)
          sum += expf(s - m);
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, sum, o);
      Combine(m, sum, m2, s2);
    }
    const RowStats st = RowStatistics(a, h, m, sum);
    const float l = st.lse;
    for (int64_t j0 = static_cast<int64_t>(lane) * VEC; j0 < a.kv_len; j0 += 32 * VEC) {
      float x[VEC];
      logits(j0, x);
      write(j0, x, st.shift, st.scale);
    }
    if (lane == 0) {
      lse[row] = band.padding ? (a.sink != nullptr ? a.sink[h] : -kInf) : l;
      row_max[row] = m;
    }
  }
}

struct ProbsBwdIo {
  const void* probs = nullptr;
  const float* dp = nullptr;       // dout . v^T, float32
  const void* dprobs = nullptr;    // cotangent of P, or null
  const float* dlse = nullptr;
  const float* scores = nullptr;   // raw q . k^T (softcap only)
  void* ds = nullptr;              // scale * dR, input dtype
  void* weights = nullptr;         // P * drop (dropout only)
  float* dbias = nullptr;          // dS (bias only)
};

template <typename T, int VEC, int NC>
__global__ void __launch_bounds__(kRowWarps * 32) ProbsSoftmaxBwd(AttentionParams a, ProbsBwdIo io) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= a.batch * a.q_heads * a.q_len) return;  // the whole warp
  const int64_t off = row * a.kv_len;
  const int64_t i = row % a.q_len, bh = row / a.q_len;
  const int64_t h = bh % a.q_heads, b = bh / a.q_heads;
  const T* prow = static_cast<const T*>(io.probs) + off;
  const float* dprow = io.dp + off;
  const T* grow = io.dprobs == nullptr ? nullptr : static_cast<const T*>(io.dprobs) + off;
  T* dsrow = static_cast<T*>(io.ds) + off;
  // P and dPt = drop * dP + G of the VEC keys at j0.
  auto load = [&](int64_t j0, float (&p)[VEC], float (&dpt)[VEC]) {
    float g[VEC];
    LoadF<T, VEC>(prow + j0, p);
    LoadF<float, VEC>(dprow + j0, dpt);
    if (grow != nullptr) {
      LoadF<T, VEC>(grow + j0, g);
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) g[t] = 0.0f;
    }
    if (a.rng_state != nullptr) {
      bool keep[VEC];
      KeepVec<VEC>(a, a.DropoutIndex(b, h, i, j0), keep);
#pragma unroll
      for (int t = 0; t < VEC; ++t) dpt[t] = (keep[t] ? a.drop_scale * dpt[t] : 0.0f) + g[t];
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) dpt[t] += g[t];
    }
  };
  // Writes scale * dR, dbias and the dropout weights of the VEC keys at j0.
  auto write = [&](int64_t j0, float (&p)[VEC], const float (&dpt)[VEC], float dt) {
    float ds[VEC], dr[VEC], raw[VEC];
    if (a.softcap > 0.0f) LoadF<float, VEC>(io.scores + off + j0, raw);
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      ds[t] = p[t] != 0.0f ? p[t] * (dpt[t] - dt) : 0.0f;
      float deriv = 1.0f;
      if (a.softcap > 0.0f && p[t] != 0.0f) {
        const float th = tanhf(a.scale * raw[t] / a.softcap);
        deriv = 1.0f - th * th;
      }
      dr[t] = p[t] != 0.0f ? a.scale * (ds[t] * deriv) : 0.0f;
    }
    StoreF<T, VEC>(dsrow + j0, dr);
    if (io.dbias != nullptr) StoreF<float, VEC>(io.dbias + off + j0, ds);
    if (io.weights != nullptr) {
      bool keep[VEC];
      KeepVec<VEC>(a, a.DropoutIndex(b, h, i, j0), keep);
#pragma unroll
      for (int t = 0; t < VEC; ++t) p[t] = keep[t] ? p[t] * a.drop_scale : 0.0f;
      StoreF<T, VEC>(static_cast<T*>(io.weights) + off + j0, p);
    }
  };
  float dt = 0.0f;
  if constexpr (NC > 0) {
    float p[NC][VEC], dpt[NC][VEC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
      if (j0 < a.kv_len) {
        load(j0, p[c], dpt[c]);
      } else {
#pragma unroll
        for (int t = 0; t < VEC; ++t) p[c][t] = dpt[c][t] = 0.0f;
      }
#pragma unroll
      for (int t = 0; t < VEC; ++t) dt += p[c][t] != 0.0f ? p[c][t] * dpt[c][t] : 0.0f;
    }
    dt = WarpSum(dt) - io.dlse[row];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
      if (j0 < a.kv_len) write(j0, p[c], dpt[c], dt);
    }
  } else {
    for (int64_t j0 = static_cast<int64_t>(lane) * VEC; j0 < a.kv_len; j0 += 32 * VEC) {
      float p[VEC], dpt[VEC];
      load(j0, p, dpt);
#pragma unroll
      for (int t = 0; t < VEC; ++t) dt += p[t] != 0.0f ? p[t] * dpt[t] : 0.0f;
    }
    dt = WarpSum(dt) - io.dlse[row];
    for (int64_t j0 = static_cast<int64_t>(lane) * VEC; j0 < a.kv_len; j0 += 32 * VEC) {
      float p[VEC], dpt[VEC];
      load(j0, p, dpt);
      write(j0, p, dpt, dt);
    }
  }
}

// Calls fn with NC = the register chunks a row of kv_len keys needs (1, 2, 4, 8), or 0 (stream).
template <int VEC, typename Fn>
cudaError_t ByRowChunks(int64_t kv_len, const Fn& fn) {
  const int64_t chunks = (kv_len + 32 * VEC - 1) / (32 * VEC);
  if (chunks <= 1) return fn(std::integral_constant<int, 1>{});
  if (chunks <= 2) return fn(std::integral_constant<int, 2>{});
  if (chunks <= 4) return fn(std::integral_constant<int, 4>{});
  if (chunks <= kProbsRegChunks) return fn(std::integral_constant<int, kProbsRegChunks>{});
  return fn(std::integral_constant<int, 0>{});
}

// float4 reads of the scores when every row starts on a 16-byte boundary, else one element.
inline int ProbsVec(const AttentionParams& a, std::initializer_list<const void*> buffers) {
  if (a.kv_len % 4 != 0) return 1;
  for (const void* p : buffers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return 4;
}

template <typename T>
cudaError_t LaunchProbsFwd(cudaStream_t stream, const AttentionParams& a, const float* scores, void* probs,
                           void* weights, float* lse, float* mx) {
  const int64_t rows = a.batch * a.q_heads * a.q_len;
  const dim3 grid(static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps)), block(kRowWarps * 32);
  T* p = static_cast<T*>(probs);
  T* w = static_cast<T*>(weights);
  auto go = [&](auto vec_tag) {
    constexpr int VEC = decltype(vec_tag)::value;
    return ByRowChunks<VEC>(a.kv_len, [&](auto nc_tag) {
      ProbsSoftmaxFwd<T, VEC, decltype(nc_tag)::value><<<grid, block, 0, stream>>>(a, scores, p, w, lse, mx);
      return cudaGetLastError();
    });
  };
  if (ProbsVec(a, {scores, probs, weights}) == 4) return go(std::integral_constant<int, 4>{});
  return go(std::integral_constant<int, 1>{});
}

template <typename T>
cudaError_t LaunchProbsBwd(cudaStream_t stream, const AttentionParams& a, const ProbsBwdIo& io) {
  const int64_t rows = a.batch * a.q_heads * a.q_len;
  const dim3 grid(static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps)), block(kRowWarps * 32);
  auto go = [&](auto vec_tag) {
    constexpr int VEC = decltype(vec_tag)::value;
    return ByRowChunks<VEC>(a.kv_len, [&](auto nc_tag) {
      ProbsSoftmaxBwd<T, VEC, decltype(nc_tag)::value><<<grid, block, 0, stream>>>(a, io);
      return cudaGetLastError();
    });
  };
  if (ProbsVec(a, {io.probs, io.dp, io.dprobs, io.scores, io.ds, io.weights, io.dbias}) == 4) {
    return go(std::integral_constant<int, 4>{});
  }
  return go(std::integral_constant<int, 1>{});
}

// ================================================================================================
// FFI handlers
// ================================================================================================
constexpr const char* kProbsTarget = "attnaux_probs_softmax";

// probs softmax: inputs 0..10 as the attention ABI, then the float32 scores.
ffi::Error ProbsValidate(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                         ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                         ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer sink,
                         ffi::AnyBuffer rng, float scale, float softcap, int32_t causal,
                         int64_t window_left, int64_t window_right, float dropout_rate,
                         AttentionParams* a) {
  if (auto e = attnaux::ValidateAttentionInputs(
          kProbsTarget, ValidationRules::kCuda,
          {q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng, scale, softcap,
           causal, window_left, window_right, dropout_rate},
          a);
      e.failure()) {
    return e;
  }
  if (a->batch * a->q_heads * a->q_len / kRowWarps >= (int64_t{1} << 31) - 1) {
    return AttnInvalid(kProbsTarget, "too many rows for one launch.");
  }
  return ffi::Error::Success();
}

// An [B, Hq, Sq, Skv] buffer of dtype t, or (0,) where `optional`.
bool IsScoreShaped(const ffi::AnyBuffer& x, const AttentionParams& a, ffi::DataType t) {
  return x.element_type() == t && SameDims(x.dimensions(), {a.batch, a.q_heads, a.q_len, a.kv_len});
}

ffi::Error ProbsFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens,
                        ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                        ffi::AnyBuffer sink, ffi::AnyBuffer rng, ffi::AnyBuffer scores, float scale,
                        float softcap, int32_t causal, int64_t window_left, int64_t window_right,
                        float dropout_rate, ffi::Result<ffi::AnyBuffer> probs,
                        ffi::Result<ffi::AnyBuffer> weights, ffi::Result<ffi::AnyBuffer> lse,
                        ffi::Result<ffi::AnyBuffer> row_max) {
  AttentionParams a;
  if (auto e = ProbsValidate(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng,
                             scale, softcap, causal, window_left, window_right, dropout_rate, &a);
      e.failure()) {
    return e;
  }
  auto invalid = [](const std::string& m) { return AttnInvalid(kProbsTarget, m); };
  const auto dt = q.element_type();
  if (!IsScoreShaped(scores, a, ffi::DataType::F32)) return invalid("`scores` must be F32 [B, Hq, Sq, Skv]; got " + BracketShape(scores.dimensions()) + ".");
  if (!IsScoreShaped(*probs, a, dt)) return invalid("output `probs` must be [B, Hq, Sq, Skv] of q's dtype.");
  void* weights_p = nullptr;
  if (a.rng_state != nullptr) {
    if (!IsScoreShaped(*weights, a, dt)) return invalid("output `weights` must be [B, Hq, Sq, Skv] of q's dtype with dropout.");
    weights_p = weights->untyped_data();
  } else if (!Absent(*weights)) {
    return invalid("output `weights` must be (0,) without dropout.");
  }
  for (auto* s : {&lse, &row_max}) {
    if ((*s)->element_type() != ffi::DataType::F32 || !SameDims((*s)->dimensions(), {a.batch, a.q_heads, a.q_len})) {
      return invalid("outputs `lse` and `max` must be F32 [B, Hq, Sq].");
    }
  }
  if (a.batch * a.q_heads * a.q_len == 0) return ffi::Error::Success();
  return CudaResult("attnaux_probs_softmax_fwd", DispatchT(dt, [&](auto tag) {
    using T = decltype(tag);
    return LaunchProbsFwd<T>(stream, a, static_cast<const float*>(scores.untyped_data()),
                             probs->untyped_data(), weights_p, static_cast<float*>(lse->untyped_data()),
                             static_cast<float*>(row_max->untyped_data()));
  }));
}

ffi::Error ProbsBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_seqlens,
                        ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                        ffi::AnyBuffer sink, ffi::AnyBuffer rng, ffi::AnyBuffer probs,
                        ffi::AnyBuffer dp, ffi::AnyBuffer dprobs, ffi::AnyBuffer dlse,
                        ffi::AnyBuffer scores, float scale, float softcap, int32_t causal,
                        int64_t window_left, int64_t window_right, float dropout_rate,
                        ffi::Result<ffi::AnyBuffer> ds, ffi::Result<ffi::AnyBuffer> weights,
                        ffi::Result<ffi::AnyBuffer> dbias) {
  AttentionParams a;
  if (auto e = ProbsValidate(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_seg, kv_seg, sink, rng,
                             scale, softcap, causal, window_left, window_right, dropout_rate, &a);
      e.failure()) {
    return e;
  }
  auto invalid = [](const std::string& m) { return AttnInvalid(kProbsTarget, m); };
  const auto dt = q.element_type();
  ProbsBwdIo io;
  if (!IsScoreShaped(probs, a, dt)) return invalid("`probs` must be [B, Hq, Sq, Skv] of q's dtype.");
  if (!IsScoreShaped(dp, a, ffi::DataType::F32)) return invalid("`dp` must be F32 [B, Hq, Sq, Skv].");
  if (!Absent(dprobs)) {
    if (!IsScoreShaped(dprobs, a, dt)) return invalid("`dprobs` must be like `probs` or (0,).");
    io.dprobs = dprobs.untyped_data();
  }
  if (dlse.element_type() != ffi::DataType::F32 || !SameDims(dlse.dimensions(), {a.batch, a.q_heads, a.q_len})) {
    return invalid("`dlse` must be F32 [B, Hq, Sq].");
  }
  if (a.softcap > 0.0f) {
    if (!IsScoreShaped(scores, a, ffi::DataType::F32)) return invalid("`scores` must be F32 [B, Hq, Sq, Skv] with softcap.");
    io.scores = static_cast<const float*>(scores.untyped_data());
  } else if (!Absent(scores)) {
    return invalid("`scores` must be (0,) without softcap.");
  }
  if (!IsScoreShaped(*ds, a, dt)) return invalid("output `ds` must be [B, Hq, Sq, Skv] of q's dtype.");
  if (a.rng_state != nullptr) {
    if (!IsScoreShaped(*weights, a, dt)) return invalid("output `weights` must be [B, Hq, Sq, Skv] of q's dtype with dropout.");
    io.weights = weights->untyped_data();
  } else if (!Absent(*weights)) {
    return invalid("output `weights` must be (0,) without dropout.");
  }
  if (a.bias != nullptr) {
    if (!IsScoreShaped(*dbias, a, ffi::DataType::F32)) return invalid("output `dbias` must be F32 [B, Hq, Sq, Skv] with a bias.");
    io.dbias = static_cast<float*>(dbias->untyped_data());
  } else if (!Absent(*dbias)) {
    return invalid("output `dbias` must be (0,) without a bias.");
  }
  io.probs = probs.untyped_data();
  io.dp = static_cast<const float*>(dp.untyped_data());
  io.dlse = static_cast<const float*>(dlse.untyped_data());
  io.ds = ds->untyped_data();
  if (a.batch * a.q_heads * a.q_len == 0) return ffi::Error::Success();
  return CudaResult("attnaux_probs_softmax_bwd", DispatchT(dt, [&](auto tag) {
    using T = decltype(tag);
    return LaunchProbsBwd<T>(stream, a, io);
  }));
}

}  // namespace attnaux_cuda_kernels

namespace ak = attnaux_cuda_kernels;

// attnaux_probs_softmax_fwd: P, the dropout weights, lse and max from XLA's float32 q k^T
// (kCmdBufferCompatible: see cuda/ffi_utils.cuh, as for every handler of these kernels).
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxProbsSoftmaxFwdCuda, ak::ProbsFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  ATTNAUX_CUDA_ATTENTION_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // scores: F32 q k^T [B, Hq, Sq, Skv]
                                  ATTNAUX_CUDA_ATTENTION_ATTRS
                                  .Ret<ffi::AnyBuffer>()   // probs (before dropout)
                                  .Ret<ffi::AnyBuffer>()   // weights P * drop, or (0,)
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Ret<ffi::AnyBuffer>(),  // max
                              {ffi::Traits::kCmdBufferCompatible});

// attnaux_probs_softmax_bwd: scale * dR, the dropout weights and dbias from the saved P and
// XLA's dout v^T.
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxProbsSoftmaxBwdCuda, ak::ProbsBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  ATTNAUX_CUDA_ATTENTION_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // probs
                                  .Arg<ffi::AnyBuffer>()  // dp: F32 dout v^T
                                  .Arg<ffi::AnyBuffer>()  // dprobs or (0,)
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Arg<ffi::AnyBuffer>()  // scores (softcap) or (0,)
                                  ATTNAUX_CUDA_ATTENTION_ATTRS
                                  .Ret<ffi::AnyBuffer>()   // ds = scale * dR
                                  .Ret<ffi::AnyBuffer>()   // weights P * drop, or (0,)
                                  .Ret<ffi::AnyBuffer>(),  // dbias or (0,)
                              {ffi::Traits::kCmdBufferCompatible});

