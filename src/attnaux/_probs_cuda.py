"""The `probs` backend on GPU: XLA's GEMMs for the products, attnaux's CUDA kernels in between.

The products of attention are matrix multiplications that XLA hands to cuBLAS, which is as fast
as they get; what XLA does not fuse well is everything between them. So on GPU:

- forward: `S = q k^T` (float32 accumulation) by XLA; then one attnaux CUDA kernel
  (`attnaux_probs_softmax_fwd`, `csrc/cuda/`) applies scale, softcap, bias, every mask
  rule and the sink, and writes `P` (input dtype, before dropout), `lse`, `max` and, with
  dropout, the weights `P * keep / (1 - rate)` (the documented Philox layout, so the mask is
  bitwise the CPU kernels'); then `out = weights v` by XLA.
- backward (reads `P`, never recomputes it): `dP = dout v^T` by XLA; one CUDA kernel
  (`attnaux_probs_softmax_bwd`) forms `Dt`, `dS = P (drop dP + G - Dt)` (also `dbias`), the
  softcap derivative and `scale * dR` in the input dtype; then `dq = dR k`, `dk = dR^T q`,
  `dv = weights^T dout` by XLA. `G` is the cotangent of `aux.probs`.

Differences from the CPU `probs` kernel, all within the tolerances of the parity tests: the
products take `P` and `dR` rounded to the input dtype (as cuDNN and FlashAttention do), float32
inputs use full float32 GEMMs (`Precision.HIGHEST`); and `P` is always materialised, since it is
an operand of the output product (the CPU kernel skips it for inference).

GEMMs multiply every row, so before them the q rows and k/v rows that take part in no visible
pair (padding, rows hidden by the mask, the segment ids or the causal/window band) are zeroed, as
the reference backend does: NaN or inf stored there cannot reach an output through `0 * NaN`.
"""

import functools

import jax
import jax.numpy as jnp

from ._canon import Canonical, Options, Problem
from ._ffi import target_unavailable
from ._kernel_call import (
    BATCH,
    CANONICAL_OPERANDS,
    KernelOp,
    attention_attrs,
    attention_primitive,
    present,
)
from ._masking import zero_hidden_rows

FWD_TARGET = "attnaux_probs_softmax_fwd"
BWD_TARGET = "attnaux_probs_softmax_bwd"


def _precision(dtype) -> jax.lax.Precision:
    # float32 inputs: full float32 products (the default would use TF32 on GPU).
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """`[B, S, Hq, D]` -> `[B, S, Hkv, G, D]` (query heads of one kv head together)."""
    bsz, seq, q_heads, dim = x.shape
    return x.reshape(bsz, seq, kv_heads, q_heads // kv_heads, dim)


def _by_group(x: jax.Array, kv_heads: int) -> jax.Array:
    """`[B, Hq, Sq, Skv]` -> `[B, Hkv, G, Sq, Skv]`."""
    bsz, q_heads, q_seq, kv_seq = x.shape
    return x.reshape(bsz, kv_heads, q_heads // kv_heads, q_seq, kv_seq)


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """float32 `q k^T` as `[B, Hq, Sq, Skv]` (unscaled; GQA without repeating k)."""
    bsz, q_seq, q_heads, _ = q.shape
    kv_seq, kv_heads = k.shape[1:3]
    s = jnp.einsum("bqkgd,bjkd->bkgqj", _grouped(q, kv_heads), k,
                   preferred_element_type=jnp.float32, precision=_precision(q.dtype))
    return s.reshape(bsz, q_heads, q_seq, kv_seq)


def _weights_times(w: jax.Array, x: jax.Array, dtype) -> jax.Array:
    """`[B, Hq, Sq, Skv] @ [B, Skv, Hkv, D]` -> `[B, Sq, Hq, D]` (summing over keys)."""
    bsz, q_heads, q_seq, _ = w.shape
    kv_heads = x.shape[2]
    out = jnp.einsum("bkgqj,bjkd->bqkgd", _by_group(w, kv_heads), x,
                     preferred_element_type=jnp.float32, precision=_precision(dtype))
    return out.reshape(bsz, q_seq, q_heads, x.shape[-1]).astype(dtype)


def _transposed_times(w: jax.Array, x: jax.Array, kv_heads: int, dtype) -> jax.Array:
    """`[B, Hq, Sq, Skv]^T @ [B, Sq, Hq, D]` -> `[B, Skv, Hkv, D]` (summing over the query
    heads of each kv head and over the rows)."""
    out = jnp.einsum("bkgqj,bqkgd->bjkd", _by_group(w, kv_heads), _grouped(x, kv_heads),
                     preferred_element_type=jnp.float32, precision=_precision(dtype))
    return out.astype(dtype)


def _forward_shapes(ops, has_dropout: bool):
    q, k = ops["q"], ops["k"]
    bsz, q_seq, q_heads, _ = q.shape
    full = (bsz, q_heads, q_seq, k.shape[1])
    return (
        jax.ShapeDtypeStruct(full, q.dtype),  # P
        jax.ShapeDtypeStruct(full if has_dropout else (0,), q.dtype),  # weights
        jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),  # lse
        jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),  # max
    )


def _backward_shapes(ops, has_dropout: bool):
    q, k = ops["q"], ops["k"]
    bsz, q_seq, q_heads, _ = q.shape
    full = (bsz, q_heads, q_seq, k.shape[1])
    return (
        jax.ShapeDtypeStruct(full, q.dtype),  # scale * dR
        jax.ShapeDtypeStruct(full if has_dropout else (0,), q.dtype),  # weights
        jax.ShapeDtypeStruct(full if present(ops["bias"]) else (0,), jnp.float32),  # dbias
    )


_BACKWARD_EXTRA = (("probs", BATCH), ("dp", BATCH), ("dprobs", BATCH), ("dlse", BATCH),
                   ("scores", BATCH))


@functools.cache
def _ops(options: Options) -> tuple[KernelOp, KernelOp]:
    attrs = attention_attrs(options)
    # (a 12-word block state without dropout is present but draws no mask: the rate decides)
    has_dropout = options.dropout_rate > 0
    forward = KernelOp(FWD_TARGET, CANONICAL_OPERANDS + (("scores", BATCH),),
                       ("probs", "weights", "lse", "max"),
                       functools.partial(_forward_shapes, has_dropout=has_dropout), attrs,
                       sequential_if_present=("rng_state",),
                       dropout=("rng_state", True))
    backward = KernelOp(BWD_TARGET, CANONICAL_OPERANDS + _BACKWARD_EXTRA,
                        ("ds", "weights", "dbias"),
                        functools.partial(_backward_shapes, has_dropout=has_dropout), attrs,
                        sequential_if_present=("rng_state",),
                        dropout=("rng_state", True))
    return forward, backward


def _forward(options: Options, ops, write_probs: bool):
    del write_probs  # P is an operand of the output product: always materialised
    q, k, v = ops["q"], ops["k"], ops["v"]
    r = _ops(options)[0](**ops, scores=_scores(q, k))
    weights = r["weights"] if present(r["weights"]) else r["probs"]
    out = _weights_times(weights, v, q.dtype)
    return out, r["lse"], r["max"], r["probs"]


def _backward(options: Options, ops, out, lse, probs, dout, dlse, dprobs):
    q, k, v = ops["q"], ops["k"], ops["v"]
    kv_heads = k.shape[2]
    dp = _scores(dout, v)  # dout v^T, float32 [B, Hq, Sq, Skv]
    raw = _scores(q, k) if options.softcap > 0 else jnp.zeros((0,), jnp.float32)
    r = _ops(options)[1](**ops, probs=probs, dp=dp, dprobs=dprobs, dlse=dlse, scores=raw)
    ds = r["ds"]
    weights = r["weights"] if present(r["weights"]) else probs
    dq = _weights_times(ds, k, q.dtype)
    dk = _transposed_times(ds, q, kv_heads, k.dtype)
    dv = _transposed_times(weights, dout, kv_heads, v.dtype)
    return dq, dk, dv, r["dbias"]


_primitive = attention_primitive(_forward, _backward)


def unavailable(problem: Problem, platform: str) -> str | None:
    """Why the CUDA softmax kernels of this backend cannot serve `problem`, or None."""
    return target_unavailable(FWD_TARGET, platform, problem.arrays.q.dtype)


def run(arrays: Canonical, options: Options, return_probs: bool):
    """The `probs` backend on GPU (see the module docstring).

    **Returns:**

    `(out [B,Sq,Hq,Dv], lse [B,Hq,Sq], max [B,Hq,Sq], probs [B,Hq,Sq,Skv] or None)`; `probs` is
    returned (and differentiable) exactly when `return_probs` is true.
    """
    return _primitive(zero_hidden_rows(arrays, options, band=True), options, return_probs)
