// XLA FFI handlers of the GPU `flash` backend (cuDNN fused attention), see docs/kernel_abi.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

// Forward: out, lse, max (Max + Sum_exp from cuDNN, lse = max + log(sum_exp)) or out, lse only.
extern "C" XLA_FFI_Error* AttnauxFlashFwdCudnn(XLA_FFI_CallFrame* call_frame);
// Backward: dq, dk, dv, dbias through cuDNN's sdpa_backward from the saved lse.
extern "C" XLA_FFI_Error* AttnauxFlashBwdCudnn(XLA_FFI_CallFrame* call_frame);

namespace attnaux_cuda {

// Graph cache and library access for module_cuda.cc (implemented in flash_cuda.cc, which alone
// compiles the cuDNN frontend).
void SetLibraryHints(const std::string& cudnn, const std::string& cudart);
int64_t LoadedCudnnVersion();
// "" when cuDNN serves the configuration (building and caching its graph), else the reason;
// `softcap` (0 = off), `dropout` (the probability, 0 = off) and `rng_dump` (a forward that also
// writes cuDNN's dropout keep-mask) complete the configuration; `composite` pins cuDNN's
// composite SDPA implementation for a forward (for measurements); `bias_grad` false makes a
// backward that takes the bias as a constant (no dbias). `ragged` (packed sequences, `b` of
// them, `sq`/`skv` their padded lengths) takes the tokens of Q and of K/V in `total_q` /
// `total_kv`, which size a packed backward's accumulators (0: by `b` x `sq`).
// With `try_f32_bias` a bias is tried in float32 first, else in the io dtype; `bias_f32` tells which
// the graph takes (and gives dbias in), `workspace` the bytes of cuDNN workspace it needs.
std::string CheckSupport(int device, int dtype, int64_t b, int64_t hq, int64_t hk, int64_t sq,
                         int64_t skv, int64_t d, int64_t dv, int64_t bias_b, int64_t bias_h,
                         bool padding, int causal, int64_t window_left, int64_t window_right,
                         float scale, bool backward, bool with_max, bool try_f32_bias,
                         float softcap, float dropout, bool rng_dump, bool composite,
                         bool bias_grad, bool ragged, int64_t total_q, int64_t total_kv,
                         bool* bias_f32, int64_t* workspace);
struct CacheStats {
  int64_t size, builds, hits;
};
CacheStats GetCacheStats();
std::vector<std::pair<std::string, std::string>> GetCacheEntries();

}  // namespace attnaux_cuda
