"""Context parallelism: exact attention over a sequence sharded along a mesh axis.

Each device holds one block of the sequence (`layout="contiguous"`: block `i` of `n`) or two
chunks of it (`layout="zigzag"`: chunks `i` and `2n - 1 - i` of `2n`, so that under a causal mask
every device has the same work). Its queries attend to every key block in turn:

- `strategy="ring"`: the key/value blocks travel around the ring (`jax.lax.ppermute`, sent
  before the block in hand is computed, so the transfer can overlap the compute); n - 1 hops.
- `strategy="allgather"`: the key/value blocks are gathered once, then visited locally.

Each (query chunk, key chunk) pair is one call of the compiled kernels with the masks at global
positions: a pair that the causal mask or the window hides entirely is skipped (costs nothing);
the CPU kernels take the pair's diagonal shift in their block state, and cuDNN, whose masks are
static graph attributes, gets one static call chosen by the shift (`_band`: full, causal on the
diagonal, a window band, or a slice of the block); segment ids travel with their keys, sequence
lengths are global. The partial results are merged by their log-sum-exp (the `AttnAux`
statistics), so `out`, `lse` and `max` are exact. The backward is a ring too: each key block's
`dk`, `dv` travel with it and arrive home after n hops; every block's share comes from the
backward kernel run with the whole problem's `out` and `lse` (`block_backward` of the backend),
exact, with the gradient through `aux.lse`. Dropout draws the unsharded call's keep-mask: each
block's kernel gets its origin in the whole problem (the 12-word dropout state of
`docs/kernel_abi.md`): the CPU kernels, attnaux's Hopper kernels (`_hopper_packed`), and on any
platform `backend="flex"` (the blockwise JAX path, `_flex_blocks`). On a GPU, the Hopper kernels
serve what cuDNN's static graphs cannot place: dropout (cuDNN's generator draws its own mask),
and a window with a bottom-right mask and lengths.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._aux import AttnAux
from .._canon import Canonical, Options, canonicalize, parse_statics, rng_state_from_key
from .._ffi import target_unavailable
from .._partition import unify_vma, vma

STRATEGIES = ("ring", "allgather")
LAYOUTS = ("contiguous", "zigzag")


class _Config(NamedTuple):
    """The static part of one context-parallel call (hashable: keys the custom_vjp)."""

    axis_name: Any
    strategy: str
    layout: str
    options: Options  # the block calls' options (causal set per block; the window is global)
    causal: bool
    has_seqlens: bool
    has_segments: bool
    has_sink: bool
    bottom_right_lengths: bool  # causal="bottom_right" with lengths: the diagonal moves per row
    backend: Any  # the backend module: run(arrays, options, False), block_backward(...)


# ------------------------------------------------------------------------------------------------
# Layout helpers (on global arrays, before sharding / after gathering)
# ------------------------------------------------------------------------------------------------
def zigzag(x: jax.Array, num_devices: int, *, axis: int) -> jax.Array:
    """Permutes the sequence axis `axis` of a global array into the load-balanced layout: split
    into `2 * num_devices` chunks, device `i` holds chunks `i` and `2 * num_devices - 1 - i`
    (so sharding the result along `axis` over `num_devices` devices gives each device one early
    and one late chunk, and the same work under a causal mask). `unzigzag` undoes it.

    **Arguments:**

    - `x`: an array with the sequence along `axis` (q, k, v, segment ids, the output).
    - `num_devices`: the size of the mesh axis that shards the sequence.
    - `axis`: the sequence axis (e.g. `-3` for `[*batch, seq, heads, dim]`, `-1` for segment
      ids `[*batch, seq]` and for `aux.lse` `[*batch, heads, seq]`).
    """
    chunks = _chunks(x, num_devices, axis)
    order = [c for i in range(num_devices) for c in (i, 2 * num_devices - 1 - i)]
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def unzigzag(x: jax.Array, num_devices: int, *, axis: int) -> jax.Array:
    """The inverse of `zigzag`: the sequence axis back in its natural order."""
    chunks = _chunks(x, num_devices, axis)
    order = [c for i in range(num_devices) for c in (i, 2 * num_devices - 1 - i)]
    natural = [None] * len(order)
    for position, c in enumerate(order):
        natural[c] = chunks[position]
    return jnp.concatenate(natural, axis=axis)


def _chunks(x: jax.Array, num_devices: int, axis: int) -> list[jax.Array]:
    length = x.shape[axis]
    if num_devices < 1 or length % (2 * num_devices):
        raise ValueError(
            f"the zigzag layout splits the sequence into 2 * num_devices = {2 * num_devices} "
            f"equal chunks; got a sequence of {length} along axis {axis}."
        )
    return jnp.split(x, 2 * num_devices, axis=axis)


# ------------------------------------------------------------------------------------------------
# One (query chunk, key chunk) block
# ------------------------------------------------------------------------------------------------
def _block_arrays(cfg: _Config, q, k, v, q_seg, kv_seg, q_len, kv_len, rng, q0, k0, totals,
                  shift, b0=0):
    """The canonical arrays of the block whose queries start at global position `q0` and keys
    at `k0` (dynamic): the global lengths cut to the block, and the 12-word block state
    (`docs/kernel_abi.md`) with the block's origin (the dropout counter) and its diagonal shift
    (`q0 - k0`, plus `kv_len - q_len` of the row for a bottom-right mask with lengths: the causal
    and window rules at global positions). `b0`: the first batch row's index (a call of one row
    of the batch: `_rows`)."""
    bsz, q_chunk = q.shape[:2]
    kv_chunk = k.shape[1]
    if cfg.has_seqlens:
        ql = jnp.clip(q_len - q0, 0, q_chunk).astype(jnp.int32)
        kl = jnp.clip(kv_len - k0, 0, kv_chunk).astype(jnp.int32)
    else:
        ql = jnp.full((bsz,), q_chunk, jnp.int32)
        kl = jnp.full((bsz,), kv_chunk, jnp.int32)
    heads, q_total, kv_total = totals
    seed = jnp.zeros((4,), jnp.uint32) if rng is None else rng.astype(jnp.uint32)
    shift = jax.lax.bitcast_convert_type(jnp.asarray(shift, jnp.int32), jnp.uint32)
    words = jnp.stack([jnp.asarray(b0).astype(jnp.uint32), jnp.uint32(0), q0.astype(jnp.uint32),
                       k0.astype(jnp.uint32), jnp.uint32(heads), jnp.uint32(q_total),
                       jnp.uint32(kv_total), shift])
    state = jnp.concatenate([seed, words])
    return Canonical(q=q, k=k, v=v, bias=None, mask=None, q_seqlens=ql, kv_seqlens=kl,
                     q_segment_ids=q_seg, kv_segment_ids=kv_seg, sink=None, rng_state=state)


def _hidden(cfg: _Config, shift, q_chunk: int, kv_chunk: int):
    """Whether the causal and window rules hide every pair of the block (it is then skipped):
    key j is visible from query i iff `j <= i + shift` (causal) and `i + shift - left <= j <=
    i + shift + right` (window), `shift = q0 - k0` (plus the bottom-right offset)."""
    options = cfg.options
    hidden = jnp.bool_(False)
    if cfg.causal:
        hidden |= q_chunk - 1 + shift < 0
    if options.window_right >= 0:
        hidden |= q_chunk - 1 + shift + options.window_right < 0
    if options.window_left >= 0:
        hidden |= shift - options.window_left > kv_chunk - 1
    return hidden


def _follows_shift(cfg: _Config) -> bool:
    return getattr(cfg.backend, "FOLLOWS_BLOCK_STATE", True)


class _Band(NamedTuple):
    """A block as one call with static masks (for a backend whose masks are graph attributes,
    cuDNN): queries `[q_lo, q_hi)` and keys `[k_lo, k_hi)` of the block under `causal` and
    `window` in that sub-block's own coordinates; the block's other pairs are hidden."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: int
    window: tuple[int, int]


def _band(cfg: _Config, shift: int, chunk: int) -> "_Band | None":
    """The static call serving a `chunk` x `chunk` block with diagonal shift `shift` (None:
    every pair hidden). Key j is visible from query i iff `lo <= j - i <= hi`, `lo = shift -
    left` (window) and `hi = shift` (causal) or `shift + right` (window). A bound inside the
    block that the static masks cannot place (a lower bound right of the diagonal, an upper
    bound left of it) becomes a slice: for `lo > 0` only queries `[0, chunk - lo)` see keys,
    and only keys `[lo, chunk)` are seen, and in those coordinates the bound is the diagonal."""
    options = cfg.options
    lo = shift - options.window_left if options.window_left >= 0 else None
    highs = ([shift] if cfg.causal else []) + (
        [shift + options.window_right] if options.window_right >= 0 else [])
    hi = min(highs) if highs else None
    span = chunk - 1
    if ((lo is not None and lo > span) or (hi is not None and hi < -span)
            or (lo is not None and hi is not None and lo > hi)):
        return None
    lo = None if lo is not None and lo <= -span else lo
    hi = None if hi is not None and hi >= span else hi
    q_lo = k_lo = 0
    if lo is not None and lo > 0:  # the sub-block's pairs have j' - i' = j - i - lo
        k_lo, hi, lo = lo, None if hi is None else hi - lo, 0
    elif hi is not None and hi < 0:  # j' - i' = j - i - hi
        q_lo, lo, hi = -hi, None if lo is None else lo - hi, 0
    size = chunk - q_lo - k_lo
    causal = 1 if hi == 0 else 0
    window = (-1 if lo is None else -lo, -1 if hi is None or causal else hi)
    return _Band(q_lo, q_lo + size, k_lo, k_lo + size, causal, window)


def _static_plan(cfg: _Config, chunk: int, num_chunks: int):
    """`(table, bands)`: the distinct static calls of every possible block (the shift of a
    block is `m * chunk`, `|m| < num_chunks`), and for each `m + num_chunks - 1` the branch
    that serves it (0: skipped, `i + 1`: `bands[i]`)."""
    bands, table = [], []
    for m in range(-(num_chunks - 1), num_chunks):
        band = _band(cfg, m * chunk, chunk)
        if band is not None and band not in bands:
            bands.append(band)
        table.append(0 if band is None else bands.index(band) + 1)
    return jnp.asarray(table, jnp.int32), tuple(bands)


def _sub_block(a: Canonical, band: _Band) -> Canonical:
    """The block's arrays cut to `band`: lengths counted from the cut, the dropout origin moved
    to it, the diagonal-shift word 0 (the masks are the call's static ones)."""
    q_size, k_size = band.q_hi - band.q_lo, band.k_hi - band.k_lo

    def rows(x, lo, hi):
        return None if x is None else x[:, lo:hi]

    state = a.rng_state.at[6].add(jnp.uint32(band.q_lo)).at[7].add(jnp.uint32(band.k_lo))
    state = state.at[11].set(jnp.uint32(0))
    return a._replace(
        q=rows(a.q, band.q_lo, band.q_hi), k=rows(a.k, band.k_lo, band.k_hi),
        v=rows(a.v, band.k_lo, band.k_hi),
        q_segment_ids=rows(a.q_segment_ids, band.q_lo, band.q_hi),
        kv_segment_ids=rows(a.kv_segment_ids, band.k_lo, band.k_hi),
        q_seqlens=jnp.clip(a.q_seqlens - band.q_lo, 0, q_size).astype(jnp.int32),
        kv_seqlens=jnp.clip(a.kv_seqlens - band.k_lo, 0, k_size).astype(jnp.int32),
        rng_state=state)


def _band_options(cfg: _Config, band: _Band) -> Options:
    return cfg.options._replace(causal=band.causal, window_left=band.window[0],
                                window_right=band.window[1])


def _pad(x, axis: int, lo: int, hi: int, size: int, value):
    """`x` (the rows `[lo, hi)` of `size` along `axis`) padded with `value` to all `size`."""
    if lo == 0 and hi == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (lo, size - hi)
    return jnp.pad(x, widths, constant_values=value)


def _diagonal_kind(shift, chunk: int):
    """A bottom-right causal mask with lengths on a static-mask backend: the block's diagonal
    `d` (the shift, data: `kv_len - q_len` of the row moves it) picks 0: skipped (`d <= -chunk`),
    1: full (`d >= chunk - 1`), 2: one bottom-right call whose key length `chunk + d` puts
    cuDNN's diagonal at `d` (`d <= 0`), 3: two calls (`0 < d < chunk - 1`: rows `[0, chunk - d)`
    bottom-right with query length `chunk - d`, the others see every key). For a valid row the
    causal bound implies the key-length bound, so lengths need no other care; rows past the
    block's query length are zeroed (forward) or have lse = -inf, hence P = 0 (backward)."""
    return jnp.where(shift <= -chunk, 0, jnp.where(shift >= chunk - 1, 1,
                                                   jnp.where(shift <= 0, 2, 3)))


def _with_lengths(a: Canonical, q_len, kv_len) -> Canonical:
    """`a` with these (block-local) lengths and the diagonal-shift word 0 (static masks)."""
    def full(x):
        return jnp.broadcast_to(jnp.asarray(x, jnp.int32), a.q_seqlens.shape)

    return a._replace(q_seqlens=full(q_len), kv_seqlens=full(kv_len),
                      rng_state=a.rng_state.at[11].set(jnp.uint32(0)))


def _diagonal_options(cfg: _Config, causal: int) -> Options:
    return cfg.options._replace(causal=causal, window_left=-1, window_right=-1)


def _diagonal_forward(cfg: _Config, shift, chunk: int, arrays: Canonical, skip):
    """`_block_forward` for a bottom-right mask with lengths on a static-mask backend (one batch
    row: `_rows` maps the rows); see `_diagonal_kind`."""
    rows = jnp.arange(chunk)

    def run(a, causal):
        out, lse, row_max, _ = cfg.backend.run(a, _diagonal_options(cfg, causal), False)
        return out.astype(jnp.float32), lse, row_max

    def valid_only(a, result):  # rows past the block's query length see nothing
        out, lse, row_max = result
        keep = rows[None, :] < a.q_seqlens[:, None]  # [b, q]
        return (jnp.where(keep[:, :, None, None], out, 0.0),
                jnp.where(keep[:, None, :], lse, -jnp.inf),
                jnp.where(keep[:, None, :], row_max, -jnp.inf))

    def full(a, d):
        return run(_with_lengths(a, a.q_seqlens, a.kv_seqlens), 0)

    def below(a, d):
        return valid_only(a, run(_with_lengths(a, chunk, chunk + d), 2))

    def split(a, d):
        upper = run(_with_lengths(a, chunk - d, chunk), 2)
        lower = run(_with_lengths(a, chunk, chunk), 0)
        take = rows < chunk - d
        out = jnp.where(take[None, :, None, None], upper[0], lower[0])
        lse, row_max = (jnp.where(take[None, None, :], u, w)
                        for u, w in zip(upper[1:], lower[1:]))
        return valid_only(a, (out, lse, row_max))

    d = jnp.asarray(shift, jnp.int32)
    return jax.lax.switch(_diagonal_kind(d, chunk),
                          [lambda a, d: skip(a), full, below, split], arrays, d)


def _diagonal_backward(cfg: _Config, shift, chunk: int, arrays: Canonical, out, lse, dout,
                       dlse, skip):
    """`_block_backward` for a bottom-right mask with lengths on a static-mask backend."""
    rows = jnp.arange(chunk)

    def run(a, causal, dout, dlse):
        grads = cfg.backend.block_backward(a, _diagonal_options(cfg, causal), out, lse, dout,
                                           dlse)
        return tuple(g.astype(jnp.float32) for g in grads)

    def full(a, d):
        return run(_with_lengths(a, a.q_seqlens, a.kv_seqlens), 0, dout, dlse)

    def below(a, d):
        return run(_with_lengths(a, chunk, chunk + d), 2, dout, dlse)

    def split(a, d):
        upper = run(_with_lengths(a, chunk - d, chunk), 2, dout, dlse)  # rows past: padding
        lower_rows = rows >= chunk - d  # the other rows' cotangents out of the full call
        lower = run(_with_lengths(a, chunk, chunk), 0,
                    jnp.where(lower_rows[None, :, None, None], dout, 0).astype(dout.dtype),
                    jnp.where(lower_rows[None, None, :], dlse, 0.0))
        return tuple(u + w for u, w in zip(upper, lower))

    d = jnp.asarray(shift, jnp.int32)
    return jax.lax.switch(_diagonal_kind(d, chunk),
                          [lambda a, d: skip(a, out, lse, dout, dlse), full, below, split],
                          arrays, d)


def _block_forward(cfg: _Config, shift, chunk: int, num_chunks: int, arrays: Canonical):
    """`(out, lse, max)` (float32) of one block: skipped when every pair is hidden; else one
    kernel call, with the block state's shift (a backend that follows it) or a static band."""
    bsz, q_chunk, q_heads, _ = arrays.q.shape
    v_dim = arrays.v.shape[-1]

    def skip(a):  # (varying over the manual axes like the block's operands)
        none = jnp.full((bsz, q_heads, q_chunk), -jnp.inf, jnp.float32)
        zeros = jnp.zeros((bsz, q_chunk, q_heads, v_dim), jnp.float32)
        return unify_vma((zeros, none, none, a.q, a.k))[:3]

    if _follows_shift(cfg):
        def shifted(a):
            options = cfg.options._replace(causal=1 if cfg.causal else 0)
            out, lse, row_max, _ = cfg.backend.run(a, options, False)
            return out.astype(jnp.float32), lse, row_max

        kind = jnp.where(_hidden(cfg, shift, chunk, chunk), 0, 1)
        return jax.lax.switch(kind, [skip, shifted], arrays)

    def banded(band):
        def run(a):
            out, lse, row_max, _ = cfg.backend.run(_sub_block(a, band), _band_options(cfg, band),
                                                   False)
            at = (band.q_lo, band.q_hi, q_chunk)
            return (_pad(out.astype(jnp.float32), 1, *at, 0.0), _pad(lse, 2, *at, -jnp.inf),
                    _pad(row_max, 2, *at, -jnp.inf))
        return run

    if cfg.bottom_right_lengths:
        return _diagonal_forward(cfg, shift, chunk, arrays, skip)
    table, bands = _static_plan(cfg, chunk, num_chunks)
    index = table[shift // chunk + num_chunks - 1]
    return jax.lax.switch(index, [skip, *(banded(b) for b in bands)], arrays)


def _block_backward(cfg: _Config, shift, chunk: int, num_chunks: int, arrays: Canonical, out,
                    lse, dout, dlse):
    """`(dq, dk, dv)` (float32) of one block, from the whole problem's `out` and `lse`."""
    def skip(a, *rest):
        zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in (a.q, a.k, a.v))
        return unify_vma((*zeros, a.q, a.k, *rest))[:3]

    def as_f32(grads):
        return tuple(g.astype(jnp.float32) for g in grads)

    if _follows_shift(cfg):
        def shifted(a, out, lse, dout, dlse):
            options = cfg.options._replace(causal=1 if cfg.causal else 0)
            return as_f32(cfg.backend.block_backward(a, options, out, lse, dout, dlse))

        kind = jnp.where(_hidden(cfg, shift, chunk, chunk), 0, 1)
        return jax.lax.switch(kind, [skip, shifted], arrays, out, lse, dout, dlse)

    def banded(band):
        def run(a, out, lse, dout, dlse):
            q_rows = slice(band.q_lo, band.q_hi)
            dq, dk, dv = as_f32(cfg.backend.block_backward(
                _sub_block(a, band), _band_options(cfg, band), out[:, q_rows],
                lse[:, :, q_rows], dout[:, q_rows], dlse[:, :, q_rows]))
            return (_pad(dq, 1, band.q_lo, band.q_hi, a.q.shape[1], 0.0),
                    _pad(dk, 1, band.k_lo, band.k_hi, a.k.shape[1], 0.0),
                    _pad(dv, 1, band.k_lo, band.k_hi, a.k.shape[1], 0.0))
        return run

    if cfg.bottom_right_lengths:
        return _diagonal_backward(cfg, shift, chunk, arrays, out, lse, dout, dlse, skip)
    table, bands = _static_plan(cfg, chunk, num_chunks)
    index = table[shift // chunk + num_chunks - 1]
    return jax.lax.switch(index, [skip, *(banded(b) for b in bands)],
                          arrays, out, lse, dout, dlse)


def _rows(cfg: _Config, fn, args, q_len, kv_len, total: int):
    """`fn(*args, shift_extra, first_row)` on the whole batch, or, for a bottom-right mask with
    lengths (whose diagonal is `kv_len - q_len` of each row), row by row: the block state holds
    one shift per call, and each call its row's index (the dropout counter's batch origin).
    `args` all have the batch leading."""
    if not cfg.bottom_right_lengths:
        return fn(*args, 0, 0)
    extra = jnp.clip(kv_len, 0, total) - jnp.clip(q_len, 0, total)

    def one(xs):
        *row, e, b = xs
        outs = fn(*(None if a is None else a[None] for a in row), e, b)
        return tuple(o[0] for o in outs)

    return jax.lax.map(one, (*args, extra, jnp.arange(extra.shape[0], dtype=jnp.int32)))


def _merge(acc, part):
    """Adds a block's `(out, lse, max)` to the running `(out, lse, max)` (float32; a row that
    saw nothing yet has lse = -inf)."""
    out_a, lse_a, max_a = acc
    out_b, lse_b, max_b = part
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    wa = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
    wb = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
    out = (out_a * wa.transpose(0, 2, 1)[..., None] + out_b * wb.transpose(0, 2, 1)[..., None])
    return out, lse, jnp.maximum(max_a, max_b)


# ------------------------------------------------------------------------------------------------
# The ring
# ------------------------------------------------------------------------------------------------
def _geometry(cfg: _Config, seq: int):
    """`(n, me, chunks, chunk_len, ids(device))`: the axis size, this device's index, chunks per
    device and their length, and a function giving a device's global chunk ids."""
    n = jax.lax.axis_size(cfg.axis_name)
    me = jax.lax.axis_index(cfg.axis_name)
    chunks = 2 if cfg.layout == "zigzag" else 1
    if seq % chunks:
        raise ValueError(
            f"the zigzag layout holds two equal chunks per device; got a local sequence of {seq}."
        )

    def ids(device):
        if chunks == 1:
            return (device,)
        return (device, 2 * n - 1 - device)

    return n, me, chunks, seq // chunks, ids


def _split(x, chunks: int):
    return [x] if chunks == 1 or x is None else jnp.split(x, chunks, axis=1)


def _ring_forward(cfg: _Config, q, k, v, q_seg, kv_seg, q_len, kv_len, rng, sink):
    bsz, seq, q_heads, _ = q.shape
    v_dim = v.shape[-1]
    n, me, chunks, chunk, ids = _geometry(cfg, seq)
    totals = (q_heads, n * seq, n * seq)
    q_parts, qs_parts = _split(q, chunks), _split(q_seg, chunks) if cfg.has_segments else None
    perm = [(i, (i + 1) % n) for i in range(n)]

    def visit(acc, kv_block, src):
        k_b, v_b, kvs_b = (*kv_block, None)[:3]  # segment ids travel only when given
        k_parts, v_parts = _split(k_b, chunks), _split(v_b, chunks)
        ks_parts = _split(kvs_b, chunks) if cfg.has_segments else None
        new = []
        for qi, q_id in enumerate(ids(me)):
            acc_i = acc[qi]
            for ki, k_id in enumerate(ids(src)):
                q0, k0 = q_id * chunk, k_id * chunk

                def block(qp, kp, vp, qs, ks, ql, kl, extra, b0, q0=q0, k0=k0):
                    shift = q0 - k0 + extra
                    arrays = _block_arrays(cfg, qp, kp, vp, qs, ks, ql, kl, rng, q0, k0, totals,
                                           shift, b0)
                    return _block_forward(cfg, shift, chunk, n * chunks, arrays)

                args = (q_parts[qi], k_parts[ki], v_parts[ki],
                        qs_parts[qi] if ks_parts else None, ks_parts[ki] if ks_parts else None,
                        q_len, kv_len)
                acc_i = _merge(acc_i, _rows(cfg, block, args, q_len, kv_len, totals[1]))
            new.append(acc_i)
        return new

    def empty():
        none = jnp.full((bsz, q_heads, chunk), -jnp.inf, jnp.float32)
        return (jnp.zeros((bsz, chunk, q_heads, v_dim), jnp.float32), none, none)

    acc = [empty() for _ in range(chunks)]
    acc = [tuple(unify_vma((*a, q))[:3]) for a in acc]
    kv_block = (k, v, kv_seg) if cfg.has_segments else (k, v)
    kv_block = tuple(unify_vma((*kv_block, q))[:len(kv_block)])
    if cfg.strategy == "allgather":
        gathered = tuple(jax.lax.all_gather(x, cfg.axis_name) for x in kv_block)

        def step(s, acc):
            src = (me - s) % n
            return visit(acc, tuple(g[src] for g in gathered), src)

        acc = jax.lax.fori_loop(0, n, step, acc)
    else:
        def step(s, carry):
            acc, kv_block = carry
            src = (me - s) % n
            # The next block is sent before this one is computed, so the two can overlap.
            following = jax.tree.map(lambda x: jax.lax.ppermute(x, cfg.axis_name, perm), kv_block)
            return visit(acc, kv_block, src), following

        # n - 1 hops; the last block received is visited after the loop, with nothing to send.
        acc, kv_block = jax.lax.fori_loop(0, n - 1, step, (acc, kv_block))
        acc = visit(acc, kv_block, (me - (n - 1)) % n)
    out = jnp.concatenate([a[0] for a in acc], axis=1)
    lse = jnp.concatenate([a[1] for a in acc], axis=2)
    row_max = jnp.concatenate([a[2] for a in acc], axis=2)
    if cfg.has_sink:
        s = sink.astype(jnp.float32)[None, :, None]
        total = jnp.logaddexp(lse, s)
        out = out * jnp.exp(lse - total).transpose(0, 2, 1)[..., None]
        lse = total
    return out.astype(q.dtype), lse, row_max


def _ring_backward(cfg: _Config, residuals, dout, dlse):
    q, k, v, q_seg, kv_seg, q_len, kv_len, rng, sink, out, lse = residuals
    bsz, seq, q_heads, _ = q.shape
    n, me, chunks, chunk, ids = _geometry(cfg, seq)
    totals = (q_heads, n * seq, n * seq)
    perm = [(i, (i + 1) % n) for i in range(n)]
    split_q = functools.partial(_split, chunks=chunks)
    q_parts, out_parts, dout_parts = split_q(q), split_q(out), split_q(dout)
    lse_parts = [lse] if chunks == 1 else jnp.split(lse, chunks, axis=2)
    dlse_parts = [dlse] if chunks == 1 else jnp.split(dlse, chunks, axis=2)
    qs_parts = split_q(q_seg) if cfg.has_segments else None

    def visit(dq_parts, kv_block, grads_block, src):
        k_b, v_b, kvs_b = (*kv_block, None)[:3]  # segment ids travel only when given
        dk_b, dv_b = grads_block
        k_parts, v_parts = _split(k_b, chunks), _split(v_b, chunks)
        ks_parts = _split(kvs_b, chunks) if cfg.has_segments else None
        dk_parts, dv_parts = _split(dk_b, chunks), _split(dv_b, chunks)
        dq_parts = list(dq_parts)
        for qi, q_id in enumerate(ids(me)):
            for ki, k_id in enumerate(ids(src)):
                q0, k0 = q_id * chunk, k_id * chunk

                def block(qp, kp, vp, qs, ks, ql, kl, out, lse, dout, dlse, extra, b0, q0=q0,
                          k0=k0):
                    shift = q0 - k0 + extra
                    arrays = _block_arrays(cfg, qp, kp, vp, qs, ks, ql, kl, rng, q0, k0, totals,
                                           shift, b0)
                    return _block_backward(cfg, shift, chunk, n * chunks, arrays, out, lse,
                                           dout, dlse)

                args = (q_parts[qi], k_parts[ki], v_parts[ki],
                        qs_parts[qi] if ks_parts else None, ks_parts[ki] if ks_parts else None,
                        q_len, kv_len, out_parts[qi], lse_parts[qi], dout_parts[qi],
                        dlse_parts[qi])
                dq, dk, dv = _rows(cfg, block, args, q_len, kv_len, totals[1])
                dq_parts[qi] = dq_parts[qi] + dq
                dk_parts[ki] = dk_parts[ki] + dk
                dv_parts[ki] = dv_parts[ki] + dv
        cat = (lambda xs: xs[0]) if chunks == 1 else (lambda xs: jnp.concatenate(xs, axis=1))
        return dq_parts, (cat(dk_parts), cat(dv_parts))

    zeros = [jnp.zeros(p.shape, jnp.float32) for p in q_parts]
    dq_parts = [unify_vma((z, q))[0] for z in zeros]
    kv_block = (k, v, kv_seg) if cfg.has_segments else (k, v)
    kv_block = tuple(unify_vma((*kv_block, q))[:len(kv_block)])
    grads = tuple(unify_vma((jnp.zeros(x.shape, jnp.float32), q))[0] for x in (k, v))
    if cfg.strategy == "allgather":
        gathered = tuple(jax.lax.all_gather(x, cfg.axis_name) for x in kv_block)
        all_grads = tuple(jnp.zeros((n, *g.shape), jnp.float32) for g in grads)
        all_grads = tuple(unify_vma((g, q))[0] for g in all_grads)

        def step(s, carry):
            dq_parts, all_grads = carry
            src = (me - s) % n
            block_grads = tuple(g[src] for g in all_grads)
            dq_parts, block_grads = visit(dq_parts, tuple(g[src] for g in gathered),
                                          block_grads, src)
            all_grads = tuple(g.at[src].set(b) for g, b in zip(all_grads, block_grads))
            return dq_parts, all_grads

        dq_parts, all_grads = jax.lax.fori_loop(0, n, step, (dq_parts, all_grads))
        dk, dv = (jax.lax.psum_scatter(g, cfg.axis_name, scatter_dimension=0, tiled=False)
                  for g in all_grads)
    else:
        def step(s, carry):
            dq_parts, kv_block, grads = carry
            src = (me - s) % n
            following = jax.tree.map(lambda x: jax.lax.ppermute(x, cfg.axis_name, perm), kv_block)
            dq_parts, grads = visit(dq_parts, kv_block, grads, src)
            # dk and dv travel with their block, one hop behind it.
            grads = jax.tree.map(lambda x: jax.lax.ppermute(x, cfg.axis_name, perm), grads)
            return dq_parts, following, grads

        dq_parts, kv_block, grads = jax.lax.fori_loop(0, n - 1, step,
                                                      (dq_parts, kv_block, grads))
        dq_parts, grads = visit(dq_parts, kv_block, grads, (me - (n - 1)) % n)
        # the n-th hop brings every block's dk and dv home
        dk, dv = jax.tree.map(lambda x: jax.lax.ppermute(x, cfg.axis_name, perm), grads)
    dq = dq_parts[0] if chunks == 1 else jnp.concatenate(dq_parts, axis=1)
    dsink = None
    if cfg.has_sink:
        # lse, out depend on the sink through lse only (as in the kernel-call layer).
        row = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32),
                         out.astype(jnp.float32)) - dlse
        dsink = -jnp.sum(jnp.exp(sink.astype(jnp.float32)[None, :, None] - lse) * row,
                         axis=(0, 2))
        if cfg.axis_name not in vma(sink):
            dsink = jax.lax.psum(dsink, cfg.axis_name)
        dsink = dsink.astype(sink.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsink


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: _Config, q, k, v, q_seg, kv_seg, q_len, kv_len, rng, sink):
    return _ring_forward(cfg, q, k, v, q_seg, kv_seg, q_len, kv_len, rng, sink)


def _ring_fwd(cfg, q, k, v, q_seg, kv_seg, q_len, kv_len, rng, sink):
    out, lse, row_max = _ring_forward(cfg, q, k, v, q_seg, kv_seg, q_len, kv_len, rng, sink)
    return (out, lse, row_max), (q, k, v, q_seg, kv_seg, q_len, kv_len, rng, sink, out, lse)


def _ring_bwd(cfg, residuals, cotangents):
    dout, dlse, _ = cotangents  # the row max carries no gradient
    out, lse = residuals[-2], residuals[-1]
    dout = jnp.zeros_like(out) if dout is None else dout
    dlse = jnp.zeros_like(lse) if dlse is None else jnp.where(jnp.isfinite(lse), dlse, 0.0)
    dq, dk, dv, dsink = _ring_backward(cfg, residuals, dout.astype(out.dtype),
                                       dlse.astype(jnp.float32))
    return (dq, dk, dv, None, None, None, None, None, dsink)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ------------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------------
def _backend_module(backend: str, platform: str):
    """The backend of the block calls: for `auto`/`flash` the flash backend of `platform` (the
    C++ kernels on CPU, cuDNN on GPU); `flex`, the blockwise JAX path on any platform (it
    follows the block state: dropout on GPU)."""
    if backend not in ("auto", "flash", "flex"):
        raise ValueError(
            f"`backend` must be 'auto', 'flash' or 'flex' for context parallelism (the ring runs "
            f"the compiled flash kernels, or flex, block by block); got {backend!r}."
        )
    if backend == "flex":
        from .. import _flex_blocks

        return _flex_blocks
    if platform == "cpu":
        from .. import _flash_cpu as module

        why = target_unavailable(module.FWD_TARGET, "cpu")
    elif platform in ("gpu", "cuda"):
        from .. import _flash_cudnn as module

        why = target_unavailable(module.FWD_TARGET, "cuda")
    else:
        module, why = None, f"no flash backend for the {platform!r} platform"
    if why is not None:
        raise ValueError(f"context parallelism needs the compiled flash kernels: {why}.")
    return module


def _hopper_module(arrays: Canonical, what: str, why_not_cudnn: str):
    """The backend of the block calls on GPU where cuDNN cannot place a block: attnaux's Hopper
    kernels, which take each block's diagonal shift and dropout origin from its block state
    (a window with a bottom-right mask and lengths, whose band moves per row by data; dropout,
    whose keep-mask must be the block's part of the whole problem's)."""
    from .. import _flash_hopper, _hopper_packed

    why = _flash_hopper.device_unavailable(arrays.q, arrays.k, arrays.v)
    if why is not None:
        raise ValueError(
            f"{what} is not supported by context parallelism on this GPU: {why_not_cudnn}; "
            f"attnaux's Hopper kernels would serve it, but {why}. `backend='flex'` serves it "
            "(blockwise JAX, exact, slower)."
        )
    return _hopper_packed


def _unsupported(name: str, why: str):
    return ValueError(f"`{name}` is not supported by context parallelism: {why}.")


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: Any,
    strategy: str = "ring",
    layout: str = "contiguous",
    scale: float | None = None,
    causal: Any = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    q_seqlens: jax.Array | None = None,
    kv_seqlens: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sink: jax.Array | None = None,
    dropout_rate: float = 0.0,
    key: jax.Array | None = None,
    backend: str = "auto",
    **unsupported: Any,
) -> tuple[jax.Array, AttnAux]:
    """Exact attention over a sequence sharded along the mesh axis `axis_name`, called inside
    `jax.shard_map` (each device passes its block; see the module docstring).

    **Arguments:**

    - `q`, `k`, `v`: this device's block, `[*batch, seq_block, heads, dim]` (`k`, `v` with the
      same block length: the sequence is self-attention length, split evenly).
    - `axis_name`: the mesh axis (or tuple of axes) that shards the sequence.
    - `strategy`: `"ring"` (key/value blocks travel around the ring, overlapping compute) or
      `"allgather"` (gathered once; more memory, fewer steps of latency).
    - `layout`: `"contiguous"` (device i holds block i) or `"zigzag"` (device i holds chunks i
      and 2n - 1 - i; `attnaux.parallel.zigzag` permutes a global array into it), which
      balances a causal mask.
    - `causal`, `window`, `scale`, `softcap`, `sink`, `dropout_rate`, `key`: as in
      `attnaux.attention`, with the masks at global positions (`causal=True`, `"top_left"` or
      `"bottom_right"`, which agree without lengths since queries and keys share one sequence;
      with lengths the bottom-right diagonal is `kv_seqlens - q_seqlens` of each row, and the
      blocks then run row by row). Block pairs that the causal mask or the window hide entirely
      are skipped.
    - `q_seqlens`, `kv_seqlens`: global valid lengths `[*batch]` (the same on every device).
    - `q_segment_ids`, `kv_segment_ids`: this device's block of the global ids `[*batch,
      seq_block]`.
    - `backend`: `"auto"` or `"flash"` (the compiled kernels), or `"flex"` (blockwise JAX on
      any platform, exact and slower: what serves dropout on GPU).

    **Returns:**

    `(out, aux)` for this device's queries: `out` `[*batch, seq_block, heads, v_dim]`, `aux.lse`
    and `aux.max` `[*batch, heads, seq_block]` exact for the whole sequence; gradients flow
    through `out` and `aux.lse` (a ring backward). `aux.rng_state` is the dropout state, whose
    keep-mask is the unsharded call's (`attnaux.introspect.dropout_mask` on the global arrays
    replays it).
    """
    if unsupported:
        name = next(iter(unsupported))
        hint = {
            "bias": "a dense [q_seq, kv_seq] bias has no block structure; use segment ids, "
                    "lengths and causal",
            "mask": "a dense [q_seq, kv_seq] mask has no block structure; use segment ids, "
                    "lengths and causal",
            "return_probs": "the probabilities of a long sequence are what context parallelism "
                            "avoids materialising",
        }.get(name, "unknown option")
        raise _unsupported(name, hint)
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}; got {strategy!r}.")
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}; got {layout!r}.")
    statics = parse_statics(scale=scale, causal=causal, window=window, softcap=softcap,
                            dropout_rate=dropout_rate)

    problem = canonicalize(q, k, v, statics, q_segment_ids=q_segment_ids,
                           kv_segment_ids=kv_segment_ids, sink=sink, key=key)
    arrays, options = problem.arrays, problem.options
    if arrays.q.shape[1] != arrays.k.shape[1]:
        raise ValueError(
            "context parallelism splits one sequence for queries and keys alike: `q` and `k` "
            f"must have the same block length; got {arrays.q.shape[1]} and {arrays.k.shape[1]}."
        )
    bsz = arrays.q.shape[0]
    lens = []
    for name, x in (("q_seqlens", q_seqlens), ("kv_seqlens", kv_seqlens)):
        if x is None:
            lens.append(jnp.full((bsz,), jnp.iinfo(jnp.int32).max, jnp.int32))
            continue
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != problem.batch_shape:
            raise ValueError(
                f"`{name}` must be an integer array of shape [*batch] = {problem.batch_shape} "
                f"(the global length of each sequence); got {x.dtype} {x.shape}."
            )
        lens.append(jnp.clip(x.reshape(bsz), 0, jnp.iinfo(jnp.int32).max).astype(jnp.int32))
    module = _backend_module(backend, jax.default_backend())
    has_lengths = q_seqlens is not None or kv_seqlens is not None
    if not getattr(module, "FOLLOWS_BLOCK_STATE", True):
        windowed = options.window_left >= 0 or options.window_right >= 0
        if options.dropout_rate > 0:
            module = _hopper_module(
                arrays, "dropout", "cuDNN's dropout generator is static per graph and cannot "
                "draw a block's part of the whole problem's mask")
        elif options.causal == 2 and has_lengths and windowed:
            module = _hopper_module(
                arrays, "a `window` with a bottom-right mask and lengths", "the diagonal moves "
                "per row by data, and cuDNN's window bounds are static per graph (a "
                "bottom-right mask with lengths is served without a window, and windows with "
                "every other mask)")
    cfg = _Config(
        axis_name=axis_name, strategy=strategy, layout=layout,
        options=options._replace(causal=0, has_seqlens=True), causal=options.causal != 0,
        has_seqlens=q_seqlens is not None or kv_seqlens is not None,
        has_segments=arrays.q_segment_ids is not None, has_sink=arrays.sink is not None,
        bottom_right_lengths=options.causal == 2 and has_lengths,
        backend=module,
    )
    out, lse, row_max = _ring(
        cfg, arrays.q, arrays.k, arrays.v, arrays.q_segment_ids, arrays.kv_segment_ids,
        lens[0], lens[1], arrays.rng_state, arrays.sink,
    )
    batch = problem.batch_shape
    aux = AttnAux(
        lse=lse.reshape((*batch, *lse.shape[1:])),
        max=jax.lax.stop_gradient(row_max.reshape((*batch, *row_max.shape[1:]))),
        probs=None, rng_state=arrays.rng_state,
        backend="flex" if backend == "flex" else "flash", dropout_impl="attnaux",
    )
    return out.reshape((*batch, *out.shape[1:])), aux


def context_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: Any,
    **options: Any,
) -> tuple[jax.Array, AttnAux]:
    """`ring_attention` on global arrays sharded along their sequence by `axis_name` of `mesh`
    (`NamedSharding` in, `NamedSharding` out): the `jax.shard_map` written for you.

    `q`, `k`, `v` are `[*batch, seq, heads, dim]` with `seq` split evenly over the axis (in the
    `layout` order: with `layout="zigzag"`, pass `attnaux.parallel.zigzag(x, n, axis=-3)` and
    undo it on the output with `unzigzag`). Segment ids `[*batch, seq]` are sharded the same
    way; lengths, the sink and the key are replicated. Returns `out` sharded like `q` and
    `aux.lse`, `aux.max` `[*batch, heads, seq]` sharded along `seq`.
    """
    from jax.sharding import PartitionSpec as P

    nb = q.ndim - 3
    seq_spec = P(*([None] * nb), axis_name)
    rows_spec = P(*([None] * (nb + 1)), axis_name)
    array_names = ("q_segment_ids", "kv_segment_ids", "q_seqlens", "kv_seqlens", "sink", "key")
    arrays = {name: options.pop(name) for name in array_names if options.get(name) is not None}
    specs = {"q_segment_ids": seq_spec, "kv_segment_ids": seq_spec}
    names = tuple(arrays)

    def local(q, k, v, *values):
        out, aux = ring_attention(q, k, v, axis_name=axis_name,
                                  **dict(zip(names, values, strict=True)), **options)
        return out, aux.lse, aux.max

    in_specs = (seq_spec, seq_spec, seq_spec, *(specs.get(n, P()) for n in names))
    out, lse, row_max = jax.shard_map(
        local, mesh=mesh, in_specs=in_specs, out_specs=(seq_spec, rows_spec, rows_spec),
    )(q, k, v, *arrays.values())
    rng = None
    if "key" in arrays and options.get("dropout_rate", 0.0):
        rng = rng_state_from_key(arrays["key"])
    aux = AttnAux(lse=lse, max=row_max, probs=None, rng_state=rng, backend="flash",
                  dropout_impl="attnaux")
    return out, aux
