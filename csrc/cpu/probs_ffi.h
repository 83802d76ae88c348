// The XLA FFI handler bodies shared by the two probability-saving primitives, `probs` and
// `small_seq` (docs/kernel_abi.md, "The probability-saving primitives"): validate, then run the
// kernel of the primitive. probs_cpu.cc and small_seq_cpu.cc bind them.
#ifndef ATTNAUX_CSRC_CPU_PROBS_FFI_H_
#define ATTNAUX_CSRC_CPU_PROBS_FFI_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/attention_validate.h"
#include "common/ffi_shapes.h"
#include "cpu/attention_cpu.h"
#include "cpu/cpu_memory.h"
#include "cpu/probs_common.h"
#include "cpu/probs_cpu.h"
#include "cpu/small_seq_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace attnaux::cpu::pk {

namespace ffi = xla::ffi;

using attnaux::Absent;

enum class Primitive { kProbs, kSmallSeq };

inline const char* TargetName(Primitive prim) {
  return prim == Primitive::kProbs ? "attnaux_probs" : "attnaux_small_seq";
}

inline ffi::Error CheckBuffer(Primitive prim, const std::string& name, ffi::DataType got_dtype,
                              ffi::DataType dtype, ffi::AnyBuffer::Dimensions dims,
                              const std::vector<int64_t>& expected) {
  if (got_dtype != dtype) {
    return ffi::Error::InvalidArgument(std::string(TargetName(prim)) + ": " + name +
                                       " has the wrong dtype (#" +
                                       std::to_string(static_cast<int>(got_dtype)) + ", expected #" +
                                       std::to_string(static_cast<int>(dtype)) + ").");
  }
  return attnaux::ExpectShape(TargetName(prim), name, dims, expected);
}

// small_seq serves one query row against at most kSmallMaxKeys keys.
inline ffi::Error CheckPrimitiveShape(Primitive prim, const AttentionParams& p) {
  if (prim == Primitive::kSmallSeq && (p.q_len != 1 || p.kv_len > kSmallMaxKeys)) {
    return ffi::Error::InvalidArgument(
        "attnaux_small_seq: needs q_seq == 1 and kv_seq <= " + std::to_string(kSmallMaxKeys) +
        ", got q_seq = " + std::to_string(p.q_len) + " and kv_seq = " +
        std::to_string(p.kv_len) + ".");
  }
  return ffi::Error::Success();
}

#define ATTNAUX_PROBS_RETURN_IF_ERROR(expr)               \
  do {                                                    \
    ffi::Error attnaux_error_ = (expr);                   \
    if (attnaux_error_.failure()) return attnaux_error_;  \
  } while (0)

template <Primitive kPrim>
ffi::Error ProbsForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::F32> bias,
                            ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_seqlens,
                            ffi::Buffer<ffi::S32> kv_seqlens, ffi::Buffer<ffi::S32> q_segment_ids,
                            ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::F32> sink,
                            ffi::Buffer<ffi::U32> rng_state, float scale, float softcap,
                            int32_t causal, int64_t window_left, int64_t window_right,
                            float dropout_rate, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::F32>> lse,
                            ffi::Result<ffi::Buffer<ffi::F32>> max,
                            ffi::Result<ffi::AnyBuffer> probs) {
  AttentionParams p;
  ATTNAUX_PROBS_RETURN_IF_ERROR(ValidateAttentionInputs(
      TargetName(kPrim), ValidationRules::kCpu,
      {q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, sink,
       rng_state, scale, softcap, causal, window_left, window_right, dropout_rate},
      &p));
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckPrimitiveShape(kPrim, p));
  const ffi::DataType dtype = q.element_type();
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "out (output)", out->element_type(), dtype,
                                            out->dimensions(),
                                            {p.batch, p.q_len, p.q_heads, p.v_dim}));
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "lse (output)", ffi::DataType::F32,
                                            ffi::DataType::F32, lse->dimensions(),
                                            {p.batch, p.q_heads, p.q_len}));
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "max (output)", ffi::DataType::F32,
                                            ffi::DataType::F32, max->dimensions(),
                                            {p.batch, p.q_heads, p.q_len}));
  const bool write_probs = !Absent(probs->dimensions());
  if (write_probs) {
    ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "probs (output)", probs->element_type(),
                                              dtype, probs->dimensions(),
                                              {p.batch, p.q_heads, p.q_len, p.kv_len}));
  }
  // Fresh output buffers: back the large ones with huge pages before the kernel's first touch.
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  if (write_probs) AdviseHugePages(probs->untyped_data(), probs->size_bytes());
  ProbsForwardOutputs o;
  o.out = out->untyped_data();
  o.lse = lse->typed_data();
  o.max = max->typed_data();
  o.probs = write_probs ? probs->untyped_data() : nullptr;
  if constexpr (kPrim == Primitive::kProbs) {
    ProbsForward(p, o, &pool);
  } else {
    SmallSeqForward(p, o, &pool);
  }
  return ffi::Error::Success();
}

template <Primitive kPrim>
ffi::Error ProbsBackwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_seqlens,
    ffi::Buffer<ffi::S32> kv_seqlens, ffi::Buffer<ffi::S32> q_segment_ids,
    ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::F32> sink,
    ffi::Buffer<ffi::U32> rng_state, ffi::AnyBuffer dout, ffi::AnyBuffer probs,
    ffi::Buffer<ffi::F32> dlse, ffi::AnyBuffer dprobs, float scale, float softcap, int32_t causal,
    int64_t window_left, int64_t window_right, float dropout_rate, ffi::Result<ffi::AnyBuffer> dq,
    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    ffi::Result<ffi::Buffer<ffi::F32>> dbias) {
  AttentionParams p;
  ATTNAUX_PROBS_RETURN_IF_ERROR(ValidateAttentionInputs(
      TargetName(kPrim), ValidationRules::kCpu,
      {q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, sink,
       rng_state, scale, softcap, causal, window_left, window_right, dropout_rate},
      &p));
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckPrimitiveShape(kPrim, p));
  const ffi::DataType dtype = q.element_type();
  const std::vector<int64_t> p_shape = {p.batch, p.q_heads, p.q_len, p.kv_len};
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "dout", dout.element_type(), dtype,
                                            dout.dimensions(),
                                            {p.batch, p.q_len, p.q_heads, p.v_dim}));
  ATTNAUX_PROBS_RETURN_IF_ERROR(
      CheckBuffer(kPrim, "probs", probs.element_type(), dtype, probs.dimensions(), p_shape));
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "dlse", ffi::DataType::F32, ffi::DataType::F32,
                                            dlse.dimensions(), {p.batch, p.q_heads, p.q_len}));
  const bool has_dprobs = !Absent(dprobs.dimensions());
  if (has_dprobs) {
    ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "dprobs", dprobs.element_type(), dtype,
                                              dprobs.dimensions(), p_shape));
  }
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "dq (output)", dq->element_type(), dtype,
                                            dq->dimensions(),
                                            {p.batch, p.q_len, p.q_heads, p.head_dim}));
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "dk (output)", dk->element_type(), dtype,
                                            dk->dimensions(),
                                            {p.batch, p.kv_len, p.kv_heads, p.head_dim}));
  ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "dv (output)", dv->element_type(), dtype,
                                            dv->dimensions(),
                                            {p.batch, p.kv_len, p.kv_heads, p.v_dim}));
  if (p.bias != nullptr) {
    ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "dbias (output)", ffi::DataType::F32,
                                              ffi::DataType::F32, dbias->dimensions(), p_shape));
  } else {
    ATTNAUX_PROBS_RETURN_IF_ERROR(CheckBuffer(kPrim, "dbias (output) without a bias",
                                              ffi::DataType::F32, ffi::DataType::F32,
                                              dbias->dimensions(), {0}));
  }
  ProbsBackwardInputs in;
  in.dout = dout.untyped_data();
  in.probs = probs.untyped_data();
  in.dlse = dlse.typed_data();
  in.dprobs = has_dprobs ? dprobs.untyped_data() : nullptr;
  // Fresh output buffers: back the large ones with huge pages before the kernel's first touch.
  AdviseHugePages(dq->untyped_data(), dq->size_bytes());
  AdviseHugePages(dk->untyped_data(), dk->size_bytes());
  AdviseHugePages(dv->untyped_data(), dv->size_bytes());
  if (p.bias != nullptr) AdviseHugePages(dbias->untyped_data(), dbias->size_bytes());
  BackwardOutputs o;
  o.dq = dq->untyped_data();
  o.dk = dk->untyped_data();
  o.dv = dv->untyped_data();
  o.dbias = p.bias != nullptr ? dbias->typed_data() : nullptr;
  if constexpr (kPrim == Primitive::kProbs) {
    ProbsBackward(p, in, o, &pool);
  } else {
    SmallSeqBackward(p, in, o, &pool);
  }
  return ffi::Error::Success();
}

}  // namespace attnaux::cpu::pk

// The FFI signatures (one comment per binding), shared by both primitives.
#define ATTNAUX_PROBS_FWD_BINDING                                                  \
  ffi::Ffi::Bind()                                                                 \
      .Ctx<ffi::ThreadPool>()         /* XLA's intra-op thread pool */             \
      .Arg<ffi::AnyBuffer>()          /* q [B, Sq, Hq, D] */                       \
      .Arg<ffi::AnyBuffer>()          /* k [B, Skv, Hkv, D] */                     \
      .Arg<ffi::AnyBuffer>()          /* v [B, Skv, Hkv, Dv] */                    \
      .Arg<ffi::Buffer<ffi::F32>>()   /* bias [B|1, Hq|1, Sq|1, Skv|1] or (0,) */  \
      .Arg<ffi::Buffer<ffi::PRED>>()  /* mask, same broadcasting, or (0,) */       \
      .Arg<ffi::Buffer<ffi::S32>>()   /* q_seqlens [B] */                          \
      .Arg<ffi::Buffer<ffi::S32>>()   /* kv_seqlens [B] */                         \
      .Arg<ffi::Buffer<ffi::S32>>()   /* q_segment_ids [B, Sq] or (0,) */          \
      .Arg<ffi::Buffer<ffi::S32>>()   /* kv_segment_ids [B, Skv] or (0,) */        \
      .Arg<ffi::Buffer<ffi::F32>>()   /* sink [Hq] or (0,) */                      \
      .Arg<ffi::Buffer<ffi::U32>>()   /* rng_state [4] iff dropout_rate > 0 */     \
      .Attr<float>("scale")           /* multiplies q.k */                         \
      .Attr<float>("softcap")         /* 0 = off */                                \
      .Attr<int32_t>("causal")        /* 0 none, 1 top-left, 2 bottom-right */     \
      .Attr<int64_t>("window_left")   /* -1 = unbounded */                         \
      .Attr<int64_t>("window_right")  /* -1 = unbounded */                         \
      .Attr<float>("dropout_rate")    /* in [0, 1) */                              \
      .Ret<ffi::AnyBuffer>()          /* out [B, Sq, Hq, Dv] */                    \
      .Ret<ffi::Buffer<ffi::F32>>()   /* lse [B, Hq, Sq] */                        \
      .Ret<ffi::Buffer<ffi::F32>>()   /* max [B, Hq, Sq] */                        \
      .Ret<ffi::AnyBuffer>()          /* probs [B, Hq, Sq, Skv], or (0,): not written */

#define ATTNAUX_PROBS_BWD_BINDING                                                  \
  ffi::Ffi::Bind()                                                                 \
      .Ctx<ffi::ThreadPool>()         /* XLA's intra-op thread pool */             \
      .Arg<ffi::AnyBuffer>()          /* q */                                      \
      .Arg<ffi::AnyBuffer>()          /* k */                                      \
      .Arg<ffi::AnyBuffer>()          /* v */                                      \
      .Arg<ffi::Buffer<ffi::F32>>()   /* bias or (0,) */                           \
      .Arg<ffi::Buffer<ffi::PRED>>()  /* mask or (0,) */                           \
      .Arg<ffi::Buffer<ffi::S32>>()   /* q_seqlens */                              \
      .Arg<ffi::Buffer<ffi::S32>>()   /* kv_seqlens */                             \
      .Arg<ffi::Buffer<ffi::S32>>()   /* q_segment_ids or (0,) */                  \
      .Arg<ffi::Buffer<ffi::S32>>()   /* kv_segment_ids or (0,) */                 \
      .Arg<ffi::Buffer<ffi::F32>>()   /* sink or (0,) */                           \
      .Arg<ffi::Buffer<ffi::U32>>()   /* rng_state or (0,) */                      \
      .Arg<ffi::AnyBuffer>()          /* dout [B, Sq, Hq, Dv] (cotangent of out) */ \
      .Arg<ffi::AnyBuffer>()          /* probs [B, Hq, Sq, Skv] (forward output) */ \
      .Arg<ffi::Buffer<ffi::F32>>()   /* dlse [B, Hq, Sq] (cotangent of lse) */    \
      .Arg<ffi::AnyBuffer>()          /* dprobs (cotangent of probs) or (0,) */    \
      .Attr<float>("scale")           /* as in the forward */                      \
      .Attr<float>("softcap")         /* as in the forward */                      \
      .Attr<int32_t>("causal")        /* as in the forward */                      \
      .Attr<int64_t>("window_left")   /* as in the forward */                      \
      .Attr<int64_t>("window_right")  /* as in the forward */                      \
      .Attr<float>("dropout_rate")    /* as in the forward (same mask) */          \
      .Ret<ffi::AnyBuffer>()          /* dq [B, Sq, Hq, D] */                      \
      .Ret<ffi::AnyBuffer>()          /* dk [B, Skv, Hkv, D] */                    \
      .Ret<ffi::AnyBuffer>()          /* dv [B, Skv, Hkv, Dv] */                   \
      .Ret<ffi::Buffer<ffi::F32>>()   /* dbias [B, Hq, Sq, Skv] with a bias, else (0,) */

#endif  // ATTNAUX_CSRC_CPU_PROBS_FFI_H_
