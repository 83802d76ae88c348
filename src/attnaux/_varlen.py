"""`varlen_attention`: packed sequences in the ecosystem's layout (FlashAttention's varlen API).

`q` is `[total_q, q_heads, dim]`, `k`/`v` `[total_kv, kv_heads, dim]`, and sequence `i` holds
query tokens `cu_seqlens_q[i]:cu_seqlens_q[i + 1]` and key tokens `cu_seqlens_kv[i]:
cu_seqlens_kv[i + 1]`. These ways serve it, picked per call (`explain` says which):

- **packed** (GPU `flash`): the sequences are read in place, through cuDNN's ragged (THD)
  layout (`_flash_cudnn.ragged_attention_cuda`), attnaux's CUDA forward over the packed tokens
  or its Hopper kernels (`_hopper_packed`); nothing is padded (`_plan` says which when).
- **padded**: every other backend. The tokens are gathered into `[num_seqs, max_seqlen, heads,
  dim]` and the call runs with per-sequence lengths (`q_seqlens`/`kv_seqlens`), which the kernels
  honour exactly (rows past a length are never read; causal and window follow each sequence's
  own lengths), then the rows are gathered back. The kernels skip what lies past the lengths, so
  the work is that of the documents; the copies cost O(num_seqs x max_seqlen).
- **one packed row** (the CPU `flash` kernels, where `num_seqs x max_seqlen` would be more than
  `_dispatch.CPU_VARLEN_ROW_MIN_SAVING` times the row): the sequences in tile-aligned regions of
  one row with segment ids (see "One packed row" below); the copies cost O(tokens + num_seqs x
  a tile).

The offsets are data. Where they are concrete (not traced) they are checked and a bad value is an
error; under `jax.jit` they are made safe instead of checked: clamped into `[0, total]`, made
non-decreasing (a decrease gives empty sequences) and each length cut to `max_seqlen_*`, so no
kernel reads outside the arrays.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _dispatch, _flash_cudnn, _hopper_packed
from ._aux import AttnAux
from ._canon import canonicalize, check_key
from ._dispatch import Explanation, call_statics, choose
from ._kernel_call import add_sink
from ._masking import token_rows

__all__ = ["cu_seqlens_to_segment_ids", "segment_ids_to_cu_seqlens", "varlen_attention"]


class Packing(NamedTuple):
    """The safe offsets of one side (queries or keys) and where each token sits."""

    offsets: jax.Array  # int32 [n + 1]: clamped into [0, total] and non-decreasing
    lengths: jax.Array  # int32 [n]: each at most its span and max_seqlen
    seq: jax.Array  # int32 [total]: the sequence of each token (clipped to a valid index)
    pos: jax.Array  # int32 [total]: its row in that sequence (clipped into [0, max_seqlen))
    covered: jax.Array  # bool [total]: whether a sequence covers the token


def _packing(cu_seqlens: jax.Array, total: int, max_seqlen: int) -> Packing:
    clipped = jnp.clip(cu_seqlens.astype(jnp.int32), 0, total)
    m = clipped.shape[0]
    if m <= 1024:  # the running max as one fused pass (see token_rows)
        earlier = jnp.arange(m)[None, :] <= jnp.arange(m)[:, None]
        offsets = jnp.max(jnp.where(earlier, clipped[None, :], 0), axis=1, initial=0)
    else:
        offsets = jax.lax.cummax(clipped)
    lengths = jnp.minimum(offsets[1:] - offsets[:-1], max_seqlen)
    if lengths.shape[0] == 0:  # no sequences: every token is padding
        zeros = jnp.zeros((total,), jnp.int32)
        return Packing(offsets, lengths, zeros, zeros, jnp.zeros((total,), bool))
    seq, pos, covered = token_rows(offsets, lengths, total)
    return Packing(offsets, lengths, seq, jnp.clip(pos, 0, max_seqlen - 1), covered)


def _padded(x: jax.Array, side: Packing, max_seqlen: int) -> jax.Array:
    """`[n, max_seqlen, heads, dim]`: sequence i's tokens, then rows the kernels never read."""
    if x.shape[0] == 0:  # no tokens: every sequence is empty
        return jnp.zeros((side.lengths.shape[0], max_seqlen, *x.shape[1:]), x.dtype)
    rows = side.offsets[:-1, None] + jnp.arange(max_seqlen, dtype=jnp.int32)[None, :]
    return x[jnp.clip(rows, 0, x.shape[0] - 1)]


# ------------------------------------------------------------------------------------------------
# One packed row with segment ids (the CPU kernels, where padding to `max_seqlen` would be large)
# ------------------------------------------------------------------------------------------------
# Padding to `[num_seqs, max_seqlen]` costs `num_seqs x max_seqlen` rows, which under `jax.jit`
# (lengths are data, so `max_seqlen` is often a loose bound such as the tokens) can be many times
# the tokens. The CPU flash kernels skip, from per-tile ranges of segment ids, every tile pair of
# different segments, so the sequences can instead sit in one row: sequence i in a region of its
# own that starts at a tile boundary (so no tile holds two sequences, and a NaN in one sequence
# never meets another's rows in a product), its queries and keys placed so that the row's
# top-left causal diagonal is the sequence's own alignment (bottom-right: both sides end at the
# region's `span`). Segment ids keep every side sorted (what the per-tile ranges need): 3i for
# sequence i's tokens, 3i + 1 for the query rows of its region's gap and 3i + 2 for its key rows'
# gap (seen by no row), i = num_seqs after the last region.
ROW_TILE = 64  # the CPU flash kernels' tiles (kBlockQ = kBlockK, csrc/cpu/attention_tile.h)


def row_length(num_seqs: int, q_tokens: int, kv_tokens: int, max_seqlen_q: int,
               max_seqlen_kv: int, shared_offsets: bool = False) -> int:
    """A static bound on the packed row: each region is its sequence's longer side, rounded up
    to a tile. With the same offsets on both sides (`shared_offsets`) the longer sides of the
    sequences lie within the longer side's tokens."""
    tokens = max(q_tokens, kv_tokens) if shared_offsets else q_tokens + kv_tokens
    spans = min(tokens, num_seqs * max(max_seqlen_q, max_seqlen_kv))
    return -(-(spans + num_seqs * (ROW_TILE - 1)) // ROW_TILE) * ROW_TILE


class _Row(NamedTuple):
    """Where the tokens sit in the packed row: a partial one-to-one map both ways."""

    q_dest: jax.Array  # int32 [total_q]: each token's row (any value where not covered)
    q_src: jax.Array  # int32 [length]: each row's token (any value where not `q_taken`)
    kv_dest: jax.Array  # int32 [total_kv]
    kv_src: jax.Array  # int32 [length]
    q_ids: jax.Array  # int32 [length]: segment ids of the row's queries (3i: a token's)
    kv_ids: jax.Array  # int32 [length]
    q_taken: jax.Array  # bool [length]: the row holds a token (`q_src` is one)
    kv_taken: jax.Array  # bool [length]


def _row_layout(pq: Packing, pk: Packing, bottom_right: bool, length: int) -> _Row:
    lq, lkv = pq.lengths, pk.lengths
    span = jnp.maximum(lq, lkv)
    region = -(-span // ROW_TILE) * ROW_TILE
    ends = jnp.cumsum(region)
    starts = ends - region
    q_start = starts + span - lq if bottom_right else starts
    kv_start = starts + span - lkv if bottom_right else starts
    rows = jnp.arange(length, dtype=jnp.int32)
    # each row's region (num_seqs after the last): a comparison with every end for up to 256
    # sequences, a sort beyond
    owner = jnp.searchsorted(ends, rows, side="right",
                             method="compare_all" if ends.shape[0] <= 256 else "sort")
    seq = jnp.minimum(owner, lq.shape[0] - 1)

    def side(start, lengths, offsets, gap):
        local = rows - start[seq]
        taken = (owner < lq.shape[0]) & (local >= 0) & (local < lengths[seq])
        ids = jnp.where(taken, 3 * owner, 3 * owner + gap).astype(jnp.int32)
        return (offsets[seq] + local).astype(jnp.int32), ids, taken

    q_src, q_ids, q_taken = side(q_start, lq, pq.offsets, 1)
    kv_src, kv_ids, kv_taken = side(kv_start, lkv, pk.offsets, 2)
    q_dest = (q_start[pq.seq] + pq.pos).astype(jnp.int32)
    kv_dest = (kv_start[pk.seq] + pk.pos).astype(jnp.int32)
    return _Row(q_dest, q_src, kv_dest, kv_src, q_ids, kv_ids, q_taken, kv_taken)


@jax.custom_vjp
def _moved(x, src, src_taken, back, back_taken):
    """`y[r] = x[src[r]]` where `src_taken[r]`, else 0, for a map that is one-to-one where taken
    and whose inverse is `(back, back_taken)`: the gradient is the same gather the other way
    (XLA's scatter, the transpose it would take, measured ~2x the gather's time on the CPU)."""
    return _gather_rows(x, src, src_taken)


def _gather_rows(x, index, taken):
    rows = x[jnp.clip(index, 0, x.shape[0] - 1)]
    return jnp.where(taken.reshape(-1, *(1,) * (x.ndim - 1)), rows, jnp.zeros((), x.dtype))


def _moved_fwd(x, src, src_taken, back, back_taken):
    return _gather_rows(x, src, src_taken), (back, back_taken)


def _moved_bwd(saved, dy):
    back, back_taken = saved
    return _gather_rows(dy, back, back_taken), None, None, None, None


_moved.defvjp(_moved_fwd, _moved_bwd)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------
def _static_int(name: str, value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be a static Python int; got {value!r}.")
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1; got {value}.")
    return int(value)


def _check_arrays(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"`{name}` must be [total_tokens, heads, dim]; got shape "
                             f"{getattr(x, 'shape', type(x).__name__)}.")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"`k` and `v` must share [total_kv, kv_heads]; got k {k.shape} and "
                         f"v {v.shape}.")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"`q` and `k` must share the head dim; got q {q.shape} and k {k.shape}.")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"`q`'s heads must be a multiple of `k`'s (GQA); got q {q.shape} and "
                         f"k {k.shape}.")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
        if getattr(cu, "ndim", None) != 1 or cu.shape[0] < 1:
            raise ValueError(f"`{name}` must be int32 [num_seqs + 1]; got shape "
                             f"{getattr(cu, 'shape', type(cu).__name__)}.")
        if jnp.dtype(cu.dtype) != jnp.int32:
            raise TypeError(f"`{name}` must be int32 [num_seqs + 1]; got {jnp.dtype(cu.dtype)}.")
    if cu_seqlens_q.shape != cu_seqlens_kv.shape:
        raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_kv` must hold the same number of "
                         f"sequences; got {cu_seqlens_q.shape} and {cu_seqlens_kv.shape}.")
    for name, cu, total, most in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
        ("cu_seqlens_kv", cu_seqlens_kv, k.shape[0], max_seqlen_kv),
    ):
        if isinstance(cu, jax.core.Tracer):
            continue  # data: made safe, not checked (module docstring)
        values = np.asarray(cu).astype(np.int64)
        side = "q" if name.endswith("_q") else "k"
        if values[0] != 0:
            raise ValueError(f"`{name}` must start at 0; got {values[0]}.")
        steps = np.diff(values)
        if (steps < 0).any():
            i = int(np.argmax(steps < 0))
            raise ValueError(f"`{name}` must be non-decreasing; got {values[i]} then "
                             f"{values[i + 1]} at index {i}.")
        if values[-1] > total:
            raise ValueError(f"`{name}` ends at {values[-1]}, past the {total} tokens of "
                             f"`{side}`.")
        if steps.size and steps.max() > most:
            i = int(np.argmax(steps))
            raise ValueError(f"sequence {i} has {steps[i]} tokens in `{name}`, more than "
                             f"`max_seqlen_{name.split('_')[-1]}={most}`.")


# ------------------------------------------------------------------------------------------------
# The call
# ------------------------------------------------------------------------------------------------
def _plan(q, k, v, cu_q, cu_kv, sink, key, *, statics, max_seqlen_q, max_seqlen_kv,
          return_probs, backend, shared_offsets=False):
    """`(problem, choice, mode, explanation, (q packing, kv packing, row map))`: the problem, the
    dispatch's choice for it, how the packed tokens are served (`"hopper"`: in place on
    attnaux's Hopper kernels; `"ragged"`: cuDNN's packed layout; `"cuda"`: attnaux's CUDA
    forward over the packed tokens and cuDNN's packed backward; `"cuda-hopper"`: that forward
    and the Hopper kernels' packed backward; `"cuda-cuda"`: that forward and attnaux's CUDA
    backward over the packed tokens; `"padded"`; `"row"`: one packed row on the CPU
    kernels, the problem then that row's), and the explanation with that way (`packed`)."""
    pq = _packing(cu_q, q.shape[0], max_seqlen_q)
    pk = _packing(cu_kv, k.shape[0], max_seqlen_kv)
    problem = canonicalize(
        _padded(q, pq, max_seqlen_q), _padded(k, pk, max_seqlen_kv),
        _padded(v, pk, max_seqlen_kv), statics, q_seqlens=pq.lengths, kv_seqlens=pk.lengths,
        sink=sink, key=key,
    )
    choice = choose(problem, backend, return_probs)
    to_tokens = None  # mode "row": the map (`_moved`'s) from the packed row back to the tokens
    ragged_no = hopper_no = "only the GPU `flash` backend reads packed sequences in place"
    gpu_flash = (choice.implementation in (_dispatch.implementation("flash", "gpu"),
                                           _dispatch.FLASH_HOPPER_FORWARD)
                 and not return_probs)
    if gpu_flash:
        hopper_no = (_hopper_packed.varlen_unavailable(q, k, v, problem.options)
                     if _dispatch.GPU_PACKED_ON_HOPPER else "GPU_PACKED_ON_HOPPER is off")
        ragged_no = _flash_cudnn.ragged_unavailable(
            problem.options, q.dtype, cu_q.shape[0] - 1, q.shape[0], k.shape[0], q.shape[1],
            k.shape[1], q.shape[2], v.shape[2], max_seqlen_q, max_seqlen_kv, "gpu",
        )
    spread = _dispatch.cudnn_backward_spread(cu_q.shape[0] - 1, max_seqlen_q, max_seqlen_kv,
                                             q.shape[0], k.shape[0])
    spread_high = spread > _dispatch.GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD
    spread_why = (f"cuDNN's ragged backward would launch {spread:.1f}x the 128-row tiles the "
                  f"tokens fill (num_seqs x the tiles of max_seqlen_*; above "
                  f"GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD="
                  f"{_dispatch.GPU_VARLEN_CUDNN_BACKWARD_MAX_SPREAD:g})")
    both_no = "GPU_VARLEN_CUDA_BACKWARD is off"  # attnaux's CUDA kernels both ways
    if not gpu_flash:
        both_no = "only GPU `flash` runs attnaux's CUDA kernels"
    elif not _dispatch.GPU_VARLEN_CUDA_FORWARD:
        both_no = "GPU_VARLEN_CUDA_FORWARD is off"
    elif _dispatch.GPU_VARLEN_CUDA_BACKWARD:
        if max_seqlen_q < _dispatch.GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ:
            both_no = (f"max_seqlen_q={max_seqlen_q} is below GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ="
                       f"{_dispatch.GPU_VARLEN_CUDA_BACKWARD_MIN_SEQ}")
        else:
            both_no = _hopper_packed.cuda_backward_unavailable(q, k, v, problem.options)
    cuda_no = "cuDNN's ragged layout does not serve this call"
    if ragged_no is None:
        if not _dispatch.GPU_VARLEN_CUDA_FORWARD:
            cuda_no = "GPU_VARLEN_CUDA_FORWARD is off"
        elif max_seqlen_q < _dispatch.GPU_VARLEN_CUDA_FORWARD_MIN_SEQ:
            least = _dispatch.GPU_VARLEN_CUDA_FORWARD_MIN_SEQ
            cuda_no = (f"max_seqlen_q={max_seqlen_q} is below GPU_VARLEN_CUDA_FORWARD_MIN_SEQ="
                       f"{least}, where cuDNN's forward measured as fast")
        else:
            cuda_no = _hopper_packed.cuda_forward_unavailable(q, k, v, problem.options)
    prefers = "GPU_VARLEN_PREFERS_HOPPER is on"  # (why not, where nothing else says)
    if both_no is None and not _dispatch.GPU_VARLEN_PREFERS_HOPPER:
        mode = "cuda-cuda"
        how = ("in place on attnaux's CUDA C++ Hopper kernels both ways (one packed row; the "
               "forward visits only the tiles of each sequence, the backward the key blocks of "
               "each sequence against its own query tiles); nothing is padded")
        choice = choice._replace(implementation=_dispatch.CUDA_PACKED)
    elif (hopper_no is None and cuda_no is None and spread_high
            and not _dispatch.GPU_VARLEN_PREFERS_HOPPER):
        mode = "cuda-hopper"
        how = ("in place: the forward on attnaux's CUDA C++ Hopper kernel (one packed row, "
               "only the tiles of each sequence), the backward on attnaux's Hopper kernels "
               "(one packed row, visiting only the tiles whose sequences meet): " + spread_why
               + f"; nothing is padded (attnaux's CUDA backward: {both_no or prefers})")
        choice = choice._replace(implementation=_dispatch.HOPPER_PACKED)
    elif hopper_no is None and (_dispatch.GPU_VARLEN_PREFERS_HOPPER or ragged_no is not None
                                or spread_high):
        mode = "hopper"
        how = ("in place on attnaux's Hopper kernels: one packed row, visiting only the tiles "
               "whose sequences meet; nothing is padded")
        if ragged_no is not None:
            how += f" (cuDNN's ragged layout: {ragged_no})"
        elif spread_high and not _dispatch.GPU_VARLEN_PREFERS_HOPPER:
            how += f" ({spread_why}; attnaux's CUDA forward: {cuda_no})"
        choice = choice._replace(implementation=_dispatch.HOPPER_PACKED)
    elif ragged_no is None:
        mode = "ragged"
        how = "in place through cuDNN's ragged (THD) layout: nothing is padded"
        if cuda_no is None:
            mode = "cuda"
            how = ("in place: the forward on attnaux's CUDA C++ Hopper kernel (one packed row, "
                   "only the tiles of each sequence), the backward through cuDNN's ragged "
                   f"(THD) layout; nothing is padded (attnaux's CUDA backward: "
                   f"{both_no or prefers})")
        elif gpu_flash:
            how += (" (attnaux's Hopper kernels: " + (
                hopper_no or "measured slower here, GPU_VARLEN_PREFERS_HOPPER") + "; attnaux's "
                "CUDA forward: " + cuda_no + ")")
    else:
        mode = "padded"
        how = (f"padded to [num_seqs, max_seqlen] with per-sequence lengths (the kernels skip "
               f"the padding; the copies are O(num_seqs x max_seqlen)): {ragged_no}")
        n = cu_q.shape[0] - 1
        length = row_length(n, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_kv,
                            shared_offsets)
        padded_rows = n * max(max_seqlen_q, max_seqlen_kv)
        if (choice.implementation is _dispatch.implementation("flash", "cpu")
                and min(q.shape[0], k.shape[0]) > 0  # (else no row sees a key: answered apart)
                and problem.options.dropout_rate == 0 and not return_probs
                and padded_rows > _dispatch.CPU_VARLEN_ROW_MIN_SAVING * length):
            mode = "row"
            causal = problem.options.causal
            row = _row_layout(pq, pk, causal == 2, length)
            statics = statics._replace(causal=1 if causal else 0)
            to_q = (row.q_src, row.q_taken, row.q_dest, pq.covered)
            to_kv = (row.kv_src, row.kv_taken, row.kv_dest, pk.covered)
            problem = canonicalize(
                _moved(q, *to_q)[None], _moved(k, *to_kv)[None], _moved(v, *to_kv)[None],
                statics, q_segment_ids=row.q_ids[None], kv_segment_ids=row.kv_ids[None],
                sink=sink, key=key)
            choice = choose(problem, backend, return_probs)
            to_tokens = (row.q_dest, pq.covered, row.q_src, row.q_taken)
            how = (f"in one packed row of {length} tokens with segment ids (each sequence in a "
                   f"region of its own from a {ROW_TILE}-token tile; the kernels skip the tiles "
                   f"of other sequences): padding to [num_seqs, max_seqlen] would have made "
                   f"{padded_rows} rows a side ({ragged_no})")
    explanation = dataclasses.replace(
        choice.explanation, packed=how,
        implementation=choice.implementation.description)
    return problem, choice, mode, explanation, (pq, pk, to_tokens)


@functools.partial(jax.jit, static_argnames=("statics", "max_seqlen_q", "max_seqlen_kv",
                                             "return_probs", "backend", "shared_offsets"))
def _varlen_jit(q, k, v, cu_q, cu_kv, sink, key, *, statics, max_seqlen_q, max_seqlen_kv,
                return_probs, backend, shared_offsets):
    problem, choice, mode, explanation, (pq, pk, to_tokens) = _plan(
        q, k, v, cu_q, cu_kv, sink, key, statics=statics, max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv, return_probs=return_probs, backend=backend,
        shared_offsets=shared_offsets,
    )
    arrays, options = problem.arrays, problem.options
    n = cu_q.shape[0] - 1
    probs = None
    if n == 0 or q.shape[0] == 0 or k.shape[0] == 0:  # no query sees a key
        out = jnp.zeros((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
        lse = row_max = jnp.full((q.shape[1], q.shape[0]), -jnp.inf, jnp.float32)
        if sink is not None:  # covered rows: lse = sink (a row with no visible key)
            lse = jnp.where(pq.covered[None, :], sink.astype(jnp.float32)[:, None], lse)
        if return_probs:
            probs = jnp.zeros((n, q.shape[1], max_seqlen_q, max_seqlen_kv), q.dtype)
    else:
        if mode == "cuda-cuda":
            out, lse_pad, max_pad = _hopper_packed.cuda_varlen_both(
                _flash_cudnn.ragged_config(options, max_seqlen_q, max_seqlen_kv), q, k, v, pq,
                pk, shared_offsets)
        elif mode == "cuda-hopper":
            q_info, kv_info = _hopper_packed.varlen_infos(
                pq.seq, pq.pos, pq.covered, pk.seq, pk.pos, pk.covered, pq.lengths,
                pk.lengths, pk.offsets, options)
            out, lse_pad, max_pad = _hopper_packed.cuda_varlen(
                q, k, v, pq.offsets, pk.offsets, q_info, kv_info,
                _flash_cudnn.ragged_config(options, max_seqlen_q, max_seqlen_kv), options)
        elif mode == "hopper":
            out, lse_t, max_t = _hopper_packed.varlen(
                q, k, v, pq.seq, pq.pos, pq.covered, pk.seq, pk.pos, pk.covered, pq.lengths,
                pk.lengths, pk.offsets, options, sink)
        elif mode in ("ragged", "cuda"):
            vis = _flash_cudnn._visible_rows(
                _flash_cudnn.ragged_config(options, max_seqlen_q, max_seqlen_kv), pq.lengths,
                pk.lengths, max_seqlen_q)
            q_keep = pq.covered & vis[pq.seq, pq.pos]
            out, lse_pad, max_pad = _flash_cudnn.ragged_attention_cuda(
                q, k, v, q_offsets=pq.offsets, kv_offsets=pk.offsets, q_len=pq.lengths,
                kv_len=pk.lengths, q_keep=q_keep, kv_keep=pk.covered, options=options,
                max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                forward_kernel=_hopper_packed.cuda_forward if mode == "cuda" else None,
            )
        else:
            out_pad, lse_pad, max_pad, probs = choice.implementation.module.run(
                arrays, options, return_probs
            )
            if mode == "row":
                out = _moved(out_pad[0], *to_tokens)
                lse_t, max_t = (_moved(x[0].T, *to_tokens).T for x in (lse_pad, max_pad))
            else:
                out = jnp.where(pq.covered[:, None, None], out_pad[pq.seq, pq.pos], 0)
        hidden = ~pq.covered[None, :]
        if mode in ("cuda", "cuda-hopper", "cuda-cuda"):  # per token, uncovered at -inf already
            lse, row_max = lse_pad, max_pad
        else:
            if mode not in ("hopper", "row"):
                lse_t, max_t = lse_pad[pq.seq, :, pq.pos].T, max_pad[pq.seq, :, pq.pos].T
            lse = jnp.where(hidden, -jnp.inf, lse_t)
            row_max = jnp.where(hidden, -jnp.inf, max_t)
        if mode in ("ragged", "cuda", "cuda-hopper", "cuda-cuda") and sink is not None:
            # (the other modes applied it)
            out, lse_sink = add_sink(out[None], lse[None], sink)
            out, lse = out[0], jnp.where(hidden, -jnp.inf, lse_sink[0])
    aux = AttnAux(
        lse=lse, max=jax.lax.stop_gradient(row_max), probs=probs, rng_state=arrays.rng_state,
        backend=explanation.backend, dropout_impl=explanation.dropout_impl,
    )
    return out, aux


def _prepare(q, k, v, options: dict):
    """Validates `varlen_attention`'s arguments; returns `(cu_q, cu_kv, sink, key, statics)`."""
    options = dict(options)
    names = ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")
    missing = [name for name in names if options.get(name) is None]
    if missing:
        raise TypeError(f"varlen_attention needs the keyword arguments {missing}.")
    cu_q, cu_kv, max_q, max_kv = (options.pop(name) for name in names)
    max_q, max_kv = _static_int("max_seqlen_q", max_q), _static_int("max_seqlen_kv", max_kv)
    shared = cu_q is cu_kv  # the same offsets both sides (self-attention): a shorter packed row
    cu_q, cu_kv = (x if isinstance(x, jax.Array) else np.asarray(x) for x in (cu_q, cu_kv))
    if not shared and not any(isinstance(x, jax.core.Tracer) for x in (cu_q, cu_kv)):
        shared = cu_q.shape == cu_kv.shape and bool(np.array_equal(cu_q, cu_kv))
    _check_arrays(q, k, v, cu_q, cu_kv, max_q, max_kv)
    statics = call_statics(
        options.pop("scale", None), options.pop("causal", False), options.pop("window", None),
        options.pop("softcap", None), options.pop("dropout_rate", 0.0),
        options.pop("return_probs", False), options.pop("backend", "auto"),
    )
    sink, key = options.pop("sink", None), options.pop("key", None)
    if options:
        raise TypeError(f"varlen_attention got unknown options {sorted(options)}; masks, "
                        "biases, lengths and segment ids are what cu_seqlens express.")
    if key is not None:
        check_key(key)
    return cu_q, cu_kv, sink, key, dict(statics, max_seqlen_q=max_q, max_seqlen_kv=max_kv,
                                        shared_offsets=shared)


def _varlen_mods(q, k, v, cu_q, cu_kv, sink, key, *, statics, max_seqlen_q, max_seqlen_kv,
                 return_probs, backend, score_mod, mask_mod):
    """`varlen_attention` with `score_mod`/`mask_mod`: the sequences padded to `[num_seqs,
    max_seqlen]` (so the functions see the sequence as `batch` and positions within it as
    `q_idx`/`kv_idx`), the flex (or reference) backend, and the rows gathered back."""
    from ._mods import attention_with_mods

    pq = _packing(cu_q, q.shape[0], max_seqlen_q)
    pk = _packing(cu_kv, k.shape[0], max_seqlen_kv)
    out_pad, aux = attention_with_mods(
        _padded(q, pq, max_seqlen_q), _padded(k, pk, max_seqlen_kv),
        _padded(v, pk, max_seqlen_kv), statics=statics, score_mod=score_mod, mask_mod=mask_mod,
        bias=None, mask=None, q_seqlens=pq.lengths, kv_seqlens=pk.lengths, q_segment_ids=None,
        kv_segment_ids=None, sink=sink, key=key, return_probs=return_probs, backend=backend)
    hidden = ~pq.covered[None, :]
    out = jnp.where(pq.covered[:, None, None], out_pad[pq.seq, pq.pos], 0)
    lse = jnp.where(hidden, -jnp.inf, aux.lse[pq.seq, :, pq.pos].T)
    row_max = jnp.where(hidden, -jnp.inf, aux.max[pq.seq, :, pq.pos].T)
    return out, AttnAux(lse=lse, max=row_max, probs=aux.probs, rng_state=aux.rng_state,
                        backend=aux.backend, dropout_impl=aux.dropout_impl)


def varlen_attention(q, k, v, **options) -> tuple[jax.Array, AttnAux]:
    """Attention within each of the sequences packed into `q`, `k` and `v`, with its statistics.

    FlashAttention's varlen layout: sequence `i` is query tokens `cu_seqlens_q[i]` to
    `cu_seqlens_q[i + 1]` and key tokens `cu_seqlens_kv[i]` to `cu_seqlens_kv[i + 1]` (separate
    offsets, so cross-attention between packed documents works too); every option applies to
    each sequence on its own (its own causal alignment, window, sink and dropout).

    **Arguments:**

    - `q`: `[total_q, q_heads, qk_dim]`; `k`: `[total_kv, kv_heads, qk_dim]`; `v`: `[total_kv,
      kv_heads, v_dim]`; `q_heads` a multiple of `kv_heads` (GQA).
    - `cu_seqlens_q`, `cu_seqlens_kv`: int32 `[num_seqs + 1]`, from 0, non-decreasing, at most
      the number of tokens. The number of sequences is static; the offsets are data. Tokens past
      the last offset are padding. Concrete offsets are checked (a clear error); traced ones are
      clamped so that no sequence leaves the arrays or exceeds `max_seqlen_*`.
    - `max_seqlen_q`, `max_seqlen_kv`: static ints, a bound on each side's sequences (the
      longest one where it is known; under `jit`, where lengths are data, a looser bound such
      as the number of tokens works: on CPU a much looser one lays the sequences out in one
      packed row instead of padding each to it, and on GPU it moves the backward off cuDNN's
      grid, whose size follows it, onto attnaux's Hopper kernels; docs/varlen.md).
    - `scale`, `causal` (`True`/`"top_left"` or `"bottom_right"`, per sequence), `window`,
      `softcap`, `sink`, `dropout_rate`, `key`, `return_probs`, `backend`: as in
      [`attnaux.attention`][].
    - `score_mod`, `mask_mod`: as in [`attnaux.attention`][], with `batch` the sequence's index
      and `q_idx`, `kv_idx` positions within the sequence (the `flex` backend on the sequences
      padded to `max_seqlen`).

    **Returns:**

    `(out, aux)`: `out` `[total_q, q_heads, v_dim]`; `aux.lse` and `aux.max` float32 `[q_heads,
    total_q]`. Padding tokens get output 0, `lse = max = -inf` and zero gradients. With
    `return_probs=True`, `aux.probs` is `[num_seqs, q_heads, max_seqlen_q, max_seqlen_kv]`, each
    sequence's probabilities from row and column 0. The dropout keep-mask of a call is that of
    the same sequences padded to `[num_seqs, max_seqlen, heads, dim]`:
    `introspect.dropout_mask(aux, q_padded, k_padded, dropout_rate=...)` replays it with arrays
    (or zeros) of those shapes.

    Works under `jax.jit`, `jax.grad` and `jax.vmap`. [`attnaux.explain`][] with the same
    arguments says which backend runs and whether the sequences are read in place (GPU `flash`:
    cuDNN's ragged layout) or padded per sequence.
    """
    options = dict(options)
    score_mod, mask_mod = options.pop("score_mod", None), options.pop("mask_mod", None)
    backend = options.get("backend", "auto")
    if score_mod is not None or mask_mod is not None:
        options["backend"] = "auto"  # checked by the flex entry instead
    cu_q, cu_kv, sink, key, statics = _prepare(q, k, v, options)
    if score_mod is not None or mask_mod is not None:
        return _varlen_mods(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_kv), sink, key,
                            statics=statics["statics"], max_seqlen_q=statics["max_seqlen_q"],
                            max_seqlen_kv=statics["max_seqlen_kv"],
                            return_probs=statics["return_probs"], backend=backend,
                            score_mod=score_mod, mask_mod=mask_mod)
    return _varlen_jit(q, k, v, cu_q, cu_kv, sink, key, **statics)


def explain_varlen(q, k, v, **options) -> Explanation:
    """`explain` for `varlen_attention`'s arguments (called by `attnaux.explain`)."""
    options = dict(options)
    score_mod, mask_mod = options.pop("score_mod", None), options.pop("mask_mod", None)
    if score_mod is not None or mask_mod is not None:
        return _explain_varlen_mods(q, k, v, options, score_mod, mask_mod)
    cu_q, cu_kv, sink, key, statics = _prepare(q, k, v, options)
    result: list[Explanation] = []

    def trace(q, k, v, cu_q, cu_kv, sink, key):
        result.append(_plan(q, k, v, cu_q, cu_kv, sink, key, **statics)[3])
        return 0

    jax.eval_shape(trace, q, k, v, cu_q, cu_kv, sink, key)
    return result[0]


def _explain_varlen_mods(q, k, v, options, score_mod, mask_mod) -> Explanation:
    from ._mods import choose_with_rules

    backend = options.get("backend", "auto")
    options["backend"] = "auto"
    cu_q, cu_kv, sink, key, statics = _prepare(q, k, v, options)
    result: list[Explanation] = []

    def trace(q, k, v, cu_q, cu_kv, sink, key):
        pq = _packing(cu_q, q.shape[0], statics["max_seqlen_q"])
        pk = _packing(cu_kv, k.shape[0], statics["max_seqlen_kv"])
        problem = canonicalize(
            _padded(q, pq, statics["max_seqlen_q"]), _padded(k, pk, statics["max_seqlen_kv"]),
            _padded(v, pk, statics["max_seqlen_kv"]), statics["statics"],
            q_seqlens=pq.lengths, kv_seqlens=pk.lengths, sink=sink, key=key)
        c = choose_with_rules(problem, score_mod, mask_mod, backend, None, None,
                              statics["return_probs"])[0]
        result.append(Explanation(
            backend=c.backend, implementation=c.implementation, platform=jax.default_backend(),
            reasons=c.reasons, packed="padded to [num_seqs, max_seqlen] with per-sequence lengths "
            "(score_mod/mask_mod see the sequence as batch and positions within it)"))
        return 0

    jax.eval_shape(trace, q, k, v, cu_q, cu_kv, sink, key)
    return result[0]


# ------------------------------------------------------------------------------------------------
# Segment ids <-> cu_seqlens
# ------------------------------------------------------------------------------------------------
def segment_ids_to_cu_seqlens(segment_ids, *, max_segments: int, padding_id: int | None = None):
    """`cu_seqlens` int32 `[max_segments + 1]` of the runs of equal ids in a packed row.

    `segment_ids`: `int[total]`, each document one run of equal ids (ids need not be sorted or
    distinct between runs: every change of id starts a new sequence). Tokens with `padding_id`
    (if given) are left uncovered; they must come after the documents (offsets describe
    contiguous spans). `max_segments` is the static number of
    sequences: unused ones are empty (their offsets repeat the end), and a row with more runs
    than `max_segments` raises where the ids are concrete; traced, the runs past the bound are
    left uncovered (padding). Works under jit.
    """
    max_segments = _static_int("max_segments", max_segments)
    ids = jnp.asarray(segment_ids)
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"`segment_ids` must be int [total]; got {ids.dtype} {ids.shape}.")
    total = ids.shape[0]
    real = jnp.ones((total,), bool) if padding_id is None else ids != padding_id
    starts = real & jnp.concatenate([jnp.ones((min(total, 1),), bool), ids[1:] != ids[:-1]])
    run = jnp.cumsum(starts) - 1  # the run index of every token
    if not isinstance(ids, jax.core.Tracer) and total:
        runs = int(np.asarray(starts).sum())
        if runs > max_segments:
            raise ValueError(f"`segment_ids` holds {runs} runs, more than "
                             f"`max_segments={max_segments}`.")
    t = jnp.arange(total, dtype=jnp.int32)
    end = jnp.max(jnp.where(real & (run < max_segments), t + 1, 0), initial=0).astype(jnp.int32)
    # offset of run r = index of its first token; runs that do not exist start at `end`
    first = jnp.full((max_segments,), end, jnp.int32)
    first = first.at[jnp.where(starts, run, max_segments)].min(
        t, mode="drop")
    return jnp.concatenate([first, end[None]]).astype(jnp.int32)


def cu_seqlens_to_segment_ids(cu_seqlens, total: int, *, padding_id: int = -1):
    """`int32[total]`: the sequence index of every token under `cu_seqlens`, `padding_id` for
    tokens that no sequence covers. Works under jit (`total` static)."""
    total = int(total)
    cu = jnp.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"`cu_seqlens` must be int32 [num_seqs + 1]; got shape {cu.shape}.")
    n = cu.shape[0] - 1
    if n == 0:
        return jnp.full((total,), padding_id, jnp.int32)
    offsets = jax.lax.cummax(jnp.clip(cu.astype(jnp.int32), 0, total))
    seq, _, covered = token_rows(offsets, offsets[1:] - offsets[:-1], total)
    return jnp.where(covered, seq, padding_id).astype(jnp.int32)
