"""The `reference` backend: attention in plain JAX, float32 inside (float64 for float64 inputs).

It materialises the full score matrix, so it is the oracle for the compiled backends and the
fallback of last resort, not a fast path. It keeps every convention of `docs/kernel_abi.md`:
rows with no visible key give output 0 and lse = -inf (or the sink), and NaN/inf in invisible
positions of q, k, v and bias never reach outputs or gradients (masks select, they never multiply).
"""

import jax
import jax.numpy as jnp

from ._canon import Canonical, Options, Problem
from ._masking import visibility
from ._philox import dropout_keep_mask


def unavailable(problem: Problem, platform: str) -> str | None:
    """The reference backend serves every call, on every platform."""
    return None


def run(arrays: Canonical, options: Options, return_probs: bool):
    """`(out, lse, max, probs or None)` in plain JAX (see `reference_attention`)."""
    return reference_attention(arrays, options, return_probs=return_probs)


def reference_attention(
    arrays: Canonical, options: Options, *, return_probs: bool = True, mods=None, consts=()
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Returns `(out [B,Sq,Hq,Dv], lse [B,Hq,Sq], max [B,Hq,Sq], probs [B,Hq,Sq,Skv] or None)`.

    `mods`, `consts`: a `score_mod`/`mask_mod` pair as `_flex.convert` makes them (applied to
    the materialised scores after the softcap, and to the visibility)."""
    q, k, v = arrays.q, arrays.k, arrays.v
    bsz, q_seq, q_heads, _ = q.shape
    _, kv_seq, kv_heads, v_dim = v.shape
    group = q_heads // kv_heads
    compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    index = (jnp.arange(bsz, dtype=jnp.int32), jnp.arange(q_heads, dtype=jnp.int32),
             jnp.arange(q_seq, dtype=jnp.int32), jnp.arange(kv_seq, dtype=jnp.int32))

    visible = jnp.broadcast_to(visibility(arrays, options), (bsz, q_heads, q_seq, kv_seq))
    if mods is not None and mods.mask is not None:
        visible = visible & mods.mask(*index, *consts[mods.n_score:])
    # Zero out rows and columns that no visible pair touches, so that NaN/inf stored there (as
    # padding often is) cannot reach a product.
    row_used = visible.any(axis=-1)  # [B, Hq, Sq]
    col_used = visible.reshape(bsz, kv_heads, group * q_seq, kv_seq).any(axis=2)  # [B, Hkv, Skv]
    q = jnp.where(row_used.transpose(0, 2, 1)[..., None], q, 0).astype(compute)
    k = jnp.where(col_used.transpose(0, 2, 1)[..., None], k, 0).astype(compute)
    v = jnp.where(col_used.transpose(0, 2, 1)[..., None], v, 0).astype(compute)
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)

    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST)
    logits = logits * options.scale
    if options.softcap > 0:
        logits = options.softcap * jnp.tanh(logits / options.softcap)
    if mods is not None and mods.score is not None:
        logits = jnp.where(visible, logits, 0)  # score_mod sees finite scores everywhere
        logits = mods.score(logits, *index, *consts[:mods.n_score]).astype(compute)
    if arrays.bias is not None:
        logits = logits + jnp.where(visible, arrays.bias.astype(compute), 0)
    logits = jnp.where(visible, logits, 0)  # safe values where invisible; masked below

    row_max = jnp.max(jnp.where(visible, logits, -jnp.inf), axis=-1, initial=-jnp.inf)
    any_visible = jnp.isfinite(row_max)
    shift = jnp.where(any_visible, row_max, 0)
    if arrays.sink is not None:
        sink = arrays.sink.astype(compute)[None, :, None]
        shift = jnp.where(any_visible, jnp.maximum(row_max, sink), sink)
    shift = jax.lax.stop_gradient(shift)
    # Mask the exponent's argument, not its result: exp of a large invisible argument would be
    # inf, and its zero cotangent times inf is NaN in the backward.
    exp = jnp.exp(jnp.where(visible, logits - shift[..., None], -jnp.inf))
    total = jnp.sum(exp, axis=-1)
    if arrays.sink is not None:
        total = total + jnp.exp(sink - shift)
        lse = shift + jnp.log(total)
    else:
        safe_total = jnp.where(any_visible, total, 1)
        lse = jnp.where(any_visible, shift + jnp.log(safe_total), -jnp.inf)
    # P divides by the row sum rather than taking exp(s - lse): its rounding then does not grow
    # with |lse| (exp(s - lse) inherits lse's absolute error, about |lse| * 2**-24).
    probs = exp / jnp.where(total > 0, total, 1)[..., None]

    weights = probs
    if options.dropout_rate > 0:
        keep = dropout_keep_mask(
            arrays.rng_state, options.dropout_rate, bsz, q_heads, q_seq, kv_seq
        )
        weights = jnp.where(keep, probs / (1 - options.dropout_rate), 0)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=jax.lax.Precision.HIGHEST)
    del v_dim

    probs_dtype = compute if arrays.q.dtype in (jnp.float32, jnp.float64) else arrays.q.dtype
    stats_dtype = jnp.float32  # the contract: statistics are float32 whatever the inputs
    return (
        out.astype(arrays.q.dtype),
        lse.astype(stats_dtype),
        jax.lax.stop_gradient(row_max.astype(stats_dtype)),
        probs.astype(probs_dtype) if return_probs else None,
    )
