"""`attnaux.softmax`: the fused scaled / masked / causal softmax that returns its statistics.

Two implementations keep one contract (`docs/softmax_abi.md`):

- `kernel`: compiled C++ forward and backward (`attnaux_softmax_fwd` / `attnaux_softmax_bwd`, XLA
  FFI) behind `jax.custom_vjp`; `jax.vmap` folds the mapped axis into the kernel's leading
  dimension through a `custom_vmap` rule, so a vmapped call is one launch.
- `reference`: the same arithmetic in plain JAX (float32 inside; float64 for float64 logits), with
  the same `custom_vjp` backward formula, so fully masked rows get zero gradients on both.

Both take the logits with their leading dimensions as they are (so each may be sharded; the
kernel flattens them per device) and the mask padded to the logits' rank, broadcasting.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from beartype import BeartypeConf, beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from ._aux import AttnAux
from ._canon import SoftmaxOptions, _fmt_shape, _is_traced, parse_causal, static_float
from ._dispatch import SOFTMAX_BACKENDS, choose_softmax

_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FLOAT_DTYPES = (*_KERNEL_DTYPES, jnp.dtype(jnp.float64))

_Arr = Array | np.ndarray
_typechecker = beartype(conf=BeartypeConf(is_pep484_tower=True))


# ------------------------------------------------------------------------------------------------
# Validation and canonical form
# ------------------------------------------------------------------------------------------------
def _check_backend(backend: Any) -> str:
    if not isinstance(backend, str) or backend not in SOFTMAX_BACKENDS:
        raise ValueError(
            f"`backend` must be one of {', '.join(map(repr, SOFTMAX_BACKENDS))}; got {backend!r}."
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
        scale=static_float("scale", scale, allow_none=False),
        causal=parse_causal(causal),
        backend=_check_backend(backend),
    )


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
    choice = choose_softmax("auto", ldtype)
    if choice.backend != "kernel":
        return KernelAvailability(False, choice.why_not_kernel)
    return KernelAvailability(
        True, f"the compiled {choice.description} serves {ldtype} logits of any size"
    )


# ------------------------------------------------------------------------------------------------
# Public function
# ------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale", "causal", "backend"))
def _softmax_jit(logits, mask, *, scale, causal, backend):
    shape, dtype = _check_logits(logits)
    padded = _check_mask(mask, shape)
    choice = choose_softmax(backend, dtype)
    options = SoftmaxOptions(scale=scale, causal=causal)
    # The backends take at least one leading dim, and the mask at the logits' rank; the leading
    # dims stay as they are (not flattened), so any of them may be sharded.
    lead = shape[:-2] or (1,)
    logits_n = logits.reshape((*lead, *shape[-2:]))
    mask_n = None if mask is None else mask.reshape((1,) * (len(lead) + 2 - len(padded)) + padded)
    probs, lse, row_max = choice.module.run(options, logits_n, mask_n)
    aux = AttnAux(
        lse=lse.reshape(shape[:-1]),
        max=jax.lax.stop_gradient(row_max.reshape(shape[:-1])),
        probs=None,
        rng_state=None,
        backend=choice.backend,
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
