// Host helpers of the CUDA kernels' XLA FFI handlers: dtype dispatch, CUDA errors as FFI errors,
// and the operands and attributes that the attention handlers (small_seq.cu, probs_softmax.cu)
// bind in the order of docs/kernel_abi.md.
#ifndef ATTNAUX_CSRC_CUDA_FFI_UTILS_CUH_
#define ATTNAUX_CSRC_CUDA_FFI_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "common/ffi_shapes.h"
#include "xla/ffi/api/ffi.h"

namespace attnaux_cuda_kernels {

namespace ffi = xla::ffi;

using attnaux::Absent;
using attnaux::BracketShape;
using attnaux::IsFloat;
using attnaux::SameDims;

template <typename Fn>
cudaError_t DispatchT(ffi::DataType t, const Fn& fn) {
  switch (t) {
    case ffi::DataType::BF16: return fn(__nv_bfloat16{});
    case ffi::DataType::F16: return fn(__half{});
    default: return fn(float{});
  }
}

inline ffi::Error CudaResult(const char* target, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(target) + ": CUDA error: " + cudaGetErrorString(err));
}

inline ffi::Error AttnInvalid(const char* target, const std::string& m) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + m);
}

// Refuses any GPU but Hopper (sm_90), for the kernels built for sm_90a alone, with an error
// naming the compute capability found; a CUDA error on the way is reported as such.
inline ffi::Error RequireHopper(const char* target) {
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  }
  if (err != cudaSuccess) return CudaResult(target, err);
  if (major != 9 || minor != 0) {
    return AttnInvalid(target, "needs a Hopper GPU (sm_90), found compute capability " +
                                   std::to_string(major) + "." + std::to_string(minor) + ".");
  }
  return ffi::Error::Success();
}

}  // namespace attnaux_cuda_kernels

// Every handler of attnaux's own CUDA kernels only launches kernels on XLA's stream, with no
// allocation and no host synchronisation, so it is marked command-buffer compatible
// (ffi::Traits::kCmdBufferCompatible): XLA may capture it into the
// CUDA graph of the surrounding kernels instead of splitting the graph around it (which cost tens
// of microseconds per call for small attention problems).

// Inputs 0..10 of the attention ABI, all bound untyped (common/attention_validate.cc checks
// their dtypes under ValidationRules::kCuda), then the attributes.
#define ATTNAUX_CUDA_ATTENTION_INPUTS                                                          \
  .Arg<ffi::AnyBuffer>()      /* q */                                                          \
      .Arg<ffi::AnyBuffer>()  /* k */                                                          \
      .Arg<ffi::AnyBuffer>()  /* v */                                                          \
      .Arg<ffi::AnyBuffer>()  /* bias */                                                       \
      .Arg<ffi::AnyBuffer>()  /* mask */                                                       \
      .Arg<ffi::AnyBuffer>()  /* q_seqlens */                                                  \
      .Arg<ffi::AnyBuffer>()  /* kv_seqlens */                                                 \
      .Arg<ffi::AnyBuffer>()  /* q_segment_ids */                                              \
      .Arg<ffi::AnyBuffer>()  /* kv_segment_ids */                                             \
      .Arg<ffi::AnyBuffer>()  /* sink */                                                       \
      .Arg<ffi::AnyBuffer>()  /* rng_state */

#define ATTNAUX_CUDA_ATTENTION_ATTRS                                                           \
  .Attr<float>("scale")                                                                        \
      .Attr<float>("softcap")                                                                  \
      .Attr<int32_t>("causal")                                                                 \
      .Attr<int64_t>("window_left")                                                            \
      .Attr<int64_t>("window_right")                                                           \
      .Attr<float>("dropout_rate")

#endif  // ATTNAUX_CSRC_CUDA_FFI_UTILS_CUH_
