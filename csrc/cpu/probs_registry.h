// The FFI handlers of the probability-saving primitives, `probs` and `small_seq`
// (docs/kernel_abi.md), for csrc/module.cc.
#ifndef ATTNAUX_CSRC_CPU_PROBS_REGISTRY_H_
#define ATTNAUX_CSRC_CPU_PROBS_REGISTRY_H_

#include <pybind11/pybind11.h>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* AttnauxProbsFwdCpu(XLA_FFI_CallFrame* call_frame);     // attnaux_probs_fwd
XLA_FFI_Error* AttnauxProbsBwdCpu(XLA_FFI_CallFrame* call_frame);     // attnaux_probs_bwd
XLA_FFI_Error* AttnauxSmallSeqFwdCpu(XLA_FFI_CallFrame* call_frame);  // attnaux_small_seq_fwd
XLA_FFI_Error* AttnauxSmallSeqBwdCpu(XLA_FFI_CallFrame* call_frame);  // attnaux_small_seq_bwd
}

namespace attnaux {

// Adds "attnaux_probs_fwd", "attnaux_probs_bwd", "attnaux_small_seq_fwd" and
// "attnaux_small_seq_bwd" (capsules of their XLA_FFI_Handler*) to the dict that
// `attnaux._ext.registrations()` returns.
void AddProbsRegistrations(pybind11::dict& handlers);

}  // namespace attnaux

#endif  // ATTNAUX_CSRC_CPU_PROBS_REGISTRY_H_
