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


_USAGE_BLOCK = 512  # key columns per step when finding the rows no visible pair uses


def _usage(arrays: Canonical, options: Options) -> tuple[jax.Array, jax.Array]:
    """Which q rows (`bool[B, Sq, Hq or 1]`) and k/v rows (`bool[B, Skv, Hkv or 1]`) take part
    in at least one visible (query, key) pair; computed one block of keys at a time, so memory
    stays linear in the sequence length."""
    from ._reference import visibility

    bsz, q_seq, q_heads, _ = arrays.q.shape
    kv_seq, kv_heads = arrays.k.shape[1:3]
    group = q_heads // kv_heads
    mask, kv_seg = arrays.mask, arrays.kv_segment_ids
    heads = 1 if mask is None else mask.shape[1]
    block = max(1, min(_USAGE_BLOCK, kv_seq))
    n_blocks = -(-kv_seq // block)
    pad = n_blocks * block - kv_seq
    mask_full_keys = mask is not None and mask.shape[3] == kv_seq and kv_seq > 1
    if pad and mask_full_keys:
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, pad)))
    if pad and kv_seg is not None:
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pad)))

    def step(rows_used, index):
        start = index * block
        sliced = arrays._replace(
            mask=jax.lax.dynamic_slice_in_dim(mask, start, block, 3) if mask_full_keys else mask,
            kv_segment_ids=None if kv_seg is None
            else jax.lax.dynamic_slice_in_dim(kv_seg, start, block, 1),
        )
        keys = start + jnp.arange(block, dtype=jnp.int32)
        visible = visibility(sliced, options, keys=keys, kv_seq=kv_seq)  # [B, heads, Sq, block]
        cols = visible.any(axis=2)  # [B, heads, block]
        if heads == q_heads and group > 1:
            cols = cols.reshape(bsz, kv_heads, group, block).any(axis=2)
        return rows_used | visible.any(axis=3), cols

    rows_used, cols = jax.lax.scan(
        step, jnp.zeros((bsz, heads, q_seq), bool), jnp.arange(n_blocks, dtype=jnp.int32)
    )
    cols = cols.transpose(1, 0, 3, 2).reshape(bsz, n_blocks * block, -1)[:, :kv_seq]
    return rows_used.transpose(0, 2, 1), cols


def zero_hidden_rows(arrays: Canonical, options: Options) -> Canonical:
    """Zeroes the q rows and k/v rows that take part in no visible pair, when a mask or segment
    ids are given.

    The kernels never read rows past the sequence lengths, skip key ranges outside the causal or
    window band, and select (never multiply) inside a tile; but a row hidden by a boolean mask or
    by the segment ids (alone, or together with the band) still enters the products `P @ V`,
    `dS @ K` and `dS^T @ Q` with weight 0, and `0 * NaN` is NaN. Zeroing those rows first keeps
    the convention that nothing stored in a masked-out position reaches any output or gradient.
    It costs one pass over the visibility pattern and over q, k and v, and only then.
    """
    if arrays.mask is None and arrays.q_segment_ids is None:
        return arrays
    q_rows, kv_rows = _usage(arrays, options)
    return arrays._replace(
        q=jnp.where(q_rows[..., None], arrays.q, 0),
        k=jnp.where(kv_rows[..., None], arrays.k, 0),
        v=jnp.where(kv_rows[..., None], arrays.v, 0),
    )


def kernel_args(arrays: Canonical, options: Options) -> tuple[jax.Array, ...]:
    """The canonical arrays as the kernel takes them: rows hidden by the mask or segment ids
    zeroed (see `zero_hidden_rows`), absent inputs as empty `(0,)` arrays."""
    arrays = zero_hidden_rows(arrays, options)
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


def batched_ffi_call(target: str, options: Options, result_shapes):
    """The FFI target `target` with attnaux's attributes, as a `custom_vmap` function of the kernel
    arguments (the 11 canonical ones first) whose batching rule is `_batching_rule`.
    `result_shapes(*args)` gives the `jax.ShapeDtypeStruct`s of its outputs."""

    @custom_vmap
    def call(*args):
        return tuple(jax.ffi.ffi_call(target, result_shapes(*args))(*args, **_attrs(options)))

    call.def_vmap(_batching_rule(call))
    return call


def gradient_shapes(q, k, v, bias, *_) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Outputs of every attention backward kernel: dq, dk, dv, and the full float32 dbias
    `[B, Hq, Sq, Skv]` when a bias is given (else `(0,)`)."""
    bsz, q_seq, q_heads, _ = q.shape
    dbias_shape = (bsz, q_heads, q_seq, k.shape[1]) if _present(bias) else (0,)
    return (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
    )


def _forward_shapes(q, k, v, *_) -> tuple[jax.ShapeDtypeStruct, ...]:
    bsz, q_seq, q_heads, _ = q.shape
    return (
        jax.ShapeDtypeStruct((bsz, q_seq, q_heads, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),
        jax.ShapeDtypeStruct((bsz, q_heads, q_seq), jnp.float32),
    )


@functools.cache
def _forward_call(options: Options):
    # Arguments: the 11 canonical ones.
    return batched_ffi_call(FWD_TARGET, options, _forward_shapes)


@functools.cache
def _backward_call(options: Options):
    # Arguments: the 11 canonical ones, then out, dout, lse, dlse.
    return batched_ffi_call(BWD_TARGET, options, gradient_shapes)


def fixed_order_sum(x: jax.Array, axis: int) -> jax.Array:
    """Sum over `axis` (kept as size 1) by pairwise halving: elementwise adds only, so the result
    never depends on how XLA splits a reduction over threads (its own reductions do)."""
    while x.shape[axis] > 1:
        n = x.shape[axis]
        half = n // 2
        low = jax.lax.slice_in_dim(x, 0, half, axis=axis)
        high = jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)
        summed = low + high
        if n % 2:
            rest = jax.lax.slice_in_dim(x, 2 * half, n, axis=axis)
            summed = jax.lax.concatenate([summed, rest], axis)
        x = summed
    if x.shape[axis] == 0:
        x = jnp.zeros((*x.shape[:axis], 1, *x.shape[axis + 1:]), x.dtype)
    return x


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
        dbias = dbias_full
        for axis in range(4):
            if bias.shape[axis] == 1 and dbias.shape[axis] != 1:
                dbias = fixed_order_sum(dbias, axis)
    dsink = None
    if _present(sink):
        # d lse / d sink = exp(sink - lse) and d out / d sink = -exp(sink - lse) * out, so the
        # sink's gradient needs only per-row terms: no kernel output.
        row_term = jnp.einsum(
            "bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32)
        ) - dlse
        terms = jnp.exp(sink[None, :, None] - lse) * row_term  # [B, Hq, Sq]
        dsink = -fixed_order_sum(fixed_order_sum(terms, 2), 0).reshape(sink.shape)
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
    return _flash(options, *kernel_args(arrays, options))
