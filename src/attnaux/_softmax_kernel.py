"""The softmax's `kernel` backend: compiled forward and backward (`attnaux_softmax_fwd` /
`attnaux_softmax_bwd`), C++ on CPU and attnaux's CUDA kernels on GPU under the same targets
(`docs/softmax_abi.md`). Through the kernel-call layer, `jax.vmap` folds the mapped axis into
the kernel's leading dimension, so a vmapped call is one launch. The operands keep the caller's
leading dims (so any of them may be sharded); each device flattens its shard for the kernel."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ._canon import SoftmaxOptions
from ._ffi import target_unavailable
from ._kernel_call import (
    BATCH,
    BROADCAST,
    KernelOp,
    absent,
    compiled_vjp,
    present,
)
from ._partition import leading_layout

FWD_TARGET = "attnaux_softmax_fwd"
BWD_TARGET = "attnaux_softmax_bwd"


def unavailable(dtype: jnp.dtype, platform: str) -> str | None:
    """Why the compiled softmax cannot serve logits of `dtype` on `platform`, or None."""
    if dtype == jnp.float64:
        return "float64 logits run only on the pure-JAX reference path"
    for target in (FWD_TARGET, BWD_TARGET):
        why = target_unavailable(target, platform)
        if why is not None:
            if platform != "cpu":
                return f"no compiled softmax kernel for the {platform!r} platform in this build"
            return why
    return None


def mask_layout(shape: tuple[int, ...], padded: tuple[int, ...]):
    """`(mask_div, kept)` of the kernel's canonical mask (`docs/softmax_abi.md`): it reads
    matrix `(n // mask_div) % mask_n`, where the mask's leading dims `kept = (first, last)` (a
    slice of the leading dims, broadcast in between) span `mask_n`; `kept = None` when the mask
    does not vary over the leading dims."""
    lead = shape[:-2]
    varying = [
        d for d, (m, s) in enumerate(zip(padded[:-2], lead, strict=True)) if m == s and s != 1
    ]
    if not varying:
        return 1, None
    first, last = varying[0], varying[-1]
    return math.prod(lead[last + 1 :]), (first, last)


def canonical_mask(mask: jax.Array, shape: tuple[int, ...], kept) -> jax.Array:
    """The mask (padded to the logits' rank) as the kernel's `[mask_n, 1|q_seq, 1|kv_seq]`."""
    lead = shape[:-2]
    mq, mkv = mask.shape[-2:]
    if kept is None:
        return mask.reshape((1, mq, mkv))
    first, last = kept
    m = mask.reshape(mask.shape[first:])  # the dims before `first` are all 1
    m = m.reshape((*mask.shape[first : last + 1], mq, mkv))  # so are the dims after `last`
    m = jnp.broadcast_to(m, (*lead[first : last + 1], mq, mkv))
    return m.reshape((math.prod(lead[first : last + 1]), mq, mkv))


def _layout(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    # The operands keep the caller's leading dims (each may be sharded); the kernel sees them
    # flattened, per device (`_forward_kernel`), so no sharding ever needs a reshuffle.
    if tuple(shape) == (0,):
        return ("absent",)
    trailing = ("q_seq",) if name in ("lse", "max", "dlse") else ("q_seq", "kv_seq")
    return leading_layout(len(shape), trailing)


def _forward_kernel(options: SoftmaxOptions):
    def kernel(logits: jax.Array, mask: jax.Array):
        shape = logits.shape
        lead, (q_seq, kv_seq) = shape[:-2], shape[-2:]
        n = math.prod(lead)
        mask_div = 1
        if present(mask):
            mask_div, kept = mask_layout(shape, mask.shape)
            mask = canonical_mask(mask, shape, kept)
        stats = jax.ShapeDtypeStruct((n, q_seq), jnp.float32)
        call = jax.ffi.ffi_call(
            FWD_TARGET, (jax.ShapeDtypeStruct((n, q_seq, kv_seq), logits.dtype), stats, stats)
        )
        probs, lse, row_max = call(
            logits.reshape((n, q_seq, kv_seq)), mask, scale=np.float32(options.scale),
            causal=np.int32(options.causal), mask_div=np.int64(mask_div),
        )
        return probs.reshape(shape), lse.reshape(shape[:-1]), row_max.reshape(shape[:-1])

    return kernel


def _backward_kernel(options: SoftmaxOptions):
    # dlogits overwrites probs in place (each row is read whole before it is written), so the
    # backward allocates nothing when probs is dead after it, as it is in a vjp; XLA copies
    # first where probs is still needed.
    def kernel(probs: jax.Array, dprobs: jax.Array, dlse: jax.Array):
        shape = probs.shape
        n = math.prod(shape[:-2])
        flat = (n, *shape[-2:])
        call = jax.ffi.ffi_call(
            BWD_TARGET, jax.ShapeDtypeStruct(flat, probs.dtype), input_output_aliases={0: 0}
        )
        dlogits = call(probs.reshape(flat), dprobs.reshape(flat), dlse.reshape(flat[:2]),
                       scale=np.float32(options.scale))
        return (dlogits.reshape(shape),)

    return kernel


@functools.cache
def _ops(options: SoftmaxOptions) -> tuple[KernelOp, KernelOp]:
    forward = KernelOp(
        FWD_TARGET, (("logits", BATCH), ("mask", BROADCAST)), ("probs", "lse", "max"),
        None, {}, layout=_layout, kernel=_forward_kernel(options),
    )
    backward = KernelOp(
        BWD_TARGET, (("probs", BATCH), ("dprobs", BATCH), ("dlse", BATCH)), ("dlogits",),
        None, {}, layout=_layout, kernel=_backward_kernel(options),
    )
    return forward, backward


def _forward(options: SoftmaxOptions, differentiating: bool, logits, mask):
    r = _ops(options)[0](logits=logits, mask=mask)
    return (r["probs"], r["lse"], r["max"]), r["probs"]


def _backward(options: SoftmaxOptions, probs, cotangents):
    dprobs, dlse, _ = cotangents  # the row max carries no gradient; absent ones are None
    dprobs = jnp.zeros_like(probs) if dprobs is None else dprobs.astype(probs.dtype)
    dlse = jnp.zeros(probs.shape[:-1], jnp.float32) if dlse is None else dlse
    r = _ops(options)[1](probs=probs, dprobs=dprobs, dlse=dlse.astype(jnp.float32))
    return r["dlogits"], None


_primitive = compiled_vjp(_forward, _backward)


def run(options: SoftmaxOptions, logits: jax.Array, mask: jax.Array | None):
    """`(probs, lse, max)` of logits `[*lead, q_seq, kv_seq]` (at least one leading dim) with the
    mask padded to the logits' rank, or None."""
    return _primitive(options, logits, absent(jnp.bool_) if mask is None else mask)
