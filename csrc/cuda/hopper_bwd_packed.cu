// `attnaux_hopper_bwd_packed`: the XLA FFI handler of attnaux's own Hopper attention backward
// (cuda/hopper_bwd_kernel.cuh) over packed sequences: q, k, v, out and dout as one row of tokens
// each, every sequence attending within itself (its own causal alignment and window). Called
// by `_hopper_packed.cuda_backward` (`varlen_attention`) with the sequences' token offsets, the
// forward's out and lse per token and their cotangents. Four kernels: the key side's block
// table and the sequences' dQ tile bases from the offsets (hopper_fwd_packed_table.cuh, the
// forward's table built from the key offsets: each run of keys in 128-key blocks, with its
// sequence's query span; skipped when the call passes the forward's work buffer, which holds
// both for self-attention), the first pass
// (hopper_bwd_preprocess.cuh: the rows' statistics, dQ's sums zeroed, dq's rows that no sequence
// covers zeroed), the main kernel (a CTA per key block of a run and kv head, adding into each
// sequence's dQ tiles of 64 rows from its `tile_base` on), and the last pass
// (hopper_bwd_postprocess.cuh: those tiles out to dq's token rows). Every row of dq, dk and dv is
// written (the tokens that no sequence covers: 0).
//
// A file of its own so that the dense and packed kernels compile side by side. Built only for
// sm_90a with the CUTLASS/CuTe headers (CMakeLists.txt).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "cuda/ffi_utils.cuh"
#include "cuda/hopper_bwd_kernel.cuh"
#include "cuda/hopper_bwd_postprocess.cuh"
#include "cuda/hopper_bwd_preprocess.cuh"
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

constexpr const char* kTarget = "attnaux_hopper_bwd_packed";

template <class Traits>
cudaError_t LaunchPacked(const BwdParams& p, const PackedTableParams* table,
                         cudaStream_t stream) {
  // (no table kernel when the forward's work buffer holds the table: `table` null)
  if (table != nullptr) PackedTableKernel<<<1, kTableThreads, 0, stream>>>(*table);
  HopperBwdPreprocess<typename Traits::Element, Traits::kHeadDim, true>
      <<<dim3(p.dq_tiles, p.q_heads, 1), kPreprocessThreads, 0, stream>>>(p);
  auto kernel = HopperBwdKernel<Traits, true>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  const KernelParams<Traits> params = MakeKernelParams<Traits>(p);
  // a CTA per table entry and kv head, the entries in the table's order (longest first)
  kernel<<<dim3(unsigned(p.block_count * p.kv_heads)), Traits::kThreads, Traits::kSmemBytes,
           stream>>>(params);
  HopperBwdPostprocess<typename Traits::Element, Traits::kHeadDim>
      <<<dim3(p.dq_tiles, p.q_heads), kPostprocessThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

ffi::Error HopperBwdPackedImpl(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
    ffi::Buffer<ffi::F32> dlse, ffi::Buffer<ffi::S32> q_offsets,
    ffi::Buffer<ffi::S32> kv_offsets, ffi::Buffer<ffi::S32> forward_work, int64_t block_count,
    int64_t max_seqlen_q, int64_t max_seqlen_kv, float scale, int32_t bottom_right,
    int32_t has_upper, int64_t upper, int32_t has_lower, int64_t lower,
    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
    ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
    ffi::Result<ffi::Buffer<ffi::F32>> stats, ffi::Result<ffi::Buffer<ffi::S32>> work) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != 1 || kd[0] != 1) {
    return AttnInvalid(kTarget, "q and k must be [1, tokens, heads, dim] (one packed row), got "
                                "q " + BracketShape(qd) + " and k " + BracketShape(kd) + ".");
  }
  const int64_t total_q = qd[1], q_heads = qd[2], dim = qd[3];
  const int64_t total_kv = kd[1], kv_heads = kd[2];
  if (kd[3] != dim || !SameDims(v.dimensions(), kd) || !SameDims(out.dimensions(), qd) ||
      !SameDims(dout.dimensions(), qd) || !SameDims(dq->dimensions(), qd) ||
      !SameDims(dk->dimensions(), kd) || !SameDims(dv->dimensions(), kd)) {
    return AttnInvalid(kTarget, "expected k, v, dk and dv of one shape [1, kv_tokens, "
                                "kv_heads, dim] and out, dout, dq of q's shape; got q " +
                                    BracketShape(qd) + ", k " + BracketShape(kd) + ", v " +
                                    BracketShape(v.dimensions()) + ", out " +
                                    BracketShape(out.dimensions()) + ", dout " +
                                    BracketShape(dout.dimensions()) + ".");
  }
  const auto dtype = q.element_type();
  if ((dtype != ffi::BF16 && dtype != ffi::F16) || k.element_type() != dtype ||
      v.element_type() != dtype || out.element_type() != dtype ||
      dout.element_type() != dtype || dq->element_type() != dtype ||
      dk->element_type() != dtype || dv->element_type() != dtype) {
    return AttnInvalid(kTarget, "q, k, v, out, dout, dq, dk and dv must share one dtype, "
                                "bfloat16 or float16.");
  }
  if (dim != 128) {
    return AttnInvalid(kTarget, "head dim must be 128, got " + std::to_string(dim) + ".");
  }
  if (kv_heads == 0 || q_heads % kv_heads != 0) {
    return AttnInvalid(kTarget, "q_heads (" + std::to_string(q_heads) +
                                    ") must be a multiple of kv_heads (" +
                                    std::to_string(kv_heads) + ").");
  }
  // dlse [1, q_heads, 0]: no lse cotangent (a symbolic zero: no zeros built and read)
  const bool with_dlse = !SameDims(dlse.dimensions(), {1, q_heads, 0});
  if (!SameDims(lse.dimensions(), {1, q_heads, total_q}) ||
      (with_dlse && !SameDims(dlse.dimensions(), {1, q_heads, total_q}))) {
    return AttnInvalid(kTarget, "lse must be [1, q_heads, q_tokens] = [1, " +
                                    std::to_string(q_heads) + ", " + std::to_string(total_q) +
                                    "] and dlse that or [1, q_heads, 0] (none), got " +
                                    BracketShape(lse.dimensions()) + " and " +
                                    BracketShape(dlse.dimensions()) + ".");
  }
  const auto od = q_offsets.dimensions();
  const int64_t num_seqs = od.size() == 1 ? od[0] - 1 : -1;
  if (num_seqs < 0 || !SameDims(kv_offsets.dimensions(), {num_seqs + 1})) {
    return AttnInvalid(kTarget, "q_offsets and kv_offsets must be int32 [num_seqs + 1], got " +
                                    BracketShape(od) + " and " +
                                    BracketShape(kv_offsets.dimensions()) + ".");
  }
  // dq_accum: [q_heads, dq_tiles, 2, 32 dim], dq_tiles a bound on the sequences' 64-row tiles
  const auto dqd = dq_accum->dimensions();
  const int64_t dq_tiles = dqd.size() == 4 ? dqd[1] : -1;
  // (PackedDqTiles: the first pass's CTAs, one a dQ tile, also reach every 64 tokens)
  if (dq_tiles < PackedDqTiles(total_q, num_seqs) ||
      !SameDims(dqd, {q_heads, dq_tiles, 2, 32 * dim})) {
    return AttnInvalid(kTarget, "dq_accum must be float32 [q_heads, dq_tiles, 2, 32 dim] with "
                                "dq_tiles >= q_tokens / 64 + num_seqs + 1 = " +
                                    std::to_string(total_q / 64 + num_seqs + 1) + ", got " +
                                    BracketShape(dqd) + ".");
  }
  const int64_t stats_seq = 64 * dq_tiles;  // the statistics by dQ tile, as dq_accum
  if (!SameDims(stats->dimensions(), {1, q_heads, 2, stats_seq})) {
    return AttnInvalid(kTarget, "stats (a work buffer) must be float32 [1, q_heads, 2, 64 "
                                "dq_tiles] = [1, " + std::to_string(q_heads) + ", 2, " +
                                    std::to_string(stats_seq) + "], got " +
                                    BracketShape(stats->dimensions()) + ".");
  }
  // work: the key side's block table, each run's first entry, the dQ tile bases, the table
  // kernel's tile counter (unused here): PackedWork. `forward_work`: [0] (build them in work),
  // or the packed forward's work buffer of a call whose two sides have the same offsets, token
  // count and max_seqlen, whose table is this one (the forward's rows are the queries, the
  // backward's the keys) and whose tile bases are the queries': then no table kernel runs.
  const PackedWork layout{block_count, num_seqs, dq_tiles};
  const int64_t work_size = layout.size();
  const bool forward_table = !attnaux::Absent(forward_work.dimensions());
  if (block_count < total_kv / 128 + 2 * num_seqs + 1 ||
      !SameDims(work->dimensions(), {work_size}) ||
      (forward_table && !SameDims(forward_work.dimensions(), {work_size}))) {
    return AttnInvalid(kTarget, "block_count must be at least kv_tokens / 128 + 2 num_seqs + 1 "
                                "= " + std::to_string(total_kv / 128 + 2 * num_seqs + 1) +
                                    " and work (and forward_work, unless [0]) int32 [6 "
                                    "block_count + 3 num_seqs + 3 + dq_tiles], got "
                                    "block_count " +
                                    std::to_string(block_count) + ", work " +
                                    BracketShape(work->dimensions()) + " and forward_work " +
                                    BracketShape(forward_work.dimensions()) + ".");
  }
  if (forward_table && (total_q != total_kv || max_seqlen_q != max_seqlen_kv)) {
    return AttnInvalid(kTarget, "a forward's work buffer (forward_work not [0]) needs the same "
                                "token count and max_seqlen on both sides, got q_tokens " +
                                    std::to_string(total_q) + ", kv_tokens " +
                                    std::to_string(total_kv) + ", max_seqlen_q " +
                                    std::to_string(max_seqlen_q) + ", max_seqlen_kv " +
                                    std::to_string(max_seqlen_kv) + ".");
  }
  if (q_heads > 65535 || total_q > (1 << 30) || total_kv > (1 << 30) ||
      block_count * kv_heads > INT32_MAX || 64 * dq_tiles > INT32_MAX ||
      max_seqlen_q < 1 || max_seqlen_kv < 1 || max_seqlen_q > (1 << 30) ||
      max_seqlen_kv > (1 << 30)) {
    return AttnInvalid(kTarget, "q_heads must be at most 65535, the token counts and max_seqlen "
                                "in [1, 2^30], and block_count x kv_heads and 64 dq_tiles below "
                                "2^31.");
  }
  if (ffi::Error hopper = RequireHopper(kTarget); hopper.failure()) return hopper;

  BwdParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.dlse = with_dlse ? dlse.typed_data() : nullptr;
  p.stats = stats->typed_data();
  p.dq_accum = dq_accum->typed_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  // q_len, kv_len and the causal offset are each CTA's sequence's (the kernel reads them from
  // the table)
  SetGeometry(p, 1, total_q, total_kv, q_heads, kv_heads, scale, total_q, total_kv, 0,
              has_upper, upper, has_lower, lower);
  p.dq_tiles = int(dq_tiles);
  p.stats_seq = int(stats_seq);
  p.q_offsets = q_offsets.typed_data();
  p.num_seqs = int(num_seqs);
  p.max_seqlen_q = int(max_seqlen_q);
  int* const work_data = work->typed_data();
  int* const tables = forward_table ? const_cast<int*>(forward_work.typed_data()) : work_data;
  p.blocks = tables;
  p.block_count = int(block_count);
  p.tile_base = tables + layout.tile_base();
  p.tile_seq = tables + layout.tile_seq();
  p.bottom_right = bottom_right != 0;
  if (q_heads == 0) return ffi::Error::Success();  // (every array empty)
  if (total_q == 0) {  // no query: dK and dV are 0 (dq is empty)
    cudaError_t err = cudaMemsetAsync(p.dk, 0, dk->size_bytes(), stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(p.dv, 0, dv->size_bytes(), stream);
    return CudaResult(kTarget, err);
  }
  if (total_kv == 0) {  // no key: dQ is 0 (dk and dv are empty)
    return CudaResult(kTarget, cudaMemsetAsync(p.dq, 0, dq->size_bytes(), stream));
  }

  // the forward's table, built from the key side: a run's rows are keys, its "keys" the
  // sequence's queries (hopper_fwd_packed_table.cuh)
  PackedTableParams table{};
  table.q_offsets = kv_offsets.typed_data();
  table.kv_offsets = q_offsets.typed_data();
  table.num_seqs = int(num_seqs);
  table.total_q = int(total_kv);
  table.max_seqlen_q = int(max_seqlen_kv);
  table.max_seqlen_kv = int(max_seqlen_q);
  table.blocks = work_data;
  table.block_count = int(block_count);
  table.run_start = work_data + layout.run_start();
  table.tile_counter = work_data + layout.tile_counter();
  table.tile_base = work_data + layout.tile_base();
  table.tile_seq = work_data + layout.tile_seq();
  table.tile_offsets = q_offsets.typed_data();
  table.tile_max_len = int(max_seqlen_q);
  table.dq_tiles = int(dq_tiles);
  static_assert(kTableRows == BwdTraits<cutlass::bfloat16_t, 128>::kBlockN,
                "the table's blocks are the kernel's key blocks");
  static_assert(kDqTileRows == BwdTraits<cutlass::bfloat16_t, 128>::kBlockM &&
                    kDqTileRows == kPreprocessRows,
                "the tile bases count the kernel's query tiles");
  const PackedTableParams* own = forward_table ? nullptr : &table;
  const cudaError_t err =
      dtype == ffi::BF16 ? LaunchPacked<BwdTraits<cutlass::bfloat16_t, 128>>(p, own, stream)
                         : LaunchPacked<BwdTraits<cutlass::half_t, 128>>(p, own, stream);
  return CudaResult(kTarget, err);
}

}  // namespace
}  // namespace attnaux_hopper

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxHopperBwdPackedCuda, attnaux_hopper::HopperBwdPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // q [1, Tq, Hq, D]
                                  .Arg<ffi::AnyBuffer>()           // k [1, Tkv, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()           // v
                                  .Arg<ffi::AnyBuffer>()           // out [1, Tq, Hq, D]
                                  .Arg<ffi::AnyBuffer>()           // dout
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lse [1, Hq, Tq]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // dlse
                                  .Arg<ffi::Buffer<ffi::S32>>()    // q_offsets [n + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // kv_offsets [n + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // forward_work: [0] or the fwd's
                                  .Attr<int64_t>("block_count")
                                  .Attr<int64_t>("max_seqlen_q")
                                  .Attr<int64_t>("max_seqlen_kv")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("bottom_right")
                                  .Attr<int32_t>("has_upper")
                                  .Attr<int64_t>("upper")
                                  .Attr<int32_t>("has_lower")
                                  .Attr<int64_t>("lower")
                                  .Ret<ffi::AnyBuffer>()           // dq [1, Tq, Hq, D]
                                  .Ret<ffi::AnyBuffer>()           // dk [1, Tkv, Hkv, D]
                                  .Ret<ffi::AnyBuffer>()           // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()    // dq_accum [Hq,tiles,2,32D]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // stats [1,Hq,2,64 tiles] (work)
                                  .Ret<ffi::Buffer<ffi::S32>>(),   // work (PackedWork)
                              {ffi::Traits::kCmdBufferCompatible});
