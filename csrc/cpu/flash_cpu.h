// XLA FFI handlers of the `flash` attention primitive on CPU (docs/kernel_abi.md).
#ifndef ATTNAUX_CSRC_CPU_FLASH_CPU_H_
#define ATTNAUX_CSRC_CPU_FLASH_CPU_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* AttnauxFlashFwdCpu(XLA_FFI_CallFrame* call_frame);  // attnaux_flash_fwd
XLA_FFI_Error* AttnauxFlashBwdCpu(XLA_FFI_CallFrame* call_frame);  // attnaux_flash_bwd
XLA_FFI_Error* AttnauxFlashModFwdCpu(XLA_FFI_CallFrame* call_frame);  // attnaux_flash_mod_fwd
XLA_FFI_Error* AttnauxFlashModBwdCpu(XLA_FFI_CallFrame* call_frame);  // attnaux_flash_mod_bwd
}

#endif  // ATTNAUX_CSRC_CPU_FLASH_CPU_H_
