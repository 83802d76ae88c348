"""The `probs` kernel with bfloat16 inputs (csrc/cpu/probs_cpu.h; on a CPU with AVX512_BF16 its
products run on VDPBF16PS, P * drop and dS rounded to bfloat16 as operands, float32 accumulation
and statistics).

- forward against the float64 oracle (out, lse, max, P) and gradients against `reference` in
  float32 on the same bfloat16 values, with the tolerances stated below, at a shape of several
  64 x 64 tiles with GQA (head dims of whole vectors: the pair products' main path), with and
  without P written (the inference forward rounds P as it forms it), causal and not;
- key blocks holding NaN or inf (hidden by a mask) take the float32 products and keep them out;
- results are bitwise independent of the thread count, float32 and bfloat16.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import make_inputs
from thread_count import assert_same_on_one_and_all_cpus

import attnaux
from attnaux import _ffi, _probs_cpu

pytestmark = pytest.mark.skipif(
    not all(_ffi.has_target(t, "cpu") for t in (_probs_cpu.FWD_TARGET, _probs_cpu.BWD_TARGET)),
    reason="the compiled probs kernels are not registered for cpu",
)

# B, Sq, Skv, Hq, Hkv, D: 3 query blocks (the last partial) x 4 key tiles (the last partial).
SHAPE = (2, 150, 200, 4, 2, 64)

# Tolerances. out and the gradients: max |error| / max |exact value| over the array (measured
# here: out 2.5e-3 to 4.7e-3, gradients 2.9e-3 to 5.4e-3); they carry their own rounding to
# bfloat16 (8 significant bits: within 2^-8 relative) and that of P * drop and dS as product
# operands, summed over the keys. P: the float32 P rounded once, so within 2^-8 relative per
# element (plus float32's own error). lse and max: float32 statistics of scores from exact
# bfloat16 products (measured: 1e-6 absolute).
TOL_OUT = 1e-2
TOL_GRAD = 1.5e-2
TOL_PROBS = 2**-8 + 1e-5  # relative, per element
TOL_LSE = 2e-5  # absolute


def _inputs(seed):
    q, k, v = make_inputs(seed, *SHAPE[:5], SHAPE[5], SHAPE[5], jnp.bfloat16)
    rng = np.random.default_rng(seed + 1)
    w = jnp.asarray(rng.standard_normal(q.shape[:-1] + (v.shape[-1],)), jnp.float32)
    u = jnp.asarray(rng.standard_normal((SHAPE[0], SHAPE[3], SHAPE[1])), jnp.float32)
    z = jnp.asarray(rng.standard_normal((SHAPE[0], SHAPE[3], SHAPE[1], SHAPE[2])), jnp.float32)
    return q, k, v, w, u, z


def _relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(got - want)) / np.max(np.abs(want))


def _loss_and_grads(q, k, v, w, u, z, causal, backend):
    def loss(q, k, v):
        out, aux = attnaux.attention(q, k, v, causal=causal, return_probs=True, backend=backend)
        value = (jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(aux.lse * u)
                 + jnp.sum(aux.probs.astype(jnp.float32) * z))
        return value, (out, aux)

    (_, (out, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return out, aux, grads


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bf16_probs_against_float64(causal):
    q, k, v, w, u, z = _inputs(11 + causal)
    want_out, want_lse, want_max, want_p = oracle.attention(
        *(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), causal=causal)
    out, aux, grads = _loss_and_grads(q, k, v, w, u, z, causal, "probs")
    assert aux.backend == "probs" and out.dtype == aux.probs.dtype == jnp.bfloat16
    inference = jax.jit(lambda q, k, v: attnaux.attention(q, k, v, causal=causal,
                                                          backend="probs")[0])(q, k, v)
    for name, got in (("out", out), ("out without P", inference)):
        err = _relative_error(got.astype(jnp.float32), want_out)
        assert err < TOL_OUT, f"{name}: max error {err:.3g} of max |out| (tolerance {TOL_OUT})"
    np.testing.assert_allclose(np.asarray(aux.lse), want_lse, rtol=0, atol=TOL_LSE)
    np.testing.assert_allclose(np.asarray(aux.max), want_max, rtol=0, atol=TOL_LSE)
    p = np.asarray(aux.probs.astype(jnp.float32), np.float64)
    assert np.all((p == 0) == (want_p == 0)), "P is 0 exactly where no key is visible"
    np.testing.assert_allclose(p, want_p, rtol=TOL_PROBS, atol=1e-30)
    # gradients: `reference` in float32 on the same (bfloat16-exact) values
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, _, want_grads = _loss_and_grads(*f32, w, u, z, causal, "reference")
    for name, got, want in zip("qkv", grads, want_grads):
        err = _relative_error(got.astype(jnp.float32), want)
        assert err < TOL_GRAD, f"d{name}: max error {err:.3g} of max |d{name}| ({TOL_GRAD})"


def test_bf16_probs_nonfinite_key_blocks_keep_float32_products():
    """inf in K and NaN in V at keys that a mask hides from every row: their key blocks' tiles
    run on the float32 products (which keep them out, as the flash kernel's do), every other
    tile on the pair products; everything matches as above and holds no NaN."""
    q, k, v, w, u, z = _inputs(21)
    k = k.at[:, 100, 0, 5].set(jnp.inf)  # second key tile, kv head 0
    v = v.at[:, 190, 1, 7].set(jnp.nan)  # last (partial) key tile, kv head 1
    mask = np.ones(SHAPE[2], bool)
    mask[[100, 190]] = False
    mask = jnp.asarray(mask)
    want_out, want_lse, _, _ = oracle.attention(
        *(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), mask=np.asarray(mask),
        causal=True)

    def loss_and_grads(q, k, v, backend):
        def loss(q, k, v):
            out, aux = attnaux.attention(q, k, v, mask=mask, causal=True, backend=backend)
            return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(aux.lse * u), (out, aux)

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, (out, aux)), grads = fn(q, k, v)
        return out, aux, grads

    out, aux, grads = loss_and_grads(q, k, v, "probs")
    assert _relative_error(out.astype(jnp.float32), want_out) < TOL_OUT
    np.testing.assert_allclose(np.asarray(aux.lse), want_lse, rtol=0, atol=TOL_LSE)
    _, _, want_grads = loss_and_grads(*(x.astype(jnp.float32) for x in (q, k, v)), "reference")
    for name, got, want in zip("qkv", grads, want_grads):
        got = np.asarray(got.astype(jnp.float32))
        assert np.isfinite(got).all(), f"d{name} holds NaN or inf"
        assert _relative_error(got, want) < TOL_GRAD, f"d{name}"


_THREADS_SCRIPT = textwrap.dedent("""
    import os, sys
    cpus = sorted(os.sched_getaffinity(0))
    if sys.argv[1] == "one":
        os.sched_setaffinity(0, {cpus[0]})
    import jax, jax.numpy as jnp, numpy as np
    import attnaux
    rng = np.random.default_rng(0)
    results = []
    # (batch, q_seq, kv_seq, q_heads, kv_heads, dim): few (batch, kv head) pairs, so the backward
    # splits their query blocks into shares summed in order; and many pairs
    for dtype in ("float32", "bfloat16"):
        for b, sq, skv, hq, hk, d, causal in ((2, 200, 150, 4, 2, 64, "bottom_right"),
                                              (4, 70, 130, 8, 4, 32, False)):
            q, k, v = (jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype) for s in
                       [(b, sq, hq, d), (b, skv, hk, d), (b, skv, hk, d)])
            def f(q, k, v):
                out, aux = attnaux.attention(q, k, v, causal=causal, return_probs=True,
                                             backend="probs")
                return (jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(aux.lse)
                        + jnp.sum(aux.probs.astype(jnp.float32) ** 2)), (out, aux.lse, aux.probs)
            (_, res), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
            results += [np.asarray(x.astype(jnp.float32)) for x in (*res, *g)]
    np.savez(sys.argv[2], *results)
""")


def test_probs_results_do_not_depend_on_thread_count(tmp_path):
    assert_same_on_one_and_all_cpus(
        _THREADS_SCRIPT, tmp_path,
        [f"{dtype} case {c}: {n}" for dtype in ("float32", "bfloat16") for c in (0, 1)
         for n in ("out", "lse", "probs", "dq", "dk", "dv")])
