"""`score_mod` / `mask_mod` on the Hopper kernels (`_flash_hopper.py`): a score program split
between XLA and the kernel.

The functions arrive as a score program (`_score_program.py`, the same translation the CPU
kernels run). Each register depends on some of score, batch, head, q_idx and kv_idx; the split
follows that:

- what depends on the score, or on both q_idx and kv_idx, runs inside the kernel on every tile
  (traced as jnp operations into the Pallas kernel, so its derivative is `jax.vjp`'s);
- what depends on the query side only (batch, head, q_idx: ALiBi's `slopes[h]`, a prefix
  length, a document id of the query) is computed by XLA before the kernel as a per-row input
  `[B, Hq, n_rows, Sq]`, and what depends on the key side only as a per-column input
  `[B, Hq, n_cols, Skv]`. XLA differentiates that part, so the captured arrays receive their
  gradients from the row and column sums the backward kernels return.

A captured array read at an index that depends on both positions (a relative-position table
indexed by `q_idx - kv_idx`) has no place in the kernel: `split` raises `Untranslatable`, and
flex serves the call.

Under SPMD the kernel calls run per shard of batch and heads, as `_hopper_packed`'s (rows, cols
and the block tables sliced with the shard); the tile function takes the batch and head index
of each entry from operands sliced the same way, so a shard's call sees the global indices.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _flash_hopper as hopper
from ._kernel_call import add_sink
from ._partition import (
    BATCH,
    HEADS,
    KV_HEADS,
    block_state,
    folded,
    partitioned,
    table_layout,
    unify_vma,
    varying_like_operands,
)
from ._score_program import (
    CONST_WORDS,
    HEADER_WORDS,
    INSTR_WORDS,
    N_INPUTS,
    Op,
    ScoreProgram,
    Untranslatable,
)

_S, _B, _H, _Q, _K = 1, 2, 4, 8, 16  # dependency bits of the input registers 0..4
_INPUT_DEPS = (_S, _B, _H, _Q, _K)


@dataclasses.dataclass(frozen=True)
class Split:
    """A score program split for the Hopper kernels (hashable: it keys the kernels' cache)."""

    program: ScoreProgram
    instrs: tuple  # every instruction, (op, dst, a, b, c, d, e)
    kernel: tuple[int, ...]  # instruction indices run in the kernel, in order
    rows: tuple[int, ...]  # registers computed by XLA per query row
    cols: tuple[int, ...]  # registers computed by XLA per key column
    score_out: int
    mask_out: int


def _reads(instr) -> tuple[int, ...]:
    op, _, a, b, c, d, e = instr
    if op == Op.LIT:
        return ()
    if op == Op.LOAD:
        return tuple(r for r in (b, c, d, e) if r >= 0)
    if op == Op.INTEGER_POW:
        return (a,)
    return tuple(r for r in (a, b, c) if r >= 0)


def split(program: ScoreProgram) -> Split:
    """Splits `program` (raises `Untranslatable` where a kernel-side instruction reads a
    captured array)."""
    words = program.words
    n_instr, score_out, mask_out, n_consts = words[3], words[4], words[5], words[6]
    start = HEADER_WORDS + n_consts * CONST_WORDS
    instrs = tuple(tuple(words[start + k * INSTR_WORDS:start + (k + 1) * INSTR_WORDS])
                   for k in range(n_instr))
    deps = list(_INPUT_DEPS)
    for instr in instrs:
        d = 0
        for r in _reads(instr):
            d |= deps[r]
        deps.append(d)

    def in_kernel(r):
        return bool(deps[r] & _S) or (deps[r] & (_Q | _K)) == (_Q | _K)

    needed = set()
    todo = [r for r in (score_out, mask_out) if r >= 0]
    while todo:
        r = todo.pop()
        if r in needed or r < N_INPUTS:
            continue
        needed.add(r)
        if in_kernel(r):
            todo.extend(_reads(instrs[r - N_INPUTS]))
    kernel, rows, cols = [], set(), set()
    for k, instr in enumerate(instrs):
        r = N_INPUTS + k
        if r not in needed or not in_kernel(r):
            continue
        if instr[0] == Op.LOAD:
            function = "mask_mod" if (mask_out >= 0 and r not in _ancestors(instrs, score_out)
                                      ) else "score_mod"
            raise Untranslatable(function, "a captured array indexed by both q_idx and kv_idx",
                                 "the Hopper kernel computes per-row and per-column values "
                                 "ahead of the kernel, not per-pair table reads")
        if instr[0] in KERNEL_UNSUPPORTED:
            raise Untranslatable("score_mod" if mask_out < 0 or r in _ancestors(instrs, score_out)
                                 else "mask_mod", "pow",
                                 "Mosaic GPU lowers no pow inside the Hopper kernel")
        kernel.append(k)
        for x in _reads(instr):
            if x >= N_INPUTS and not in_kernel(x) and instrs[x - N_INPUTS][0] != Op.LIT:
                (cols if deps[x] & _K else rows).add(x)
    for r in (score_out, mask_out):  # an output computed ahead of the kernel
        if r >= N_INPUTS and not in_kernel(r) and instrs[r - N_INPUTS][0] != Op.LIT:
            (cols if deps[r] & _K else rows).add(r)
    return Split(program, instrs, tuple(kernel), tuple(sorted(rows)), tuple(sorted(cols)),
                 score_out, mask_out)


def _ancestors(instrs, r) -> set:
    seen, todo = set(), [r] if r >= 0 else []
    while todo:
        x = todo.pop()
        if x in seen or x < N_INPUTS:
            continue
        seen.add(x)
        todo.extend(_reads(instrs[x - N_INPUTS]))
    return seen


# ---- the operations, in jnp (float32 registers; bools 1/0), as `_score_program.evaluate`
def _f(x):
    return x.astype(jnp.float32) if hasattr(x, "astype") else jnp.float32(x)


def _integer_pow(x, y: int):
    if y == 0:
        return jnp.ones_like(x)
    acc, base, n = None, x, abs(y)
    while n:
        if n & 1:
            acc = base if acc is None else acc * base
        n >>= 1
        if n:
            base = base * base
    return 1.0 / acc if y < 0 else acc


def _round_away(a):
    t = jnp.trunc(a)
    return jnp.where(jnp.abs(a - t) >= 0.5, t + jnp.sign(a), t)


def _idiv(a, b):
    zero = b == 0
    return jnp.where(zero, -1.0, jnp.trunc(a / jnp.where(zero, 1.0, b)))


_UNARY = {
    Op.NEG: lambda a: -a, Op.ABS: jnp.abs, Op.SIGN: jnp.sign, Op.FLOOR: jnp.floor,
    Op.CEIL: jnp.ceil, Op.ROUND_EVEN: jnp.round, Op.ROUND_AWAY: _round_away, Op.EXP: jnp.exp,
    Op.LOG: jnp.log, Op.LOG1P: jnp.log1p, Op.EXPM1: jnp.expm1, Op.TANH: jnp.tanh,
    Op.LOGISTIC: lambda a: 1.0 / (1.0 + jnp.exp(-a)), Op.SQRT: jnp.sqrt,
    Op.RSQRT: lambda a: 1.0 / jnp.sqrt(a), Op.TRUNC: jnp.trunc, Op.NOT: lambda a: 1.0 - a,
    Op.NONZERO: lambda a: _f(a != 0), Op.EXP2: jnp.exp2, Op.COPY: lambda a: a,
    Op.STOP: lax.stop_gradient,
}
_BINARY = {
    Op.ADD: lambda a, b: a + b, Op.SUB: lambda a, b: a - b, Op.MUL: lambda a, b: a * b,
    Op.DIV: lambda a, b: a / b, Op.IDIV: _idiv, Op.REM: lax.rem, Op.MAX: jnp.maximum,
    Op.MIN: jnp.minimum, Op.POW: jnp.power,
    Op.LT: lambda a, b: _f(a < b), Op.LE: lambda a, b: _f(a <= b),
    Op.GT: lambda a, b: _f(a > b), Op.GE: lambda a, b: _f(a >= b),
    Op.EQ: lambda a, b: _f(a == b), Op.NE: lambda a, b: _f(a != b),
    Op.AND: lambda a, b: _f((a != 0) & (b != 0)), Op.OR: lambda a, b: _f((a != 0) | (b != 0)),
    Op.XOR: lambda a, b: _f((a != 0) ^ (b != 0)),
}


# Inside the kernel, Mosaic GPU lowers no floor/ceil/trunc, log1p, expm1, pow, `%` or a scalar
# divided by an array: the same values from what it lowers (trunc by a round trip through
# int32, exact below 2**23 where every float32 is already an integer beyond).
def _k_recip(a):
    return lax.div(jnp.ones_like(a), a)


def _k_trunc(a):
    small = jnp.abs(a) < 2.0**23
    return jnp.where(small, jnp.where(small, a, 0.0).astype(jnp.int32).astype(jnp.float32), a)


def _k_floor(a):
    t = _k_trunc(a)
    return jnp.where(t > a, t - 1.0, t)


def _k_ceil(a):
    t = _k_trunc(a)
    return jnp.where(t < a, t + 1.0, t)


def _k_idiv(a, b):
    zero = b == 0
    return jnp.where(zero, -1.0, _k_trunc(a / jnp.where(zero, 1.0, b)))


_KERNEL_UNARY = {
    Op.FLOOR: _k_floor, Op.CEIL: _k_ceil, Op.TRUNC: _k_trunc,
    Op.ROUND_AWAY: lambda a: jnp.where(jnp.abs(a - _k_trunc(a)) >= 0.5,
                                       _k_trunc(a) + jnp.sign(a), _k_trunc(a)),
    Op.LOG1P: lambda a: jnp.log(a + 1.0), Op.EXPM1: lambda a: jnp.exp(a) - 1.0,
    Op.LOGISTIC: lambda a: _k_recip(jnp.exp(-a) + 1.0),
    Op.RSQRT: lambda a: _k_recip(jnp.sqrt(a)),
}
_KERNEL_BINARY = {Op.IDIV: _k_idiv, Op.REM: lambda a, b: a - _k_trunc(a / b) * b}
KERNEL_UNSUPPORTED = frozenset({Op.POW})
"""Opcodes left to flex when they would run inside the kernel (`pow` of a non-integer
exponent: Mosaic GPU has no lowering for it)."""


def _step(instr, regs, literals, tables=None, kernel: bool = False):
    op, _, a, b, c, d, e = instr
    if kernel and op in _KERNEL_UNARY:
        return _KERNEL_UNARY[op](regs[a])
    if kernel and op in _KERNEL_BINARY:
        return _KERNEL_BINARY[op](regs[a], regs[b])
    if kernel and op == Op.INTEGER_POW and b < 0:
        return _k_recip(_integer_pow(regs[a], -b))
    if op == Op.LIT:
        return jnp.float32(literals[a])
    if op == Op.LOAD:
        table = tables[a]
        idx = tuple(jnp.clip(regs[x], 0, n - 1).astype(jnp.int32)
                    for x, n in zip((b, c, d, e), table.shape))
        table = jnp.asarray(table)  # extras are NumPy constants
        return _f(table[idx] if idx else table)
    if op == Op.INTEGER_POW:
        return _integer_pow(regs[a], b)
    if op == Op.SELECT:
        return jnp.where(regs[a] != 0, regs[c], regs[b])
    if op == Op.CLAMP:
        return jnp.minimum(jnp.maximum(regs[b], regs[a]), regs[c])
    if op in _UNARY:
        return _UNARY[op](regs[a])
    return _BINARY[op](regs[a], regs[b])


def tile_fn(sp: Split) -> hopper.TileFn:
    """The kernel side of `sp` as the kernels' tile function."""
    literals = sp.program.literals

    def fn(s, q_pos, kv_pos, b, h, rows, cols):
        def tile(x):  # Mosaic GPU does not broadcast scalars implicitly (in `select_n`)
            return jnp.broadcast_to(_f(x), s.shape)

        regs = {0: s, 1: tile(b), 2: tile(h), 3: _f(q_pos), 4: _f(kv_pos)}
        regs.update(zip(sp.rows, rows))
        regs.update(zip(sp.cols, cols))
        for k, instr in enumerate(sp.instrs):
            r = N_INPUTS + k
            if instr[0] == Op.LIT and r not in regs:
                regs[r] = tile(literals[instr[2]])
        for k in sp.kernel:
            regs[N_INPUTS + k] = _step(sp.instrs[k], regs, literals, kernel=True)
        score = s if sp.score_out < 0 else regs[sp.score_out]
        score = score + jnp.zeros_like(s)  # a literal or a row input: the tile's shape
        visible = None if sp.mask_out < 0 else (regs[sp.mask_out] + jnp.zeros_like(s)) != 0
        return score, visible

    return hopper.TileFn(fn, len(sp.rows), len(sp.cols), sp.mask_out >= 0, sp)


def side_inputs(sp: Split, tables, bsz: int, q_heads: int, q_seq: int, kv_seq: int):
    """`(rows [B, Hq, n_rows, Sq], cols [B, Hq, n_cols, Skv])` float32, computed by XLA (and
    differentiated by it) from the captured arrays `tables` (the program's const table)."""
    literals = sp.program.literals

    def values(wanted, side_len, side_reg):
        grid = (bsz, q_heads, side_len)
        regs = {1: jnp.arange(bsz, dtype=jnp.float32)[:, None, None],
                2: jnp.arange(q_heads, dtype=jnp.float32)[None, :, None],
                side_reg: jnp.arange(side_len, dtype=jnp.float32)[None, None, :]}

        def get(r):
            if r not in regs:
                instr = sp.instrs[r - N_INPUTS]
                for x in _reads(instr):
                    get(x)
                regs[r] = _step(instr, regs, literals, tables)
            return regs[r]

        if not wanted:
            return jnp.zeros((bsz, q_heads, 0, side_len), jnp.float32)
        return jnp.stack([jnp.broadcast_to(_f(get(r)), grid) for r in wanted], axis=2)

    return values(sp.rows, q_seq, 3), values(sp.cols, kv_seq, 4)


# ---- block tables: mask_mod's 64 x 64 tiles as per-block visiting ranges
def _runs(table_row: np.ndarray) -> tuple[int, int, int, int]:
    """`(lo, hi, full_lo, full_hi)` of one row of tiles (0 hidden, 1 partial, 2 whole): the
    tiles visited, and the longest run of whole tiles inside (no mask needed there)."""
    seen = np.flatnonzero(table_row > 0)
    if seen.size == 0:
        return 0, 0, 0, 0
    lo, hi = int(seen[0]), int(seen[-1]) + 1
    best, start = (lo, lo), None
    for j in range(lo, hi + 1):
        whole = j < hi and table_row[j] == 2
        if whole and start is None:
            start = j
        if not whole and start is not None:
            if j - start > best[1] - best[0]:
                best = (start, j)
            start = None
    return lo, hi, best[0], best[1]


def _merge(table: np.ndarray, factor: int) -> np.ndarray:
    """Tiles merged `factor` at a time along the last axis (hidden if all are, whole if all
    are), padded with hidden tiles."""
    n = table.shape[-1]
    pad = (-n) % factor
    t = np.concatenate([table, np.zeros(table.shape[:-1] + (pad,), table.dtype)], axis=-1)
    return _combine(t.reshape(table.shape[:-1] + (-1, factor)), -1)


def _combine(t: np.ndarray, axis: int) -> np.ndarray:
    """Tiles combined along `axis` (hidden where hidden in all, whole where whole in all)."""
    return np.where((t == 0).all(axis), 0, np.where((t == 2).all(axis), 2, 1)).astype(np.int32)


def range_tables(tiles: np.ndarray, n_q64: int, n_k64: int, block_kv: int, group: int):
    """The kernels' visiting ranges from mask_mod's table of 64 x 64 tiles `[Bt, Ht, nq, nk]`
    (padded with hidden tiles to `n_q64 x n_k64`): int32 `[Bt, Ht, blocks, 4]` for the forward
    (64-row blocks over `block_kv`-key tiles), the dQ kernel (64 over 64) and the dK/dV kernel
    (64-key blocks over 64-row query tiles; per kv head, over the `group` query heads it
    serves)."""
    bt, ht, nq, nk = tiles.shape
    t = np.zeros((bt, ht, n_q64, n_k64), np.int32)
    t[:, :, :nq, :nk] = tiles

    def rows_of(table):
        return np.asarray([[[_runs(r) for r in table[i, j]] for j in range(table.shape[1])]
                           for i in range(table.shape[0])], np.int32).reshape(
                               table.shape[:3] + (4,))

    fwd = rows_of(_merge(t, block_kv // 64))
    dq = rows_of(t)
    per_kv_head = t if ht == 1 else _combine(t.reshape(bt, ht // group, group, n_q64, n_k64), 2)
    dkv = rows_of(np.swapaxes(per_kv_head, 2, 3))
    return fwd, dq, dkv


# ---- the call
def unavailable(problem) -> str | None:
    """Why the Hopper kernels cannot serve this canonical problem (None: they can)."""
    arrays, options = problem.arrays, problem.options
    why = hopper.device_unavailable(arrays.q, arrays.k, arrays.v)
    if why is not None:
        return why
    if options.has_seqlens:
        return ("the Hopper kernels read no q_seqlens/kv_seqlens (`_mods.rules_as_mask` folds "
                "them into the mask_mod first)")
    if arrays.q_segment_ids is not None or arrays.kv_segment_ids is not None:
        return ("the Hopper kernels read no segment ids (`_mods.rules_as_mask` folds them into "
                "the mask_mod first)")
    return None


@dataclasses.dataclass(frozen=True)
class Static:
    split: Split | None
    softcap: float | None
    scale: float
    geometry: hopper.Geometry
    config: hopper.Config
    tables: tuple | None  # ((shape, int32 bytes), ...) of range_tables, or None: hashable
    dropout: float | None = None  # the rate; the kernels then take the 12-word block state

    def range_arrays(self):
        if self.tables is None:
            return None
        return tuple(jnp.asarray(np.frombuffer(data, np.int32).reshape(shape))
                     for shape, data in self.tables)


def _pad(x, axis: int, multiple: int):
    n = x.shape[axis]
    extra = (-n) % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


# ---- the kernel calls: partitioned over batch and heads, vmap folded into the batch
# (as `_hopper_packed`'s). The tile function sees the batch and head index of each entry from
# the operands `batch_ids` and `head_ids` (`arange`s, sliced with the shard and folded with a
# vmap, as every other operand), so that a shard's call, or a vmapped one, computes what the
# whole call computes there; every array is read at the entry's local index.
_TABLES = ("t_fwd", "t_dq", "t_dkv")
_LAYOUTS = {
    "rows": (BATCH, HEADS, "n_rows", "q_seq"), "drows": (BATCH, HEADS, "n_rows", "q_seq"),
    "cols": (BATCH, HEADS, "n_cols", "kv_seq"), "dcols": (BATCH, HEADS, "n_cols", "kv_seq"),
    "batch_ids": (BATCH,), "head_ids": (HEADS,),
    # range_tables' dims of size 1 broadcast (the partitioning leaves them whole)
    "t_fwd": (BATCH, HEADS, "q_blocks", "range"), "t_dq": (BATCH, HEADS, "q_blocks", "range"),
    "t_dkv": (BATCH, KV_HEADS, "kv_blocks", "range"),
}


def _layout(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    return _LAYOUTS.get(name) or table_layout(name, shape)


def _names(st: Static):
    """`(forward operands, backward operands, backward results)` of a static setting (rows and
    cols only where the split has them, the block tables only where mask_mod gave them)."""
    n_rows, n_cols = (0, 0) if st.split is None else (len(st.split.rows), len(st.split.cols))
    side = ("rows",) * bool(n_rows) + ("cols",) * bool(n_cols)
    forward = ("q", "k", "v", *side, "batch_ids", "head_ids",
               *(_TABLES if st.tables is not None else ()), *(("rng_state",) * bool(st.dropout)))
    results = ("dq", "dk", "dv") + ("drows",) * bool(n_rows) + ("dcols",) * bool(n_cols)
    return forward, forward + ("out", "lse", "dout", "dlse"), results


def _kernel_args(st: Static, names, args):
    """The named operands, rows and cols (empty where absent) and the kernels' keywords."""
    named = dict(zip(names, args, strict=True))
    bsz, q_seq, q_heads, _ = named["q"].shape
    rows = named.get("rows", jnp.zeros((bsz, q_heads, 0, q_seq), jnp.float32))
    cols = named.get("cols", jnp.zeros((bsz, q_heads, 0, named["k"].shape[1]), jnp.float32))
    keywords = dict(scale=st.scale, softcap=st.softcap, geometry=st.geometry,
                    tile_fn=tile_fn(st.split) if st.split is not None else None,
                    config=st.config,
                    tables=tuple(named[t] for t in _TABLES) if st.tables is not None else None,
                    indices=(named["batch_ids"], named["head_ids"]), dropout=st.dropout,
                    drop_state=named.get("rng_state"))
    return named, rows, cols, keywords


def _local_forward(st: Static, *args):
    named, rows, cols, kw = _kernel_args(st, _names(st)[0], args)
    return hopper.forward(named["q"], named["k"], named["v"], rows, cols, **kw)


def _local_backward(st: Static, *args):
    n = _names(st)
    named, rows, cols, kw = _kernel_args(st, n[1], args)
    dq, dk, dv, drows, dcols = hopper.backward(
        *(named[x] for x in ("q", "k", "v", "out", "lse", "dout", "dlse")), rows, cols, **kw)
    grads = {"dq": dq, "dk": dk, "dv": dv, "drows": drows, "dcols": dcols}
    return tuple(grads[x] for x in n[2])


@functools.cache
def _ops(st: Static):
    """The forward and backward kernel calls of one static setting: each partitioned over
    batch and heads under SPMD (`_partition.partitioned`: a device runs its shard, no gather;
    rows, cols, the ids and the block tables are sliced with it; with dropout the block state
    gets the shard's origin), and folded under `jax.vmap` (mapped one element after another
    with dropout, whose counters use the batch index)."""
    fwd_names, bwd_names, bwd_results = _names(st)
    drop = ("rng_state", True) if st.dropout else None
    forward = partitioned(functools.partial(_local_forward, st), "attnaux score_mod (Hopper)",
                          fwd_names, ("out", "lse", "max"), layout=_layout, dropout=drop)
    backward = partitioned(functools.partial(_local_backward, st),
                           "attnaux score_mod backward (Hopper)", bwd_names, bwd_results,
                           layout=_layout, dropout=drop)
    tables_at = tuple(i for i, x in enumerate(bwd_names) if x in _TABLES)
    heads_at = (bwd_names.index("head_ids"),)
    sequential = bool(st.dropout)
    return (varying_like_operands(folded(forward, tables_at, heads_at, sequential)),
            varying_like_operands(folded(backward, tables_at, heads_at, sequential)))


def _side(st: Static, rp, cp):
    """The rows and cols operands the kernel calls take (those the split has)."""
    _, _, results = _names(st)
    return (*((rp,) if "drows" in results else ()), *((cp,) if "dcols" in results else ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_call(st: Static, q, k, v, rows, cols, ids, tabs, rng):
    return _fwd(st, q, k, v, rows, cols, ids, tabs, rng)[0]


def _fwd(st, q, k, v, rows, cols, ids, tabs, rng):
    q_seq = q.shape[1]
    qp, kp, vp = _pad(q, 1, 128), _pad(k, 1, 128), _pad(v, 1, 128)
    rp, cp = _pad(rows, 3, 128), _pad(cols, 3, 128)
    out, lse, mx = _ops(st)[0](qp, kp, vp, *_side(st, rp, cp), *ids, *tabs, *rng)
    result = (out[:, :q_seq], lse[..., :q_seq], mx[..., :q_seq])
    return result, ((qp, kp, vp, out, lse, rp, cp, ids, tabs, rng), q_seq, k.shape[1])


def _bwd(st, saved, cotangents):
    (qp, kp, vp, out, lse, rp, cp, ids, tabs, rng), q_seq, kv_seq = saved
    dout, dlse, _ = cotangents  # the row max has no gradient
    dout = _pad(dout.astype(qp.dtype), 1, 128)
    dlse = _pad(dlse.astype(jnp.float32), 2, 128)
    grads = dict(zip(_names(st)[2], _ops(st)[1](qp, kp, vp, *_side(st, rp, cp), *ids, *tabs,
                                                 *rng, out, lse, dout, dlse), strict=True))
    drows, dcols = grads.get("drows", rp), grads.get("dcols", cp)  # absent: shape with 0
    return (grads["dq"][:, :q_seq], grads["dk"][:, :kv_seq], grads["dv"][:, :kv_seq],
            drows[..., :q_seq], dcols[..., :kv_seq], None, None, None)


_kernel_call.defvjp(_fwd, _bwd)


def plain_forward(cfg, q, k, v):
    """`(out, lse, max)` of plain attention (no tile function, tables or dropout) on the Hopper
    forward kernel, partitioned like `run`'s; `cfg` has `scale`, `causal`, `window_left` and
    `window_right` (the GPU flash backend's `Config`). No VJP of its own: GPU `flash` runs it
    inside its custom VJP and differentiates it with cuDNN's backward
    (`_dispatch.gpu_forward_on_hopper`)."""
    bsz, q_seq, q_heads, dim = q.shape
    kv_seq = k.shape[1]
    geometry = geometry_of(cfg, q_seq, kv_seq)
    st = Static(None, None, float(cfg.scale), geometry, _config(dim, kv_seq, geometry), None)
    ids = (jnp.arange(bsz, dtype=jnp.int32), jnp.arange(q_heads, dtype=jnp.int32))
    out, lse, row_max = _ops(st)[0](_pad(q, 1, 128), _pad(k, 1, 128), _pad(v, 1, 128), *ids)
    return out[:, :q_seq], lse[..., :q_seq], row_max[..., :q_seq]


def plain_backward(cfg, q, k, v, out, lse, dout, dlse):
    """`(dq, dk, dv)` of plain attention on the CUDA C++ Hopper backward
    (`_flash_hopper._cuda_backward`), partitioned like `run`'s, from the forward's out and lse
    (`[B, Hq, Sq]`, natural log; cuDNN's or the Hopper forward's) and the cotangents of out and
    lse; `cfg` as `plain_forward`'s. No VJP of its own: GPU `flash` runs it in its custom VJP's
    backward in cuDNN's place (`_dispatch.gpu_backward_on_cuda`, which checks that the CUDA
    kernel serves the call)."""
    bsz, q_seq, q_heads, dim = q.shape
    kv_seq = k.shape[1]
    geometry = geometry_of(cfg, q_seq, kv_seq)
    config = dataclasses.replace(_config(dim, kv_seq, geometry), cuda_backward=True)
    st = Static(None, None, float(cfg.scale), geometry, config, None)
    ids = (jnp.arange(bsz, dtype=jnp.int32), jnp.arange(q_heads, dtype=jnp.int32))
    # rows past q_seq lie past the geometry's q_len: nothing of theirs enters the products
    dq, dk, dv = _ops(st)[1](
        _pad(q, 1, 128), _pad(k, 1, 128), _pad(v, 1, 128), *ids, _pad(out, 1, 128),
        _pad(lse.astype(jnp.float32), 2, 128), _pad(dout.astype(q.dtype), 1, 128),
        _pad(dlse.astype(jnp.float32), 2, 128))
    return dq[:, :q_seq], dk[:, :kv_seq], dv[:, :kv_seq]


def _config(dim: int, kv_seq: int, geometry: hopper.Geometry, widen: bool = True):
    """`hopper.default_config` for the keys as the kernels see them (padded to 128, `_pad`);
    `widen=False` keeps the 128-key forward tiles."""
    return hopper.default_config(dim, -(-kv_seq // 128) * 128 if widen else None,
                                 banded=geometry.causal or geometry.window is not None)


def geometry_of(options, q_seq: int, kv_seq: int) -> hopper.Geometry:
    window = None
    if options.window_left >= 0 or options.window_right >= 0:
        unbounded = q_seq + kv_seq
        window = (options.window_left if options.window_left >= 0 else unbounded,
                  options.window_right if options.window_right >= 0 else unbounded)
    offset = kv_seq - q_seq if options.causal == 2 else 0
    if options.causal == 0 and window is not None:
        offset = 0
    return hopper.Geometry(options.causal != 0, window, offset, kv_seq, q_seq)


def run(arrays, options, sp: Split | None, tables, tiles):
    """`(out, lse, max)` of the canonical problem on the Hopper kernels; `tables`: the
    program's const table (captured arrays, differentiable through XLA's side inputs);
    `tiles`: mask_mod's table of 64 x 64 tiles or None."""
    q, k, v = arrays.q, arrays.k, arrays.v
    bsz, q_seq, q_heads, dim = q.shape
    kv_seq = k.shape[1]
    if sp is not None:
        rows, cols = side_inputs(sp, tables, bsz, q_heads, q_seq, kv_seq)
    else:
        rows = jnp.zeros((bsz, q_heads, 0, q_seq), jnp.float32)
        cols = jnp.zeros((bsz, q_heads, 0, kv_seq), jnp.float32)
    geometry = geometry_of(options, q_seq, kv_seq)
    # mask_mod's tables keep the 128-key tiles (their skipping is unmeasured at 256)
    config = _config(dim, kv_seq, geometry, widen=tiles is None)
    packed = None
    if tiles is not None:
        n_q64, n_k64 = -(-q_seq // 128) * 2, -(-kv_seq // 128) * 2
        group = q_heads // k.shape[2]
        packed = tuple((t.shape, np.ascontiguousarray(t, np.int32).tobytes()) for t in
                       range_tables(tiles, n_q64, n_k64, config.block_kv, group))
    dropout = options.dropout_rate if options.dropout_rate > 0 else None
    st = Static(sp, options.softcap or None, options.scale, geometry, config, packed, dropout)
    # with dropout, the 12-word block state of the call (its unpadded sizes): attnaux's mask of
    # the [B, Hq, Sq, Skv] problem, whatever the padding
    rng = (block_state(arrays.rng_state, q, k),) if dropout else ()
    # inside `jax.shard_map`: rows and cols (from replicated captured arrays) vary like q, k, v,
    # so that the custom VJP gives each its cotangent's type
    q, k, v, rows, cols = unify_vma((q, k, v, rows, cols))
    ids = (jnp.arange(bsz, dtype=jnp.int32), jnp.arange(q_heads, dtype=jnp.int32))
    out, lse, row_max = _kernel_call(st, q, k, v, rows, cols, ids, st.range_arrays() or (),
                                     rng)
    if arrays.sink is not None:  # after the kernels, exactly; JAX differentiates it
        out, lse = add_sink(out, lse, arrays.sink)
    return out, lse, row_max
