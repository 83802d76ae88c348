// XLA FFI handlers of the `small_seq` primitive on CPU (docs/kernel_abi.md): q_seq == 1 and
// kv_seq <= 16; validate, then call small_seq_cpu.h.
#include "cpu/probs_ffi.h"
#include "cpu/probs_registry.h"

namespace ffi = xla::ffi;

// attnaux_small_seq_fwd: out, lse, max and (unless its output is (0,)) the probabilities P.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxSmallSeqFwdCpu,
    attnaux::cpu::pk::ProbsForwardImpl<attnaux::cpu::pk::Primitive::kSmallSeq>,
    ATTNAUX_PROBS_FWD_BINDING);

// attnaux_small_seq_bwd: dq, dk, dv, dbias from the saved P (and the cotangents of out, lse, P).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttnauxSmallSeqBwdCpu,
    attnaux::cpu::pk::ProbsBackwardImpl<attnaux::cpu::pk::Primitive::kSmallSeq>,
    ATTNAUX_PROBS_BWD_BINDING);
