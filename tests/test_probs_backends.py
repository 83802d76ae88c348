"""The probability-saving backends, `probs` and `small_seq`, against `reference`.

- parity of out, lse, max, probs and of the gradients (through out, lse and probs) over the option
  grid, for both backends and all three dtypes;
- `aux.probs` is filled exactly when `return_probs=True`, whatever the backend, and is
  differentiable; rows with no visible key give P = 0;
- `auto` picks `small_seq` whenever the static shapes fit, `probs` when `return_probs=True`
  keys or with `return_probs=True`, and its choice never changes the results;
- bad input: `small_seq` for a shape it cannot serve, `return_probs=True` on `flash`.

The default run covers every option and dtype once; `-m slow` adds the full small_seq grid
(kv_seq x kv_seqlens x heads x head dims x dtypes) and more probs shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    DTYPES,
    assert_close,
    dtype_id,
    every_other,
    loss_weights,
    make_inputs,
    make_options,
    probe_loss,
    split_options,
    tol,
)

import attnaux
from attnaux import _ffi, _probs_cpu, _small_seq
from attnaux._dispatch import AUTO_PROBS_MAX_KV_SEQ
from attnaux._small_seq import MAX_KV_SEQ as SMALL_SEQ_MAX_KV_SEQ

TARGETS = {
    "probs": (_probs_cpu.FWD_TARGET, _probs_cpu.BWD_TARGET),
    "small_seq": (_small_seq.FWD_TARGET, _small_seq.BWD_TARGET),
}

HAS_PROBS = all(_ffi.has_target(t, "cpu") for pair in TARGETS.values() for t in pair)
pytestmark = pytest.mark.skipif(
    not HAS_PROBS, reason="the compiled probs/small_seq kernels are not registered for cpu"
)

KEY = jax.random.key(7)


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def _probs_weights(seed, q, k):
    rng = np.random.default_rng(seed + 20_000)
    *batch, q_seq, q_heads, _ = q.shape
    return jnp.asarray(rng.standard_normal((*batch, q_heads, q_seq, k.shape[-3]), np.float32))


def run_with_probs(backend, q, k, v, seed, **options):
    """`(out, aux, grads)` of `probe_loss(out, lse) + sum(probs * z)` with `return_probs=True`,
    jitted; grads for q, k, v and, when given, bias and sink."""
    w, u = loss_weights(seed, q, v)
    z = _probs_weights(seed, q, k)
    diff, arrays, static = split_options(q, k, v, options)

    def loss(diff, arrays):
        extra = {n: x for n, x in diff.items() if n not in ("q", "k", "v")}
        out, aux = attnaux.attention(diff["q"], diff["k"], diff["v"], **extra, **arrays,
                                     **static, return_probs=True, backend=backend)
        value = probe_loss(out, aux.lse, w, u) + jnp.sum(aux.probs.astype(jnp.float32) * z)
        return value, (out, aux)

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, (out, aux)), grads = fn(diff, arrays)
    return out, aux, grads


def run_without_probs(backend, q, k, v, seed, **options):
    """`(out, aux, grads)` of `probe_loss(out, lse)` with `return_probs=False`, jitted."""
    w, u = loss_weights(seed, q, v)
    diff, arrays, static = split_options(q, k, v, options)

    def loss(diff, arrays):
        extra = {n: x for n, x in diff.items() if n not in ("q", "k", "v")}
        out, aux = attnaux.attention(diff["q"], diff["k"], diff["v"], **extra, **arrays,
                                     **static, backend=backend)
        return probe_loss(out, aux.lse, w, u), (out, aux)

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, (out, aux)), grads = fn(diff, arrays)
    return out, aux, grads


def check_parity(backend, q, k, v, seed, *, with_probs=True, without_probs=True, **options):
    dtype = q.dtype
    runs = []
    if with_probs:
        runs.append(run_with_probs)
    if without_probs:
        runs.append(run_without_probs)
    for runner in runs:
        out, aux, grads = runner(backend, q, k, v, seed, **options)
        out_r, aux_r, grads_r = runner("reference", q, k, v, seed, **options)
        where = f"{backend}/{runner.__name__}"
        assert aux.backend == backend
        assert_close(out, out_r, tol(dtype, "out"), f"{where}: out")
        assert_close(aux.lse, aux_r.lse, tol(dtype, "lse"), f"{where}: lse")
        assert_close(aux.max, aux_r.max, tol(dtype, "lse"), f"{where}: max")
        if runner is run_with_probs:
            assert aux.probs.dtype == aux_r.probs.dtype == (
                jnp.float32 if dtype == jnp.float32 else dtype)
            assert_close(aux.probs, aux_r.probs, tol(dtype, "out"), f"{where}: probs")
        else:
            assert aux.probs is None and aux_r.probs is None
        assert set(grads) == set(grads_r)
        for name in grads:
            assert_close(grads[name], grads_r[name], tol(dtype, "grad"), f"{where}: d{name}")


# ------------------------------------------------------------------------------------------------
# probs: parity over the option grid
# ------------------------------------------------------------------------------------------------
# B, Sq, Skv, Hq, Hkv, D, Dv: 67 query rows cross the 64-row query blocks, 70 keys the 64-key
# tiles; D = 24 is not a whole number of vectors; GQA with groups of 2. With 4 (batch, kv head)
# pairs the backward splits each pair's query blocks into shares (see PROBS_MANY_PAIRS).
PROBS_SHAPE = (2, 67, 70, 4, 2, 24, 16)
# 16 (batch, kv head) pairs: the backward's tasks own whole pairs; 40 query rows, 48 keys (tiles
# of whole 16 x 16 transposes and ragged ones), head dims that are whole vectors.
PROBS_MANY_PAIRS = (4, 40, 48, 8, 4, 32, 16)

PROBS_OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "bottom_right_seqlens": dict(causal="bottom_right", q_seqlens="edges", kv_seqlens="rand"),
    "window": dict(window=(9, 3)),
    "window_left_only_seqlens": dict(window=(4, None), kv_seqlens=[70, 0, 33]),
    "bias_mask": dict(bias="B1QK", mask="bHQK"),
    "bias_heads": dict(bias="HQK"),
    "segments": dict(segments=3),
    "softcap_sink": dict(softcap=2.5, sink=True),
    "dropout": dict(dropout_rate=0.3),
    "everything": dict(causal="bottom_right", window=(20, 2), q_seqlens="rand", kv_seqlens="rand",
                       bias="BHQK", mask="B1QK", softcap=4.0, sink=True, dropout_rate=0.2),
}


def _options(seed, shape, spec):
    b, sq, skv, hq = shape[:4]
    spec = dict(spec)
    if spec.get("dropout_rate"):
        spec["key"] = KEY
    return make_options(seed, b, sq, skv, hq, **spec)


@pytest.mark.parametrize("case", every_other(list(PROBS_OPTIONS), single=True))
def test_probs_parity_float32(case):
    q, k, v = make_inputs(1, *PROBS_SHAPE, jnp.float32)
    check_parity("probs", q, k, v, 1, **_options(2, PROBS_SHAPE, PROBS_OPTIONS[case]))


@pytest.mark.parametrize("case", ["plain", "dropout", "everything"])
def test_probs_parity_many_pairs(case):
    q, k, v = make_inputs(7, *PROBS_MANY_PAIRS, jnp.float32)
    check_parity("probs", q, k, v, 7, **_options(8, PROBS_MANY_PAIRS, PROBS_OPTIONS[case]))


# each 16-bit dtype with one option set, the other two pairs in the slow run
@pytest.mark.parametrize("case,dtype", [
    pytest.param(case, dtype, id=f"{case}-{dtype_id(dtype)}",
                 marks=[pytest.mark.slow] if (case == "plain") == (dtype == jnp.float16) else [])
    for case in ("plain", "everything") for dtype in DTYPES[1:]])
def test_probs_parity_low_precision(case, dtype):
    q, k, v = make_inputs(3, *PROBS_SHAPE, dtype)
    check_parity("probs", q, k, v, 3, **_options(4, PROBS_SHAPE, PROBS_OPTIONS[case]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [
    (1, 1, 1, 1, 1, 16, 16),
    (3, 1, 300, 8, 1, 64, 64),      # MQA, one query row, long keys
    (1, 130, 129, 2, 2, 128, 32),
    (2, 64, 512, 6, 3, 8, 40),
    ((2, 2), 17, 9, 2, 1, 33, 7),   # two batch dims
], ids=str)
@pytest.mark.parametrize("case", list(PROBS_OPTIONS))
def test_probs_parity_sweep(case, shape, dtype):
    q, k, v = make_inputs(5, *shape, dtype)
    batch = shape[0] if isinstance(shape[0], tuple) else (shape[0],)
    spec = dict(PROBS_OPTIONS[case])
    if spec.get("dropout_rate"):
        spec["key"] = KEY
    options = make_options(6, batch, shape[1], shape[2], shape[3], **spec)
    check_parity("probs", q, k, v, 5, **options)


# ------------------------------------------------------------------------------------------------
# small_seq: parity over kv_seq x kv_seqlens x heads x head dims x dtypes
# ------------------------------------------------------------------------------------------------
SMALL_KV = (1, 2, 3, 8, 13, 16)
SMALL_HEADS = ((1, 1), (4, 2), (16, 4), (8, 8), (6, 1))
SMALL_DIMS = (64, 128)
SMALL_BATCH = 7  # kv_seqlens "edges": full, 0, random, full, 0, ...


def _small_case(kv_seq, heads, dim, dtype, seed, **spec):
    hq, hkv = heads
    q, k, v = make_inputs(seed, SMALL_BATCH, 1, kv_seq, hq, hkv, dim, dim, dtype)
    spec.setdefault("kv_seqlens", "edges")
    if spec.get("dropout_rate"):
        spec["key"] = KEY
    options = make_options(seed + 1, SMALL_BATCH, 1, kv_seq, hq, **spec)
    return q, k, v, options


# The default run: every kv_seq, dtype, head layout and head dim at least once.
SMALL_DEFAULT = [
    (1, (1, 1), 64, jnp.float32),
    (2, (4, 2), 128, jnp.bfloat16),
    (3, (16, 4), 64, jnp.float16),
    (8, (8, 8), 128, jnp.float32),
    (13, (6, 1), 64, jnp.bfloat16),
    (16, (16, 4), 128, jnp.float32),
    (16, (4, 2), 64, jnp.float16),
]


@pytest.mark.parametrize("kv_seq,heads,dim,dtype", SMALL_DEFAULT,
                         ids=[f"kv{s}-h{h[0]}x{h[1]}-d{d}-{dtype_id(t)}"
                              for s, h, d, t in SMALL_DEFAULT])
def test_small_seq_parity(kv_seq, heads, dim, dtype):
    q, k, v, options = _small_case(kv_seq, heads, dim, dtype, 10 + kv_seq)
    check_parity("small_seq", q, k, v, 10, without_probs=kv_seq in (1, 16), **options)


SMALL_OPTIONS = {
    "bias_mask_sink_softcap": dict(bias="BHQK", mask="b1QK", sink=True, softcap=3.0),
    "dropout": dict(dropout_rate=0.25),
    "bottom_right_q_seqlens": dict(causal="bottom_right", q_seqlens=[1, 0, 1]),
    "top_left_window": dict(causal=True, window=(3, 0)),
    "window_bottom_right": dict(causal="bottom_right", window=(4, None)),
    "segments": dict(segments=2),
    "full_lengths": dict(kv_seqlens=[16], bias="B1QK"),
}


@pytest.mark.parametrize("case", every_other(list(SMALL_OPTIONS), single=True))
def test_small_seq_options(case):
    q, k, v, options = _small_case(16 if case != "segments" else 13, (4, 2), 64, jnp.float32, 30,
                                   **SMALL_OPTIONS[case])
    check_parity("small_seq", q, k, v, 30, **options)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dim", SMALL_DIMS)
@pytest.mark.parametrize("heads", SMALL_HEADS, ids=lambda h: f"h{h[0]}x{h[1]}")
@pytest.mark.parametrize("kv_seq", SMALL_KV)
def test_small_seq_parity_sweep(kv_seq, heads, dim, dtype):
    q, k, v, options = _small_case(kv_seq, heads, dim, dtype, 40 + kv_seq)
    check_parity("small_seq", q, k, v, 40, **options)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(SMALL_OPTIONS))
def test_small_seq_options_sweep(case, dtype):
    for kv_seq in (1, 5, 16):
        spec = dict(SMALL_OPTIONS[case])
        if "kv_seqlens" in spec:
            spec["kv_seqlens"] = [kv_seq]
        q, k, v, options = _small_case(kv_seq, (8, 2), 128, dtype, 50, **spec)
        check_parity("small_seq", q, k, v, 50, **options)


def test_small_seq_large_batch_and_odd_head_dim():
    """Many batch tasks (the kernel gives each task a run of batch elements) and a head dim that
    is not a whole number of vectors (rows are converted into padded buffers)."""
    q, k, v = make_inputs(60, (3, 37), 1, 5, 4, 2, 20, 12, jnp.float32)
    options = make_options(61, (3, 37), 1, 5, 4, kv_seqlens="rand", sink=True)
    check_parity("small_seq", q, k, v, 60, without_probs=False, **options)


# ------------------------------------------------------------------------------------------------
# aux.probs: filled exactly when asked, P = 0 where nothing is visible, no P written in inference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_seq,kv_seq", [(1, 8), (5, 9)])
def test_aux_probs_structure_depends_on_arguments_only(q_seq, kv_seq):
    q, k, v = make_inputs(70, 2, q_seq, kv_seq, 4, 2, 16, 16)
    backends = ["auto", "reference", "probs"] + (["small_seq"] if q_seq == 1 else [])
    for return_probs in (False, True):
        trees = []
        for backend in backends:
            _, aux = attnaux.attention(q, k, v, return_probs=return_probs, backend=backend)
            if return_probs:
                assert aux.probs is not None and aux.probs.shape == (2, 4, q_seq, kv_seq)
                assert aux.probs.dtype == jnp.float32
            else:
                assert aux.probs is None
            trees.append(jax.tree.structure(jax.tree.map(lambda x: 0, aux)))
        leaves = {len(jax.tree.leaves(t)) for t in trees}
        assert len(leaves) == 1, (return_probs, trees)


@pytest.mark.parametrize("backend", ["probs", "small_seq"])
def test_rows_without_visible_keys_give_zero_probs(backend):
    q_seq = 1 if backend == "small_seq" else 6
    q, k, v = make_inputs(80, 3, q_seq, 7, 2, 2, 16, 16)
    mask = np.ones((3, 2, q_seq, 7), bool)
    mask[1] = False  # batch element 1: nothing visible
    out, aux = attnaux.attention(q, k, v, mask=jnp.asarray(mask), kv_seqlens=jnp.array([7, 7, 0]),
                                 return_probs=True, backend=backend)
    p = np.asarray(aux.probs)
    assert np.all(p[1:] == 0) and np.all(np.asarray(out)[1:] == 0)
    assert np.all(np.isneginf(np.asarray(aux.lse)[1:]))
    np.testing.assert_allclose(p[0].sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("backend", ["probs", "small_seq"])
def test_nan_in_hidden_positions_never_leaks(backend):
    """NaN stored in padding rows of q, k, v and in masked-out bias entries reaches no output or
    gradient (masking selects, it never multiplies)."""
    q_seq = 1 if backend == "small_seq" else 9
    q, k, v = make_inputs(90, 3, q_seq, 11, 4, 2, 16, 16)
    kv_len = jnp.array([11, 4, 0])
    q_len = jnp.array([q_seq, max(q_seq - 3, 1), q_seq])
    k = k.at[1, 4:].set(jnp.nan).at[2].set(jnp.nan)
    v = v.at[1, 4:].set(jnp.inf).at[2].set(jnp.nan)
    q = q.at[1, int(q_len[1]):].set(jnp.nan)
    bias = jnp.zeros((3, 1, q_seq, 11)).at[1, :, :, 4:].set(jnp.nan)

    def loss(q, k, v, bias):
        out, aux = attnaux.attention(q, k, v, bias=bias, q_seqlens=q_len, kv_seqlens=kv_len,
                                     return_probs=True, backend=backend)
        lse = jnp.where(jnp.isfinite(aux.lse), aux.lse, 0)
        return jnp.sum(out) + jnp.sum(lse) + jnp.sum(aux.probs ** 2), (out, aux)

    (_, (out, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                        has_aux=True))(q, k, v, bias)
    for name, x in [("out", out), ("probs", aux.probs), *zip("qkvb", grads)]:
        assert not np.isnan(np.asarray(x)).any(), name


@pytest.mark.parametrize("backend,q_seq", [("probs", 5), ("small_seq", 1)])
def test_inference_does_not_write_probs(backend, q_seq):
    """Without `return_probs` and without differentiation the kernel's P output is `(0,)`."""
    q, k, v = make_inputs(100, 2, q_seq, 8, 2, 2, 16, 16)
    hlo = jax.jit(lambda q, k, v: attnaux.attention(q, k, v, backend=backend)).lower(
        q, k, v).as_text()
    target = TARGETS[backend][0]
    line = next(line for line in hlo.splitlines() if target in line)
    assert "tensor<0xf32>" in line, line
    hlo_p = jax.jit(lambda q, k, v: attnaux.attention(q, k, v, backend=backend,
                                                      return_probs=True)).lower(q, k, v).as_text()
    line = next(line for line in hlo_p.splitlines() if target in line)
    assert f"tensor<2x2x{q_seq}x8xf32>" in line, line


@pytest.mark.parametrize("backend,q_seq", [("probs", 5), ("small_seq", 1)])
def test_vmap_matches_a_loop(backend, q_seq):
    q, k, v = make_inputs(110, (3, 2), q_seq, 6, 4, 2, 16, 8)
    kv_len = jnp.array([[6, 2], [0, 5], [3, 6]])

    def f(q, k, v, kv_len):
        out, aux = attnaux.attention(q, k, v, kv_seqlens=kv_len, return_probs=True,
                                     backend=backend)
        return out, aux.lse, aux.probs

    got = jax.vmap(f)(q, k, v, kv_len)
    for n in range(3):
        want = f(q[n], k[n], v[n], kv_len[n])
        for a, e in zip(got, want):
            np.testing.assert_allclose(np.asarray(a[n]), np.asarray(e), rtol=1e-6, atol=1e-6)
    def loss(q, k, v, length):
        return jnp.sum(f(q, k, v, length)[2] ** 2)

    grads = jax.vmap(jax.grad(loss))(q, k, v, kv_len)
    want = jax.grad(loss)(q[1], k[1], v[1], kv_len[1])
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_gradient_through_probs_only():
    """A loss on `aux.probs` alone (no out, no lse) gets the reference's gradients."""
    q, k, v = make_inputs(120, 2, 6, 10, 2, 1, 16, 16)
    bias = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 6, 10)), jnp.float32)
    sink = jnp.array([0.3, -1.0])

    def loss(backend):
        def f(q, k, bias, sink):
            _, aux = attnaux.attention(q, k, v, bias=bias, sink=sink, causal=True,
                                       return_probs=True, backend=backend)
            return jnp.sum(jnp.sin(3 * aux.probs))
        return jax.grad(f, argnums=(0, 1, 2, 3))(q, k, bias, sink)

    for got, want, name in zip(loss("probs"), loss("reference"), "qkbs"):
        assert_close(got, want, tol(jnp.float32, "grad"), name)


# ------------------------------------------------------------------------------------------------
# auto: what it picks, and that its choice never changes results
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_seq,kv_seq,return_probs,dtype,want", [
    (1, 1, False, jnp.float32, "small_seq"),
    (1, SMALL_SEQ_MAX_KV_SEQ, False, jnp.bfloat16, "small_seq"),
    (1, SMALL_SEQ_MAX_KV_SEQ, True, jnp.float32, "small_seq"),
    (1, SMALL_SEQ_MAX_KV_SEQ + 1, False, jnp.float32, "probs"),
    (2, 16, False, jnp.float32, "probs"),
    (4, 64, False, jnp.float16, "probs"),
    (4, 64, True, jnp.float16, "probs"),
    (4, AUTO_PROBS_MAX_KV_SEQ, False, jnp.float32, "probs"),
    (4, AUTO_PROBS_MAX_KV_SEQ + 1, False, jnp.float32, "flash"),
    (4, 600, True, jnp.float32, "probs"),
    (1, 8, False, jnp.float64, "reference"),
])
def test_auto_choice(q_seq, kv_seq, return_probs, dtype, want):
    structs = [jax.ShapeDtypeStruct(s, dtype) for s in
               ((3, q_seq, 4, 16), (3, kv_seq, 2, 16), (3, kv_seq, 2, 16))]
    with jax.enable_x64(dtype == jnp.float64):
        e = attnaux.explain(*structs, return_probs=return_probs)
    assert e.backend == want, str(e)
    assert set(e.reasons) == {"flash", "probs", "small_seq", "reference"}
    if want == "small_seq":
        assert "chosen whenever the static shapes fit" in e.reasons["small_seq"]
    elif dtype != jnp.float64:
        assert f"kv_seq <= {SMALL_SEQ_MAX_KV_SEQ}" in e.reasons["small_seq"]
    if want == "flash":
        assert "not chosen: flash measures as fast for longer key sequences" in e.reasons["probs"]
    if want == "probs" and not return_probs:
        assert f"kv_seq={kv_seq} <= {AUTO_PROBS_MAX_KV_SEQ}" in e.reasons["probs"]


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
def test_auto_choice_bfloat16_on_amx_tiles(monkeypatch, amx):
    """On a CPU whose flash kernels run bfloat16 on AMX tiles (`_ffi.cpu_amx_tiles`, answering
    as told here), `auto` takes flash for bfloat16 at head dims that are multiples of 64 from
    `AUTO_PROBS_MAX_KV_SEQ_AMX + 1` keys, where it measured faster than probs; float32 and head
    dim 32 keep `AUTO_PROBS_MAX_KV_SEQ`, and so does every call without the tiles."""
    from attnaux import _dispatch, _ffi

    monkeypatch.setattr(_ffi, "cpu_amx_tiles", lambda: amx)
    limit = _dispatch.AUTO_PROBS_MAX_KV_SEQ_AMX

    def chosen(kv_seq, dtype=jnp.bfloat16, dim=64):
        structs = [jax.ShapeDtypeStruct(s, dtype) for s in
                   ((2, 64, 4, dim), (2, kv_seq, 2, dim), (2, kv_seq, 2, dim))]
        return attnaux.explain(*structs)

    e = chosen(limit + 1)
    assert e.backend == ("flash" if amx else "probs"), str(e)
    if amx:
        assert "AUTO_PROBS_MAX_KV_SEQ_AMX" in e.reasons["probs"]
    e = chosen(limit)
    assert e.backend == "probs"
    assert ("AUTO_PROBS_MAX_KV_SEQ_AMX" if amx else "AUTO_PROBS_MAX_KV_SEQ") in e.reasons["probs"]
    assert chosen(AUTO_PROBS_MAX_KV_SEQ, dtype=jnp.float32).backend == "probs"
    assert chosen(AUTO_PROBS_MAX_KV_SEQ, dim=32).backend == "probs"
    assert chosen(AUTO_PROBS_MAX_KV_SEQ).backend == ("flash" if amx else "probs")


@pytest.mark.parametrize("q_seq,kv_seq",
                         [(1, 12), (1, 40), (33, 70), (3, AUTO_PROBS_MAX_KV_SEQ + 2)])
def test_auto_never_changes_results(q_seq, kv_seq):
    """`auto` gives bitwise what the backend it names gives, and that agrees with flash and the
    reference within the parity tolerances (so crossing a dispatch limit changes nothing)."""
    q, k, v = make_inputs(130, 2, q_seq, kv_seq, 4, 2, 32, 32)
    options = make_options(131, 2, q_seq, kv_seq, 4, bias="B1QK", kv_seqlens="edges", sink=True,
                           causal="bottom_right")
    chosen = attnaux.explain(q, k, v, **options).backend
    w, u = loss_weights(130, q, v)
    results = {}
    for backend in ("auto", chosen, "flash", "reference"):
        if backend not in results:
            results[backend] = run_without_probs(backend, q, k, v, 130, **options)
    auto, same = results["auto"], results[chosen]
    assert auto[1].backend == chosen
    for a, b in zip(jax.tree.leaves((auto[0], auto[1].lse, auto[2])),
                    jax.tree.leaves((same[0], same[1].lse, same[2]))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for other in ("flash", "reference"):
        out, aux, grads = results[other]
        assert_close(auto[0], out, tol(jnp.float32, "out"), f"auto vs {other}: out")
        assert_close(auto[1].lse, aux.lse, tol(jnp.float32, "lse"), f"auto vs {other}: lse")
        for name in grads:
            assert_close(auto[2][name], grads[name], tol(jnp.float32, "grad"),
                         f"auto vs {other}: d{name}")


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_seq,kv_seq", [(2, 8), (1, SMALL_SEQ_MAX_KV_SEQ + 1), (4, 40)])
def test_small_seq_rejects_shapes_it_cannot_serve(q_seq, kv_seq):
    q, k, v = make_inputs(140, 2, q_seq, kv_seq, 2, 2, 16, 16)
    pattern = (rf"backend='small_seq' cannot serve this call: it needs q_seq == 1 and kv_seq <= "
               rf"{SMALL_SEQ_MAX_KV_SEQ} .*got q_seq={q_seq} and kv_seq={kv_seq}")
    for fn in (attnaux.attention, attnaux.explain):
        with pytest.raises(ValueError, match=pattern):
            fn(q, k, v, backend="small_seq")


def test_return_probs_with_flash_is_a_clear_error():
    q, k, v = make_inputs(150, 2, 3, 5, 2, 2, 16, 16)
    with pytest.raises(ValueError, match=r"backend='flash' cannot serve this call: does not save "
                       r"the probabilities \(return_probs=True\); use backend='probs'"):
        attnaux.attention(q, k, v, return_probs=True, backend="flash")


def test_float64_is_reference_only():
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in make_inputs(160, 1, 1, 4, 2, 2, 8, 8))
        for backend in ("probs", "small_seq"):
            with pytest.raises(ValueError, match=rf"backend='{backend}' cannot serve this call: "
                               "float64"):
                attnaux.attention(q, k, v, backend=backend)


def test_small_seq_kernel_rechecks_its_shape():
    """The compiled handler refuses a shape it cannot serve with a message naming the limit."""
    from attnaux._internal import canonical_problem
    from attnaux._small_seq import run

    q, k, v = make_inputs(170, 1, 2, 4, 2, 2, 16, 16)
    problem = canonical_problem(q, k, v)
    with pytest.raises(Exception, match=r"attnaux_small_seq: needs q_seq == 1 and kv_seq <= 16"):
        jax.block_until_ready(run(problem.arrays, problem.options, False))


def test_gpu_auto_rule_thresholds():
    """The GPU rule of `auto` (`gpu_prefers_probs`, derived from benchmarks/gpu_auto_table.py):
    probs at most GPU_AUTO_PROBS_MAX_PAIRS score entries (4x that with a boolean mask), q_seq at
    least GPU_AUTO_PROBS_MIN_Q_SEQ and kv_seq at most AUTO_PROBS_MAX_KV_SEQ; flash otherwise."""
    from attnaux import _dispatch
    from attnaux._internal import canonical_problem

    def rule(b, h, sq, skv, **options):
        q = jnp.zeros((b, sq, h, 64), jnp.bfloat16)
        kv = jnp.zeros((b, skv, h, 64), jnp.bfloat16)
        return _dispatch.gpu_prefers_probs(canonical_problem(q, kv, kv, **options))

    assert _dispatch.GPU_AUTO_PROBS_MAX_PAIRS == 4 * 8 * 256 * 256
    assert "GPU_AUTO_PROBS_MAX_PAIRS" in rule(4, 8, 256, 256)
    assert rule(4, 8, 256, 256, causal=True) is not None
    assert rule(16, 16, 128, 128) is None  # 2**22 pairs: within 1.2x either way, flash kept
    assert rule(4, 8, 512, 512) is None
    mask = jnp.ones((4, 1, 512, 512), bool)
    assert "MASKED" in rule(4, 8, 512, 512, mask=mask)
    assert rule(1, 1, 64, 64) is None  # q_seq below the measured range
    assert rule(1, 1, 128, 1024) is None  # kv_seq above AUTO_PROBS_MAX_KV_SEQ
