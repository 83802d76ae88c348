// pybind11 module attnaux._kernels_cuda: attnaux's own CUDA kernels (softmax.cu, small_seq.cu,
// probs_softmax.cu; handlers declared in kernels_cuda.h) as XLA FFI capsules, registered by attnaux._ffi for platform "CUDA" under the CPU targets' names.
//
// A module of its own, apart from attnaux._ext_cuda: it links the CUDA runtime statically (its
// symbols kept private with --exclude-libs), which must not meet the cuDNN frontend's dynamically
// loaded runtime in one shared object (the frontend crashed when both were linked together).
#include <pybind11/pybind11.h>

#include "common/ffi_capsule.h"
#include "cuda/kernels_cuda.h"

namespace py = pybind11;

PYBIND11_MODULE(_kernels_cuda, m) {
  m.doc() =
      "attnaux's CUDA kernels (fused softmax, small_seq, the probs softmax) behind XLA FFI "
      "handlers.";
  m.def(
      "registrations",
      []() {
        py::dict handlers;
        handlers["attnaux_softmax_fwd"] = attnaux::HandlerCapsule(AttnauxSoftmaxFwdCuda);
        handlers["attnaux_softmax_bwd"] = attnaux::HandlerCapsule(AttnauxSoftmaxBwdCuda);
        handlers["attnaux_small_seq_fwd"] = attnaux::HandlerCapsule(AttnauxSmallSeqFwdCuda);
        handlers["attnaux_small_seq_bwd"] = attnaux::HandlerCapsule(AttnauxSmallSeqBwdCuda);
        handlers["attnaux_probs_softmax_fwd"] = attnaux::HandlerCapsule(AttnauxProbsSoftmaxFwdCuda);
        handlers["attnaux_probs_softmax_bwd"] = attnaux::HandlerCapsule(AttnauxProbsSoftmaxBwdCuda);
        handlers["attnaux_zero_rows"] = attnaux::HandlerCapsule(AttnauxZeroRowsCuda);
        handlers["attnaux_fold_lse"] = attnaux::HandlerCapsule(AttnauxFoldLseCuda);
#if ATTNAUX_HOPPER_CUDA
        handlers["attnaux_hopper_fwd"] = attnaux::HandlerCapsule(AttnauxHopperFwdCuda);
        handlers["attnaux_hopper_fwd_packed"] =
            attnaux::HandlerCapsule(AttnauxHopperFwdPackedCuda);
        handlers["attnaux_hopper_bwd"] = attnaux::HandlerCapsule(AttnauxHopperBwdCuda);
        handlers["attnaux_hopper_bwd_packed"] =
            attnaux::HandlerCapsule(AttnauxHopperBwdPackedCuda);
#endif
        return handlers;
      },
      "Target name -> capsule of its XLA_FFI_Handler*, for jax.ffi.register_ffi_target "
      "(platform 'CUDA').");
}
