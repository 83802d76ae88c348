"""The `small_seq` backend: one query row against at most 16 keys, for very large batches.

One module for both platforms: the C++ kernels (CPU) and attnaux's CUDA kernels (GPU) are
registered under the same FFI targets and share the probability-saving ABI of
`docs/kernel_abi.md` with `probs` (the backward reads `P`).
"""

from ._canon import Canonical, Options, Problem
from ._ffi import target_unavailable
from ._kernel_call import probs_kernel_primitive
from ._masking import zero_hidden_rows

FWD_TARGET = "attnaux_small_seq_fwd"
BWD_TARGET = "attnaux_small_seq_bwd"
MAX_KV_SEQ = 16
"""Shape limit of `small_seq` (also checked by its kernels): q_seq == 1, kv_seq <= this."""

_primitive = probs_kernel_primitive(FWD_TARGET, BWD_TARGET)


def unavailable(problem: Problem, platform: str) -> str | None:
    """Why `small_seq` cannot serve `problem` on `platform`, or None."""
    q_seq, kv_seq = problem.arrays.q.shape[1], problem.arrays.k.shape[1]
    if q_seq != 1 or kv_seq > MAX_KV_SEQ:
        return (
            f"it needs q_seq == 1 and kv_seq <= {MAX_KV_SEQ} (one query row against a "
            f"handful of keys); got q_seq={q_seq} and kv_seq={kv_seq}"
        )
    return target_unavailable(FWD_TARGET, platform, problem.arrays.q.dtype)


def run(arrays: Canonical, options: Options, return_probs: bool):
    """`(out [B,1,Hq,Dv], lse [B,Hq,1], max [B,Hq,1], probs [B,Hq,1,Skv] or None)`."""
    return _primitive(zero_hidden_rows(arrays, options), options, return_probs)
