// The fused softmax's FFI handlers (docs/softmax_abi.md), for csrc/module.cc.
#ifndef ATTNAUX_CSRC_CPU_SOFTMAX_REGISTRY_H_
#define ATTNAUX_CSRC_CPU_SOFTMAX_REGISTRY_H_

#include <pybind11/pybind11.h>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* AttnauxSoftmaxFwdCpu(XLA_FFI_CallFrame* call_frame);  // attnaux_softmax_fwd
XLA_FFI_Error* AttnauxSoftmaxBwdCpu(XLA_FFI_CallFrame* call_frame);  // attnaux_softmax_bwd
}

namespace attnaux {

// Adds "attnaux_softmax_fwd" and "attnaux_softmax_bwd" (capsules of their XLA_FFI_Handler*) to
// the dict that `attnaux._ext.registrations()` returns.
void AddSoftmaxRegistrations(pybind11::dict& handlers);

}  // namespace attnaux

#endif  // ATTNAUX_CSRC_CPU_SOFTMAX_REGISTRY_H_
