// `attnaux_hopper_fwd`: the XLA FFI handler of attnaux's own Hopper attention forward
// (cuda/hopper_fwd_kernel.cuh): out, lse and max of plain scores (scale, causal / window
// geometry, GQA) at head dims 64, 128 and 256 in bfloat16 or float16. Called by
// `_flash_hopper.forward` when its config asks for it; see hopper_fwd_params.h for the operands'
// layouts.
//
// Built only for sm_90a, and only when the CUTLASS/CuTe headers were found (CMakeLists.txt);
// the handler refuses another GPU with an error naming the device it found.
#include <algorithm>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "cuda/ffi_utils.cuh"
#include "cuda/hopper_fwd_kernel.cuh"
#include "cuda/hopper_fwd_operands.h"
#include "cuda/kernels_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux_hopper {
namespace {

using attnaux_cuda_kernels::AttnInvalid;
using attnaux_cuda_kernels::CudaResult;
using attnaux_cuda_kernels::RequireHopper;
using attnaux::BracketShape;

constexpr const char* kTarget = "attnaux_hopper_fwd";

ffi::Error HopperFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::Buffer<ffi::S32> schedule, int64_t grid,
                         float scale, int64_t q_len, int64_t kv_len,
                         int64_t offset, int32_t has_upper, int64_t upper, int32_t has_lower,
                         int64_t lower, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Buffer<ffi::F32>> lse,
                         ffi::Result<ffi::Buffer<ffi::F32>> row_max) {
  if (ffi::Error bad = CheckForwardOperands(kTarget, q, k, v, *out, lse->dimensions(),
                                            row_max->dimensions());
      bad.failure()) {
    return bad;
  }
  const auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t bsz = qd[0], q_seq = qd[1], q_heads = qd[2], dim = qd[3];
  const int64_t kv_seq = kd[1], kv_heads = kd[2];
  const auto dtype = q.element_type();
  if (q_seq % 128 != 0 || kv_seq % 128 != 0) {
    return AttnInvalid(kTarget, "q_seq and kv_seq must be multiples of 128 (padded), got " +
                                    std::to_string(q_seq) + " and " + std::to_string(kv_seq) + ".");
  }
  if (bsz > 65535 || q_heads > 65535 || q_seq > (1 << 30) || kv_seq > (1 << 30)) {
    return AttnInvalid(kTarget, "batch and q_heads must be at most 65535 and the sequences "
                                "at most 2^30 (grid and int32 positions).");
  }
  const auto sd = schedule.dimensions();
  if (sd.size() != 1 || grid < 1 || grid > 65535 || sd[0] < grid + 1 ||
      sd[0] - grid - 1 > (int64_t(1) << 30)) {
    return AttnInvalid(kTarget, "schedule must be int32 [grid + 1 + tiles] with grid (" +
                                    std::to_string(grid) + ") in [1, 65535], got " +
                                    BracketShape(sd) + ".");
  }
  if (ffi::Error hopper = RequireHopper(kTarget); hopper.failure()) return hopper;

  FwdParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.max = row_max->typed_data();
  SetGeometry(p, bsz, q_seq, kv_seq, q_heads, kv_heads, scale, q_len, kv_len, offset, has_upper,
              upper, has_lower, lower);
  p.schedule = schedule.typed_data();
  p.grid = int(grid);
  p.schedule_tiles = int(sd[0] - grid - 1);
  if (bsz == 0 || q_seq == 0 || q_heads == 0) return ffi::Error::Success();
  cudaError_t launch =
      dtype == ffi::BF16
          ? LaunchFwd<cutlass::bfloat16_t, false>(p, int(dim), stream)
          : LaunchFwd<cutlass::half_t, false>(p, int(dim), stream);
  return CudaResult(kTarget, launch);
}

}  // namespace
}  // namespace attnaux_hopper

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxHopperFwdCuda, attnaux_hopper::HopperFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // q [B, Sq, Hq, D]
                                  .Arg<ffi::AnyBuffer>()           // k [B, Skv, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()           // v
                                  .Arg<ffi::Buffer<ffi::S32>>()    // schedule
                                  .Attr<int64_t>("grid")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("q_len")
                                  .Attr<int64_t>("kv_len")
                                  .Attr<int64_t>("offset")
                                  .Attr<int32_t>("has_upper")
                                  .Attr<int64_t>("upper")
                                  .Attr<int32_t>("has_lower")
                                  .Attr<int64_t>("lower")
                                  .Ret<ffi::AnyBuffer>()           // out [B, Sq, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // lse [B, Hq, Sq]
                                  .Ret<ffi::Buffer<ffi::F32>>(),   // max [B, Hq, Sq]
                              {ffi::Traits::kCmdBufferCompatible});
