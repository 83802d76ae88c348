"""Validation of the public arguments and their canonical form for the backends.

Every public entry point validates here before anything is traced, so that a mistake gets one
clear sentence naming the argument, what was expected and what came. The canonical form is what
every backend (and the kernel ABI in `docs/kernel_abi.md`) works on: batch dimensions flattened
into one, broadcast dimensions of bias and mask kept at size 1, sequence lengths always present.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)
CAUSAL_MODES = {False: 0, None: 0, True: 1, "top_left": 1, "bottom_right": 2}
CAUSAL_NAMES = ("none", "top_left", "bottom_right")


class Options(NamedTuple):
    """Static options of one attention call; hashable, so it can key caches and `custom_vjp`."""

    scale: float
    softcap: float  # 0.0 = off
    causal: int  # 0 none, 1 top-left, 2 bottom-right
    window_left: int  # -1 = unbounded
    window_right: int  # -1 = unbounded
    dropout_rate: float
    has_seqlens: bool = False  # q_seqlens or kv_seqlens was given (GPU: cuDNN's padding mask)


class Statics(NamedTuple):
    """The static options of `attnaux.attention`, parsed once (by `parse_statics`).

    Hashable, so it keys the jit cache; `canonicalize` takes it as it is.
    """

    scale: float | None  # None: 1/sqrt(qk_dim), known once q's shape is
    causal: int  # 0 none, 1 top-left, 2 bottom-right
    window: tuple[int, int]  # (left, right), -1 = unbounded
    softcap: float | None
    dropout_rate: float


def _check_float32(name: str, value: float | None, *, positive: bool) -> None:
    """Raises unless `value` keeps its meaning in float32, the type every kernel computes in: it
    must stay finite there (1e39 is inf) and, when nonzero, not round to 0 (1e-46 does; a
    softcap must be positive in float32)."""
    if value is None:
        return
    with np.errstate(over="ignore"):
        value32 = float(np.float32(value))
    if not math.isfinite(value32) or (value != 0 and value32 == 0) or (positive and value32 <= 0):
        kind = "finite and positive" if positive else "finite and not rounded to 0"
        raise ValueError(
            f"`{name}` must be {kind} in float32, the precision the kernels compute in; got "
            f"{value!r}, which is {value32!r} in float32."
        )


def parse_statics(*, scale: Any, causal: Any, window: Any, softcap: Any,
                  dropout_rate: Any) -> Statics:
    """Validates the static options of an attention call and parses them once."""
    softcap_value = static_float("softcap", softcap, allow_none=True)
    if softcap_value is not None and softcap_value <= 0:
        raise ValueError(f"`softcap` must be a positive float or None; got {softcap_value}.")
    _check_float32("softcap", softcap_value, positive=True)
    rate = static_float("dropout_rate", dropout_rate, allow_none=False)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"`dropout_rate` must be in [0, 1); got {rate}.")
    scale_value = static_float("scale", scale, allow_none=True)
    _check_float32("scale", scale_value, positive=False)
    return Statics(
        scale=scale_value,
        causal=parse_causal(causal),
        window=parse_window(window),
        softcap=softcap_value,
        dropout_rate=rate,
    )


class SoftmaxOptions(NamedTuple):
    """Static options of one `attnaux.softmax` call (hashable: keys `custom_vjp` and the kernel
    cache)."""

    scale: float
    causal: int  # 0 none, 1 top-left, 2 bottom-right


class Canonical(NamedTuple):
    """The arrays of one attention call in canonical form (see `docs/kernel_abi.md`)."""

    q: jax.Array  # [B, Sq, Hq, D]
    k: jax.Array  # [B, Skv, Hkv, D]
    v: jax.Array  # [B, Skv, Hkv, Dv]
    bias: jax.Array | None  # float32 [Bb, Hb, Sqb, Skvb], each 1 or full
    mask: jax.Array | None  # bool, same broadcasting
    q_seqlens: jax.Array  # int32 [B]
    kv_seqlens: jax.Array  # int32 [B]
    q_segment_ids: jax.Array | None  # int32 [B, Sq]
    kv_segment_ids: jax.Array | None  # int32 [B, Skv]
    sink: jax.Array | None  # float32 [Hq]
    rng_state: jax.Array | None  # uint32 [4]


class Problem(NamedTuple):
    """A validated call: canonical arrays, static options and what is needed to unflatten."""

    arrays: Canonical
    options: Options
    batch_shape: tuple[int, ...]
    has_dropout: bool


def _fmt_shape(x: Any) -> str:
    return str(tuple(np.shape(x)))


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _as_array(name: str, x: Any) -> jax.Array:
    if isinstance(x, (jax.Array, np.ndarray)):
        return jnp.asarray(x)
    if _is_traced(x):
        return x
    raise TypeError(
        f"`{name}` must be a JAX or NumPy array; got an object of type {type(x).__name__}."
    )


def static_float(name: str, value: Any, *, allow_none: bool) -> float | None:
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"`{name}` must be a Python float; got None.")
    if _is_traced(value) or (isinstance(value, jax.Array) and not value.shape == ()):
        raise TypeError(
            f"`{name}` must be a static Python float (it is compiled into the kernel); got a "
            f"traced or array value of shape {_fmt_shape(value)}. Scale the inputs instead if it "
            "has to be traced."
        )
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number, jax.Array)):
        raise TypeError(f"`{name}` must be a Python float; got {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite; got {value}.")
    return value


def parse_causal(causal: Any) -> int:
    """Maps the public `causal` value to 0 (none), 1 (top-left) or 2 (bottom-right)."""
    if isinstance(causal, (bool, str)) or causal is None:
        try:
            return CAUSAL_MODES[causal]
        except KeyError:
            pass
    raise ValueError(
        "`causal` must be one of False, True (= 'top_left'), 'top_left' or 'bottom_right'; "
        f"got {causal!r}."
    )


def parse_window(window: Any) -> tuple[int, int]:
    """Maps `window=(left, right)` to two ints, -1 meaning unbounded (`None` on that side)."""
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            "`window` must be None or a pair (left, right) of ints >= 0 (None for an unbounded "
            f"side); got {window!r}."
        )
    sides = []
    for side_name, side in zip(("left", "right"), window):
        if side is None:
            sides.append(-1)
            continue
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
            raise TypeError(
                f"`window` {side_name} size must be an int >= 0 or None; got {side!r}."
            )
        if side < 0:
            raise ValueError(
                f"`window` sizes must be >= 0 (None for unbounded); got {side_name}={int(side)} "
                f"in window={tuple(window)!r}."
            )
        sides.append(int(side))
    return sides[0], sides[1]


def _check_float(name: str, x: jax.Array) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"`{name}` must have a floating dtype (float32, bfloat16 or float16); got "
            f"{x.dtype} with shape {_fmt_shape(x)}."
        )


def _check_int(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"`{name}` must have an integer dtype; got {x.dtype} with shape {_fmt_shape(x)}."
        )


def _broadcast_dims(
    name: str, x: jax.Array, batch: tuple[int, ...], q_heads: int, q_seq: int, kv_seq: int
) -> jax.Array:
    """Brings a bias or mask to canonical `[Bb, Hb, Sqb, Skvb]` with each dim 1 or full."""
    full = (*batch, q_heads, q_seq, kv_seq)
    layout = (f"[*batch, q_heads, q_seq, kv_seq] = {full} (batch={batch}, q_heads={q_heads}, "
              f"q_seq={q_seq}, kv_seq={kv_seq})")
    if x.ndim > len(full):
        raise ValueError(
            f"`{name}` must broadcast to {layout}, so it can have at most {len(full)} "
            f"dimensions; got shape {_fmt_shape(x)}."
        )
    padded = (1,) * (len(full) - x.ndim) + tuple(x.shape)
    for got, want in zip(padded, full):
        if got not in (1, want):
            raise ValueError(
                f"`{name}` of shape {_fmt_shape(x)} does not broadcast to {layout}: every "
                "dimension must be 1 or equal to the one it lines up with."
            )
    x = x.reshape(padded)
    nb = len(batch)
    batch_part, rest = padded[:nb], padded[nb:]
    if all(d == 1 for d in batch_part):
        return x.reshape((1, *rest))
    if batch_part != batch:
        x = jnp.broadcast_to(x, (*batch, *rest))
    return x.reshape((math.prod(batch), *rest))


def _segment_ids_int32(q_ids: jax.Array, kv_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Segment ids as the kernels' int32, keeping which pairs are equal.

    32-bit ids cast one to one. Wider ids (with `jax_enable_x64`) would collide when truncated
    (0 and 2**32 would compare equal), so each row's ids are replaced by their rank among that
    row's q and kv ids: equal ids get equal ranks, different ids different ones."""
    if jnp.dtype(q_ids.dtype).itemsize <= 4 and jnp.dtype(kv_ids.dtype).itemsize <= 4:
        return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    both = jnp.concatenate([q_ids, kv_ids.astype(q_ids.dtype)], axis=1)
    ranks = jax.vmap(jnp.searchsorted)(jnp.sort(both, axis=1), both).astype(jnp.int32)
    return ranks[:, : q_ids.shape[1]], ranks[:, q_ids.shape[1] :]


def check_key(key: Any) -> None:
    """Raises unless `key` is one JAX PRNG key (typed, or a legacy `uint32[2]`)."""
    if _is_traced(key) or isinstance(key, jax.Array):
        is_typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        if (is_typed and key.shape == ()) or (
            not is_typed and key.dtype == jnp.uint32 and key.shape == (2,)
        ):
            return
        what = f"an array of shape {_fmt_shape(key)} and dtype {key.dtype}"
    else:
        what = f"an object of type {type(key).__name__}"
    raise TypeError(
        "`key` must be a single JAX PRNG key (from `jax.random.key(seed)`, or a legacy "
        f"`jax.random.PRNGKey(seed)`); got {what}."
    )


def rng_state_from_key(key: Any) -> jax.Array:
    """Derives the `uint32[4]` dropout state (seed, offset) from a JAX PRNG key."""
    check_key(key)
    return jax.random.bits(key, (4,), jnp.uint32)


def canonicalize(
    q: Any,
    k: Any,
    v: Any,
    statics: Statics,
    *,
    bias: Any = None,
    mask: Any = None,
    q_seqlens: Any = None,
    kv_seqlens: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    sink: Any = None,
    key: Any = None,
) -> Problem:
    """Validates the array arguments of `attention` and returns the call in canonical form; the
    static options come parsed (`parse_statics`)."""
    q, k, v = _as_array("q", q), _as_array("k", k), _as_array("v", v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x)
        if x.ndim < 3:
            raise ValueError(
                f"`{name}` must have shape [*batch, seq, heads, dim] (at least 3 dimensions); "
                f"got shape {_fmt_shape(x)}."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"`q`, `k` and `v` must share one dtype; got q: {q.dtype}, k: {k.dtype}, v: {v.dtype}."
        )
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            "`q`, `k` and `v` must have the same number of dimensions ([*batch, seq, heads, dim] "
            f"with the same batch dimensions); got q: {_fmt_shape(q)}, k: {_fmt_shape(k)}, "
            f"v: {_fmt_shape(v)}."
        )
    batch = tuple(q.shape[:-3])
    if tuple(k.shape[:-3]) != batch or tuple(v.shape[:-3]) != batch:
        raise ValueError(
            f"`q`, `k` and `v` must have the same batch dimensions; got q batch {batch}, "
            f"k batch {tuple(k.shape[:-3])}, v batch {tuple(v.shape[:-3])}."
        )
    q_seq, q_heads, qk_dim = q.shape[-3:]
    kv_seq, kv_heads, _ = k.shape[-3:]
    if k.shape[-1] != qk_dim:
        raise ValueError(
            f"`k` must have the same head dimension (last axis) as `q`, {qk_dim}; got "
            f"k.shape={_fmt_shape(k)} with qk_dim {k.shape[-1]}."
        )
    if v.shape[-3] != kv_seq or v.shape[-2] != kv_heads:
        raise ValueError(
            f"`v` must have shape [*batch, kv_seq={kv_seq}, kv_heads={kv_heads}, v_dim] like `k`; "
            f"got v.shape={_fmt_shape(v)}."
        )
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(
            f"The number of query heads must be a multiple of the number of key/value heads "
            f"(GQA/MQA); got q_heads={q_heads} (q.shape={_fmt_shape(q)}) and kv_heads={kv_heads} "
            f"(k.shape={_fmt_shape(k)})."
        )

    scale_value = statics.scale
    if scale_value is None:
        scale_value = 1.0 / math.sqrt(qk_dim) if qk_dim > 0 else 1.0
    softcap_value, rate = statics.softcap, statics.dropout_rate
    causal_mode = statics.causal
    window_left, window_right = statics.window

    bsz = math.prod(batch)
    bias_c = None
    if bias is not None:
        bias = _as_array("bias", bias)
        _check_float("bias", bias)
        bias_c = _broadcast_dims("bias", bias, batch, q_heads, q_seq, kv_seq)
        bias_c = bias_c.astype(jnp.float64 if bias.dtype == jnp.float64 else jnp.float32)
    mask_c = None
    if mask is not None:
        mask = _as_array("mask", mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(
                "`mask` must be a boolean array (True = attend); got dtype "
                f"{mask.dtype} with shape {_fmt_shape(mask)}. Use `mask.astype(bool)` for a 0/1 "
                "mask, or pass additive values as `bias`."
            )
        mask_c = _broadcast_dims("mask", mask, batch, q_heads, q_seq, kv_seq)

    def seqlens(name: str, x: Any, full: int) -> jax.Array:
        if x is None:
            return jnp.full((bsz,), full, jnp.int32)
        x = _as_array(name, x)
        _check_int(name, x)
        if tuple(x.shape) != batch:
            raise ValueError(
                f"`{name}` must have shape [*batch] = {batch} (one length per sequence); got "
                f"shape {_fmt_shape(x)}."
            )
        # Clamped before the cast, so that a 64-bit length such as 2**32 + 1 is not truncated
        # (lengths beyond the sequence mean the whole sequence, as the kernels clamp).
        return jnp.clip(x.reshape((bsz,)), 0, full).astype(jnp.int32)

    q_len = seqlens("q_seqlens", q_seqlens, q_seq)
    kv_len = seqlens("kv_seqlens", kv_seqlens, kv_seq)

    if (q_segment_ids is None) != (kv_segment_ids is None):
        if q_seq != kv_seq:
            given = "q_segment_ids" if q_segment_ids is not None else "kv_segment_ids"
            raise ValueError(
                f"Only `{given}` was given, and q_seq={q_seq} differs from kv_seq={kv_seq}; "
                "pass both `q_segment_ids` and `kv_segment_ids`."
            )
        q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
        kv_segment_ids = q_segment_ids
    q_seg = kv_seg = None
    if q_segment_ids is not None:
        segs = []
        for name, x, seq in (
            ("q_segment_ids", q_segment_ids, q_seq),
            ("kv_segment_ids", kv_segment_ids, kv_seq),
        ):
            x = _as_array(name, x)
            _check_int(name, x)
            if tuple(x.shape) != (*batch, seq):
                raise ValueError(
                    f"`{name}` must have shape [*batch, {name[:-12]}_seq] = {(*batch, seq)}; got "
                    f"shape {_fmt_shape(x)}."
                )
            segs.append(x.reshape((bsz, seq)))
        q_seg, kv_seg = _segment_ids_int32(*segs)

    sink_c = None
    if sink is not None:
        sink = _as_array("sink", sink)
        _check_float("sink", sink)
        if tuple(sink.shape) != (q_heads,):
            raise ValueError(
                f"`sink` must have shape [q_heads] = ({q_heads},), one logit per query head; got "
                f"shape {_fmt_shape(sink)}."
            )
        sink_c = sink.astype(jnp.float64 if sink.dtype == jnp.float64 else jnp.float32)

    rng_state = None
    if rate > 0.0:
        if key is None:
            raise ValueError(
                f"`dropout_rate={rate}` needs a PRNG key: pass `key=jax.random.key(...)` "
                "(or set dropout_rate=0.0 for inference)."
            )
        rng_state = rng_state_from_key(key)
    elif key is not None:
        rng_state_from_key(key)  # still validate what came

    arrays = Canonical(
        q=q.reshape((bsz, q_seq, q_heads, qk_dim)),
        k=k.reshape((bsz, kv_seq, kv_heads, qk_dim)),
        v=v.reshape((bsz, kv_seq, kv_heads, v.shape[-1])),
        bias=bias_c,
        mask=mask_c,
        q_seqlens=q_len,
        kv_seqlens=kv_len,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        sink=sink_c,
        rng_state=rng_state,
    )
    options = Options(
        scale=scale_value,
        softcap=0.0 if softcap_value is None else softcap_value,
        causal=causal_mode,
        window_left=window_left,
        window_right=window_right,
        dropout_rate=rate,
        has_seqlens=q_seqlens is not None or kv_seqlens is not None,
    )
    return Problem(arrays, options, batch, rate > 0.0)
