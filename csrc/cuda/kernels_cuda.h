// XLA FFI handlers of attnaux's own CUDA kernels: the fused softmax (docs/softmax_abi.md;
// cuda/softmax.cu) and the `small_seq` attention primitive (docs/kernel_abi.md;
// cuda/small_seq.cu), registered for platform "CUDA" under the same target names as the CPU
// handlers, and the fused softmax of the `probs` backend on GPU (cuda/probs_softmax.cu; GPU-only
// targets, see src/attnaux/_probs_gpu.py).
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* AttnauxSoftmaxFwdCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnauxSoftmaxBwdCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnauxSmallSeqFwdCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnauxSmallSeqBwdCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnauxProbsSoftmaxFwdCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnauxProbsSoftmaxBwdCuda(XLA_FFI_CallFrame* call_frame);
// cuda/zero_rows.cu: rows of padding tokens set to 0 after cuDNN's packed (THD) layout.
extern "C" XLA_FFI_Error* AttnauxZeroRowsCuda(XLA_FFI_CallFrame* call_frame);
// cuda/fold_lse.cu: the lse cotangent folded into O for cuDNN's backward (one pass).
extern "C" XLA_FFI_Error* AttnauxFoldLseCuda(XLA_FFI_CallFrame* call_frame);
// cuda/hopper_fwd.cu, cuda/hopper_bwd.cu (and their packed forms, cuda/hopper_*_packed.cu):
// attnaux's own Hopper attention forward and backward
// (CuTe; built with the CUTLASS headers only, ATTNAUX_HOPPER_CUDA).
extern "C" XLA_FFI_Error* AttnauxHopperFwdCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnauxHopperFwdPackedCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnauxHopperBwdCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AttnauxHopperBwdPackedCuda(XLA_FFI_CallFrame* call_frame);
