// XLA FFI handlers of the `flash` primitive on CPU: validate, then call attention_cpu.h.
#include "cpu/flash_cpu.h"

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "common/attention_validate.h"
#include "common/ffi_shapes.h"
#include "cpu/attention_cpu.h"
#include "cpu/cpu_memory.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux::cpu {
namespace {

using attnaux::Absent;
using attnaux::Dims;
using attnaux::SameDims;
using attnaux::Shape;


ffi::Error ShapeError(const std::string& name, const std::string& expected, Dims got) {
  return ffi::Error::InvalidArgument("attnaux_flash: " + name + " must have shape " + expected +
                                     ", got " + Shape(got) + ".");
}

ffi::Error ExpectShape(const std::string& name, Dims dims, const std::vector<int64_t>& expected) {
  if (SameDims(dims, expected)) return ffi::Error::Success();
  return ShapeError(name, Shape(expected), dims);
}

std::string DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F16:
      return "float16";
    default:
      return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

// Checks a broadcastable [B, H, Sq, Skv] input (bias or mask) and returns its strides (0 on
// broadcast dims). Sets *present.
ffi::Error CheckBroadcast4(const std::string& name, Dims dims, const int64_t full[4],
                           bool* present, int64_t strides[4]) {
  *present = false;
  for (int a = 0; a < 4; ++a) strides[a] = 0;
  if (Absent(dims)) return ffi::Error::Success();
  std::string expected = "(0,) or [B|1, Hq|1, Sq|1, Skv|1] = " + Shape(Dims(full, 4)) +
                         " with each dim 1 or full";
  if (dims.size() != 4) return ShapeError(name, expected, dims);
  for (int a = 0; a < 4; ++a) {
    if (dims[a] != 1 && dims[a] != full[a]) return ShapeError(name, expected, dims);
  }
  int64_t stride = 1;
  for (int a = 3; a >= 0; --a) {
    strides[a] = dims[a] == 1 ? 0 : stride;
    stride *= dims[a];
  }
  *present = true;
  return ffi::Error::Success();
}

#define ATTNAUX_RETURN_IF_ERROR(expr)      \
  do {                                     \
    ffi::Error attnaux_error_ = (expr);    \
    if (attnaux_error_.failure()) return attnaux_error_; \
  } while (0)

// Validates inputs 0..10 and the attributes shared by forward and backward; fills params.
ffi::Error BuildParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask,
                       ffi::Buffer<ffi::S32> q_seqlens, ffi::Buffer<ffi::S32> kv_seqlens,
                       ffi::Buffer<ffi::S32> q_segment_ids, ffi::Buffer<ffi::S32> kv_segment_ids,
                       ffi::Buffer<ffi::F32> sink, ffi::Buffer<ffi::U32> rng_state, float scale,
                       float softcap, int32_t causal, int64_t window_left, int64_t window_right,
                       float dropout_rate, FlashParams* p) {
  const ffi::DataType dtype = q.element_type();
  if (dtype == ffi::DataType::F32) {
    p->elem = Elem::kF32;
  } else if (dtype == ffi::DataType::BF16) {
    p->elem = Elem::kBF16;
  } else if (dtype == ffi::DataType::F16) {
    p->elem = Elem::kF16;
  } else {
    return ffi::Error::InvalidArgument(
        "attnaux_flash: q must be float32, bfloat16 or float16, got " + DtypeName(dtype) + ".");
  }
  if (k.element_type() != dtype || v.element_type() != dtype) {
    return ffi::Error::InvalidArgument("attnaux_flash: q, k and v must share one dtype, got " +
                                       DtypeName(dtype) + ", " + DtypeName(k.element_type()) +
                                       " and " + DtypeName(v.element_type()) + ".");
  }
  if (q.dimensions().size() != 4) {
    return ShapeError("q", "[B, Sq, Hq, D] (rank 4)", q.dimensions());
  }
  if (k.dimensions().size() != 4) {
    return ShapeError("k", "[B, Skv, Hkv, D] (rank 4)", k.dimensions());
  }
  if (v.dimensions().size() != 4) {
    return ShapeError("v", "[B, Skv, Hkv, Dv] (rank 4)", v.dimensions());
  }
  Dims qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  p->batch = qd[0];
  p->q_len = qd[1];
  p->q_heads = qd[2];
  p->head_dim = qd[3];
  p->kv_len = kd[1];
  p->kv_heads = kd[2];
  p->v_dim = vd[3];
  if (kd[0] != p->batch || kd[3] != p->head_dim) {
    return ShapeError("k", "[B, Skv, Hkv, D] with B = " + std::to_string(p->batch) +
                               " and D = " + std::to_string(p->head_dim) + " (from q)",
                      kd);
  }
  ATTNAUX_RETURN_IF_ERROR(
      ExpectShape("v", vd, {p->batch, p->kv_len, p->kv_heads, p->v_dim}));
  if (p->kv_heads == 0 ? p->q_heads != 0 : p->q_heads % p->kv_heads != 0) {
    return ffi::Error::InvalidArgument(
        "attnaux_flash: the number of query heads (q dim 2 = " + std::to_string(p->q_heads) +
        ") must be a multiple of the number of kv heads (k dim 2 = " +
        std::to_string(p->kv_heads) + ").");
  }
  const int64_t full[4] = {p->batch, p->q_heads, p->q_len, p->kv_len};
  bool has_bias, has_mask;
  ATTNAUX_RETURN_IF_ERROR(CheckBroadcast4("bias", bias.dimensions(), full, &has_bias,
                                          p->bias_stride));
  ATTNAUX_RETURN_IF_ERROR(CheckBroadcast4("mask", mask.dimensions(), full, &has_mask,
                                          p->mask_stride));
  p->bias = has_bias ? bias.typed_data() : nullptr;
  p->mask = has_mask ? mask.typed_data() : nullptr;
  ATTNAUX_RETURN_IF_ERROR(ExpectShape("q_seqlens", q_seqlens.dimensions(), {p->batch}));
  ATTNAUX_RETURN_IF_ERROR(ExpectShape("kv_seqlens", kv_seqlens.dimensions(), {p->batch}));
  p->q_seqlens = q_seqlens.typed_data();
  p->kv_seqlens = kv_seqlens.typed_data();
  const bool q_seg_absent = Absent(q_segment_ids.dimensions());
  const bool kv_seg_absent = Absent(kv_segment_ids.dimensions());
  if (q_seg_absent != kv_seg_absent) {
    return ffi::Error::InvalidArgument(
        "attnaux_flash: q_segment_ids and kv_segment_ids must be given together, got shapes " +
        Shape(q_segment_ids.dimensions()) + " and " + Shape(kv_segment_ids.dimensions()) + ".");
  }
  if (!q_seg_absent) {
    ATTNAUX_RETURN_IF_ERROR(
        ExpectShape("q_segment_ids", q_segment_ids.dimensions(), {p->batch, p->q_len}));
    ATTNAUX_RETURN_IF_ERROR(
        ExpectShape("kv_segment_ids", kv_segment_ids.dimensions(), {p->batch, p->kv_len}));
    p->q_segment_ids = q_segment_ids.typed_data();
    p->kv_segment_ids = kv_segment_ids.typed_data();
  }
  if (!Absent(sink.dimensions())) {
    ATTNAUX_RETURN_IF_ERROR(ExpectShape("sink", sink.dimensions(), {p->q_heads}));
    p->sink = sink.typed_data();
  }
  if (!(dropout_rate >= 0.0f && dropout_rate < 1.0f)) {
    return ffi::Error::InvalidArgument("attnaux_flash: dropout_rate must be in [0, 1), got " +
                                       std::to_string(dropout_rate) + ".");
  }
  if (dropout_rate > 0.0f) {
    if (!SameDims(rng_state.dimensions(), {4})) {
      return ShapeError("rng_state", "(4,) when dropout_rate > 0", rng_state.dimensions());
    }
    p->rng_state = rng_state.typed_data();
  } else if (!Absent(rng_state.dimensions())) {
    return ShapeError("rng_state", "(0,) when dropout_rate is 0", rng_state.dimensions());
  }
  if (!(softcap >= 0.0f) || std::isinf(softcap)) {
    return ffi::Error::InvalidArgument(
        "attnaux_flash: softcap must be finite and >= 0 (0 = off), got " +
        std::to_string(softcap) + ".");
  }
  if (causal < 0 || causal > 2) {
    return ffi::Error::InvalidArgument(
        "attnaux_flash: causal must be 0 (none), 1 (top-left) or 2 (bottom-right), got " +
        std::to_string(causal) + ".");
  }
  if (window_left < -1 || window_right < -1) {
    return ffi::Error::InvalidArgument(
        "attnaux_flash: window_left and window_right must be -1 (unbounded) or >= 0, got " +
        std::to_string(window_left) + " and " + std::to_string(window_right) + ".");
  }
  // A window wider than both sequences behaves as unbounded; clamping keeps i + off +- w exact.
  const int64_t widest = p->q_len + p->kv_len + 1;
  p->window_left = window_left < 0 ? -1 : std::min(window_left, widest);
  p->window_right = window_right < 0 ? -1 : std::min(window_right, widest);
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->scale = scale;
  p->softcap = softcap;
  p->causal = causal;
  p->dropout_rate = dropout_rate;
  return ffi::Error::Success();
}

ffi::Error CheckOutput(const std::string& name, ffi::DataType got_dtype, ffi::DataType dtype,
                       Dims dims, const std::vector<int64_t>& expected) {
  if (got_dtype != dtype) {
    return ffi::Error::InvalidArgument("attnaux_flash: " + name + " must be " +
                                       DtypeName(dtype) + ", got " + DtypeName(got_dtype) + ".");
  }
  return ExpectShape(name, dims, expected);
}

ffi::Error FlashForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::F32> bias,
                            ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_seqlens,
                            ffi::Buffer<ffi::S32> kv_seqlens,
                            ffi::Buffer<ffi::S32> q_segment_ids,
                            ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::F32> sink,
                            ffi::Buffer<ffi::U32> rng_state, float scale, float softcap,
                            int32_t causal, int64_t window_left, int64_t window_right,
                            float dropout_rate, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse,
                            ffi::Result<ffi::Buffer<ffi::F32>> max) {
  FlashParams p;
  ATTNAUX_RETURN_IF_ERROR(BuildParams(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
                                      kv_segment_ids, sink, rng_state, scale, softcap, causal,
                                      window_left, window_right, dropout_rate, &p));
  ATTNAUX_RETURN_IF_ERROR(CheckOutput("out", out->element_type(), q.element_type(),
                                      out->dimensions(),
                                      {p.batch, p.q_len, p.q_heads, p.v_dim}));
  ATTNAUX_RETURN_IF_ERROR(
      ExpectShape("lse (output)", lse->dimensions(), {p.batch, p.q_heads, p.q_len}));
  ATTNAUX_RETURN_IF_ERROR(
      ExpectShape("max (output)", max->dimensions(), {p.batch, p.q_heads, p.q_len}));
  // A fresh output buffer: back it with huge pages (if large) before the kernel's first touch.
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  ForwardOutputs outputs;
  outputs.out = out->untyped_data();
  outputs.lse = lse->typed_data();
  outputs.max = max->typed_data();
  FlashForward(p, outputs, &pool);
  return ffi::Error::Success();
}

ffi::Error FlashBackwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_seqlens,
    ffi::Buffer<ffi::S32> kv_seqlens, ffi::Buffer<ffi::S32> q_segment_ids,
    ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::F32> sink,
    ffi::Buffer<ffi::U32> rng_state, ffi::AnyBuffer out, ffi::AnyBuffer dout,
    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dlse, float scale, float softcap,
    int32_t causal, int64_t window_left, int64_t window_right, float dropout_rate,
    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    ffi::Result<ffi::Buffer<ffi::F32>> dbias) {
  FlashParams p;
  ATTNAUX_RETURN_IF_ERROR(BuildParams(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
                                      kv_segment_ids, sink, rng_state, scale, softcap, causal,
                                      window_left, window_right, dropout_rate, &p));
  const ffi::DataType dtype = q.element_type();
  const std::vector<int64_t> o_shape = {p.batch, p.q_len, p.q_heads, p.v_dim};
  const std::vector<int64_t> stat_shape = {p.batch, p.q_heads, p.q_len};
  ATTNAUX_RETURN_IF_ERROR(CheckOutput("out", out.element_type(), dtype, out.dimensions(), o_shape));
  ATTNAUX_RETURN_IF_ERROR(
      CheckOutput("dout", dout.element_type(), dtype, dout.dimensions(), o_shape));
  ATTNAUX_RETURN_IF_ERROR(ExpectShape("lse", lse.dimensions(), stat_shape));
  ATTNAUX_RETURN_IF_ERROR(ExpectShape("dlse", dlse.dimensions(), stat_shape));
  ATTNAUX_RETURN_IF_ERROR(CheckOutput("dq (output)", dq->element_type(), dtype,
                                      dq->dimensions(),
                                      {p.batch, p.q_len, p.q_heads, p.head_dim}));
  ATTNAUX_RETURN_IF_ERROR(CheckOutput("dk (output)", dk->element_type(), dtype,
                                      dk->dimensions(),
                                      {p.batch, p.kv_len, p.kv_heads, p.head_dim}));
  ATTNAUX_RETURN_IF_ERROR(CheckOutput("dv (output)", dv->element_type(), dtype,
                                      dv->dimensions(),
                                      {p.batch, p.kv_len, p.kv_heads, p.v_dim}));
  if (p.bias != nullptr) {
    ATTNAUX_RETURN_IF_ERROR(ExpectShape("dbias (output)", dbias->dimensions(),
                                        {p.batch, p.q_heads, p.q_len, p.kv_len}));
  } else if (!Absent(dbias->dimensions())) {
    return ShapeError("dbias (output)", "(0,) when no bias is given", dbias->dimensions());
  }
  BackwardInputs inputs;
  inputs.out = out.untyped_data();
  inputs.dout = dout.untyped_data();
  inputs.lse = lse.typed_data();
  inputs.dlse = dlse.typed_data();
  // Fresh output buffers: back the large ones with huge pages before the kernel's first touch.
  AdviseHugePages(dq->untyped_data(), dq->size_bytes());
  AdviseHugePages(dk->untyped_data(), dk->size_bytes());
  AdviseHugePages(dv->untyped_data(), dv->size_bytes());
  if (p.bias != nullptr) AdviseHugePages(dbias->untyped_data(), dbias->size_bytes());
  BackwardOutputs outputs;
  outputs.dq = dq->untyped_data();
  outputs.dk = dk->untyped_data();
  outputs.dv = dv->untyped_data();
  outputs.dbias = p.bias != nullptr ? dbias->typed_data() : nullptr;
  FlashBackward(p, inputs, outputs, &pool);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error ValidateAttentionInputs(
    const std::string& target, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_seqlens,
    ffi::Buffer<ffi::S32> kv_seqlens, ffi::Buffer<ffi::S32> q_segment_ids,
    ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::F32> sink,
    ffi::Buffer<ffi::U32> rng_state, float scale, float softcap, int32_t causal,
    int64_t window_left, int64_t window_right, float dropout_rate, FlashParams* p) {
  ffi::Error error = BuildParams(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
                                 kv_segment_ids, sink, rng_state, scale, softcap, causal,
                                 window_left, window_right, dropout_rate, p);
  if (error.success()) return error;
  std::string message = error.message();
  const std::string flash = "attnaux_flash";
  if (message.compare(0, flash.size(), flash) == 0) message = target + message.substr(flash.size());
  return ffi::Error::InvalidArgument(message);
}

}  // namespace attnaux::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxFlashFwdCpu, attnaux::cpu::FlashForwardImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()             // XLA's intra-op thread pool
        .Arg<ffi::AnyBuffer>()              // q [B, Sq, Hq, D]
        .Arg<ffi::AnyBuffer>()              // k [B, Skv, Hkv, D]
        .Arg<ffi::AnyBuffer>()              // v [B, Skv, Hkv, Dv]
        .Arg<ffi::Buffer<ffi::F32>>()       // bias [B|1, Hq|1, Sq|1, Skv|1] or (0,)
        .Arg<ffi::Buffer<ffi::PRED>>()      // mask, same broadcasting, True = may attend
        .Arg<ffi::Buffer<ffi::S32>>()       // q_seqlens [B]
        .Arg<ffi::Buffer<ffi::S32>>()       // kv_seqlens [B]
        .Arg<ffi::Buffer<ffi::S32>>()       // q_segment_ids [B, Sq] or (0,)
        .Arg<ffi::Buffer<ffi::S32>>()       // kv_segment_ids [B, Skv] or (0,)
        .Arg<ffi::Buffer<ffi::F32>>()       // sink [Hq] or (0,)
        .Arg<ffi::Buffer<ffi::U32>>()       // rng_state [4] iff dropout_rate > 0, else (0,)
        .Attr<float>("scale")               // multiplies q.k
        .Attr<float>("softcap")             // 0 = off
        .Attr<int32_t>("causal")            // 0 none, 1 top-left, 2 bottom-right
        .Attr<int64_t>("window_left")       // -1 = unbounded
        .Attr<int64_t>("window_right")      // -1 = unbounded
        .Attr<float>("dropout_rate")        // in [0, 1)
        .Ret<ffi::AnyBuffer>()              // out [B, Sq, Hq, Dv]
        .Ret<ffi::Buffer<ffi::F32>>()       // lse [B, Hq, Sq]
        .Ret<ffi::Buffer<ffi::F32>>());     // max [B, Hq, Sq]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxFlashBwdCpu, attnaux::cpu::FlashBackwardImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()             // XLA's intra-op thread pool
        .Arg<ffi::AnyBuffer>()              // q
        .Arg<ffi::AnyBuffer>()              // k
        .Arg<ffi::AnyBuffer>()              // v
        .Arg<ffi::Buffer<ffi::F32>>()       // bias or (0,)
        .Arg<ffi::Buffer<ffi::PRED>>()      // mask or (0,)
        .Arg<ffi::Buffer<ffi::S32>>()       // q_seqlens
        .Arg<ffi::Buffer<ffi::S32>>()       // kv_seqlens
        .Arg<ffi::Buffer<ffi::S32>>()       // q_segment_ids or (0,)
        .Arg<ffi::Buffer<ffi::S32>>()       // kv_segment_ids or (0,)
        .Arg<ffi::Buffer<ffi::F32>>()       // sink or (0,)
        .Arg<ffi::Buffer<ffi::U32>>()       // rng_state or (0,)
        .Arg<ffi::AnyBuffer>()              // out (forward output)
        .Arg<ffi::AnyBuffer>()              // dout (cotangent of out)
        .Arg<ffi::Buffer<ffi::F32>>()       // lse (forward output)
        .Arg<ffi::Buffer<ffi::F32>>()       // dlse (cotangent of lse)
        .Attr<float>("scale")               // as in the forward
        .Attr<float>("softcap")             // as in the forward
        .Attr<int32_t>("causal")            // as in the forward
        .Attr<int64_t>("window_left")       // as in the forward
        .Attr<int64_t>("window_right")      // as in the forward
        .Attr<float>("dropout_rate")        // as in the forward (same rng_state: same mask)
        .Ret<ffi::AnyBuffer>()              // dq [B, Sq, Hq, D]
        .Ret<ffi::AnyBuffer>()              // dk [B, Skv, Hkv, D]
        .Ret<ffi::AnyBuffer>()              // dv [B, Skv, Hkv, Dv]
        .Ret<ffi::Buffer<ffi::F32>>());     // dbias [B, Hq, Sq, Skv] with a bias, else (0,)
