// XLA FFI handlers of the fused softmax on CPU (docs/softmax_abi.md); kernels in softmax_cpu.h.
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/ffi_capsule.h"
#include "common/ffi_shapes.h"
#include "cpu/cpu_memory.h"
#include "cpu/softmax_cpu.h"
#include "cpu/softmax_registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using attnaux::Absent;
using attnaux::BracketShape;
using attnaux::IsFloat;
using attnaux::SameDims;
using attnaux::cpu::softmax::Bf16;
using attnaux::cpu::softmax::ForwardShape;
using attnaux::cpu::softmax::Half;

// Calls fn(T{}) with T the storage type of `t` (float, Bf16 or Half).
template <typename Fn>
void Dispatch(ffi::DataType t, const Fn& fn) {
  switch (t) {
    case ffi::DataType::BF16:
      fn(Bf16{});
      break;
    case ffi::DataType::F16:
      fn(Half{});
      break;
    default:
      fn(float{});
      break;
  }
}

ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("attnaux_softmax: " + message);
}

ffi::Error SoftmaxFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer logits, ffi::AnyBuffer mask,
                          float scale, int32_t causal, int64_t mask_div,
                          ffi::Result<ffi::AnyBuffer> probs, ffi::Result<ffi::AnyBuffer> lse,
                          ffi::Result<ffi::AnyBuffer> row_max) {
  const auto ld = logits.dimensions();
  if (ld.size() != 3) {
    return Invalid("`logits` must have rank 3 [N, q_seq, kv_seq]; got " + BracketShape(ld) +
                   ".");
  }
  if (!IsFloat(logits.element_type())) {
    return Invalid("`logits` must be F32, BF16 or F16.");
  }
  ForwardShape s;
  s.n = ld[0];
  s.q_seq = ld[1];
  s.kv_seq = ld[2];
  s.scale = scale;
  s.causal = causal;
  if (s.n < 0 || s.q_seq < 0 || s.kv_seq < 0) return Invalid("`logits` has a negative dimension.");
  if (causal < 0 || causal > 2) {
    return Invalid("attribute `causal` must be 0, 1 or 2; got " + std::to_string(causal) + ".");
  }
  if (!Absent(mask)) {
    const auto md = mask.dimensions();
    if (mask.element_type() != ffi::DataType::PRED) return Invalid("`mask` must be PRED (bool).");
    if (md.size() != 3) {
      return Invalid("`mask` must have rank 3 [mask_n, q_seq or 1, kv_seq or 1] or be the empty "
                     "(0,) placeholder; got " + BracketShape(md) + ".");
    }
    s.mask_n = md[0];
    s.mask_q = md[1];
    s.mask_kv = md[2];
    if ((s.mask_q != 1 && s.mask_q != s.q_seq) || (s.mask_kv != 1 && s.mask_kv != s.kv_seq)) {
      return Invalid("`mask` of shape " + BracketShape(md) + " does not broadcast to logits " +
                     BracketShape(ld) +
                     ": its last two dimensions must each be 1 or equal to logits'.");
    }
    if (mask_div < 1) {
      return Invalid("attribute `mask_div` must be >= 1; got " + std::to_string(mask_div) + ".");
    }
    // Every logits matrix b reads mask matrix (b / mask_div) % mask_n, which exists iff
    // mask_n >= 1; and the layout must be a whole number of (mask_div x mask_n) blocks.
    if (s.n > 0 && (s.mask_n < 1 || s.n % mask_div != 0 || (s.n / mask_div) % s.mask_n != 0)) {
      return Invalid("`mask` leading size " + std::to_string(s.mask_n) + " with mask_div " +
                     std::to_string(mask_div) + " does not tile logits' leading size " +
                     std::to_string(s.n) + ".");
    }
    s.mask_div = mask_div;
  } else if (mask.element_type() != ffi::DataType::PRED) {
    return Invalid("the absent `mask` placeholder must be PRED (bool) of shape (0,).");
  }
  const int64_t rows = s.n * s.q_seq;
  if (probs->element_type() != logits.element_type() || !SameDims(probs->dimensions(), ld)) {
    return Invalid("output `probs` must have logits' dtype and shape " + BracketShape(ld) + ".");
  }
  for (auto* out : {&lse, &row_max}) {
    const auto od = (*out)->dimensions();
    if ((*out)->element_type() != ffi::DataType::F32 || od.size() != 2 || od[0] != s.n ||
        od[1] != s.q_seq) {
      return Invalid("outputs `lse` and `max` must be F32 of shape [" + std::to_string(s.n) +
                     ", " + std::to_string(s.q_seq) + "]; got " + BracketShape(od) + ".");
    }
  }
  (void)rows;
  const uint8_t* mask_data =
      s.mask_n > 0 ? static_cast<const uint8_t*>(mask.untyped_data()) : nullptr;
  float* lse_data = static_cast<float*>(lse->untyped_data());
  float* max_data = static_cast<float*>(row_max->untyped_data());
  attnaux::cpu::AdviseHugePages(probs->untyped_data(), probs->size_bytes());
  Dispatch(logits.element_type(), [&](auto tag) {
    using T = decltype(tag);
    attnaux::cpu::softmax::Forward<T>(&pool, s, static_cast<const T*>(logits.untyped_data()),
                                      mask_data, static_cast<T*>(probs->untyped_data()), lse_data,
                                      max_data);
  });
  return ffi::Error::Success();
}

ffi::Error SoftmaxBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer probs, ffi::AnyBuffer dprobs,
                          ffi::AnyBuffer dlse, float scale, ffi::Result<ffi::AnyBuffer> dlogits) {
  const auto pd = probs.dimensions();
  if (pd.size() != 3) {
    return Invalid("`probs` must have rank 3 [N, q_seq, kv_seq]; got " + BracketShape(pd) + ".");
  }
  if (!IsFloat(probs.element_type())) return Invalid("`probs` must be F32, BF16 or F16.");
  if (pd[0] < 0 || pd[1] < 0 || pd[2] < 0) return Invalid("`probs` has a negative dimension.");
  if (dprobs.element_type() != probs.element_type() || !SameDims(dprobs.dimensions(), pd)) {
    return Invalid("`dprobs` must have the dtype and shape " + BracketShape(pd) +
                   " of `probs`; got " + BracketShape(dprobs.dimensions()) + ".");
  }
  const auto ld = dlse.dimensions();
  if (dlse.element_type() != ffi::DataType::F32 || ld.size() != 2 || ld[0] != pd[0] ||
      ld[1] != pd[1]) {
    return Invalid("`dlse` must be F32 of shape [" + std::to_string(pd[0]) + ", " +
                   std::to_string(pd[1]) + "]; got " + BracketShape(ld) + ".");
  }
  if (dlogits->element_type() != probs.element_type() || !SameDims(dlogits->dimensions(), pd)) {
    return Invalid("output `dlogits` must have the dtype and shape " + BracketShape(pd) +
                   " of `probs`.");
  }
  attnaux::cpu::AdviseHugePages(dlogits->untyped_data(), dlogits->size_bytes());
  Dispatch(probs.element_type(), [&](auto tag) {
    using T = decltype(tag);
    attnaux::cpu::softmax::Backward<T>(&pool, pd[0] * pd[1], pd[2], scale,
                                       static_cast<const T*>(probs.untyped_data()),
                                       static_cast<const T*>(dprobs.untyped_data()),
                                       static_cast<const float*>(dlse.untyped_data()),
                                       static_cast<T*>(dlogits->untyped_data()));
  });
  return ffi::Error::Success();
}

}  // namespace

// attnaux_softmax_fwd: logits [N, Sq, Skv], mask PRED [Mn, Sqm, Skvm] or (0,)
//   -> probs [N, Sq, Skv], lse F32 [N, Sq], max F32 [N, Sq].
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSoftmaxFwdCpu, SoftmaxFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("causal")
                                  .Attr<int64_t>("mask_div")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// attnaux_softmax_bwd: probs, dprobs [N, Sq, Skv], dlse F32 [N, Sq] -> dlogits [N, Sq, Skv].
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnauxSoftmaxBwdCpu, SoftmaxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>());

namespace attnaux {

void AddSoftmaxRegistrations(pybind11::dict& handlers) {
  handlers["attnaux_softmax_fwd"] = HandlerCapsule(AttnauxSoftmaxFwdCpu);
  handlers["attnaux_softmax_bwd"] = HandlerCapsule(AttnauxSoftmaxBwdCpu);
}

}  // namespace attnaux
