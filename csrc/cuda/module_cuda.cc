// pybind11 module attnaux._ext_cuda: the GPU `flash` handlers (cuDNN fused attention) as capsules
// for attnaux._ffi, plus a view of the cuDNN graph cache for tests and `explain`.
//
// Importing this module loads no CUDA library beyond the statically linked CUDA runtime: libcudnn
// is looked up on the first graph build (cudnn_graphs.h, EnsureCudnnLoaded).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "common/ffi_capsule.h"
#include "cuda/flash_cuda.h"

namespace py = pybind11;

using attnaux::HandlerCapsule;

PYBIND11_MODULE(_ext_cuda, m) {
  m.doc() = "attnaux's GPU kernels: cuDNN fused attention behind XLA FFI handlers.";
  m.def(
      "registrations",
      []() {
        py::dict handlers;
        handlers["attnaux_flash_fwd_cudnn"] = HandlerCapsule(AttnauxFlashFwdCudnn);
        handlers["attnaux_flash_bwd_cudnn"] = HandlerCapsule(AttnauxFlashBwdCudnn);
        return handlers;
      },
      "Target name -> capsule of its XLA_FFI_Handler*, for jax.ffi.register_ffi_target "
      "(platform 'CUDA').");
  m.def("set_library_hints", &attnaux_cuda::SetLibraryHints, py::arg("cudnn"), py::arg("cudart"),
        "Paths to dlopen when libcudnn.so.9 / libcudart are not loaded yet (empty: none).");
  m.def("cudnn_version", &attnaux_cuda::LoadedCudnnVersion,
        "The version of the loaded libcudnn (e.g. 91901), or -1 when it cannot be loaded.");
  m.def(
      "check_support",
      [](int device, int dtype, int64_t b, int64_t hq, int64_t hk, int64_t sq, int64_t skv,
         int64_t d, int64_t dv, int64_t bias_b, int64_t bias_h, bool padding, int causal,
         int64_t window_left, int64_t window_right, float scale, bool backward, bool with_max,
         bool try_f32_bias, float softcap, float dropout, bool rng_dump, bool composite,
         bool bias_grad, bool ragged, int64_t total_q, int64_t total_kv) {
        bool bias_f32 = true;
        int64_t workspace = 0;
        std::string error;
        {
          py::gil_scoped_release release;
          error = attnaux_cuda::CheckSupport(device, dtype, b, hq, hk, sq, skv, d, dv, bias_b,
                                             bias_h, padding, causal, window_left, window_right,
                                             scale, backward, with_max, try_f32_bias, softcap,
                                             dropout, rng_dump, composite, bias_grad, ragged,
                                             total_q, total_kv,
                                             &bias_f32, &workspace);
        }
        return py::make_tuple(error, bias_f32, workspace);
      },
      py::arg("device"), py::arg("dtype"), py::arg("b"), py::arg("hq"), py::arg("hk"),
      py::arg("sq"), py::arg("skv"), py::arg("d"), py::arg("dv"), py::arg("bias_b"),
      py::arg("bias_h"), py::arg("padding"), py::arg("causal"), py::arg("window_left"),
      py::arg("window_right"), py::arg("scale"), py::arg("backward"), py::arg("with_max"),
      py::arg("try_f32_bias"), py::arg("softcap") = 0.0f, py::arg("dropout") = 0.0f,
      py::arg("rng_dump") = false, py::arg("composite") = false, py::arg("bias_grad") = true,
      py::arg("ragged") = false, py::arg("total_q") = 0, py::arg("total_kv") = 0,
      "Builds (once) and caches the cuDNN graph of this configuration; returns (reason, "
      "bias_f32, workspace_bytes): reason '' when cuDNN serves it, whether it takes the bias in "
      "float32 (else in the input dtype), and the workspace it needs.");
  m.def(
      "graph_cache_size", []() { return attnaux_cuda::GetCacheStats().size; },
      "Number of cuDNN graph configurations built (or rejected) so far.");
  m.def(
      "graph_cache_stats",
      []() {
        auto s = attnaux_cuda::GetCacheStats();
        py::dict d;
        d["size"] = s.size;
        d["builds"] = s.builds;
        d["hits"] = s.hits;
        return d;
      },
      "{'size', 'builds', 'hits'} of the cuDNN graph cache.");
  m.def("graph_cache_entries", &attnaux_cuda::GetCacheEntries,
        "[(configuration key, 'ok; workspace ...' or the reason it was rejected)].");
}
