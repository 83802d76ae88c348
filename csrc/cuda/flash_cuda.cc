// XLA FFI handlers of the `flash` primitive on NVIDIA GPUs: validate, look the cuDNN graph up in
// the cache (cudnn_graphs.h), run it on XLA's stream.
//
// cuDNN's workspace comes from XLA's FFI scratch allocator. XLA accepts alignments up to 16 bytes
// there (a request for more is refused with "Unsupported alignment", which is why an earlier
// version that asked for 256 saw every allocation fail); cuDNN wants 256-byte aligned workspace,
// so the handler asks for 255 bytes more with alignment 16 and rounds the pointer up. A workspace
// output buffer of sufficient size, when the Python layer passes one
// (ATTNAUX_CUDNN_WORKSPACE=output), is used instead.
//
// The handlers are NOT declared compatible with command buffers (CUDA graphs): they may build a
// cuDNN plan on first use and take a host mutex, so XLA runs them as ordinary thunks.
#include "cuda/flash_cuda.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/ffi_shapes.h"
#include "cuda/cudnn_graphs.h"
#include "xla/ffi/api/ffi.h"

// The frontend's dynamic-loading mode reads libcudnn's handle from here (cudnn_graphs.h sets it).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace ffi = xla::ffi;

namespace attnaux_cuda {
namespace {

using attnaux::Absent;
using attnaux::Dims;
using attnaux::ExpectShape;  // "<target>: <name> must have shape ..., got ...."
using attnaux::Shape;


ffi::Error Invalid(const std::string& target, const std::string& what) {
  return ffi::Error::InvalidArgument(target + ": " + what);
}

ffi::Error CudaError(const std::string& target, const char* what, cudaError_t e) {
  return ffi::Error::Internal(target + ": " + what + " failed: " + CudaErrorString(e));
}

// The token counts of a call in the packed layout; the padded sizes otherwise (what the [B, S]
// dims of q/out and k/v hold).
struct Rows {
  int64_t q = 0, kv = 0;
};

// Shapes shared by the forward and the backward; fills the static part of `c`. In the packed
// (ragged) layout q, k and v are [1, tokens, H, D], the number of sequences is the length of
// q_seqlens and the padded sizes are the attributes max_seqlen_q / max_seqlen_kv; `offsets` holds
// the element offsets of each sequence in q, k, v and out (rows 0-3, int32 [4, >= B + 1]). The
// offsets and lengths are data: the Python layer clamps them so that every sequence lies inside
// its tensor (docs/kernel_abi.md).
ffi::Error CommonChecks(const std::string& target, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> q_seqlens,
                        ffi::Buffer<ffi::S32> kv_seqlens, ffi::Buffer<ffi::U32> rng_state,
                        ffi::Buffer<ffi::S32> offsets, float scale, int32_t causal,
                        int64_t window_left, int64_t window_right, int32_t padding, float softcap,
                        float dropout_rate, int32_t ragged, int64_t max_seqlen_q,
                        int64_t max_seqlen_kv, AttnConfig* c, Rows* rows) {
  const ffi::DataType t = q.element_type();
  if (t != ffi::DataType::BF16 && t != ffi::DataType::F16) {
    return Invalid(target, "q, k and v must be bfloat16 or float16 (cuDNN fused attention).");
  }
  if (k.element_type() != t || v.element_type() != t) {
    return Invalid(target, "q, k and v must share one dtype.");
  }
  Dims qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return Invalid(target, "q, k and v must be [B, S, H, D]; got q " + Shape(qd) + ", k " +
                               Shape(kd) + ", v " + Shape(vd) + ".");
  }
  c->dtype = t == ffi::DataType::BF16 ? 0 : 1;
  c->b = qd[0];
  c->sq = qd[1];
  c->hq = qd[2];
  c->d = qd[3];
  c->skv = kd[1];
  c->hk = kd[2];
  c->dv = vd[3];
  if (auto e = ExpectShape(target, "k", kd, {c->b, c->skv, c->hk, c->d}); e.failure()) return e;
  if (auto e = ExpectShape(target, "v", vd, {c->b, c->skv, c->hk, c->dv}); e.failure()) return e;
  rows->q = c->sq;
  rows->kv = c->skv;
  c->ragged = ragged != 0;
  if (c->ragged) {
    if (c->b != 1) {
      return Invalid(target, "packed sequences take q, k and v as [1, tokens, H, D]; got q " +
                                 Shape(qd) + ".");
    }
    const Dims sd = q_seqlens.dimensions();
    const Dims od = offsets.dimensions();
    if (sd.size() != 1 || sd[0] < 1) {
      return Invalid(target, "packed sequences need q_seqlens [num_seqs >= 1]; got " +
                                 Shape(sd) + ".");
    }
    c->b = sd[0];
    if (od.size() != 2 || od[0] != 4 || od[1] < c->b + 1) {
      return Invalid(target, "offsets must be int32 [4, >= num_seqs + 1] = [4, >= " +
                                 std::to_string(c->b + 1) + "]; got " + Shape(od) + ".");
    }
    if (max_seqlen_q < 1 || max_seqlen_kv < 1) {
      return Invalid(target, "max_seqlen_q and max_seqlen_kv must be >= 1.");
    }
    if (padding == 0) return Invalid(target, "packed sequences need padding=1 (the lengths).");
    c->total_q = qd[1];  // the backward's accumulators are sized by the tokens
    c->total_kv = kd[1];
    c->sq = max_seqlen_q;
    c->skv = max_seqlen_kv;
  }
  if (c->b <= 0 || c->sq <= 0 || c->skv <= 0 || c->hq <= 0 || c->hk <= 0) {
    return Invalid(target, "zero-sized problems are handled in Python and never reach cuDNN.");
  }
  if (c->hq % c->hk != 0) {
    return Invalid(target, "the number of query heads must be a multiple of the kv heads.");
  }
  if (c->d % 8 != 0 || c->dv % 8 != 0 || c->d <= 0 || c->dv <= 0 || c->d > 256 || c->dv > 256) {
    return Invalid(target, "head dims must be multiples of 8 in [8, 256]; got qk_dim " +
                               std::to_string(c->d) + ", v_dim " + std::to_string(c->dv) + ".");
  }
  Dims bd = bias.dimensions();
  if (c->ragged && !Absent(bd)) return Invalid(target, "packed sequences take no bias.");
  if (Absent(bd)) {
    c->bias_b = c->bias_h = 0;
  } else {
    if (bd.size() != 4 || (bd[0] != 1 && bd[0] != c->b) || (bd[1] != 1 && bd[1] != c->hq) ||
        bd[2] != c->sq || bd[3] != c->skv) {
      return Invalid(target, "bias must be [1|B, 1|Hq, Sq, Skv] = [1|" + std::to_string(c->b) +
                                 ", 1|" + std::to_string(c->hq) + ", " + std::to_string(c->sq) +
                                 ", " + std::to_string(c->skv) + "] or (0,); got " + Shape(bd) +
                                 ".");
    }
    if (bias.element_type() != ffi::DataType::F32 && bias.element_type() != t) {
      return Invalid(target, "bias must be float32 or have q's dtype.");
    }
    c->bias_b = bd[0];
    c->bias_h = bd[1];
    c->bias_f32 = bias.element_type() == ffi::DataType::F32;
  }
  if (auto e = ExpectShape(target, "q_seqlens", q_seqlens.dimensions(), {c->b}); e.failure()) {
    return e;
  }
  if (auto e = ExpectShape(target, "kv_seqlens", kv_seqlens.dimensions(), {c->b}); e.failure()) {
    return e;
  }
  if (causal < 0 || causal > 2) return Invalid(target, "causal must be 0, 1 or 2.");
  if (window_left < -1 || window_right < -1) {
    return Invalid(target, "window sizes must be >= 0 or -1 (unbounded).");
  }
  if (window_left > (int64_t{1} << 30) || window_right > (int64_t{1} << 30)) {
    return Invalid(target, "window sizes above 2**30 are not supported.");
  }
  if (!(scale == scale) || scale == INFINITY || scale == -INFINITY) {
    return Invalid(target, "scale must be finite.");
  }
  if (!(softcap >= 0.0f) || softcap == INFINITY) {
    return Invalid(target, "softcap must be finite and >= 0 (0 = off).");
  }
  if (!(dropout_rate >= 0.0f && dropout_rate < 1.0f)) {
    return Invalid(target, "dropout_rate must be in [0, 1).");
  }
  if (dropout_rate > 0.0f) {
    if (auto e = ExpectShape(target, "rng_state", rng_state.dimensions(), {4}); e.failure()) {
      return e;
    }
  }
  c->scale = scale;
  c->causal = causal;
  c->window_left = window_left;
  c->window_right = window_right;
  c->padding = padding != 0;
  c->softcap = softcap;
  c->dropout = dropout_rate;
  return ffi::Error::Success();
}

// The variant-pack entries shared by the forward and the backward.
void PackCommon(const AttnConfig& c, ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> q_seqlens,
                ffi::Buffer<ffi::S32> kv_seqlens, ffi::Buffer<ffi::U32> rng_state,
                ffi::Buffer<ffi::S32> offsets, std::unordered_map<int64_t, void*>& pack) {
  if (c.has_bias()) pack[kBias] = bias.untyped_data();
  if (c.ragged) {
    auto* rows = static_cast<int32_t*>(offsets.untyped_data());
    const int64_t stride = offsets.dimensions()[1];
    pack[kRaggedQ] = rows;
    pack[kRaggedK] = rows + stride;
    pack[kRaggedV] = rows + 2 * stride;
    pack[kRaggedO] = rows + 3 * stride;
  }
  if (c.padding) {
    pack[kSeqQ] = q_seqlens.untyped_data();
    pack[kSeqKv] = kv_seqlens.untyped_data();
  }
  if (c.dropout > 0) {
    // rng_state = (seed_lo, seed_hi, offset_lo, offset_hi): little-endian, words 0-1 are the
    // int64 seed and words 2-3 the int64 offset (8-byte aligned: XLA aligns buffers to >= 64).
    auto* words = static_cast<uint32_t*>(rng_state.untyped_data());
    pack[kSeed] = words;
    pack[kOffset] = words + 2;
  }
}

// cuDNN's workspace: the workspace output buffer when the Python layer sized one for the plan
// (ATTNAUX_CUDNN_WORKSPACE=output), else XLA's scratch allocator (see the top of this file). The
// scratch memory is released when the handler returns, which is stream-ordered: the next user of
// that memory runs on the same stream after cuDNN's kernels.
ffi::Error Workspace(const std::string& target, const Plan& plan, ffi::AnyBuffer buffer,
                     ffi::ScratchAllocator& scratch, void** ptr) {
  constexpr size_t kAlignment = 256;  // what cuDNN's kernels assume of their workspace
  *ptr = nullptr;
  if (plan.workspace <= 0) return ffi::Error::Success();
  if (static_cast<int64_t>(buffer.size_bytes()) >= plan.workspace) {
    *ptr = buffer.untyped_data();
    return ffi::Error::Success();
  }
  const size_t bytes = static_cast<size_t>(plan.workspace) + kAlignment - 1;
  std::optional<void*> memory = scratch.Allocate(bytes, 16);  // XLA's largest accepted alignment
  if (!memory.has_value() || *memory == nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      target + ": XLA's FFI scratch allocator could not provide " +
                          std::to_string(bytes) +
                          " bytes of cuDNN workspace (set ATTNAUX_CUDNN_WORKSPACE=output to have "
                          "it allocated as an output buffer instead).");
  }
  auto address = reinterpret_cast<uintptr_t>(*memory);
  *ptr = reinterpret_cast<void*>((address + kAlignment - 1) & ~uintptr_t{kAlignment - 1});
  return ffi::Error::Success();
}

ffi::Error FlashForwardImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
                            ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> q_seqlens,
                            ffi::Buffer<ffi::S32> kv_seqlens,
                            ffi::Buffer<ffi::U32> rng_state, ffi::Buffer<ffi::S32> offsets,
                            float scale, int32_t causal, int64_t window_left,
                            int64_t window_right, int32_t padding, int32_t with_max,
                            int32_t composite, float softcap, float dropout_rate,
                            int32_t rng_dump, int32_t ragged, int64_t max_seqlen_q,
                            int64_t max_seqlen_kv,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse,
                            ffi::Result<ffi::Buffer<ffi::F32>> row_max,
                            ffi::Result<ffi::Buffer<ffi::F32>> keep_mask,
                            ffi::Result<ffi::AnyBuffer> workspace_buffer) {
  const std::string target = "attnaux_flash_fwd_cudnn";
  AttnConfig c;
  c.device = device;
  c.backward = false;
  c.with_max = with_max != 0;
  Rows rows;
  if (auto e = CommonChecks(target, q, k, v, bias, q_seqlens, kv_seqlens, rng_state, offsets,
                            scale, causal, window_left, window_right, padding, softcap,
                            dropout_rate, ragged, max_seqlen_q, max_seqlen_kv, &c, &rows);
      e.failure()) {
    return e;
  }
  const int64_t out_b = c.ragged ? 1 : c.b;  // the [B, S] dims of q/out and k/v
  c.rng_dump = rng_dump != 0;
  c.composite = composite != 0;
  if (c.rng_dump && c.dropout <= 0.0f) {
    return Invalid(target, "rng_dump needs dropout_rate > 0.");
  }
  if (c.rng_dump && c.ragged) return Invalid(target, "rng_dump takes no packed sequences.");
  if (out->element_type() != q.element_type()) return Invalid(target, "out must have q's dtype.");
  if (auto e = ExpectShape(target, "out", out->dimensions(), {out_b, rows.q, c.hq, c.dv});
      e.failure()) {
    return e;
  }
  if (auto e = ExpectShape(target, "lse", lse->dimensions(), {c.b, c.hq, c.sq}); e.failure()) {
    return e;
  }
  if (c.with_max) {
    if (auto e = ExpectShape(target, "max", row_max->dimensions(), {c.b, c.hq, c.sq});
        e.failure()) {
      return e;
    }
  }
  if (c.rng_dump) {
    if (auto e = ExpectShape(target, "keep_mask", keep_mask->dimensions(),
                             {c.b, c.hq, c.sq, c.skv});
        e.failure()) {
      return e;
    }
  }
  DeviceGuard guard(device);
  if (!guard.ok()) return ffi::Error::Internal(target + ": cudaSetDevice failed");
  std::string error;
  auto plan = GraphCache::Get().Lookup(c, &error);
  if (!plan) return ffi::Error::InvalidArgument(target + ": " + error);

  void* workspace = nullptr;
  if (auto e = Workspace(target, *plan, *workspace_buffer, scratch, &workspace); e.failure()) {
    return e;
  }

  std::unordered_map<int64_t, void*> pack = {
      {kQ, q.untyped_data()}, {kK, k.untyped_data()}, {kV, v.untyped_data()},
      {kO, out->untyped_data()}};
  if (c.with_max) {
    pack[kMax] = row_max->untyped_data();
    pack[kSumExp] = lse->untyped_data();  // Python forms lse = max + log(sum_exp)
  } else {
    pack[kStats] = lse->untyped_data();
  }
  if (c.rng_dump) pack[kRngDump] = keep_mask->untyped_data();
  PackCommon(c, bias, q_seqlens, kv_seqlens, rng_state, offsets, pack);
  error = Execute(device, *plan, stream, pack, workspace);
  if (!error.empty()) return ffi::Error::Internal(target + ": " + error);
  return ffi::Error::Success();
}

ffi::Error FlashBackwardImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
                             ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> q_seqlens,
                             ffi::Buffer<ffi::S32> kv_seqlens,
                             ffi::Buffer<ffi::U32> rng_state, ffi::Buffer<ffi::S32> offsets,
                             ffi::AnyBuffer out, ffi::AnyBuffer dout,
                             ffi::Buffer<ffi::F32> stats, float scale, int32_t causal,
                             int64_t window_left, int64_t window_right, int32_t padding,
                             float softcap, float dropout_rate, int32_t ragged,
                             int64_t max_seqlen_q, int64_t max_seqlen_kv,
                             ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                             ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                             ffi::Result<ffi::AnyBuffer> workspace_buffer) {
  const std::string target = "attnaux_flash_bwd_cudnn";
  AttnConfig c;
  c.device = device;
  c.backward = true;
  c.with_max = false;
  Rows rows;
  if (auto e = CommonChecks(target, q, k, v, bias, q_seqlens, kv_seqlens, rng_state, offsets,
                            scale, causal, window_left, window_right, padding, softcap,
                            dropout_rate, ragged, max_seqlen_q, max_seqlen_kv, &c, &rows);
      e.failure()) {
    return e;
  }
  const int64_t out_b = c.ragged ? 1 : c.b;  // the [B, S] dims of q/out and k/v
  const ffi::DataType t = q.element_type();
  if (out.element_type() != t || dout.element_type() != t || dq->element_type() != t ||
      dk->element_type() != t || dv->element_type() != t) {
    return Invalid(target, "out, dout, dq, dk and dv must have q's dtype.");
  }
  if (auto e = ExpectShape(target, "out", out.dimensions(), {out_b, rows.q, c.hq, c.dv});
      e.failure()) {
    return e;
  }
  if (auto e = ExpectShape(target, "dout", dout.dimensions(), {out_b, rows.q, c.hq, c.dv});
      e.failure()) {
    return e;
  }
  if (auto e = ExpectShape(target, "lse", stats.dimensions(), {c.b, c.hq, c.sq}); e.failure()) {
    return e;
  }
  if (auto e = ExpectShape(target, "dq", dq->dimensions(), {out_b, rows.q, c.hq, c.d});
      e.failure()) {
    return e;
  }
  if (auto e = ExpectShape(target, "dk", dk->dimensions(), {out_b, rows.kv, c.hk, c.d});
      e.failure()) {
    return e;
  }
  if (auto e = ExpectShape(target, "dv", dv->dimensions(), {out_b, rows.kv, c.hk, c.dv});
      e.failure()) {
    return e;
  }
  if (c.has_bias() && Absent(dbias->dimensions())) {
    c.bias_grad = false;  // a constant bias (the caller's segment-id mask): no gradient written
  } else if (c.has_bias()) {
    if (auto e = ExpectShape(target, "dbias", dbias->dimensions(),
                             {c.bias_b, c.bias_h, c.sq, c.skv});
        e.failure()) {
      return e;
    }
  } else if (!Absent(dbias->dimensions())) {
    return Invalid(target, "dbias must be (0,) without a bias.");
  }
  DeviceGuard guard(device);
  if (!guard.ok()) return ffi::Error::Internal(target + ": cudaSetDevice failed");
  std::string error;
  auto plan = GraphCache::Get().Lookup(c, &error);
  if (!plan) return ffi::Error::InvalidArgument(target + ": " + error);

  if (c.has_bias() && c.bias_grad) {
    if (dbias->element_type() != bias.element_type()) {
      return Invalid(target, "dbias must have the bias's dtype.");
    }
    // With a padding mask cuDNN may skip masked rows/columns of dbias: start from zeros.
    if (c.padding) {
      const size_t bytes = static_cast<size_t>(c.bias_b * c.bias_h * c.sq * c.skv) *
                           (c.bias_f32 ? 4 : 2);
      cudaError_t e = cudaErrorInitializationError;
      try {
        e = fe::detail::cuda_mem_set_async(dbias->untyped_data(), 0, bytes, stream);
      } catch (const std::exception&) {
      }
      if (e != cudaSuccess) return CudaError(target, "cudaMemsetAsync(dbias)", e);
    }
  }
  void* workspace = nullptr;
  if (auto e = Workspace(target, *plan, *workspace_buffer, scratch, &workspace); e.failure()) {
    return e;
  }

  std::unordered_map<int64_t, void*> pack = {
      {kQ, q.untyped_data()},       {kK, k.untyped_data()},        {kV, v.untyped_data()},
      {kO, out.untyped_data()},     {kDO, dout.untyped_data()},    {kStats, stats.untyped_data()},
      {kDQ, dq->untyped_data()},    {kDK, dk->untyped_data()},     {kDV, dv->untyped_data()}};
  if (c.has_bias() && c.bias_grad) pack[kDBias] = dbias->untyped_data();
  PackCommon(c, bias, q_seqlens, kv_seqlens, rng_state, offsets, pack);
  error = Execute(device, *plan, stream, pack, workspace);
  if (!error.empty()) return ffi::Error::Internal(target + ": " + error);
  return ffi::Error::Success();
}

}  // namespace

void SetLibraryHints(const std::string& cudnn, const std::string& cudart) {
  std::lock_guard<std::mutex> lock(LoadMutex());
  Hints().cudnn = cudnn;
  Hints().cudart = cudart;
}

int64_t LoadedCudnnVersion() { return CudnnVersion(); }

std::string CheckSupport(int device, int dtype, int64_t b, int64_t hq, int64_t hk, int64_t sq,
                         int64_t skv, int64_t d, int64_t dv, int64_t bias_b, int64_t bias_h,
                         bool padding, int causal, int64_t window_left, int64_t window_right,
                         float scale, bool backward, bool with_max, bool try_f32_bias,
                         float softcap, float dropout, bool rng_dump, bool composite,
                         bool bias_grad, bool ragged, int64_t total_q, int64_t total_kv,
                         bool* bias_f32, int64_t* workspace) {
  AttnConfig c;
  c.device = device;
  c.dtype = dtype;
  c.b = b;
  c.hq = hq;
  c.hk = hk;
  c.sq = sq;
  c.skv = skv;
  c.d = d;
  c.dv = dv;
  c.bias_b = bias_b;
  c.bias_h = bias_h;
  c.padding = padding;
  c.causal = causal;
  c.window_left = window_left;
  c.window_right = window_right;
  c.scale = scale;
  c.backward = backward;
  c.with_max = with_max;
  c.softcap = softcap;
  c.dropout = dropout;
  c.bias_grad = bias_grad;
  c.ragged = ragged;
  c.total_q = ragged ? total_q : 0;
  c.total_kv = ragged ? total_kv : 0;
  c.rng_dump = rng_dump && !backward;
  c.composite = composite && !backward;
  std::string error;
  DeviceGuard guard(device);
  if (!guard.ok()) return "cudaSetDevice(" + std::to_string(device) + ") failed";
  c.bias_f32 = try_f32_bias;
  auto plan = GraphCache::Get().Lookup(c, &error, /*fallback=*/try_f32_bias);
  *bias_f32 = plan ? plan->bias_f32 : try_f32_bias;
  *workspace = plan ? plan->workspace : 0;
  return error;
}

CacheStats GetCacheStats() {
  auto& cache = GraphCache::Get();
  return CacheStats{cache.size(), cache.builds(), cache.hits()};
}

std::vector<std::pair<std::string, std::string>> GetCacheEntries() {
  return GraphCache::Get().entries();
}

}  // namespace attnaux_cuda

// attnaux_flash_fwd_cudnn: out and the softmax statistics from a cached cuDNN forward graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxFlashFwdCudnn, attnaux_cuda::FlashForwardImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: all work is enqueued on it
        .Ctx<ffi::ScratchAllocator>()              // cuDNN's workspace (stream-ordered)
        .Ctx<ffi::DeviceOrdinal>()                 // which GPU (graphs/handles are per device)
        .Arg<ffi::AnyBuffer>()                     // q [B, Sq, Hq, D] bf16/f16
        .Arg<ffi::AnyBuffer>()                     // k [B, Skv, Hkv, D]
        .Arg<ffi::AnyBuffer>()                     // v [B, Skv, Hkv, Dv]
        .Arg<ffi::AnyBuffer>()                     // bias F32 or T [1|B, 1|Hq, Sq, Skv], or (0,)
        .Arg<ffi::Buffer<ffi::S32>>()              // q_seqlens [B] (read iff padding)
        .Arg<ffi::Buffer<ffi::S32>>()              // kv_seqlens [B] (read iff padding)
        .Arg<ffi::Buffer<ffi::U32>>()              // rng_state [4] (read iff dropout) or (0,)
        .Arg<ffi::Buffer<ffi::S32>>()              // offsets [4, >= B+1] (read iff ragged) or (0,)
        .Attr<float>("scale")                      // multiplies q.k
        .Attr<int32_t>("causal")                   // 0 none, 1 top-left, 2 bottom-right
        .Attr<int64_t>("window_left")              // -1 = unbounded
        .Attr<int64_t>("window_right")             // -1 = unbounded
        .Attr<int32_t>("padding")                  // 1: mask rows/keys past the seqlens
        .Attr<int32_t>("with_max")                 // 1: Max + Sum_exp (lse and max), 0: lse only
        .Attr<int32_t>("composite")                // 1: pin cuDNN's composite implementation
        .Attr<float>("softcap")                    // 0 = off
        .Attr<float>("dropout_rate")               // 0 = off; else cuDNN's Philox from rng_state
        .Attr<int32_t>("rng_dump")                 // 1: also write cuDNN's dropout keep-mask
        .Attr<int32_t>("ragged")                   // 1: packed sequences (THD), see CommonChecks
        .Attr<int64_t>("max_seqlen_q")             // ragged: the padded query length
        .Attr<int64_t>("max_seqlen_kv")            // ragged: the padded key length
        .Ret<ffi::AnyBuffer>()                     // out [B, Sq, Hq, Dv]
        .Ret<ffi::Buffer<ffi::F32>>()              // sum_exp [B, Hq, Sq] (with_max=1) or lse
        .Ret<ffi::Buffer<ffi::F32>>()              // max [B, Hq, Sq] (or (0,) when with_max=0)
        .Ret<ffi::Buffer<ffi::F32>>()              // keep mask 0/1 [B, Hq, Sq, Skv] or (0,)
        .Ret<ffi::AnyBuffer>());                   // workspace (u8, (0,): XLA's scratch)

// attnaux_flash_bwd_cudnn: dq, dk, dv and dbias from a cached cuDNN backward graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxFlashBwdCudnn, attnaux_cuda::FlashBackwardImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
        .Ctx<ffi::ScratchAllocator>()              // cuDNN's workspace (stream-ordered)
        .Ctx<ffi::DeviceOrdinal>()                 // which GPU
        .Arg<ffi::AnyBuffer>()                     // q
        .Arg<ffi::AnyBuffer>()                     // k
        .Arg<ffi::AnyBuffer>()                     // v [B, Skv, Hkv, Dv'] (Dv' may carry extra columns)
        .Arg<ffi::AnyBuffer>()                     // bias (F32 or T) or (0,)
        .Arg<ffi::Buffer<ffi::S32>>()              // q_seqlens
        .Arg<ffi::Buffer<ffi::S32>>()              // kv_seqlens
        .Arg<ffi::Buffer<ffi::U32>>()              // rng_state (the forward's) or (0,)
        .Arg<ffi::Buffer<ffi::S32>>()              // offsets (the forward's) or (0,)
        .Arg<ffi::AnyBuffer>()                     // out [B, Sq, Hq, Dv']
        .Arg<ffi::AnyBuffer>()                     // dout [B, Sq, Hq, Dv']
        .Arg<ffi::Buffer<ffi::F32>>()              // lse [B, Hq, Sq] (the softmax stats)
        .Attr<float>("scale")                      // as in the forward
        .Attr<int32_t>("causal")                   // as in the forward
        .Attr<int64_t>("window_left")              // as in the forward
        .Attr<int64_t>("window_right")             // as in the forward
        .Attr<int32_t>("padding")                  // as in the forward
        .Attr<float>("softcap")                    // as in the forward
        .Attr<float>("dropout_rate")               // as in the forward (same mask regenerated)
        .Attr<int32_t>("ragged")                   // as in the forward
        .Attr<int64_t>("max_seqlen_q")             // as in the forward
        .Attr<int64_t>("max_seqlen_kv")            // as in the forward
        .Ret<ffi::AnyBuffer>()                     // dq [B, Sq, Hq, D]
        .Ret<ffi::AnyBuffer>()                     // dk [B, Skv, Hkv, D]
        .Ret<ffi::AnyBuffer>()                     // dv [B, Skv, Hkv, Dv']
        .Ret<ffi::AnyBuffer>()                     // dbias like bias, or (0,): no gradient
        .Ret<ffi::AnyBuffer>());                   // workspace (u8, (0,): XLA's scratch)
