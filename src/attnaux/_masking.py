"""The masking rules of `docs/kernel_abi.md`, defined once in Python, and the hidden-row pass.

Part of the kernel-call layer (with `_kernel_call.py`): every Python path that needs to know
which (query, key) pairs are visible asks `visibility` (the `reference` backend, the hidden-row
zeroing below, and, through `attnaux._internal`, the blockwise recomputations of
`attnaux.introspect`); every compiled backend zeroes the rows no visible pair uses with
`zero_hidden_rows` before its kernels multiply them.

The functions take the canonical arrays and options (`_canon.Canonical`, `_canon.Options`) and
read them by field; this module imports only `_partition.py` of attnaux (for the varying axes of
`jax.shard_map`), so it sits near the bottom of the import graph.
"""

from typing import Any

import jax
import jax.numpy as jnp

from ._partition import match_vma, vma

Canonical = Any  # `_canon.Canonical`: the canonical arrays of a call
Options = Any  # `_canon.Options`: its static options


def visibility(
    arrays: Canonical, options: Options, keys: jax.Array | None = None, kv_seq: int | None = None
) -> jax.Array:
    """`bool[B, Hq or 1, Sq, n]`: which key each query row may attend to.

    With `keys` (`int[n]` key positions) only those columns are computed; `arrays.mask` and
    `arrays.kv_segment_ids` must then already be sliced to them (a broadcast key dimension of
    the mask may stay 1), and `kv_seq` gives the full key length. This is the one definition of
    the masking rules of `docs/kernel_abi.md` in Python.
    """
    bsz, q_seq, _, _ = arrays.q.shape
    kv_seq = arrays.k.shape[1] if kv_seq is None else kv_seq
    if keys is None:
        keys = jnp.arange(kv_seq, dtype=jnp.int32)
    i = jnp.arange(q_seq, dtype=jnp.int32)[None, None, :, None]
    j = keys.astype(jnp.int32)[None, None, None, :]
    q_len = jnp.clip(arrays.q_seqlens, 0, q_seq)[:, None, None, None]
    kv_len = jnp.clip(arrays.kv_seqlens, 0, kv_seq)[:, None, None, None]
    visible = (i < q_len) & (j < kv_len)
    offset = kv_len - q_len if options.causal == 2 else 0
    offset = offset + diagonal_shift(arrays)
    if options.causal:
        visible &= j <= i + offset
    if options.window_left >= 0:
        visible &= j >= i + offset - options.window_left
    if options.window_right >= 0:
        visible &= j <= i + offset + options.window_right
    if arrays.mask is not None:
        visible &= arrays.mask
    if arrays.q_segment_ids is not None:
        visible &= (
            arrays.q_segment_ids[:, None, :, None] == arrays.kv_segment_ids[:, None, None, :]
        )
    return jnp.broadcast_to(visible, (bsz, visible.shape[1], q_seq, j.shape[-1]))


def diagonal_shift(arrays: Canonical) -> jax.Array | int:
    """The diagonal shift of the causal and window rules: word 11 of a 12-word block state
    (`docs/kernel_abi.md`; a block of a larger problem), else 0."""
    state = arrays.rng_state
    if state is None or state.shape != (12,):
        return 0
    return jax.lax.bitcast_convert_type(state[11].astype(jnp.uint32), jnp.int32)


_USAGE_BLOCK = 512  # key columns per step when finding the rows no visible pair uses


def row_usage(arrays: Canonical, options: Options) -> tuple[jax.Array, jax.Array]:
    """Which q rows (`bool[B, Sq, Hq or 1]`) and k/v rows (`bool[B, Skv, Hkv or 1]`) take part
    in at least one visible pair; computed one block of keys at a time, so memory stays linear in
    the sequence length."""
    bsz, q_seq, q_heads, _ = arrays.q.shape
    kv_seq, kv_heads = arrays.k.shape[1:3]
    group = q_heads // kv_heads
    mask, kv_seg = arrays.mask, arrays.kv_segment_ids
    heads = 1 if mask is None else mask.shape[1]
    if 0 in (bsz, q_seq, kv_seq):  # no pair at all: no row is used (and no block to scan)
        kv_cols = kv_heads if heads == q_heads else 1
        return jnp.zeros((bsz, q_seq, heads), bool), jnp.zeros((bsz, kv_seq, kv_cols), bool)
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

    # The carry varies over the manual axes of `jax.shard_map` like the arrays it is built from.
    axes = frozenset().union(*(vma(x) for x in arrays if x is not None))
    rows_used, cols = jax.lax.scan(
        step, match_vma(jnp.zeros((bsz, heads, q_seq), bool), axes),
        jnp.arange(n_blocks, dtype=jnp.int32),
    )
    cols = cols.transpose(1, 0, 3, 2).reshape(bsz, n_blocks * block, -1)[:, :kv_seq]
    return rows_used.transpose(0, 2, 1), cols


def _hides_rows(arrays: Canonical, options: Options) -> bool:
    """Whether some q or k/v row may take part in no visible pair (statically)."""
    return (
        options.has_seqlens
        or options.causal != 0
        or options.window_left >= 0
        or options.window_right >= 0
        or arrays.mask is not None
        or arrays.q_segment_ids is not None
    )


def zero_hidden_rows(arrays: Canonical, options: Options, *, band: bool = False) -> Canonical:
    """Zeroes the q rows and k/v rows that take part in no visible pair.

    Kernels that select inside a tile (the CPU kernels, cuDNN) never read rows past the
    sequence lengths and skip key ranges outside the causal or window band, but a row hidden by a
    boolean mask or by the segment ids still enters the products `P @ V`, `dS @ K` and
    `dS^T @ Q` with weight 0, and `0 * NaN` is NaN: for them (`band=False`) only a mask or
    segment ids trigger the pass. Dense GEMMs multiply every row, so they ask with `band=True`:
    lengths and the causal/window band count too. Either way the convention holds that nothing
    stored in a masked-out position reaches any output or gradient; the pass costs one scan over
    the visibility pattern and one over q, k and v, and only when some row can be hidden.
    """
    hides = _hides_rows(arrays, options) if band else (
        arrays.mask is not None or arrays.q_segment_ids is not None
    )
    if not hides:
        return arrays
    q_rows, kv_rows = row_usage(arrays, options)
    return arrays._replace(
        q=jnp.where(q_rows[..., None], arrays.q, 0),
        k=jnp.where(kv_rows[..., None], arrays.k, 0),
        v=jnp.where(kv_rows[..., None], arrays.v, 0),
    )
