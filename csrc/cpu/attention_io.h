// What the CPU flash kernels write and the backward reads besides the canonical inputs
// (attention_cpu.h: tiled; decode_cpu.h: a few query rows).
#ifndef ATTNAUX_CSRC_CPU_ATTENTION_IO_H_
#define ATTNAUX_CSRC_CPU_ATTENTION_IO_H_

namespace attnaux::cpu {

struct ForwardOutputs {
  void* out = nullptr;
  float* lse = nullptr;
  float* max = nullptr;
};

struct BackwardInputs {
  const void* out = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  const float* dlse = nullptr;
};

struct BackwardOutputs {
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* dbias = nullptr;  // [B, Hq, Sq, Skv] when a bias is given, else nullptr
  // [B, Hq, score_consts size] with a score program: each (batch, head)'s share of the
  // gradient of its consts (summed by the caller), else nullptr
  float* dconsts = nullptr;
};

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_ATTENTION_IO_H_
