"""Backend choice: which backend serves a call, and why the others do not."""

import dataclasses

import jax
import jax.numpy as jnp

from . import _ffi
from ._canon import Problem
from ._flash import FWD_TARGET
from ._probs import SMALL_SEQ_MAX_KV_SEQ
from ._probs import TARGETS as _PROBS_TARGETS
from ._probs_gpu import FWD_TARGET as _PROBS_GPU_TARGET

BACKENDS = ("auto", "flash", "probs", "small_seq", "reference")

AUTO_PROBS_MAX_KV_SEQ = 512
"""On CPU, `backend="auto"` picks `probs` over `flash` for calls with `kv_seq` at most this (and
for any length when `return_probs=True`), DESIGN.md's limit. Measured side by side on the 2-core
CPU (`benchmarks/probs_small_seq.py`), `probs` is faster than `flash` there both forward (its
kernel shares flash's tiles and packs K/V faster; without differentiation it writes no P) and
forward+backward (its backward reads P instead of recomputing the scores): 1.6x / 1.7x at
4x256x8x64 and 1.2x / 1.1x at 4x512x8x64. On GPU `auto` does not use this limit (see
`_auto_probs_max_kv_seq`): cuDNN's flash attention is the faster path there."""


def _auto_probs_max_kv_seq(platform: str) -> int:
    return AUTO_PROBS_MAX_KV_SEQ if platform == "cpu" else 0


GPU_AUTO_SMALL_SEQ = False
"""Whether `backend="auto"` picks `small_seq` on GPU when the shapes fit (it always does on CPU).

Measured on an H200 (`python benchmarks/gpu_kernels.py`, batch 30720, 8 heads, head dim 128,
kv_seq 16, bf16): the CUDA kernel's forward takes 0.628 ms (83% of the device copy bandwidth)
against 0.545 ms for the reference path, whose fused XLA reductions stream K and V at 96% of
copy; forward+backward it is 1.14x faster (1.83 vs 2.08 ms) and 6x faster than cuDNN. `auto`
cannot tell inference from training, so it leaves `small_seq` to explicit requests on GPU."""
GPU_SMALL_SEQ_MEASURED = (
    "on GPU its forward measures slower than the reference path (0.87x on an H200 at batch "
    "30720, 8 heads, head dim 128, kv_seq 16, bf16), though forward+backward is 1.14x faster: "
    "ask for backend='small_seq' when training"
)
"""Why, in `explain`'s words: the measured comparison on GPU (`benchmarks/gpu_kernels.py`)."""


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What `attnaux.explain` returns.

    **Fields:**

    - `backend`: the backend that would run (`"flash"`, `"probs"`, `"small_seq"` or
      `"reference"`).
    - `implementation`: how it runs on this platform (for example `"C++ (XLA FFI, cpu)"`).
    - `platform`: the JAX platform the choice was made for (`"cpu"`, `"gpu"`, ...).
    - `reasons`: for every backend, why it was chosen or why not.
    """

    backend: str
    implementation: str
    platform: str
    reasons: dict[str, str]

    def __str__(self) -> str:
        lines = [f"backend: {self.backend} ({self.implementation}) on {self.platform}"]
        for name, why in self.reasons.items():
            mark = "*" if name == self.backend else "-"
            lines.append(f"  {mark} {name}: {why}")
        return "\n".join(lines)


def check_backend(backend: object) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        options = ", ".join(map(repr, BACKENDS))
        raise ValueError(f"`backend` must be one of {options}; got {backend!r}.")
    return backend


def _platform() -> str:
    return jax.default_backend()


def _compiled_unavailable(problem: Problem, platform: str, target: str) -> str | None:
    if problem.arrays.q.dtype == jnp.float64:
        return "float64 inputs run only on the reference backend"
    if not _ffi.has_target(target, platform):
        if _ffi.IMPORT_ERROR is not None:
            return f"the compiled extension is not available ({_ffi.IMPORT_ERROR})"
        return f"no compiled implementation for the {platform!r} platform in this build"
    return None


def _flash_unavailable(problem: Problem, platform: str, return_probs: bool) -> str | None:
    if return_probs:
        return (
            "does not save the probabilities (return_probs=True); use backend='probs' (any "
            f"shape), 'small_seq' (q_seq == 1 and kv_seq <= {SMALL_SEQ_MAX_KV_SEQ}), "
            "'reference' or 'auto'"
        )
    if platform == "gpu":  # cuDNN fused attention (see _flash_cuda.py)
        from ._flash_cuda import unavailable as cuda_unavailable

        return cuda_unavailable(problem)
    return _compiled_unavailable(problem, platform, FWD_TARGET)


def _probs_unavailable(problem: Problem, platform: str) -> str | None:
    # On GPU: XLA's GEMMs around attnaux's CUDA softmax kernels (_probs_gpu.py).
    target = _PROBS_GPU_TARGET if platform == "gpu" else _PROBS_TARGETS["probs"][0]
    return _compiled_unavailable(problem, platform, target)


def _implementation(backend: str, platform: str) -> str:
    if backend == "reference":
        return "pure JAX (XLA)"
    if platform != "gpu":
        return f"C++ (XLA FFI, {platform})"
    return {
        "flash": "cuDNN fused attention (XLA FFI, gpu)",
        "probs": "XLA GEMMs (cuBLAS) around attnaux's CUDA softmax kernels (XLA FFI, gpu)",
        "small_seq": "attnaux's CUDA kernels (XLA FFI, gpu)",
    }[backend]


def _small_seq_unavailable(problem: Problem, platform: str) -> str | None:
    q_seq, kv_seq = problem.arrays.q.shape[1], problem.arrays.k.shape[1]
    if q_seq != 1 or kv_seq > SMALL_SEQ_MAX_KV_SEQ:
        return (
            f"it needs q_seq == 1 and kv_seq <= {SMALL_SEQ_MAX_KV_SEQ} (one query row against a "
            f"handful of keys); got q_seq={q_seq} and kv_seq={kv_seq}"
        )
    return _compiled_unavailable(problem, platform, _PROBS_TARGETS["small_seq"][0])


def choose(problem: Problem, backend: str, return_probs: bool) -> Explanation:
    """Picks the backend for a validated call; raises if an explicit request cannot be served.

    `auto` prefers, in order: `small_seq` whenever the static shapes fit (q_seq == 1 and
    kv_seq <= 16; on GPU when `GPU_AUTO_SMALL_SEQ`); `probs` when `return_probs=True` (or, on CPU,
    kv_seq <= `AUTO_PROBS_MAX_KV_SEQ`); `flash`; on GPU `probs` when cuDNN cannot serve
    the call; and `reference` when no compiled backend can serve the call.
    """
    backend = check_backend(backend)
    platform = _platform()
    kv_seq = problem.arrays.k.shape[1]
    probs_limit = _auto_probs_max_kv_seq(platform)
    flash_no = _flash_unavailable(problem, platform, return_probs)
    probs_no = _probs_unavailable(problem, platform)
    small_no = _small_seq_unavailable(problem, platform)
    reasons = {
        "flash": flash_no or "serves every option here; O(seq) memory",
        "probs": probs_no or "serves every option here; saves the probabilities "
        "[B, q_heads, q_seq, kv_seq] when training or when return_probs=True",
        "small_seq": small_no or f"the static shapes fit (q_seq == 1, kv_seq={kv_seq} <= "
        f"{SMALL_SEQ_MAX_KV_SEQ}): one query row against a handful of keys per (batch, head)",
        "reference": "pure JAX; materialises the q_seq x kv_seq scores",
    }

    small_auto_no = small_no
    if small_no is None and platform == "gpu" and not GPU_AUTO_SMALL_SEQ:
        small_auto_no = GPU_SMALL_SEQ_MEASURED
        reasons["small_seq"] += f"; not picked by auto: {small_auto_no}"

    if backend == "auto":
        if small_auto_no is None:
            chosen = "small_seq"
            reasons["small_seq"] += "; chosen whenever the static shapes fit"
            if platform == "gpu":
                reasons["small_seq"] += f" ({GPU_SMALL_SEQ_MEASURED})"
            for other, other_no in (("flash", flash_no), ("probs", probs_no)):
                if other_no is None:
                    reasons[other] += "; not chosen: small_seq serves this shape"
        elif probs_no is None and (return_probs or kv_seq <= probs_limit):
            chosen = "probs"
            why = ("return_probs=True" if return_probs else
                   f"kv_seq={kv_seq} <= {probs_limit} (AUTO_PROBS_MAX_KV_SEQ; it measures "
                   f"faster than flash there)")
            reasons["probs"] += f"; chosen because {why}"
            if flash_no is None:
                reasons["flash"] += (
                    f"; not chosen: probs is preferred for kv_seq <= {probs_limit}"
                )
        elif flash_no is None:
            chosen = "flash"
            if probs_no is None:
                faster = ("measures faster (on GPU except on tiny calls, where per-call overhead "
                          "dominates; docs/performance.md)" if platform == "gpu"
                          else "measures as fast for longer key sequences")
                reasons["probs"] += (
                    f"; not chosen: flash {faster} and needs O(seq) memory; auto uses "
                    f"probs when return_probs=True (or kv_seq <= AUTO_PROBS_MAX_KV_SEQ = "
                    f"{probs_limit})"
                )
        elif probs_no is None and platform == "gpu":
            # cuDNN cannot serve the call (float32, softcap with a bias, ...): on GPU the probs
            # backend (cuBLAS GEMMs + one fused CUDA softmax) is faster than the reference path,
            # which runs float32 GEMMs and several elementwise passes over the scores.
            chosen = "probs"
            reasons["probs"] += (
                "; chosen because flash (cuDNN) cannot serve this call and probs measures "
                "faster than reference on GPU"
            )
        else:
            chosen = "reference"
            reasons["reference"] += "; chosen because no compiled backend can serve this call"
    else:
        chosen = backend
        why_not = {"flash": flash_no, "probs": probs_no, "small_seq": small_no}.get(chosen)
        if why_not is not None:
            raise ValueError(f"backend={chosen!r} cannot serve this call: {why_not}.")
    implementation = _implementation(chosen, platform)
    return Explanation(chosen, implementation, platform, reasons)
