"""`score_mod` and `mask_mod` (`_mods.py`): the C++ kernels' score programs (`flash`, CPU) and the
blockwise `flex` backend against the materialised `reference` with the same functions, and all
against attnaux's built-in options spelled as
functions (softcap, causal, a precomputed ALiBi bias, segment ids), which the reference computes
by an independent path. float32 throughout; tolerances: 2e-5 relative to the largest entry for
outputs and statistics, 1e-4 for gradients (the blockwise sums run in another order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux as ax

B, S, HQ, HK, D = 2, 200, 4, 2, 16  # 200: two 128-row blocks, the second ragged
# score programs run in the CPU kernels; on a GPU `auto` gives the functions to flex
CPU = jax.default_backend() == "cpu"
COMPILED = "flash" if CPU else "flex"
cpu_only = pytest.mark.skipif(not CPU, reason="score programs run in the CPU kernels")


def _inputs(seed=0, s=S):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, s, HQ, D))
    k = jax.random.normal(ks[1], (B, s, HK, D))
    v = jax.random.normal(ks[2], (B, s, HK, D))
    w = jax.random.normal(ks[3], (B, s, HQ, D))
    u = jax.random.normal(ks[4], (B, HQ, s))
    return q, k, v, w, u


def _close(got, want, rel, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{what}: finiteness")
    scale = max(1.0, np.abs(want[finite]).max(initial=0.0))
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=rel * scale, err_msg=what)


def _run(q, k, v, w, u, params, make_options, backend):
    """out, lse, max and the gradients of `sum(out * w) + sum(lse * u)` (lse where finite) with
    respect to q, k, v and `params` (the arrays the functions close over)."""
    def loss(q, k, v, params):
        out, aux = ax.attention(q, k, v, backend=backend, **make_options(params))
        lse = jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)
        return jnp.sum(out * w) + jnp.sum(lse * u), (out, aux.lse, aux.max)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    grads, stats = grad(q, k, v, params)
    return stats, grads


def _alibi_table(seed=3):
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
    rel = 0.3 * jax.random.normal(jax.random.key(seed), (2 * S,))
    return {"slopes": slopes, "rel": rel}


CASES = {
    "alibi_rel_table_causal": lambda p: dict(
        causal=True,
        score_mod=lambda s, b, h, i, j: s + p["slopes"][h] * (j - i) + p["rel"][i - j + S]),
    "mask_mod_window_gqa": lambda p: dict(
        mask_mod=lambda b, h, i, j: (i - j < 70) & (j - i < 30),
        score_mod=lambda s, b, h, i, j: s * (1.0 + 0.1 * p["slopes"][h])),
    "softcap_lengths_sink": lambda p: dict(
        softcap=5.0, q_seqlens=jnp.asarray([200, 131]), kv_seqlens=jnp.asarray([97, 200]),
        sink=p["slopes"], score_mod=lambda s, b, h, i, j: s + p["rel"][j]),
    "prefix_lm_sliding_window_sink": lambda p: dict(
        sink=p["slopes"],
        mask_mod=lambda b, h, i, j: (j < 32) | ((j <= i) & (i - j < 64)),
        score_mod=lambda s, b, h, i, j: s * jnp.tanh(p["slopes"][h] * 4.0)),  # a tanh gate
    "segments_bottom_right_head_mask": lambda p: dict(
        causal="bottom_right", q_segment_ids=jnp.repeat(jnp.arange(4), 50)[None].repeat(B, 0),
        mask_mod=lambda b, h, i, j: (h != 1) | (j % 3 != 0),
        score_mod=lambda s, b, h, i, j: s - p["slopes"][h] * jnp.abs(i - j) / (b + 1)),
}


@pytest.mark.parametrize("backend", [pytest.param("flash", marks=cpu_only), "flex"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_backends_match_the_materialised_reference(name, backend):
    q, k, v, w, u = _inputs()
    params = _alibi_table()
    make = CASES[name]
    (out, lse, mx), grads = _run(q, k, v, w, u, params, make, backend)
    (r_out, r_lse, r_mx), r_grads = _run(q, k, v, w, u, params, make, "reference")
    _close(out, r_out, 2e-5, "out")
    _close(lse, r_lse, 2e-5, "lse")
    _close(mx, r_mx, 2e-5, "max")
    for n, g, r in zip(("dq", "dk", "dv"), grads[:3], r_grads[:3], strict=True):
        _close(g, r, 1e-4, n)
    for n in params:
        _close(grads[3][n], r_grads[3][n], 1e-4, f"d{n} (captured)")
    assert float(jnp.abs(r_grads[3]["slopes"]).max()) > 0  # the captured arrays matter here


@pytest.mark.parametrize("backend", [pytest.param("flash", marks=cpu_only),
                                     pytest.param("flex", marks=pytest.mark.slow if CPU else ()),
                                     pytest.param("reference", marks=pytest.mark.slow)])
def test_builtin_options_spelled_as_functions(backend):
    """Each spelling against the built-in option, through the reference without functions."""
    q, k, v, w, u = _inputs(1)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    alibi = slopes[:, None, None] * (j - i)[None]  # [H, S, S]
    seg = jnp.repeat(jnp.arange(5), 40)[None].repeat(B, 0)
    pairs = [
        (dict(score_mod=lambda s, b, h, i, j: 7.0 * jnp.tanh(s / 7.0)), dict(softcap=7.0)),
        (dict(mask_mod=lambda b, h, i, j: j <= i), dict(causal=True)),
        (dict(score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i), causal=True),
         dict(bias=alibi, causal=True)),
        (dict(mask_mod=lambda b, h, i, j: seg[b, i] == seg[b, j]),
         dict(q_segment_ids=seg, kv_segment_ids=seg)),
    ]
    for mods, builtin in pairs:
        (out, lse, mx), grads = _run(q, k, v, w, u, {}, lambda p, m=mods: m, backend)
        (r_out, r_lse, r_mx), r_grads = _run(q, k, v, w, u, {}, lambda p, b=builtin: b,
                                             "reference")
        what = f"{sorted(mods)} vs {sorted(builtin)}"
        _close(out, r_out, 2e-5, f"out, {what}")
        _close(lse, r_lse, 2e-5, f"lse, {what}")
        _close(mx, r_mx, 2e-5, f"max, {what}")
        for n, g, r in zip(("dq", "dk", "dv"), grads[:3], r_grads[:3], strict=True):
            _close(g, r, 1e-4, f"{n}, {what}")


def test_block_skipping_and_explain(monkeypatch):
    from attnaux import _flex

    monkeypatch.setattr(_flex, "BLOCK_Q", 128)  # fine tiles, to count what they skip
    monkeypatch.setattr(_flex, "BLOCK_K", 128)
    q, k, v, _, _ = _inputs(2, s=1024)
    e = ax.explain(q, k, v, mask_mod=lambda b, h, i, j: j <= i)
    # flex: 8 x 8 blocks of 128, causal visits 36 of them; the kernels: 136 of 16 x 16 tiles
    assert e.backend == COMPILED and "56.2% of the blocks" in e.reasons["flex"], str(e)
    if CPU:
        assert "keeps 53.1% of the 64 x 64 tiles" in e.reasons["flash"], str(e)
    # documents of 256 tokens: 4 groups of 2 x 2 blocks (of 4 x 4 tiles)
    doc = jnp.arange(1024) // 256
    e = ax.explain(q, k, v, mask_mod=lambda b, h, i, j: doc[i] == doc[j])
    assert "25.0% of the blocks" in e.reasons["flex"], str(e)
    if CPU:
        assert "keeps 25.0% of the 64 x 64 tiles" in e.reasons["flash"], str(e)
    # a mask_mod closing over a traced array cannot be evaluated at trace time: no skipping by it
    def traced(doc):
        return ax.explain(q, k, v, mask_mod=lambda b, h, i, j: doc[i] == doc[j])
    reasons = []
    jax.eval_shape(lambda d: reasons.append(traced(d).reasons) or 0, doc)
    assert "100.0% of the blocks" in reasons[0]["flex"] and "traced" in reasons[0]["flex"]
    if CPU:
        assert "traced" in reasons[0]["flash"] and "no tile skipped" in reasons[0]["flash"]
    out, aux = ax.attention(q[:, :256], k[:, :256], v[:, :256],
                            mask_mod=lambda b, h, i, j: j <= i)
    assert aux.backend == COMPILED
    out, aux = ax.attention(q[:, :256], k[:, :256], v[:, :256], backend="flex",
                            mask_mod=lambda b, h, i, j: j <= i)
    assert aux.backend == "flex"


def test_under_jit_and_vmap_with_a_traced_captured_array():
    q, k, v, _, _ = _inputs(4, s=64)
    rel = jax.random.normal(jax.random.key(5), (128,))

    @jax.jit
    def f(q, k, v, rel):
        return ax.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + rel[i - j + 64])

    out, aux = f(q, k, v, rel)
    r_out, r_aux = ax.attention(q, k, v, backend="reference",
                                score_mod=lambda s, b, h, i, j: s + rel[i - j + 64])
    _close(out, r_out, 2e-5, "out")
    _close(aux.lse, r_aux.lse, 2e-5, "lse")
    per_row = jax.vmap(lambda q, k, v: f(q, k, v, rel)[0])(q, k, v)  # unbatched rows
    _close(per_row, r_out, 2e-5, "vmap out")
    # a function of the batch index under vmap: each mapped call's own batch index (the compiled
    # kernels then map the elements one after another instead of folding them into one batch)
    def g(q, k, v):
        return ax.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * (1.0 + b))[0]

    stacked = jnp.stack([q, 2 * q]), jnp.stack([k, k]), jnp.stack([v, -v])
    mapped = jax.jit(jax.vmap(g))(*stacked)
    for n in range(2):
        _close(mapped[n], g(*(x[n] for x in stacked)), 2e-5, f"vmap with the batch index, {n}")


def test_bad_input_says_what_is_wrong():
    q, k, v, _, _ = _inputs(6, s=32)
    with pytest.raises(ValueError, match="backend='flex' serves calls with"):
        ax.attention(q, k, v, backend="flex")
    with pytest.raises(ValueError, match="'flash'.*'flex'.*'reference'.*got backend='probs'"):
        ax.attention(q, k, v, backend="probs", mask_mod=lambda b, h, i, j: j <= i)
    # a function outside what the kernels translate: flex serves it under auto (explain says
    # which operation stopped the translation); an explicit flash raises
    def wavy(s, b, h, i, j):
        return s + jnp.cos(i - j)

    why = "`score_mod` uses `cos`" if CPU else "Hopper"  # float32 inputs: not on the GPU kernels
    with pytest.raises(ValueError, match=f"backend='flash' cannot serve.*{why}"):
        ax.attention(q, k, v, backend="flash", score_mod=wavy)
    e = ax.explain(q, k, v, score_mod=wavy)
    assert e.backend == "flex" and why in e.reasons["flash"], str(e)
    with pytest.raises(ValueError, match="backend='flash' does not save the probabilities"):
        ax.attention(q, k, v, backend="flash", mask_mod=lambda b, h, i, j: j <= i,
                     return_probs=True)
    with pytest.raises(ValueError, match="`bias` does not combine"):
        ax.attention(q, k, v, bias=jnp.zeros((32, 32)), score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match="one float per logit"):
        ax.attention(q, k, v, score_mod=lambda s, b, h, i, j: jnp.stack([s, s]))
    def branchy(s, b, h, i, j):
        return s if i > j else -s  # Python control flow on a traced index

    with pytest.raises(ValueError, match="`score_mod` could not be traced"):
        ax.attention(q, k, v, score_mod=branchy)
    with pytest.raises(ValueError, match="one bool per pair"):
        ax.attention(q, k, v, mask_mod=lambda b, h, i, j: (j - i).astype(jnp.float32))
    out, aux = ax.attention(q, k, v, mask_mod=lambda b, h, i, j: j <= i, return_probs=True)
    assert aux.backend == "reference" and aux.probs.shape == (B, HQ, 32, 32)


def test_export_round_trip():
    """jax.export of a call with score_mod (the C++ kernels' score program: its attributes
    serialise), against the materialised reference."""
    q, k, v, _, _ = _inputs(7, s=64)
    rel = jax.random.normal(jax.random.key(8), (128,))

    def f(q, k, v, rel):
        return ax.attention(q, k, v, causal=True,
                            score_mod=lambda s, b, h, i, j: s + rel[i - j + 64])

    exported = jax.export.export(jax.jit(f))(q, k, v, rel)
    restored = jax.export.deserialize(exported.serialize())
    out, aux = restored.call(q, k, v, rel)
    want, want_aux = ax.attention(q, k, v, causal=True, backend="reference",
                                  score_mod=lambda s, b, h, i, j: s + rel[i - j + 64])
    assert aux.backend == COMPILED
    _close(out, want, 2e-5, "out")
    _close(aux.lse, want_aux.lse, 2e-5, "lse")


@pytest.mark.parametrize("backend", ["auto", "flex"])
def test_varlen_with_score_mod_equals_each_sequence_alone(backend):
    """varlen_attention with score_mod/mask_mod: each sequence as its own call (positions within
    the sequence), padding tokens 0 / -inf, and the captured table's gradient summed over them."""
    lens_q, lens_kv = [30, 70], [50, 70]
    cu_q = jnp.asarray([0, 30, 100], jnp.int32)
    cu_kv = jnp.asarray([0, 50, 120], jnp.int32)
    ks = jax.random.split(jax.random.key(11), 4)
    q = jax.random.normal(ks[0], (105, HQ, D))  # 5 padding tokens at the end
    k = jax.random.normal(ks[1], (120, HK, D))
    v = jax.random.normal(ks[2], (120, HK, D))
    rel = 0.3 * jax.random.normal(ks[3], (2 * S,))
    mods = dict(causal="bottom_right", score_mod=lambda s, b, h, i, j: s + rel[i - j + S],
                mask_mod=lambda b, h, i, j: j % 7 != 3)

    def packed(rel):
        m = dict(mods, backend=backend)
        m = dict(m, score_mod=lambda s, b, h, i, j: s + rel[i - j + S])
        out, aux = ax.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                       max_seqlen_q=70, max_seqlen_kv=70, **m)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(aux.lse), aux.lse, 0)), (out, aux)

    def alone(rel):
        total, outs, lses = 0.0, [], []
        m = dict(mods, score_mod=lambda s, b, h, i, j: s + rel[i - j + S])
        for a, (lq, lk) in enumerate(zip(lens_q, lens_kv, strict=True)):
            q0, k0 = sum(lens_q[:a]), sum(lens_kv[:a])
            out, aux = ax.attention(q[None, q0:q0 + lq], k[None, k0:k0 + lk],
                                    v[None, k0:k0 + lk], backend="reference", **m)
            total = total + jnp.sum(out**2) + jnp.sum(
                jnp.where(jnp.isfinite(aux.lse), aux.lse, 0))
            outs.append(out[0])
            lses.append(aux.lse[0])
        return total, (outs, lses)

    (_, (out, aux)), drel = jax.jit(jax.value_and_grad(packed, has_aux=True))(rel)
    (_, (outs, lses)), want_drel = jax.jit(jax.value_and_grad(alone, has_aux=True))(rel)
    assert aux.backend == (COMPILED if backend == "auto" else "flex")
    _close(out[:100], jnp.concatenate(outs), 2e-5, "out")
    _close(aux.lse[:, :100], jnp.concatenate(lses, axis=1), 2e-5, "lse")
    assert np.all(np.asarray(out[100:]) == 0) and np.all(np.isneginf(np.asarray(aux.lse[:, 100:])))
    _close(drel, want_drel, 1e-4, "d(captured table)")
    e = ax.explain(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=70,
                   max_seqlen_kv=70, backend=backend, **mods)
    assert e.backend == aux.backend and "padded" in e.packed


@pytest.mark.parametrize("backend", [pytest.param("flash", marks=cpu_only), "flex"])
def test_dropout_composes_with_the_functions(backend):
    """Dropout with score_mod and mask_mod: each backend draws attnaux's documented keep-mask
    at the global positions, so with the same key out and the gradients (captured arrays'
    included) equal the materialised reference's; lse and max do not see dropout. Without the
    key's mask (another key) they differ."""
    q, k, v, w, u = _inputs(11)
    params = _alibi_table(12)
    key = jax.random.key(13)

    def options(p, key=key):
        return dict(causal=True, dropout_rate=0.25, key=key,
                    mask_mod=lambda b, h, i, j: (i - j < 90),
                    score_mod=lambda s, b, h, i, j: s + p["slopes"][h] * (j - i))

    got = _run(q, k, v, w, u, params, options, backend)
    want = _run(q, k, v, w, u, params, options, "reference")
    for name, g_, w_ in zip(("out", "lse", "max"), got[0], want[0]):
        _close(g_, w_, 2e-5, name)
    for name, g_, w_ in zip(("dq", "dk", "dv", "dparams"), got[1], want[1]):
        for leaf_g, leaf_w in zip(jax.tree.leaves(g_), jax.tree.leaves(w_)):
            _close(leaf_g, leaf_w, 1e-4, name)
    other = _run(q, k, v, w, u, params, lambda p: options(p, jax.random.key(14)), backend)
    assert np.abs(np.asarray(other[0][0]) - np.asarray(want[0][0])).max() > 1e-2


# ---- lengths and segment ids folded into the mask_mod (how the Hopper kernels serve them)
RULE_CASES = {
    "lengths_bottom_right_window": dict(causal="bottom_right", window=(40, 0),
                                        lengths=([150, 37], [200, 120])),
    "lengths_top_left_segments": dict(causal=True, lengths=([200, 90], [170, 200]),
                                      segments=True),
    "segments_large_ids_no_causal": dict(segments=True, big_ids=True),
}


@pytest.mark.parametrize("name", sorted(RULE_CASES))
def test_rules_folded_into_the_mask_mod_equal_the_call(name):
    """`_mods.rules_as_mask` (on a Hopper GPU the call then runs on attnaux's kernels): the
    rewritten call (static rules only, the lengths / ids / moving diagonal in the mask_mod, q,
    k, v zeroed past the lengths) gives the original call's out, lse, max and gradients, both
    materialised (`reference_attention`), with NaN stored past the lengths and segment ids
    beyond float32's exact integers (the ids are compared in two halves)."""
    from attnaux import _flex, _mods
    from attnaux._canon import canonicalize, parse_statics
    from attnaux._reference import reference_attention

    case = RULE_CASES[name]
    q, k, v, w, u = _inputs(seed=7)
    extra = {}
    if "lengths" in case:
        q_len, kv_len = (jnp.asarray(x, jnp.int32) for x in case["lengths"])
        extra.update(q_seqlens=q_len, kv_seqlens=kv_len)
        past_q = jnp.arange(S)[None, :, None, None] >= q_len[:, None, None, None]
        past_kv = jnp.arange(S)[None, :, None, None] >= kv_len[:, None, None, None]
        q = jnp.where(past_q, jnp.nan, q)
        k, v = (jnp.where(past_kv, jnp.nan, x) for x in (k, v))
    if case.get("segments"):
        ids = np.sort(np.random.default_rng(2).integers(0, 4, (B, S)), axis=1)
        if case.get("big_ids"):  # equal as float32 (2**24 + 1 rounds to 2**24), not as int32
            ids = np.where(ids % 2 == 0, 2**24, 2**24 + 1) + 8192 * (ids // 2)
        ids = jnp.asarray(ids, jnp.int32)
        extra.update(q_segment_ids=ids, kv_segment_ids=ids)
    statics = parse_statics(scale=None, causal=case.get("causal", False),
                            window=case.get("window"), softcap=None, dropout_rate=0.0)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])

    def score_mod(s, b, h, i, j):
        return s - slopes[h] * jnp.abs(i - j) / S

    def mask_mod(b, h, i, j):
        return (i + j + h) % 7 != 0

    def run(rewrite):
        def loss(q, k, v):
            problem = canonicalize(q, k, v, statics, **extra)
            masks = mask_mod
            if rewrite:
                problem, masks = _mods.rules_as_mask(problem, mask_mod)
                assert problem.arrays.q_segment_ids is None and not problem.options.has_seqlens
            mods, consts = _flex.convert(score_mod, masks)
            out, lse, mx, _ = reference_attention(problem.arrays, problem.options,
                                                  return_probs=False, mods=mods, consts=consts)
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return (jnp.sum(jnp.where(jnp.isnan(out), 0.0, out) * w[:, :, :, :D])
                    + jnp.sum(finite * u), (out, lse, mx))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    if "lengths" in case:  # what the kernels read past the lengths: zeros, not the NaN
        arrays = _mods.rules_as_mask(canonicalize(q, k, v, statics, **extra), mask_mod)[0].arrays
        for x, past in ((arrays.q, past_q), (arrays.k, past_kv), (arrays.v, past_kv)):
            assert bool(jnp.all(jnp.where(past, x == 0, True))), "not zeroed past the lengths"
    (grads, stats), (want_grads, want_stats) = run(True), run(False)
    for got, want, what in zip(stats, want_stats, ("out", "lse", "max"), strict=True):
        _close(got, want, 2e-5, what)
    if "lengths" in case:
        assert np.isfinite(np.asarray(stats[0])).all(), "NaN past the lengths reached out"
    for got, want, what in zip(grads, want_grads, ("dq", "dk", "dv"), strict=True):
        _close(jnp.where(jnp.isnan(want), 0.0, got), jnp.where(jnp.isnan(want), 0.0, want),
               1e-4, what)
