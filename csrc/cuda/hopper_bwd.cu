// `attnaux_hopper_bwd`: the XLA FFI handler of attnaux's own Hopper attention backward
// (cuda/hopper_bwd_kernel.cuh). Called by `_flash_hopper.backward` for plain scores (scale,
// causal / window geometry, GQA) at head dim 128 in bfloat16 or float16 when its config asks
// for it and XLA was not asked for deterministic results; see hopper_bwd_params.h for the
// operands' layouts.
//
// Built only for sm_90a, and only when the CUTLASS/CuTe headers were found (CMakeLists.txt);
// the handler refuses another GPU with an error naming the device it found.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "cuda/ffi_utils.cuh"
#include "cuda/hopper_bwd_kernel.cuh"
#include "cuda/hopper_bwd_preprocess.cuh"
#include "cuda/kernels_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux_hopper {
namespace {

using attnaux_cuda_kernels::AttnInvalid;
using attnaux_cuda_kernels::CudaResult;
using attnaux_cuda_kernels::RequireHopper;
using Dims = attnaux::Dims;
using attnaux::BracketShape;
using attnaux::SameDims;

constexpr const char* kTarget = "attnaux_hopper_bwd";

template <class Traits>
cudaError_t Launch(const BwdParams& p, cudaStream_t stream) {
  // the rows' statistics and the zeroed dQ sums, then the main kernel
  HopperBwdPreprocess<typename Traits::Element, Traits::kHeadDim, false>
      <<<dim3(p.dq_tiles, p.q_heads, p.batch), kPreprocessThreads, 0, stream>>>(p);
  auto kernel = HopperBwdKernel<Traits, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  // the TMA descriptors of this call's tensors, passed as a __grid_constant__ parameter
  KernelParams<Traits> params = MakeKernelParams<Traits>(p);
  // sections of (batch, kv head) pairs whose Q, dO and dQ sums fit in 40 MiB of the H100's 50
  // MiB L2 (FlashAttention-3's choice), a power of 2
  const int pairs = p.batch * p.kv_heads;
  const int64_t pair_bytes = int64_t(p.q_heads / p.kv_heads) * p.q_seq * Traits::kHeadDim *
                             (2 * sizeof(typename Traits::Element) + sizeof(float));
  int section = 1;
  while (section * 2 <= pairs && section * 2 * pair_bytes <= (int64_t(40) << 20)) section *= 2;
  params.p.section = section;
  const int64_t ctas = int64_t(p.kv_seq / Traits::kBlockN) * pairs;
  kernel<<<dim3(unsigned(ctas)), Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

ffi::Error HopperBwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer dout,
                         ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dlse, float scale, int64_t q_len, int64_t kv_len, int64_t offset,
                         int32_t has_upper, int64_t upper, int32_t has_lower, int64_t lower,
                         ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                         ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                         ffi::Result<ffi::Buffer<ffi::F32>> stats) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) {
    return AttnInvalid(kTarget, "q and k must be [batch, seq, heads, dim], got q " +
                                    BracketShape(qd) + " and k " + BracketShape(kd) + ".");
  }
  const int64_t bsz = qd[0], q_seq = qd[1], q_heads = qd[2], dim = qd[3];
  const int64_t kv_seq = kd[1], kv_heads = kd[2];
  if (kd[0] != bsz || kd[3] != dim || !SameDims(v.dimensions(), kd) ||
      !SameDims(out.dimensions(), qd) || !SameDims(dout.dimensions(), qd)) {
    return AttnInvalid(kTarget, "expected k and v of one shape [batch, kv_seq, kv_heads, dim] "
                                "matching q's batch and dim, and out and dout of q's shape; got "
                                "q " + BracketShape(qd) + ", k " + BracketShape(kd) + ", v " +
                                    BracketShape(v.dimensions()) + ", out " +
                                    BracketShape(out.dimensions()) + ", dout " +
                                    BracketShape(dout.dimensions()) + ".");
  }
  const auto dtype = q.element_type();
  if ((dtype != ffi::BF16 && dtype != ffi::F16) || k.element_type() != dtype ||
      v.element_type() != dtype || out.element_type() != dtype ||
      dout.element_type() != dtype || dk->element_type() != dtype ||
      dv->element_type() != dtype) {
    return AttnInvalid(kTarget, "q, k, v, out, dout, dk and dv must share one dtype, bfloat16 "
                                "or float16.");
  }
  if (dim != 128) {
    return AttnInvalid(kTarget, "head dim must be 128, got " + std::to_string(dim) + ".");
  }
  if (q_seq % 64 != 0 || kv_seq % 128 != 0) {
    return AttnInvalid(kTarget, "q_seq must be a multiple of 64 and kv_seq of 128 (padded), got " +
                                    std::to_string(q_seq) + " and " + std::to_string(kv_seq) + ".");
  }
  if (kv_heads == 0 || q_heads % kv_heads != 0) {
    return AttnInvalid(kTarget, "q_heads (" + std::to_string(q_heads) +
                                    ") must be a multiple of kv_heads (" +
                                    std::to_string(kv_heads) + ").");
  }
  const int64_t want_rows[3] = {bsz, q_heads, q_seq};
  if (!SameDims(lse.dimensions(), Dims(want_rows, 3)) ||
      !SameDims(dlse.dimensions(), Dims(want_rows, 3))) {
    return AttnInvalid(kTarget, "lse and dlse must be [batch, q_heads, q_seq] = " +
                                    BracketShape(Dims(want_rows, 3)) + ", got " +
                                    BracketShape(lse.dimensions()) + " and " +
                                    BracketShape(dlse.dimensions()) + ".");
  }
  const int64_t want_stats[4] = {bsz, q_heads, 2, q_seq};
  if (!SameDims(stats->dimensions(), Dims(want_stats, 4))) {
    return AttnInvalid(kTarget, "stats (the rows' statistics, a work buffer) must be [batch, "
                                "q_heads, 2, q_seq] = " + BracketShape(Dims(want_stats, 4)) +
                                    ", got " + BracketShape(stats->dimensions()) + ".");
  }
  const int64_t want_dq[5] = {bsz, q_heads, q_seq / 64, 2, 32 * dim};
  if (!SameDims(dq_accum->dimensions(), Dims(want_dq, 5)) ||
      !SameDims(dk->dimensions(), kd) || !SameDims(dv->dimensions(), kd)) {
    return AttnInvalid(kTarget, "dq_accum must be [batch, q_heads, q_seq / 64, 2, 32 dim] = " +
                                    BracketShape(Dims(want_dq, 5)) + " (got " +
                                    BracketShape(dq_accum->dimensions()) +
                                    ") and dk, dv of k's shape.");
  }
  if (bsz > 65535 || q_heads > 65535 || q_seq > (1 << 30) || kv_seq > (1 << 30) ||
      (kv_seq / 128) * bsz * kv_heads > INT32_MAX) {
    return AttnInvalid(kTarget, "batch and q_heads must be at most 65535, the sequences at "
                                "most 2^30 and (kv_seq / 128) * batch * kv_heads at most 2^31 - "
                                "1 (grids and int32 positions), got batch " +
                                    std::to_string(bsz) + ", q_heads " + std::to_string(q_heads) +
                                    ", kv_heads " + std::to_string(kv_heads) + ", q_seq " +
                                    std::to_string(q_seq) + ", kv_seq " + std::to_string(kv_seq) +
                                    ".");
  }
  if (ffi::Error hopper = RequireHopper(kTarget); hopper.failure()) return hopper;

  BwdParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.dlse = dlse.typed_data();
  p.stats = stats->typed_data();
  p.dq_accum = dq_accum->typed_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  SetGeometry(p, bsz, q_seq, kv_seq, q_heads, kv_heads, scale, q_len, kv_len, offset, has_upper,
              upper, has_lower, lower);
  p.dq_tiles = int(q_seq / 64);
  p.stats_seq = int(q_seq);

  if (bsz == 0 || q_heads == 0) return ffi::Error::Success();  // (every array empty)
  if (q_seq == 0) {  // no query: dK and dV are 0 (dq_accum is empty)
    cudaError_t err = cudaMemsetAsync(p.dk, 0, dk->size_bytes(), stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(p.dv, 0, dv->size_bytes(), stream);
    return CudaResult(kTarget, err);
  }
  if (kv_seq == 0) {  // no key: dQ is 0 (dk and dv are empty)
    return CudaResult(kTarget, cudaMemsetAsync(p.dq_accum, 0,
                                               sizeof(float) * dq_accum->element_count(),
                                               stream));
  }
  // the first pass zeroes dq_accum, into which every key block's CTA adds its dS K
  const cudaError_t err = dtype == ffi::BF16 ? Launch<BwdTraits<cutlass::bfloat16_t, 128>>(p, stream)
                           : Launch<BwdTraits<cutlass::half_t, 128>>(p, stream);
  return CudaResult(kTarget, err);
}

}  // namespace
}  // namespace attnaux_hopper

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxHopperBwdCuda, attnaux_hopper::HopperBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // q [B, Sq, Hq, D]
                                  .Arg<ffi::AnyBuffer>()           // k [B, Skv, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()           // v
                                  .Arg<ffi::AnyBuffer>()           // out [B, Sq, Hq, D]
                                  .Arg<ffi::AnyBuffer>()           // dout [B, Sq, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lse [B, Hq, Sq]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // dlse [B, Hq, Sq]
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("q_len")
                                  .Attr<int64_t>("kv_len")
                                  .Attr<int64_t>("offset")
                                  .Attr<int32_t>("has_upper")
                                  .Attr<int64_t>("upper")
                                  .Attr<int32_t>("has_lower")
                                  .Attr<int64_t>("lower")
                                  .Ret<ffi::Buffer<ffi::F32>>()    // dq_accum [B,Hq,Sq/64,2,32D]
                                  .Ret<ffi::AnyBuffer>()           // dk [B, Skv, Hkv, D]
                                  .Ret<ffi::AnyBuffer>()           // dv
                                  .Ret<ffi::Buffer<ffi::F32>>(),   // stats [B, Hq, 2, Sq] (work)
                              {ffi::Traits::kCmdBufferCompatible});
