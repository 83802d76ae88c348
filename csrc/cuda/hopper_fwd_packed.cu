// `attnaux_hopper_fwd_packed`: the XLA FFI handler of attnaux's own Hopper attention forward
// (cuda/hopper_fwd_kernel.cuh) over packed sequences: q, k and v as one row of tokens each,
// every sequence attending within itself (its own causal alignment and window), tiles that no
// sequence's rows and keys share never visited. Called by `_hopper_packed.cuda_forward`
// (`varlen_attention`) with the sequences' token offsets; a one-CTA kernel before the forward
// turns them into its block table (hopper_fwd_packed_table.cuh), so every row of out, lse and
// max is written, the tokens that no sequence covers with 0, -inf, -inf.
// hopper_fwd_params.h describes the operands.
//
// A file of its own so that the dense and packed kernels compile side by side. Built only for
// sm_90a with the CUTLASS/CuTe headers (CMakeLists.txt).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "cuda/ffi_utils.cuh"
#include "cuda/hopper_fwd_kernel.cuh"
#include "cuda/hopper_fwd_operands.h"
#include "cuda/hopper_fwd_packed_table.cuh"
#include "cuda/kernels_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux_hopper {
namespace {

using attnaux_cuda_kernels::AttnInvalid;
using attnaux_cuda_kernels::CudaResult;
using attnaux_cuda_kernels::RequireHopper;
using attnaux::BracketShape;
using attnaux::SameDims;

constexpr const char* kTarget = "attnaux_hopper_fwd_packed";

ffi::Error HopperFwdPackedImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> q_offsets,
                               ffi::Buffer<ffi::S32> kv_offsets, int64_t grid,
                               int64_t block_count, int64_t max_seqlen_q, int64_t max_seqlen_kv,
                               float scale, int32_t bottom_right, int32_t has_upper, int64_t upper,
                               int32_t has_lower, int64_t lower, int32_t backward_tiles,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::F32>> lse,
                               ffi::Result<ffi::Buffer<ffi::F32>> row_max,
                               ffi::Result<ffi::Buffer<ffi::F32>> stats,
                               ffi::Result<ffi::Buffer<ffi::S32>> work) {
  if (ffi::Error bad = CheckForwardOperands(kTarget, q, k, v, *out, lse->dimensions(),
                                            row_max->dimensions());
      bad.failure()) {
    return bad;
  }
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd[0] != 1) {
    return AttnInvalid(kTarget, "q and k must be [1, tokens, heads, dim] (one packed row), got "
                                "q " + BracketShape(qd) + " and k " + BracketShape(kd) + ".");
  }
  const int64_t total_q = qd[1], q_heads = qd[2], dim = qd[3];
  const int64_t total_kv = kd[1], kv_heads = kd[2];
  const auto dtype = q.element_type();
  const auto od = q_offsets.dimensions();
  const int64_t num_seqs = od.size() == 1 ? od[0] - 1 : -1;
  if (num_seqs < 0 || !SameDims(kv_offsets.dimensions(), {num_seqs + 1})) {
    return AttnInvalid(kTarget, "q_offsets and kv_offsets must be int32 [num_seqs + 1], got " +
                                    BracketShape(od) + " and " +
                                    BracketShape(kv_offsets.dimensions()) + ".");
  }
  // work: the block table, the runs' first entries, the dQ tile bases (which the packed
  // backward reads when it takes this buffer), the tile counter (PackedWork)
  const PackedWork layout{block_count, num_seqs, PackedDqTiles(total_q, num_seqs)};
  const int64_t work_size = layout.size();
  if (block_count < 1 || !SameDims(work->dimensions(), {work_size})) {
    return AttnInvalid(kTarget, "work must be int32 [6 block_count + 4 num_seqs + 4 + "
                                "q_tokens / 64] = [" +
                                    std::to_string(work_size) + "] with block_count >= 1, got " +
                                    BracketShape(work->dimensions()) + ".");
  }
  // stats: cuDNN's ragged statistics [num_seqs, q_heads, max_seqlen_q], or [0] for none
  const bool with_stats = !attnaux::Absent(stats->dimensions());
  if (with_stats && !SameDims(stats->dimensions(), {num_seqs, q_heads, max_seqlen_q})) {
    return AttnInvalid(kTarget, "stats must be float32 [num_seqs, q_heads, max_seqlen_q] = [" +
                                    std::to_string(num_seqs) + ", " + std::to_string(q_heads) +
                                    ", " + std::to_string(max_seqlen_q) + "] or [0], got " +
                                    BracketShape(stats->dimensions()) + ".");
  }
  // (block_count bounds each run's blocks: total_q / 128 + one a run, runs 2 num_seqs + 1)
  if (block_count < total_q / 128 + 2 * num_seqs + 1) {
    return AttnInvalid(kTarget, "block_count (" + std::to_string(block_count) +
                                    ") must be at least total_q / 128 + 2 num_seqs + 1 = " +
                                    std::to_string(total_q / 128 + 2 * num_seqs + 1) + ".");
  }
  if (q_heads > 65535 || total_q > (1 << 30) || total_kv > (1 << 30) ||
      block_count * q_heads >= (int64_t(1) << 31) - 65536 || grid < 1 || grid > 65535 ||
      max_seqlen_q < 1 || max_seqlen_kv < 1 || max_seqlen_q > (1 << 30) ||
      max_seqlen_kv > (1 << 30)) {
    return AttnInvalid(kTarget, "q_heads must be at most 65535, the token counts and max_seqlen "
                                "in [1, 2^30], blocks x q_heads below 2^31 and grid (" +
                                    std::to_string(grid) + ") in [1, 65535].");
  }
  if (ffi::Error hopper = RequireHopper(kTarget); hopper.failure()) return hopper;

  FwdParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.max = row_max->typed_data();
  // q_len and kv_len are each tile's sequence's (the kernel reads them from `blocks`)
  SetGeometry(p, 1, total_q, total_kv, q_heads, kv_heads, scale, total_q, total_kv, 0,
              has_upper, upper, has_lower, lower);
  int* const work_data = work->typed_data();
  int* const forward_blocks = work_data + layout.forward_blocks();  // (ForwardOrder's copy)
  p.blocks = forward_blocks;
  p.block_count = int(block_count);
  p.bottom_right = bottom_right != 0;
  p.tile_counter = work_data + layout.tile_counter();
  p.grid = int(grid);
  p.stats = with_stats ? stats->typed_data() : nullptr;
  p.stats_rows = int(max_seqlen_q);
  if (total_q == 0 || q_heads == 0) return ffi::Error::Success();  // (nothing to write)

  PackedTableParams table{};
  table.q_offsets = q_offsets.typed_data();
  table.kv_offsets = kv_offsets.typed_data();
  table.num_seqs = int(num_seqs);
  table.total_q = int(total_q);
  table.max_seqlen_q = int(max_seqlen_q);
  table.max_seqlen_kv = int(max_seqlen_kv);
  table.blocks = work_data;
  table.block_count = int(block_count);
  table.run_start = work_data + layout.run_start();
  table.tile_counter = p.tile_counter;
  // (the backward's dQ tiles only when asked: the packed backward reads them from this buffer;
  // a forward alone leaves them unwritten and its table kernel ~0.6 us shorter)
  table.tile_base = backward_tiles != 0 ? work_data + layout.tile_base() : nullptr;
  table.tile_seq = work_data + layout.tile_seq();
  table.tile_offsets = q_offsets.typed_data();
  table.tile_max_len = int(max_seqlen_q);
  table.dq_tiles = int(layout.dq_tiles);
  table.forward_blocks = forward_blocks;
  table.has_upper = p.has_upper;
  table.upper = p.upper;
  table.has_lower = p.has_lower;
  table.lower = p.lower;
  table.bottom_right = p.bottom_right;
  PackedTableKernel<<<1, kTableThreads, 0, stream>>>(table);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaResult(kTarget, err);
  err = dtype == ffi::BF16 ? LaunchFwd<cutlass::bfloat16_t, true>(p, int(dim), stream)
                           : LaunchFwd<cutlass::half_t, true>(p, int(dim), stream);
  return CudaResult(kTarget, err);
}

}  // namespace
}  // namespace attnaux_hopper

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxHopperFwdPackedCuda, attnaux_hopper::HopperFwdPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // q [1, Tq, Hq, D]
                                  .Arg<ffi::AnyBuffer>()           // k [1, Tkv, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()           // v
                                  .Arg<ffi::Buffer<ffi::S32>>()    // q_offsets [n + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // kv_offsets [n + 1]
                                  .Attr<int64_t>("grid")
                                  .Attr<int64_t>("block_count")
                                  .Attr<int64_t>("max_seqlen_q")
                                  .Attr<int64_t>("max_seqlen_kv")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("bottom_right")
                                  .Attr<int32_t>("has_upper")
                                  .Attr<int64_t>("upper")
                                  .Attr<int32_t>("has_lower")
                                  .Attr<int64_t>("lower")
                                  .Attr<int32_t>("backward_tiles")
                                  .Ret<ffi::AnyBuffer>()           // out [1, Tq, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // lse [1, Hq, Tq]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // max [1, Hq, Tq]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // stats [n, Hq, max_q] or [0]
                                  .Ret<ffi::Buffer<ffi::S32>>(),   // work (PackedWork)
                              {ffi::Traits::kCmdBufferCompatible});
