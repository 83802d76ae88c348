// XLA FFI handlers of the `probs` primitive on CPU (docs/kernel_abi.md): validate, then call
// probs_cpu.h.
#include "common/ffi_capsule.h"
#include "cpu/probs_ffi.h"
#include "cpu/probs_registry.h"

namespace ffi = xla::ffi;

// attnaux_probs_fwd: out, lse, max and (unless its output is (0,)) the probabilities P.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxProbsFwdCpu,
    attnaux::cpu::pk::ProbsForwardImpl<attnaux::cpu::pk::Primitive::kProbs>,
    ATTNAUX_PROBS_FWD_BINDING);

// attnaux_probs_bwd: dq, dk, dv, dbias from the saved P (and the cotangents of out, lse, P).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxProbsBwdCpu,
    attnaux::cpu::pk::ProbsBackwardImpl<attnaux::cpu::pk::Primitive::kProbs>,
    ATTNAUX_PROBS_BWD_BINDING);

namespace attnaux {

void AddProbsRegistrations(pybind11::dict& handlers) {
  handlers["attnaux_probs_fwd"] = HandlerCapsule(AttnauxProbsFwdCpu);
  handlers["attnaux_probs_bwd"] = HandlerCapsule(AttnauxProbsBwdCpu);
  handlers["attnaux_small_seq_fwd"] = HandlerCapsule(AttnauxSmallSeqFwdCpu);
  handlers["attnaux_small_seq_bwd"] = HandlerCapsule(AttnauxSmallSeqBwdCpu);
}

}  // namespace attnaux
