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
    arrays: Canonical, options: Options, keys: jax.Array | None = None, kv_seq: int | None = None,
    queries: jax.Array | None = None, q_seq: int | None = None,
) -> jax.Array:
    """`bool[B, Hq or 1, m, n]`: which key each query row may attend to.

    With `keys` (`int[n]` key positions) only those columns are computed; `arrays.mask` and
    `arrays.kv_segment_ids` must then already be sliced to them (a broadcast key dimension of
    the mask may stay 1), and `kv_seq` gives the full key length. `queries` (`int[m]`) and
    `q_seq` do the same for the rows (`arrays.q_segment_ids` sliced to them). This is the one
    definition of the masking rules of `docs/kernel_abi.md` in Python.
    """
    bsz = arrays.q.shape[0]
    q_seq = arrays.q.shape[1] if q_seq is None else q_seq
    kv_seq = arrays.k.shape[1] if kv_seq is None else kv_seq
    if keys is None:
        keys = jnp.arange(kv_seq, dtype=jnp.int32)
    if queries is None:
        queries = jnp.arange(q_seq, dtype=jnp.int32)
    i = queries.astype(jnp.int32)[None, None, :, None]
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
    return jnp.broadcast_to(visible, (bsz, visible.shape[1], i.shape[2], j.shape[-1]))


def diagonal_shift(arrays: Canonical) -> jax.Array | int:
    """The diagonal shift of the causal and window rules: word 11 of a 12-word block state
    (`docs/kernel_abi.md`; a block of a larger problem), else 0."""
    state = arrays.rng_state
    if state is None or state.shape != (12,):
        return 0
    return jax.lax.bitcast_convert_type(state[11].astype(jnp.uint32), jnp.int32)


_USAGE_BLOCK = 512  # key columns per step when finding the rows no visible pair uses
# From this many (query, key) pairs on, segment ids without a mask take the binary searches of
# `_segment_row_usage` (O(S log S)) instead of the block scan (O(S^2), but a smaller program to
# compile): at T = 16384 packed the scan cost 10-15 ms more than the searches on 2 CPU cores.
_SEGMENT_SEARCH_MIN_PAIRS = 2048 * 2048


def _band(arrays: Canonical, options: Options, rows: int, cols: int, lengths_rows, lengths_cols,
          transpose: bool) -> tuple[jax.Array, jax.Array]:
    """`(lo, hi)`, `int32[B, rows]`: the band of columns each row may see (empty where lo > hi)
    from the lengths, causal and window rules, both non-decreasing in the row. With `transpose`
    the rows are keys and the columns queries (the band of queries that may see each key)."""
    if transpose:
        q_lo, q_hi = _band(arrays, options, cols, rows, lengths_cols, lengths_rows, False)
        j = jnp.arange(rows, dtype=jnp.int32)[None, :]
        real = jnp.arange(cols, dtype=jnp.int32)[None, :] < lengths_cols[:, None]
        # queries i with lo_i <= j <= hi_i: hi is non-decreasing, so those with hi_i >= j start
        # at the first such i; lo is non-decreasing, so those with lo_i <= j end at the last
        # such i. Padding queries (empty bands) are excluded by `real`.
        big = jnp.iinfo(jnp.int32).max
        keys = jnp.broadcast_to(j, (q_hi.shape[0], rows))
        count = jax.vmap(jnp.searchsorted, in_axes=(0, 0, None))
        first = count(jnp.where(real, q_hi, big), keys, "left")  # queries with hi_i < j
        last = count(jnp.where(real, q_lo, big), keys, "right")  # queries with lo_i <= j
        hi = jnp.minimum(last.astype(jnp.int32) - 1, lengths_cols[:, None] - 1)
        return first.astype(jnp.int32), hi
    i = jnp.arange(rows, dtype=jnp.int32)[None, :]
    q_len, kv_len = lengths_rows[:, None], lengths_cols[:, None]
    offset = (kv_len - q_len if options.causal == 2 else 0) + diagonal_shift(arrays)
    lo = jnp.zeros_like(i + offset)
    hi = jnp.broadcast_to(kv_len - 1, (q_len.shape[0], rows))
    right = 0 if options.causal else options.window_right
    if right >= 0:
        hi = jnp.minimum(hi, i + offset + right)
    if options.window_left >= 0:
        lo = jnp.maximum(lo, i + offset - options.window_left)
    hi = jnp.where(i < q_len, hi, -1)  # a padding row sees nothing
    return jnp.broadcast_to(lo, hi.shape), hi


def _any_same_id(ids_rows, ids_cols, lo, hi) -> jax.Array:
    """`bool[B, rows]`: whether some column `j` in `[lo, hi]` has `ids_cols[j] == ids_rows[row]`.

    The columns sorted by (id, position) once; per row, the block of its id by two binary
    searches, then the last position <= hi in that block by a fixed number of halving steps
    (O((rows + cols) log cols), no dense rows x cols pass)."""
    cols = ids_cols.shape[1]
    steps = max(1, int(cols).bit_length())

    def one(a, c, lo, hi):
        position = jnp.arange(cols, dtype=jnp.int32)
        ids, pos = jax.lax.sort((c, position), num_keys=2)
        start = jnp.searchsorted(ids, a, side="left").astype(jnp.int32)
        stop = jnp.searchsorted(ids, a, side="right").astype(jnp.int32)
        # the first index in [start, stop) whose position exceeds hi (stop when none)
        left, right = start, stop
        for _ in range(steps):
            mid = (left + right) // 2
            go_right = (mid < right) & (pos[jnp.clip(mid, 0, cols - 1)] <= hi)
            left = jnp.where(go_right, mid + 1, left)
            right = jnp.where(go_right, right, mid)
        found = left - 1  # the last same-id column at or before hi
        ok = (found >= start) & (lo <= hi)
        return ok & (pos[jnp.clip(found, 0, cols - 1)] >= lo)

    return jax.vmap(one)(ids_rows.astype(jnp.int32), ids_cols.astype(jnp.int32), lo, hi)


def _segment_row_usage(arrays: Canonical, options: Options) -> tuple[jax.Array, jax.Array]:
    """`row_usage` for segment ids without a boolean mask, in O(S log S)."""
    q_seq, kv_seq = arrays.q.shape[1], arrays.k.shape[1]
    q_len = jnp.clip(arrays.q_seqlens, 0, q_seq).astype(jnp.int32)
    kv_len = jnp.clip(arrays.kv_seqlens, 0, kv_seq).astype(jnp.int32)
    lo, hi = _band(arrays, options, q_seq, kv_seq, q_len, kv_len, False)
    rows = _any_same_id(arrays.q_segment_ids, arrays.kv_segment_ids, lo, hi)
    lo, hi = _band(arrays, options, kv_seq, q_seq, kv_len, q_len, True)
    cols = _any_same_id(arrays.kv_segment_ids, arrays.q_segment_ids, lo, hi)
    return rows[:, :, None], cols[:, :, None]


def row_usage(arrays: Canonical, options: Options) -> tuple[jax.Array, jax.Array]:
    """Which q rows (`bool[B, Sq, Hq or 1]`) and k/v rows (`bool[B, Skv, Hkv or 1]`) take part
    in at least one visible pair; computed one block of keys at a time, so memory stays linear in
    the sequence length (long rows with segment ids and no mask: by binary searches,
    `_segment_row_usage`)."""
    bsz, q_seq, q_heads, _ = arrays.q.shape
    kv_seq, kv_heads = arrays.k.shape[1:3]
    group = q_heads // kv_heads
    mask, kv_seg = arrays.mask, arrays.kv_segment_ids
    heads = 1 if mask is None else mask.shape[1]
    if 0 in (bsz, q_seq, kv_seq):  # no pair at all: no row is used (and no block to scan)
        kv_cols = kv_heads if heads == q_heads else 1
        return jnp.zeros((bsz, q_seq, heads), bool), jnp.zeros((bsz, kv_seq, kv_cols), bool)
    if mask is None and kv_seg is not None and q_seq * kv_seq >= _SEGMENT_SEARCH_MIN_PAIRS:
        return _segment_row_usage(arrays, options)
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


# ---- packed sequences: which sequence holds each token (varlen, the CUDA forward's blocks)
_COMPARE_ALL = 1 << 24  # tokens x sequences counted by comparison in `token_rows`


def token_rows(offsets: jax.Array, lengths: jax.Array, tokens: int):
    """`(sequence, position, covered)` of every token, `int32/int32/bool [tokens]`: the sequence
    holding it (clipped to a valid index), its row in that sequence, and whether a sequence
    covers it (`offsets`: `[n + 1]`, non-decreasing; `lengths`: `[n]`, each at most its span)."""
    t = jnp.arange(tokens, dtype=jnp.int32)
    n = lengths.shape[0]
    # seq[t] = how many sequences end at or before t. Up to _COMPARE_ALL tokens x sequences,
    # every token counts the ends at or before it: one fused pass. The histogram of the ends
    # and its running sum below is O(tokens + n) but several kernels on GPU (a scatter and the
    # running sum's windows; with the offsets' running max, 8 fusions around a packed forward
    # instead of 5, 0.003-0.004 ms of 0.13-0.22 ms on an H100 at 16384 tokens); a searchsorted
    # is a while loop, a host round trip per step on GPU.
    if tokens * n <= _COMPARE_ALL:
        seq = jnp.sum(offsets[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32)
    else:
        ends = jnp.zeros((tokens + 1,), jnp.int32).at[jnp.clip(offsets[1:], 0, tokens)].add(1)
        seq = jnp.cumsum(ends[:tokens])
    seq = jnp.minimum(seq, n - 1).astype(jnp.int32)
    pos = t - offsets[seq]
    return seq, pos, (pos >= 0) & (pos < lengths[seq])
