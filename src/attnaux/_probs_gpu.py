"""The `probs` backend on GPU: XLA's GEMMs for the products, attnaux's CUDA kernels in between.

The products of attention are matrix multiplications that XLA hands to cuBLAS, which is as fast
as they get; what XLA does not fuse well is everything between them. So on GPU:

- forward: `S = q k^T` (float32 accumulation) by XLA; then one attnaux CUDA kernel
  (`attnaux_probs_softmax_fwd`, `csrc/kernels_cuda.cu`) applies scale, softcap, bias, every mask
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

from ._canon import Canonical, Options
from ._flash import _EMPTY_DTYPES, _present, _usage, batched_ffi_call
from ._probs import is_symbolic_zero, parameter_gradients

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


def _hides_rows(arrays: Canonical, options: Options) -> bool:
    """Whether some q or k/v row may take part in no visible pair (statically)."""
    return (
        options.has_seqlens
        or options.causal != 0
        or options.window_left >= 0
        or options.window_right >= 0
        or arrays.mask is not None
        or arrays.q_segment_ids is not None
    )


def _zero_unused_rows(arrays: Canonical, options: Options) -> Canonical:
    """Zeroes the q rows and k/v rows that take part in no visible pair (see the module
    docstring); a no-op, at trace time, when no option can hide a row."""
    if not _hides_rows(arrays, options):
        return arrays
    q_rows, kv_rows = _usage(arrays, options)
    return arrays._replace(
        q=jnp.where(q_rows[..., None], arrays.q, 0),
        k=jnp.where(kv_rows[..., None], arrays.k, 0),
        v=jnp.where(kv_rows[..., None], arrays.v, 0),
    )


def _forward_shapes(q, k, v, *args):
    bsz, q_seq, q_heads, _ = q.shape
    full = (bsz, q_heads, q_seq, k.shape[1])
    has_dropout = _present(args[7])  # rng_state (canonical argument 10)
    return (
        jax.ShapeDtypeStruct(full, q.dtype),  # P
        jax.ShapeDtypeStruct(full if has_dropout else (0,), q.dtype),  # weights
        jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),  # lse
        jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),  # max
    )


def _backward_shapes(q, k, v, bias, *args):
    bsz, q_seq, q_heads, _ = q.shape
    full = (bsz, q_heads, q_seq, k.shape[1])
    has_dropout = _present(args[6])  # rng_state (canonical argument 10)
    return (
        jax.ShapeDtypeStruct(full, q.dtype),  # scale * dR
        jax.ShapeDtypeStruct(full if has_dropout else (0,), q.dtype),  # weights
        jax.ShapeDtypeStruct(full if _present(bias) else (0,), jnp.float32),  # dbias
    )


@functools.cache
def _softmax_forward(options: Options):
    # Arguments: the 11 canonical ones, then the float32 scores.
    return batched_ffi_call(FWD_TARGET, options, _forward_shapes)


@functools.cache
def _softmax_backward(options: Options):
    # Arguments: the 11 canonical ones, then probs, dp, dprobs, dlse, scores (softcap) or (0,).
    return batched_ffi_call(BWD_TARGET, options, _backward_shapes)


def _forward(options: Options, args: tuple[jax.Array, ...]):
    q, k, v = args[:3]
    probs, weights, lse, row_max = _softmax_forward(options)(*args, _scores(q, k))
    out = _weights_times(weights if _present(weights) else probs, v, q.dtype)
    return out, lse, row_max, probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _probs_gpu(options: Options, return_probs: bool, *args: jax.Array):
    out, lse, row_max, probs = _forward(options, args)
    return out, lse, row_max, (probs if return_probs else jnp.zeros((0,), probs.dtype))


def _probs_gpu_fwd(options: Options, return_probs: bool, *args):
    args = tuple(a.value for a in args)  # CustomVJPPrimal (symbolic_zeros=True)
    out, lse, row_max, probs = _forward(options, args)
    primal_probs = probs if return_probs else jnp.zeros((0,), probs.dtype)
    return (out, lse, row_max, primal_probs), (args, out, lse, probs)


def _probs_gpu_bwd(options: Options, return_probs: bool, residuals, cotangents):
    args, out, lse, probs = residuals
    q, k, v = args[:3]
    kv_heads = k.shape[2]
    dout, dlse, _, dprobs = cotangents  # the row max carries no gradient
    dout = jnp.zeros_like(out) if is_symbolic_zero(dout) else dout.astype(out.dtype)
    dlse = jnp.zeros_like(lse) if is_symbolic_zero(dlse) else dlse.astype(jnp.float32)
    if not return_probs or is_symbolic_zero(dprobs):
        dprobs = jnp.zeros((0,), probs.dtype)
    else:
        dprobs = dprobs.astype(probs.dtype)
    dp = _scores(dout, v)  # dout v^T, float32 [B, Hq, Sq, Skv]
    raw = _scores(q, k) if options.softcap > 0 else jnp.zeros((0,), jnp.float32)
    ds, weights, dbias_full = _softmax_backward(options)(*args, probs, dp, dprobs, dlse, raw)
    dq = _weights_times(ds, k, q.dtype)
    dk = _transposed_times(ds, q, kv_heads, k.dtype)
    dv = _transposed_times(weights if _present(weights) else probs, dout, kv_heads, v.dtype)
    dbias, dsink = parameter_gradients(args, out, lse, probs, dout, dlse, dprobs, dbias_full)
    return (dq, dk, dv, dbias) + (None,) * 5 + (dsink, None)


_probs_gpu.defvjp(_probs_gpu_fwd, _probs_gpu_bwd, symbolic_zeros=True)


def probs_attention_gpu(
    arrays: Canonical, options: Options, *, return_probs: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The `probs` backend on GPU (see the module docstring).

    **Returns:**

    `(out [B,Sq,Hq,Dv], lse [B,Hq,Sq], max [B,Hq,Sq], probs [B,Hq,Sq,Skv] or None)`; `probs` is
    returned (and differentiable) exactly when `return_probs` is true.
    """
    arrays = _zero_unused_rows(arrays, options)
    args = tuple(
        jnp.zeros((0,), dtype) if x is None else x for x, dtype in zip(arrays, _EMPTY_DTYPES)
    )
    out, lse, row_max, probs = _probs_gpu(options, bool(return_probs), *args)
    return out, lse, row_max, (probs if return_probs else None)
