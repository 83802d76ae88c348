"""A pure-JAX stand-in for the Hopper kernels (`_flash_hopper.forward` and `backward`), so that
what wraps them runs and is checked on CPU: `_hopper_packed` (padding, token infos, tables,
partitioning over devices, vmap folding, the custom VJP) and `_hopper_mods` (score_mod/mask_mod:
the tile function, per-row and per-column inputs, block tables, the same wrapping). It computes
what the kernels compute, densely in float32:

- packed geometry: visibility from the same token infos (`_flash_hopper._packed_visible`);
- otherwise: the scores after scale and softcap, then the tile function (given the batch and
  head index from `indices` where they come, as the kernels do; else the entries' own), then
  the geometry's masks and the tile function's visibility, and only the tiles the block tables
  visit (on the tiles they mark whole, no visibility of the tile function), each kernel by its
  own table (forward; dQ and the row inputs; dK/dV and the column inputs);

then a masked softmax, and the backward from the given out and lse, as the kernels'
(dS = P * (dP - (D - dlse)), pulled back through the tile function by `jax.vjp`). With
dropout, the keep-mask of `docs/kernel_abi.md`'s 12-word block state, drawn with
`_philox.keep_at` from the documented index `e` (not with the kernels' own `dropout_rows`):
P times it over `1 - rate` meets V in the forward and dO in dV, and dP is multiplied by it.

Use as a context manager: `with emulated_kernels(): ...` (it swaps the two module attributes
and clears JAX's caches around the swap)."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from attnaux import _flash_hopper as fh
from attnaux import _flex
from attnaux import _hopper_mods as hm
from attnaux._canon import canonicalize, parse_statics
from attnaux._philox import keep_at
from attnaux._score_program import translate


def _scores(q, k, v, infos, scale, softcap, geometry):
    """`(visible, s, tanh or None, q, k, v)`: the scores after scale and softcap (float32, not
    masked) and the operands in float32, k and v repeated over their query heads."""
    q_info, kv_info = infos
    visible = fh._packed_visible(geometry, q_info[:, 0, :, None], q_info[:, 1, :, None],
                                 kv_info[:, 0, None, :], kv_info[:, 1, None, :])[:, None]
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    kf, vf = jnp.repeat(kf, group, axis=2), jnp.repeat(vf, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision="highest") * scale
    th = None
    if softcap is not None:
        th = jnp.tanh(s / softcap)
        s = th * softcap
    return visible, s, th, qf, kf, vf


def _dense(q, k, v, infos, scale, softcap, geometry, drop):
    visible, s, _, _, _, vf = _scores(q, k, v, infos, scale, softcap, geometry)
    return _softmax(jnp.where(visible, s, -jnp.inf), vf, drop)


def _drop(dropout, drop_state, q, k):
    """`keep / (1 - rate)` float32 `[B, Hq, Sq, Skv]` (1 without dropout): the element index
    `e = (((b0 + b) * Hq' + h0 + h) * Sq' + i0 + i) * Skv' + j0 + j` of the documented block
    state, given to `keep_at` as the row `(...) * Sq' + i0 + i` and the column `j0 + j`."""
    if not dropout:
        return 1.0
    w = drop_state.astype(jnp.uint32)
    bsz, q_seq, q_heads, _ = q.shape
    b = jnp.arange(bsz, dtype=jnp.uint32)[:, None, None, None]
    h = jnp.arange(q_heads, dtype=jnp.uint32)[None, :, None, None]
    i = jnp.arange(q_seq, dtype=jnp.uint32)[None, None, :, None]
    j = jnp.arange(k.shape[1], dtype=jnp.uint32)[None, None, None, :]
    row = ((w[4] + b) * w[8] + w[5] + h) * w[9] + w[6] + i
    keep = keep_at(w[:4], dropout, row, w[7] + j, w[10])
    return jnp.where(keep, jnp.float32(1.0 / (1.0 - dropout)), jnp.float32(0.0))


def _visited(table, n_rows: int, n_cols: int, row_tile: int, col_tile: int):
    """`(visited, whole)` bool `[Bt, Ht, n_rows, n_cols]` of a block table `[Bt, Ht, blocks,
    4]` (each block of `row_tile` rows: `[lo, hi)` of the `col_tile`-wide tiles it visits and
    `[full_lo, full_hi)` it computes without a mask)."""
    t = table[:, :, jnp.arange(n_rows) // row_tile]
    c = (jnp.arange(n_cols) // col_tile)[None, None, None, :]
    lo, hi, full_lo, full_hi = (t[..., i, None] for i in range(4))
    return (lo <= c) & (c < hi), (full_lo <= c) & (c < full_hi)


def _modified(qf, kf, rows, cols, *, scale, softcap, geometry, tile_fn, indices, region):
    """The scores `[B, Hq, Sq, Skv]` after scale, softcap and the tile function, -inf where not
    visible; `region`: `(visited, whole)` of a block table, or None (every tile masked)."""
    group = qf.shape[2] // kf.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, jnp.repeat(kf, group, axis=2),
                   precision="highest") * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    bsz, q_seq, q_heads, _ = qf.shape
    q_pos = jnp.arange(q_seq, dtype=jnp.int32)[:, None] + jnp.zeros((1, kf.shape[1]), jnp.int32)
    kv_pos = jnp.arange(kf.shape[1], dtype=jnp.int32)[None, :] + jnp.zeros_like(q_pos)
    visible = fh._geometry_visible(geometry, q_pos, kv_pos)[None, None]
    if tile_fn is not None:
        b_ids, h_ids = indices if indices is not None else (
            jnp.arange(bsz, dtype=jnp.int32), jnp.arange(q_heads, dtype=jnp.int32))
        s, fn_visible = tile_fn.fn(
            s, q_pos[None, None], kv_pos[None, None], b_ids[:, None, None, None],
            h_ids[None, :, None, None], tuple(rows[:, :, r, :, None] for r in range(rows.shape[2])),
            tuple(cols[:, :, c, None, :] for c in range(cols.shape[2])))
        if fn_visible is not None:
            visible = visible & (fn_visible if region is None else (fn_visible | region[1]))
    if region is not None:
        visible = visible & region[0]
    return jnp.where(visible, s, -jnp.inf)


def _regions(tables, group: int, q_seq: int, kv_seq: int, block_kv: int):
    """The forward's, the dQ kernel's and the dK/dV kernel's `(visited, whole)` over `[Bt, Ht,
    Sq, Skv]` (None each without tables)."""
    if tables is None:
        return None, None, None
    t_fwd, t_dq, t_dkv = tables
    fwd = _visited(t_fwd, q_seq, kv_seq, fh.BLOCK_Q, block_kv)
    dq = _visited(t_dq, q_seq, kv_seq, fh.BLOCK_Q, fh.BLOCK_Q)
    dkv = tuple(jnp.swapaxes(x, 2, 3) for x in _visited(t_dkv, kv_seq, q_seq, fh.BLOCK_Q,
                                                          fh.BLOCK_Q))
    if t_dkv.shape[1] > 1:  # per kv head: over the query heads it serves
        dkv = tuple(jnp.repeat(x, group, axis=1) for x in dkv)
    return fwd, dq, dkv


def _tile_forward(q, k, v, rows, cols, *, scale, softcap, geometry, tile_fn, config, tables,
                  indices, drop):
    group = q.shape[2] // k.shape[2]
    region = _regions(tables, group, q.shape[1], k.shape[1], config.block_kv)[0]
    s = _modified(q.astype(jnp.float32), k.astype(jnp.float32), rows, cols, scale=scale,
                  softcap=softcap, geometry=geometry, tile_fn=tile_fn, indices=indices,
                  region=region)
    return _softmax(s, jnp.repeat(v.astype(jnp.float32), group, axis=2), drop)


def _tile_backward(q, k, v, out, lse, dout, dlse, rows, cols, *, scale, softcap, geometry,
                   tile_fn, config, tables, indices, drop):
    """Each kernel's gradients with its own table: dq and the rows' from the dQ kernel's, dk,
    dv and the columns' from the dK/dV kernel's."""
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    do = dout.astype(jnp.float32)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # rows that see nothing: P = 0
    row = jnp.einsum("bqhd,bqhd->bhq", do, out.astype(jnp.float32), precision="highest") - dlse
    dp = drop * jnp.einsum("bqhd,bkhd->bhqk", do, jnp.repeat(vf, group, axis=2),
                           precision="highest")

    def grads(region):
        def scores(qf, kf, rows, cols):
            return _modified(qf, kf, rows, cols, scale=scale, softcap=softcap, geometry=geometry,
                             tile_fn=tile_fn, indices=indices, region=region)

        x, pull = jax.vjp(scores, qf, kf, rows, cols)
        p = jnp.exp(x - lse_safe[..., None])
        dq, dk, drows, dcols = pull(p * (dp - row[..., None]))
        dv = _fold(jnp.einsum("bhqk,bqhd->bkhd", p * drop, do, precision="highest"), group)
        return dq, dk, dv, drows, dcols

    _, dq_region, dkv_region = _regions(tables, group, q.shape[1], k.shape[1], config.block_kv)
    dq, dk, dv, drows, dcols = grads(dq_region)
    if tables is not None:
        _, dk, dv, _, dcols = grads(dkv_region)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), drows, dcols


def _softmax(s, vf, drop=1.0):
    """`(out, lse, max)` of masked scores `s [B, Hq, Sq, Skv]` (-inf: hidden); `drop`
    multiplies the probabilities that meet `vf`."""
    m = s.max(-1)
    seen = jnp.isfinite(m)
    m_safe = jnp.where(seen, m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    denom = p.sum(-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(seen, denom, 1.0)[..., None] * drop, vf,
                     precision="highest")
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
    return out, lse, jnp.where(seen, m, -jnp.inf)


def _fold(x, group: int):
    """Query heads' shares `[B, S, Hq, D]` back onto their kv head."""
    b, n, h, d = x.shape
    return x.reshape(b, n, h // group, group, d).sum(3)


def fake_forward(q, k, v, rows, cols, *, scale, softcap, geometry, tile_fn, config,
                 tables=None, infos=None, indices=None, dropout=None, drop_state=None):
    fh._check_packed(geometry, tile_fn, tables, infos)
    fh._drop_args(dropout, drop_state, q.shape[0], q.shape[2], q.shape[1])  # its checks
    drop = _drop(dropout, drop_state, q, k)
    if geometry.packed:
        out, lse, m = _dense(q, k, v, infos, scale, softcap, geometry, drop)
    else:
        out, lse, m = _tile_forward(q, k, v, rows, cols, scale=scale, softcap=softcap,
                                    geometry=geometry, tile_fn=tile_fn, config=config,
                                    tables=tables, indices=indices, drop=drop)
    return out.astype(q.dtype), lse, m


def fake_backward(q, k, v, out, lse, dout, dlse, rows, cols, *, scale, softcap, geometry,
                  tile_fn, config, tables=None, infos=None, indices=None, dropout=None,
                  drop_state=None):
    """As the kernels: P from the given `lse` (a block of a larger problem gets the whole
    problem's, so P is its share), dS = P * (dP - (rowsum(dO * O) - dlse))."""
    fh._check_packed(geometry, tile_fn, tables, infos)
    fh._drop_args(dropout, drop_state, q.shape[0], q.shape[2], q.shape[1])
    drop = _drop(dropout, drop_state, q, k)
    if not geometry.packed:
        return _tile_backward(q, k, v, out, lse, dout, dlse, rows, cols, scale=scale,
                              softcap=softcap, geometry=geometry, tile_fn=tile_fn, config=config,
                              tables=tables, indices=indices, drop=drop)
    visible, s, th, qf, kf, vf = _scores(q, k, v, infos, scale, softcap, geometry)
    group = q.shape[2] // k.shape[2]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # rows that see nothing: P = 0
    p = jnp.where(visible, jnp.exp(s - lse_safe[..., None]), 0.0)
    do = dout.astype(jnp.float32)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p * drop, do, precision="highest")
    dp = drop * jnp.einsum("bqhd,bkhd->bhqk", do, vf, precision="highest")
    row = jnp.einsum("bqhd,bqhd->bhq", do, out.astype(jnp.float32), precision="highest") - dlse
    ds = p * (dp - row[..., None])
    if th is not None:
        ds = ds * (1.0 - th * th)
    ds = ds * scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kf, precision="highest")
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, qf, precision="highest")
    return (dq.astype(q.dtype), _fold(dk, group).astype(k.dtype),
            _fold(dv, group).astype(v.dtype), rows, cols)


def _not_run(*_):
    raise RuntimeError("the opaque stand-in is for compiling only: executing a host callback on "
                       "several CPU devices at once crashes jaxlib")


def _operands(rows, cols, tables, infos, indices, drop_state=None):
    """What a kernel reads besides q, k, v (and the backward's residuals)."""
    return (*(x for x in (rows, cols) if x.size), *(tables or ()), *(infos or ()),
            *(indices or ()), *(() if drop_state is None else (drop_state,)))


def opaque_forward(q, k, v, rows, cols, *, scale, softcap, geometry, tile_fn, config,
                   tables=None, infos=None, indices=None, dropout=None, drop_state=None):
    """A call of the forward's shapes behind `jax.pure_callback`: one XLA cannot look into or
    partition (as the kernels' custom calls), so that a test of the partitioning can fail. Its
    programs are compiled and inspected, never run."""
    stats = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats)
    return jax.pure_callback(_not_run, shapes, q, k, v,
                             *_operands(rows, cols, tables, infos, indices, drop_state))


def opaque_backward(q, k, v, out, lse, dout, dlse, rows, cols, *, scale, softcap, geometry,
                    tile_fn, config, tables=None, infos=None, indices=None, dropout=None,
                    drop_state=None):
    side = tuple(x for x in (rows, cols) if x.size)  # the row and column inputs' gradients
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, *side))
    grads = list(jax.pure_callback(_not_run, shapes, q, k, v, out, lse, dout, dlse,
                                   *_operands(rows, cols, tables, infos, indices,
                                              drop_state)))
    dq, dk, dv = grads[:3]
    drows = grads[3] if rows.size else rows
    dcols = grads[-1] if cols.size else cols
    return dq, dk, dv, drows, dcols


def mods_attention(q, k, v, score_mod=None, mask_mod=None, *, causal=False, softcap=None):
    """`(out, lse, max)` of `attnaux.attention(q, k, v, score_mod=..., mask_mod=...)` on the
    Hopper kernels' path (`_hopper_mods.run`), as the dispatch calls it on a Hopper GPU: the
    score program split, mask_mod's block table of 64 x 64 tiles, the captured arrays."""
    statics = parse_statics(scale=None, causal=causal, window=None, softcap=softcap,
                            dropout_rate=0.0)
    problem = canonicalize(q, k, v, statics)
    mods, consts = _flex.convert(score_mod, mask_mod)
    bsz, q_seq, q_heads, _ = problem.arrays.q.shape
    dense, _ = _flex.dense_mask(mods, consts, bsz, q_heads, q_seq, problem.arrays.k.shape[1])
    program, extras = translate(mods.score_scalar, mods.n_score, mods.mask_scalar, mods.n_mask,
                                consts)
    tiles = None if dense is None else _flex.tiles_of(dense, 64)
    return hm.run(problem.arrays, problem.options, hm.split(program), (*consts, *extras), tiles)


@contextlib.contextmanager
def emulated_kernels(opaque: bool = False):
    """`opaque`: calls of the kernels' shapes behind `jax.pure_callback`, for compiling only
    (`opaque_forward`)."""
    saved = fh.forward, fh.backward
    fh.forward, fh.backward = fake_forward, fake_backward
    if opaque:
        fh.forward, fh.backward = opaque_forward, opaque_backward
    jax.clear_caches()
    try:
        yield
    finally:
        fh.forward, fh.backward = saved
        jax.clear_caches()


# ---- what the tests with the stand-in check
GATHERS = ("all-gather", "all-to-all", "collective-permute")


def gathers_in(compiled_text: str) -> list[str]:
    """The gathering collectives in a compiled program's text (a shard-local call has none)."""
    return [g for g in GATHERS if re.search(rf"\b{g}(?:-start)?\(", compiled_text)]


def close(got, want, rel, what):
    """`got` equals `want` within `rel` of the largest finite entry of `want` (at least 1), and
    is finite exactly where `want` is."""
    got, want = np.asarray(got), np.asarray(want)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=what)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0,
                               atol=rel * max(1.0, np.abs(want[finite]).max()), err_msg=what)
