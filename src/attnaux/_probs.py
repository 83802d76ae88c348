"""The probability-saving backends `probs` and `small_seq`: compiled kernels behind custom_vjp.

Both primitives share one ABI (`docs/kernel_abi.md`, "The probability-saving primitives"): the
forward returns `out, lse, max` and the probabilities `P` (`[B, Hq, Sq, Skv]`, before dropout, in
the input dtype), and the backward reads `P` instead of recomputing it. `probs` serves any shape
(its kernels work on blocks of query rows against every key they see); `small_seq` is specialised
for one query row against at most `SMALL_SEQ_MAX_KV_SEQ` keys and very large batches.
On GPU, `small_seq` runs attnaux's CUDA kernels through the same targets, and `probs` runs
XLA's GEMMs around attnaux's CUDA softmax kernels (`_probs_gpu.py`).

- Without differentiation and without `return_probs`, the forward does not write `P` at all (its
  output is an empty `(0,)` array), so inference pays nothing for the backend's residual.
- Under `jax.grad`, `P` is the residual of the backward.
- `aux.probs` is differentiable: the backward takes the cotangent of `P` too (a symbolic zero when
  nothing depends on `P`, and then no dense zero is ever built).

`jax.vmap` is handled like `flash`'s: the mapped axis is folded into the kernel's batch dimension
(see `_flash._batching_rule`).
"""

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from ._canon import Canonical, Options
from ._flash import (
    _present,
    batched_ffi_call,
    fixed_order_sum,
    gradient_shapes,
    kernel_args,
)

# Shape limits of `small_seq` (also checked by its kernel).
SMALL_SEQ_MAX_KV_SEQ = 16

TARGETS = {
    "probs": ("attnaux_probs_fwd", "attnaux_probs_bwd"),
    "small_seq": ("attnaux_small_seq_fwd", "attnaux_small_seq_bwd"),
}


@functools.cache
def _forward_call(kind: str, options: Options, write_probs: bool):
    target = TARGETS[kind][0]

    def shapes(q, k, v, *_):
        bsz, q_seq, q_heads, _ = q.shape
        probs_shape = (bsz, q_heads, q_seq, k.shape[1]) if write_probs else (0,)
        return (
            jax.ShapeDtypeStruct((bsz, q_seq, q_heads, v.shape[-1]), q.dtype),
            jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),
            jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),
            jax.ShapeDtypeStruct(probs_shape, q.dtype),
        )

    # Arguments: the 11 canonical ones.
    return batched_ffi_call(target, options, shapes)


@functools.cache
def _backward_call(kind: str, options: Options):
    # Arguments: the 11 canonical ones, then dout, probs, dlse, dprobs.
    return batched_ffi_call(TARGETS[kind][1], options, gradient_shapes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _probs_attention(kind: str, options: Options, return_probs: bool, *args: jax.Array):
    # Not differentiated: P is written only when it is returned.
    return _forward_call(kind, options, return_probs)(*args)


def _probs_fwd(kind: str, options: Options, return_probs: bool, *args):
    args = tuple(a.value for a in args)  # CustomVJPPrimal (symbolic_zeros=True)
    out, lse, row_max, probs = _forward_call(kind, options, True)(*args)
    primal_probs = probs if return_probs else jnp.zeros((0,), probs.dtype)
    return (out, lse, row_max, primal_probs), (args, out, lse, probs)


def is_symbolic_zero(ct) -> bool:
    """Whether a cotangent is absent (a symbolic zero under `symbolic_zeros=True`)."""
    return ct is None or isinstance(ct, SymbolicZero)


def parameter_gradients(args, out, lse, probs, dout, dlse, dprobs, dbias_full):
    """`(dbias, dsink)` of a probability-saving backward: the kernel's full float32 dbias summed
    down to the bias's broadcast shape, and the sink's gradient from per-row terms. Either is
    None when that input is absent."""
    bias, sink = args[3], args[9]
    dbias = None
    if _present(bias):  # summed down to the bias's broadcast shape, in a fixed order
        dbias = dbias_full
        for axis in range(4):
            if bias.shape[axis] == 1 and dbias.shape[axis] != 1:
                dbias = fixed_order_sum(dbias, axis)
    dsink = None
    if _present(sink):
        # lse, out and P depend on the sink only through lse: d lse / d sink = exp(sink - lse),
        # d out / d sink = -exp(sink - lse) * out, d P / d sink = -exp(sink - lse) * P. So
        # dsink = -sum_rows exp(sink - lse) * Dt with Dt = dout . out + rowsum(dP * P) - dlse.
        row_term = jnp.einsum(
            "bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32)
        ) - dlse
        if _present(dprobs):
            row_term = row_term + jnp.einsum(
                "bhqk,bhqk->bhq", dprobs.astype(jnp.float32), probs.astype(jnp.float32)
            )
        terms = jnp.exp(sink[None, :, None] - lse) * row_term  # [B, Hq, Sq]
        dsink = -fixed_order_sum(fixed_order_sum(terms, 2), 0).reshape(sink.shape)
    return dbias, dsink


def _probs_bwd(kind: str, options: Options, return_probs: bool, residuals, cotangents):
    args, out, lse, probs = residuals
    dout, dlse, _, dprobs = cotangents  # the row max carries no gradient
    dout = jnp.zeros_like(out) if is_symbolic_zero(dout) else dout.astype(out.dtype)
    dlse = jnp.zeros_like(lse) if is_symbolic_zero(dlse) else dlse.astype(jnp.float32)
    if not return_probs or is_symbolic_zero(dprobs):
        dprobs = jnp.zeros((0,), probs.dtype)
    else:
        dprobs = dprobs.astype(probs.dtype)
    dq, dk, dv, dbias_full = _backward_call(kind, options)(*args, dout, probs, dlse, dprobs)
    dbias, dsink = parameter_gradients(args, out, lse, probs, dout, dlse, dprobs, dbias_full)
    return (dq, dk, dv, dbias) + (None,) * 5 + (dsink, None)


_probs_attention.defvjp(_probs_fwd, _probs_bwd, symbolic_zeros=True)


def probs_attention(
    arrays: Canonical, options: Options, *, kind: str, return_probs: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Runs the compiled `probs` or `small_seq` kernels (`kind`).

    **Returns:**

    `(out [B,Sq,Hq,Dv], lse [B,Hq,Sq], max [B,Hq,Sq], probs [B,Hq,Sq,Skv] or None)`; `probs` is
    returned (and differentiable) exactly when `return_probs` is true.
    """
    if kind not in TARGETS:
        raise ValueError(f"kind must be one of {sorted(TARGETS)}; got {kind!r}.")
    if kind == "probs" and jax.default_backend() == "gpu":  # XLA GEMMs + CUDA softmax kernels
        from ._probs_gpu import probs_attention_gpu

        return probs_attention_gpu(arrays, options, return_probs=return_probs)
    out, lse, row_max, probs = _probs_attention(kind, options, bool(return_probs),
                                                *kernel_args(arrays, options))
    return out, lse, row_max, (probs if return_probs else None)
