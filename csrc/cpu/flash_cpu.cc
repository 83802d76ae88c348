// XLA FFI handlers of the `flash` primitive on CPU: validate, then call attention_cpu.h.
#include "cpu/flash_cpu.h"

#include <cstdint>
#include <string>
#include <vector>

#include "common/attention_validate.h"
#include "common/ffi_shapes.h"
#include "cpu/attention_cpu.h"
#include "cpu/cpu_memory.h"
#include "cpu/decode_cpu.h"
#include "cpu/score_program.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace attnaux::cpu {
namespace {

using attnaux::Absent;
using attnaux::DtypeName;
using attnaux::ShapeError;

constexpr char kTarget[] = "attnaux_flash";

#define ATTNAUX_RETURN_IF_ERROR(expr)                    \
  do {                                                   \
    ffi::Error attnaux_error_ = (expr);                  \
    if (attnaux_error_.failure()) return attnaux_error_; \
  } while (0)

ffi::Error ExpectShape(const std::string& name, attnaux::Dims dims,
                       const std::vector<int64_t>& expected) {
  return attnaux::ExpectShape(kTarget, name, dims, expected);
}

// Validates inputs 0..10 and the attributes shared by forward and backward; fills params.
ffi::Error BuildParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask,
                       ffi::Buffer<ffi::S32> q_seqlens, ffi::Buffer<ffi::S32> kv_seqlens,
                       ffi::Buffer<ffi::S32> q_segment_ids, ffi::Buffer<ffi::S32> kv_segment_ids,
                       ffi::Buffer<ffi::F32> sink, ffi::Buffer<ffi::U32> rng_state, float scale,
                       float softcap, int32_t causal, int64_t window_left, int64_t window_right,
                       float dropout_rate, AttentionParams* p) {
  return ValidateAttentionInputs(kTarget, ValidationRules::kCpu,
                                 {q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
                                  kv_segment_ids, sink, rng_state, scale, softcap, causal,
                                  window_left, window_right, dropout_rate},
                                 p);
}

ffi::Error CheckOutput(const std::string& name, ffi::DataType got_dtype, ffi::DataType dtype,
                       attnaux::Dims dims, const std::vector<int64_t>& expected) {
  if (got_dtype != dtype) {
    return ffi::Error::InvalidArgument(std::string(kTarget) + ": " + name + " must be " +
                                       DtypeName(dtype) + ", got " + DtypeName(got_dtype) + ".");
  }
  return ExpectShape(name, dims, expected);
}

// Checks the forward's outputs against `p` and runs it: the decode form for a few query rows,
// else the tiled kernel. Shared by the plain and the score-program handlers.
ffi::Error RunForward(const AttentionParams& p, ffi::DataType dtype,
                      ffi::Result<ffi::AnyBuffer>& out, ffi::Result<ffi::Buffer<ffi::F32>>& lse,
                      ffi::Result<ffi::Buffer<ffi::F32>>& max, ffi::ThreadPool& pool) {
  ATTNAUX_RETURN_IF_ERROR(CheckOutput("out", out->element_type(), dtype, out->dimensions(),
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
  if (DecodeApplies(p)) {
    DecodeForward(p, outputs, &pool);  // a few query rows: at memory speed
  } else {
    FlashForward(p, outputs, &pool);
  }
  return ffi::Error::Success();
}

// Checks the backward's inputs and dq, dk, dv against `p` and runs it into `outputs` (whose
// dbias or dconsts the caller has checked and set). Shared by both handlers.
ffi::Error RunBackward(const AttentionParams& p, ffi::DataType dtype, ffi::AnyBuffer out,
                       ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
                       ffi::Buffer<ffi::F32> dlse, ffi::Result<ffi::AnyBuffer>& dq,
                       ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                       BackwardOutputs outputs, ffi::ThreadPool& pool) {
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
  BackwardInputs inputs;
  inputs.out = out.untyped_data();
  inputs.dout = dout.untyped_data();
  inputs.lse = lse.typed_data();
  inputs.dlse = dlse.typed_data();
  // Fresh output buffers: back the large ones with huge pages before the kernel's first touch.
  AdviseHugePages(dq->untyped_data(), dq->size_bytes());
  AdviseHugePages(dk->untyped_data(), dk->size_bytes());
  AdviseHugePages(dv->untyped_data(), dv->size_bytes());
  outputs.dq = dq->untyped_data();
  outputs.dk = dk->untyped_data();
  outputs.dv = dv->untyped_data();
  if (DecodeApplies(p)) {
    DecodeBackward(p, inputs, outputs, &pool);
  } else {
    FlashBackward(p, inputs, outputs, &pool);
  }
  return ffi::Error::Success();
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
  AttentionParams p;
  ATTNAUX_RETURN_IF_ERROR(BuildParams(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
                                      kv_segment_ids, sink, rng_state, scale, softcap, causal,
                                      window_left, window_right, dropout_rate, &p));
  return RunForward(p, q.element_type(), out, lse, max, pool);
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
  AttentionParams p;
  ATTNAUX_RETURN_IF_ERROR(BuildParams(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
                                      kv_segment_ids, sink, rng_state, scale, softcap, causal,
                                      window_left, window_right, dropout_rate, &p));
  if (p.bias != nullptr) {
    ATTNAUX_RETURN_IF_ERROR(ExpectShape("dbias (output)", dbias->dimensions(),
                                        {p.batch, p.q_heads, p.q_len, p.kv_len}));
    AdviseHugePages(dbias->untyped_data(), dbias->size_bytes());
  } else if (!Absent(dbias->dimensions())) {
    return ShapeError(kTarget, "dbias (output)", "(0,) when no bias is given",
                      dbias->dimensions());
  }
  BackwardOutputs outputs;
  outputs.dbias = p.bias != nullptr ? dbias->typed_data() : nullptr;
  return RunBackward(p, q.element_type(), out, dout, lse, dlse, dq, dk, dv, outputs, pool);
}

// The score program of a call with score_mod / mask_mod (score_program.h), checked, and its
// block table: p gets both.
ffi::Error AttachProgram(ffi::Span<const int32_t> program, ffi::Span<const float> literals,
                         ffi::Buffer<ffi::F32> score_consts, ffi::Buffer<ffi::S32> tile_mask,
                         ScoreProgram* parsed, AttentionParams* p) {
  if (score_consts.dimensions().size() != 1) {
    return ShapeError(kTarget, "score_consts", "a vector [n] (the flat captured arrays)",
                      score_consts.dimensions());
  }
  const std::string why = ScoreProgram::Parse(
      program.begin(), static_cast<int64_t>(program.size()), literals.begin(),
      static_cast<int64_t>(literals.size()), score_consts.typed_data(),
      score_consts.dimensions()[0], parsed);
  if (!why.empty()) {
    return ffi::Error::InvalidArgument(std::string(kTarget) + ": `program`: " + why + ".");
  }
  p->score_program = parsed;
  if (Absent(tile_mask.dimensions())) return ffi::Error::Success();
  const auto dims = tile_mask.dimensions();
  const int64_t q_tiles = CeilDiv(p->q_len, kBlockQ), kv_tiles = CeilDiv(p->kv_len, kBlockK);
  if (dims.size() != 4 || (dims[0] != 1 && dims[0] != p->batch) ||
      (dims[1] != 1 && dims[1] != p->q_heads) || dims[2] != q_tiles || dims[3] != kv_tiles) {
    return ShapeError(kTarget, "tile_mask",
                      "[B|1, Hq|1, ceil(Sq/64), ceil(Skv/64)] = [" + std::to_string(p->batch) +
                          "|1, " + std::to_string(p->q_heads) + "|1, " +
                          std::to_string(q_tiles) + ", " + std::to_string(kv_tiles) + "]",
                      dims);
  }
  p->tile_mask = tile_mask.typed_data();
  p->tile_mask_stride[0] = dims[0] == 1 ? 0 : dims[1] * q_tiles * kv_tiles;
  p->tile_mask_stride[1] = dims[1] == 1 ? 0 : q_tiles * kv_tiles;
  return ffi::Error::Success();
}

ffi::Error FlashModForwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_seqlens,
    ffi::Buffer<ffi::S32> kv_seqlens, ffi::Buffer<ffi::S32> q_segment_ids,
    ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::F32> sink,
    ffi::Buffer<ffi::U32> rng_state, ffi::Buffer<ffi::F32> score_consts,
    ffi::Buffer<ffi::S32> tile_mask, float scale, float softcap, int32_t causal,
    int64_t window_left, int64_t window_right, float dropout_rate,
    ffi::Span<const int32_t> program, ffi::Span<const float> literals,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
    ffi::Result<ffi::Buffer<ffi::F32>> max) {
  AttentionParams p;
  ATTNAUX_RETURN_IF_ERROR(BuildParams(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
                                      kv_segment_ids, sink, rng_state, scale, softcap, causal,
                                      window_left, window_right, dropout_rate, &p));
  ScoreProgram parsed;
  ATTNAUX_RETURN_IF_ERROR(AttachProgram(program, literals, score_consts, tile_mask, &parsed, &p));
  return RunForward(p, q.element_type(), out, lse, max, pool);
}

ffi::Error FlashModBackwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_seqlens,
    ffi::Buffer<ffi::S32> kv_seqlens, ffi::Buffer<ffi::S32> q_segment_ids,
    ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::F32> sink,
    ffi::Buffer<ffi::U32> rng_state, ffi::Buffer<ffi::F32> score_consts,
    ffi::Buffer<ffi::S32> tile_mask, ffi::AnyBuffer out, ffi::AnyBuffer dout,
    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dlse, float scale, float softcap,
    int32_t causal, int64_t window_left, int64_t window_right, float dropout_rate,
    ffi::Span<const int32_t> program, ffi::Span<const float> literals,
    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    ffi::Result<ffi::Buffer<ffi::F32>> dconsts) {
  AttentionParams p;
  ATTNAUX_RETURN_IF_ERROR(BuildParams(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
                                      kv_segment_ids, sink, rng_state, scale, softcap, causal,
                                      window_left, window_right, dropout_rate, &p));
  ScoreProgram parsed;
  ATTNAUX_RETURN_IF_ERROR(AttachProgram(program, literals, score_consts, tile_mask, &parsed, &p));
  if (p.bias != nullptr) {
    return ffi::Error::InvalidArgument(std::string(kTarget) +
                                       ": a bias does not combine with a score program.");
  }
  ATTNAUX_RETURN_IF_ERROR(ExpectShape("dscore_consts (output)", dconsts->dimensions(),
                                      {p.batch, p.q_heads, parsed.data_size}));
  BackwardOutputs outputs;
  outputs.dconsts = dconsts->typed_data();
  return RunBackward(p, q.element_type(), out, dout, lse, dlse, dq, dk, dv, outputs, pool);
}

}  // namespace
}  // namespace attnaux::cpu

// attnaux_flash_fwd: out, lse and max of blocked flash attention (attention_cpu.h).
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

// attnaux_flash_bwd: dq, dk, dv, dbias, recomputing P from the saved lse (attention_cpu.h).
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

// attnaux_flash_mod_fwd / _bwd: the flash kernels with score_mod / mask_mod as a score program
// (score_program.h): the canonical operands, then the flat captured arrays and the block table.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxFlashModFwdCpu, attnaux::cpu::FlashModForwardImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::AnyBuffer>()              // q
        .Arg<ffi::AnyBuffer>()              // k
        .Arg<ffi::AnyBuffer>()              // v
        .Arg<ffi::Buffer<ffi::F32>>()       // bias: (0,) (score_mod adds its own)
        .Arg<ffi::Buffer<ffi::PRED>>()      // mask: (0,)
        .Arg<ffi::Buffer<ffi::S32>>()       // q_seqlens
        .Arg<ffi::Buffer<ffi::S32>>()       // kv_seqlens
        .Arg<ffi::Buffer<ffi::S32>>()       // q_segment_ids or (0,)
        .Arg<ffi::Buffer<ffi::S32>>()       // kv_segment_ids or (0,)
        .Arg<ffi::Buffer<ffi::F32>>()       // sink or (0,)
        .Arg<ffi::Buffer<ffi::U32>>()       // rng_state: the 12-word block state (origin)
        .Arg<ffi::Buffer<ffi::F32>>()       // score_consts [n]: captured arrays, flat
        .Arg<ffi::Buffer<ffi::S32>>()       // tile_mask [B|1, Hq|1, q tiles, kv tiles] or (0,)
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("causal")
        .Attr<int64_t>("window_left")
        .Attr<int64_t>("window_right")
        .Attr<float>("dropout_rate")
        .Attr<ffi::Span<const int32_t>>("program")   // the score program's words
        .Attr<ffi::Span<const float>>("literals")    // its literal table
        .Ret<ffi::AnyBuffer>()              // out
        .Ret<ffi::Buffer<ffi::F32>>()       // lse
        .Ret<ffi::Buffer<ffi::F32>>());     // max

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxFlashModBwdCpu, attnaux::cpu::FlashModBackwardImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::AnyBuffer>()              // q
        .Arg<ffi::AnyBuffer>()              // k
        .Arg<ffi::AnyBuffer>()              // v
        .Arg<ffi::Buffer<ffi::F32>>()       // bias: (0,)
        .Arg<ffi::Buffer<ffi::PRED>>()      // mask: (0,)
        .Arg<ffi::Buffer<ffi::S32>>()       // q_seqlens
        .Arg<ffi::Buffer<ffi::S32>>()       // kv_seqlens
        .Arg<ffi::Buffer<ffi::S32>>()       // q_segment_ids or (0,)
        .Arg<ffi::Buffer<ffi::S32>>()       // kv_segment_ids or (0,)
        .Arg<ffi::Buffer<ffi::F32>>()       // sink or (0,)
        .Arg<ffi::Buffer<ffi::U32>>()       // rng_state: the 12-word block state
        .Arg<ffi::Buffer<ffi::F32>>()       // score_consts
        .Arg<ffi::Buffer<ffi::S32>>()       // tile_mask or (0,)
        .Arg<ffi::AnyBuffer>()              // out
        .Arg<ffi::AnyBuffer>()              // dout
        .Arg<ffi::Buffer<ffi::F32>>()       // lse
        .Arg<ffi::Buffer<ffi::F32>>()       // dlse
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("causal")
        .Attr<int64_t>("window_left")
        .Attr<int64_t>("window_right")
        .Attr<float>("dropout_rate")
        .Attr<ffi::Span<const int32_t>>("program")
        .Attr<ffi::Span<const float>>("literals")
        .Ret<ffi::AnyBuffer>()              // dq
        .Ret<ffi::AnyBuffer>()              // dk
        .Ret<ffi::AnyBuffer>()              // dv
        .Ret<ffi::Buffer<ffi::F32>>());     // dscore_consts [B, Hq, n]: per (batch, head)
