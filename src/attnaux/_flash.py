"""The `flash` backend: the compiled blocked online-softmax kernels behind `jax.custom_vjp`.

The forward saves only `lse` (plus the inputs and the output); the backward recomputes the
probabilities tile by tile from it. Both kernels are XLA FFI targets (`docs/kernel_abi.md`).
`jax.vmap` is handled by a batching rule that folds the mapped axis into the kernel's batch
dimension, so a vmapped call is one kernel launch; where that would change results (a batched sink
or dropout state), it maps sequentially instead.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from ._canon import Canonical, Options

FWD_TARGET = "attnaux_flash_fwd"
BWD_TARGET = "attnaux_flash_bwd"

# Positions of the canonical arrays in the kernel's argument list.
_PER_BATCH = (0, 1, 2, 5, 6, 7, 8)  # q, k, v, q_seqlens, kv_seqlens, q/kv_segment_ids
_BROADCAST = (3, 4)  # bias, mask: [Bb, Hb, Sqb, Skvb] with Bb in {1, B}
_SHARED = (9, 10)  # sink, rng_state: one per call
_EMPTY_DTYPES = (
    None, None, None, jnp.float32, jnp.bool_, None, None, jnp.int32, jnp.int32, jnp.float32,
    jnp.uint32,
)


def _attrs(options: Options) -> dict:
    return dict(
        scale=np.float32(options.scale),
        softcap=np.float32(options.softcap),
        causal=np.int32(options.causal),
        window_left=np.int64(options.window_left),
        window_right=np.int64(options.window_right),
        dropout_rate=np.float32(options.dropout_rate),
    )


def _members(values: jax.Array, pool: jax.Array, pool_valid: jax.Array) -> jax.Array:
    """`bool[B, n]`: whether each of `values[b]` occurs among the valid entries of `pool[b]`."""

    def one(values, pool, pool_valid):
        big = jnp.iinfo(jnp.int32).max
        ordered = jnp.sort(jnp.where(pool_valid, pool, big))
        at = jnp.clip(jnp.searchsorted(ordered, values), 0, max(pool.shape[0] - 1, 0))
        found = ordered[at] == values if pool.shape[0] else jnp.zeros(values.shape, bool)
        return found & ((values != big) | jnp.any(pool_valid & (pool == big)))

    return jax.vmap(one)(values, pool, pool_valid)


def zero_hidden_rows(arrays: Canonical) -> Canonical:
    """Zeroes the q rows and k/v rows that the mask or the segment ids hide from every partner.

    The kernels skip padding (rows past the sequence lengths) and select, never multiply, inside
    a tile; but a key hidden only by a boolean mask (say a key-padding mask) still sits inside the
    products `P @ V` and `dS @ K` with weight 0, and `0 * NaN` is NaN. Zeroing such rows first
    keeps the convention that nothing stored in a masked-out position reaches any output or
    gradient. Costs one pass over q, k and v, and only when a mask or segment ids are given.
    """
    if arrays.mask is None and arrays.q_segment_ids is None:
        return arrays
    bsz, q_seq, q_heads, _ = arrays.q.shape
    kv_seq, kv_heads = arrays.k.shape[1:3]
    group = q_heads // kv_heads
    q_rows = jnp.ones((bsz, q_seq, 1), bool)  # [B, Sq, Hq or 1]
    kv_rows = jnp.ones((bsz, kv_seq, 1), bool)  # [B, Skv, Hkv or 1]
    if arrays.mask is not None:  # conservative: any key / any query of the mask, per head
        m = arrays.mask
        q_rows = q_rows & jnp.broadcast_to(
            m.any(axis=3).transpose(0, 2, 1), (m.shape[0], q_seq, m.shape[1]))
        kv_any = m.any(axis=2)  # [Bm, Hm, Skvm]
        if m.shape[1] == q_heads and group > 1:
            kv_any = kv_any.reshape(m.shape[0], kv_heads, group, -1).any(axis=2)
        kv_rows = kv_rows & jnp.broadcast_to(
            kv_any.transpose(0, 2, 1), (m.shape[0], kv_seq, kv_any.shape[1]))
    if arrays.q_segment_ids is not None:
        q_valid = jnp.arange(q_seq) < jnp.clip(arrays.q_seqlens, 0, q_seq)[:, None]
        kv_valid = jnp.arange(kv_seq) < jnp.clip(arrays.kv_seqlens, 0, kv_seq)[:, None]
        q_seg, kv_seg = arrays.q_segment_ids, arrays.kv_segment_ids
        q_rows = q_rows & _members(q_seg, kv_seg, kv_valid)[..., None]
        kv_rows = kv_rows & _members(kv_seg, q_seg, q_valid)[..., None]
    return arrays._replace(
        q=jnp.where(q_rows[..., None], arrays.q, 0),
        k=jnp.where(kv_rows[..., None], arrays.k, 0),
        v=jnp.where(kv_rows[..., None], arrays.v, 0),
    )


def kernel_args(arrays: Canonical) -> tuple[jax.Array, ...]:
    """The canonical arrays as the kernel takes them: rows hidden by the mask or segment ids
    zeroed (see `zero_hidden_rows`), absent inputs as empty `(0,)` arrays."""
    arrays = zero_hidden_rows(arrays)
    return tuple(
        jnp.zeros((0,), dtype) if x is None else x for x, dtype in zip(arrays, _EMPTY_DTYPES)
    )


def _present(x: jax.Array) -> bool:
    return x.ndim > 1 or x.shape != (0,)


def _fold(axis_size: int, batched: bool, x: jax.Array, per_batch: bool, bsz: int) -> jax.Array:
    """Merges the vmapped axis (leading, if batched) into the kernel's batch dimension."""
    if per_batch:
        if not batched:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        return x.reshape((axis_size * x.shape[1], *x.shape[2:]))
    # bias / mask: dims [Bb, ...] with Bb in {1, bsz}.
    if not _present(x if not batched else x[0]):
        return x[0] if batched else x
    if not batched:
        if x.shape[0] == 1:
            return x
        x = jnp.broadcast_to(x, (axis_size, *x.shape))
    elif x.shape[1] != bsz:
        x = jnp.broadcast_to(x, (axis_size, bsz, *x.shape[2:]))
    return x.reshape((axis_size * bsz, *x.shape[2:]))


def _unfold(axis_size: int, x: jax.Array) -> jax.Array:
    return x.reshape((axis_size, x.shape[0] // axis_size, *x.shape[1:]))


def _batching_rule(fn):
    """A `custom_vmap` rule for a kernel call whose first 11 arguments are the canonical ones and
    whose remaining arguments (and every output) are per batch element."""

    def rule(axis_size, in_batched, *args):
        sink_batched = in_batched[9] and _present(args[9][0])
        has_dropout = _present(args[10][0] if in_batched[10] else args[10])
        if sink_batched or has_dropout or axis_size == 0:
            # A sink per mapped element cannot share one launch, and folding the mapped axis into
            # the batch would change the dropout counters (so `vmap(f)(x)[n]` would differ from
            # `f(x[n])` and from `introspect.dropout_mask`): map the elements one after another.
            def one(mapped):
                it = iter(mapped)
                return fn(*(next(it) if b else a for a, b in zip(args, in_batched)))

            outs = jax.lax.map(one, tuple(a for a, b in zip(args, in_batched) if b))
            return outs, jax.tree.map(lambda _: True, outs)
        bsz = args[0].shape[1] if in_batched[0] else args[0].shape[0]
        folded = []
        for i, (x, b) in enumerate(zip(args, in_batched)):
            if i in _SHARED:
                folded.append(x[0] if b else x)
            elif i in _BROADCAST:
                folded.append(_fold(axis_size, b, x, per_batch=False, bsz=bsz))
            else:
                folded.append(_fold(axis_size, b, x, per_batch=True, bsz=bsz))
        outs = fn(*folded)
        unfolded = tuple(
            _unfold(axis_size, o) if _present(o) else o for o in outs
        )
        return unfolded, tuple(_present(o) for o in outs)

    return rule


@functools.lru_cache(maxsize=None)
def _forward_call(options: Options):
    @custom_vmap
    def forward(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg, sink, rng):
        bsz, q_seq, q_heads, _ = q.shape
        v_dim = v.shape[-1]
        call = jax.ffi.ffi_call(
            FWD_TARGET,
            (
                jax.ShapeDtypeStruct((bsz, q_seq, q_heads, v_dim), q.dtype),
                jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),
                jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),
            ),
        )
        return tuple(
            call(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg, sink, rng, **_attrs(options))
        )

    forward.def_vmap(_batching_rule(forward))
    return forward


@functools.lru_cache(maxsize=None)
def _backward_call(options: Options):
    @custom_vmap
    def backward(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg, sink, rng, out, dout, lse, dlse):
        bsz, q_seq, q_heads, _ = q.shape
        kv_seq = k.shape[1]
        dbias_shape = (bsz, q_heads, q_seq, kv_seq) if _present(bias) else (0,)
        call = jax.ffi.ffi_call(
            BWD_TARGET,
            (
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(k.shape, k.dtype),
                jax.ShapeDtypeStruct(v.shape, v.dtype),
                jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
            ),
        )
        return tuple(
            call(
                q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg, sink, rng,
                out, dout, lse, dlse, **_attrs(options),
            )
        )

    backward.def_vmap(_batching_rule(backward))
    return backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(options: Options, *args: jax.Array):
    return _forward_call(options)(*args)


def _flash_fwd(options: Options, *args: jax.Array):
    out, lse, row_max = _forward_call(options)(*args)
    return (out, lse, row_max), (args, out, lse)


def _flash_bwd(options: Options, residuals, cotangents):
    args, out, lse = residuals
    dout, dlse, _ = cotangents  # the row max carries no gradient
    dout = dout.astype(out.dtype)
    dlse = dlse.astype(jnp.float32)
    dq, dk, dv, dbias_full = _backward_call(options)(*args, out, dout, lse, dlse)
    bias, sink = args[3], args[9]
    dbias = None
    if _present(bias):
        axes = tuple(a for a in range(4) if bias.shape[a] == 1 and dbias_full.shape[a] != 1)
        dbias = jnp.sum(dbias_full, axis=axes, keepdims=True).reshape(bias.shape)
    dsink = None
    if _present(sink):
        # d lse / d sink = exp(sink - lse) and d out / d sink = -exp(sink - lse) * out, so the
        # sink's gradient needs only per-row terms: no kernel output.
        row_term = jnp.einsum(
            "bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32)
        ) - dlse
        dsink = -jnp.sum(jnp.exp(sink[None, :, None] - lse) * row_term, axis=(0, 2))
    cts = [dq, dk, dv, dbias] + [None] * 5 + [dsink, None]
    return tuple(cts)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    arrays: Canonical, options: Options
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs the compiled `flash` kernels: `(out [B,Sq,Hq,Dv], lse [B,Hq,Sq], max [B,Hq,Sq])`."""
    if jax.default_backend() == "gpu":  # cuDNN fused attention (see _flash_cuda.py)
        from ._flash_cuda import flash_attention_cuda

        return flash_attention_cuda(arrays, options)
    return _flash(options, *kernel_args(arrays))
