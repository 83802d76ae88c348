"""attnaux's own CUDA kernels (csrc/cuda/: softmax.cu, small_seq.cu, probs_softmax.cu) on the
GPU: the fused softmax, `small_seq` and the `probs` backend (XLA's GEMMs around attnaux's CUDA
softmax kernels, `_probs_cuda.py`).

Marked `gpu` (skipped without a GPU, conftest.py) and skipped when this build has no CUDA module.
Each kernel is compared with the pure-JAX `reference` path on the GPU (float32 math, HIGHEST
precision), gradients included (through `out`, `aux.lse` and `aux.probs`), with the tolerances of
`conftest.TOL`; the softmax and `small_seq` kernels also with the CPU kernel of the same target on
the same inputs (`probs` on GPU has GPU-only targets: the backend is chosen by JAX's default
backend, so a CPU run from this process would still take the GPU path). The dropout keep-mask is
compared bit for bit between GPU, CPU (`small_seq`) and `attnaux.introspect.dropout_mask`, which
computes the documented Philox layout in pure JAX.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_close,
    attention_and_grads,
    dtype_id,
    loss_weights,
    make_inputs,
    make_options,
    tol,
)

import attnaux
from attnaux import _ffi
from attnaux import introspect as ai
from attnaux._dispatch import GPU_AUTO_SMALL_SEQ, GPU_SMALL_SEQ_MEASURED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _ffi.ext_cuda() is None,
        reason=f"no CUDA handlers: {_ffi.CUDA_IMPORT_ERROR}; see the README, "
        "'GPU build and test'",
    ),
    pytest.mark.skipif(
        _ffi.ext_cuda() is not None and _ffi.KERNELS_CUDA_ERROR is not None,
        reason=f"attnaux._kernels_cuda failed to load: {_ffi.KERNELS_CUDA_ERROR}",
    ),
]

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
STATS_TOL = (2e-5, 2e-5)


def _on_cpu(fn, *args):
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        args = jax.tree.map(
            lambda x: jax.device_put(x, cpu) if isinstance(x, (jax.Array, np.ndarray)) else x, args
        )
        return fn(*args)


# ------------------------------------------------------------------------------------------------
# Fused softmax
# ------------------------------------------------------------------------------------------------
SOFTMAX_CASES = [  # (name, logits shape, mask shape or None, causal, scale)
    ("tiny", (2, 3, 5, 7), None, False, 1.0),
    ("one_key", (2, 3, 4, 1), None, False, 0.5),
    ("q1_odd", (4, 1, 1000), None, False, 0.3),
    ("d2048", (2, 4, 64, 2048), None, False, 0.125),
    ("d2048_causal", (2, 4, 64, 2048), None, True, 0.125),
    ("bottom_right", (2, 2, 48, 80), None, "bottom_right", 1.0),
    ("mask_heads", (2, 4, 32, 96), (1, 4, 32, 96), False, 1.0),
    ("mask_keypad", (2, 4, 32, 96), (2, 1, 1, 96), True, 1.0),
    ("mask_rows", (3, 2, 17, 33), (17, 1), False, 1.0),
    ("long_4100", (1, 2, 3, 4100), None, False, 0.5),
    ("long_65536", (1, 1, 2, 65536), None, False, 1.0),
    ("long_causal_mask", (1, 2, 5, 8192), (1, 2, 5, 8192), "bottom_right", 1.0),
]


def _softmax_inputs(shape, mask_shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 3, dtype)
    mask = None if mask_shape is None else jnp.asarray(rng.random(mask_shape) < 0.7)
    g = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
    u = jnp.asarray(rng.standard_normal(shape[:-1], dtype=np.float32))
    return x, mask, g, u


def _softmax_run(x, mask, g, u, *, causal, scale, backend):
    def loss(x):
        p, aux = attnaux.softmax(x, mask=mask, causal=causal, scale=scale, backend=backend)
        lse_term = jnp.where(jnp.isfinite(aux.lse), aux.lse * u, 0.0)
        return jnp.sum(p.astype(jnp.float32) * g.astype(jnp.float32)) + jnp.sum(lse_term), (p, aux)

    (_, (p, aux)), dx = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    return p, aux, dx


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=lambda c: c[0])
def test_softmax_matches_reference_and_cpu(case, dtype):
    name, shape, mask_shape, causal, scale = case
    if shape[-1] >= 65536 and dtype != jnp.bfloat16:
        pytest.skip("the longest row is checked in bf16 only")
    x, mask, g, u = _softmax_inputs(shape, mask_shape, dtype)
    ok, why = attnaux.softmax_kernel_available(x, mask=mask, causal=causal)
    assert ok, why
    p, aux, dx = _softmax_run(x, mask, g, u, causal=causal, scale=scale, backend="kernel")
    assert aux.backend == "kernel"
    rp, raux, rdx = _softmax_run(x, mask, g, u, causal=causal, scale=scale, backend="reference")
    assert_close(p, rp, tol(dtype, "out"), "probs")
    assert_close(aux.lse, raux.lse, STATS_TOL, "lse")
    assert_close(aux.max, raux.max, STATS_TOL, "max")
    assert_close(dx, rdx, tol(dtype, "grad"), "dlogits")
    cp, caux, cdx = _on_cpu(
        lambda *a: _softmax_run(*a, causal=causal, scale=scale, backend="kernel"), x, mask, g, u
    )
    assert_close(p, cp, tol(dtype, "out"), "probs vs cpu")
    assert_close(aux.lse, caux.lse, STATS_TOL, "lse vs cpu")
    assert_close(dx, cdx, tol(dtype, "grad"), "dlogits vs cpu")


def test_softmax_fully_masked_rows_and_nan_hidden():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 4, 40)), jnp.float32)
    mask = jnp.ones((2, 4, 40), bool).at[:, 1].set(False).at[:, :, 30:].set(False)
    x = x.at[:, :, 30:].set(jnp.nan)
    p, aux = attnaux.softmax(x, mask=mask, backend="kernel")
    assert np.all(np.isfinite(np.asarray(p)))
    assert np.all(np.asarray(p[:, 1]) == 0)
    assert np.all(np.isneginf(np.asarray(aux.lse[:, 1])))
    dx = jax.grad(lambda x: jnp.sum(attnaux.softmax(x, mask=mask, backend="kernel")[0] ** 2))(x)
    assert np.all(np.isfinite(np.asarray(dx)))


def test_softmax_vmap_on_gpu():
    x, _, _, _ = _softmax_inputs((3, 2, 8, 64), None, jnp.float32)
    got = jax.vmap(lambda y: attnaux.softmax(y, backend="kernel")[0])(x)
    want = attnaux.softmax(x, backend="reference")[0]
    assert_close(got, want, tol(jnp.float32, "out"), "vmapped probs")


# ------------------------------------------------------------------------------------------------
# small_seq
# ------------------------------------------------------------------------------------------------
# (name, batch, kv_seq, q_heads, kv_heads, qk_dim, v_dim, options)
SMALL_CASES = [
    ("plain", 64, 16, 8, 8, 128, 128, {}),
    ("gqa_kvlens", 64, 16, 8, 2, 64, 64, dict(kv_seqlens="edges")),
    ("mqa_odd", 33, 7, 6, 1, 40, 24, dict(kv_seqlens="rand")),
    ("bias_mask", 32, 12, 4, 2, 64, 64, dict(bias="BHQK", mask="bHQK")),
    ("bias_bcast", 32, 16, 4, 4, 64, 64, dict(bias="b1QK")),
    ("softcap_sink", 32, 16, 4, 2, 64, 64, dict(softcap=5.0, sink=True, q_seqlens="edges")),
    ("window_br", 32, 16, 4, 4, 32, 32, dict(causal="bottom_right", window=(4, None),
                                             kv_seqlens="rand")),
    ("segments", 16, 16, 4, 2, 64, 64, dict(segments=3)),
    ("one_key", 16, 1, 4, 4, 8, 8, {}),
    ("d256", 8, 16, 4, 4, 256, 256, dict(scale=0.2)),
    # head dims that are not whole 16-byte vectors (bf16/f16: one element per lane)
    ("dim_odd", 24, 11, 4, 2, 36, 20, dict(kv_seqlens="rand")),
    # 32 query heads per kv head: fewer groups per block so their coefficients fit
    ("gqa_32", 16, 16, 32, 1, 64, 64, dict(bias="B1QK")),
    ("gqa_8_d128", 40, 16, 8, 1, 128, 128, dict(kv_seqlens="edges", sink=True)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: c[0])
def test_small_seq_matches_reference_and_cpu(case, dtype):
    name, batch, kv_seq, hq, hk, d, dv, options = case
    q, k, v = make_inputs(0, (batch,), 1, kv_seq, hq, hk, d, dv, dtype)
    opts = make_options(1, (batch,), 1, kv_seq, hq, **options)
    if "bias" in opts:
        opts["bias"] = opts["bias"].astype(dtype).astype(jnp.float32)
    explanation = attnaux.explain(q, k, v, **opts, backend="small_seq")  # serves the call
    assert explanation.backend == "small_seq", str(explanation)
    w, u = loss_weights(3, q, v)
    out, aux, grads = attention_and_grads(q, k, v, w, u, backend="small_seq", **opts)
    r_out, r_aux, r_grads = attention_and_grads(q, k, v, w, u, backend="reference", **opts)
    assert aux.backend == "small_seq"
    assert_close(out, r_out, tol(dtype, "out"), "out")
    assert_close(aux.lse, r_aux.lse, STATS_TOL, "lse")
    assert_close(aux.max, r_aux.max, STATS_TOL, "max")
    for g in grads:
        assert_close(grads[g], r_grads[g], tol(dtype, "grad"), f"d{g}")
    c_out, c_aux, c_grads = _on_cpu(
        lambda q, k, v, w, u, opts: attention_and_grads(q, k, v, w, u, backend="small_seq", **opts),
        q, k, v, w, u, opts,
    )
    assert_close(out, c_out, tol(dtype, "out"), "out vs cpu")
    assert_close(aux.lse, c_aux.lse, STATS_TOL, "lse vs cpu")
    for g in grads:
        assert_close(grads[g], c_grads[g], tol(dtype, "grad"), f"d{g} vs cpu")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_small_seq_probs_and_their_gradient(dtype):
    q, k, v = make_inputs(4, (24,), 1, 16, 4, 2, 64, 64, dtype)
    rng = np.random.default_rng(5)
    gp = jnp.asarray(rng.standard_normal((24, 4, 1, 16), dtype=np.float32))

    def loss(q, k, v, backend):
        out, aux = attnaux.attention(q, k, v, return_probs=True, backend=backend)
        value = jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(aux.probs.astype(jnp.float32) * gp)
        return value, aux.probs

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, p), g = run(q, k, v, "small_seq")
    (_, rp), rg = run(q, k, v, "reference")
    assert_close(p, rp, tol(dtype, "out"), "probs")
    for a, b, n in zip(g, rg, "qkv", strict=True):
        assert_close(a, b, tol(dtype, "grad"), f"d{n}")


def test_small_seq_nan_in_hidden_keys_stays_out():
    q, k, v = make_inputs(6, (8,), 1, 16, 4, 4, 32, 32, jnp.float32)
    kv_len = jnp.asarray([16, 9, 0, 3, 16, 1, 5, 12], jnp.int32)
    hidden = jnp.arange(16)[None, :, None, None] >= kv_len[:, None, None, None]
    k = jnp.where(hidden, jnp.nan, k)
    v = jnp.where(hidden, jnp.inf, v)

    def loss(q, k, v):
        out, aux = attnaux.attention(q, k, v, kv_seqlens=kv_len, backend="small_seq")
        return jnp.sum(out ** 2), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert np.all(np.isfinite(np.asarray(out)))
    assert np.all(np.isfinite(np.asarray(grads[0])))
    assert np.all(np.asarray(out[2]) == 0)


# ------------------------------------------------------------------------------------------------
# probs on GPU: XLA's GEMMs around attnaux's CUDA softmax kernels
# ------------------------------------------------------------------------------------------------
# (name, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, options)
PROBS_CASES = [
    ("plain", 2, 64, 64, 4, 4, 64, 64, {}),
    ("gqa_causal_kvlens", 3, 40, 72, 4, 2, 64, 64, dict(causal=True, kv_seqlens="edges")),
    ("bias_mask", 2, 33, 48, 4, 2, 32, 32, dict(bias="BHQK", mask="bHQK")),
    ("bias_bcast_odd_keys", 2, 17, 45, 4, 4, 64, 48, dict(bias="b1QK", scale=0.3)),
    ("softcap_sink_qlens", 2, 48, 64, 4, 2, 64, 64, dict(softcap=5.0, sink=True,
                                                            q_seqlens="edges")),
    ("window_br", 2, 30, 50, 4, 4, 32, 32, dict(causal="bottom_right", window=(6, 2),
                                                kv_seqlens="rand", q_seqlens="rand")),
    ("segments", 2, 40, 40, 4, 2, 64, 64, dict(segments=3)),
    ("long_keys", 1, 8, 1100, 2, 1, 64, 64, dict(mask="b1QK")),
    ("one_query", 4, 1, 128, 8, 2, 128, 128, {}),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", PROBS_CASES, ids=lambda c: c[0])
def test_probs_matches_reference(case, dtype):
    name, batch, q_seq, kv_seq, hq, hk, d, dv, options = case
    q, k, v = make_inputs(1, (batch,), q_seq, kv_seq, hq, hk, d, dv, dtype)
    opts = make_options(2, (batch,), q_seq, kv_seq, hq, **options)
    if "bias" in opts:
        opts["bias"] = opts["bias"].astype(dtype).astype(jnp.float32)
    explanation = attnaux.explain(q, k, v, **opts, backend="probs")
    assert explanation.backend == "probs" and "CUDA" in explanation.implementation
    w, u = loss_weights(3, q, v)
    out, aux, grads = attention_and_grads(q, k, v, w, u, backend="probs", **opts)
    r_out, r_aux, r_grads = attention_and_grads(q, k, v, w, u, backend="reference", **opts)
    assert aux.backend == "probs"
    assert_close(out, r_out, tol(dtype, "out"), "out")
    assert_close(aux.lse, r_aux.lse, STATS_TOL, "lse")
    assert_close(aux.max, r_aux.max, STATS_TOL, "max")
    assert set(grads) == set(r_grads)
    for g in grads:
        assert_close(grads[g], r_grads[g], tol(dtype, "grad"), f"d{g}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_probs_returned_and_differentiable(dtype, softcap):
    """aux.probs equals the reference's P, and a loss on it (plus out and lse) has the
    reference's gradients, with GQA and masking."""
    q, k, v = make_inputs(4, (2,), 24, 40, 4, 2, 64, 64, dtype)
    rng = np.random.default_rng(5)
    gp = jnp.asarray(rng.standard_normal((2, 4, 24, 40), dtype=np.float32))
    kv_len = jnp.asarray([40, 23], jnp.int32)

    def loss(q, k, v, backend):
        out, aux = attnaux.attention(q, k, v, causal="bottom_right", kv_seqlens=kv_len,
                                     softcap=softcap, return_probs=True, backend=backend)
        value = (jnp.sum(out.astype(jnp.float32) ** 2)
                 + jnp.sum(aux.probs.astype(jnp.float32) * gp)
                 + jnp.sum(jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)))
        return value, aux.probs

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, p), g = run(q, k, v, "probs")
    (_, rp), rg = run(q, k, v, "reference")
    assert p.dtype == rp.dtype == (jnp.float32 if dtype == jnp.float32 else dtype)
    assert_close(p, rp, tol(dtype, "out"), "probs")
    for a, b, n in zip(g, rg, "qkv", strict=True):
        assert_close(a, b, tol(dtype, "grad"), f"d{n}")


def test_probs_nan_in_hidden_rows_stays_out():
    """GEMMs multiply every row: rows past the lengths (NaN/inf here) are zeroed first."""
    q, k, v = make_inputs(6, (4,), 20, 30, 4, 2, 32, 32, jnp.float32)
    q_len = jnp.asarray([20, 7, 0, 13], jnp.int32)
    kv_len = jnp.asarray([30, 9, 0, 30], jnp.int32)
    q = jnp.where(jnp.arange(20)[None, :, None, None] >= q_len[:, None, None, None], jnp.nan, q)
    hidden = jnp.arange(30)[None, :, None, None] >= kv_len[:, None, None, None]
    k = jnp.where(hidden, jnp.nan, k)
    v = jnp.where(hidden, jnp.inf, v)

    def loss(q, k, v):
        out, aux = attnaux.attention(q, k, v, q_seqlens=q_len, kv_seqlens=kv_len, backend="probs")
        return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(aux.lse), aux.lse, 0)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert np.all(np.isfinite(np.asarray(out)))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(out[2]) == 0)


def test_probs_vmap_on_gpu():
    q, k, v = make_inputs(7, (3, 2), 16, 24, 4, 2, 32, 32, jnp.float32)
    got = jax.vmap(lambda q, k, v: attnaux.attention(q, k, v, causal=True, backend="probs")[0])(
        q, k, v)
    want = attnaux.attention(q, k, v, causal=True, backend="reference")[0]
    assert_close(got, want, tol(jnp.float32, "out"), "vmapped out")


# ------------------------------------------------------------------------------------------------
# Dropout: the GPU keep-mask is bitwise the CPU one and introspect's
# ------------------------------------------------------------------------------------------------
def _keep_mask_from_output(backend, batch, heads, q_seq, kv_seq, rate, key):
    """keep[b, h, i, j] read off the output: q = 0 gives P = 1/kv_seq, one-hot v[j] = e_j."""
    q = jnp.zeros((batch, q_seq, heads, 4), jnp.float32)
    k = jnp.zeros((batch, kv_seq, 1, 4), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(kv_seq, dtype=jnp.float32)[None, :, None, :],
                         (batch, kv_seq, 1, kv_seq))

    def run(q, k, v):
        return attnaux.attention(q, k, v, dropout_rate=rate, key=key, backend=backend)

    out, aux = run(q, k, v)
    assert aux.backend == backend
    scaled = np.asarray(out) * kv_seq * (1 - rate)
    assert np.all((np.abs(scaled) < 1e-5) | (np.abs(scaled - 1) < 1e-5))
    return np.transpose(scaled > 0.5, (0, 2, 1, 3)), aux, q, k, (run, v)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("backend,q_seq,kv_seq", [("small_seq", 1, 13), ("small_seq", 1, 16),
                                                  ("probs", 9, 40), ("probs", 5, 37)])
def test_dropout_mask_gpu_equals_cpu_and_introspect(backend, q_seq, kv_seq, rate):
    keep, aux, q, k, (run, v) = _keep_mask_from_output(backend, 37, 5, q_seq, kv_seq, rate,
                                                       jax.random.key(11))
    replay = np.asarray(ai.dropout_mask(aux, q, k, dropout_rate=rate))
    assert keep.shape == replay.shape
    assert np.array_equal(keep, replay), f"{(keep != replay).sum()} of {keep.size} differ"
    if backend == "small_seq":  # the same target runs on CPU
        cpu_out, _ = _on_cpu(run, q, k, v)
        cpu_keep = np.transpose(np.asarray(cpu_out) * kv_seq * (1 - rate) > 0.5, (0, 2, 1, 3))
        assert np.array_equal(keep, cpu_keep), f"{(keep != cpu_keep).sum()} of {keep.size} differ"


@pytest.mark.parametrize("backend,q_seq,kv_seq", [("small_seq", 1, 16), ("probs", 12, 24)])
def test_dropout_gradients_match(backend, q_seq, kv_seq):
    """With dropout, gradients equal the CPU kernel's (small_seq) and the reference's (which
    draws the same documented Philox mask from the same key)."""
    q, k, v = make_inputs(8, (16,), q_seq, kv_seq, 4, 2, 32, 32, jnp.float32)
    key = jax.random.key(3)

    def grad_of(backend):
        def loss(q, k, v):
            out, aux = attnaux.attention(q, k, v, dropout_rate=0.3, key=key, backend=backend)
            w = jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape) / out.size
            return jnp.sum(out * w) + jnp.sum(aux.lse)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    g = grad_of(backend)(q, k, v)
    for a, b, n in zip(g, grad_of("reference")(q, k, v), "qkv", strict=True):
        assert_close(a, b, tol(jnp.float32, "grad"), f"d{n} vs reference")
    if backend == "small_seq":
        for a, b, n in zip(g, _on_cpu(grad_of(backend), q, k, v), "qkv", strict=True):
            assert_close(a, b, tol(jnp.float32, "grad"), f"d{n} vs cpu")


# ------------------------------------------------------------------------------------------------
# What auto picks on GPU
# ------------------------------------------------------------------------------------------------
def test_explain_on_gpu():
    q, k, v = make_inputs(0, (4,), 1, 16, 8, 2, 64, 64, jnp.bfloat16)
    e = attnaux.explain(q, k, v)
    assert e.platform == "gpu", str(e)
    if GPU_AUTO_SMALL_SEQ:
        assert e.backend == "small_seq" and "CUDA" in e.implementation, str(e)
        assert GPU_SMALL_SEQ_MEASURED in e.reasons["small_seq"]
    else:
        assert e.backend != "small_seq", str(e)
        assert "not picked by auto" in e.reasons["small_seq"]
    assert attnaux.explain(q, k, v, backend="small_seq").backend == "small_seq"
    assert attnaux.softmax_kernel_available((2, 3, 4, 5), jnp.bfloat16)
    # probs: for return_probs, and whenever cuDNN cannot serve the call (here softcap with a
    # bias); a boolean mask goes to cuDNN as a bias, so flash serves it
    q, k, v = make_inputs(0, (2,), 64, 64, 4, 2, 64, 64, jnp.bfloat16)
    e = attnaux.explain(q, k, v, return_probs=True)
    assert e.backend == "probs" and "cuBLAS" in e.implementation, str(e)
    e = attnaux.explain(q, k, v, mask=jnp.ones((64, 64), bool))
    assert e.backend == "flash", str(e)
    bias = jnp.zeros((64, 64), jnp.bfloat16)
    e = attnaux.explain(q, k, v, bias=bias, softcap=30.0)
    assert e.backend == "probs", str(e)
    assert "cannot serve" in e.reasons["probs"] and "softcap" in e.reasons["flash"], str(e)
    e = attnaux.explain(q, k, v)
    assert e.backend == "flash" and "not chosen" in e.reasons["probs"], str(e)


def test_auto_prefers_probs_for_small_calls_by_the_measured_rule():
    """GPU `auto` takes `probs` where the benchmark table measured it faster (small calls), cites
    the rule in `explain`, and keeps cuDNN above it."""
    q, k, v = make_inputs(0, (4,), 256, 256, 8, 8, 64, 64, jnp.bfloat16)
    e = attnaux.explain(q, k, v, causal=True)
    assert e.backend == "probs" and "GPU_AUTO_PROBS_MAX_PAIRS" in e.reasons["probs"], str(e)
    out, aux = attnaux.attention(q, k, v, causal=True)
    assert aux.backend == "probs" and aux.probs is None
    q, k, v = make_inputs(0, (16,), 512, 512, 16, 16, 64, 64, jnp.bfloat16)
    e = attnaux.explain(q, k, v, causal=True)
    assert e.backend == "flash" and "GPU_AUTO_PROBS_MAX_PAIRS" in e.reasons["probs"], str(e)
