"""The `flash` backend on CPU: attnaux's blocked online-softmax C++ kernels (XLA FFI).

The forward saves only `lse` (plus the inputs and the output); the backward recomputes the
probabilities tile by tile from it. Both kernels are XLA FFI targets (`docs/kernel_abi.md`) with
the canonical operands; the kernel-call layer gives them their vmap rule (one launch for a
vmapped call) and their `custom_vjp`. With at most `DECODE_MAX_Q_SEQ` query rows the same targets
take their decode form (`csrc/cpu/decode_cpu.h`; `describe` tells `explain`).

`run_mods` is the same kernels with `score_mod`/`mask_mod` compiled in: the targets
`attnaux_flash_mod_fwd/_bwd` take a score program (`_score_program.py`), the captured arrays
flat, and mask_mod's table of 64 x 64 tiles, and return the captured arrays' gradient.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ._canon import Canonical, Options, Problem
from ._ffi import target_unavailable
from ._kernel_call import (
    BATCH,
    BROADCAST,
    CANONICAL_OPERANDS,
    GRADIENTS,
    SHARED,
    KernelOp,
    absent,
    attention_attrs,
    attention_primitive,
    attention_shapes,
    compiled_vjp,
    fixed_order_sum,
    gradient_shapes,
    kernel_operands,
    parameter_gradients,
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


DECODE_MAX_Q_SEQ = 16
DECODE_MAX_ROWS = 64
"""The decode form of the kernels (`csrc/cpu/decode_cpu.h`: `kDecodeMaxQ`, `kDecodeMaxRows`):
calls with at most this many query rows (and GQA group x q_seq rows per kv head), and no bias,
mask, segment ids or dropout."""


def describe(problem: Problem) -> str | None:
    """How the kernels serve `problem` when that is worth saying (`explain`)."""
    arrays, options = problem.arrays, problem.options
    q_seq, q_heads = arrays.q.shape[1], arrays.q.shape[2]
    group = q_heads // arrays.k.shape[2]
    if (1 <= q_seq <= DECODE_MAX_Q_SEQ and group * q_seq <= DECODE_MAX_ROWS
            and arrays.bias is None and arrays.mask is None and arrays.q_segment_ids is None
            and options.dropout_rate == 0):
        return (f"q_seq={q_seq} <= {DECODE_MAX_Q_SEQ}: its decode form (each kv head's K and V "
                f"read once for its {group * q_seq} query rows, at memory speed)")
    return None


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


# ------------------------------------------------------------------------------------------------
# score_mod / mask_mod inside the kernels (a score program, `_score_program.py`)
# ------------------------------------------------------------------------------------------------
MOD_FWD_TARGET = "attnaux_flash_mod_fwd"
MOD_BWD_TARGET = "attnaux_flash_mod_bwd"
KERNEL_TILE = 64
"""Query rows and keys per tile of the CPU kernels (`kBlockQ`, `kBlockK` in
`csrc/cpu/attention_tile.h`): the granularity of the block table (`tile_mask`)."""

_MOD_OPERANDS = CANONICAL_OPERANDS + (("score_consts", SHARED), ("tile_mask", BROADCAST))
_MOD_NAMES = tuple(name for name, _ in _MOD_OPERANDS)


def _mod_gradient_shapes(ops):
    q, k, v, consts = ops["q"], ops["k"], ops["v"], ops["score_consts"]
    return (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct((q.shape[0], q.shape[2], consts.shape[0]), jnp.float32),
    )


@functools.cache
def _mod_ops(options: Options, program, sequential: bool) -> tuple[KernelOp, KernelOp]:
    attrs = {**attention_attrs(options), **program.attrs()}
    # the block state (rng_state, 12 words) carries the shard's origin under SPMD, so the
    # functions see global batch and head indices (`_partition.dropout_origin`)
    forward = KernelOp(MOD_FWD_TARGET, _MOD_OPERANDS, ("out", "lse", "max"), attention_shapes,
                       attrs, dropout=("rng_state", True), sequential=sequential)
    backward = KernelOp(MOD_BWD_TARGET, _MOD_OPERANDS + _BACKWARD_EXTRA,
                        ("dq", "dk", "dv", "dscore_consts"), _mod_gradient_shapes, attrs,
                        dropout=("rng_state", True), sequential=sequential)
    return forward, backward


def _mod_forward(static, differentiating, *args):
    options, program, sequential = static
    ops = dict(zip(_MOD_NAMES, args, strict=True))
    r = _mod_ops(options, program, sequential)[0](**ops)
    return (r["out"], r["lse"], r["max"]), (args, r["out"], r["lse"])


def _mod_backward(static, residuals, cotangents):
    options, program, sequential = static
    args, out, lse = residuals
    dout, dlse, _ = cotangents  # the row max carries no gradient
    if dout is None and dlse is None:
        return (None,) * len(args)
    ops = dict(zip(_MOD_NAMES, args, strict=True))
    dout = jnp.zeros_like(out) if dout is None else dout.astype(out.dtype)
    dlse = jnp.zeros_like(lse) if dlse is None else dlse.astype(jnp.float32)
    r = _mod_ops(options, program, sequential)[1](**ops, out=out, dout=dout, lse=lse, dlse=dlse)
    _, dsink = parameter_gradients(ops, out, lse, absent(out.dtype), dout, dlse,
                                   absent(out.dtype), absent(jnp.float32))
    # each (batch, head)'s share of the captured arrays' gradient, summed in a fixed order
    dconsts = fixed_order_sum(fixed_order_sum(r["dscore_consts"], 0), 1).reshape(-1)
    grads = dict(q=r["dq"], k=r["dk"], v=r["dv"], sink=dsink, score_consts=dconsts)
    return tuple(grads.get(name) for name in _MOD_NAMES)


_mod_primitive = compiled_vjp(_mod_forward, _mod_backward)


def mod_unavailable(platform: str) -> str | None:
    """Why the CPU kernels cannot run score programs here, or None."""
    return target_unavailable(MOD_FWD_TARGET, platform)


def run_mods(arrays: Canonical, options: Options, program, flat_consts, tile_mask):
    """`(out, lse, max)` with score_mod/mask_mod evaluated inside the C++ kernels.

    `program`: the `ScoreProgram`; `flat_consts`: float32 `[program.size]` (its captured
    arrays, flat; differentiable); `tile_mask`: int32 `[B|1, Hq|1, q tiles, kv tiles]` of
    `KERNEL_TILE`-sized tiles (0: every pair hidden) or None."""
    ops = kernel_operands(arrays)
    bsz, q_seq, q_heads, _ = arrays.q.shape
    kv_seq = arrays.k.shape[1]
    # the 12-word block state of a whole problem: the dropout seed and offset (zero without
    # dropout), origin 0, the global shape (`docs/kernel_abi.md`)
    seed = (arrays.rng_state.astype(jnp.uint32) if arrays.rng_state is not None
            else jnp.zeros((4,), jnp.uint32))
    ops["rng_state"] = jnp.concatenate([seed[:4], jnp.asarray(
        np.array([0, 0, 0, 0, q_heads, q_seq, kv_seq, 0], np.uint32))])
    ops["score_consts"] = flat_consts.astype(jnp.float32)
    ops["tile_mask"] = absent(jnp.int32) if tile_mask is None else jnp.asarray(tile_mask)
    static = (options, program, program.uses_batch)
    return _mod_primitive(static, *(ops[name] for name in _MOD_NAMES))
