// cuDNN fused-attention graphs for the GPU `flash` backend: building, caching and running them.
//
// attnaux drives cuDNN's scaled-dot-product-attention (SDPA) through the cuDNN frontend graph API.
// The frontend is header-only and is compiled here in its dynamic-loading mode
// (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): every cuDNN call goes through `cudnn_dlhandle`, which
// `EnsureCudnnLoaded` points at the libcudnn.so.9 that the process has already loaded (JAX's CUDA
// plugin loads the one of the nvidia-cudnn wheel), so attnaux and XLA run the same cuDNN.
//
// A graph depends only on the static configuration of a call (`AttnConfig`: shapes, dtype, masks,
// scale, device). Building one takes milliseconds to seconds, so each is built once and kept in a
// process-wide cache (`GraphCache`), which is thread-safe: lookups and builds hold one mutex, and a
// graph is never rebuilt. Execution holds a per-device mutex around `cudnnSetStream` + `execute`
// on that device's cuDNN handle (a handle must not be used by two threads at once).
#pragma once

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

namespace attnaux_cuda {

namespace fe = cudnn_frontend;

// Tensor uids of the variant packs.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kMax,
  kSumExp,
  kBias,
  kSeqQ,
  kSeqKv,
  kDO,
  kDQ,
  kDK,
  kDV,
  kDBias,
  kSeed,      // dropout: cuDNN's Philox seed, int64 (rng_state words 0, 1)
  kOffset,    // dropout: cuDNN's Philox offset, int64 (rng_state words 2, 3)
  kRngDump,   // dropout: cuDNN's keep-mask as float32 0/1 [B, Hq, Sq, Skv] (replay only)
  kRaggedQ,   // packed (THD) layout: element offset of each sequence in Q, dQ  (int32 [B + 1])
  kRaggedK,   // ... in K, dK
  kRaggedV,   // ... in V, dV
  kRaggedO,   // ... in O, dO
};

// The static configuration of one forward or backward call: everything a cuDNN graph depends on.
struct AttnConfig {
  int device = 0;
  int dtype = 0;  // 0 bfloat16, 1 float16
  int64_t b = 0, hq = 0, hk = 0, sq = 0, skv = 0, d = 0, dv = 0;
  int64_t bias_b = 0, bias_h = 0;  // bias dims (1 or full); 0 = no bias
  bool padding = false;            // padding mask from q/kv sequence lengths
  int causal = 0;                  // 0 none, 1 top-left, 2 bottom-right
  int64_t window_left = -1, window_right = -1;
  float scale = 1.0f;
  bool with_max = true;   // forward: emit Max + Sum_exp (else Stats)
  bool backward = false;  // sdpa_backward graph (with dbias when there is a bias)
  bool bias_f32 = true;   // bias (and dbias) tensors in float32, else in the io dtype
  float softcap = 0.0f;   // > 0: logits -> softcap * tanh(logits / softcap), before the bias
  float dropout = 0.0f;   // probability of dropping an entry of P (cuDNN's Philox), 0 = none
  bool rng_dump = false;  // forward: also write cuDNN's dropout keep-mask (mask replay)
  // Backward with a bias: whether to write its gradient. Off for a constant bias, such as the
  // segment-id mask (0 / -inf) the Python layer passes in place of segment ids.
  bool bias_grad = true;
  // Forward: pin cuDNN's composite SDPA implementation (the one that emits Max + Sum_exp on
  // cuDNN < 9.21) instead of letting the frontend pick; used to measure the max's cost on one
  // engine (benchmarks/gpu_flash.py).
  bool composite = false;
  // Packed sequences (varlen): Q, K, V, O and their gradients hold the `b` sequences back to back
  // (`[tokens, heads, dim]`), sequence i starting at the element offset of the ragged-offset
  // tensors and `sq` / `skv` being the largest lengths. Needs the padding mask (the lengths).
  bool ragged = false;
  // Packed backward: the tokens in Q (and dQ) and in K/V (and dK/dV). cuDNN then sizes its
  // float32 dQ accumulator (and the dK/dV ones it may keep) by the tokens, [tokens, H, D], not
  // by `b` x `sq`: with `max_seqlen_q` a loose static bound (common under jit, where the lengths
  // are data) the padded size is many times the tokens (8.6 GB at 64 sequences, 16 heads x 128
  // and a bound of 16384), and with documents of varied lengths its passes measured ~4% of the
  // call (docs/performance.md). 0: not packed, or a forward.
  int64_t total_q = 0, total_kv = 0;

  bool has_bias() const { return bias_b > 0; }

  // cuDNN accepts no built-in mask (causal band, padding) next to a score modifier, and no bias
  // or dropout next to bottom-right causal masking. Those configurations get every mask from
  // attnaux's own score modifier instead (ScoreModifier below), which costs the skipping of
  // fully masked tiles but computes the same logits.
  bool masks_in_score_mod() const {
    return softcap > 0 || (causal == 2 && (has_bias() || dropout > 0));
  }

  std::string Key() const {
    uint32_t scale_bits, softcap_bits, dropout_bits;
    std::memcpy(&scale_bits, &scale, sizeof(scale_bits));
    std::memcpy(&softcap_bits, &softcap, sizeof(softcap_bits));
    std::memcpy(&dropout_bits, &dropout, sizeof(dropout_bits));
    char buf[512];
    std::snprintf(buf, sizeof(buf),
                  "%s dev%d t%d b%lld hq%lld hk%lld sq%lld skv%lld d%lld dv%lld bias%lldx%lld "
                  "pad%d c%d w%lld,%lld s%08x max%d f32bias%d cap%08x p%08x dump%d comp%d dbias%d rag%d "
                  "tot%lld,%lld",
                  backward ? "bwd" : "fwd", device, dtype, (long long)b, (long long)hq,
                  (long long)hk, (long long)sq, (long long)skv, (long long)d, (long long)dv,
                  (long long)bias_b, (long long)bias_h, (int)padding, causal,
                  (long long)window_left, (long long)window_right, scale_bits,
                  backward ? 0 : (int)with_max, has_bias() ? (int)bias_f32 : 0, softcap_bits,
                  dropout_bits, (int)(rng_dump && !backward), (int)(composite && !backward),
                  (int)(backward && has_bias() && bias_grad), (int)ragged,
                  (long long)(backward ? total_q : 0), (long long)(backward ? total_kv : 0));
    return buf;
  }
};

struct ScoreModifier;

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  bool bias_f32 = true;
  std::shared_ptr<ScoreModifier> modifier;  // attnaux's score modifier, when the graph has one
  int64_t plan_index = -1;  // the candidate plan built (ATTNAUX_CUDNN_PLAN), -1: the heuristics'
};

// ------------------------------------------------------------------------------------------------
// Loading libcudnn and libcudart (dynamic loading mode of the frontend)
// ------------------------------------------------------------------------------------------------
struct LibraryHints {
  std::string cudnn;   // a path to libcudnn.so.9 to dlopen when none is loaded yet
  std::string cudart;  // a path to libcudart.so.1x for the frontend's CUDA runtime calls
};

inline LibraryHints& Hints() {
  static LibraryHints* hints = new LibraryHints();
  return *hints;
}

inline std::mutex& LoadMutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}

// Points the frontend at libcudnn (the already loaded one when there is one). Returns "" or why not.
inline std::string EnsureCudnnLoaded() {
  std::lock_guard<std::mutex> lock(LoadMutex());
  static std::string error;
  static bool done = false;
  if (done) return error;
  done = true;
  // The frontend's CUDA runtime calls dlopen "libcudart.so.12"/".13"; prefer one already loaded,
  // else the hint from Python (the nvidia-cuda-runtime wheel), unless the user chose one.
  if (std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME") == nullptr) {
    const char* loaded = nullptr;
    for (const char* name : {"libcudart.so.13", "libcudart.so.12"}) {
      if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) {
        loaded = name;
        dlclose(h);
        break;
      }
    }
    if (loaded != nullptr) {
      setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", loaded, 0);
    } else if (!Hints().cudart.empty()) {
      setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", Hints().cudart.c_str(), 0);
    }
  }
  void* handle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr && !Hints().cudnn.empty()) {
    handle = dlopen(Hints().cudnn.c_str(), RTLD_NOW | RTLD_GLOBAL);
  }
  if (handle == nullptr) handle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    error = std::string("could not load libcudnn.so.9 (install nvidia-cudnn-cu12 or -cu13, the "
                        "cuDNN that JAX's CUDA plugin uses): ") +
            (why ? why : "unknown error");
    return error;
  }
  fe::cudnn_dlhandle = handle;
  return error;
}

inline int64_t CudnnVersion() {
  if (!EnsureCudnnLoaded().empty()) return -1;
  try {
    return static_cast<int64_t>(fe::detail::get_backend_version());
  } catch (const std::exception&) {
    return -1;
  }
}

// CUDA runtime calls go through the frontend's dynamically loaded libcudart (nothing is linked).
inline cudaError_t CudaSetDevice(int device) {
  using Fn = cudaError_t (*)(int);
  try {
    auto fn = reinterpret_cast<Fn>(
        fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDART, "cudaSetDevice"));
    return fn ? fn(device) : cudaErrorInitializationError;
  } catch (const std::exception&) {
    return cudaErrorInitializationError;
  }
}

inline cudaError_t CudaGetDevice(int* device) {
  try {
    return fe::detail::cuda_get_device(device);
  } catch (const std::exception&) {
    return cudaErrorInitializationError;
  }
}

inline const char* CudaErrorString(cudaError_t e) {
  try {
    return fe::detail::cuda_get_error_string(e);
  } catch (const std::exception&) {
    return "unknown CUDA error";
  }
}

// Sets the current CUDA device for the scope, restoring the previous one at exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (!EnsureCudnnLoaded().empty()) {
      ok_ = false;
      return;
    }
    if (CudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) {
      ok_ = CudaSetDevice(device) == cudaSuccess;
      changed_ = ok_ && previous_ >= 0;
    }
  }
  ~DeviceGuard() {
    if (changed_) CudaSetDevice(previous_);
  }
  bool ok() const { return ok_; }

 private:
  int previous_ = -1;
  bool ok_ = true;
  bool changed_ = false;
};

// ------------------------------------------------------------------------------------------------
// Per-device cuDNN handles
// ------------------------------------------------------------------------------------------------
struct DeviceState {
  std::mutex mutex;  // held while the handle is used (set stream + build or execute)
  cudnnHandle_t handle = nullptr;
  std::string error;
};

inline DeviceState* GetDevice(int device, std::string* error) {
  static std::mutex* m = new std::mutex();
  static std::map<int, DeviceState*>* states = new std::map<int, DeviceState*>();
  std::string load = EnsureCudnnLoaded();
  if (!load.empty()) {
    *error = load;
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(*m);
  auto it = states->find(device);
  if (it != states->end()) {
    if (!it->second->error.empty()) {
      *error = it->second->error;
      return nullptr;
    }
    return it->second;
  }
  auto* state = new DeviceState();  // lives for the process (handles outlive XLA's executables)
  (*states)[device] = state;
  DeviceGuard guard(device);
  try {
    cudnnStatus_t status = fe::detail::create_handle(&state->handle);
    if (status != CUDNN_STATUS_SUCCESS) {
      state->error = "cudnnCreate failed on device " + std::to_string(device) + ": " +
                     fe::detail::get_error_string(status);
    }
  } catch (const std::exception& e) {
    state->error = std::string("cudnnCreate failed: ") + e.what();
  }
  if (!state->error.empty()) {
    *error = state->error;
    return nullptr;
  }
  return state;
}

// ------------------------------------------------------------------------------------------------
// Graph construction
// ------------------------------------------------------------------------------------------------
// attnaux's q/k/v/out are [B, S, H, D]; cuDNN's logical dims are (b, h, s, d): give it BSHD strides.
inline std::vector<int64_t> BshdStrides(int64_t h, int64_t s, int64_t d) {
  return {s * h * d, d, h * d, 1};
}

inline std::string FeMessage(fe::error_t e, const char* step) {
  return std::string(step) + ": " + e.get_message();
}

// The band of the causal / window masks in cuDNN's terms: cuDNN keeps key j of query i iff
// j <= i + off + right_bound and j > i + off - left_bound; attnaux keeps j >= i + off - left.
inline std::optional<int64_t> RightBound(const AttnConfig& c) {
  int64_t right = c.causal ? 0 : c.window_right;  // causal caps the right side at the diagonal
  if (right >= 0) return right;
  return std::nullopt;
}

inline std::optional<int64_t> LeftBound(const AttnConfig& c) {
  if (c.window_left >= 0) return c.window_left + 1;
  return std::nullopt;
}

inline fe::DiagonalAlignment_t Alignment(const AttnConfig& c) {
  return c.causal == 2 ? fe::DiagonalAlignment_t::BOTTOM_RIGHT : fe::DiagonalAlignment_t::TOP_LEFT;
}

template <typename Attributes>
void ApplyMasks(const AttnConfig& c, Attributes& a) {
  if (auto right = RightBound(c)) a.set_diagonal_band_right_bound(static_cast<int>(*right));
  if (auto left = LeftBound(c)) a.set_diagonal_band_left_bound(static_cast<int>(*left));
  a.set_diagonal_alignment(Alignment(c));
}

// attnaux's score modifier: softcap, then the padding and causal / window masks, on
// the scaled logits (the bias is added after it, as attnaux's convention wants). Used for the
// configurations of `AttnConfig::masks_in_score_mod`; cuDNN runs it inside the fused kernel. The
// Softcap helper keeps its pre-tanh tensor for the backward's bprop modifier, so one instance
// serves the forward and the bprop lambda of one graph.
struct ScoreModifier {
  AttnConfig c;
  std::shared_ptr<fe::graph::Tensor_attributes> softcap, seq_q, seq_kv;
  fe::graph::attn::score_modifiers::Softcap softcap_op;

  std::shared_ptr<fe::graph::Tensor_attributes> Forward(
      std::shared_ptr<fe::graph::Graph> graph, std::shared_ptr<fe::graph::Tensor_attributes> x) {
    namespace g = fe::graph;
    namespace mods = fe::graph::attn::score_modifiers;
    if (c.softcap > 0) x = softcap_op.forward(graph, x, softcap);
    if (c.padding) x = mods::padding_mask(graph, x, seq_kv, seq_q);
    auto right = RightBound(c);
    auto left = LeftBound(c);
    if (right || left) {
      x = mods::sliding_window_mask(graph, x, Alignment(c), left, right, c.sq, c.skv,
                                    c.padding ? seq_q : nullptr, c.padding ? seq_kv : nullptr,
                                    nullptr, nullptr);
    }
    return x;
  }

  std::shared_ptr<fe::graph::Tensor_attributes> Backward(
      std::shared_ptr<fe::graph::Graph> graph, std::shared_ptr<fe::graph::Tensor_attributes> ds) {
    // The masks select: their gradient passes dS where kept, and dS is already 0 elsewhere.
    return c.softcap > 0 ? softcap_op.backward(graph, ds, softcap) : ds;
  }
};

// Builds the graph of `c` on `handle` (the caller holds the device mutex). Returns "" or why not.
inline std::string BuildGraph(const AttnConfig& c, cudnnHandle_t handle, Plan* plan) {
  namespace g = fe::graph;
  auto graph = std::make_shared<g::Graph>();
  const auto io = c.dtype == 0 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  const auto bias_type = c.bias_f32 ? fe::DataType_t::FLOAT : io;
  graph->set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);

  auto tensor = [&](const char* name, int64_t uid, std::vector<int64_t> dim,
                    std::vector<int64_t> stride) {
    return graph->tensor(
        g::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
  };
  auto Q = tensor("Q", kQ, {c.b, c.hq, c.sq, c.d}, BshdStrides(c.hq, c.sq, c.d));
  auto K = tensor("K", kK, {c.b, c.hk, c.skv, c.d}, BshdStrides(c.hk, c.skv, c.d));
  auto V = tensor("V", kV, {c.b, c.hk, c.skv, c.dv}, BshdStrides(c.hk, c.skv, c.dv));
  // Packed sequences: one ragged-offset tensor per layout (Q and dQ share theirs, and so on).
  std::shared_ptr<g::Tensor_attributes> ragged_q, ragged_k, ragged_v, ragged_o;
  if (c.ragged) {
    auto offsets = [&](const char* name, int64_t uid) {
      auto t = tensor(name, uid, {c.b + 1, 1, 1, 1}, {1, 1, 1, 1});
      t->set_data_type(fe::DataType_t::INT32);
      return t;
    };
    ragged_q = offsets("ragged_q", kRaggedQ);
    ragged_k = offsets("ragged_k", kRaggedK);
    ragged_v = offsets("ragged_v", kRaggedV);
    ragged_o = offsets("ragged_o", kRaggedO);
    Q->set_ragged_offset(ragged_q);
    K->set_ragged_offset(ragged_k);
    V->set_ragged_offset(ragged_v);
  }
  const std::vector<int64_t> row_dim = {c.b, c.hq, c.sq, 1};
  const std::vector<int64_t> row_stride = {c.hq * c.sq, c.sq, 1, 1};
  const std::vector<int64_t> bias_dim = {c.bias_b, c.bias_h, c.sq, c.skv};
  const std::vector<int64_t> bias_stride = {c.bias_h * c.sq * c.skv, c.sq * c.skv, c.skv, 1};

  std::shared_ptr<g::Tensor_attributes> bias, seq_q, seq_kv, seed, offset;
  if (c.has_bias()) {
    bias = tensor("Bias", kBias, bias_dim, bias_stride);
    bias->set_data_type(bias_type);
  }
  if (c.padding) {
    seq_q = tensor("seq_q", kSeqQ, {c.b, 1, 1, 1}, {1, 1, 1, 1});
    seq_kv = tensor("seq_kv", kSeqKv, {c.b, 1, 1, 1}, {1, 1, 1, 1});
    seq_q->set_data_type(fe::DataType_t::INT32);
    seq_kv->set_data_type(fe::DataType_t::INT32);
  }
  if (c.dropout > 0) {
    // int64 scalars in device memory, read by the kernels (no host sync, CUDA-graph friendly).
    seed = tensor("Seed", kSeed, {1, 1, 1, 1}, {1, 1, 1, 1});
    offset = tensor("Offset", kOffset, {1, 1, 1, 1}, {1, 1, 1, 1});
    seed->set_data_type(fe::DataType_t::INT64);
    offset->set_data_type(fe::DataType_t::INT64);
  }
  std::shared_ptr<ScoreModifier> modifier;
  if (c.masks_in_score_mod()) {
    modifier = std::make_shared<ScoreModifier>();
    modifier->c = c;
    modifier->seq_q = seq_q;
    modifier->seq_kv = seq_kv;
    if (c.softcap > 0) modifier->softcap = std::make_shared<g::Tensor_attributes>(c.softcap);
  }
  auto forward_mod = [modifier](std::shared_ptr<g::Graph> sub,
                                std::shared_ptr<g::Tensor_attributes> x) {
    return modifier->Forward(std::move(sub), std::move(x));
  };
  auto backward_mod = [modifier](std::shared_ptr<g::Graph> sub,
                                 std::shared_ptr<g::Tensor_attributes> x) {
    return modifier->Backward(std::move(sub), std::move(x));
  };

  try {
    if (!c.backward) {
      auto attrs = g::SDPA_attributes().set_name("attnaux_flash_fwd").set_attn_scale(c.scale);
      if (c.composite) attrs.set_implementation(fe::AttentionImplementation_t::COMPOSITE);
      if (bias) attrs.set_bias(bias);
      if (modifier) {
        attrs.set_score_mod(forward_mod);
        // The lengths still bound cuDNN's matmuls; the masking itself is in the modifier.
        if (c.padding) attrs.set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
      } else {
        ApplyMasks(c, attrs);
        if (c.padding) attrs.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
      }
      if (c.dropout > 0) {
        attrs.set_dropout(c.dropout, seed, offset);
        if (c.rng_dump) {
          auto dump = tensor("RngDump", kRngDump, {c.b, c.hq, c.sq, c.skv},
                             {c.hq * c.sq * c.skv, c.sq * c.skv, c.skv, 1});
          dump->set_data_type(fe::DataType_t::FLOAT);
          attrs.set_rng_dump(dump);
        }
      }
      if (c.with_max) {
        attrs.set_generate_stats(false);
        auto mx = tensor("Max", kMax, row_dim, row_stride);
        auto se = tensor("Sum_exp", kSumExp, row_dim, row_stride);
        mx->set_data_type(fe::DataType_t::FLOAT);
        se->set_data_type(fe::DataType_t::FLOAT);
        attrs.set_logit_max(mx).set_score_sum_exp(se);
      } else {
        attrs.set_generate_stats(true);
      }
      auto outs = graph->sdpa(Q, K, V, std::move(attrs));
      outs[0]->set_output(true).set_uid(kO).set_dim({c.b, c.hq, c.sq, c.dv}).set_stride(
          BshdStrides(c.hq, c.sq, c.dv));
      if (c.ragged) outs[0]->set_ragged_offset(ragged_o);
      if (!c.with_max) {
        outs[1]->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT)
            .set_dim(row_dim).set_stride(row_stride);
      }
    } else {
      auto O = tensor("O", kO, {c.b, c.hq, c.sq, c.dv}, BshdStrides(c.hq, c.sq, c.dv));
      auto dO = tensor("dO", kDO, {c.b, c.hq, c.sq, c.dv}, BshdStrides(c.hq, c.sq, c.dv));
      if (c.ragged) {
        O->set_ragged_offset(ragged_o);
        dO->set_ragged_offset(ragged_o);
      }
      auto stats = tensor("Stats", kStats, row_dim, row_stride);
      stats->set_data_type(fe::DataType_t::FLOAT);
      auto attrs =
          g::SDPA_backward_attributes().set_name("attnaux_flash_bwd").set_attn_scale(c.scale);
      if (bias) {
        attrs.set_bias(bias);
        if (c.bias_grad) {
          auto dbias = tensor("dBias", kDBias, bias_dim, bias_stride);
          dbias->set_data_type(bias_type);
          attrs.set_dbias(dbias);
        }
      }
      if (modifier) {
        attrs.set_score_mod(forward_mod);
        if (c.softcap > 0) attrs.set_score_mod_bprop(backward_mod);
        if (c.padding) attrs.set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
      } else {
        ApplyMasks(c, attrs);
        if (c.padding) attrs.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
      }
      if (c.dropout > 0) attrs.set_dropout(c.dropout, seed, offset);
      // ATTNAUX_CUDNN_RAGGED_TOTALS=0 (measurements only) sizes them by `b` x `sq` as before.
      const char* totals = std::getenv("ATTNAUX_CUDNN_RAGGED_TOTALS");
      const bool by_tokens = totals == nullptr || std::string(totals) != "0";
      if (c.ragged && by_tokens && c.total_q > 0 && c.total_kv > 0) {
        attrs.set_max_total_seq_len_q(c.total_q).set_max_total_seq_len_kv(c.total_kv);
      }
      auto grads = graph->sdpa_backward(Q, K, V, O, dO, stats, std::move(attrs));
      grads[0]->set_output(true).set_uid(kDQ).set_dim({c.b, c.hq, c.sq, c.d}).set_stride(
          BshdStrides(c.hq, c.sq, c.d));
      grads[1]->set_output(true).set_uid(kDK).set_dim({c.b, c.hk, c.skv, c.d}).set_stride(
          BshdStrides(c.hk, c.skv, c.d));
      grads[2]->set_output(true).set_uid(kDV).set_dim({c.b, c.hk, c.skv, c.dv}).set_stride(
          BshdStrides(c.hk, c.skv, c.dv));
      if (c.ragged) {
        grads[0]->set_ragged_offset(ragged_q);
        grads[1]->set_ragged_offset(ragged_k);
        grads[2]->set_ragged_offset(ragged_v);
      }
    }

    DeviceGuard guard(c.device);
    fe::error_t e = graph->validate();
    if (!e.is_good()) return FeMessage(e, "validate");
    e = graph->build_operation_graph(handle);
    if (!e.is_good()) return FeMessage(e, "build_operation_graph");
    // Measurement knobs (benchmarks only; unset in normal use): ATTNAUX_CUDNN_HEUR=B asks
    // cuDNN's heuristics mode B instead of A, ATTNAUX_CUDNN_PLAN=<i> builds the i-th candidate
    // plan instead of the heuristics' first, ATTNAUX_CUDNN_VERBOSE=1 lists the candidates.
    const char* heur = std::getenv("ATTNAUX_CUDNN_HEUR");
    const bool mode_b = heur != nullptr && std::string(heur) == "B";
    e = graph->create_execution_plans(
        {mode_b ? fe::HeurMode_t::B : fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (!e.is_good()) return FeMessage(e, "create_execution_plans");
    e = graph->check_support(handle);
    if (!e.is_good()) return FeMessage(e, "check_support");
    if (std::getenv("ATTNAUX_CUDNN_VERBOSE") != nullptr) {
      const int64_t count = graph->get_execution_plan_count();
      for (int64_t i = 0; i < count; ++i) {
        std::string name;
        (void)graph->get_plan_name_at_index(i, name);
        std::fprintf(stderr, "attnaux cuDNN %s plan %lld: %s\n", c.Key().c_str(), (long long)i,
                     name.c_str());
      }
    }
    const char* pick = std::getenv("ATTNAUX_CUDNN_PLAN");
    if (pick != nullptr) {
      plan->plan_index = std::atoll(pick);
      e = graph->build_plan_at_index(handle, plan->plan_index);
    } else {
      e = graph->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
    }
    if (!e.is_good()) return FeMessage(e, "build_plans");
    int64_t workspace = 0;
    e = plan->plan_index >= 0
            ? graph->get_workspace_size_plan_at_index(plan->plan_index, workspace)
            : graph->get_workspace_size(workspace);
    if (!e.is_good()) return FeMessage(e, "get_workspace_size");
    plan->graph = graph;
    plan->workspace = workspace;
    plan->bias_f32 = c.bias_f32;
    plan->modifier = modifier;  // its tensors and lambdas live as long as the graph
  } catch (const std::exception& ex) {
    return std::string("cuDNN frontend: ") + ex.what();
  }
  return "";
}

// ------------------------------------------------------------------------------------------------
// The cache
// ------------------------------------------------------------------------------------------------
class GraphCache {
 public:
  static GraphCache& Get() {
    static GraphCache* cache = new GraphCache();  // never destroyed: outlives XLA's executables
    return *cache;
  }

  // The plan of `c` (bias dtype chosen here: float32 when cuDNN takes it, else the io dtype).
  // Builds it on the first request, caches failures too. Returns nullptr and sets `error`.
  // With `fallback`, a bias graph that cuDNN rejects in float32 is built with the bias in the io
  // dtype instead (and cached under both keys); the plan says which one it takes.
  std::shared_ptr<const Plan> Lookup(AttnConfig c, std::string* error, bool fallback = false) {
    std::string dev_error;
    DeviceState* dev = GetDevice(c.device, &dev_error);
    if (dev == nullptr) {
      *error = dev_error;
      return nullptr;
    }
    const std::string key = c.Key();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = entries_.find(key);
      if (it != entries_.end()) {
        ++hits_;
        if (!it->second.plan) *error = it->second.error;
        return it->second.plan;
      }
    }
    // Build under the device mutex (the handle is used); one build per key: re-check after.
    std::lock_guard<std::mutex> dev_lock(dev->mutex);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = entries_.find(key);
      if (it != entries_.end()) {
        ++hits_;
        if (!it->second.plan) *error = it->second.error;
        return it->second.plan;
      }
    }
    Entry entry;
    auto plan = std::make_shared<Plan>();
    std::string why = BuildGraph(c, dev->handle, plan.get());
    std::string low_key;
    if (!why.empty() && c.has_bias() && c.bias_f32 && fallback) {
      // cuDNN's fused kernels may want the bias in the io dtype: the handler then converts it.
      AttnConfig low = c;
      low.bias_f32 = false;
      auto plan_low = std::make_shared<Plan>();
      std::string why_low = BuildGraph(low, dev->handle, plan_low.get());
      if (why_low.empty()) {
        plan = plan_low;
        why.clear();
        low_key = low.Key();
      } else {
        why += " (and with the bias in the input dtype: " + why_low + ")";
      }
    }
    if (why.empty()) {
      entry.plan = plan;
    } else {
      entry.error = "cuDNN cannot run this attention configuration [" + c.Key() + "]: " + why;
      *error = entry.error;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    ++builds_;
    entries_[key] = entry;
    if (!low_key.empty()) entries_[low_key] = entry;
    return entry.plan;
  }

  int64_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(entries_.size());
  }
  int64_t hits() {
    std::lock_guard<std::mutex> lock(mutex_);
    return hits_;
  }
  int64_t builds() {
    std::lock_guard<std::mutex> lock(mutex_);
    return builds_;
  }
  std::vector<std::pair<std::string, std::string>> entries() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& [key, entry] : entries_) {
      std::string what = entry.plan ? (std::string("ok; workspace ") +
                                       std::to_string(entry.plan->workspace) + " B; bias " +
                                       (entry.plan->bias_f32 ? "float32" : "input dtype"))
                                    : entry.error;
      out.emplace_back(key, what);
    }
    return out;
  }

 private:
  struct Entry {
    std::shared_ptr<const Plan> plan;
    std::string error;
  };
  std::mutex mutex_;
  std::unordered_map<std::string, Entry> entries_;
  int64_t hits_ = 0;
  int64_t builds_ = 0;
};

// Runs `plan` on `stream` with the device's handle. Returns "" or the error.
inline std::string Execute(int device, const Plan& plan, cudaStream_t stream,
                           std::unordered_map<int64_t, void*>& pack, void* workspace) {
  std::string error;
  DeviceState* dev = GetDevice(device, &error);
  if (dev == nullptr) return error;
  std::lock_guard<std::mutex> lock(dev->mutex);
  try {
    cudnnStatus_t status = fe::detail::set_stream(dev->handle, stream);
    if (status != CUDNN_STATUS_SUCCESS) {
      return std::string("cudnnSetStream failed: ") + fe::detail::get_error_string(status);
    }
    fe::error_t e =
        plan.plan_index >= 0
            ? plan.graph->execute_plan_at_index(dev->handle, pack, workspace, plan.plan_index)
            : plan.graph->execute(dev->handle, pack, workspace);
    if (!e.is_good()) return FeMessage(e, "cuDNN execute");
  } catch (const std::exception& ex) {
    return std::string("cuDNN execute: ") + ex.what();
  }
  return "";
}

}  // namespace attnaux_cuda
