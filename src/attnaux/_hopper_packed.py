"""Packed sequences on attnaux's Hopper kernels (`_flash_hopper.py`): segment ids and per-row
lengths in `attnaux.attention`, and the sequences of `attnaux.varlen_attention`, read in place.

The kernels see one long row of tokens per batch entry. What decides visibility comes per token
as data (`infos`, int32 `[B, 2, S]` per side):

- a **segment**: a row sees only keys of its own segment (segment ids; the sequence index of
  `varlen_attention`);
- a **position**: the key's position, and the row's *aligned* position (its position plus the
  bottom-right offset of its sequence), between which causal and window rules hold
  (`_flash_hopper._packed_visible`); padding is a key position of -1 and a row position of
  `PAD_ROW`. Only differences within a segment matter, so a sequence's positions may be
  shifted: `varlen_infos` starts each at its first key token, which keeps the per-tile position
  bounds tight where a tile straddles two sequences.

Before the kernels, one XLA pass over per-tile summaries (min and max of segment and position
over each 64-token tile) classifies every (query tile, key tile) pair: hidden, partial or whole
(every pair visible), and turns each tile row into the kernels' visiting ranges (`tables`). A
tile wholly inside one document is computed without a mask, a pair of tiles from different
documents is never visited, only tiles on a boundary pay for the per-token rules. This is the
tile skipping of FlashAttention's varlen kernels without a per-sequence launch grid: the work is
that of the documents, and the number of sequences is never static.

Tokens that no sequence covers are zeroed before the kernels (where the call can have them:
lengths, `varlen_attention`), so that NaN stored in padding never meets a zero probability or
score gradient in a product.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _flash_hopper as hopper
from ._canon import Canonical, Options, Problem
from ._kernel_call import SHARED, KernelOp, add_sink, compiled_vjp
from ._masking import diagonal_shift
from ._partition import (
    BATCH,
    HEADS,
    KV_HEADS,
    block_state,
    folded,
    partitioned,
    table_layout,
    varying_like_operands,
)

TILE = 64  # the tables' granularity: the backward's tiles, half a forward key tile
_PAD_MULTIPLE = 128  # sequence lengths the kernels take (two warpgroups of 64 rows)
_UNBOUNDED = 2**30  # a window side without a bound (positions stay far below it)
_MAX_TOKENS = 2**30
PAD_ROW = hopper.PAD_ROW


def window_of(options: Options):
    if options.window_left < 0 and options.window_right < 0:
        return None
    return (options.window_left if options.window_left >= 0 else _UNBOUNDED,
            options.window_right if options.window_right >= 0 else _UNBOUNDED)


def geometry(options: Options, q_seq: int, kv_seq: int) -> hopper.Geometry:
    return hopper.Geometry(options.causal != 0, window_of(options), 0, kv_seq, q_seq,
                           packed=True)


# ---- availability
DROPOUT_NOT_CHOSEN = (
    "the Hopper kernels draw attnaux's dropout mask (Philox-4x32-10 per element, in 32-bit "
    "operations) for context parallelism only; for a whole call cuDNN's generator is faster")
def _options_unavailable(options: Options, has_bias_or_mask: bool):
    if options.dropout_rate > 0:
        return DROPOUT_NOT_CHOSEN
    if has_bias_or_mask:
        return "the Hopper kernels take no bias or boolean mask"
    return None


def unavailable(problem: Problem, platform: str = "gpu") -> str | None:
    """Why the Hopper kernels cannot serve this call's packed sequences (None: they can)."""
    a, options = problem.arrays, problem.options
    if platform != "gpu":
        return f"attnaux's Hopper kernels run on GPUs, not on {platform!r}"
    why = hopper.device_unavailable(a.q, a.k, a.v)
    if why is None:
        why = _options_unavailable(options, a.bias is not None or a.mask is not None)
    if why is None and max(a.q.shape[1], a.k.shape[1]) >= _MAX_TOKENS:
        why = f"sequences of {_MAX_TOKENS} tokens or more"
    return why


def varlen_unavailable(q, k, v, options: Options) -> str | None:
    """Why `varlen_attention`'s packed tokens cannot go to the Hopper kernels (None: they can)."""
    why = hopper.device_unavailable(q, k, v) or _options_unavailable(options, False)
    if why is None and max(q.shape[0], k.shape[0]) >= _MAX_TOKENS:
        why = f"sequences of {_MAX_TOKENS} tokens or more"
    return why


# ---- the block tables, from per-tile summaries
def _summary(info, valid):
    """Per 64-token tile of `info [B, 2, S]`: min/max segment and position over the valid
    tokens, whether any and whether all are valid."""
    bsz, _, seq = info.shape
    n = seq // TILE
    seg = info[:, 0].reshape(bsz, n, TILE)
    pos = info[:, 1].reshape(bsz, n, TILE)
    ok = valid.reshape(bsz, n, TILE)
    big, small = jnp.int32(2**31 - 1), jnp.int32(-(2**31))
    return dict(
        seg_min=jnp.where(ok, seg, big).min(-1), seg_max=jnp.where(ok, seg, small).max(-1),
        pos_min=jnp.where(ok, pos, big).min(-1), pos_max=jnp.where(ok, pos, small).max(-1),
        some=ok.any(-1), every=ok.all(-1))


def classify(q_info, kv_info, g: hopper.Geometry):
    """int32 `[B, q tiles, key tiles]` of 64 x 64 tiles: 0 no visible pair, 2 every pair
    visible, 1 otherwise (conservative: 1 may hold no visible pair)."""
    qs = {n: x[:, :, None] for n, x in _summary(q_info, q_info[:, 1] != PAD_ROW).items()}
    ks = {n: x[:, None, :] for n, x in _summary(kv_info, kv_info[:, 1] >= 0).items()}
    some = (qs["some"] & ks["some"] & (qs["seg_min"] <= ks["seg_max"])
            & (ks["seg_min"] <= qs["seg_max"]))
    whole = (qs["every"] & ks["every"] & (qs["seg_min"] == qs["seg_max"])
             & (ks["seg_min"] == ks["seg_max"]) & (qs["seg_min"] == ks["seg_min"]))
    if g.causal:
        some &= ks["pos_min"] <= qs["pos_max"]
        whole &= ks["pos_max"] <= qs["pos_min"]
    if g.window is not None:
        left, right = g.window
        some &= (ks["pos_max"] >= qs["pos_min"] - left) & (ks["pos_min"] <= qs["pos_max"] + right)
        whole &= (ks["pos_min"] >= qs["pos_max"] - left) & (ks["pos_max"] <= qs["pos_min"] + right)
    return jnp.where(some, jnp.where(whole, 2, 1), 0).astype(jnp.int32)


def _merge(cls, factor: int):
    """Key tiles merged `factor` at a time (hidden if all are, whole if all are), padded with
    hidden tiles to a multiple of `factor`."""
    if factor == 1:
        return cls
    cls = jnp.pad(cls, ((0, 0), (0, 0), (0, (-cls.shape[-1]) % factor)))
    b, r, n = cls.shape
    t = cls.reshape(b, r, n // factor, factor)
    return jnp.where((t == 0).all(-1), 0, jnp.where((t == 2).all(-1), 2, 1)).astype(jnp.int32)


def _runs(cls):
    """The visiting ranges `[B, 1, rows, 4]` int32 of tile rows `cls [B, rows, n]`: `[lo, hi)`
    from the first to the last tile with a visible pair, and `[full_lo, full_hi)` the first run
    of whole tiles in it (every whole tile of a row when the documents are contiguous). Min and
    max reductions only, which XLA fuses with `classify`."""
    n = cls.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    some, whole = cls > 0, cls == 2
    hi = jnp.where(some, idx + 1, 0).max(-1)
    lo = jnp.where(hi > 0, jnp.where(some, idx, n).min(-1), 0)
    full_lo = jnp.where(whole, idx, n).min(-1)
    full_hi = jnp.where(~whole & (idx >= full_lo[..., None]), idx, n).min(-1)
    has_whole = full_lo < n
    full_lo, full_hi = jnp.where(has_whole, full_lo, lo), jnp.where(has_whole, full_hi, lo)
    return jnp.stack([lo, hi, full_lo, full_hi], -1).astype(jnp.int32)[:, None]


def tables(q_info, kv_info, g: hopper.Geometry, block_kv: int):
    """The kernels' visiting ranges `(forward, dQ, dK/dV)` from the token infos (lengths
    multiples of 128)."""
    cls = classify(q_info, kv_info, g)
    return _runs(_merge(cls, block_kv // TILE)), _runs(cls), _runs(jnp.swapaxes(cls, 1, 2))


# ---- the call: partitioned over batch and heads, vmap folded into the batch
@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    softcap: float | None
    geometry: hopper.Geometry
    config: hopper.Config
    dropout: float | None = None  # the rate; the kernels then take the 12-word block state
    # zero the padding tokens (the call may hold NaN there): `_call` zeroes V alone for a
    # forward that is not differentiated, q, k and v when it is (`_call_fwd`)
    clean: bool = False


def _no_side(bsz: int, heads: int, seq: int):
    return jnp.zeros((bsz, heads, 0, seq), jnp.float32)


_LAYOUTS = {
    "q_info": (BATCH, "info", "q_seq"), "kv_info": (BATCH, "info", "kv_seq"),
    "t_fwd": (BATCH, "one", "q_blocks", "range"), "t_dq": (BATCH, "one", "q_blocks", "range"),
    "t_dkv": (BATCH, "one", "kv_blocks", "range"),
}
_FORWARD_OPERANDS = ("q", "k", "v", "q_info", "kv_info", "t_fwd", "t_dq", "t_dkv", "rng_state")
_BACKWARD_OPERANDS = _FORWARD_OPERANDS + ("out", "lse", "dout", "dlse")


def _layout(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    return _LAYOUTS.get(name) or table_layout(name, shape)


def _dropout(st: _Static, rng_state):
    """The kernels' dropout arguments: the rate and the shard's 12-word block state (whose
    origin `_partition.partitioned` has moved to the shard)."""
    return dict(dropout=st.dropout, drop_state=rng_state if st.dropout else None)


def _local_forward(st: _Static, q, k, v, q_info, kv_info, t_fwd, t_dq, t_dkv, rng_state):
    bsz, q_seq, q_heads, _ = q.shape
    return hopper.forward(q, k, v, _no_side(bsz, q_heads, q_seq),
                          _no_side(bsz, q_heads, k.shape[1]), scale=st.scale,
                          softcap=st.softcap, geometry=st.geometry, tile_fn=None,
                          config=st.config, tables=(t_fwd, t_dq, t_dkv), infos=(q_info, kv_info),
                          **_dropout(st, rng_state))


def _local_backward(st: _Static, q, k, v, q_info, kv_info, t_fwd, t_dq, t_dkv, rng_state, out,
                    lse, dout, dlse):
    bsz, q_seq, q_heads, _ = q.shape
    dq, dk, dv, _, _ = hopper.backward(
        q, k, v, out, lse, dout, dlse, _no_side(bsz, q_heads, q_seq),
        _no_side(bsz, q_heads, k.shape[1]), scale=st.scale, softcap=st.softcap,
        geometry=st.geometry, tile_fn=None, config=st.config, tables=(t_fwd, t_dq, t_dkv),
        infos=(q_info, kv_info), **_dropout(st, rng_state))
    return dq, dk, dv


@functools.cache
def _ops(st: _Static):
    """The forward and backward kernel calls of one static setting: each partitioned over
    batch and heads under SPMD (`_partition.partitioned`: a device runs its shard, no
    gather; with dropout each shard's block state gets its origin), and folded under
    `jax.vmap` (mapped one element after another with dropout, whose counters use the batch
    index: folding would draw another mask)."""
    drop = ("rng_state", True) if st.dropout else None
    forward = partitioned(functools.partial(_local_forward, st), "attnaux packed (Hopper)",
                          _FORWARD_OPERANDS, ("out", "lse", "max"), layout=_layout, dropout=drop)
    backward = partitioned(functools.partial(_local_backward, st),
                           "attnaux packed backward (Hopper)", _BACKWARD_OPERANDS,
                           ("dq", "dk", "dv"), layout=_layout, dropout=drop)
    sequential = bool(st.dropout)
    return (varying_like_operands(folded(forward, sequential=sequential)),
            varying_like_operands(folded(backward, sequential=sequential)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _call(st: _Static, q, k, v, infos, tabs, rng):
    if st.clean:
        # The forward alone needs only V's padding zeroed: the kernels mask hidden pairs by
        # selection (a NaN score of a padding row or key never reaches P) and visit no tile
        # without a visible pair, but a masked P = 0 still meets V in the P V product (0 * NaN).
        # The backward's products meet q and k too (`_call_fwd`). Each zeroing is a pass over
        # its tensor (read and write): two of three passes fewer when nothing differentiates.
        v = _cleaned_keys(v, infos[1])
    return _ops(st)[0](q, k, v, *infos, *tabs, rng)


def _call_fwd(st, q, k, v, infos, tabs, rng):
    if st.clean:
        q, k, v = _cleaned(q, k, v, *infos)
    out, lse, mx = _ops(st)[0](q, k, v, *infos, *tabs, rng)
    return (out, lse, mx), (q, k, v, infos, tabs, rng, out, lse)


def _call_bwd(st, saved, cotangents):
    q, k, v, infos, tabs, rng, out, lse = saved
    dout, dlse, _ = cotangents  # the row max has no gradient
    dq, dk, dv = _ops(st)[1](q, k, v, *infos, *tabs, rng, out, lse, dout.astype(q.dtype),
                             dlse.astype(jnp.float32))
    return dq, dk, dv, None, None, None


_call.defvjp(_call_fwd, _call_bwd)


def _pad_tokens(x, axis: int, value=0):
    extra = (-x.shape[axis]) % _PAD_MULTIPLE
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_infos(q_info, kv_info):
    """The token infos padded to the kernels' multiple of 128 with padding tokens."""
    q_seq, kv_seq = q_info.shape[2], kv_info.shape[2]
    q_info = _pad_tokens(q_info, 2, PAD_ROW).at[:, 0, q_seq:].set(0)
    kv_info = _pad_tokens(kv_info, 2, -1).at[:, 0, kv_seq:].set(0)
    return q_info, kv_info


def _cleaned_keys(x, kv_info):
    """Keys (or values) with their padding tokens zeroed."""
    keep = (kv_info[:, 1] >= 0)[:, :, None, None]
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


def _cleaned(q, k, v, q_info, kv_info):
    """q, k and v with their padding tokens zeroed."""
    q_keep = (q_info[:, 1] != PAD_ROW)[:, :, None, None]
    return (jnp.where(q_keep, q, jnp.zeros((), q.dtype)), _cleaned_keys(k, kv_info),
            _cleaned_keys(v, kv_info))


def _prepared(q, k, v, q_info, kv_info, options: Options, clean: bool, rng_state=None):
    """`(st, q, k, v, infos, tables, rng)` of a call, as the kernels take it: q, k and v
    padded to the kernels' multiple of 128, the token infos padded with padding tokens, the
    static setting (`st.clean`: the padding is to be zeroed, `_call` does it), the visiting
    ranges and, with dropout, the block state (else an absent `(0,)`)."""
    dropout = options.dropout_rate if options.dropout_rate > 0 else None
    if dropout is not None:
        if rng_state is None or rng_state.shape[0] not in (4, 12):
            raise ValueError("dropout on the Hopper kernels needs the call's rng_state (4 or "
                             "12 uint32 words)")
        rng = block_state(rng_state, q, k)
    else:
        rng = jnp.zeros((0,), jnp.uint32)
    qp, kp, vp = _pad_tokens(q, 1), _pad_tokens(k, 1), _pad_tokens(v, 1)
    infos = pad_infos(q_info, kv_info)
    g = geometry(options, qp.shape[1], kp.shape[1])
    config = hopper.default_config(qp.shape[-1])  # 128-key tiles (256 unmeasured on documents)
    st = _Static(options.scale, options.softcap or None, g, config, dropout, clean)
    return st, qp, kp, vp, infos, tables(*infos, g, config.block_kv), rng


def packed_attention(q, k, v, q_info, kv_info, options: Options, *, clean: bool,
                     rng_state=None):
    """`(out [B, Sq, Hq, D], lse [B, Hq, Sq], max [B, Hq, Sq])` on the Hopper kernels for
    tokens described by `q_info [B, 2, Sq]`, `kv_info [B, 2, Skv]` (segment, position; see the
    module docstring). `clean`: zero the padding tokens of q, k and v first (the call may have
    padding that holds NaN: in a tile that mixes padding with visible pairs, a zero
    probability or score gradient would meet it in a product). Rows that see no key: out 0,
    lse = max = -inf, zero gradients. With `options.dropout_rate`, `rng_state` (4 words, or a
    block's 12) draws attnaux's keep-mask of the `[B, Hq, Sq, Skv]` problem."""
    q_seq = q.shape[1]
    st, qp, kp, vp, infos, tabs, rng = _prepared(q, k, v, q_info, kv_info, options, clean,
                                                 rng_state)
    out, lse, mx = _call(st, qp, kp, vp, infos, tabs, rng)
    return out[:, :q_seq], lse[..., :q_seq], mx[..., :q_seq]


def token_infos(arrays: Canonical, options: Options):
    """`(q_info, kv_info)` of an `attention` call: segment ids (0 without), the lengths'
    padding, and in the rows' aligned positions the bottom-right offset of each batch row plus
    a block's diagonal shift (word 11 of a 12-word block state: context parallelism)."""
    bsz, q_seq = arrays.q.shape[:2]
    kv_seq = arrays.k.shape[1]
    q_len = jnp.clip(arrays.q_seqlens.astype(jnp.int32), 0, q_seq)[:, None]
    kv_len = jnp.clip(arrays.kv_seqlens.astype(jnp.int32), 0, kv_seq)[:, None]
    offset = kv_len - q_len if options.causal == 2 else jnp.zeros_like(q_len)
    offset = offset + jnp.asarray(diagonal_shift(arrays), jnp.int32)
    i = jnp.arange(q_seq, dtype=jnp.int32)[None]
    j = jnp.arange(kv_seq, dtype=jnp.int32)[None]
    q_at = jnp.where(i < q_len, i + offset, PAD_ROW)
    kv_at = jnp.where(j < kv_len, j, -1)
    q_seg = (jnp.zeros((bsz, q_seq), jnp.int32) if arrays.q_segment_ids is None
             else arrays.q_segment_ids.astype(jnp.int32))
    kv_seg = (jnp.zeros((bsz, kv_seq), jnp.int32) if arrays.kv_segment_ids is None
              else arrays.kv_segment_ids.astype(jnp.int32))
    return jnp.stack([q_seg, q_at], 1), jnp.stack([kv_seg, kv_at], 1)


def run(arrays: Canonical, options: Options, return_probs: bool):
    """`(out, lse, max, None)`: the dispatch's entry for `attention` with segment ids."""
    del return_probs  # never asked (flash saves no probabilities)
    q_info, kv_info = token_infos(arrays, options)
    out, lse, mx = packed_attention(arrays.q, arrays.k, arrays.v, q_info, kv_info, options,
                                    clean=options.has_seqlens, rng_state=arrays.rng_state)
    if arrays.sink is not None:
        out, lse = add_sink(out, lse, arrays.sink)
    return out, lse, mx, None


FOLLOWS_BLOCK_STATE = True
"""The kernels take a block's diagonal shift from its 12-word block state (`token_infos`), and
with dropout its origin, so context parallelism gives them every block as it is and each block
draws its part of the whole problem's keep-mask."""


def block_backward(arrays: Canonical, options: Options, out, lse, dout, dlse):
    """`(dq, dk, dv)` of one block of a larger attention (context parallelism): the backward
    kernels with the *whole* problem's `out` and `lse` as residuals, so that P and the row term
    are the whole problem's: the block's exact share of the gradients."""
    q, k = arrays.q, arrays.k
    q_seq, kv_seq = q.shape[1], k.shape[1]
    st, qp, kp, vp, infos, tabs, rng = _prepared(q, k, arrays.v, *token_infos(arrays, options),
                                                 options, options.has_seqlens, arrays.rng_state)
    if st.clean:  # the backward kernels called directly, not through `_call`
        qp, kp, vp = _cleaned(qp, kp, vp, *infos)
    dq, dk, dv = _ops(st)[1](
        qp, kp, vp, *infos, *tabs, rng, _pad_tokens(out.astype(q.dtype), 1),
        _pad_tokens(lse.astype(jnp.float32), 2, -jnp.inf), _pad_tokens(dout.astype(q.dtype), 1),
        _pad_tokens(dlse.astype(jnp.float32), 2))
    return dq[:, :q_seq], dk[:, :kv_seq], dv[:, :kv_seq]


def varlen_infos(q_seq_of, q_pos, q_covered, kv_seq_of, kv_pos, kv_covered, q_lengths,
                 kv_lengths, kv_offsets, options: Options):
    """`(q_info [1, 2, total_q], kv_info [1, 2, total_kv])` of `varlen_attention`'s packed
    tokens: each token's sequence and position in it (`_varlen.Packing`), the sequences'
    lengths for the bottom-right offsets and their key offsets.

    Both sides' positions are shifted by their sequence's first key token, so a key's position
    is its token index and a query's lies among its sequence's keys: a pair of one sequence
    compares as before, and a query tile that straddles two sequences gets position bounds
    that still prune the second one's later keys (with positions inside each sequence it got
    the first one's late positions, and its causal bound kept most of the second one's key
    tiles)."""
    shift = kv_offsets[:-1]
    offset = (kv_lengths - q_lengths)[q_seq_of] if options.causal == 2 else 0
    q_at = jnp.where(q_covered, q_pos + offset + shift[q_seq_of], PAD_ROW)
    kv_at = jnp.where(kv_covered, kv_pos + shift[kv_seq_of], -1)
    q_info = jnp.stack([q_seq_of.astype(jnp.int32), q_at.astype(jnp.int32)])[None]
    kv_info = jnp.stack([kv_seq_of.astype(jnp.int32), kv_at.astype(jnp.int32)])[None]
    return q_info, kv_info


def varlen(q, k, v, q_seq_of, q_pos, q_covered, kv_seq_of, kv_pos, kv_covered, q_lengths,
           kv_lengths, kv_offsets, options: Options, sink):
    """`(out [total_q, Hq, D], lse [Hq, total_q], max [Hq, total_q])` of `varlen_attention`'s
    packed tokens (`varlen_infos`)."""
    q_info, kv_info = varlen_infos(q_seq_of, q_pos, q_covered, kv_seq_of, kv_pos, kv_covered,
                                   q_lengths, kv_lengths, kv_offsets, options)
    out, lse, mx = packed_attention(q[None], k[None], v[None], q_info, kv_info, options,
                                    clean=True)
    if sink is not None:
        out, lse = add_sink(out, lse, sink)
    return out[0], lse[0], mx[0]


# ---- the CUDA C++ forward over packed sequences (csrc/cuda/hopper_fwd_packed.cu)
CUDA_FORWARD_TARGET = "attnaux_hopper_fwd_packed"
CUDA_FORWARD_HEAD_DIMS = (64, 128, 256)
_CUDA_LAYOUTS = {
    "q": ("one", "q_tokens", HEADS, "qk_dim"), "k": ("one", "kv_tokens", KV_HEADS, "qk_dim"),
    "v": ("one", "kv_tokens", KV_HEADS, "v_dim"), "out": ("one", "q_tokens", HEADS, "v_dim"),
    "lse": ("one", HEADS, "q_tokens"), "max": ("one", HEADS, "q_tokens"),
    "stats": ("seqs", HEADS, "q_seq"), "q_offsets": ("bounds",), "kv_offsets": ("bounds",),
    "work": ("work_words",),
}


def cuda_forward_unavailable(q, k, v, options: Options) -> str | None:
    """Why `varlen_attention`'s forward cannot run on attnaux's CUDA C++ kernel over the packed
    tokens (`cuda_forward`; None: it can). `q`, `k`, `v`: `[tokens, heads, dim]`."""
    from ._ffi import has_target

    if not has_target(CUDA_FORWARD_TARGET, "gpu"):
        return "this build of attnaux has no CUDA C++ Hopper kernels (built without CUTLASS)"
    devices = jax.devices()
    capability = str(getattr(devices[0], "compute_capability", "")) if devices else ""
    if not capability.startswith("9."):
        return (f"the CUDA C++ kernels need a Hopper GPU (compute capability 9.x), not "
                f"{capability!r}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"it takes bfloat16 or float16 q, k, v (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.shape[-1] not in CUDA_FORWARD_HEAD_DIMS or v.shape[-1] != q.shape[-1]:
        return (f"it takes head dims {CUDA_FORWARD_HEAD_DIMS}, equal for q/k and v (got "
                f"{q.shape[-1]} and {v.shape[-1]})")
    if options.softcap is not None and options.softcap > 0:
        return "it applies no softcap"
    if options.dropout_rate > 0:
        return "it draws no dropout"
    if max(q.shape[0], k.shape[0]) >= _MAX_TOKENS:
        return f"sequences of {_MAX_TOKENS} tokens or more"
    return None


def cuda_block_count(total_q: int, num_seqs: int) -> int:
    """The CUDA forward's block table's length (`FwdParams::blocks`): a bound on the 128-row
    blocks of its runs (each sequence's tokens, its tokens past `max_seqlen_q`, the tokens past
    the last sequence: `2 num_seqs + 1` runs of `total_q` tokens, each at most one block more
    than its whole blocks)."""
    return total_q // hopper.CUDA_FORWARD_ROWS + 2 * num_seqs + 1


def cuda_forward(cfg, q, k, v, q_offsets, kv_offsets, with_stats: bool = False):
    """`(out [1, Tq, Hq, D], lse, max, stats)` of packed sequences on attnaux's CUDA C++
    Hopper forward (`cuda_forward_unavailable` is None), the statistics per token `[1, Hq, Tq]`
    (cuDNN's ragged backward differentiates this: `_flash_cudnn`'s `Config.forward_kernel`
    with `ragged`). `cfg`: the GPU flash backend's `Config` (scale, causal, window,
    `max_seqlen_*`); q, k and v with a leading 1; `*_offsets` int32 `[n + 1]`, non-decreasing
    within the tokens (`_varlen._packing`'s), sequence i's lengths `min(span, max_seqlen_*)`.
    Every row is written: the tokens that no sequence covers (past a sequence's
    `max_seqlen_q`, past the last sequence) and the rows that see no key get out 0 and
    lse = max = -inf. `with_stats`: `stats` is the lse per sequence as cuDNN's ragged backward
    takes it, `[n, Hq, max_seqlen_q]`, +inf where a row sees no key (None without)."""
    r = _cuda_forward_results(cfg, q, k, v, q_offsets, kv_offsets, with_stats, False)
    return r["out"], r["lse"], r["max"], r.get("stats")


def cuda_forward_with_work(cfg, q, k, v, q_offsets, kv_offsets, with_work: bool):
    """`(out, lse, max, work)`: `cuda_forward`'s, with the kernel's work buffer when asked
    (`with_work`, else None): its block table and dQ tile bases, which `cuda_backward` takes in
    place of building its own when both sides have the same offsets (`PackedWork` in
    csrc/cuda/hopper_fwd_packed_table.cuh)."""
    r = _cuda_forward_results(cfg, q, k, v, q_offsets, kv_offsets, False, with_work)
    return r["out"], r["lse"], r["max"], r.get("work")


def _cuda_forward_results(cfg, q, k, v, q_offsets, kv_offsets, with_stats: bool,
                          with_work: bool) -> dict:
    op = _cuda_op(float(cfg.scale), int(cfg.causal), int(cfg.window_left),
                  int(cfg.window_right), int(cfg.max_seqlen_q), int(cfg.max_seqlen_kv),
                  bool(with_stats), bool(with_work))
    # (the keys past a sequence's end in its last key block, the next sequence's or padding,
    # have their V rows zeroed by the kernel, as 0 * NaN is NaN in the tensor cores: no
    # pass over V here)
    return op(q=q, k=k, v=v, q_offsets=q_offsets, kv_offsets=kv_offsets)


def cuda_varlen(q, k, v, q_offsets, kv_offsets, q_info, kv_info, cfg, options: Options):
    """`(out [Tq, Hq, D], lse [Hq, Tq], max [Hq, Tq])` of `varlen_attention`'s packed tokens:
    the forward on the CUDA C++ kernel (`cuda_forward`), differentiated by the Hopper kernels'
    packed backward (the visiting ranges of `q_info`/`kv_info`, `varlen_infos`), whose work,
    unlike cuDNN's ragged backward's grid, does not grow with `max_seqlen_*`
    (`_dispatch.GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD`). Both kernels write or visit only the
    rows of sequences: the rows no sequence covers get out 0, lse = max = -inf and zero
    gradients. `cfg`, offsets and availability as for `cuda_forward` and `varlen_unavailable`."""
    out, lse, row_max = _cuda_then_hopper(cfg, options, q[None], k[None], v[None], q_offsets,
                                          kv_offsets, q_info, kv_info)
    return out[0], lse[0], row_max[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cuda_then_hopper(cfg, options, q, k, v, q_offsets, kv_offsets, q_info, kv_info):
    out, lse, row_max, _ = cuda_forward(cfg, q, k, v, q_offsets, kv_offsets)
    return out, lse, row_max


def _cuda_then_hopper_fwd(cfg, options, q, k, v, q_offsets, kv_offsets, q_info, kv_info):
    out, lse, row_max, _ = cuda_forward(cfg, q, k, v, q_offsets, kv_offsets)
    return (out, lse, row_max), (q, k, v, q_info, kv_info, out, lse)


def _cuda_then_hopper_bwd(cfg, options, saved, cotangents):
    q, k, v, q_info, kv_info, out, lse = saved
    dout, dlse, _ = cotangents  # the row max has no gradient
    tokens_q, tokens_kv = q.shape[1], k.shape[1]
    # as `_call_fwd` prepares the Hopper kernels' own differentiated forward: tokens padded to
    # their multiple of 128, the padding tokens of q, k and v zeroed (NaN stored there must not
    # meet a zero probability or score gradient in a product)
    st, qp, kp, vp, infos, tabs, rng = _prepared(q, k, v, q_info, kv_info, options, clean=True)
    qp, kp, vp = _cleaned(qp, kp, vp, *infos)
    dq, dk, dv = _ops(st)[1](
        qp, kp, vp, *infos, *tabs, rng, _pad_tokens(out, 1), _pad_tokens(lse, 2),
        _pad_tokens(dout.astype(q.dtype), 1), _pad_tokens(dlse.astype(jnp.float32), 2))
    return (dq[:, :tokens_q], dk[:, :tokens_kv], dv[:, :tokens_kv], None, None, None, None)


_cuda_then_hopper.defvjp(_cuda_then_hopper_fwd, _cuda_then_hopper_bwd)


def _cuda_attrs(scale: float, causal: int, window_left: int, window_right: int, max_q: int,
                max_kv: int) -> dict:
    """The packed CUDA kernels' visibility attributes, as the dense forward's (the offsets are
    each sequence's), with the scale and the causal alignment."""
    window = None
    if window_left >= 0 or window_right >= 0:
        unbounded = max_q + max_kv
        window = (window_left if window_left >= 0 else unbounded,
                  window_right if window_right >= 0 else unbounded)
    geometry = hopper.Geometry(causal != 0, window, 0, max_kv, max_q)
    attrs = hopper._geometry_attrs(geometry)
    attrs = {name: attrs[name] for name in ("has_upper", "upper", "has_lower", "lower")}
    attrs.update(scale=np.float32(scale), bottom_right=np.int32(causal == 2))
    return attrs


@functools.cache
def _cuda_op(scale: float, causal: int, window_left: int, window_right: int, max_q: int,
             max_kv: int, with_stats: bool, with_work: bool = False):
    attrs = _cuda_attrs(scale, causal, window_left, window_right, max_q, max_kv)

    def shapes(ops):
        q = ops["q"]
        rows = jax.ShapeDtypeStruct((1, q.shape[2], q.shape[1]), jnp.float32)
        per_sequence = jax.ShapeDtypeStruct(
            (ops["q_offsets"].shape[0] - 1, q.shape[2], max_q) if with_stats else (0,),
            jnp.float32)
        work = _work_shape(q.shape[1], q.shape[1], ops["q_offsets"].shape[0] - 1)
        return (jax.ShapeDtypeStruct(q.shape, q.dtype), rows, rows, per_sequence, work)

    def kernel(q, k, v, q_offsets, kv_offsets):
        # (the block table is built on the device from the offsets, by the handler's first
        # kernel: csrc/cuda/hopper_fwd_packed_table.cuh)
        blocks = cuda_block_count(q.shape[1], q_offsets.shape[0] - 1)
        grid = max(1, min(hopper._sm_count(), blocks * q.shape[2]))
        out, lse, row_max, stats, work = jax.ffi.ffi_call(
            CUDA_FORWARD_TARGET, shapes(dict(q=q, q_offsets=q_offsets)))(
            q, k, v, q_offsets.astype(jnp.int32), kv_offsets.astype(jnp.int32),
            grid=np.int64(grid), block_count=np.int64(blocks), max_seqlen_q=np.int64(max_q),
            max_seqlen_kv=np.int64(max_kv), backward_tiles=np.int32(with_work), **attrs)
        return (out, lse, row_max) + ((stats,) if with_stats else ()) + (
            (work,) if with_work else ())

    names = ("q", "k", "v", "q_offsets", "kv_offsets")
    results = ("out", "lse", "max") + (("stats",) if with_stats else ()) + (
        ("work",) if with_work else ())
    keep = (0, 1, 2) + ((3,) if with_stats else ()) + ((4,) if with_work else ())
    return KernelOp(CUDA_FORWARD_TARGET, tuple((name, SHARED) for name in names), results,
                    lambda ops: tuple(shapes(ops)[i] for i in keep), {}, kernel=kernel,
                    sequential=True, layout=lambda name, shape: _CUDA_LAYOUTS[name])


def _work_shape(block_tokens: int, q_tokens: int, num_seqs: int) -> jax.ShapeDtypeStruct:
    """The packed handlers' int32 work buffer (`PackedWork`): the block table of `block_tokens`
    rows (the forward's queries, the backward's keys), the runs' first entries, the dQ tile
    bases, a tile counter, each dQ tile's sequence (`_dq_tiles` of them), the forward's order of
    the block table."""
    size = (12 * cuda_block_count(block_tokens, num_seqs) + 3 * num_seqs + 3
            + _dq_tiles(q_tokens, num_seqs))
    return jax.ShapeDtypeStruct((size,), jnp.int32)


def _dq_tiles(q_tokens: int, num_seqs: int) -> int:
    """A bound on the sequences' 64-row dQ tiles (`PackedDqTiles`): each at most one more than
    its whole tiles, and one at least a 64 tokens."""
    return q_tokens // hopper.BLOCK_Q + num_seqs + 1


# ---- the CUDA C++ backward over packed sequences (csrc/cuda/hopper_bwd_packed.cu)
CUDA_BACKWARD_TARGET = "attnaux_hopper_bwd_packed"
_CUDA_BACKWARD_LAYOUTS = {
    **_CUDA_LAYOUTS, "dout": ("one", "q_tokens", HEADS, "v_dim"),
    "dlse": ("one", HEADS, "q_tokens"), "forward_work": ("work_words",),
    "dq": ("one", "q_tokens", HEADS, "qk_dim"),
    "dk": ("one", "kv_tokens", KV_HEADS, "qk_dim"), "dv": ("one", "kv_tokens", KV_HEADS, "v_dim"),
}


def cuda_backward_unavailable(q, k, v, options: Options) -> str | None:
    """Why `varlen_attention`'s backward cannot run on attnaux's CUDA C++ kernel over the
    packed tokens (`cuda_backward`; None: it can): the CUDA forward's conditions
    (`cuda_forward_unavailable`), head dim 128, and XLA not asked for deterministic results
    (its dQ sums come in a varying order). `q`, `k`, `v`: `[tokens, heads, dim]`."""
    from ._ffi import has_target

    forward_no = cuda_forward_unavailable(q, k, v, options)
    if forward_no is not None:
        return forward_no
    if not has_target(CUDA_BACKWARD_TARGET, "gpu"):
        return "this build of attnaux has no CUDA C++ packed backward"
    if q.shape[-1] != 128:
        return f"it takes head dim 128 (got {q.shape[-1]})"
    if hopper.deterministic_requested():
        return ("XLA was asked for deterministic results (--xla_gpu_deterministic_ops), and its "
                "dQ sums come in a varying order")
    return None


def cuda_varlen_both(cfg, q, k, v, q_side, kv_side, shared_offsets: bool = False):
    """`(out [Tq, Hq, D], lse [Hq, Tq], max [Hq, Tq])` of `varlen_attention`'s packed tokens on
    attnaux's CUDA C++ kernels both ways: the forward (`cuda_forward`) and its own backward
    over the packed tokens (`cuda_backward`), neither padding nor gathering a token.
    `q_side`, `kv_side`: `_varlen`'s packings (offsets, lengths, each token's sequence and
    position, covered); `cfg` and availability as for `cuda_forward` and
    `cuda_backward_unavailable`. `shared_offsets`: both sides have the same offsets (one
    array: self-attention), so that the backward takes the forward's block table and dQ tile
    bases when the token counts and `max_seqlen_*` agree too. The rows no sequence covers get
    out 0, lse = max = -inf and zero gradients."""
    reuse = (shared_offsets and q.shape[0] == k.shape[0]
             and int(cfg.max_seqlen_q) == int(cfg.max_seqlen_kv))
    out, lse, row_max = _cuda_both((cfg, reuse), q[None], k[None], v[None], q_side.offsets,
                                   kv_side.offsets)
    return out[0], lse[0], row_max[0]


def _cuda_both_forward(static, differentiating, q, k, v, q_offsets, kv_offsets):
    cfg, reuse = static
    out, lse, row_max, work = cuda_forward_with_work(cfg, q, k, v, q_offsets, kv_offsets,
                                                     differentiating and reuse)
    return (out, lse, row_max), (q, k, v, q_offsets, kv_offsets, out, lse, work)


def _cuda_both_backward(static, saved, cotangents):
    cfg, _ = static
    q, k, v, q_offsets, kv_offsets, out, lse, work = saved
    dout, dlse, _ = cotangents  # the row max has no gradient; None: a symbolic zero
    if dout is None:  # (only lse is differentiated)
        dout = jnp.zeros(out.shape, q.dtype)
    dq, dk, dv = cuda_backward(cfg, q, k, v, out, lse, dout.astype(q.dtype),
                               None if dlse is None else dlse.astype(jnp.float32), q_offsets,
                               kv_offsets, work)
    return dq, dk, dv, None, None


# (symbolic zeros: no dense lse cotangent is built when the loss does not read lse)
_cuda_both = compiled_vjp(_cuda_both_forward, _cuda_both_backward)


def cuda_backward(cfg, q, k, v, out, lse, dout, dlse, q_offsets, kv_offsets, work=None):
    """`(dq, dk, dv)` of packed sequences (q, k, v, out, dout `[1, tokens, heads, dim]`; lse,
    dlse `[1, Hq, Tq]`, dlse None for none) on attnaux's CUDA C++ backward: each sequence's
    query tiles of 64 rows get dQ sums of their own, which the handler's last pass writes to
    the tokens' rows (0 for the tokens no sequence covers). `work`: the packed forward's work
    buffer (`cuda_forward_with_work`) of a call with the same offsets, token count and
    `max_seqlen` both sides, whose block table and tile bases the backward then takes, or None
    (the handler's first kernel builds them)."""
    op = _cuda_backward_op(float(cfg.scale), int(cfg.causal), int(cfg.window_left),
                           int(cfg.window_right), int(cfg.max_seqlen_q), int(cfg.max_seqlen_kv))
    if dlse is None:
        dlse = jnp.zeros((1, q.shape[2], 0), jnp.float32)
    if work is None:
        work = jnp.zeros((0,), jnp.int32)
    r = op(q=q, k=k, v=v, out=out, dout=dout, lse=lse, dlse=dlse, q_offsets=q_offsets,
           kv_offsets=kv_offsets, forward_work=work)
    return r["dq"], r["dk"], r["dv"]


@functools.cache
def _cuda_backward_op(scale: float, causal: int, window_left: int, window_right: int,
                      max_q: int, max_kv: int):
    attrs = _cuda_attrs(scale, causal, window_left, window_right, max_q, max_kv)
    attrs.update(max_seqlen_q=np.int64(max_q), max_seqlen_kv=np.int64(max_kv))

    def shapes(ops):
        q, k = ops["q"], ops["k"]
        return (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                jax.ShapeDtypeStruct(k.shape, k.dtype))

    def kernel(q, k, v, out, dout, lse, dlse, q_offsets, kv_offsets, forward_work):
        # (the key side's block table and the dQ tile bases are built on the device from the
        # offsets by the handler's first kernel, or taken from `forward_work`; the dQ sums,
        # the rows' statistics and the table are work buffers)
        n = q_offsets.shape[0] - 1
        tiles = _dq_tiles(q.shape[1], n)
        work = (jax.ShapeDtypeStruct((q.shape[2], tiles, 2, hopper.BLOCK_Q * q.shape[3] // 2),
                                     jnp.float32),
                jax.ShapeDtypeStruct((1, q.shape[2], 2, 64 * tiles), jnp.float32),
                _work_shape(k.shape[1], q.shape[1], n))
        dq, dk, dv, *_ = jax.ffi.ffi_call(
            CUDA_BACKWARD_TARGET, (*shapes(dict(q=q, k=k)), *work))(
            q, k, v, out, dout, lse, dlse, q_offsets.astype(jnp.int32),
            kv_offsets.astype(jnp.int32), forward_work.astype(jnp.int32),
            block_count=np.int64(cuda_block_count(k.shape[1], n)), **attrs)
        return dq, dk, dv

    names = ("q", "k", "v", "out", "dout", "lse", "dlse", "q_offsets", "kv_offsets",
             "forward_work")
    return KernelOp(CUDA_BACKWARD_TARGET, tuple((name, SHARED) for name in names),
                    ("dq", "dk", "dv"), shapes, {}, kernel=kernel, sequential=True,
                    layout=lambda name, shape: _CUDA_BACKWARD_LAYOUTS[name])
