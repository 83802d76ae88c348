// The fused softmax of docs/softmax_abi.md on CUDA (`attnaux_softmax_fwd` / `_bwd`, registered
// for platform "CUDA" under the CPU handlers' target names): one warp per row while a row fits in
// registers (<= 64 floats per lane, so kv_seq <= 2048), 16-byte vector loads and stores when
// kv_seq is a multiple of the vector width; longer rows take one 512-thread block per row with an
// online (max, sum) pass and a write pass. Float32 math for every dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/device_utils.cuh"
#include "cuda/ffi_utils.cuh"
#include "cuda/kernels_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux_cuda_kernels {

// ================================================================================================
// Fused softmax
// ================================================================================================
struct SoftmaxArgs {
  int64_t n = 0, sq = 0, skv = 0;
  float scale = 1.0f;
  int causal = 0;
  const uint8_t* mask = nullptr;
  int64_t mask_n = 0, mask_q = 1, mask_kv = 1, mask_div = 1;
};

__device__ __forceinline__ const uint8_t* MaskRow(const SoftmaxArgs& a, int64_t row) {
  if (a.mask == nullptr) return nullptr;
  const int64_t n = row / a.sq, i = row - n * a.sq;
  const int64_t m = (n / a.mask_div) % a.mask_n;
  return a.mask + (m * a.mask_q + (a.mask_q == 1 ? 0 : i)) * a.mask_kv;
}

// One past the last positionally visible key of row i.
__device__ __forceinline__ int64_t RowEnd(const SoftmaxArgs& a, int64_t i) {
  if (a.causal == 0) return a.skv;
  const int64_t e = i + (a.causal == 2 ? a.skv - a.sq : 0) + 1;
  return e < 0 ? 0 : (e > a.skv ? a.skv : e);
}

__device__ __forceinline__ bool MaskAt(const uint8_t* mrow, int64_t mask_kv, int64_t j) {
  return mrow == nullptr || mrow[mask_kv == 1 ? 0 : j] != 0;
}

template <typename T, int VEC, int NC, bool MASKED>
__global__ void __launch_bounds__(kRowWarps * 32)
    SoftmaxFwdWarp(SoftmaxArgs a, const T* __restrict__ x, T* __restrict__ probs,
                   float* __restrict__ lse, float* __restrict__ row_max) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= a.n * a.sq) return;
  const int64_t i = row % a.sq;
  const int64_t end = RowEnd(a, i);
  const uint8_t* mrow = MaskRow(a, row);
  const T* xr = x + row * a.skv;
  float s[NC][VEC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < end) {
      LoadF<T, VEC>(xr + j0, s[c]);
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) s[c][t] = -kInf;
    }
  }
  float m = -kInf;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      // Without mask and causal every key of an in-bounds vector is visible (skv % VEC == 0).
      const bool vis = MASKED ? (j0 + t < end && MaskAt(mrow, a.mask_kv, j0 + t)) : j0 < end;
      s[c][t] = vis ? a.scale * s[c][t] : -kInf;
      m = fmaxf(m, s[c][t]);
    }
  }
  m = WarpMax(m);
  const float shift = m == -kInf ? 0.0f : m;
  constexpr float kLog2e = 1.4426950408889634f;
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      s[c][t] = exp2f((s[c][t] - shift) * kLog2e);  // exp; exp2f is ex2.approx, ~2 ulp
      sum += s[c][t];
    }
  }
  sum = WarpSum(sum);
  const float inv = m == -kInf ? 0.0f : 1.0f / sum;
  T* pr = probs + row * a.skv;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < a.skv) {
#pragma unroll
      for (int t = 0; t < VEC; ++t) s[c][t] *= inv;
      StoreF<T, VEC>(pr + j0, s[c]);
    }
  }
  if (lane == 0) {
    lse[row] = m == -kInf ? -kInf : m + logf(sum);
    row_max[row] = m;
  }
}

constexpr int kBlockThreads = 512;

// (max, sum) of the block, broadcast to every thread.
__device__ __forceinline__ void BlockCombine(float& m, float& s) {
  __shared__ float sm[kBlockThreads / 32], ss[kBlockThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    Combine(m, s, m2, s2);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  m = -kInf;
  s = 0.0f;
  for (int w = 0; w < kBlockThreads / 32; ++w) Combine(m, s, sm[w], ss[w]);  // same in all threads
}

__device__ __forceinline__ float BlockSum(float x) {
  __shared__ float part[kBlockThreads / 32];
  x = WarpSum(x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) part[warp] = x;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kBlockThreads / 32; ++w) total += part[w];
  return total;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
    SoftmaxFwdBlock(SoftmaxArgs a, const T* __restrict__ x, T* __restrict__ probs,
                    float* __restrict__ lse, float* __restrict__ row_max) {
  const int64_t row = blockIdx.x;
  const int64_t i = row % a.sq;
  const int64_t end = RowEnd(a, i);
  const uint8_t* mrow = MaskRow(a, row);
  const T* xr = x + row * a.skv;
  float m = -kInf, sum = 0.0f;
  for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * VEC; j0 < end;
       j0 += static_cast<int64_t>(kBlockThreads) * VEC) {
    float s[VEC];
    LoadF<T, VEC>(xr + j0, s);
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      if (j0 + t >= end || !MaskAt(mrow, a.mask_kv, j0 + t)) continue;
      const float v = a.scale * s[t];
      if (v > m) {
        sum = sum * expf(m - v) + 1.0f;
        m = v;
      } else {
        sum += expf(v - m);
      }
    }
  }
  BlockCombine(m, sum);
  const float shift = m == -kInf ? 0.0f : m;
  const float inv = m == -kInf ? 0.0f : 1.0f / sum;
  T* pr = probs + row * a.skv;
  for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * VEC; j0 < a.skv;
       j0 += static_cast<int64_t>(kBlockThreads) * VEC) {
    float s[VEC];
    if (j0 < end) {
      LoadF<T, VEC>(xr + j0, s);
    } else {
#pragma unroll
      for (int t = 0; t < VEC; ++t) s[t] = 0.0f;
    }
#pragma unroll
    for (int t = 0; t < VEC; ++t) {
      const bool vis = j0 + t < end && MaskAt(mrow, a.mask_kv, j0 + t);
      s[t] = vis ? expf(a.scale * s[t] - shift) * inv : 0.0f;
    }
    StoreF<T, VEC>(pr + j0, s);
  }
  if (threadIdx.x == 0) {
    lse[row] = m == -kInf ? -kInf : m + logf(sum);
    row_max[row] = m;
  }
}

// Backward: dlogits may alias probs (each element is read by the thread that writes it, and the
// row's reduction completes before any write). The row of P and of its cotangent stay in
// registers in the input dtype (converted to float where used), so one pass over memory serves
// rows of up to kBwdRowBytes per lane and tensor (2048 keys in bf16/f16, 1024 in float32).
constexpr int64_t kBwdRowBytes = 128;

template <typename T, int VEC, int NC>
__global__ void __launch_bounds__(kRowWarps * 32, 2)
    SoftmaxBwdWarp(int64_t rows, int64_t skv, float scale, const T* probs, const T* dprobs,
                   const float* dlse, T* dlogits) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  Vec<T, VEC> p_raw[NC], g_raw[NC];
  float dt = 0.0f;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < skv) {
      p_raw[c] = *reinterpret_cast<const Vec<T, VEC>*>(probs + row * skv + j0);
      g_raw[c] = *reinterpret_cast<const Vec<T, VEC>*>(dprobs + row * skv + j0);
    } else {
      p_raw[c] = g_raw[c] = Vec<T, VEC>{};  // zero bits
    }
    float p[VEC], g[VEC];
    ToFloats<T, VEC>(p_raw[c], p);
    ToFloats<T, VEC>(g_raw[c], g);
#pragma unroll
    for (int t = 0; t < VEC; ++t) dt += p[t] != 0.0f ? p[t] * g[t] : 0.0f;
  }
  dt = WarpSum(dt) - dlse[row];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int64_t j0 = (static_cast<int64_t>(c) * 32 + lane) * VEC;
    if (j0 < skv) {
      float p[VEC], g[VEC];
      ToFloats<T, VEC>(p_raw[c], p);
      ToFloats<T, VEC>(g_raw[c], g);
#pragma unroll
      for (int t = 0; t < VEC; ++t) g[t] = p[t] != 0.0f ? (p[t] * scale) * (g[t] - dt) : 0.0f;
      StoreF<T, VEC>(dlogits + row * skv + j0, g);
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
    SoftmaxBwdBlock(int64_t skv, float scale, const T* probs, const T* dprobs, const float* dlse,
                    T* dlogits) {
  const int64_t row = blockIdx.x;
  const T* pr = probs + row * skv;
  const T* gr = dprobs + row * skv;
  float dt = 0.0f;
  for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * VEC; j0 < skv;
       j0 += static_cast<int64_t>(kBlockThreads) * VEC) {
    float p[VEC], g[VEC];
    LoadF<T, VEC>(pr + j0, p);
    LoadF<T, VEC>(gr + j0, g);
#pragma unroll
    for (int t = 0; t < VEC; ++t) dt += p[t] != 0.0f ? p[t] * g[t] : 0.0f;
  }
  dt = BlockSum(dt) - dlse[row];
  for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * VEC; j0 < skv;
       j0 += static_cast<int64_t>(kBlockThreads) * VEC) {
    float p[VEC], g[VEC];
    LoadF<T, VEC>(pr + j0, p);
    LoadF<T, VEC>(gr + j0, g);
#pragma unroll
    for (int t = 0; t < VEC; ++t) g[t] = p[t] != 0.0f ? (p[t] * scale) * (g[t] - dt) : 0.0f;
    StoreF<T, VEC>(dlogits + row * skv + j0, g);
  }
}

constexpr int64_t kMaxRegPerLane = 64;  // floats of a row per lane in the warp kernels

template <typename T, int VEC>
cudaError_t LaunchSoftmaxFwdT(cudaStream_t stream, const SoftmaxArgs& a, const void* x, void* p,
                              float* lse, float* mx) {
  const int64_t rows = a.n * a.sq;
  const T* xt = static_cast<const T*>(x);
  T* pt = static_cast<T*>(p);
  const int64_t per_lane = (a.skv + 31) / 32;  // elements per lane
  const dim3 grid(static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps));
  const dim3 block(kRowWarps * 32);
  if (per_lane <= kMaxRegPerLane) {
    const int64_t nc = (per_lane + VEC - 1) / VEC;
    auto go = [&](auto ncv) {
      constexpr int NC = decltype(ncv)::value;
      if constexpr (NC * VEC <= kMaxRegPerLane) {
        if (a.mask != nullptr || a.causal != 0) {
          SoftmaxFwdWarp<T, VEC, NC, true><<<grid, block, 0, stream>>>(a, xt, pt, lse, mx);
        } else {
          SoftmaxFwdWarp<T, VEC, NC, false><<<grid, block, 0, stream>>>(a, xt, pt, lse, mx);
        }
      }
    };
    if (nc <= 1) go(std::integral_constant<int, 1>{});
    else if (nc <= 2) go(std::integral_constant<int, 2>{});
    else if (nc <= 4) go(std::integral_constant<int, 4>{});
    else if (nc <= 8) go(std::integral_constant<int, 8>{});
    else if (nc <= 16) go(std::integral_constant<int, 16>{});
    else if (nc <= 32) go(std::integral_constant<int, 32>{});
    else go(std::integral_constant<int, 64>{});
  } else {
    SoftmaxFwdBlock<T, VEC><<<static_cast<unsigned>(rows), kBlockThreads, 0, stream>>>(a, xt, pt, lse, mx);
  }
  return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t LaunchSoftmaxBwdT(cudaStream_t stream, int64_t rows, int64_t skv, float scale,
                              const void* p, const void* g, const float* dlse, void* out) {
  const T* pt = static_cast<const T*>(p);
  const T* gt = static_cast<const T*>(g);
  T* ot = static_cast<T*>(out);
  const int64_t per_lane = (skv + 31) / 32;
  const dim3 grid(static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps));
  const dim3 block(kRowWarps * 32);
  if (per_lane * static_cast<int64_t>(sizeof(T)) <= kBwdRowBytes) {
    const int64_t nc = (per_lane + VEC - 1) / VEC;
    auto go = [&](auto ncv) {
      constexpr int NC = decltype(ncv)::value;
      if constexpr (NC * VEC * sizeof(T) <= kBwdRowBytes) {
        SoftmaxBwdWarp<T, VEC, NC><<<grid, block, 0, stream>>>(rows, skv, scale, pt, gt, dlse, ot);
      }
    };
    if (nc <= 1) go(std::integral_constant<int, 1>{});
    else if (nc <= 2) go(std::integral_constant<int, 2>{});
    else if (nc <= 4) go(std::integral_constant<int, 4>{});
    else if (nc <= 8) go(std::integral_constant<int, 8>{});
    else if (nc <= 16) go(std::integral_constant<int, 16>{});
    else if (nc <= 32) go(std::integral_constant<int, 32>{});
    else go(std::integral_constant<int, 64>{});
  } else {
    SoftmaxBwdBlock<T, VEC><<<static_cast<unsigned>(rows), kBlockThreads, 0, stream>>>(skv, scale, pt, gt, dlse, ot);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchSoftmaxFwd(cudaStream_t stream, const SoftmaxArgs& a, const void* x, void* p,
                             float* lse, float* mx) {
  constexpr int kVec = 16 / sizeof(T);
  if (a.skv % kVec == 0) return LaunchSoftmaxFwdT<T, kVec>(stream, a, x, p, lse, mx);
  if (a.skv % 2 == 0) return LaunchSoftmaxFwdT<T, 2>(stream, a, x, p, lse, mx);
  return LaunchSoftmaxFwdT<T, 1>(stream, a, x, p, lse, mx);
}

template <typename T>
cudaError_t LaunchSoftmaxBwd(cudaStream_t stream, int64_t rows, int64_t skv, float scale,
                             const void* p, const void* g, const float* dlse, void* out) {
  constexpr int kVec = 16 / sizeof(T);
  if (skv % kVec == 0) return LaunchSoftmaxBwdT<T, kVec>(stream, rows, skv, scale, p, g, dlse, out);
  if (skv % 2 == 0) return LaunchSoftmaxBwdT<T, 2>(stream, rows, skv, scale, p, g, dlse, out);
  return LaunchSoftmaxBwdT<T, 1>(stream, rows, skv, scale, p, g, dlse, out);
}


// ================================================================================================
// FFI handlers
// ================================================================================================
ffi::Error SoftmaxInvalid(const std::string& m) {
  return ffi::Error::InvalidArgument("attnaux_softmax: " + m);
}

ffi::Error SoftmaxFwdImpl(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer mask,
                          float scale, int32_t causal, int64_t mask_div,
                          ffi::Result<ffi::AnyBuffer> probs, ffi::Result<ffi::AnyBuffer> lse,
                          ffi::Result<ffi::AnyBuffer> row_max) {
  const auto ld = logits.dimensions();
  if (ld.size() != 3) return SoftmaxInvalid("`logits` must have rank 3 [N, q_seq, kv_seq]; got " + BracketShape(ld) + ".");
  if (!IsFloat(logits.element_type())) return SoftmaxInvalid("`logits` must be F32, BF16 or F16.");
  SoftmaxArgs a;
  a.n = ld[0];
  a.sq = ld[1];
  a.skv = ld[2];
  a.scale = scale;
  a.causal = causal;
  if (causal < 0 || causal > 2) return SoftmaxInvalid("attribute `causal` must be 0, 1 or 2; got " + std::to_string(causal) + ".");
  if (!Absent(mask)) {
    const auto md = mask.dimensions();
    if (mask.element_type() != ffi::DataType::PRED) return SoftmaxInvalid("`mask` must be PRED (bool).");
    if (md.size() != 3) return SoftmaxInvalid("`mask` must have rank 3 [mask_n, q_seq or 1, kv_seq or 1]; got " + BracketShape(md) + ".");
    a.mask_n = md[0];
    a.mask_q = md[1];
    a.mask_kv = md[2];
    if ((a.mask_q != 1 && a.mask_q != a.sq) || (a.mask_kv != 1 && a.mask_kv != a.skv)) {
      return SoftmaxInvalid("`mask` of shape " + BracketShape(md) + " does not broadcast to logits " + BracketShape(ld) + ".");
    }
    if (mask_div < 1) return SoftmaxInvalid("attribute `mask_div` must be >= 1; got " + std::to_string(mask_div) + ".");
    if (a.n > 0 && (a.mask_n < 1 || a.n % mask_div != 0 || (a.n / mask_div) % a.mask_n != 0)) {
      return SoftmaxInvalid("`mask` leading size " + std::to_string(a.mask_n) + " with mask_div " +
                            std::to_string(mask_div) + " does not tile logits' leading size " +
                            std::to_string(a.n) + ".");
    }
    a.mask_div = mask_div;
    a.mask = static_cast<const uint8_t*>(mask.untyped_data());
  } else if (mask.element_type() != ffi::DataType::PRED) {
    return SoftmaxInvalid("the absent `mask` placeholder must be PRED (bool) of shape (0,).");
  }
  if (probs->element_type() != logits.element_type() || !SameDims(probs->dimensions(), {a.n, a.sq, a.skv})) {
    return SoftmaxInvalid("output `probs` must have logits' dtype and shape " + BracketShape(ld) + ".");
  }
  for (auto* out : {&lse, &row_max}) {
    if ((*out)->element_type() != ffi::DataType::F32 || !SameDims((*out)->dimensions(), {a.n, a.sq})) {
      return SoftmaxInvalid("outputs `lse` and `max` must be F32 of shape [N, q_seq].");
    }
  }
  const int64_t rows = a.n * a.sq;
  if (rows == 0) return ffi::Error::Success();
  if (rows / kRowWarps >= (int64_t{1} << 31) - 1 || (a.skv > 32 * kMaxRegPerLane && rows >= (int64_t{1} << 31) - 1)) {
    return SoftmaxInvalid("too many rows for one launch.");
  }
  float* lse_p = static_cast<float*>(lse->untyped_data());
  float* max_p = static_cast<float*>(row_max->untyped_data());
  return CudaResult("attnaux_softmax_fwd", DispatchT(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return LaunchSoftmaxFwd<T>(stream, a, logits.untyped_data(), probs->untyped_data(), lse_p, max_p);
  }));
}

ffi::Error SoftmaxBwdImpl(cudaStream_t stream, ffi::AnyBuffer probs, ffi::AnyBuffer dprobs,
                          ffi::AnyBuffer dlse, float scale, ffi::Result<ffi::AnyBuffer> dlogits) {
  const auto pd = probs.dimensions();
  if (pd.size() != 3) return SoftmaxInvalid("`probs` must have rank 3 [N, q_seq, kv_seq]; got " + BracketShape(pd) + ".");
  if (!IsFloat(probs.element_type())) return SoftmaxInvalid("`probs` must be F32, BF16 or F16.");
  if (dprobs.element_type() != probs.element_type() || !SameDims(dprobs.dimensions(), {pd[0], pd[1], pd[2]})) {
    return SoftmaxInvalid("`dprobs` must have the dtype and shape " + BracketShape(pd) + " of `probs`.");
  }
  if (dlse.element_type() != ffi::DataType::F32 || !SameDims(dlse.dimensions(), {pd[0], pd[1]})) {
    return SoftmaxInvalid("`dlse` must be F32 of shape [" + std::to_string(pd[0]) + ", " + std::to_string(pd[1]) +
                          "]; got " + BracketShape(dlse.dimensions()) + ".");
  }
  if (dlogits->element_type() != probs.element_type() || !SameDims(dlogits->dimensions(), {pd[0], pd[1], pd[2]})) {
    return SoftmaxInvalid("output `dlogits` must have probs' dtype and shape " + BracketShape(pd) + ".");
  }
  const int64_t rows = pd[0] * pd[1], skv = pd[2];
  if (rows == 0 || skv == 0) return ffi::Error::Success();
  return CudaResult("attnaux_softmax_bwd", DispatchT(probs.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return LaunchSoftmaxBwd<T>(stream, rows, skv, scale, probs.untyped_data(), dprobs.untyped_data(),
                               static_cast<const float*>(dlse.untyped_data()), dlogits->untyped_data());
  }));
}

}  // namespace attnaux_cuda_kernels

namespace ak = attnaux_cuda_kernels;

// attnaux_softmax_fwd on CUDA: probs, lse and max of the scaled, masked logits.
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSoftmaxFwdCuda, ak::SoftmaxFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // logits [N, Sq, Skv]
                                  .Arg<ffi::AnyBuffer>()  // mask [Mn, Sqm, Skvm] or (0,)
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("causal")
                                  .Attr<int64_t>("mask_div")
                                  .Ret<ffi::AnyBuffer>()   // probs
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Ret<ffi::AnyBuffer>(),  // max
                              {ffi::Traits::kCmdBufferCompatible});

// attnaux_softmax_bwd on CUDA: dlogits from probs and the cotangents of probs and lse.
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSoftmaxBwdCuda, ak::SoftmaxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // probs
                                  .Arg<ffi::AnyBuffer>()  // dprobs
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>(),  // dlogits (aliases probs)
                              {ffi::Traits::kCmdBufferCompatible});
