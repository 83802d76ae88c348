"""The softmax's `kernel` backend: compiled forward and backward (`attnaux_softmax_fwd` /
`attnaux_softmax_bwd`), C++ on CPU and attnaux's CUDA kernels on GPU under the same targets
(`docs/softmax_abi.md`). Through the kernel-call layer, `jax.vmap` folds the mapped axis into
the kernel's leading dimension, so a vmapped call is one launch."""

import functools

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


def _mask_fold(options: SoftmaxOptions):
    def fold(axis_size: int, batched: bool, mask: jax.Array, n: int) -> jax.Array:
        if batched and present(mask[0]):
            # Logits matrix a * n + r must read mask matrix a * mask_n + (r // div) % mask_n:
            # true for `(. // div) % (axis_size * mask_n)` once the mask spans all of n / div.
            mask_n = mask.shape[1]
            outer = n // (options.mask_div * mask_n) if n else 1
            mask = jnp.broadcast_to(mask[:, None], (axis_size, outer, *mask.shape[1:]))
            return mask.reshape((axis_size * outer * mask_n, *mask.shape[3:]))
        # An unbatched mask needs nothing: (a * n + r) // div % mask_n == r // div % mask_n
        # because n is a multiple of div * mask_n.
        return mask[0] if batched else mask

    return fold


@functools.cache
def _ops(options: SoftmaxOptions) -> tuple[KernelOp, KernelOp]:
    def forward_shapes(ops):
        logits = ops["logits"]
        stats = jax.ShapeDtypeStruct(logits.shape[:2], jnp.float32)
        return jax.ShapeDtypeStruct(logits.shape, logits.dtype), stats, stats

    forward = KernelOp(
        FWD_TARGET, (("logits", BATCH), ("mask", BROADCAST)), ("probs", "lse", "max"),
        forward_shapes,
        dict(scale=np.float32(options.scale), causal=np.int32(options.causal),
             mask_div=np.int64(options.mask_div)),
        folds={"mask": _mask_fold(options)},
    )
    # dlogits overwrites probs in place (each row is read whole before it is written), so the
    # backward allocates nothing when probs is dead after it, as it is in a vjp; XLA copies
    # first where probs is still needed.
    backward = KernelOp(
        BWD_TARGET, (("probs", BATCH), ("dprobs", BATCH), ("dlse", BATCH)), ("dlogits",),
        lambda ops: (jax.ShapeDtypeStruct(ops["probs"].shape, ops["probs"].dtype),),
        dict(scale=np.float32(options.scale)), aliases={0: 0},
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
    """`(probs, lse, max)` of logits `[N, q_seq, kv_seq]` with the canonical mask or None."""
    return _primitive(options, logits, absent(jnp.bool_) if mask is None else mask)
