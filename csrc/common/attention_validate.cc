// Checks of the attention operands (common/attention_validate.h): the CPU rules and the CUDA
// rules, each as its handlers wrote it, then one fill of AttentionParams for both.
#include "common/attention_validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "common/philox.h"
#include "xla/ffi/api/ffi.h"

namespace attnaux {
namespace {

namespace ffi = xla::ffi;

#define ATTNAUX_RETURN_IF_ERROR(expr)                    \
  do {                                                   \
    ffi::Error attnaux_error_ = (expr);                  \
    if (attnaux_error_.failure()) return attnaux_error_; \
  } while (0)

ffi::Error Invalid(const std::string& target, const std::string& what) {
  return ffi::Error::InvalidArgument(target + ": " + what);
}

// Whether a [B|1, Hq|1, Sq|1, Skv|1] operand (bias or mask) broadcasts to `full`.
bool Broadcasts4(Dims dims, const int64_t full[4]) {
  if (dims.size() != 4) return false;
  for (int a = 0; a < 4; ++a) {
    if (dims[a] != 1 && dims[a] != full[a]) return false;
  }
  return true;
}

// Element strides of such an operand, 0 on its broadcast dims.
void BroadcastStrides(Dims dims, int64_t strides[4]) {
  int64_t stride = 1;
  for (int a = 3; a >= 0; --a) {
    strides[a] = dims[a] == 1 ? 0 : stride;
    stride *= dims[a];
  }
}

// ---------------------------------------------------------------------------------------------
// The CPU handlers' rules
// ---------------------------------------------------------------------------------------------
ffi::Error CheckBroadcast4Cpu(const std::string& target, const std::string& name, Dims dims,
                              const int64_t full[4]) {
  if (Absent(dims)) return ffi::Error::Success();
  if (Broadcasts4(dims, full)) return ffi::Error::Success();
  return ShapeError(target, name,
                    "(0,) or [B|1, Hq|1, Sq|1, Skv|1] = " + Shape(Dims(full, 4)) +
                        " with each dim 1 or full",
                    dims);
}

ffi::Error CheckCpuRules(const std::string& target, const AttentionInputs& in) {
  const ffi::DataType dtype = in.q.dtype;
  if (!IsFloat(dtype)) {
    return Invalid(target, "q must be float32, bfloat16 or float16, got " + DtypeName(dtype) + ".");
  }
  if (in.k.dtype != dtype || in.v.dtype != dtype) {
    return Invalid(target, "q, k and v must share one dtype, got " + DtypeName(dtype) + ", " +
                               DtypeName(in.k.dtype) + " and " + DtypeName(in.v.dtype) + ".");
  }
  if (in.q.dims.size() != 4) return ShapeError(target, "q", "[B, Sq, Hq, D] (rank 4)", in.q.dims);
  if (in.k.dims.size() != 4) {
    return ShapeError(target, "k", "[B, Skv, Hkv, D] (rank 4)", in.k.dims);
  }
  if (in.v.dims.size() != 4) {
    return ShapeError(target, "v", "[B, Skv, Hkv, Dv] (rank 4)", in.v.dims);
  }
  const Dims qd = in.q.dims, kd = in.k.dims, vd = in.v.dims;
  const int64_t batch = qd[0], q_len = qd[1], q_heads = qd[2], head_dim = qd[3];
  const int64_t kv_len = kd[1], kv_heads = kd[2], v_dim = vd[3];
  if (kd[0] != batch || kd[3] != head_dim) {
    return ShapeError(target, "k",
                      "[B, Skv, Hkv, D] with B = " + std::to_string(batch) +
                          " and D = " + std::to_string(head_dim) + " (from q)",
                      kd);
  }
  ATTNAUX_RETURN_IF_ERROR(ExpectShape(target, "v", vd, {batch, kv_len, kv_heads, v_dim}));
  if (kv_heads == 0 ? q_heads != 0 : q_heads % kv_heads != 0) {
    return Invalid(target, "the number of query heads (q dim 2 = " + std::to_string(q_heads) +
                               ") must be a multiple of the number of kv heads (k dim 2 = " +
                               std::to_string(kv_heads) + ").");
  }
  const int64_t full[4] = {batch, q_heads, q_len, kv_len};
  ATTNAUX_RETURN_IF_ERROR(CheckBroadcast4Cpu(target, "bias", in.bias.dims, full));
  ATTNAUX_RETURN_IF_ERROR(CheckBroadcast4Cpu(target, "mask", in.mask.dims, full));
  ATTNAUX_RETURN_IF_ERROR(ExpectShape(target, "q_seqlens", in.q_seqlens.dims, {batch}));
  ATTNAUX_RETURN_IF_ERROR(ExpectShape(target, "kv_seqlens", in.kv_seqlens.dims, {batch}));
  const bool q_seg_absent = Absent(in.q_segment_ids.dims);
  if (q_seg_absent != Absent(in.kv_segment_ids.dims)) {
    return Invalid(target, "q_segment_ids and kv_segment_ids must be given together, got shapes " +
                               Shape(in.q_segment_ids.dims) + " and " +
                               Shape(in.kv_segment_ids.dims) + ".");
  }
  if (!q_seg_absent) {
    ATTNAUX_RETURN_IF_ERROR(
        ExpectShape(target, "q_segment_ids", in.q_segment_ids.dims, {batch, q_len}));
    ATTNAUX_RETURN_IF_ERROR(
        ExpectShape(target, "kv_segment_ids", in.kv_segment_ids.dims, {batch, kv_len}));
  }
  if (!Absent(in.sink.dims)) {
    ATTNAUX_RETURN_IF_ERROR(ExpectShape(target, "sink", in.sink.dims, {q_heads}));
  }
  const float dropout_rate = in.dropout_rate;
  if (!(dropout_rate >= 0.0f && dropout_rate < 1.0f)) {
    return Invalid(target,
                   "dropout_rate must be in [0, 1), got " + std::to_string(dropout_rate) + ".");
  }
  if (dropout_rate > 0.0f) {
    if (!SameDims(in.rng_state.dims, {4}) && !SameDims(in.rng_state.dims, {12})) {
      return ShapeError(target, "rng_state",
                        "(4,), or (12,) for a block of a larger problem, when dropout_rate > 0",
                        in.rng_state.dims);
    }
  } else if (!Absent(in.rng_state.dims) && !SameDims(in.rng_state.dims, {12})) {
    return ShapeError(target, "rng_state",
                      "(0,), or (12,) for a block of a larger problem, when dropout_rate is 0",
                      in.rng_state.dims);
  }
  if (!(in.softcap >= 0.0f) || std::isinf(in.softcap)) {
    return Invalid(target, "softcap must be finite and >= 0 (0 = off), got " +
                               std::to_string(in.softcap) + ".");
  }
  if (in.causal < 0 || in.causal > 2) {
    return Invalid(target, "causal must be 0 (none), 1 (top-left) or 2 (bottom-right), got " +
                               std::to_string(in.causal) + ".");
  }
  if (in.window_left < -1 || in.window_right < -1) {
    return Invalid(target, "window_left and window_right must be -1 (unbounded) or >= 0, got " +
                               std::to_string(in.window_left) + " and " +
                               std::to_string(in.window_right) + ".");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// The CUDA handlers' rules
// ---------------------------------------------------------------------------------------------
ffi::Error CheckBroadcast4Cuda(const std::string& target, const char* name, Dims dims,
                               const int64_t full[4]) {
  if (dims.size() != 4) {
    return Invalid(target, std::string("`") + name + "` must have rank 4 or be (0,); got " +
                               BracketShape(dims) + ".");
  }
  if (!Broadcasts4(dims, full)) {
    return Invalid(target, std::string("`") + name + "` of shape " + BracketShape(dims) +
                               " does not broadcast to [B, Hq, Sq, Skv].");
  }
  return ffi::Error::Success();
}

ffi::Error CheckCudaRules(const std::string& target, const AttentionInputs& in) {
  const Dims qd = in.q.dims, kd = in.k.dims, vd = in.v.dims;
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return Invalid(target, "`q`, `k`, `v` must have rank 4; got " + BracketShape(qd) + ", " +
                               BracketShape(kd) + ", " + BracketShape(vd) + ".");
  }
  if (!IsFloat(in.q.dtype) || in.k.dtype != in.q.dtype || in.v.dtype != in.q.dtype) {
    return Invalid(target, "`q`, `k`, `v` must share one dtype among F32, BF16, F16.");
  }
  const int64_t B = qd[0], Sq = qd[1], Hq = qd[2], D = qd[3], Skv = kd[1], Hk = kd[2];
  if (kd[0] != B || kd[3] != D || vd[0] != B || vd[1] != Skv || vd[2] != Hk) {
    return Invalid(target, "`k` " + BracketShape(kd) + " / `v` " + BracketShape(vd) +
                               " do not match `q` " + BracketShape(qd) + ".");
  }
  if (Hk < 1 || Hq % Hk != 0) return Invalid(target, "q_heads must be a multiple of kv_heads.");
  const int64_t full[4] = {B, Hq, Sq, Skv};
  if (!Absent(in.bias.dims)) {
    if (in.bias.dtype != ffi::DataType::F32) return Invalid(target, "`bias` must be F32.");
    ATTNAUX_RETURN_IF_ERROR(CheckBroadcast4Cuda(target, "bias", in.bias.dims, full));
  }
  if (!Absent(in.mask.dims)) {
    if (in.mask.dtype != ffi::DataType::PRED) return Invalid(target, "`mask` must be PRED.");
    ATTNAUX_RETURN_IF_ERROR(CheckBroadcast4Cuda(target, "mask", in.mask.dims, full));
  }
  if (in.q_seqlens.dtype != ffi::DataType::S32 || !SameDims(in.q_seqlens.dims, {B}) ||
      in.kv_seqlens.dtype != ffi::DataType::S32 || !SameDims(in.kv_seqlens.dims, {B})) {
    return Invalid(target, "`q_seqlens` and `kv_seqlens` must be S32 of shape [B].");
  }
  const Operand& q_seg = in.q_segment_ids;
  const Operand& kv_seg = in.kv_segment_ids;
  if (Absent(q_seg.dims) != Absent(kv_seg.dims)) {
    return Invalid(target, "`q_segment_ids` and `kv_segment_ids` come together.");
  }
  if (!Absent(q_seg.dims)) {
    if (q_seg.dtype != ffi::DataType::S32 || !SameDims(q_seg.dims, {B, Sq}) ||
        kv_seg.dtype != ffi::DataType::S32 || !SameDims(kv_seg.dims, {B, Skv})) {
      return Invalid(target, "segment ids must be S32 [B, q_seq] and [B, kv_seq].");
    }
  }
  if (!Absent(in.sink.dims)) {
    if (in.sink.dtype != ffi::DataType::F32 || !SameDims(in.sink.dims, {Hq})) {
      return Invalid(target, "`sink` must be F32 [q_heads].");
    }
  }
  if (!(in.dropout_rate >= 0.0f && in.dropout_rate < 1.0f)) {
    return Invalid(target, "attribute `dropout_rate` must be in [0, 1).");
  }
  if (in.dropout_rate > 0.0f) {
    if (in.rng_state.dtype != ffi::DataType::U32 ||
        (!SameDims(in.rng_state.dims, {4}) && !SameDims(in.rng_state.dims, {12}))) {
      return Invalid(target, "`rng_state` must be U32 [4] (or [12] for a block of a larger "
                             "problem) when dropout_rate > 0.");
    }
  } else if (!Absent(in.rng_state.dims) &&
             (in.rng_state.dtype != ffi::DataType::U32 || !SameDims(in.rng_state.dims, {12}))) {
    return Invalid(target, "`rng_state` must be (0,) (or U32 [12] for a block of a larger "
                           "problem) when dropout_rate == 0.");
  }
  if (in.causal < 0 || in.causal > 2) {
    return Invalid(target, "attribute `causal` must be 0, 1 or 2.");
  }
  if (!(in.softcap >= 0.0f)) return Invalid(target, "attribute `softcap` must be >= 0.");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// The fill, once the rules have passed
// ---------------------------------------------------------------------------------------------
void FillParams(const AttentionInputs& in, int64_t window_limit, AttentionParams* p) {
  const ffi::DataType dtype = in.q.dtype;
  p->elem = dtype == ffi::DataType::F32    ? Elem::kF32
            : dtype == ffi::DataType::BF16 ? Elem::kBF16
                                           : Elem::kF16;
  const Dims qd = in.q.dims, kd = in.k.dims, vd = in.v.dims;
  p->batch = qd[0];
  p->q_len = qd[1];
  p->q_heads = qd[2];
  p->head_dim = qd[3];
  p->kv_len = kd[1];
  p->kv_heads = kd[2];
  p->v_dim = vd[3];
  p->q = in.q.data;
  p->k = in.k.data;
  p->v = in.v.data;
  if (!Absent(in.bias.dims)) {
    BroadcastStrides(in.bias.dims, p->bias_stride);
    p->bias = static_cast<const float*>(in.bias.data);
  }
  if (!Absent(in.mask.dims)) {
    BroadcastStrides(in.mask.dims, p->mask_stride);
    p->mask = static_cast<const bool*>(in.mask.data);
  }
  p->q_seqlens = static_cast<const int32_t*>(in.q_seqlens.data);
  p->kv_seqlens = static_cast<const int32_t*>(in.kv_seqlens.data);
  if (!Absent(in.q_segment_ids.dims)) {
    p->q_segment_ids = static_cast<const int32_t*>(in.q_segment_ids.data);
    p->kv_segment_ids = static_cast<const int32_t*>(in.kv_segment_ids.data);
  }
  if (!Absent(in.sink.dims)) p->sink = static_cast<const float*>(in.sink.data);
  if (SameDims(in.rng_state.dims, {12})) {
    p->block_state = static_cast<const uint32_t*>(in.rng_state.data);
  }
  if (in.dropout_rate > 0.0f) {
    p->rng_state = static_cast<const uint32_t*>(in.rng_state.data);
    p->drop_threshold = DropoutThreshold(in.dropout_rate);
    p->drop_scale = 1.0f / (1.0f - in.dropout_rate);
  }
  p->scale = in.scale;
  p->softcap = in.softcap;
  p->causal = in.causal;
  p->dropout_rate = in.dropout_rate;
  // A window wider than both sequences behaves as unbounded; clamping keeps i + off +- w exact.
  p->window_left = in.window_left < 0 ? -1 : std::min(in.window_left, window_limit);
  p->window_right = in.window_right < 0 ? -1 : std::min(in.window_right, window_limit);
}

}  // namespace

ffi::Error ValidateAttentionInputs(const std::string& target, ValidationRules rules,
                                   const AttentionInputs& in, AttentionParams* p) {
  if (rules == ValidationRules::kCpu) {
    ATTNAUX_RETURN_IF_ERROR(CheckCpuRules(target, in));
    // Sq + Skv + 1 + |diagonal shift|: here q and k have passed the rank checks, and a CPU
    // call's block state is in host memory.
    int64_t shift = 0;
    if (SameDims(in.rng_state.dims, {12})) {
      shift = static_cast<int32_t>(static_cast<const uint32_t*>(in.rng_state.data)[11]);
    }
    FillParams(in, in.q.dims[1] + in.k.dims[1] + 1 + (shift < 0 ? -shift : shift), p);
  } else {
    ATTNAUX_RETURN_IF_ERROR(CheckCudaRules(target, in));
    FillParams(in, int64_t{1} << 40, p);
  }
  return ffi::Error::Success();
}

}  // namespace attnaux
