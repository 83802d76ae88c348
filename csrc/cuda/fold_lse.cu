// `attnaux_fold_lse` on CUDA: the lse cotangent folded into the O (and dO) that cuDNN's backward
// reads, in one pass (the semantics of `_flash_cudnn.fold_lse_cotangent`, which stays the
// reference): per row of out/dout [rows, dv] (bfloat16) and dlse [rows] (float32),
//
//   norm2 = |dO|^2,  D = rowsum(dO * O)                  (float32)
//   dlse != 0 and norm2 > kMinNorm2:  O' = O - (dlse / norm2) dO,  dO' = dO
//   dlse != 0 and norm2 <= kMinNorm2: O'[0] = (D - dlse) / kEps (rest O), dO' = kEps e_0
//   dlse == 0:                        O' = O, dO' = dO
//
// so that cuDNN's row term rowsum(dO' * O') is D - dlse. dO' aliases dO and only the rare rows of
// the second case are written: the pass reads O and dO once and writes O' (the XLA fusion of the
// reference read them twice and wrote both O' and dO').
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/ffi_utils.cuh"
#include "cuda/kernels_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux_cuda_kernels {
namespace {

constexpr float kMinNorm2 = 1e-30f;  // as _FOLD_MIN_NORM2
constexpr float kEps = 8.673617379884035e-19f;  // 2**-60, as _FOLD_EPS
constexpr int kRowsPerBlock = 4;  // one warp per row

__global__ void FoldLseKernel(const __nv_bfloat162* out, __nv_bfloat162* dout, const float* dlse,
                              __nv_bfloat162* out_f, int64_t rows, int64_t pairs) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y;
  if (row >= rows) return;
  const int lane = threadIdx.x;
  const __nv_bfloat162* o = out + row * pairs;
  __nv_bfloat162* d = dout + row * pairs;
  __nv_bfloat162* of = out_f + row * pairs;
  const float g = dlse[row];
  float norm2 = 0.0f, row_term = 0.0f;
  for (int64_t p = lane; p < pairs; p += 32) {
    const float2 dv = __bfloat1622float2(d[p]);
    const float2 ov = __bfloat1622float2(o[p]);
    norm2 += dv.x * dv.x + dv.y * dv.y;
    row_term += dv.x * ov.x + dv.y * ov.y;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    norm2 += __shfl_xor_sync(0xffffffffu, norm2, offset);
    row_term += __shfl_xor_sync(0xffffffffu, row_term, offset);
  }
  const bool carried = g != 0.0f;
  const bool stuck = carried && norm2 <= kMinNorm2;
  if (!stuck) {
    const float gamma = carried ? g / norm2 : 0.0f;
    for (int64_t p = lane; p < pairs; p += 32) {
      const float2 dv = __bfloat1622float2(d[p]);
      const float2 ov = __bfloat1622float2(o[p]);
      of[p] = __floats2bfloat162_rn(ov.x - gamma * dv.x, ov.y - gamma * dv.y);
    }
    return;
  }
  // dO is (numerically) 0: the row carries dlse through column 0 alone.
  for (int64_t p = lane; p < pairs; p += 32) {
    if (p == 0) {
      const float2 ov = __bfloat1622float2(o[0]);
      of[0] = __floats2bfloat162_rn((row_term - g) / kEps, ov.y);
      d[0] = __floats2bfloat162_rn(kEps, 0.0f);
    } else {
      of[p] = o[p];
      d[p] = __floats2bfloat162_rn(0.0f, 0.0f);
    }
  }
}

ffi::Error FoldLseImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> out,
                       ffi::Buffer<ffi::BF16> dout, ffi::Buffer<ffi::F32> dlse,
                       ffi::Result<ffi::Buffer<ffi::BF16>> out_f,
                       ffi::Result<ffi::Buffer<ffi::BF16>> dout_f) {
  const char* target = "attnaux_fold_lse";
  const auto dims = out.dimensions();
  if (dims.size() < 1) return AttnInvalid(target, "out must have a trailing head dim.");
  const int64_t dv = dims[dims.size() - 1];
  const int64_t rows = dv == 0 ? 0 : static_cast<int64_t>(out.element_count()) / dv;
  bool same_shape = dout.dimensions().size() == dims.size();
  for (size_t i = 0; same_shape && i < dims.size(); ++i) same_shape = dout.dimensions()[i] == dims[i];
  if (!same_shape) return AttnInvalid(target, "dout must have out's shape.");
  if (static_cast<int64_t>(dlse.element_count()) != rows) {
    return AttnInvalid(target, "dlse must have one float32 per row of out (" +
                                   std::to_string(rows) + "), got " +
                                   std::to_string(dlse.element_count()) + ".");
  }
  if (dv % 2 != 0) {
    return AttnInvalid(target, "the head dim of out must be even, got " + std::to_string(dv) + ".");
  }
  if (dout_f->untyped_data() != dout.untyped_data()) {
    return AttnInvalid(target, "dout' must alias dout (input_output_aliases={1: 1}).");
  }
  if (rows == 0) return ffi::Error::Success();
  const dim3 block(32, kRowsPerBlock);
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks > 0x7fffffff) return AttnInvalid(target, "too many rows.");
  FoldLseKernel<<<static_cast<unsigned>(blocks), block, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat162*>(out.untyped_data()),
      reinterpret_cast<__nv_bfloat162*>(dout_f->untyped_data()), dlse.typed_data(),
      reinterpret_cast<__nv_bfloat162*>(out_f->untyped_data()), rows, dv / 2);
  return CudaResult(target, cudaGetLastError());
}

}  // namespace
}  // namespace attnaux_cuda_kernels

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxFoldLseCuda, attnaux_cuda_kernels::FoldLseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // out [..., dv]
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // dout [..., dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // dlse [...]
                                  .Ret<ffi::Buffer<ffi::BF16>>()   // out'
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // dout' (aliases dout)
                              {ffi::Traits::kCmdBufferCompatible});
