"""Shared machinery: options in canonical form, and logits recomputed one key block at a time.

The masking is `attnaux._internal.visibility` (the rules of `docs/kernel_abi.md`), evaluated for
one slice of key positions at a time so that nothing of size `q_seq x kv_seq` is ever formed.
Every function that recomputes probabilities from `aux.lse` goes through `block_scores`, so
there is one definition of the logits in this package.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from beartype import BeartypeConf, beartype
from jaxtyping import Array

from attnaux._internal import (
    AttnAux,
    Canonical,
    Options,
    Problem,
    dropout_keep_mask,
    static_float,
    visibility,
)
from attnaux._internal import canonical_problem as attention_problem

# Arrays may come from JAX or NumPy; Python ints are accepted where a float is asked for.
Arr = Array | np.ndarray
typechecker = beartype(conf=BeartypeConf(is_pep484_tower=True))

DEFAULT_BLOCK_SIZE = 256

MASK_OPTIONS = (
    "scale", "bias", "mask", "causal", "window", "q_seqlens", "kv_seqlens", "q_segment_ids",
    "kv_segment_ids", "softcap", "sink",
)
# Keywords of `attnaux.attention` that do not shape the logits: accepted (so that one options dict
# serves `attention` and the functions here) and ignored, except `dropout_rate` in the backward.
OTHER_OPTIONS = ("dropout_rate", "key", "return_probs", "backend")


def canonical_problem(
    fn_name: str, q: Any, k: Any, v: Any, options: dict
) -> tuple[Problem, float]:
    """Validates `options` like `attnaux.attention` does; returns the problem and the dropout rate.

    The dropout rate is validated but not put into the problem: the state comes from
    `aux.rng_state`, so no key is needed.
    """
    unknown = sorted(set(options) - set(MASK_OPTIONS) - set(OTHER_OPTIONS))
    if unknown:
        raise TypeError(
            f"{fn_name}() got unexpected keyword arguments {unknown}; it takes the keyword "
            f"arguments of attnaux.attention that shape the logits: {', '.join(MASK_OPTIONS)} "
            f"(and accepts, ignoring them unless documented, {', '.join(OTHER_OPTIONS)})."
        )
    kw = {name: options[name] for name in MASK_OPTIONS if name in options}
    problem = attention_problem(q, k, v, **kw)
    rate = static_float("dropout_rate", options.get("dropout_rate", 0.0), allow_none=False)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"`dropout_rate` must be in [0, 1); got {rate}.")
    return problem, rate


def check_aux(fn_name: str, aux: Any, problem: Problem) -> None:
    """Checks that `aux` belongs to a call with the shapes of `problem`."""
    if not isinstance(aux, AttnAux):
        raise TypeError(
            f"{fn_name}() needs the `AttnAux` returned by attnaux.attention as `aux`; got an "
            f"object of type {type(aux).__name__}."
        )
    _, q_seq, q_heads, _ = problem.arrays.q.shape
    want = (*problem.batch_shape, q_heads, q_seq)
    if tuple(aux.lse.shape) != want:
        raise ValueError(
            f"`aux.lse` must have shape [*batch, q_heads, q_seq] = {want} to match `q` of shape "
            f"{(*problem.batch_shape, q_seq, q_heads, problem.arrays.q.shape[-1])}; got shape "
            f"{tuple(aux.lse.shape)}. Pass the aux of the attention call made with this `q`."
        )


def check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"`block_size` must be a positive int; got {block_size!r}.")
    if block_size < 1:
        raise ValueError(f"`block_size` must be a positive int; got {int(block_size)}.")
    return int(block_size)


def compute_dtype(arrays: Canonical):
    return jnp.float64 if arrays.q.dtype == jnp.float64 else jnp.float32


def safe_lse(lse: jax.Array, compute) -> jax.Array:
    """`lse` with non-finite entries (rows with no visible key) replaced by 0."""
    lse = lse.astype(compute)
    return jnp.where(jnp.isfinite(lse), lse, 0)


class Layout(NamedTuple):
    """How the key axis is cut into blocks; static."""

    block: int  # keys per block
    n_blocks: int
    padded: int  # block * n_blocks >= kv_seq (0 when kv_seq is 0)


def layout(kv_seq: int, block_size: int) -> Layout:
    block = max(1, min(block_size, kv_seq))
    n_blocks = math.ceil(kv_seq / block)
    return Layout(block, n_blocks, block * n_blocks)


def kv_full(x: jax.Array, kv_seq: int) -> bool:
    """Whether a canonical bias/mask has a full (not broadcast) key dimension."""
    return x.shape[-1] != 1 or kv_seq == 1


def pad_keys(arrays: Canonical, lay: Layout) -> Canonical:
    """Pads every array with a key axis to `lay.padded` keys (padding is never visible)."""
    kv_seq = arrays.k.shape[1]
    # At least one block's worth, so that slicing traces even when there are no keys at all.
    extra = max(lay.padded, lay.block) - kv_seq

    def pad(x, axis):
        if x is None or extra == 0:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    bias = arrays.bias if arrays.bias is None or not kv_full(arrays.bias, kv_seq) else pad(
        arrays.bias, 3
    )
    mask = arrays.mask if arrays.mask is None or not kv_full(arrays.mask, kv_seq) else pad(
        arrays.mask, 3
    )
    return arrays._replace(
        k=pad(arrays.k, 1), v=pad(arrays.v, 1), bias=bias, mask=mask,
        kv_segment_ids=pad(arrays.kv_segment_ids, 1),
    )


def _slice_keys(x: jax.Array | None, start: jax.Array, size: int, axis: int, kv_seq: int):
    if x is None or (axis == 3 and not kv_full(x, kv_seq)):
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def block_visibility(
    arrays: Canonical, options: Options, j: jax.Array, mask_blk, kv_seg_blk, kv_seq: int
) -> jax.Array:
    """`bool[B, Hq or 1, Sq, block]`: `attnaux._internal.visibility` for key positions `j`."""
    sliced = arrays._replace(mask=mask_blk, kv_segment_ids=kv_seg_blk)
    return visibility(sliced, options, keys=j, kv_seq=kv_seq)


def keep_block(
    rng_state: jax.Array, rate: float, shape: tuple[int, int, int], kv_seq: int, j: jax.Array
) -> jax.Array:
    """`bool[B, Hq, Sq, block]`: columns `j` of `attnaux._internal.dropout_keep_mask`."""
    bsz, heads, q_seq = shape
    return dropout_keep_mask(rng_state, rate, bsz, heads, q_seq, kv_seq, columns=j)


class Scores(NamedTuple):
    """One key block's recomputed logits and what the backward needs of them."""

    visible: jax.Array  # bool [B, Hq, Sq, block]
    s: jax.Array  # final logits, 0 where not visible [B, Hq, Sq, block]
    r: jax.Array  # scale * q.k before the softcap [B, Hq, Sq, block]
    q: jax.Array  # q with rows that see no key of this block zeroed [B, Sq, Hkv, G, D]
    k: jax.Array  # k of this block, keys seen by no query zeroed [B, block, Hkv, D]
    v: jax.Array | None  # likewise for v
    rows: jax.Array  # bool [B, Hq, Sq]: the row sees a key of this block
    bias: jax.Array | None  # this block's slice of the canonical bias
    j: jax.Array  # int32 [block]: key positions


def block_scores(
    padded: Canonical, options: Options, lay: Layout, n: jax.Array, kv_seq: int, with_v: bool
) -> Scores:
    """Recomputes the logits of key block `n` exactly as the attention kernels define them."""
    q = padded.q
    bsz, q_seq, q_heads, qk_dim = q.shape
    kv_heads = padded.k.shape[2]
    group = q_heads // kv_heads
    compute = compute_dtype(padded)
    start = n * lay.block
    j = start + jnp.arange(lay.block, dtype=jnp.int32)
    k = _slice_keys(padded.k, start, lay.block, 1, kv_seq)
    v = _slice_keys(padded.v, start, lay.block, 1, kv_seq) if with_v else None
    mask = _slice_keys(padded.mask, start, lay.block, 3, kv_seq)
    bias = _slice_keys(padded.bias, start, lay.block, 3, kv_seq)
    kv_seg = _slice_keys(padded.kv_segment_ids, start, lay.block, 1, kv_seq)

    visible = block_visibility(padded, options, j, mask, kv_seg, kv_seq)
    visible = jnp.broadcast_to(visible, (bsz, q_heads, q_seq, lay.block))
    # Masking selects, it never multiplies: zero rows/keys no visible pair touches, so that
    # NaN/inf stored in padding cannot reach a product.
    rows = visible.any(axis=-1)
    cols = visible.reshape(bsz, kv_heads, group * q_seq, lay.block).any(axis=2)
    cols = cols.transpose(0, 2, 1)[..., None]  # [B, block, Hkv, 1]
    qz = jnp.where(rows.transpose(0, 2, 1)[..., None], q, 0).astype(compute)
    qz = qz.reshape(bsz, q_seq, kv_heads, group, qk_dim)
    kz = jnp.where(cols, k, 0).astype(compute)
    vz = jnp.where(cols, v, 0).astype(compute) if with_v else None

    r = jnp.einsum("bqhgd,bkhd->bhgqk", qz, kz, precision=jax.lax.Precision.HIGHEST)
    r = r.reshape(bsz, q_heads, q_seq, lay.block) * options.scale
    s = options.softcap * jnp.tanh(r / options.softcap) if options.softcap > 0 else r
    if bias is not None:
        s = s + jnp.where(visible, bias.astype(compute), 0)
    s = jnp.where(visible, s, 0)
    return Scores(visible, s, r, qz, kz, vz, rows, bias, j)


def probs_of(scores: Scores, lse_safe: jax.Array) -> jax.Array:
    """`P = exp(s - lse)` on visible entries, 0 elsewhere."""
    return jnp.where(scores.visible, jnp.exp(scores.s - lse_safe[..., None]), 0)


def unflatten(x: jax.Array, batch: tuple[int, ...]) -> jax.Array:
    return x.reshape((*batch, *x.shape[1:]))
