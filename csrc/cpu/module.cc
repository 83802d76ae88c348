// pybind11 module attnaux._ext: hands the FFI handlers to attnaux._ffi for registration.
#include <pybind11/pybind11.h>

#include "common/ffi_capsule.h"
#include "cpu/cpu_gemm.h"
#include "cpu/flash_cpu.h"
#include "cpu/probs_registry.h"
#include "cpu/softmax_registry.h"

namespace py = pybind11;

using attnaux::HandlerCapsule;

PYBIND11_MODULE(_ext, m) {
  m.doc() = "Compiled kernels of attnaux (XLA FFI handlers).";
  m.def(
      "registrations",
      []() {
        py::dict handlers;
        handlers["attnaux_flash_fwd"] = HandlerCapsule(AttnauxFlashFwdCpu);
        handlers["attnaux_flash_bwd"] = HandlerCapsule(AttnauxFlashBwdCpu);
        handlers["attnaux_flash_mod_fwd"] = HandlerCapsule(AttnauxFlashModFwdCpu);
        handlers["attnaux_flash_mod_bwd"] = HandlerCapsule(AttnauxFlashModBwdCpu);
        attnaux::AddProbsRegistrations(handlers);
        attnaux::AddSoftmaxRegistrations(handlers);
        return handlers;
      },
      "Target name -> capsule of its XLA_FFI_Handler*, for jax.ffi.register_ffi_target.");
  m.def(
      "amx_tiles", []() { return attnaux::cpu::AmxUsable(); },
      "Whether the CPU flash kernels run bfloat16 products on AMX tiles (the build targets AMX "
      "and the OS granted the tiles' state).");
}
