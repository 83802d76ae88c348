"""`attnaux.softmax`: the fused scaled / masked / causal softmax that returns its statistics.

Two implementations keep one contract (`docs/softmax_abi.md`):

- `kernel`: compiled C++ forward and backward (`attnaux_softmax_fwd` / `attnaux_softmax_bwd`, XLA
  FFI) behind `jax.custom_vjp`; `jax.vmap` folds the mapped axis into the kernel's leading
  dimension through a `custom_vmap` rule, so a vmapped call is one launch.
- `reference`: the same arithmetic in plain JAX (float32 inside; float64 for float64 logits), with
  the same `custom_vjp` backward formula, so fully masked rows get zero gradients on both.

Both work on a canonical form: logits `[N, q_seq, kv_seq]` (all leading dimensions flattened) and
a mask `[mask_n, 1 or q_seq, 1 or kv_seq]` that logits matrix `n` reads at `(n // mask_div) %
mask_n`, which covers every broadcast of a mask over batch and heads without materialising it.
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from beartype import BeartypeConf, beartype
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Bool, Float, jaxtyped

from . import _ffi
from ._aux import AttnAux
from ._canon import _fmt_shape, _is_traced, _static_float, parse_causal

FWD_TARGET = "attnaux_softmax_fwd"
BWD_TARGET = "attnaux_softmax_bwd"
BACKENDS = ("auto", "kernel", "reference")
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FLOAT_DTYPES = (*_KERNEL_DTYPES, jnp.dtype(jnp.float64))

_Arr = Array | np.ndarray
_typechecker = beartype(conf=BeartypeConf(is_pep484_tower=True))


# ------------------------------------------------------------------------------------------------
# FFI registration
# ------------------------------------------------------------------------------------------------
def _register_targets() -> str | None:
    """Registers the softmax FFI targets from `attnaux._ext` (unless `_ffi` already did, as it
    does for every capsule the extension exports). Returns why they are unavailable, or None."""
    if _ffi._ext is None:
        return f"the compiled extension is not available ({_ffi.IMPORT_ERROR})"
    capsules = _ffi._ext.registrations()
    for name in (FWD_TARGET, BWD_TARGET):
        if _ffi.has_target(name, "cpu"):
            continue
        if name not in capsules:
            return (
                f"the compiled extension attnaux._ext was built without the softmax kernels "
                f"({name!r} is not among its registrations)"
            )
        jax.ffi.register_ffi_target(name, capsules[name], platform="cpu")
        _ffi.REGISTERED[name] = ("cpu",)
    return None


_UNREGISTERED: str | None = _register_targets()


# ------------------------------------------------------------------------------------------------
# Validation and canonical form
# ------------------------------------------------------------------------------------------------
class Options(NamedTuple):
    """Static options of one softmax call (hashable: keys `custom_vjp` and the kernel cache)."""

    scale: float
    causal: int  # 0 none, 1 top-left, 2 bottom-right
    mask_div: int  # logits matrix n reads mask matrix (n // mask_div) % mask_n


def _check_backend(backend: Any) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"`backend` must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}."
        )
    return backend


def _check_logits(logits: Any) -> tuple[tuple[int, ...], jnp.dtype]:
    """Shape and dtype of `logits` (an array, a tracer or a `jax.ShapeDtypeStruct`)."""
    if not (
        isinstance(logits, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or _is_traced(logits)
    ):
        raise TypeError(
            "`logits` must be a JAX or NumPy array of shape [*batch, heads, q_seq, kv_seq]; got "
            f"an object of type {type(logits).__name__}."
        )
    shape = tuple(logits.shape)
    dtype = jnp.dtype(jax.dtypes.canonicalize_dtype(logits.dtype))  # float64 -> 32 without x64
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(
            "`logits` must have a floating dtype (float32, bfloat16 or float16; float64 runs on "
            f"the reference path only); got {dtype} with shape {shape}."
        )
    if len(shape) < 2:
        raise ValueError(
            "`logits` must have shape [*batch, heads, q_seq, kv_seq] (at least the two dimensions "
            f"[q_seq, kv_seq]); got shape {shape}."
        )
    return shape, dtype


def _check_mask(mask: Any, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Validates `mask` against logits of `shape`; returns its shape padded to the logits rank."""
    if mask is None:
        return None
    if not (isinstance(mask, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or _is_traced(mask)):
        raise TypeError(
            "`mask` must be None or a boolean JAX or NumPy array (True = keep); got an object of "
            f"type {type(mask).__name__}."
        )
    if jnp.dtype(mask.dtype) != jnp.bool_:
        raise TypeError(
            f"`mask` must be a boolean array (True = keep); got dtype {mask.dtype} with shape "
            f"{_fmt_shape(mask)}. Use `mask.astype(bool)` for a 0/1 mask, or add additive "
            "values to the logits instead."
        )
    mshape = tuple(mask.shape)
    layout = f"the logits' shape {shape}"
    if len(mshape) > len(shape):
        raise ValueError(
            f"`mask` of shape {mshape} has more dimensions than the logits, so it does not "
            f"broadcast to {layout}."
        )
    padded = (1,) * (len(shape) - len(mshape)) + mshape
    for got, want in zip(padded, shape, strict=True):
        if got not in (1, want):
            raise ValueError(
                f"`mask` of shape {mshape} does not broadcast to {layout}: aligned from the "
                "right, every mask dimension must be 1 or equal to the logits dimension."
            )
    return padded


def _statics(scale: Any, causal: Any, backend: Any) -> dict:
    return dict(
        scale=_static_float("scale", scale, allow_none=False),
        causal=parse_causal(causal),
        backend=_check_backend(backend),
    )


def _mask_layout(shape: tuple[int, ...], padded: tuple[int, ...] | None):
    """`(mask_div, kept)`: the canonical mask reads `(n // mask_div) % mask_n`, where the
    mask's leading dims `kept = (first, last)` (a slice of the batch dims, broadcast in between)
    span `mask_n`; `kept = None` when the mask does not vary over the leading dims."""
    lead = shape[:-2]
    if padded is None:
        return 1, None
    varying = [
        d for d, (m, s) in enumerate(zip(padded[:-2], lead, strict=True)) if m == s and s != 1
    ]
    if not varying:
        return 1, None
    first, last = varying[0], varying[-1]
    return math.prod(lead[last + 1 :]), (first, last)


def _canonical_mask(mask: jax.Array, shape: tuple[int, ...], padded, kept) -> jax.Array:
    lead = shape[:-2]
    mq, mkv = padded[-2:]
    if kept is None:
        return mask.reshape((1, mq, mkv))
    first, last = kept
    m = mask.reshape(padded[first:])  # the dims before `first` are all 1
    m = m.reshape((*padded[first : last + 1], mq, mkv))  # so are the dims after `last`
    m = jnp.broadcast_to(m, (*lead[first : last + 1], mq, mkv))
    return m.reshape((math.prod(lead[first : last + 1]), mq, mkv))


# ------------------------------------------------------------------------------------------------
# Kernel availability
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelAvailability:
    """What `softmax_kernel_available` returns: truthy iff the compiled kernel serves the call.

    Unpacks as a pair: `ok, reason = attnaux.softmax_kernel_available(logits)`.

    **Fields:**

    - `available`: whether `softmax(..., backend="auto")` runs the compiled kernel.
    - `reason`: why (or why not), one sentence.
    """

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available

    def __iter__(self):
        return iter((self.available, self.reason))


def _platform() -> str:
    return jax.default_backend()


def _kernel_unavailable(dtype: jnp.dtype) -> str | None:
    if dtype == jnp.float64:
        return "float64 logits run only on the pure-JAX reference path"
    platform = _platform()
    if not _ffi.has_target(FWD_TARGET, platform) or not _ffi.has_target(BWD_TARGET, platform):
        if platform != "cpu":
            return f"no compiled softmax kernel for the {platform!r} platform in this build"
        return _UNREGISTERED or "the softmax FFI targets are not registered"
    return None


def softmax_kernel_available(
    logits_shape_or_array: Any,
    dtype: Any = None,
    *,
    mask: Any = None,
    causal: bool | str = False,
) -> KernelAvailability:
    """Says whether the compiled softmax kernel serves a call, and why not.

    Validates the arguments exactly as [`attnaux.softmax`][] does (so a bad call raises here too)
    and runs nothing.

    **Arguments:**

    - `logits_shape_or_array`: the logits (an array or `jax.ShapeDtypeStruct`) or their shape as
      a tuple of ints.
    - `dtype`: the logits' dtype when a shape is given (default float32); must match an array's.
    - `mask`, `causal`: as for `softmax` (a mask may be a `jax.ShapeDtypeStruct`).

    **Returns:**

    A `KernelAvailability(available, reason)`: truthy iff the kernel runs for
    `backend="auto"`; unpacks as `(available, reason)`.
    """
    x = logits_shape_or_array
    if isinstance(x, (tuple, list)):
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in x):
            raise TypeError(
                f"`logits_shape_or_array` as a shape must be a tuple of ints; got {x!r}."
            )
        x = jax.ShapeDtypeStruct(tuple(int(d) for d in x), jnp.float32 if dtype is None else dtype)
    elif dtype is not None and hasattr(x, "dtype") and jnp.dtype(dtype) != jnp.dtype(x.dtype):
        raise TypeError(
            f"`dtype` {jnp.dtype(dtype)} differs from the dtype {jnp.dtype(x.dtype)} of the "
            "logits array given; pass a shape tuple to ask about another dtype."
        )
    try:
        shape, ldtype = _check_logits(x)
    except TypeError as error:
        raise TypeError(str(error).replace("`logits`", "`logits_shape_or_array`")) from None
    except ValueError as error:
        raise ValueError(str(error).replace("`logits`", "`logits_shape_or_array`")) from None
    _check_mask(mask, shape)
    parse_causal(causal)
    why_not = _kernel_unavailable(ldtype)
    if why_not is not None:
        return KernelAvailability(False, why_not)
    return KernelAvailability(
        True, f"the compiled C++ kernel (XLA FFI, {_platform()}) serves {ldtype} logits of any size"
    )


# ------------------------------------------------------------------------------------------------
# Reference path (pure JAX)
# ------------------------------------------------------------------------------------------------
def _visible(options: Options, shape: tuple[int, ...], mask: jax.Array | None):
    """`bool` visibility broadcastable to logits `[N, q_seq, kv_seq]`, or None (all visible)."""
    n, q_seq, kv_seq = shape
    visible = None
    if options.causal:
        offset = kv_seq - q_seq if options.causal == 2 else 0
        i = jnp.arange(q_seq)[:, None]
        j = jnp.arange(kv_seq)[None, :]
        visible = (j <= i + offset)[None]
    if mask is not None:
        mask_n = mask.shape[0]
        outer = n // (options.mask_div * mask_n) if n else 0
        m = jnp.broadcast_to(
            mask[None, :, None], (outer, mask_n, options.mask_div, *mask.shape[1:])
        ).reshape((n, *mask.shape[1:]))
        visible = m if visible is None else visible & m
    return visible


def _reference_forward(options: Options, logits: jax.Array, mask: jax.Array | None):
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reference(options: Options, logits: jax.Array, mask: jax.Array | None):
    return _reference_forward(options, logits, mask)


def _reference_fwd(options, logits, mask):
    probs, lse, row_max = _reference_forward(options, logits, mask)
    return (probs, lse, row_max), probs


def _reference_bwd(options, probs, cotangents):
    dprobs, dlse, _ = cotangents  # the row max carries no gradient
    return _softmax_backward_math(options.scale, probs, dprobs, dlse), None


_reference.defvjp(_reference_fwd, _reference_bwd)


# ------------------------------------------------------------------------------------------------
# Kernel path
# ------------------------------------------------------------------------------------------------
_NO_MASK_SHAPE = (0,)


def _present(mask: jax.Array) -> bool:
    return mask.shape != _NO_MASK_SHAPE


def _fold(axis_size: int, batched: bool, x: jax.Array) -> jax.Array:
    """Merges the vmapped axis (leading, if batched) into the kernel's leading dimension."""
    if not batched:
        x = jnp.broadcast_to(x, (axis_size, *x.shape))
    return x.reshape((axis_size * x.shape[1], *x.shape[2:]))


def _unfold(axis_size: int, n: int, x: jax.Array) -> jax.Array:
    return x.reshape((axis_size, n, *x.shape[1:]))


@functools.cache
def _forward_call(options: Options):
    @custom_vmap
    def forward(logits, mask):
        n, q_seq, _ = logits.shape
        stats = jax.ShapeDtypeStruct((n, q_seq), jnp.float32)
        call = jax.ffi.ffi_call(
            FWD_TARGET, (jax.ShapeDtypeStruct(logits.shape, logits.dtype), stats, stats)
        )
        return tuple(
            call(
                logits,
                mask,
                scale=np.float32(options.scale),
                causal=np.int32(options.causal),
                mask_div=np.int64(options.mask_div),
            )
        )

    @forward.def_vmap
    def rule(axis_size, in_batched, logits, mask):
        logits_batched, mask_batched = in_batched
        n = logits.shape[1] if logits_batched else logits.shape[0]
        folded_logits = _fold(axis_size, logits_batched, logits)
        if mask_batched and _present(mask[0]):
            # Logits matrix a * n + r must read mask matrix a * mask_n + (r // div) % mask_n:
            # true for `(. // div) % (axis_size * mask_n)` once the mask spans all of n / div.
            mask_n = mask.shape[1]
            outer = n // (options.mask_div * mask_n) if n else 1
            mask = jnp.broadcast_to(mask[:, None], (axis_size, outer, *mask.shape[1:]))
            mask = mask.reshape((axis_size * outer * mask_n, *mask.shape[3:]))
        elif mask_batched:
            mask = mask[0]
        # An unbatched mask needs nothing: (a * n + r) // div % mask_n == r // div % mask_n
        # because n is a multiple of div * mask_n.
        outs = forward(folded_logits, mask)
        return tuple(_unfold(axis_size, n, o) for o in outs), (True, True, True)

    return forward


@functools.cache
def _backward_call(scale: float):
    @custom_vmap
    def backward(probs, dprobs, dlse):
        # dlogits overwrites probs in place (each row is read whole before it is written), so
        # the backward allocates nothing when probs is dead after it, as it is in a vjp; XLA
        # copies first where probs is still needed.
        call = jax.ffi.ffi_call(
            BWD_TARGET,
            jax.ShapeDtypeStruct(probs.shape, probs.dtype),
            input_output_aliases={0: 0},
        )
        return call(probs, dprobs, dlse, scale=np.float32(scale))

    @backward.def_vmap
    def rule(axis_size, in_batched, probs, dprobs, dlse):
        n = probs.shape[1] if in_batched[0] else probs.shape[0]
        args = [
            _fold(axis_size, b, x) for x, b in zip((probs, dprobs, dlse), in_batched, strict=True)
        ]
        return _unfold(axis_size, n, backward(*args)), True

    return backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel(options: Options, logits: jax.Array, mask: jax.Array):
    return _forward_call(options)(logits, mask)


def _kernel_fwd(options, logits, mask):
    probs, lse, row_max = _forward_call(options)(logits, mask)
    return (probs, lse, row_max), probs


def _kernel_bwd(options, probs, cotangents):
    dprobs, dlse, _ = cotangents  # the row max carries no gradient
    dlogits = _backward_call(options.scale)(
        probs, dprobs.astype(probs.dtype), dlse.astype(jnp.float32)
    )
    return dlogits, None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


# ------------------------------------------------------------------------------------------------
# Public function
# ------------------------------------------------------------------------------------------------
def _choose(backend: str, dtype: jnp.dtype) -> str:
    why_not = _kernel_unavailable(dtype)
    if backend == "auto":
        return "kernel" if why_not is None else "reference"
    if backend == "kernel" and why_not is not None:
        raise ValueError(
            f"`backend='kernel'` cannot serve this call: {why_not}. Use backend='auto' (which "
            "falls back to the pure-JAX path) or backend='reference'."
        )
    return backend


@functools.partial(jax.jit, static_argnames=("scale", "causal", "backend"))
def _softmax_jit(logits, mask, *, scale, causal, backend):
    shape, dtype = _check_logits(logits)
    padded = _check_mask(mask, shape)
    chosen = _choose(backend, dtype)
    mask_div, kept = _mask_layout(shape, padded)
    options = Options(scale=scale, causal=causal, mask_div=mask_div)
    lead, (q_seq, kv_seq) = shape[:-2], shape[-2:]
    logits3 = logits.reshape((math.prod(lead), q_seq, kv_seq))
    mask3 = None if mask is None else _canonical_mask(mask, shape, padded, kept)
    if chosen == "kernel":
        if mask3 is None:
            mask3 = jnp.zeros(_NO_MASK_SHAPE, jnp.bool_)
        probs, lse, row_max = _kernel(options, logits3, mask3)
    else:
        probs, lse, row_max = _reference(options, logits3, mask3)
    aux = AttnAux(
        lse=lse.reshape(shape[:-1]),
        max=jax.lax.stop_gradient(row_max.reshape(shape[:-1])),
        probs=None,
        rng_state=None,
        backend=chosen,
    )
    return probs.reshape(shape), aux


def _validated_first(fn):
    """Runs attnaux's own checks (one sentence naming the argument) before the jaxtyping ones."""

    @functools.wraps(fn)
    def wrapper(logits, *, scale=1.0, mask=None, causal=False, backend="auto"):
        shape, _ = _check_logits(logits)
        _check_mask(mask, shape)
        _statics(scale, causal, backend)
        return fn(logits, scale=scale, mask=mask, causal=causal, backend=backend)

    return wrapper


@_validated_first
@jaxtyped(typechecker=_typechecker)
def softmax(
    logits: Float[_Arr, "*batch q_seq kv_seq"],
    *,
    scale: float = 1.0,
    mask: Bool[_Arr, "..."] | None = None,
    causal: bool | str = False,
    backend: str = "auto",
) -> tuple[Float[Array, "*batch q_seq kv_seq"], AttnAux]:
    """Fused `softmax(scale * logits, masked)` over the last axis, with its statistics.

    One function for the three classic fusions: scaled, scaled + boolean mask, scaled + causal
    (upper-triangular) mask; `mask` and `causal` combine. Float32 arithmetic inside for every
    input dtype. Works under `jax.jit`, `jax.grad` and `jax.vmap`.

    **Arguments:**

    - `logits`: `[*batch, heads, q_seq, kv_seq]` (any number of leading dimensions, at least
      `[q_seq, kv_seq]`); float32, bfloat16 or float16 (float64 runs on the reference path).
    - `scale`: multiplies the logits before the softmax; a static Python float (may be negative).
    - `mask`: boolean, `True` = keep; broadcasts against `logits` by NumPy rules (e.g.
      `[q_seq, kv_seq]`, `[*batch, 1, 1, kv_seq]` for key padding, `[1, heads, q_seq, kv_seq]`).
    - `causal`: `False`; `True` or `"top_left"` (row `i` keeps keys `j <= i`); `"bottom_right"`
      (keeps `j <= i + kv_seq - q_seq`, so the last row sees every key).
    - `backend`: `"auto"` (the compiled kernel where it serves the call, see
      [`attnaux.softmax_kernel_available`][], else the pure-JAX path), `"kernel"` (raises if it
      cannot serve the call) or `"reference"` (pure JAX).

    **Returns:**

    `(probs, aux)`: `probs` has the shape and dtype of `logits`; `aux` is an
    [`AttnAux`][attnaux.AttnAux] with float32 `lse` and `max` of shape `logits.shape[:-1]`, the
    natural-log log-sum-exp and the maximum of each row of the scaled, masked logits (`probs ==
    exp(scale * logits - lse)` at kept positions), `aux.probs = None` and `aux.backend` set to
    `"kernel"` or `"reference"`. A row with no kept key gives `probs = 0`,
    `lse = max = -inf` and zero gradients. Gradients flow through `probs` and `aux.lse`;
    `aux.max` carries none.

    **Raises:**

    `ValueError` or `TypeError` naming the argument, what was expected and what came, before
    anything is traced.
    """
    return _softmax_jit(logits, mask, **_statics(scale, causal, backend))
