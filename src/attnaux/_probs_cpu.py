"""The `probs` backend on CPU: attnaux's C++ kernels that also write the probabilities.

Its kernels work on blocks of query rows against every key they see; the forward writes `P`
when it is returned or differentiated, and the backward reads `P` instead of recomputing the
scores (the probability-saving ABI of `docs/kernel_abi.md`, shared with `small_seq`).
"""

from ._canon import Canonical, Options, Problem
from ._ffi import target_unavailable
from ._kernel_call import probs_kernel_primitive
from ._masking import zero_hidden_rows

FWD_TARGET = "attnaux_probs_fwd"
BWD_TARGET = "attnaux_probs_bwd"

_primitive = probs_kernel_primitive(FWD_TARGET, BWD_TARGET)


def unavailable(problem: Problem, platform: str) -> str | None:
    """Why the CPU kernels cannot serve `problem`, or None."""
    return target_unavailable(FWD_TARGET, platform, problem.arrays.q.dtype)


def run(arrays: Canonical, options: Options, return_probs: bool):
    """`(out [B,Sq,Hq,Dv], lse [B,Hq,Sq], max [B,Hq,Sq], probs [B,Hq,Sq,Skv] or None)`; `probs`
    is returned (and differentiable) exactly when `return_probs` is true."""
    return _primitive(zero_hidden_rows(arrays, options), options, return_probs)
