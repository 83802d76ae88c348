"""The `flex` path as a block backend of context parallelism (`attnaux.parallel`, `backend="flex"`).

Blockwise attention in JAX, compiled by XLA on any platform (`_flex`), given a block of a larger
problem: the 12-word block state's diagonal shift places the causal and window rules at global
positions (`_masking.visibility`), and its origin puts the dropout counter at the block's place
in the whole problem, so a sharded call draws the unsharded call's keep-mask (attnaux's
documented generator). This is what serves dropout under context parallelism on GPU, where
cuDNN's generator cannot follow a block and attnaux's Hopper kernels draw no mask; it is exact,
and slower than the fused kernels (a few XLA operations per tile).

Every tile of a block is visited (the shift is data, so no static table can skip by the
geometry; the ring already skips blocks that are wholly hidden).
"""

import jax.numpy as jnp

from ._canon import Canonical, Options
from ._flex import _flex_backward, _Static, block_table, convert
from ._flex import run as _flex_run

FOLLOWS_BLOCK_STATE = True


def _static(options: Options, arrays: Canonical) -> _Static:
    mods, _ = convert(None, None)
    bsz, q_seq, q_heads, _ = arrays.q.shape
    kv_seq = arrays.k.shape[1]
    every_tile = options._replace(causal=0, window_left=-1, window_right=-1)
    table = block_table(mods, (), every_tile, bsz, q_heads, q_seq, kv_seq)
    return _Static(options, mods, table, q_seq, kv_seq)


def run(arrays: Canonical, options: Options, return_probs: bool):
    """`(out, lse, max, None)` of one block (the ring's forward call)."""
    del return_probs
    st = _static(options, arrays)
    return (*_flex_run(arrays, options, st.mods, (), st.table), None)


def block_backward(arrays: Canonical, options: Options, out, lse, dout, dlse):
    """`(dq, dk, dv)` of one block from the whole problem's `out` and `lse`."""
    st = _static(options, arrays)
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0).astype(jnp.float32)
    dq, dk, dv, _ = _flex_backward(st, arrays, (), out, lse, dout, dlse)
    return dq, dk, dv
