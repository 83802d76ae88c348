"""Packed sequences on attnaux's Hopper kernels (`_hopper_packed.py`).

Off a GPU (in CI), the part that decides what the kernels compute is checked exactly: the token
infos (segment, aligned position) give the same visibility pair by pair as `_masking.visibility`
(the one Python definition of the masking rules), and the visiting ranges built from per-tile
summaries cover every visible pair and mark as whole only tiles whose every pair is visible, for
each of the three kernels' tables. On a Hopper GPU (`gpu` marker), `attention` with segment ids
and `varlen_attention` run on the kernels and are compared with the `reference` backend in
float32 (bfloat16 inputs; tolerances as in `test_hopper.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import every_other
from hopper_emulation import emulated_kernels
from test_hopper import _close

import attnaux as ax
from attnaux import _dispatch, _masking
from attnaux import _flash_hopper as fh
from attnaux import _hopper_packed as hpk
from attnaux._canon import canonicalize, parse_statics
from attnaux._varlen import _packing

ON_HOPPER = (jax.default_backend() == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9."))


def _segments(kind, n, rng):
    if kind == "docs":  # contiguous documents, lengths 1 .. > a tile, some of one token
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(9, n - 1), replace=False))
        cuts = np.concatenate([cuts, [1, 2] if n > 3 else []]).astype(int)
        seg = np.zeros(n, np.int32)
        for c in np.unique(cuts):
            seg[c:] += 1
        return seg
    if kind == "mixed":  # non-contiguous ids
        return rng.integers(0, 3, size=n).astype(np.int32)
    return np.zeros(n, np.int32)  # "none"


CASES = [  # (q_seq, kv_seq, kind, causal, window, seqlens)
    (300, 300, "docs", True, None, False),
    (300, 300, "docs", False, None, False),
    (256, 256, "mixed", False, None, False),
    (200, 330, "none", "bottom_right", None, True),
    (330, 200, "docs", "bottom_right", (5, 0), True),
    (260, 260, "docs", False, (70, 30), False),
    (257, 190, "mixed", True, (40, None), True),
    (128, 129, "none", "bottom_right", None, False),  # a tile's one visible pair at its corner
    (192, 192, "none", False, (0, 64), False),  # and a window's
]


def _problem(case, seed=0):
    q_seq, kv_seq, kind, causal, window, seqlens = case
    rng = np.random.default_rng(seed)
    b = 2
    x = jnp.zeros((b, max(q_seq, kv_seq), 1, 8), jnp.float32)
    extra = {}
    if kind != "none":
        if q_seq == kv_seq:
            seg = np.stack([_segments(kind, q_seq, rng) for _ in range(b)])
            extra.update(q_segment_ids=seg, kv_segment_ids=seg)
        else:
            extra.update(q_segment_ids=np.stack([_segments(kind, q_seq, rng) for _ in range(b)]),
                         kv_segment_ids=np.stack([_segments(kind, kv_seq, rng)
                                                  for _ in range(b)]))
    if seqlens:
        extra.update(q_seqlens=np.array([q_seq, q_seq - 37]),
                     kv_seqlens=np.array([kv_seq - 50, kv_seq]))
    statics = parse_statics(scale=None, causal=causal, window=window, softcap=None,
                            dropout_rate=0.0)
    return canonicalize(x[:, :q_seq], x[:, :kv_seq], x[:, :kv_seq], statics, **extra)


def _packed_rule(q_info, kv_info, g):
    """`_flash_hopper._packed_visible` over every pair, in NumPy."""
    qi, ki = np.asarray(q_info), np.asarray(kv_info)
    return np.asarray(fh._packed_visible(
        g, qi[:, 0, :, None], qi[:, 1, :, None], ki[:, 0, None, :], ki[:, 1, None, :]))


def _check_table(table, visible, rows_per_block, cols_per_tile, what):
    """Every visible pair inside its block's `[lo, hi)`; every tile of `[full_lo, full_hi)`
    wholly visible."""
    b, n_rows, n_cols = visible.shape
    for bi in range(b):
        for block in range(table.shape[2]):
            lo, hi, full_lo, full_hi = (int(x) for x in table[bi, 0, block])
            assert 0 <= lo <= full_lo <= full_hi <= hi or (full_lo == full_hi and lo <= hi), \
                (what, block, (lo, hi, full_lo, full_hi))
            rows = visible[bi, block * rows_per_block:(block + 1) * rows_per_block]
            cols = np.flatnonzero(rows.any(0))
            tiles = np.unique(cols // cols_per_tile)
            assert all(lo <= t < hi for t in tiles), (what, bi, block, tiles, (lo, hi))
            for t in range(full_lo, full_hi):
                tile = rows[:, t * cols_per_tile:(t + 1) * cols_per_tile]
                assert tile.shape[0] == rows_per_block and tile.all(), (what, bi, block, t)


# the corner cases (a tile's one visible pair) in the default run, the rest every other one
@pytest.mark.parametrize("case", every_other(CASES[:7], single=True) + CASES[7:],
                         ids=lambda c: "-".join(map(str, c)))
def test_token_rules_and_tables_match_the_masking_rules(case):
    problem = _problem(case)
    arrays, options = problem.arrays, problem.options
    q_info, kv_info = hpk.pad_infos(*hpk.token_infos(arrays, options))
    g = hpk.geometry(options, q_info.shape[2], kv_info.shape[2])
    want = np.asarray(_masking.visibility(arrays, options))[:, 0]
    got = _packed_rule(q_info, kv_info, g)
    q_seq, kv_seq = want.shape[1:]
    np.testing.assert_array_equal(got[:, :q_seq, :kv_seq], want)
    assert not got[:, q_seq:].any() and not got[:, :, kv_seq:].any()  # padding sees nothing
    for block_kv in (128, 256):  # the forward's key tiles (`default_config`)
        fwd, dq, dkv = (np.asarray(t) for t in hpk.tables(q_info, kv_info, g, block_kv))
        _check_table(fwd, got, 64, block_kv, f"forward, {block_kv}-key tiles")
    _check_table(dq, got, 64, 64, "dq")
    _check_table(dkv, np.swapaxes(got, 1, 2), 64, 64, "dkv")


def test_tables_skip_other_documents():
    """Contiguous documents of 256 tokens, causal: each 64-row block visits only its own
    document's tiles up to the diagonal, and only the diagonal tile is masked."""
    seg = np.repeat(np.arange(8), 256)[None].astype(np.int32)
    statics = parse_statics(scale=None, causal=True, window=None, softcap=None,
                            dropout_rate=0.0)
    x = jnp.zeros((1, seg.shape[1], 1, 8), jnp.float32)
    problem = canonicalize(x, x, x, statics, q_segment_ids=seg, kv_segment_ids=seg)
    q_info, kv_info = hpk.pad_infos(*hpk.token_infos(problem.arrays, problem.options))
    g = hpk.geometry(problem.options, seg.shape[1], seg.shape[1])
    _, dq, _ = (np.asarray(t) for t in hpk.tables(q_info, kv_info, g, 128))
    for block in range(seg.shape[1] // 64):
        doc_start = (block * 64 // 256) * 4
        assert tuple(dq[0, 0, block]) == (doc_start, block + 1, doc_start, block), block


def test_varlen_infos_match_the_padded_rules():
    """`varlen`'s token infos: sequence i's queries see its keys by its own (bottom-right)
    causal rule and window, nothing else; uncovered tokens see and are seen by nothing."""
    cu_q = jnp.array([0, 5, 5, 70, 130, 131], jnp.int32)  # an empty and a one-token sequence
    cu_kv = jnp.array([0, 9, 20, 60, 150, 151], jnp.int32)
    total_q, total_kv, max_q, max_kv = 140, 160, 64, 80  # lengths cut to the maxima
    pq, pk = _packing(cu_q, total_q, max_q), _packing(cu_kv, total_kv, max_kv)
    statics = parse_statics(scale=None, causal="bottom_right", window=(20, 0), softcap=None,
                            dropout_rate=0.0)
    x = jnp.zeros((1, 1, 1, 8), jnp.float32)
    options = canonicalize(x, x, x, statics).options
    q_info, kv_info = hpk.varlen_infos(pq.seq, pq.pos, pq.covered, pk.seq, pk.pos, pk.covered,
                                       pq.lengths, pk.lengths, pk.offsets, options)
    g = hpk.geometry(options, total_q, total_kv)
    got = _packed_rule(q_info, kv_info, g)[0]
    want = np.zeros((total_q, total_kv), bool)
    lq, lk = np.asarray(pq.lengths), np.asarray(pk.lengths)
    oq, ok = np.asarray(cu_q), np.asarray(cu_kv)
    for s in range(len(lq)):
        i = np.arange(lq[s])[:, None]
        j = np.arange(lk[s])[None, :]
        d = lk[s] - lq[s]
        want[oq[s]:oq[s] + lq[s], ok[s]:ok[s] + lk[s]] = (j <= i + d) & (j >= i + d - 20)
    np.testing.assert_array_equal(got, want)


def _visited(table):
    """Tiles a table's blocks visit: the sum of `hi - lo`."""
    return int((table[..., 1] - table[..., 0]).sum())


def test_varlen_tables_prune_documents_that_straddle_a_tile():
    """Causal documents of different lengths (their starts fall inside tiles): the tables
    cover every visible pair and visit no more tiles than the fewest that cover them plus one
    per straddled boundary; with positions inside each document (the earlier infos) a block
    that straddles two documents kept most of the second one's tiles."""
    lengths = np.array([300, 77, 1000, 451, 129, 610, 1024, 505])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    total = int(lengths.sum()) + 64  # and some padding
    statics = parse_statics(scale=None, causal=True, window=None, softcap=None,
                            dropout_rate=0.0)
    x = jnp.zeros((1, 1, 1, 8), jnp.float32)
    options = canonicalize(x, x, x, statics).options
    p = _packing(cu, total, int(lengths.max()))
    infos = hpk.pad_infos(*hpk.varlen_infos(p.seq, p.pos, p.covered, p.seq, p.pos, p.covered,
                                            p.lengths, p.lengths, p.offsets, options))
    g = hpk.geometry(options, infos[0].shape[2], infos[1].shape[2])
    visible = _packed_rule(*infos, g)
    fwd, dq, dkv = (np.asarray(t) for t in hpk.tables(*infos, g, 128))
    _check_table(fwd, visible, 64, 128, "forward")
    _check_table(dq, visible, 64, 64, "dq")
    _check_table(dkv, np.swapaxes(visible, 1, 2), 64, 64, "dkv")
    # the fewest 64-key tiles per 64-row block: from its first to its last visible key's tile
    rows = visible[0].reshape(-1, 64, visible.shape[2]).any(1)
    fewest = sum(np.flatnonzero(r).max() // 64 - np.flatnonzero(r).min() // 64 + 1
                 for r in rows if r.any())
    assert _visited(dq) <= fewest, (_visited(dq), fewest)
    # the earlier infos: positions inside each document
    old_q = jnp.where(p.covered, p.pos, hpk.PAD_ROW)
    old = hpk.pad_infos(jnp.stack([p.seq, old_q])[None],
                        jnp.stack([p.seq, jnp.where(p.covered, p.pos, -1)])[None])
    _, old_dq, _ = (np.asarray(t) for t in hpk.tables(*old, g, 128))
    assert _visited(dq) < _visited(old_dq), (_visited(dq), _visited(old_dq))


# ---- the wrapping of the kernels, with a pure-JAX stand-in for them (runs on CPU)
def _emulated_case(seed=0, b=2, s=150):
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, s, 4, 16))
    k = jax.random.normal(keys[1], (b, s, 2, 16))
    v = jax.random.normal(keys[2], (b, s, 2, 16))
    w = jax.random.normal(keys[3], (b, s, 4, 16))
    seg = jnp.asarray(np.stack([_segments("docs", s, rng) for _ in range(b)]))
    options = dict(causal="bottom_right", softcap=20.0, q_segment_ids=seg, kv_segment_ids=seg,
                   q_seqlens=jnp.array([s, s - 40][:b]), kv_seqlens=jnp.array([s - 7, s][:b]),
                   sink=jnp.linspace(-1.0, 1.0, 4))
    return q, k, v, w, options


def _packed_run(q, k, v, **options):
    """`_hopper_packed.run` as the dispatch calls it: `(out, lse)`."""
    statics = parse_statics(scale=None, causal=options.pop("causal", False), window=None,
                            softcap=options.pop("softcap", None),
                            dropout_rate=options.pop("dropout_rate", 0.0))
    problem = canonicalize(q, k, v, statics, **options)
    out, lse, _, _ = hpk.run(problem.arrays, problem.options, False)
    return out, lse


def test_wrapping_matches_the_reference_with_emulated_kernels():
    """Padding to 128, token infos, lengths, the sink after the kernels and the custom VJP
    (through lse too) around a stand-in of the kernels: equal to the reference backend."""
    q, k, v, w, options = _emulated_case()

    def loss(run, q, k, v):
        out, lse = run(q, k, v)
        return (out * w).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum(), (out, lse)

    with emulated_kernels():  # (jitted: a compile each instead of one an eager op)
        got = jax.jit(jax.value_and_grad(
            lambda *a: loss(lambda *x: _packed_run(*x, **dict(options)), *a),
            argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(
        lambda *x: (lambda r: (r[0], r[1].lse))(ax.attention(*x, backend="reference",
                                                              **options)), *a),
        argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _close(got[0][1][0], want[0][1][0], 1e-5, "out")
    _close(got[0][1][1], want[0][1][1], 1e-5, "lse")
    for name, g_, w_ in zip("qkv", got[1], want[1]):
        _close(g_, w_, 1e-4, f"d{name}")


def test_vmap_folds_into_the_batch_with_emulated_kernels():
    """`jax.vmap` (twice nested) of the packed call: one call with the mapped axes folded into
    the batch, equal to the calls one by one, gradients too."""
    q, k, v, w, options = _emulated_case(b=1)
    seg, q_len, kv_len = (options.pop(n) for n in ("q_segment_ids", "q_seqlens", "kv_seqlens"))
    del options["kv_segment_ids"]
    stack = lambda x: jnp.stack([x, x[:, ::-1], 0.5 * x])  # noqa: E731
    qs, ks, vs = (jnp.stack([stack(x), -stack(x)]) for x in (q, k, v))  # [2, 3, 1, ...]

    def one(q, k, v):
        return _packed_run(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_seqlens=q_len,
                           kv_seqlens=kv_len, **dict(options))[0]

    def loss(fn, q, k, v):
        return (fn(q, k, v) ** 2).sum()

    with emulated_kernels():  # (jitted: a compile each instead of one an eager op)
        mapped = jax.vmap(jax.vmap(one))
        got = jax.jit(mapped)(qs, ks, vs)
        got_grads = jax.jit(jax.grad(lambda *a: loss(mapped, *a), argnums=(0, 1, 2)))(
            qs, ks, vs)
        jaxpr = str(jax.make_jaxpr(mapped)(qs, ks, vs))
        one_jit = jax.jit(one)
        one_grad = jax.jit(jax.grad(lambda *a: loss(one, *a), argnums=(0, 1, 2)))
        for i in range(2):
            for j in range(3):
                _close(got[i, j], one_jit(qs[i, j], ks[i, j], vs[i, j]), 1e-6,
                       f"out[{i}, {j}]")
                gi = one_grad(qs[i, j], ks[i, j], vs[i, j])
                for g_, w_ in zip(got_grads, gi):
                    _close(g_[i, j], w_, 1e-5, f"grad[{i}, {j}]")
    assert jaxpr.count("attnaux_kernel_call") == 1, "the mapped calls are one kernel call"


def test_dropout_with_emulated_kernels_draws_the_reference_mask():
    """With dropout the kernels get the call's 12-word block state (origin 0, the unpadded
    sizes) and draw attnaux's keep-mask: around the stand-in (which draws it from the
    documented index), out, lse and the gradients equal the `reference` backend's with the
    same key, lengths, segments, softcap and sink included; other keys give other values."""
    q, k, v, w, options = _emulated_case()
    options.update(dropout_rate=0.3)

    def loss(run, q, k, v):
        out, lse = run(q, k, v)
        return (out * w).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum(), (out, lse)

    @jax.jit  # (a compile instead of one an eager op)
    def packed(key):
        return jax.value_and_grad(
            lambda *a: loss(lambda *x: _packed_run(*x, key=key, **dict(options)), *a),
            argnums=(0, 1, 2), has_aux=True)(q, k, v)

    with emulated_kernels():
        got = packed(jax.random.key(5))
        other = packed(jax.random.key(6))
    want = jax.jit(jax.value_and_grad(lambda *a: loss(
        lambda *x: (lambda r: (r[0], r[1].lse))(
            ax.attention(*x, backend="reference", key=jax.random.key(5), **options)), *a),
        argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _close(got[0][1][0], want[0][1][0], 1e-5, "out")
    _close(got[0][1][1], want[0][1][1], 1e-5, "lse")
    for name, g_, w_ in zip("qkv", got[1], want[1]):
        _close(g_, w_, 1e-4, f"d{name}")
    assert float(jnp.abs(other[0][1][0] - got[0][1][0]).max()) > 0.1, "the key draws the mask"


def test_dropout_under_vmap_maps_the_calls_one_by_one():
    """The dropout counters use the batch index, so `jax.vmap` of a call with dropout runs
    the elements one after another (folding them into the batch would draw another mask):
    each mapped result equals the call of its element, gradients too."""
    q, k, v, _, options = _emulated_case(b=1)
    options = dict(causal=True, dropout_rate=0.25, q_segment_ids=options["q_segment_ids"],
                   kv_segment_ids=options["kv_segment_ids"])
    qs, ks, vs = (jnp.stack([x, -x, 0.5 * x]) for x in (q, k, v))
    key = jax.random.key(3)

    def one(q, k, v):
        return _packed_run(q, k, v, key=key, **dict(options))[0]

    with emulated_kernels():  # (jitted: a compile each instead of one an eager op)
        got = jax.jit(jax.vmap(one))(qs, ks, vs)
        grads = jax.jit(jax.grad(lambda *a: (jax.vmap(one)(*a) ** 2).sum(),
                                 argnums=(0, 1, 2)))(qs, ks, vs)
        one_jit = jax.jit(one)
        one_grad = jax.jit(jax.grad(lambda *a: (one(*a) ** 2).sum(), argnums=(0, 1, 2)))
        for i in range(3):
            _close(got[i], one_jit(qs[i], ks[i], vs[i]), 1e-6, f"out[{i}]")
            gi = one_grad(qs[i], ks[i], vs[i])
            for name, g_, w_ in zip("qkv", grads, gi):
                _close(g_[i], w_, 1e-5, f"d{name}[{i}]")


def test_dropout_is_not_chosen_for_a_whole_call():
    """The dispatch keeps cuDNN's generator for a whole call with dropout and segment ids (the
    Hopper kernels draw attnaux's mask for context parallelism), and says so."""
    problem = _problem(CASES[0])
    statics = parse_statics(scale=None, causal=True, window=None, softcap=None,
                            dropout_rate=0.1)
    a = problem.arrays
    dropped = canonicalize(a.q, a.k, a.v, statics, q_segment_ids=a.q_segment_ids,
                           kv_segment_ids=a.kv_segment_ids, key=jax.random.key(0))
    assert hpk._options_unavailable(dropped.options, False) == hpk.DROPOUT_NOT_CHOSEN


# ---- on a Hopper GPU
GPU_CASES = [  # (dim, kv heads, causal, window, softcap, seqlens, sink, kind)
    (128, 4, True, None, None, False, False, "docs"),
    (64, 2, False, None, None, False, True, "docs"),
    (128, 2, "bottom_right", None, 30.0, True, False, "docs"),
    (64, 4, False, (70, 30), None, True, False, "mixed"),
]


def _loss_and_grads(fn, q, k, v, w, u):
    def loss(q, k, v):
        out, aux = fn(q, k, v)
        return ((out.astype(jnp.float32) * w).sum()
                + (jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0) * u).sum()), (out, aux)
    (_, (out, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, aux, grads


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_segment_ids_on_hopper_match_the_reference(case):
    dim, kv_heads, causal, window, softcap, seqlens, sink, kind = case
    b, s, hq = 2, 700, 4
    rng = np.random.default_rng(1)
    keys = jax.random.split(jax.random.key(2), 5)
    q = jax.random.normal(keys[0], (b, s, hq, dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, kv_heads, dim), jnp.bfloat16)
    w = jax.random.normal(keys[3], (b, s, hq, dim), jnp.float32)
    u = jax.random.normal(keys[4], (b, hq, s), jnp.float32)
    seg = np.stack([_segments(kind, s, rng) for _ in range(b)])
    options = dict(causal=causal, window=window, softcap=softcap, q_segment_ids=seg,
                   kv_segment_ids=seg)
    if seqlens:
        options.update(q_seqlens=np.array([s, s - 90]), kv_seqlens=np.array([s - 33, s]))
    if sink:
        options.update(sink=jnp.linspace(-1.0, 1.0, hq))
    explanation = ax.explain(q, k, v, backend="flash", **options)
    assert "Hopper" in explanation.implementation, explanation
    got = _loss_and_grads(lambda q, k, v: ax.attention(q, k, v, backend="flash", **options),
                          q, k, v, w, u)
    want = _loss_and_grads(lambda q, k, v: ax.attention(q, k, v, backend="reference", **options),
                           q, k, v, w, u)
    _close(got[0], want[0], 3e-2, "out")
    _close(got[1].lse, want[1].lse, 1e-4, "lse")
    _close(got[1].max, want[1].max, 1e-4, "max")
    for name, g_, w_ in zip("qkv", got[2], want[2]):
        _close(g_, w_, 3e-2, f"d{name}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("causal", [True, "bottom_right"])
def test_varlen_on_hopper_matches_the_reference(causal):
    """Sequences with different query and key offsets, an empty one, one of one token, ones
    longer than a tile, tokens no sequence covers holding NaN (they must not leak)."""
    cu_q = jnp.array([0, 5, 5, 270, 530, 531], jnp.int32)
    cu_kv = jnp.array([0, 9, 200, 260, 550, 551], jnp.int32)
    total_q, total_kv, heads, kv_heads, dim = 560, 600, 4, 2, 128
    keys = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(keys[0], (total_q, heads, dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (total_kv, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (total_kv, kv_heads, dim), jnp.bfloat16)
    nan_q, nan_kv = jnp.arange(total_q) >= 531, jnp.arange(total_kv) >= 551
    q = jnp.where(nan_q[:, None, None], jnp.nan, q)
    k = jnp.where(nan_kv[:, None, None], jnp.nan, k)
    v = jnp.where(nan_kv[:, None, None], jnp.nan, v)
    w = jax.random.normal(keys[3], (total_q, heads, dim), jnp.float32)
    u = jax.random.normal(keys[4], (heads, total_q), jnp.float32)
    options = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=300, max_seqlen_kv=300,
                   causal=causal)
    saved = _dispatch.GPU_VARLEN_PREFERS_HOPPER
    _dispatch.GPU_VARLEN_PREFERS_HOPPER = True  # read at trace time
    jax.clear_caches()
    try:
        explanation = ax.explain(q, k, v, backend="flash", **options)
        assert "Hopper" in explanation.packed, explanation
        got = _loss_and_grads(lambda q, k, v: ax.varlen_attention(q, k, v, backend="flash",
                                                                  **options), q, k, v, w, u)
        # the forward alone zeroes V's padding only (q and k's NaN stay, masked by selection)
        alone = jax.jit(lambda q, k, v: ax.varlen_attention(q, k, v, backend="flash",
                                                            **options))(q, k, v)
    finally:
        _dispatch.GPU_VARLEN_PREFERS_HOPPER = saved
        jax.clear_caches()
    want = _loss_and_grads(lambda q, k, v: ax.varlen_attention(q, k, v, backend="reference",
                                                               **options), q, k, v, w, u)
    _close(got[0], want[0], 3e-2, "out")
    _close(got[1].lse, want[1].lse, 1e-4, "lse")
    _close(got[1].max, want[1].max, 1e-4, "max")
    _close(alone[0], want[0], 3e-2, "out (forward alone)")
    _close(alone[1].lse, want[1].lse, 1e-4, "lse (forward alone)")
    for name, g_, w_ in zip("qkv", got[2], want[2]):
        assert np.isfinite(np.asarray(g_, np.float32)).all(), f"d{name} not finite"
        _close(g_, w_, 3e-2, f"d{name}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_segment_ids_on_hopper_under_vmap_and_jit():
    """`jax.vmap` over a leading axis of calls with segment ids, inside `jax.jit`, with the
    gradient: equal to the reference backend."""
    rng = np.random.default_rng(4)
    keys = jax.random.split(jax.random.key(5), 4)
    shape = (3, 1, 300, 2, 64)
    q, k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys[:3])
    w = jax.random.normal(keys[3], shape, jnp.float32)
    seg = jnp.asarray(np.stack([_segments("docs", 300, rng)[None] for _ in range(3)]))

    def loss(q, k, v, backend):
        def one(q, k, v, seg):
            return ax.attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg,
                                backend=backend)[0]
        out = jax.vmap(one)(q, k, v, seg)
        return (out.astype(jnp.float32) * w).sum(), out

    got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "flash"), argnums=(0, 1, 2),
                                     has_aux=True))(q, k, v)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2),
                                      has_aux=True))(q, k, v)
    _close(got[0][1], want[0][1], 3e-2, "out")
    for name, g_, w_ in zip("qkv", got[1], want[1]):
        _close(g_, w_, 3e-2, f"d{name}")
