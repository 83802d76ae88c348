// pybind11 module attnaux._kernels_cuda: attnaux's own CUDA kernels (kernels_cuda.cu) as XLA FFI
// capsules, registered by attnaux._ffi for platform "CUDA" under the CPU targets' names.
//
// A module of its own, apart from attnaux._ext_cuda: it links the CUDA runtime statically (its
// symbols kept private with --exclude-libs), which must not meet the cuDNN frontend's dynamically
// loaded runtime in one shared object (the frontend crashed when both were linked together).
#include <pybind11/pybind11.h>

#include "kernels_cuda.h"

namespace py = pybind11;

PYBIND11_MODULE(_kernels_cuda, m) {
  m.doc() = "attnaux's CUDA kernels (fused softmax, small_seq) behind XLA FFI handlers.";
  m.def(
      "registrations",
      []() {
        py::dict handlers;
        handlers["attnaux_softmax_fwd"] = py::capsule(reinterpret_cast<void*>(AttnauxSoftmaxFwdCuda));
        handlers["attnaux_softmax_bwd"] = py::capsule(reinterpret_cast<void*>(AttnauxSoftmaxBwdCuda));
        handlers["attnaux_small_seq_fwd"] = py::capsule(reinterpret_cast<void*>(AttnauxSmallSeqFwdCuda));
        handlers["attnaux_small_seq_bwd"] = py::capsule(reinterpret_cast<void*>(AttnauxSmallSeqBwdCuda));
        return handlers;
      },
      "Target name -> capsule of its XLA_FFI_Handler*, for jax.ffi.register_ffi_target "
      "(platform 'CUDA').");
}
