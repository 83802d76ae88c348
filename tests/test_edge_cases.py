"""Defects found by a property-based run against a float64 oracle and by a first-time user
(issue 19), each pinned by a test that failed before its fix: empty inputs with masks, dropout
replay at rates whose float32 and float64 thresholds differ, 64-bit lengths and segment ids,
static floats that change meaning in float32, lower-rank masks, and the CPU-only build's
message about the CUDA module."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux
from attnaux import _ffi
from attnaux import introspect as ai

HAS_KERNELS = _ffi.has_target("attnaux_flash_fwd", "cpu")
# The inputs here are float32: on GPU, `flash` is cuDNN, which takes bf16/f16 only (and says so;
# tests/test_gpu_flash.py covers it), so there the compiled backends under test are the others.
ON_CPU = jax.default_backend() == "cpu"
COMPILED = (["flash", "probs"] if ON_CPU else ["probs"]) if HAS_KERNELS else []
BACKENDS = [*COMPILED, "reference", "auto"]


# --- 1. empty key sequence or empty batch, with a mask or segment ids ---------------------------
def _empty_cases():
    q = jnp.ones((4, 2, 8))
    kv = jnp.ones((0, 1, 8))
    yield "mask_no_keys", (q, kv, kv), dict(mask=jnp.ones((4, 0), bool))
    yield "segments_no_keys", (q, kv, kv), dict(
        q_segment_ids=jnp.zeros(4, jnp.int32), kv_segment_ids=jnp.zeros(0, jnp.int32))
    qb, kb = jnp.ones((0, 4, 2, 8)), jnp.ones((0, 6, 1, 8))
    yield "mask_no_batch", (qb, kb, kb), dict(mask=jnp.ones((4, 6), bool))
    yield "segments_no_batch", (qb, kb, kb), dict(
        q_segment_ids=jnp.zeros((0, 4), jnp.int32), kv_segment_ids=jnp.zeros((0, 6), jnp.int32))


EMPTY = list(_empty_cases())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,args,opts", EMPTY, ids=[c[0] for c in EMPTY])
def test_empty_inputs_with_masks(backend, name, args, opts):
    """Every row sees no key: output 0, lse = max = -inf, zero gradients (the reference's
    documented answer), on every backend."""
    q, k, v = args
    out, aux = attnaux.attention(q, k, v, backend=backend, **opts)
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    np.testing.assert_array_equal(np.asarray(out), 0)
    assert np.all(np.asarray(aux.lse) == -np.inf) and np.all(np.asarray(aux.max) == -np.inf)
    grads = jax.grad(
        lambda q, k, v: attnaux.attention(q, k, v, backend=backend, **opts)[0].sum(),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape
        np.testing.assert_array_equal(np.asarray(g), 0)


# --- 2. dropout replay is bit-exact --------------------------------------------------------------
@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("rate,seed", [(0.7, 29995), (0.1, 3), (0.3, 11), (0.9, 5)])
def test_dropout_mask_replays_the_kernels_bit_exactly(backend, rate, seed):
    """With q = k = 0 and v = I, `out[i, j]` is nonzero exactly where the kernel kept P[i, j]:
    it must be `introspect.dropout_mask` bit for bit (one threshold, from float32(rate))."""
    n = 64
    q = k = jnp.zeros((n, 1, 8))
    v = jnp.eye(n)[:, None, :]
    out, aux = attnaux.attention(q, k, v, dropout_rate=rate, key=jax.random.key(seed),
                                 backend=backend)
    kept = np.asarray(out[:, 0, :]) > 0
    replay = np.asarray(ai.dropout_mask(aux, q, k, dropout_rate=rate)[0])
    np.testing.assert_array_equal(kept, replay)
    ref, _ = attnaux.attention(q, k, v, dropout_rate=rate, key=jax.random.key(seed),
                               backend="reference")
    np.testing.assert_array_equal(np.asarray(ref[:, 0, :]) > 0, replay)


def test_the_reported_dropout_case():
    q = k = jnp.zeros((64, 1, 8))
    v = jnp.eye(64)[:, None, :]
    backend = COMPILED[0] if COMPILED else "reference"
    out, aux = attnaux.attention(q, k, v, dropout_rate=0.7, key=jax.random.key(29995),
                                 backend=backend)
    assert float(out[56, 0, 52]) > 0
    assert bool(ai.dropout_mask(aux, q, k, dropout_rate=0.7)[0, 56, 52])


# --- 4. 64-bit lengths and segment ids -----------------------------------------------------------
@pytest.mark.parametrize("backend", [*COMPILED, "reference"])
def test_int64_lengths_and_segment_ids_are_not_truncated(backend):
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
        full, _ = attnaux.attention(q, k, k, backend=backend)
        long, _ = attnaux.attention(q, k, k, kv_seqlens=jnp.array([2**32 + 1], jnp.int64),
                                    backend=backend)
        np.testing.assert_allclose(np.asarray(long), np.asarray(full), rtol=1e-6, atol=1e-6)
        wide = jnp.array([[0, 2**32, 0, 2**32]], jnp.int64)
        narrow = jnp.array([[0, 1, 0, 1]], jnp.int32)
        got, aux = attnaux.attention(q, k, k, q_segment_ids=wide, kv_segment_ids=wide,
                                     backend=backend)
        want, aux_want = attnaux.attention(q, k, k, q_segment_ids=narrow,
                                           kv_segment_ids=narrow, backend=backend)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(aux.lse), np.asarray(aux_want.lse), rtol=1e-6)
        assert float(jnp.abs(got - full).max()) > 0.1  # the segments really separate rows


# --- 5. static floats that change meaning in float32 ---------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(scale=1e39), r"`scale` must be finite and not rounded to 0 in float32.*inf"),
    (dict(scale=1e-46), r"`scale` must be finite and not rounded to 0 in float32.*0\.0"),
    (dict(softcap=1e-46), r"`softcap` must be finite and positive in float32.*0\.0"),
    (dict(softcap=1e39), r"`softcap` must be finite and positive in float32.*inf"),
])
def test_static_floats_are_checked_in_float32(kwargs, match):
    q = jnp.ones((2, 4, 2, 8))
    with pytest.raises(ValueError, match=match):
        attnaux.attention(q, q, q, **kwargs)
    with pytest.raises(ValueError, match=match):
        attnaux.explain(q, q, q, **kwargs)


# --- 15. masks and biases of lower rank broadcast by NumPy's rules -------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank1_mask_and_bias_broadcast_like_jax_nn(backend):
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 7, 2, 8)), jnp.float32) for _ in range(3))
    mask = jnp.arange(7) <= 3
    bias = jnp.asarray(rng.standard_normal(7), jnp.float32)
    out, _ = attnaux.attention(q, k, v, mask=mask, bias=bias, backend=backend)
    with jax.default_matmul_precision("float32"):  # jax.nn in full float32 on GPU too (not TF32)
        want = jax.nn.dot_product_attention(q, k, v, mask=mask, bias=bias)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)


# --- 12. a CPU-only build says why the CUDA module is missing ------------------------------------
@pytest.mark.skipif(_ffi.ext_cuda() is not None, reason="this build has the CUDA module")
def test_cpu_only_build_says_the_cuda_module_was_not_built():
    message = _ffi.CUDA_IMPORT_ERROR
    assert "circular" not in message
    assert "not built" in message and "CPU-only build" in message
    assert "cuDNN" in message


# --- 16. P's rounding does not grow with |lse| ---------------------------------------------------
PROBS_BACKENDS = ["reference", *(["probs", "small_seq"] if HAS_KERNELS else [])]


@pytest.mark.parametrize("backend", PROBS_BACKENDS)
def test_probs_error_does_not_grow_with_lse(backend):
    """P is normalised by the row sum, so a constant bias of 20 (lse ~ 100) leaves its error
    against float64 at float32 rounding (jax.nn's 1e-6 level), not |lse| * 2**-24 (~6e-6)."""
    rng = np.random.default_rng(0)
    q_seq, kv_seq = (1, 16) if backend == "small_seq" else (16, 64)
    q = jnp.asarray(rng.standard_normal((1, q_seq, 1, 8)) * 6, jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, kv_seq, 1, 8)) * 6, jnp.float32)
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = np.einsum("bqhd,bkhd->bhqk", q64, k64) / np.sqrt(8)
    want = np.exp(s - s.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    for shift in (0.0, 20.0):
        _, aux = attnaux.attention(q, k, k, bias=jnp.full((kv_seq,), shift), return_probs=True,
                                   backend=backend)
        assert float(aux.lse.mean()) > 3 * shift  # |lse| is large in the shifted case
        np.testing.assert_allclose(np.asarray(aux.probs), want, rtol=0, atol=2e-6)


# --- 3. long softmax rows keep their precision ---------------------------------------------------
@pytest.mark.skipif(not attnaux.softmax_kernel_available((1, 1, 8)), reason="no compiled softmax")
def test_long_softmax_rows_keep_their_precision():
    """The kernel's row sums are blocked (float inside a block, double across blocks), so lse,
    the probabilities' sum and the gradient's dot product do not lose precision with the row
    length (at 2**22 keys the plain float sum gave an lse error of about -2e-4)."""
    n = 2**22
    x = np.random.default_rng(0).normal(0, 4, size=(1, 1, n)).astype(np.float32)
    probs, aux = attnaux.softmax(jnp.asarray(x), scale=0.7, backend="kernel")
    s = x.astype(np.float64) * np.float64(np.float32(0.7))
    m = s.max()
    lse = m + np.log(np.exp(s - m).sum())
    assert abs(float(aux.lse[0, 0]) - lse) < 5e-6
    assert abs(np.asarray(probs, np.float64).sum() - 1.0) < 1e-5
    dlse = np.full((1, 1), 0.5, np.float32)
    dprobs = np.random.default_rng(1).normal(size=(1, 1, n)).astype(np.float32)
    _, vjp = jax.vjp(lambda x: attnaux.softmax(x, scale=0.7, backend="kernel"), jnp.asarray(x))
    cotangent = attnaux.AttnAux(lse=jnp.asarray(dlse), max=jnp.zeros((1, 1)), backend="kernel")
    (grad,) = vjp((jnp.asarray(dprobs), cotangent))
    p = np.exp(s - lse)
    want = 0.7 * p * (dprobs - ((p * dprobs).sum() - dlse[..., None]))
    err = np.abs(np.asarray(grad, np.float64) - want).max() / np.abs(want).max()
    assert err < 1e-5, err
