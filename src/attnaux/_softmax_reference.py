"""The softmax's `reference` backend: the kernel's arithmetic in plain JAX (float32 inside;
float64 for float64 logits), with the same backward formula, so fully masked rows get zero
gradients on both. It runs on every platform and for every dtype."""

import jax
import jax.numpy as jnp

from ._canon import SoftmaxOptions
from ._kernel_call import compiled_vjp


def _visible(options: SoftmaxOptions, shape: tuple[int, ...], mask: jax.Array | None):
    """`bool` visibility broadcastable to logits `[*lead, q_seq, kv_seq]`, or None (all
    visible); `mask` is padded to the logits' rank."""
    q_seq, kv_seq = shape[-2:]
    visible = None
    if options.causal:
        offset = kv_seq - q_seq if options.causal == 2 else 0
        i = jnp.arange(q_seq)[:, None]
        j = jnp.arange(kv_seq)[None, :]
        visible = j <= i + offset
    if mask is not None:
        visible = mask if visible is None else visible & mask
    return visible


def _reference_forward(options: SoftmaxOptions, logits: jax.Array, mask: jax.Array | None):
    compute = jnp.float64 if logits.dtype == jnp.float64 else jnp.float32
    s = logits.astype(compute) * jnp.asarray(options.scale, compute)
    visible = _visible(options, logits.shape, mask)
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, initial=-jnp.inf)
    any_visible = row_max > -jnp.inf
    shift = jnp.where(any_visible, row_max, 0)
    e = jnp.exp(s - shift[..., None])  # exp(-inf) = 0 at invisible keys
    total = jnp.sum(e, axis=-1)
    probs = e * (1 / jnp.where(any_visible, total, 1))[..., None]
    lse = jnp.where(any_visible, shift + jnp.log(jnp.where(any_visible, total, 1)), -jnp.inf)
    return probs.astype(logits.dtype), lse, row_max


def _softmax_backward_math(scale: float, probs, dprobs, dlse):
    """`dlogits = scale * P * (dP - (sum_j P dP - dlse))`, 0 where `P == 0`."""
    compute = jnp.float64 if probs.dtype == jnp.float64 else jnp.float32
    p = probs.astype(compute)
    dp = dprobs.astype(compute)
    nonzero = p != 0
    dt = jnp.sum(jnp.where(nonzero, p * dp, 0), axis=-1) - dlse.astype(compute)
    g = jnp.where(nonzero, (p * jnp.asarray(scale, compute)) * (dp - dt[..., None]), 0)
    return g.astype(probs.dtype)


def _forward(options: SoftmaxOptions, differentiating: bool, logits, mask):
    probs, lse, row_max = _reference_forward(options, logits, mask)
    return (probs, lse, row_max), probs


def _backward(options: SoftmaxOptions, probs, cotangents):
    dprobs, dlse, _ = cotangents  # the row max carries no gradient; absent ones are None
    dprobs = jnp.zeros_like(probs) if dprobs is None else dprobs
    dlse = jnp.zeros(probs.shape[:-1], jnp.float32) if dlse is None else dlse
    return _softmax_backward_math(options.scale, probs, dprobs, dlse), None


_primitive = compiled_vjp(_forward, _backward)


def run(options: SoftmaxOptions, logits: jax.Array, mask: jax.Array | None):
    """`(probs, lse, max)` of logits `[*lead, q_seq, kv_seq]` with the mask padded to the
    logits' rank, or None."""
    return _primitive(options, logits, mask)
