"""The `reference` backend against the independent float64 NumPy oracle (`tests/oracle.py`).

- forward (out, lse, max, probs) over every option of `attnaux.attention` and combinations of
  them, odd lengths, q_seq != kv_seq both ways, zero-length sequences, GQA/MQA, zero to two batch
  dims, the three input dtypes;
- gradients (q, k, v, bias, sink; through `out` and through `aux.lse`) against central finite
  differences of the oracle in float64, on tiny problems;
- the lse identity `lse = max + log(sum(exp(logits - max)))` against float64 logits;
- the conventions every backend keeps (rows without a visible key, padding rows, NaN/inf in
  invisible inputs, `aux.max` without gradient, stats dtypes), run for `reference` and, when it is
  built, `flash`;
- a few checks of the oracle itself against closed forms, so that its own mistakes show.
"""

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import (
    assert_close,
    attention_and_grads,
    dtype_id,
    every_other,
    loss_weights,
    make_inputs,
    make_options,
    probe_loss,
    requires_flash,
    tol,
)

import attnaux

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def case(name, *, batch=(2,), sq=5, skv=7, hq=4, hkv=2, d=8, dv=None, dtype=F32, seed=0, **opts):
    """A test case: shapes plus `make_options` specs / static options, with a readable id."""
    shape = dict(batch=batch, sq=sq, skv=skv, hq=hq, hkv=hkv, d=d, dv=d if dv is None else dv,
                 dtype=dtype, seed=seed)
    return pytest.param(shape, opts, id=f"{name}-{dtype_id(dtype)}")


def build(shape, opts):
    """`(q, k, v, options)` of a case, the inputs rounded to its dtype."""
    s = shape
    q, k, v = make_inputs(s["seed"], s["batch"], s["sq"], s["skv"], s["hq"], s["hkv"], s["d"],
                          s["dv"], s["dtype"])
    options = make_options(s["seed"] + 1, s["batch"], s["sq"], s["skv"], s["hq"], **opts)
    return q, k, v, options


FORWARD_CASES = [
    case("plain"),
    case("scale", scale=0.7),
    case("scale-large", scale=2.5),
    # bias, broadcast every way the API allows
    case("bias-BHQK", bias="BHQK"),
    case("bias-B1QK", bias="B1QK"),
    case("bias-11QK", bias="b1QK"),
    case("bias-HQK", bias="HQK"),
    case("bias-QK", bias="QK"),
    case("bias-BH1K", bias="BH1K"),
    case("bias-1HQ1", bias="bHQ1"),
    # boolean mask, broadcast (random, so some rows are fully masked)
    case("mask-BHQK", mask="BHQK"),
    case("mask-1HQK", mask="bHQK"),
    case("mask-QK", mask="QK"),
    case("mask-B11K", mask="B11K"),
    case("mask-row-fully-masked", skv=2, mask="BHQK", seed=3),
    # causal
    case("causal-true", causal=True),
    case("causal-top_left", causal="top_left"),
    case("causal-top_left-sq>skv", sq=9, skv=4, causal="top_left"),
    case("causal-bottom_right", causal="bottom_right"),
    case("causal-bottom_right-sq>skv", sq=9, skv=4, causal="bottom_right"),
    # sliding window, alone and shifted like the causal alignment
    case("window-2-1", window=(2, 1)),
    case("window-0-0", window=(0, 0)),
    case("window-None-0", window=(None, 0)),
    case("window-1-None", window=(1, None)),
    case("window-None-None", window=(None, None)),
    case("window-2-0-causal", window=(2, 0), causal=True),
    case("window-1-2-bottom_right", window=(1, 2), causal="bottom_right"),
    case("window-3-1-bottom_right-sq>skv", sq=9, skv=4, window=(3, 1), causal="bottom_right"),
    # padding
    case("q_seqlens", q_seqlens=[3, 0]),
    case("kv_seqlens", kv_seqlens=[7, 4]),
    case("seqlens-zero-and-full", q_seqlens=[0, 5], kv_seqlens=[7, 0]),
    case("seqlens-rand", batch=(4,), q_seqlens="rand", kv_seqlens="rand"),
    case("seqlens-over-clamped", q_seqlens=[9, 5], kv_seqlens=[99, -3]),
    case("seqlens-bottom_right", q_seqlens=[3, 5], kv_seqlens=[6, 2], causal="bottom_right"),
    case("seqlens-top_left", q_seqlens=[3, 5], kv_seqlens=[6, 2], causal=True),
    case("seqlens-window-bottom_right", q_seqlens=[4, 2], kv_seqlens=[5, 7], window=(1, 1),
         causal="bottom_right"),
    # packing
    case("segments-2", segments=2),
    case("segments-3-sq=skv", sq=8, skv=8, segments=3),
    case("segments-causal", sq=8, skv=8, segments=3, causal=True),
    case("segments-seqlens", segments=2, q_seqlens=[4, 2], kv_seqlens=[5, 7]),
    # softcap and sink
    case("softcap", softcap=2.0, scale=3.0),
    case("softcap-bias", softcap=1.5, bias="BHQK"),
    case("sink", sink=True),
    case("sink-seqlens-mask", sink=True, q_seqlens=[3, 5], kv_seqlens=[0, 7], mask="BHQK"),
    # heads
    case("gqa-8-2", hq=8, hkv=2),
    case("mqa-8-1", hq=8, hkv=1),
    case("mha-3-3", hq=3, hkv=3),
    # batch dims
    case("batch-none", batch=()),
    case("batch-none-bias-HQK-causal", batch=(), bias="HQK", causal="bottom_right"),
    case("batch-2x3", batch=(2, 3), bias="bHQK", q_seqlens="rand"),
    case("batch-2x3-bias-1BHQK", batch=(2, 3), bias=(1, 3, 4, 5, 7)),
    case("batch-zero", batch=(0,)),
    # lengths
    case("sq1-skv1", sq=1, skv=1),
    case("sq1", sq=1, skv=13, causal="bottom_right"),
    case("skv1", sq=13, skv=1, causal=True),
    case("sq0", sq=0, skv=5),
    case("skv0", sq=5, skv=0),
    case("skv0-sink", sq=5, skv=0, sink=True),
    case("odd-11-17", sq=11, skv=17, d=5, dv=3, causal="bottom_right"),
    case("dv!=d", d=8, dv=3),
    # everything at once
    case("all", batch=(2, 2), hq=4, hkv=2, sq=9, skv=11, bias="BHQK", mask="bHQK",
         causal="bottom_right", window=(4, 1), q_seqlens="rand", kv_seqlens="rand", segments=2,
         softcap=3.0, sink=True, scale=0.9),
    case("all-mqa-top_left", batch=(3,), hq=4, hkv=1, sq=10, skv=6, bias="QK", mask="B1QK",
         causal=True, window=(None, 2), q_seqlens=[10, 7, 0], segments=3, sink=True),
    # low precision inputs (float32 accumulation inside; out and probs in the input dtype)
    case("plain", dtype=BF16),
    case("plain", dtype=F16),
    case("bias-mask-causal", dtype=BF16, bias="B1QK", mask="BHQK", causal="bottom_right"),
    case("bias-mask-causal", dtype=F16, bias="B1QK", mask="BHQK", causal="bottom_right"),
    case("gqa-seqlens-segments", dtype=BF16, hq=8, hkv=2, q_seqlens=[2, 5], segments=2),
    case("softcap-sink-window", dtype=F16, softcap=2.0, sink=True, window=(1, 0)),
]


@pytest.mark.parametrize("shape,opts", every_other(FORWARD_CASES))
def test_forward_matches_oracle(shape, opts):
    q, k, v, options = build(shape, opts)
    out, aux = attnaux.attention(q, k, v, backend="reference", return_probs=True, **options)
    want_out, want_lse, want_max, want_probs = oracle.attention(q, k, v, **options)

    dtype = shape["dtype"]
    assert out.dtype == dtype and out.shape == want_out.shape
    assert aux.lse.dtype == jnp.float32 and aux.max.dtype == jnp.float32
    assert aux.backend == "reference" and aux.rng_state is None
    assert aux.probs.dtype == (jnp.float32 if dtype == F32 else dtype)
    assert_close(out, want_out, tol(dtype, "out"), "out")
    assert_close(aux.lse, want_lse, tol(dtype, "lse"), "lse")
    assert_close(aux.max, want_max, tol(dtype, "lse"), "max")
    assert_close(aux.probs, want_probs, tol(dtype, "out"), "probs")


# ------------------------------------------------------------------------------------------------
# The lse identity against float64 NumPy
# ------------------------------------------------------------------------------------------------
IDENTITY_CASES = [
    case("plain", sq=9, skv=13),
    case("bias-mask-causal", bias="B1QK", mask="BHQK", causal="bottom_right"),
    case("large-logits", scale=8.0),  # exp(logits) would overflow float32 without the max shift
    case("softcap-sink-seqlens", softcap=2.0, sink=True, q_seqlens=[3, 0], kv_seqlens=[7, 2]),
    case("bf16-segments-window", dtype=BF16, segments=2, window=(1, 1)),
]


@pytest.mark.parametrize("shape,opts", IDENTITY_CASES)
def test_lse_identity(shape, opts):
    """aux.lse == aux.max + log(sum(exp(logits - aux.max))) with float64 logits (plus the sink)."""
    q, k, v, options = build(shape, opts)
    _, aux = attnaux.attention(q, k, v, backend="reference", **options)
    logits, _ = oracle.scores(q, k, **{n: x for n, x in options.items() if n != "sink"})
    want = oracle.lse_from_max(aux.max, logits, options.get("sink"))
    assert_close(aux.lse, want, (1e-6, 1e-6), "lse vs max + log(sum(exp(logits - max)))")
    # and the oracle agrees with itself through the same identity
    _, o_lse, o_max, _ = oracle.attention(q, k, v, **options)
    assert_close(oracle.lse_from_max(o_max, logits, options.get("sink")), o_lse, (1e-12, 1e-12),
                 "oracle lse identity")
    if options.get("sink") is None:  # without a sink, max <= lse <= max + log(kv_seq)
        fin = np.isfinite(np.asarray(aux.max))
        lse, mx = np.asarray(aux.lse)[fin], np.asarray(aux.max)[fin]
        assert np.all(lse >= mx) and np.all(lse <= mx + np.log(shape["skv"]) + 1e-5)


# ------------------------------------------------------------------------------------------------
# Gradients against central finite differences of the float64 oracle
# ------------------------------------------------------------------------------------------------
GRAD_CASES = [
    case("plain", batch=(2,), sq=3, skv=4, hq=2, hkv=1, d=3, dv=2),
    case("bias-B1QK-causal", batch=(2,), sq=3, skv=4, hq=2, hkv=2, d=3, dv=2, bias="B1QK",
         causal=True),
    case("bias-QK-batch2x2", batch=(2, 2), sq=3, skv=2, hq=2, hkv=1, d=2, dv=2, bias="QK"),
    case("bias-HQK-nobatch-bottom_right", batch=(), sq=4, skv=3, hq=2, hkv=1, d=3, dv=3,
         bias="HQK", causal="bottom_right"),
    case("mask-seqlens", batch=(2,), sq=4, skv=4, hq=2, hkv=1, d=3, dv=2, mask="BHQK",
         q_seqlens=[3, 0], kv_seqlens=[4, 2], bias="BHQK"),
    case("window-segments", batch=(1,), sq=5, skv=5, hq=2, hkv=1, d=2, dv=2, window=(1, 1),
         causal="bottom_right", segments=2),
    case("softcap-sink", batch=(2,), sq=3, skv=4, hq=2, hkv=1, d=3, dv=2, softcap=1.5,
         scale=2.0, sink=True, bias="bHQK"),
    case("sink-fully-masked-rows", batch=(2,), sq=3, skv=3, hq=2, hkv=2, d=2, dv=2, sink=True,
         q_seqlens=[2, 3], kv_seqlens=[3, 0]),
    case("mqa-all", batch=(1,), sq=4, skv=5, hq=3, hkv=1, d=2, dv=3, bias="1HQK", mask="QK",
         causal="bottom_right", window=(2, None), kv_seqlens=[4], softcap=2.0, sink=True),
]


def _oracle_loss(params, options, w, u):
    opts = dict(options)
    for name in ("bias", "sink"):
        if name in params:
            opts[name] = params[name]
    out, lse, _, _ = oracle.attention(params["q"], params["k"], params["v"], **opts)
    return probe_loss(out, lse, np.asarray(w, np.float64), np.asarray(u, np.float64))


def _finite_differences(params, options, w, u, h=1e-6):
    grads = {}
    for name, x in params.items():
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = dict(params), dict(params)
            plus[name], minus[name] = x.copy(), x.copy()
            plus[name][idx] += h
            minus[name][idx] -= h
            diff = _oracle_loss(plus, options, w, u) - _oracle_loss(minus, options, w, u)
            g[idx] = diff / (2 * h)
        grads[name] = g
    return grads


@pytest.mark.parametrize("shape,opts", GRAD_CASES)
def test_gradients_match_finite_differences(shape, opts):
    q, k, v, options = build(shape, opts)
    w, u = loss_weights(shape["seed"], q, v)
    _, _, grads = attention_and_grads(q, k, v, w, u, backend="reference", **options)
    params = {"q": q, "k": k, "v": v}
    params.update({n: options[n] for n in ("bias", "sink") if n in options})
    params = {n: np.asarray(x, np.float64) for n, x in params.items()}
    static = {n: x for n, x in options.items() if n not in ("bias", "sink")}
    want = _finite_differences(params, static, w, u)
    assert set(grads) == set(want)
    for name in want:
        assert grads[name].shape == want[name].shape, name
        assert_close(grads[name], want[name], (1e-4, 1e-5), f"d{name}")


def test_gradient_through_lse_alone():
    """A z-loss on lse alone: d/dq sum(lse**2) against finite differences of the oracle."""
    q, k, v = make_inputs(5, (1,), 3, 4, 2, 1, 3, 2)

    def zloss(q):
        _, aux = attnaux.attention(q, k, v, causal=True, backend="reference")
        return jnp.sum(aux.lse**2)

    got = jax.grad(zloss)(q)
    q64 = np.asarray(q, np.float64)
    want = np.zeros_like(q64)
    for idx in np.ndindex(q64.shape):
        qp, qm = q64.copy(), q64.copy()
        qp[idx] += 1e-6
        qm[idx] -= 1e-6
        lp = np.sum(oracle.attention(qp, k, v, causal=True)[1] ** 2)
        lm = np.sum(oracle.attention(qm, k, v, causal=True)[1] ** 2)
        want[idx] = (lp - lm) / 2e-6
    assert_close(got, want, (1e-4, 1e-5), "d sum(lse^2) / dq")


# ------------------------------------------------------------------------------------------------
# Conventions every backend keeps (reference always; flash once it is built)
# ------------------------------------------------------------------------------------------------
BACKENDS = ["reference", pytest.param("flash", marks=requires_flash)]


def _assert_all_finite(tree, what):
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{what}{jax.tree_util.keystr(path)}"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_visible_key(backend, dtype):
    """Fully masked rows and padding rows: out 0, lse = max = -inf, zero and finite gradients."""
    batch, sq, skv, hq = (2,), 4, 6, 2
    q, k, v = make_inputs(0, batch, sq, skv, hq, 1, 8, 8, dtype)
    mask = np.ones((2, hq, sq, skv), bool)
    mask[0, 1, 2, :] = False  # one row fully masked
    q_seqlens = jnp.array([4, 1], jnp.int32)  # batch 1: rows 1.. are padding
    kv_seqlens = jnp.array([6, 6], jnp.int32)
    w, u = loss_weights(0, q, v)
    out, aux, grads = attention_and_grads(
        q, k, v, w, u, backend=backend, mask=jnp.asarray(mask), q_seqlens=q_seqlens,
        kv_seqlens=kv_seqlens, bias=jnp.zeros((2, 1, sq, skv)))
    out, lse, mx = np.asarray(out, np.float32), np.asarray(aux.lse), np.asarray(aux.max)
    empty = np.zeros((2, hq, sq), bool)
    empty[0, 1, 2] = True
    empty[1, :, 1:] = True
    assert np.all(out.transpose(0, 2, 1, 3)[empty] == 0)
    assert np.all(lse[empty] == -np.inf) and np.all(mx[empty] == -np.inf)
    assert np.all(np.isfinite(lse[~empty])) and np.all(np.isfinite(mx[~empty]))
    _assert_all_finite(grads, "grad")
    dq = np.asarray(grads["q"], np.float32)
    assert np.all(dq[1, 1:] == 0), "padding query rows must get zero dq"
    assert np.all(dq[0, 2, 1] == 0), "a fully masked row must get zero dq"
    dbias = np.asarray(grads["bias"])
    assert np.all(dbias[1, :, 1:] == 0)

    # with a sink, the empty rows have lse = sink (and still out 0)
    sink = jnp.array([0.5, -1.0], jnp.float32)
    out, aux, grads = attention_and_grads(
        q, k, v, w, u, backend=backend, mask=jnp.asarray(mask), q_seqlens=q_seqlens, sink=sink)
    lse = np.asarray(aux.lse)
    want = np.broadcast_to(np.asarray(sink)[None, :, None], lse.shape)
    assert np.all(lse[empty] == want[empty])
    assert np.all(np.asarray(aux.max)[empty] == -np.inf)
    assert np.all(np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty] == 0)
    _assert_all_finite(grads, "grad with sink")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_invisible_inputs_does_not_leak(backend):
    """NaN/inf in q rows past q_seqlens, k/v rows past kv_seqlens and invisible bias entries
    change nothing: outputs and gradients equal those with zeros there."""
    batch, sq, skv, hq, hkv = (2,), 5, 7, 4, 2
    q, k, v = make_inputs(1, batch, sq, skv, hq, hkv, 8, 8)
    bias = np.random.default_rng(2).standard_normal((2, hq, sq, skv)).astype(np.float32)
    q_seqlens, kv_seqlens = np.array([3, 5]), np.array([7, 4])
    opts = dict(q_seqlens=jnp.asarray(q_seqlens, jnp.int32),
                kv_seqlens=jnp.asarray(kv_seqlens, jnp.int32), causal=True)
    _, visible = oracle.scores(q, k, **opts)

    def poison(x, rows, value):
        x = np.array(x)
        for b in range(2):
            x[b, rows[b]:] = value
        return jnp.asarray(x)

    clean = dict(q=poison(q, q_seqlens, 0), k=poison(k, kv_seqlens, 0), v=poison(v, kv_seqlens, 0),
                 bias=jnp.asarray(np.where(visible, bias, 0)))
    dirty = dict(q=poison(q, q_seqlens, np.nan), k=poison(k, kv_seqlens, np.inf),
                 v=poison(v, kv_seqlens, np.nan),
                 bias=jnp.asarray(np.where(visible, bias, np.nan)))
    dirty["bias"] = dirty["bias"].at[1, 0, 0, 1].set(np.inf)  # invisible (causal)
    w, u = loss_weights(1, q, v)
    results = []
    for a in (clean, dirty):
        out, aux, grads = attention_and_grads(a["q"], a["k"], a["v"], w, u, backend=backend,
                                              bias=a["bias"], **opts)
        _assert_all_finite((out, grads), f"{backend} with NaN/inf in invisible inputs: ")
        results.append((out, aux.lse, aux.max, grads))
    (o1, l1, m1, g1), (o2, l2, m2, g2) = results
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    np.testing.assert_array_equal(np.asarray(m1), np.asarray(m2))
    for name in g1:
        np.testing.assert_array_equal(np.asarray(g1[name]), np.asarray(g2[name]), err_msg=name)
    # gradients of padding k/v rows and invisible bias entries are exactly zero
    for b in range(2):
        assert np.all(np.asarray(g2["k"])[b, kv_seqlens[b]:] == 0)
        assert np.all(np.asarray(g2["v"])[b, kv_seqlens[b]:] == 0)
    assert np.all(np.asarray(g2["bias"])[~visible] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_masked_rows_does_not_leak(backend):
    """NaN in k/v rows that the mask or the segment ids hide from every query, and in q rows the
    mask hides from every key, changes nothing (outputs and gradients equal those with zeros)."""
    sq, skv, hq, hkv = 6, 8, 4, 2
    q, k, v = make_inputs(7, (2,), sq, skv, hq, hkv, 8, 8)
    mask = np.ones((2, 1, sq, skv), bool)
    mask[0, :, :, 2] = False  # key 2 of batch 0: masked for every query and head
    mask[1, :, 4, :] = False  # query row 4 of batch 1: masked from every key
    q_seg = np.zeros((2, sq), np.int32)
    kv_seg = np.zeros((2, skv), np.int32)
    kv_seg[1, 6:] = 9  # keys 6, 7 of batch 1: a segment no query belongs to
    hidden_k = [(0, 2), (1, 6), (1, 7)]
    hidden_q = [(1, 4)]
    bias = jnp.asarray(np.random.default_rng(7).standard_normal((2, hq, sq, skv)), jnp.float32)
    opts = dict(mask=jnp.asarray(mask), q_segment_ids=jnp.asarray(q_seg),
                kv_segment_ids=jnp.asarray(kv_seg), bias=bias, causal="bottom_right")
    w, u = loss_weights(7, q, v)
    results = []
    for value in (0.0, np.nan):
        qq, kk, vv = (np.array(x) for x in (q, k, v))
        for b, j in hidden_k:
            kk[b, j], vv[b, j] = value, value
        for b, i in hidden_q:
            qq[b, i] = value
        out, aux, grads = attention_and_grads(jnp.asarray(qq), jnp.asarray(kk), jnp.asarray(vv),
                                              w, u, backend=backend, **opts)
        _assert_all_finite((out, grads), f"{backend}, value {value}: ")
        results.append((out, aux.lse, aux.max, grads))
    (o1, l1, m1, g1), (o2, l2, m2, g2) = results
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    np.testing.assert_array_equal(np.asarray(m1), np.asarray(m2))
    for name in g1:
        np.testing.assert_array_equal(np.asarray(g1[name]), np.asarray(g2[name]), err_msg=name)
    for b, j in hidden_k:
        assert np.all(np.asarray(g2["k"])[b, j] == 0) and np.all(np.asarray(g2["v"])[b, j] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_shift_invariance_with_very_negative_logits(backend):
    """Adding a constant c to one row of the bias shifts that row's lse and max by c and changes
    nothing else: out and every gradient stay the same. With c = -120 every visible logit of the
    row is below -88, where exp(-logit) overflows float32; the gradients must stay finite (no
    inf * 0 from exponentials of invisible entries)."""
    sq, skv, hq = 5, 7, 2
    q, k, v = make_inputs(8, (2,), sq, skv, hq, 1, 8, 8)
    bias0 = np.random.default_rng(8).standard_normal((2, hq, sq, skv)).astype(np.float32)
    bias1 = bias0.copy()
    bias1[0, 1, 0, :] -= 120.0  # causal row 0 sees key 0 only: its logit becomes ~ -120
    bias1[1, 0, 3, :] -= 120.0
    w, u = loss_weights(8, q, v)
    res = [attention_and_grads(q, k, v, w, u, backend=backend, bias=jnp.asarray(b), causal=True)
           for b in (bias0, bias1)]
    (o0, a0, g0), (o1, a1, g1) = res
    _assert_all_finite(g1, f"{backend} gradients with a row of logits near -120: ")
    shift = np.zeros((2, hq, sq))
    shift[0, 1, 0] = shift[1, 0, 3] = -120.0
    tol_ = (1e-4, 1e-4)  # float32 logits near -120 carry an absolute rounding of ~8e-6
    assert_close(o1, o0, tol_, "out")
    assert_close(a1.lse, np.asarray(a0.lse) + shift, tol_, "lse")
    assert_close(a1.max, np.asarray(a0.max) + shift, tol_, "max")
    for name in g0:
        # the lse term of the loss adds u * c to the loss, which has no gradient
        assert_close(g1[name], g0[name], tol_, f"d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_has_no_gradient(backend):
    q, k, v = make_inputs(2, (2,), 5, 6, 2, 1, 8, 8)

    def f(q, k):
        _, aux = attnaux.attention(q, k, v, causal=True, backend=backend)
        return jnp.sum(aux.max)

    gq, gk = jax.grad(f, argnums=(0, 1))(q, k)
    assert np.all(np.asarray(gq) == 0) and np.all(np.asarray(gk) == 0)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_output_and_stats_dtypes(backend, dtype):
    q, k, v = make_inputs(3, (2, 1), 3, 4, 2, 2, 8, 5, dtype)
    out, aux = attnaux.attention(q, k, v, backend=backend)
    assert out.dtype == dtype and out.shape == (2, 1, 3, 2, 5)
    assert aux.lse.dtype == jnp.float32 and aux.lse.shape == (2, 1, 2, 3)
    assert aux.max.dtype == jnp.float32 and aux.max.shape == (2, 1, 2, 3)
    assert aux.backend == backend and aux.probs is None and aux.rng_state is None


USAGE_CASES = [
    case("mask-BHQK-gqa", sq=5, skv=11, mask="BHQK"),
    case("mask-bHQK", sq=6, skv=6, mask="bHQK"),
    case("mask-B11K", sq=4, skv=9, mask="B11K"),
    case("segments", sq=7, skv=7, segments=3),
    case("segments-bottom_right-seqlens", sq=6, skv=10, segments=2, causal="bottom_right",
         kv_seqlens="edges"),
    case("mask-QK-window-seqlens", sq=8, skv=8, mask="QK", window=(2, 1), q_seqlens="rand"),
    case("mask-BHQK-mqa", sq=3, skv=5, hq=4, hkv=1, mask="BHQK", seed=4),
]


@pytest.mark.parametrize("block", [3, 512], ids=["blocks-of-3", "one-block"])
@pytest.mark.parametrize("shape,opts", USAGE_CASES)
def test_row_usage_matches_oracle(shape, opts, block, monkeypatch):
    """`_masking.row_usage`: which q rows and which k/v rows take part in at least one visible
    pair
    (the rows `zero_hidden_rows` keeps), computed a block of keys at a time (several blocks, the
    last one partial, and a single block), against the oracle's per-row visibility."""
    from attnaux import _masking
    from attnaux._internal import canonical_problem

    monkeypatch.setattr(_masking, "_USAGE_BLOCK", block)
    q, k, v, options = build(shape, opts)
    problem = canonical_problem(q, k, v, **options)
    q_rows, kv_rows = _masking.row_usage(problem.arrays, problem.options)
    _, visible = oracle.scores(q, k, **{n: x for n, x in options.items() if n != "sink"})
    sq, skv, hq, group = q.shape[-3], k.shape[-3], q.shape[-2], q.shape[-2] // k.shape[-2]
    vis = visible.reshape(-1, hq, sq, skv)
    nb = vis.shape[0]
    want_q = vis.any(axis=3).transpose(0, 2, 1)  # [B, Sq, Hq]
    want_kv = vis.reshape(nb, hq // group, group, sq, skv).any(axis=(2, 3)).transpose(0, 2, 1)
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(q_rows), want_q.shape), want_q)
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(kv_rows), want_kv.shape), want_kv)


# ------------------------------------------------------------------------------------------------
# The oracle itself, against closed forms
# ------------------------------------------------------------------------------------------------
def test_oracle_uniform_rows():
    """q = 0 makes every visible logit 0: probs uniform over the visible keys, lse = log(count),
    max = 0 and out the mean of the visible values (causal bottom-right with padding)."""
    rng = np.random.default_rng(0)
    sq, skv = 4, 6
    q = np.zeros((2, sq, 1, 3))
    k = rng.standard_normal((2, skv, 1, 3))
    v = rng.standard_normal((2, skv, 1, 2))
    out, lse, mx, probs = oracle.attention(q, k, v, causal="bottom_right",
                                           q_seqlens=np.array([4, 2]), kv_seqlens=np.array([6, 3]))
    for b, (ql, kl) in enumerate([(4, 6), (2, 3)]):
        for i in range(sq):
            if i >= ql:
                assert lse[b, 0, i] == -np.inf and mx[b, 0, i] == -np.inf
                assert np.all(out[b, i] == 0) and np.all(probs[b, 0, i] == 0)
                continue
            n = i + (kl - ql) + 1  # keys 0 .. i + off
            np.testing.assert_allclose(lse[b, 0, i], np.log(n), rtol=1e-14)
            assert mx[b, 0, i] == 0
            np.testing.assert_allclose(probs[b, 0, i, :n], 1 / n, rtol=1e-14)
            assert np.all(probs[b, 0, i, n:] == 0)
            np.testing.assert_allclose(out[b, i, 0], v[b, :n, 0].mean(0), rtol=1e-12)


def test_oracle_dense_formula():
    """Without options, the oracle equals softmax(scale q k^T) v written densely (GQA repeat)."""
    q, k, v = (np.asarray(x, np.float64) for x in make_inputs(4, (3,), 5, 6, 4, 2, 8, 3))
    kr, vr = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * 0.3
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out, lse, mx, probs = oracle.attention(q, k, v, scale=0.3)
    np.testing.assert_allclose(probs, p, rtol=1e-12)
    np.testing.assert_allclose(out, np.einsum("bhqk,bkhd->bqhd", p, vr), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)
    np.testing.assert_allclose(mx, s.max(-1), rtol=1e-14)


def test_oracle_sink_is_an_extra_logit():
    """A sink equals one extra key with logit `sink[h]` and value 0."""
    q, k, v = (np.asarray(x, np.float64) for x in make_inputs(6, (), 3, 4, 2, 2, 4, 3))
    sink = np.array([0.3, -0.7])
    out, lse, mx, _ = oracle.attention(q, k, v, sink=sink)
    # the extra key: zero key, value 0, and a bias making its logit exactly sink[h]
    k2 = np.concatenate([k, np.zeros((1, 2, 4))], axis=0)
    v2 = np.concatenate([v, np.zeros((1, 2, 3))], axis=0)
    bias = np.zeros((2, 3, 5))
    bias[:, :, 4] = sink[:, None]
    out2, lse2, _, _ = oracle.attention(q, k2, v2, bias=bias)
    np.testing.assert_allclose(out, out2, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(lse, lse2, rtol=1e-12)
    logits, _ = oracle.scores(q, k)
    np.testing.assert_allclose(mx, logits.max(-1), rtol=1e-14)
