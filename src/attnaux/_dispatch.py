"""The one dispatch table: which implementation serves a call, and why the others do not.

`IMPLEMENTATIONS` maps `(backend, platform)` to the sibling module that implements it, with what
it is and which dropout generator it uses. `choose` decides backend, platform and dropout
generator once per call; the backends never ask again, and `explain` reads the same decision.
Every implementation module offers `unavailable(problem, platform) -> str | None` and
`run(arrays, options, return_probs) -> (out, lse, max, probs or None)`.
"""

import dataclasses
import functools
import types
from typing import NamedTuple

import jax
import numpy as np

from . import (
    _ffi,
    _flash_cpu,
    _flash_cudnn,
    _flash_hopper,
    _hopper_mods,
    _hopper_packed,
    _probs_cpu,
    _probs_cuda,
    _reference,
    _small_seq,
    _softmax_kernel,
    _softmax_reference,
)
from ._canon import Problem, parse_statics


class Implementation(NamedTuple):
    """One row of the dispatch table."""

    module: types.ModuleType  # offers unavailable(problem, platform) and run(...)
    description: str  # what runs, as `explain` says it
    dropout_impl: str  # the generator of the dropout keep-mask (AttnAux.dropout_impl)


_CPP = "C++ (XLA FFI, cpu)"
IMPLEMENTATIONS: dict[tuple[str, str], Implementation] = {
    ("flash", "cpu"): Implementation(_flash_cpu, _CPP, "attnaux"),
    ("flash", "gpu"): Implementation(
        _flash_cudnn, "cuDNN fused attention (XLA FFI, gpu)", "cudnn"
    ),
    ("probs", "cpu"): Implementation(_probs_cpu, _CPP, "attnaux"),
    ("probs", "gpu"): Implementation(
        _probs_cuda,
        "XLA GEMMs (cuBLAS) around attnaux's CUDA softmax kernels (XLA FFI, gpu)",
        "attnaux",
    ),
    ("small_seq", "cpu"): Implementation(_small_seq, _CPP, "attnaux"),
    ("small_seq", "gpu"): Implementation(
        _small_seq, "attnaux's CUDA kernels (XLA FFI, gpu)", "attnaux"
    ),
}
"""The compiled implementations, by (backend, platform). `reference` (pure JAX) runs anywhere."""
REFERENCE = Implementation(_reference, "pure JAX (XLA)", "attnaux")
HOPPER_PACKED = Implementation(
    _hopper_packed, "attnaux's Hopper kernels (Pallas Mosaic GPU), packed sequences", "attnaux"
)
CUDA_PACKED = Implementation(  # `varlen_attention`'s mode `cuda-cuda` (`_varlen`)
    _hopper_packed, "attnaux's CUDA C++ Hopper kernels, packed sequences (XLA FFI, gpu)",
    "attnaux"
)
GPU_PACKED_ON_HOPPER = True
"""Whether GPU `flash` serves segment ids on attnaux's Hopper kernels (`_hopper_packed`: per-tile
visiting ranges from the segments, no mask materialised) where they can, instead of cuDNN with
the segments as a dense `[B, 1, q_seq, kv_seq]` mask. Measured with `benchmarks/varlen_gpu.py`
(docs/performance.md, "segment ids on attnaux's Hopper kernels"): at T = 16384 with 16 causal
documents, 16 heads x 128, bf16, the forward took 0.24 ms on an H200, where the dense mask had
taken 4.9 ms on an H100."""
GPU_VARLEN_PREFERS_HOPPER = False
"""Whether `varlen_attention` on GPU `flash` takes attnaux's Hopper kernels before cuDNN's ragged
layout. Off, by measurement (`benchmarks/varlen_gpu.py`, H100, causal, 16 heads x 128, bf16,
4-64 documents of equal and of varied lengths, 2026-11-26, eighth session): cuDNN's ragged
layout was 1.08-1.64x faster forward and 1.21-1.40x forward+backward (FA3 / ragged 0.72-0.84x
forward, 0.81-0.87x forward+backward; FA3 / Hopper kernels 0.48-0.72x, 0.59-0.67x). The Hopper
kernels serve what the ragged layout cannot."""
GPU_VARLEN_CUDA_FORWARD = True
GPU_VARLEN_CUDA_FORWARD_MIN_SEQ = 256
"""Where `varlen_attention` on GPU `flash` (where cuDNN's ragged layout serves it) runs the
forward on attnaux's CUDA C++ Hopper kernel over the packed tokens (`_hopper_packed.
cuda_forward`: a one-CTA kernel builds the block table from the offsets, then a tile counter
hands out (run, 128-row block, head) tiles, each visiting only its sequence's key blocks; it
writes every row, the lse per sequence for the backward too) and differentiates it with
cuDNN's ragged backward: with the switch on, a Hopper GPU, bf16/f16, head dim 64/128/256, no
softcap or dropout, and `max_seqlen_q` at least `GPU_VARLEN_CUDA_FORWARD_MIN_SEQ`. Measured on
an H100 (`benchmarks/varlen_gpu.py`, causal, 16 heads x 128, bf16, 2026-11-28;
docs/performance.md), CUDA forward / cuDNN's ragged forward in time, since the table moved onto
the device: 0.88-0.96x at documents of 256 to 4096 tokens, equal and varied lengths (forward
+backward 0.97-0.99x). Below 256 tokens the two were not measured, and cuDNN keeps them."""
GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD = 16.0
"""The most `cudnn_backward_spread` (tiles cuDNN's ragged backward launches over tiles the
tokens fill) at which `varlen_attention` on GPU `flash` is differentiated by cuDNN's ragged
backward; above it, by attnaux's Hopper kernels' packed backward (`_hopper_packed`, one packed
row: its work follows the tokens, not `max_seqlen_*`), after the CUDA forward where that serves
(mode `cuda-hopper`), else on the Hopper kernels both ways. cuDNN's grid is `num_seqs` x
heads x the 128-row tiles of `max_seqlen_*`, and each tile it launches past a sequence's end
costs about 6-10 ns a head: nothing while `max_seqlen_*` is the longest document, a cliff when
it is a loose static bound (the tokens, say: the bound a jitted caller knows without reading
the lengths). Measured on an H100 (`benchmarks/varlen_gpu.py --max-seqlen tokens` beside the
default, causal, 16 heads x 128, bf16, 2026-11-28, tenth session), cuDNN's backward / the
Hopper kernels' in time: spread 42.7 (16384 tokens, 64 documents of equal or varied lengths,
`max_seqlen` 16384) 2.5x / 2.2x, spread 14.2 (16 documents) 1.0x / 0.9x, 7.1 (8192 / 8) 0.88x,
3.9 (16384 / 4) 0.81x, and with `max_seqlen` the longest document (spread at most 1.6)
0.75-0.81x."""

GPU_VARLEN_CUDA_BACKWARD = True
GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ = 256
"""Where `varlen_attention` on GPU `flash` runs on attnaux's CUDA C++ kernels both ways (mode
`cuda-cuda`: the CUDA forward above, then the CUDA backward over the packed tokens,
`_hopper_packed.cuda_backward`: the key side's block table built on the device, a CTA per 128
keys of a sequence and kv head over its sequence's query tiles; its work follows the tokens,
not `max_seqlen_*`): with the switch on, where the CUDA forward serves, at head dim 128, off
XLA's deterministic mode, and `max_seqlen_q` at least `GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ`.
Measured on an H100 (2026-11-28, twentieth session, `benchmarks/varlen_gpu.py --candidates
"varlen,varlen cuda,varlen cuda-bwd"`, causal, 16 heads x 128, bf16, ms forward+backward), the
CUDA backward / cuDNN's ragged backward after the same CUDA forward / FA3 varlen: 0.873 /
0.894 / 0.813 at 16384 tokens and 16 documents, 0.648 / 0.671 / 0.612 at 64, 0.464 / 0.490 /
0.418 at 8192 / 8, 2.154 / 2.310 / 1.918 at 16384 / 4, 1.032 / 1.060 / 0.933 with 16 documents
of varied lengths, and behind only with 64 varied (`max_seqlen` 448): 0.733 / 0.712 / 0.680.
Below 256 query rows the CUDA forward does not serve either (`GPU_VARLEN_CUDA_FORWARD_MIN_SEQ`).
The kernels a call (`tools/gpu_dev/prof_varlen.py 8192/8`, a timeline, switching this flag):
main kernel 223.8 us against cuDNN's 236.1, first pass 46.7 (cuDNN 47.7, FA3 44.3), the dQ
pass 35.6 (cuDNN 38.6, FA3 33.3)."""

CPU_VARLEN_ROW_MIN_SAVING = 2.0
"""How many times the rows of one packed row `varlen_attention`'s padded layout (`num_seqs x
max_seqlen_*` a side) must be before the CPU `flash` kernels take the sequences in one packed
row with segment ids instead (`_varlen.row_length`; docs/varlen.md). Both ways compute only the
documents' tiles; what differs is the rows moved in and out (and the row's trailing tiles, which
the kernels skip). Measured on 2 Zen 4 cores (float32, causal, 2026-11-28, docs/performance.md):
with `max_seqlen` the tokens, padding 20x / 14x the tight bound's time forward / forward+backward
(4096 tokens, 32 documents) and the row 1.6x / 1.4x; the tight bound keeps the padded layout.
2 is a margin between the two; the crossover itself was not measured."""


def cudnn_backward_spread(num_seqs: int, max_seqlen_q: int, max_seqlen_kv: int,
                          q_tokens: int, kv_tokens: int) -> float:
    """The 128-row tiles cuDNN's ragged backward launches (`num_seqs` x those of
    `max_seqlen_q`, and of `max_seqlen_kv`) over the tiles the tokens fill at most (those of
    the tokens, and a partial one per sequence); static, from the shapes alone."""
    def tiles(n):
        return -(-n // 128)
    launched = num_seqs * (tiles(max_seqlen_q) + tiles(max_seqlen_kv))
    filled = tiles(q_tokens) + tiles(kv_tokens) + 2 * num_seqs
    return launched / max(filled, 1)


FLASH_HOPPER_FORWARD = Implementation(  # `_flash_cudnn` with the Hopper kernel's forward
    types.SimpleNamespace(unavailable=_flash_cudnn.unavailable,
                          run=functools.partial(_flash_cudnn.run,
                                                forward_kernel=_hopper_mods.plain_forward)),
    "attnaux's Hopper forward kernel (Pallas Mosaic GPU) and cuDNN's fused backward (XLA FFI, "
    "gpu)", "attnaux",
)
FLASH_CUDA_BACKWARD = Implementation(  # `_flash_cudnn` with the CUDA C++ backward
    types.SimpleNamespace(unavailable=_flash_cudnn.unavailable,
                          run=functools.partial(_flash_cudnn.run,
                                                backward_kernel=_hopper_mods.plain_backward)),
    "cuDNN's fused forward and attnaux's CUDA C++ Hopper backward (XLA FFI, gpu)", "attnaux",
)
FLASH_HOPPER_BOTH = Implementation(  # `_flash_cudnn` with attnaux's kernels both ways
    types.SimpleNamespace(unavailable=_flash_cudnn.unavailable,
                          run=functools.partial(_flash_cudnn.run,
                                                forward_kernel=_hopper_mods.plain_forward,
                                                backward_kernel=_hopper_mods.plain_backward)),
    "attnaux's Hopper forward kernel (Pallas Mosaic GPU) and its CUDA C++ Hopper backward (XLA "
    "FFI, gpu)", "attnaux",
)
GPU_FORWARD_ON_HOPPER = True
GPU_HOPPER_FORWARD_HEAD_DIMS = (128,)
GPU_HOPPER_FORWARD_MIN_SEQ = 2048
"""Where GPU `flash` runs the forward on attnaux's Hopper kernel (`_flash_hopper.forward`) and
differentiates it with cuDNN's backward (or the CUDA C++ one, `GPU_CUDA_BACKWARD_MIN_SEQ`), which
takes the kernel's out and lse as its residuals:
causal attention (top-left or bottom-right, a window and GQA allowed, a sink after; no bias,
mask, segment ids, sequence lengths, softcap or dropout) at head dim 128 with q_seq and kv_seq
both >= 2048 (the shapes measured had q_seq == kv_seq; shorter query blocks, decode among them,
were not measured and stay on cuDNN).
Measured on an H100 in two runs of `benchmarks/gpu_hopper.py` (bf16, 16 heads, 2026-11-27;
docs/performance.md): causal, the Hopper forward took 1.04-1.14x cuDNN's speed at 2048-16384
tokens; without a mask 0.99-1.04x (a tie: the same kernel measured up to 11% apart within one
run), at 1024 tokens 0.92-0.96x and at head dim 64 0.91-0.93x, so cuDNN keeps those. cuDNN's
backward stays: FA3 / Hopper forward+backward 0.69-0.81x, FA3 / cuDNN 0.79-0.92x."""
GPU_BACKWARD_ON_CUDA = True
GPU_CUDA_BACKWARD_MIN_SEQ = 1024
"""Where GPU `flash` differentiates with attnaux's CUDA C++ Hopper backward
(`_flash_hopper._cuda_backward`, through `_hopper_mods.plain_backward`) instead of cuDNN's,
whichever forward ran: causal attention (top-left or bottom-right, GQA allowed, a sink after; no
window, bias, mask, segment ids, sequence lengths, softcap or dropout) at head dim 128 in
bfloat16 or float16, q_seq and kv_seq both >= 1024 and q_seq a multiple of 64, on a Hopper GPU
with the kernel built, and XLA not asked for deterministic results (its dQ sums come in a
varying order).
Measured on an H100 (2026-11-28, eleventh session, docs/performance.md; bf16, 16 heads x 128,
one call's GPU timeline), the backward's kernels a call, CUDA / cuDNN: causal 306 / 321 us at
8x1024, 436 / 469 at 4x2048, 1225 / 1374 at 1x8192; without a mask 690 / 692 at 4x2048, a tie,
so cuDNN keeps the calls without a causal mask. Windows, head dims 64 and 256 and shorter
sequences were not measured (the kernel serves head dim 128 alone)."""
SAVES_PROBS = {"flash": False, "probs": True, "small_seq": True, "reference": True}
"""Whether a backend can fill `aux.probs` (on every platform)."""
SMALL_SEQ_MAX_KV_SEQ = _small_seq.MAX_KV_SEQ

BACKENDS = ("auto", "flash", "probs", "small_seq", "reference")

AUTO_PROBS_MAX_KV_SEQ = 512
"""On CPU, `backend="auto"` picks `probs` over `flash` for calls with `kv_seq` at most this (and
for any length when `return_probs=True`), DESIGN.md's limit. Measured side by side on the 2-core
CPU (`benchmarks/probs_small_seq.py`), `probs` is faster than `flash` there both forward (its
kernel shares flash's tiles and packs K/V faster; without differentiation it writes no P) and
forward+backward (its backward reads P instead of recomputing the scores): 1.6x / 1.7x at
4x256x8x64 and 1.2x / 1.1x at 4x512x8x64. On GPU `auto` does not use this limit (see
`_auto_probs_max_kv_seq`): cuDNN's flash attention is the faster path there."""


AUTO_PROBS_MAX_KV_SEQ_AMX = 128
"""`AUTO_PROBS_MAX_KV_SEQ` for bfloat16 on a CPU whose `flash` kernels run on AMX tiles
(`_ffi.cpu_amx_tiles()`) at head dims whose products the tiles take both ways (multiples of 64):
there `flash` measured 2.2x / 2.2x `probs` (forward / forward+backward GFLOP/s) at 4x512x8x64,
1.7x / 1.7x causal, 1.6x / 1.3x at 8x256x8x64 and level at 16x128x8x64 causal (2 cores of a
Sapphire Rapids Xeon, 2026-11-28, the probs kernels on VDPBF16PS)."""


def _auto_probs_max_kv_seq(platform: str, problem: Problem | None = None) -> int:
    if platform != "cpu":
        return 0
    if problem is not None and _amx_flash(problem):
        return AUTO_PROBS_MAX_KV_SEQ_AMX
    return AUTO_PROBS_MAX_KV_SEQ


def _amx_flash(problem: Problem) -> bool:
    """Whether the CPU `flash` kernels run this call's products on AMX tiles both ways."""
    a = problem.arrays
    return (a.q.dtype == jax.numpy.bfloat16 and a.q.shape[-1] % 64 == 0 and a.v.shape[-1] % 64 == 0
            and _ffi.cpu_amx_tiles())


GPU_AUTO_PROBS_MAX_PAIRS = 2**21
GPU_AUTO_PROBS_MAX_PAIRS_MASKED = 2**23
GPU_AUTO_PROBS_MIN_Q_SEQ = 128
"""On GPU, `backend="auto"` picks `probs` over `flash` (cuDNN) for calls so small that per-call
cost decides: `batch * q_heads * q_seq * kv_seq` at most `GPU_AUTO_PROBS_MAX_PAIRS` (2**21 score
entries), or `GPU_AUTO_PROBS_MAX_PAIRS_MASKED` (2**23) with a boolean mask (which cuDNN reads as a
bias), with `q_seq >= GPU_AUTO_PROBS_MIN_Q_SEQ` and `kv_seq <= AUTO_PROBS_MAX_KV_SEQ`, the range
measured. Derived from `python benchmarks/gpu_auto_table.py` on an H100 (bf16; the table is in
docs/backends.md): at 4 x 8 heads and s = 128 or 256 `probs` was faster than `flash` in all 12
rows forward and forward+backward (1.3-2.4x forward+backward); at 2**22 pairs (16 x 16 x 128)
the two were within 1.2x either way; from 2**24 pairs on `flash` won every row, up to 8x. With a
mask `probs` stayed ahead up to 4 x 8 x 512 (forward+backward 1.39x)."""


def gpu_prefers_probs(problem: Problem) -> str | None:
    """The measured rule (`GPU_AUTO_PROBS_MAX_PAIRS`) by which GPU `auto` prefers `probs`, as the
    reason `explain` cites, or None when it does not apply."""
    bsz, q_seq, q_heads, _ = problem.arrays.q.shape
    kv_seq = problem.arrays.k.shape[1]
    masked = problem.arrays.mask is not None
    limit = GPU_AUTO_PROBS_MAX_PAIRS_MASKED if masked else GPU_AUTO_PROBS_MAX_PAIRS
    pairs = bsz * q_heads * q_seq * kv_seq
    if q_seq < GPU_AUTO_PROBS_MIN_Q_SEQ or kv_seq > AUTO_PROBS_MAX_KV_SEQ or pairs > limit:
        return None
    limit_name = "GPU_AUTO_PROBS_MAX_PAIRS" + ("_MASKED" if masked else "")
    return (f"batch * q_heads * q_seq * kv_seq = {pairs} <= {limit} ({limit_name}): at this "
            "size per-call cost decides, and probs measured faster than cuDNN on an H100 "
            "(benchmarks/gpu_auto_table.py, docs/backends.md)")


GPU_AUTO_SMALL_SEQ = True
"""Whether `backend="auto"` picks `small_seq` on GPU when the shapes fit (it always does on CPU).

Measured on an H100 (`python benchmarks/gpu_kernels.py small_seq`, batch 30720, 8 heads, head
dim 128, kv_seq 16, bf16, one run, 2026-11-24): `small_seq` forward 0.746 ms (98% of the device
copy bandwidth), forward+backward 2.271 ms; `reference` 0.776 / 2.366 ms; cuDNN `flash` 2.592 /
10.808 ms. `small_seq` is the fastest path both ways there (on an H200 its forward had measured
0.87x the reference path's, within 1.15x), and cuDNN, which `auto` picked before, 3.5x / 4.8x
slower."""
GPU_SMALL_SEQ_MEASURED = (
    "fastest on GPU at these shapes (H100, batch 30720, 8 heads, head dim 128, kv_seq 16, bf16: "
    "forward 1.04x the reference path and 3.5x cuDNN, forward+backward 1.04x and 4.8x)"
)
"""Why, in `explain`'s words: the measured comparison on GPU (`benchmarks/gpu_kernels.py`)."""


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What `attnaux.explain` returns.

    **Fields:**

    - `backend`: the backend that would run (`"flash"`, `"probs"`, `"small_seq"` or
      `"reference"`; `"flex"` for a call with `score_mod`/`mask_mod`).
    - `implementation`: how it runs on this platform (for example `"C++ (XLA FFI, cpu)"`).
    - `platform`: the JAX platform the choice was made for (`"cpu"`, `"gpu"`, ...).
    - `reasons`: for every backend, why it was chosen or why not.
    - `dropout_impl`: the generator that draws a dropout keep-mask there (`"attnaux"`:
      attnaux's documented Philox; `"cudnn"`: cuDNN's own), as `AttnAux.dropout_impl` records.
    - `packed`: for packed sequences (segment ids, or `varlen_attention`), how they reach the
      kernels; `""` otherwise.
    """

    backend: str
    implementation: str
    platform: str
    reasons: dict[str, str]
    dropout_impl: str = "attnaux"
    packed: str = ""

    def __str__(self) -> str:
        lines = [f"backend: {self.backend} ({self.implementation}) on {self.platform}"]
        for name, why in self.reasons.items():
            mark = "*" if name == self.backend else "-"
            lines.append(f"  {mark} {name}: {why}")
        if self.packed:
            lines.append(f"  packed sequences: {self.packed}")
        return "\n".join(lines)


def check_backend(backend: object) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        options = ", ".join(map(repr, BACKENDS))
        raise ValueError(f"`backend` must be one of {options}; got {backend!r}.")
    return backend


def _check_return_probs(return_probs: object) -> bool:
    if not isinstance(return_probs, (bool, np.bool_)):
        raise TypeError(f"`return_probs` must be a bool; got {return_probs!r}.")
    return bool(return_probs)


def call_statics(scale, causal, window, softcap, dropout_rate, return_probs, backend) -> dict:
    """The static options of an `attention` or `varlen_attention` call, parsed once, before they
    key the jit cache (they must be hashable)."""
    return dict(
        statics=parse_statics(scale=scale, causal=causal, window=window, softcap=softcap,
                              dropout_rate=dropout_rate),
        return_probs=_check_return_probs(return_probs),
        backend=check_backend(backend),
    )


def _plain_causal(problem: Problem) -> bool:
    """Causal attention (a window allowed) with no bias, mask, segment ids, sequence lengths,
    softcap or dropout: what attnaux's Hopper forward and CUDA backward take in cuDNN's place."""
    a, o = problem.arrays, problem.options
    return (a.bias is None and a.mask is None and a.q_segment_ids is None
            and a.kv_segment_ids is None and not o.has_seqlens and o.softcap == 0
            and o.dropout_rate == 0 and o.causal != 0)


def gpu_forward_on_hopper(problem: Problem) -> str | None:
    """Why GPU `flash` runs this call's forward on attnaux's Hopper kernel
    (`GPU_HOPPER_FORWARD_MIN_SEQ`), or None where cuDNN runs it."""
    a, o = problem.arrays, problem.options
    if not GPU_FORWARD_ON_HOPPER or _flash_hopper.device_unavailable(a.q, a.k, a.v) is not None:
        return None
    dim, q_seq, kv_seq = a.q.shape[-1], a.q.shape[1], a.k.shape[1]
    if (not _plain_causal(problem) or dim not in GPU_HOPPER_FORWARD_HEAD_DIMS
            or min(q_seq, kv_seq) < GPU_HOPPER_FORWARD_MIN_SEQ
            or _flash_cudnn.padding_needed(o, q_seq, kv_seq)):
        return None
    return (f"forward on attnaux's Hopper kernel (causal attention, head "
            f"dim {dim}, q_seq={q_seq} and kv_seq={kv_seq} >= {GPU_HOPPER_FORWARD_MIN_SEQ}: "
            "GPU_HOPPER_FORWARD_MIN_SEQ, measured faster than cuDNN's forward there)")


def gpu_backward_on_cuda(problem: Problem) -> str | None:
    """Why GPU `flash` differentiates this call with attnaux's CUDA C++ Hopper backward
    (`GPU_CUDA_BACKWARD_MIN_SEQ`), or None where cuDNN's backward runs."""
    a, o = problem.arrays, problem.options
    if not GPU_BACKWARD_ON_CUDA or _flash_hopper.device_unavailable(a.q, a.k, a.v) is not None:
        return None
    q_seq, kv_seq = a.q.shape[1], a.k.shape[1]
    windowed = o.window_left >= 0 or o.window_right >= 0
    if (not _plain_causal(problem) or windowed or a.q.shape[-1] != 128 or a.v.shape[-1] != 128
            or a.q.dtype not in (np.dtype("bfloat16"), np.dtype("float16"))
            or q_seq % _flash_hopper.BLOCK_Q or min(q_seq, kv_seq) < GPU_CUDA_BACKWARD_MIN_SEQ
            or _flash_cudnn.padding_needed(o, q_seq, kv_seq)
            or _flash_hopper.deterministic_requested()
            or not _ffi.has_target(_flash_hopper.CUDA_BACKWARD_TARGET, "gpu")):
        return None
    return (f"backward on attnaux's CUDA C++ Hopper kernel (causal attention, head dim 128, "
            f"q_seq={q_seq} and kv_seq={kv_seq} >= {GPU_CUDA_BACKWARD_MIN_SEQ}: "
            "GPU_CUDA_BACKWARD_MIN_SEQ, measured faster than cuDNN's backward there)")


def _platform() -> str:
    return jax.default_backend()


def implementation(backend: str, platform: str) -> Implementation | None:
    """The table's row for `backend` on `platform` (None: no compiled implementation there)."""
    if backend == "reference":
        return REFERENCE
    return IMPLEMENTATIONS.get((backend, platform))


def _unavailable(backend: str, problem: Problem, platform: str, return_probs: bool) -> str | None:
    if return_probs and not SAVES_PROBS[backend]:
        return (
            "does not save the probabilities (return_probs=True); use backend='probs' (any "
            f"shape), 'small_seq' (q_seq == 1 and kv_seq <= {SMALL_SEQ_MAX_KV_SEQ}), "
            "'reference' or 'auto'"
        )
    impl = implementation(backend, platform)
    if impl is None:
        return f"no compiled implementation for the {platform!r} platform in this build"
    return impl.module.unavailable(problem, platform)


class Choice(NamedTuple):
    """What `choose` decided: the explanation and the implementation that runs."""

    explanation: "Explanation"
    implementation: Implementation


def choose(problem: Problem, backend: str, return_probs: bool) -> Choice:
    """Picks the backend for a validated call; raises if an explicit request cannot be served.

    `auto` prefers, in order: `small_seq` whenever the static shapes fit (q_seq == 1 and
    kv_seq <= 16; on GPU when `GPU_AUTO_SMALL_SEQ`); `probs` when `return_probs=True` (or, on CPU,
    kv_seq <= `AUTO_PROBS_MAX_KV_SEQ`; on GPU, calls within `GPU_AUTO_PROBS_MAX_PAIRS`);
    `flash`; on GPU `probs` when cuDNN cannot serve
    the call; and `reference` when no compiled backend can serve the call.
    """
    backend = check_backend(backend)
    platform = _platform()
    kv_seq = problem.arrays.k.shape[1]
    probs_limit = _auto_probs_max_kv_seq(platform, problem)
    flash_no = _unavailable("flash", problem, platform, return_probs)
    probs_no = _unavailable("probs", problem, platform, return_probs)
    gpu_rule = gpu_prefers_probs(problem) if platform == "gpu" else None
    small_no = _unavailable("small_seq", problem, platform, return_probs)
    flash_impl = implementation("flash", platform)
    flash_form = getattr(getattr(flash_impl, "module", None), "describe", lambda _: None)
    flash_note = flash_form(problem) if flash_no is None else None
    reasons = {
        "flash": flash_no or "serves every option here; O(seq) memory" + (
            f"; {flash_note}" if flash_note else ""),
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
        elif probs_no is None and (return_probs or kv_seq <= probs_limit or (
                platform == "gpu" and flash_no is None and gpu_rule is not None)):
            chosen = "probs"
            if return_probs:
                why = "return_probs=True"
            elif kv_seq <= probs_limit:
                name = ("AUTO_PROBS_MAX_KV_SEQ_AMX" if platform == "cpu" and _amx_flash(problem)
                        else "AUTO_PROBS_MAX_KV_SEQ")
                why = (f"kv_seq={kv_seq} <= {probs_limit} ({name}; it measures faster than "
                       f"flash there)")
            else:
                why = gpu_rule
            reasons["probs"] += f"; chosen because {why}"
            if flash_no is None:
                reasons["flash"] += (
                    "; not chosen: probs is preferred for "
                    + (f"kv_seq <= {probs_limit}" if platform != "gpu" or return_probs
                       else "calls this small")
                )
        elif flash_no is None:
            chosen = "flash"
            if probs_no is None:
                if platform == "gpu":
                    reasons["probs"] += (
                        "; not chosen: flash measures faster on GPU above "
                        "GPU_AUTO_PROBS_MAX_PAIRS (batch * q_heads * q_seq * kv_seq; "
                        "benchmarks/gpu_auto_table.py) and needs O(seq) memory; auto uses "
                        "probs when return_probs=True"
                    )
                else:
                    amx = _amx_flash(problem)
                    reasons["probs"] += (
                        "; not chosen: flash measures as fast for longer key sequences"
                        + (" (bfloat16 on AMX tiles: faster from 256 keys)" if amx else "")
                        + " and needs O(seq) memory; auto uses probs when return_probs=True (or "
                        + ("kv_seq <= AUTO_PROBS_MAX_KV_SEQ_AMX" if amx
                           else "kv_seq <= AUTO_PROBS_MAX_KV_SEQ")
                        + f" = {probs_limit})"
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
    packed = ""
    impl = implementation(chosen, platform)
    hopper_forward = (gpu_forward_on_hopper(problem)
                      if chosen == "flash" and platform == "gpu" else None)
    cuda_backward = (gpu_backward_on_cuda(problem)
                     if chosen == "flash" and platform == "gpu" else None)
    if hopper_forward is not None:
        impl = FLASH_HOPPER_FORWARD if cuda_backward is None else FLASH_HOPPER_BOTH
        reasons["flash"] += f"; {hopper_forward}"
    elif cuda_backward is not None:
        impl = FLASH_CUDA_BACKWARD
    if cuda_backward is not None:
        reasons["flash"] += f"; {cuda_backward}"
    if problem.arrays.q_segment_ids is not None:
        hopper_no = (_hopper_packed.unavailable(problem, platform) if GPU_PACKED_ON_HOPPER
                     else "GPU_PACKED_ON_HOPPER is off")
        if platform == "cpu":
            packed = "segment ids: the CPU kernels skip every tile whose keys lie in other segments"
        elif chosen == "flash" and hopper_no is None:
            impl = HOPPER_PACKED
            packed = ("segment ids: attnaux's Hopper kernels visit only the tiles whose segments "
                      "meet (visiting ranges from per-tile segment and position bounds)")
            reasons["flash"] += "; packed sequences on attnaux's Hopper kernels"
        else:
            packed = ("segment ids reach the GPU kernels as a dense [B, 1, q_seq, kv_seq] mask"
                      + (f" (attnaux's Hopper kernels: {hopper_no})" if chosen == "flash"
                         else ""))
    dropout_impl = impl.dropout_impl if problem.has_dropout else "attnaux"
    return Choice(
        Explanation(chosen, impl.description, platform, reasons, dropout_impl, packed), impl
    )


# ------------------------------------------------------------------------------------------------
# attnaux.softmax
# ------------------------------------------------------------------------------------------------
SOFTMAX_BACKENDS = ("auto", "kernel", "reference")
SOFTMAX_IMPLEMENTATIONS: dict[tuple[str, str], Implementation] = {
    ("kernel", "cpu"): Implementation(_softmax_kernel, "C++ kernel (XLA FFI, cpu)", "attnaux"),
    ("kernel", "gpu"): Implementation(
        _softmax_kernel, "CUDA kernel (XLA FFI, gpu)", "attnaux"
    ),
}
"""The compiled softmax, by platform (one module: the same FFI targets on both)."""
SOFTMAX_REFERENCE = Implementation(_softmax_reference, "pure JAX (XLA)", "attnaux")


class SoftmaxChoice(NamedTuple):
    backend: str  # "kernel" or "reference"
    module: types.ModuleType  # offers run(options, logits, mask)
    description: str
    why_not_kernel: str | None


def choose_softmax(backend: str, dtype) -> SoftmaxChoice:
    """Picks the softmax implementation for logits of `dtype` on this platform; raises if
    `backend="kernel"` cannot serve the call."""
    platform = _platform()
    impl = SOFTMAX_IMPLEMENTATIONS.get(("kernel", platform))
    if impl is None:
        why_not = f"no compiled softmax kernel for the {platform!r} platform in this build"
    else:
        why_not = impl.module.unavailable(dtype, platform)
    if backend == "kernel" and why_not is not None:
        raise ValueError(
            f"`backend='kernel'` cannot serve this call: {why_not}. Use backend='auto' (which "
            "falls back to the pure-JAX path) or backend='reference'."
        )
    if backend == "reference" or why_not is not None:
        ref = SOFTMAX_REFERENCE
        return SoftmaxChoice("reference", ref.module, ref.description, why_not)
    return SoftmaxChoice("kernel", impl.module, impl.description, None)
