"""The `flash` backend on CPU: attnaux's blocked online-softmax C++ kernels (XLA FFI).

The forward saves only `lse` (plus the inputs and the output); the backward recomputes the
probabilities tile by tile from it. Both kernels are XLA FFI targets (`docs/kernel_abi.md`) with
the canonical operands; the kernel-call layer gives them their vmap rule (one launch for a
vmapped call) and their `custom_vjp`.
"""

import functools

from ._canon import Canonical, Options, Problem
from ._ffi import target_unavailable
from ._kernel_call import (
    BATCH,
    CANONICAL_OPERANDS,
    GRADIENTS,
    KernelOp,
    absent,
    attention_attrs,
    attention_primitive,
    attention_shapes,
    gradient_shapes,
    kernel_operands,
)

FWD_TARGET = "attnaux_flash_fwd"
BWD_TARGET = "attnaux_flash_bwd"

_BACKWARD_EXTRA = (("out", BATCH), ("dout", BATCH), ("lse", BATCH), ("dlse", BATCH))


@functools.cache
def _ops(options: Options) -> tuple[KernelOp, KernelOp]:
    attrs = attention_attrs(options)
    forward = KernelOp(FWD_TARGET, CANONICAL_OPERANDS, ("out", "lse", "max"), attention_shapes,
                       attrs, sequential_if_present=("rng_state",),
                       dropout=("rng_state", True))
    backward = KernelOp(BWD_TARGET, CANONICAL_OPERANDS + _BACKWARD_EXTRA, GRADIENTS,
                        gradient_shapes, attrs, sequential_if_present=("rng_state",),
                        dropout=("rng_state", True))
    return forward, backward


def _forward(options: Options, ops, write_probs: bool):
    r = _ops(options)[0](**ops)
    return r["out"], r["lse"], r["max"], absent(ops["q"].dtype)  # flash writes no P


def _backward(options: Options, ops, out, lse, probs, dout, dlse, dprobs):
    r = _ops(options)[1](**ops, out=out, dout=dout, lse=lse, dlse=dlse)
    return r["dq"], r["dk"], r["dv"], r["dbias"]


_primitive = attention_primitive(_forward, _backward)


def unavailable(problem: Problem, platform: str) -> str | None:
    """Why the CPU kernels cannot serve `problem`, or None."""
    return target_unavailable(FWD_TARGET, platform, problem.arrays.q.dtype)


def run(arrays: Canonical, options: Options, return_probs: bool):
    """`(out [B,Sq,Hq,Dv], lse [B,Hq,Sq], max [B,Hq,Sq], None)` through the C++ kernels."""
    del return_probs  # flash saves no probabilities (the dispatch never asks it to)
    # No zero_hidden_rows pass: the kernels zero, inside a tile, the rows it hides when they hold
    # NaN or inf (attention_cpu.h); the pass cost packed sequences ~30% of the forward.
    out, lse, row_max, _ = _primitive(arrays, options, False)
    return out, lse, row_max, None



def block_backward(arrays: Canonical, options: Options, out, lse, dout, dlse):
    """`(dq, dk, dv)` of one block of a larger attention (context parallelism): the backward
    kernel with the *whole* problem's `out` and `lse` in place of the block's own, so that it
    recomputes the whole problem's probabilities on this block's keys, `P = exp(s - lse)`, and
    its row term `D = rowsum(dout * out) - dlse`: the block's exact share of the gradients."""
    ops = kernel_operands(arrays)
    dq, dk, dv, _ = _backward(options, ops, out, lse, None, dout, dlse, None)
    return dq, dk, dv
