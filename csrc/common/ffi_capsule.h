// The one way attnaux hands an XLA FFI handler to Python: a capsule of its XLA_FFI_Handler*, which
// attnaux._ffi passes to jax.ffi.register_ffi_target.
#ifndef ATTNAUX_CSRC_COMMON_FFI_CAPSULE_H_
#define ATTNAUX_CSRC_COMMON_FFI_CAPSULE_H_

#include <pybind11/pybind11.h>

#include <type_traits>

#include "xla/ffi/api/c_api.h"

namespace attnaux {

template <typename Fn>
pybind11::capsule HandlerCapsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler takes an XLA_FFI_CallFrame*");
  return pybind11::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace attnaux

#endif  // ATTNAUX_CSRC_COMMON_FFI_CAPSULE_H_
