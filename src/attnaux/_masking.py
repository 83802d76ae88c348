"""The masking rules of `docs/kernel_abi.md`, defined once in Python.

Every Python path that needs to know which (query, key) pairs are visible asks `visibility`: the
`reference` backend, the hidden-row zeroing of the kernel-call layer, the GPU backends' row
handling, and (through `attnaux._internal`) the blockwise recomputations of `attnaux.introspect`.
"""

import jax
import jax.numpy as jnp

from ._canon import Canonical, Options


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
