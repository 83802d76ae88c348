"""`score_mod` and `mask_mod`: attention with the scores shaped by plain JAX functions.

`score_mod(score, batch, head, q_idx, kv_idx) -> score` and `mask_mod(batch, head, q_idx,
kv_idx) -> bool` are scalar functions; attnaux vectorises them with `jax.vmap` over the four
index axes. Captured arrays (a relative-position table, ALiBi slopes) are found by
`jax.closure_convert` and become differentiable operands, like flex attention's captured buffers.
The order of the score rules: `scale * q k^T`, then `softcap`, then `score_mod`, then the masks
(lengths, causal, window, segment ids, `mask_mod`); `aux.lse` and `aux.max` are of the modified
scores.

This module holds the functions' conversion, the block table and the `flex` backend; which
backend serves a call (the CPU kernels' score programs, flex, or the reference) is decided in
`_mods.py`. Here:

- `flex`: blockwise online softmax in JAX, compiled by XLA on every platform (`_flex_forward`,
  `_flex_backward`): query tiles of up to `BLOCK_Q` rows against key tiles of up to `BLOCK_K`
  keys, memory linear in the sequence length. The (query tile, key tile) pairs to visit are a
  table built once per static shape from the causal/window geometry and, where it can be
  evaluated at trace time, from `mask_mod` itself (`block_table`, flex attention's BlockMask):
  hidden tiles cost nothing. The backward is derived by JAX: per tile, `jax.vjp` of the
  vectorised `score_mod` at the recomputed scores, with dS = P * (dP - (D - dlse)) as its
  cotangent, gives the scores' gradient and that tile's share of the captured arrays' gradient.
- `reference`: the scores materialised (`_reference.reference_attention` with the two functions),
  differentiated by JAX end to end: the oracle of the tests.

Dropout composes: every backend draws attnaux's documented keep-mask (`_philox`) at the
global positions of each tile (flex per tile, the CPU kernels as for their built-in options), so
the three agree for the same `rng_state` and `introspect.dropout_mask` replays it. attnaux's
Hopper kernels draw no mask: on GPU a call with dropout runs on flex.

Not served with them (a clear error, `_mods._check`): `bias` and `mask` (a `score_mod` or
`mask_mod` closing over the array says the same), `return_probs` on `flex`.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._canon import Canonical, Options
from ._masking import visibility
from ._partition import match_vma, unify_vma, vma
from ._philox import keep_at

BLOCK_Q = 512
BLOCK_K = 512
"""The largest tiles (query rows x keys); a shorter sequence takes one tile of its length rounded
up to 64. Measured on 2 CPU cores at 1 x 2048 x 8 x 64 (`benchmarks/score_mod.py`): 512 x 512
tiles ran the causal mask_mod 1.4x / 1.6x faster (forward / forward+backward) than 128 x 128, as
every tile costs a few passes of XLA operations; smaller tiles skip finer masks."""


def tile_sizes(q_seq: int, kv_seq: int) -> tuple[int, int]:
    return (min(BLOCK_Q, max(64, -(-q_seq // 64) * 64)),
            min(BLOCK_K, max(64, -(-kv_seq // 64) * 64)))
BLOCK_MASK_MAX_EVALUATIONS = 2**26
"""`mask_mod` is evaluated at every (batch, head, query, key) at trace time to find the blocks it
hides, when that is at most this many evaluations and it captures no traced array; otherwise only
the causal/window geometry skips blocks (`explain` says which)."""


def vectorize_score_mod(score_mod: Callable, n_consts: int = 0) -> Callable:
    """`f(scores [B, H, Q, K], b [B], h [H], q [Q], k [K], *consts) -> [B, H, Q, K]` from the
    scalar `score_mod(score, b, h, q_idx, kv_idx, *consts)` (the consts are not mapped)."""
    c = (None,) * n_consts
    f = jax.vmap(score_mod, in_axes=(0, None, None, None, 0, *c))
    f = jax.vmap(f, in_axes=(0, None, None, 0, None, *c))
    f = jax.vmap(f, in_axes=(0, None, 0, None, None, *c))
    return jax.vmap(f, in_axes=(0, 0, None, None, None, *c))


def vectorize_mask_mod(mask_mod: Callable, n_consts: int = 0) -> Callable:
    """`f(b [B], h [H], q [Q], k [K], *consts) -> bool[B, H, Q, K]` from the scalar
    `mask_mod(b, h, q_idx, kv_idx, *consts)`."""
    c = (None,) * n_consts
    f = jax.vmap(mask_mod, in_axes=(None, None, None, 0, *c))
    f = jax.vmap(f, in_axes=(None, None, 0, None, *c))
    f = jax.vmap(f, in_axes=(None, 0, None, None, *c))
    return jax.vmap(f, in_axes=(0, None, None, None, *c))


class Mods(NamedTuple):
    """The closure-converted functions: `score(s, b, h, qi, ki, *score_consts)` and
    `mask(b, h, qi, ki, *mask_consts)` (vectorised), or None; `score_scalar` and
    `mask_scalar` are the same functions on scalars (what `_score_program` translates)."""

    score: Callable | None
    n_score: int
    mask: Callable | None
    n_mask: int
    score_scalar: Callable | None = None
    mask_scalar: Callable | None = None


def _trace(name: str, fn: Callable, *args):
    """The abstract result of `fn` on scalar arguments, or a ValueError naming the function."""
    try:
        return jax.eval_shape(fn, *args)
    except Exception as error:  # any failure to trace: say which function and why
        kinds = "a float32 score and four int32 indices" if name == "score_mod" else (
            "four int32 indices")
        raise ValueError(
            f"`{name}` could not be traced on scalars ({kinds}; attnaux vectorises it with "
            f"jax.vmap, so it must be a traceable JAX function of scalars): "
            f"{type(error).__name__}: {error}"
        ) from error


def convert(score_mod, mask_mod):
    """`(Mods, consts)`: the functions with their captured arrays as explicit operands (checked
    on one example: a scalar float32 result for `score_mod`, a scalar bool for `mask_mod`)."""
    i = jnp.zeros((), jnp.int32)
    s = jnp.zeros((), jnp.float32)
    score_fn = mask_fn = pure = pure_m = None
    consts_s: list = []
    consts_m: list = []
    if score_mod is not None:
        if not callable(score_mod):
            raise TypeError(f"`score_mod` must be a function; got {type(score_mod).__name__}.")
        out = _trace("score_mod", score_mod, s, i, i, i, i)
        if getattr(out, "shape", None) != () or not jnp.issubdtype(out.dtype, jnp.floating):
            raise ValueError(
                "`score_mod(score, batch, head, q_idx, kv_idx)` must return one float per logit "
                f"(a scalar); it returned {getattr(out, 'dtype', type(out))} "
                f"{getattr(out, 'shape', '')}."
            )
        pure, consts_s = jax.closure_convert(score_mod, s, i, i, i, i)
        score_fn = vectorize_score_mod(pure, len(consts_s))
    if mask_mod is not None:
        if not callable(mask_mod):
            raise TypeError(f"`mask_mod` must be a function; got {type(mask_mod).__name__}.")
        out = _trace("mask_mod", mask_mod, i, i, i, i)
        if getattr(out, "shape", None) != () or out.dtype != jnp.bool_:
            raise ValueError(
                "`mask_mod(batch, head, q_idx, kv_idx)` must return one bool per pair (True = "
                f"attend); it returned {getattr(out, 'dtype', type(out))} "
                f"{getattr(out, 'shape', '')}."
            )
        pure_m, consts_m = jax.closure_convert(mask_mod, i, i, i, i)
        mask_fn = vectorize_mask_mod(pure_m, len(consts_m))
    return (Mods(score_fn, len(consts_s), mask_fn, len(consts_m), pure, pure_m),
            (*consts_s, *consts_m))


def _apply_score(mods: Mods, consts, s, b, h, qi, ki):
    if mods.score is None:
        return s
    # inside `jax.shard_map` the captured arrays take the scores' varying axes (JAX would
    # not cast them inside the vectorised function)
    s, *c = unify_vma((s, *consts[:mods.n_score]))
    return mods.score(s, b, h, qi, ki, *c).astype(jnp.float32)


def _mask(mods: Mods, consts, b, h, qi, ki):
    if mods.mask is None:
        return None
    return mods.mask(b, h, qi, ki, *consts[mods.n_score:])


# ------------------------------------------------------------------------------------------------
# The block table (flex attention's BlockMask)
# ------------------------------------------------------------------------------------------------
class BlockTable(NamedTuple):
    bq: int  # query rows per tile
    bk: int  # keys per tile
    counts: np.ndarray  # int32 [nq]: key blocks each query block visits
    indices: np.ndarray  # int32 [nq, max(1, max count)]: which, in order (padded with 0)
    fraction: float  # blocks visited / all blocks
    how: str  # what decided it, for `explain`


def _geometry_visible(options: Options, nq: int, nk: int, q_seq: int, kv_seq: int, bq: int,
                      bk: int) -> np.ndarray:
    """bool[nq, nk]: blocks the causal/window rules (without lengths) leave any pair in.
    Bottom-right alignment with lengths can move the diagonal, so it keeps every block."""
    keep = np.ones((nq, nk), bool)
    if options.causal == 2 and options.has_seqlens:
        return keep
    offset = kv_seq - q_seq if options.causal == 2 else 0
    q_lo = np.arange(nq) * bq
    q_hi = np.minimum(q_lo + bq, q_seq) - 1
    k_lo = np.arange(nk) * bk
    k_hi = np.minimum(k_lo + bk, kv_seq) - 1
    right = 0 if options.causal else options.window_right
    if right >= 0:  # some pair with k <= q + offset + right
        keep &= k_lo[None, :] <= q_hi[:, None] + offset + right
    if options.window_left >= 0:  # some pair with k >= q + offset - left
        keep &= k_hi[None, :] >= q_lo[:, None] + offset - options.window_left
    return keep


def _reads_batch_and_head(mods: Mods, consts) -> tuple[bool, bool]:
    """Whether mask_mod reads its batch and its head index (an index passed on to a nested call
    counts as read)."""
    i = jax.ShapeDtypeStruct((), jnp.int32)
    avals = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in consts[mods.n_score:]]
    jaxpr = jax.make_jaxpr(mods.mask_scalar)(i, i, i, i, *avals).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
    used |= {id(v) for v in jaxpr.outvars}
    return id(jaxpr.invars[0]) in used, id(jaxpr.invars[1]) in used


def dense_mask(mods: Mods, consts, bsz: int, q_heads: int, q_seq: int,
               kv_seq: int) -> tuple[np.ndarray | None, str]:
    """`(bool [B|1, Hq|1, Sq, Skv] or None, why not)`: mask_mod evaluated at every pair at trace
    time, where that is possible (at most `BLOCK_MASK_MAX_EVALUATIONS` pairs, no traced
    captures); once for every batch row (head) when it does not read the batch (head) index."""
    if mods.mask is None:
        return None, ""
    reads_b, reads_h = _reads_batch_and_head(mods, consts)
    nb, nh = (bsz if reads_b else 1), (q_heads if reads_h else 1)
    if nb * nh * q_seq * kv_seq > BLOCK_MASK_MAX_EVALUATIONS:
        return None, (f"mask_mod not evaluated ({nb * nh * q_seq * kv_seq} pairs > "
                      f"BLOCK_MASK_MAX_EVALUATIONS)")
    try:
        with jax.ensure_compile_time_eval():
            dense = np.asarray(_mask(mods, consts, jnp.arange(nb), jnp.arange(nh),
                                     jnp.arange(q_seq), jnp.arange(kv_seq)))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError):
        return None, "mask_mod not evaluated (it captures traced arrays)"
    return np.broadcast_to(dense, (nb, nh, q_seq, kv_seq)), ""


def _tile_table(dense: np.ndarray, bq: int, bk: int) -> np.ndarray:
    """bool `[B, Hq, ceil(Sq/bq), ceil(Skv/bk)]`: some pair of the tile is visible."""
    bsz, q_heads, q_seq, kv_seq = dense.shape
    nq, nk = -(-q_seq // bq), -(-kv_seq // bk)
    pad = np.zeros((bsz, q_heads, nq * bq, nk * bk), bool)
    pad[:, :, :q_seq, :kv_seq] = dense
    return pad.reshape(bsz, q_heads, nq, bq, nk, bk).any(axis=(3, 5))


def tiles_of(dense: np.ndarray, tile: int) -> np.ndarray:
    """int32 `[B|1, Hq|1, ceil(Sq/tile), ceil(Skv/tile)]`: 0 where mask_mod hides every pair of
    the tile, 2 where it shows every pair (the part of the tile inside the arrays), else 1; a
    dim of size 1 where every batch row (head) has the same table."""
    whole = ~_tile_table(~dense, tile, tile)  # (the padding past the arrays hides nothing)
    table = _tile_table(dense, tile, tile).astype(np.int32) + whole.astype(np.int32)
    if (table == table[:1]).all():
        table = table[:1]
    if (table == table[:, :1]).all():
        table = table[:, :1]
    return table


def block_table(mods: Mods, consts, options: Options, bsz: int, q_heads: int, q_seq: int,
                kv_seq: int, dense: np.ndarray | None = None, why_not: str = "") -> BlockTable:
    """The tiles to visit (`BlockTable`), from the geometry and `dense_mask`'s result."""
    bq, bk = tile_sizes(q_seq, kv_seq)
    nq, nk = -(-q_seq // bq), -(-kv_seq // bk)
    keep = _geometry_visible(options, nq, nk, q_seq, kv_seq, bq, bk)
    how = "the causal/window geometry"
    if why_not:
        how += "; " + why_not
    if dense is not None:
        keep &= _tile_table(dense, bq, bk).any(axis=(0, 1))
        how += " and mask_mod (evaluated once for this shape)"
    counts = keep.sum(axis=1).astype(np.int32)
    indices = np.zeros((nq, max(1, int(counts.max(initial=0)))), np.int32)
    for i in range(nq):
        idx = np.nonzero(keep[i])[0]
        indices[i, :idx.size] = idx
    fraction = float(keep.sum()) / max(1, nq * nk)
    return BlockTable(bq, bk, counts, indices, fraction, how)


# ------------------------------------------------------------------------------------------------
# Blockwise forward and backward
# ------------------------------------------------------------------------------------------------
class _Static(NamedTuple):
    options: Options
    mods: Mods
    table: Any  # BlockTable (numpy arrays)
    q_seq: int
    kv_seq: int


def _pad_seq(x, axis: int, multiple: int):
    if x is None:
        return None
    n = x.shape[axis]
    pad = -(-n // multiple) * multiple - n
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _tile(st: _Static, arrays: Canonical, consts, q0, k0, q_blk, k_blk):
    """`(raw, modified, visible, tanh)` scores of one tile, `[B, Hq, BQ, BK]` float32: `raw`
    after scale and softcap, `modified` after score_mod (0 where not visible)."""
    options = st.options
    bq, bk = st.table.bq, st.table.bk
    bsz, _, kv_heads, _ = k_blk.shape
    q_heads = q_blk.shape[2]
    group = q_heads // kv_heads
    qg = q_blk.reshape(bsz, bq, kv_heads, group, -1).astype(jnp.float32)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_blk.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST).reshape(bsz, q_heads, bq, bk)
    s = s * options.scale
    th = None
    if options.softcap > 0:
        th = jnp.tanh(s / options.softcap)
        s = options.softcap * th
    qi = q0 + jnp.arange(bq, dtype=jnp.int32)
    ki = k0 + jnp.arange(bk, dtype=jnp.int32)
    b_idx = jnp.arange(bsz, dtype=jnp.int32)
    h_idx = jnp.arange(q_heads, dtype=jnp.int32)
    tile = arrays._replace(q=q_blk, k=k_blk)
    if arrays.q_segment_ids is not None:
        tile = tile._replace(
            q_segment_ids=jax.lax.dynamic_slice_in_dim(arrays.q_segment_ids, q0, bq, 1),
            kv_segment_ids=jax.lax.dynamic_slice_in_dim(arrays.kv_segment_ids, k0, bk, 1))
    # the rules of docs/kernel_abi.md at the tile's global positions (lengths, causal, window,
    # segment ids), then mask_mod
    visible = visibility(tile, options, keys=ki, kv_seq=st.kv_seq, queries=qi, q_seq=st.q_seq)
    user = _mask(st.mods, consts, b_idx, h_idx, qi, ki)
    if user is not None:
        visible &= user
    visible = jnp.broadcast_to(visible, s.shape)
    raw = jnp.where(visible, s, 0.0)  # score_mod sees finite scores everywhere
    modified = jnp.where(visible, _apply_score(st.mods, consts, raw, b_idx, h_idx, qi, ki), 0.0)
    return raw, modified, visible, th


def _dropout_scale(st: _Static, arrays: Canonical, q0, k0, bsz: int, q_heads: int):
    """`keep / (1 - rate)` of a tile, `[B, Hq, BQ, BK]` float32, from attnaux's generator at the
    tile's positions in the whole problem (the words of the whole problem's mask; a 12-word
    block state gives the call's origin in it and its sizes), or 1.0 without dropout."""
    rate = st.options.dropout_rate
    if rate == 0:
        return 1.0
    bq, bk = st.table.bq, st.table.bk
    state = arrays.rng_state.astype(jnp.uint32)
    u32 = jnp.uint32
    if state.shape[0] == 12:  # a block of a larger problem (docs/kernel_abi.md)
        b0, h0, i0, j0, heads, q_total, kv_total = (state[n] for n in range(4, 11))
    else:
        b0 = h0 = i0 = j0 = u32(0)
        heads, q_total, kv_total = u32(q_heads), u32(st.q_seq), u32(st.kv_seq)
    b = b0 + jnp.arange(bsz, dtype=u32)
    h = h0 + jnp.arange(q_heads, dtype=u32)
    i = i0 + jnp.asarray(q0, u32) + jnp.arange(bq, dtype=u32)
    j = j0 + jnp.asarray(k0, u32) + jnp.arange(bk, dtype=u32)
    row = (b[:, None, None, None] * heads + h[None, :, None, None]) * q_total + i[:, None]
    keep = keep_at(state[:4], rate, row, j[None, None, None, :], kv_total)
    return jnp.where(keep, jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))


def _padded(st: _Static, arrays: Canonical):
    bq, bk = st.table.bq, st.table.bk
    q = _pad_seq(arrays.q, 1, bq)
    k = _pad_seq(arrays.k, 1, bk)
    v = _pad_seq(arrays.v, 1, bk)
    qs = _pad_seq(arrays.q_segment_ids, 1, bq)
    ks = _pad_seq(arrays.kv_segment_ids, 1, bk)
    return arrays._replace(q=q, k=k, v=v, q_segment_ids=qs, kv_segment_ids=ks)


def _flex_forward(st: _Static, arrays: Canonical, consts):
    """`(out [B,Sq,Hq,Dv], lse [B,Hq,Sq], max [B,Hq,Sq])`, float32, without the sink."""
    bq, bk = st.table.bq, st.table.bk
    padded = _padded(st, arrays)
    bsz, _, q_heads, _ = padded.q.shape
    kv_heads, v_dim = padded.v.shape[2], padded.v.shape[3]
    group = q_heads // kv_heads
    counts = jnp.asarray(st.table.counts)

    def q_block(qb):
        q0 = qb * bq
        q_blk = jax.lax.dynamic_slice_in_dim(padded.q, q0, bq, 1)

        def body(t, carry):
            acc, m, total = carry
            k0 = jnp.asarray(st.table.indices)[qb, t] * bk
            k_blk = jax.lax.dynamic_slice_in_dim(padded.k, k0, bk, 1)
            v_blk = jax.lax.dynamic_slice_in_dim(padded.v, k0, bk, 1)
            _, s, visible, _ = _tile(st, padded, consts, q0, k0, q_blk, k_blk)
            m_new = jnp.maximum(m, jnp.max(jnp.where(visible, s, -jnp.inf), axis=-1))
            m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_use), 0.0)
            p = jnp.exp(jnp.where(visible, s - m_use[..., None], -jnp.inf))
            total = total * alpha + p.sum(-1)
            # dropout acts on the normalised probabilities: the denominator keeps every p
            kept = p * _dropout_scale(st, padded, q0, k0, bsz, q_heads)
            pv = jnp.einsum("bhgqk,bkhd->bqhgd",
                            kept.reshape(bsz, kv_heads, group, bq, bk),
                            v_blk.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
            pv = pv.reshape(bsz, bq, q_heads, v_dim)
            acc = acc * alpha.transpose(0, 2, 1)[..., None] + pv
            return acc, m_new, total

        init = (jnp.zeros((bsz, bq, q_heads, v_dim), jnp.float32),
                jnp.full((bsz, q_heads, bq), -jnp.inf, jnp.float32),
                jnp.zeros((bsz, q_heads, bq), jnp.float32))
        init = tuple(unify_vma((*init, q_blk))[:3])
        acc, m, total = jax.lax.fori_loop(0, counts[qb], body, init)
        seen = jnp.isfinite(m) & (total > 0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
        out = acc / jnp.where(seen, total, 1.0).transpose(0, 2, 1)[..., None]
        out = jnp.where(seen.transpose(0, 2, 1)[..., None], out, 0.0)
        return out, lse, jnp.where(seen, m, -jnp.inf)

    nq = st.table.counts.shape[0]
    out, lse, row_max = jax.lax.map(q_block, jnp.arange(nq, dtype=jnp.int32))
    out = out.transpose(1, 0, 2, 3, 4).reshape(bsz, nq * bq, q_heads, v_dim)[:, :st.q_seq]
    lse = lse.transpose(1, 2, 0, 3).reshape(bsz, q_heads, nq * bq)[..., :st.q_seq]
    row_max = row_max.transpose(1, 2, 0, 3).reshape(bsz, q_heads, nq * bq)[..., :st.q_seq]
    return out, lse, row_max


def _flex_backward(st: _Static, arrays: Canonical, consts, out, lse, dout, dlse):
    """`(dq, dk, dv, dconsts)` (float32) from the whole problem's out and lse."""
    bq, bk = st.table.bq, st.table.bk
    padded = _padded(st, arrays)
    bsz, _, q_heads, qk_dim = padded.q.shape
    kv_heads, v_dim = padded.v.shape[2], padded.v.shape[3]
    group = q_heads // kv_heads
    counts = jnp.asarray(st.table.counts)
    out_p = _pad_seq(out, 1, bq)
    dout_p = _pad_seq(dout, 1, bq).astype(jnp.float32)
    row = jnp.einsum("bqhd,bqhd->bhq", dout_p, out_p.astype(jnp.float32))
    row_term = row - _pad_seq(dlse, 2, bq)  # D - dlse, [B, Hq, Sq]
    lse_p = _pad_seq(lse, 2, bq)
    lse_safe = jnp.where(jnp.isfinite(lse_p), lse_p, jnp.inf)  # rows seeing nothing: P = 0
    n_score = st.mods.n_score
    score_consts = consts[:n_score]
    # only the floating captured arrays of score_mod get gradients (integer tables do not)
    fidx = [i for i, c in enumerate(score_consts) if _float_const(c)]

    def q_block(qb, carry):
        dk, dv, dconsts = carry
        q0 = qb * bq
        q_blk = jax.lax.dynamic_slice_in_dim(padded.q, q0, bq, 1)
        do_blk = jax.lax.dynamic_slice_in_dim(dout_p, q0, bq, 1)
        lse_blk = jax.lax.dynamic_slice_in_dim(lse_safe, q0, bq, 2)
        rt_blk = jax.lax.dynamic_slice_in_dim(row_term, q0, bq, 2)

        def body(t, inner):
            dq_blk, dk, dv, dconsts = inner
            k0 = jnp.asarray(st.table.indices)[qb, t] * bk
            k_blk = jax.lax.dynamic_slice_in_dim(padded.k, k0, bk, 1)
            v_blk = jax.lax.dynamic_slice_in_dim(padded.v, k0, bk, 1)
            raw, s, visible, th = _tile(st, padded, consts, q0, k0, q_blk, k_blk)
            p = jnp.exp(jnp.where(visible, s - lse_blk[..., None], -jnp.inf))
            drop = _dropout_scale(st, padded, q0, k0, bsz, q_heads)  # 1, or keep / (1 - rate)
            p5 = (p * drop).reshape(bsz, kv_heads, group, bq, bk)
            do5 = do_blk.reshape(bsz, bq, kv_heads, group, v_dim)
            dv_t = jnp.einsum("bhgqk,bqhgd->bkhd", p5, do5, precision=jax.lax.Precision.HIGHEST)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do5, v_blk.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST).reshape(p.shape) * drop
            ds = jnp.where(visible, p * (dp - rt_blk[..., None]), 0.0)
            if st.mods.score is not None:
                b_idx = jnp.arange(bsz, dtype=jnp.int32)
                h_idx = jnp.arange(q_heads, dtype=jnp.int32)
                qi = q0 + jnp.arange(bq, dtype=jnp.int32)
                ki = k0 + jnp.arange(bk, dtype=jnp.int32)
                def score(r, *floats):
                    c = list(score_consts)
                    for i, x in zip(fidx, floats, strict=True):
                        c[i] = x
                    r, *c = unify_vma((r, *c))
                    return st.mods.score(r, b_idx, h_idx, qi, ki, *c).astype(jnp.float32)

                _, vjp = jax.vjp(score, raw, *(score_consts[i] for i in fidx))
                ds_raw, *dc = vjp(ds)
                ds_raw = jnp.where(visible, ds_raw, 0.0)
                dconsts = list(dconsts)
                for i, d in zip(fidx, dc, strict=True):
                    dconsts[i] = dconsts[i] + d.astype(jnp.float32)
                dconsts = tuple(dconsts)
            else:
                ds_raw = ds
            if th is not None:
                ds_raw = ds_raw * (1.0 - th * th)
            ds_raw = ds_raw * st.options.scale
            ds5 = ds_raw.reshape(bsz, kv_heads, group, bq, bk)
            dq_blk = dq_blk + jnp.einsum("bhgqk,bkhd->bqhgd", ds5, k_blk.astype(jnp.float32),
                                         precision=jax.lax.Precision.HIGHEST
                                         ).reshape(dq_blk.shape)
            dk_t = jnp.einsum("bhgqk,bqhgd->bkhd", ds5,
                              q_blk.reshape(bsz, bq, kv_heads, group, qk_dim)
                              .astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
            dk = jax.lax.dynamic_update_slice_in_dim(
                dk, jax.lax.dynamic_slice_in_dim(dk, k0, bk, 1) + dk_t, k0, 1)
            dv = jax.lax.dynamic_update_slice_in_dim(
                dv, jax.lax.dynamic_slice_in_dim(dv, k0, bk, 1) + dv_t, k0, 1)
            return dq_blk, dk, dv, dconsts

        dq0 = unify_vma((jnp.zeros((bsz, bq, q_heads, qk_dim), jnp.float32), q_blk))[0]
        dq_blk, dk, dv, dconsts = jax.lax.fori_loop(0, counts[qb], body, (dq0, dk, dv, dconsts))
        return (dk, dv, dconsts), dq_blk

    dk0 = jnp.zeros(padded.k.shape, jnp.float32)
    dv0 = jnp.zeros(padded.v.shape, jnp.float32)
    # A captured array's gradient has the array's varying axes: inside `jax.shard_map` the vjp
    # of the score function sums it over the devices where the array does not vary (the
    # transpose of its cast to the scores' axes in `score`).
    dc0 = tuple(match_vma(jnp.zeros(jnp.shape(c), jnp.float32), vma(c)) for c in score_consts)
    init = tuple(unify_vma((dk0, dv0, padded.q))[:2])
    nq = st.table.counts.shape[0]
    (dk, dv, dconsts), dq = jax.lax.scan(
        lambda c, qb: q_block(qb, c), (*init, dc0), jnp.arange(nq, dtype=jnp.int32))
    dq = dq.transpose(1, 0, 2, 3, 4).reshape(bsz, nq * bq, q_heads, qk_dim)[:, :st.q_seq]
    return dq, dk[:, :st.kv_seq], dv[:, :st.kv_seq], dconsts


def _float_const(c) -> bool:
    return jnp.issubdtype(jnp.result_type(c), jnp.inexact)


def make_flex(st: _Static):
    """The differentiable `(q, k, v, sink, consts) -> (out, lse, max)` of one static setting;
    other canonical arrays (lengths, segment ids, the dropout `rng_state`) ride along
    undifferentiated."""

    @jax.custom_vjp
    def flex(q, k, v, sink, consts, others):
        return _forward(q, k, v, sink, consts, others)[0]

    def _forward(q, k, v, sink, consts, others):
        arrays = Canonical(q, k, v, None, None, *others[:4], sink, others[4])
        out, lse, row_max = _flex_forward(st, arrays, consts)
        if sink is not None:
            s = sink.astype(jnp.float32)[None, :, None]
            total = jnp.logaddexp(lse, s)
            out = out * jnp.exp(lse - total).transpose(0, 2, 1)[..., None]
            lse = total
        out = out.astype(q.dtype)
        return (out, lse, row_max), (q, k, v, sink, consts, others, out, lse)

    def fwd(q, k, v, sink, consts, others):
        return _forward(q, k, v, sink, consts, others)

    def bwd(res, cts):
        q, k, v, sink, consts, others, out, lse = res
        dout, dlse, _ = cts
        dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0).astype(jnp.float32)
        arrays = Canonical(q, k, v, None, None, *others[:4], sink, others[4])
        dq, dk, dv, dscore = _flex_backward(st, arrays, consts, out, lse, dout, dlse)
        dsink = None
        if sink is not None:
            row = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32),
                             out.astype(jnp.float32)) - dlse
            dsink = (-jnp.sum(jnp.exp(sink.astype(jnp.float32)[None, :, None] - lse) * row,
                              axis=(0, 2))).astype(sink.dtype)
        dconsts = []
        for i, c in enumerate(consts):
            if i < st.mods.n_score and _float_const(c):
                dconsts.append(dscore[i].astype(jnp.result_type(c)))
            elif _float_const(c):
                dconsts.append(jnp.zeros_like(c))  # mask_mod's arrays: a mask has no gradient
            else:
                dconsts.append(np.zeros(jnp.shape(c), jax.dtypes.float0))
        others_ct = tuple(None if o is None else np.zeros(o.shape, jax.dtypes.float0)
                          for o in others)
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsink,
                tuple(dconsts), others_ct)

    flex.defvjp(fwd, bwd)
    return flex


def run(arrays: Canonical, options: Options, mods: Mods, consts, table: BlockTable):
    """`(out, lse, max)` of the `flex` backend."""
    st = _Static(options, mods, table, arrays.q.shape[1], arrays.k.shape[1])
    block = arrays.rng_state is not None and arrays.rng_state.shape == (12,)
    others = (arrays.q_seqlens, arrays.kv_seqlens, arrays.q_segment_ids, arrays.kv_segment_ids,
              arrays.rng_state if options.dropout_rate > 0 or block else None)
    return make_flex(st)(arrays.q, arrays.k, arrays.v, arrays.sink, tuple(consts), others)


def describe(table: BlockTable) -> str:
    return (f"blockwise online softmax in JAX ({table.bq} x {table.bk} tiles, XLA-compiled); "
            f"computes {table.fraction:.1%} of the blocks (skipped by {table.how})")
