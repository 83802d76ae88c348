"""`jax.export` of functions that call attnaux (issue 20): the exported artifact serializes and
deserializes with no safety check disabled, and the round trip gives the same forward, aux and
VJP as the original function (compared with a float32 tolerance of 1e-6: the same kernels run on
the same inputs, so any difference would come only from XLA fusing the surrounding code
differently)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_FLASH

import attnaux as ax

TOL = 1e-6


def _inputs(backend="reference"):
    # GPU flash (cuDNN) takes bfloat16; then the round trip is compared at bfloat16's rounding
    # (cuDNN's dq is accumulated with atomics, so two runs differ by rounding)
    gpu_flash = backend == "flash" and jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu_flash else jnp.float32
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (2, 16, 4, 8), dtype)
    k = jax.random.normal(ks[1], (2, 16, 2, 8), dtype)
    v = jax.random.normal(ks[2], (2, 16, 2, 8), dtype)
    return q, k, v


def _close(a, b, what, loose=False):
    tol = 2e-2 if loose or a.dtype == jnp.bfloat16 else TOL
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                               atol=tol, err_msg=what)


@pytest.mark.parametrize("backend", ["flash", "probs", "reference"])
def test_export_round_trip_forward_and_vjp(backend):
    if backend != "reference":
        requires_flash_check()
    q, k, v = _inputs(backend)
    bias = jnp.linspace(-1, 1, 16 * 16, dtype=jnp.float32).reshape(1, 1, 16, 16)

    @jax.jit
    def f(q, k, v, bias):
        return ax.attention(q, k, v, bias=bias, causal=True, backend=backend,
                            return_probs=backend != "flash")

    exported = jax.export.export(f)(q, k, v, bias)  # no disabled_checks
    restored = jax.export.deserialize(exported.serialize(vjp_order=1))
    out, aux = restored.call(q, k, v, bias)
    want, want_aux = f(q, k, v, bias)
    assert isinstance(aux, ax.AttnAux) and aux.backend == want_aux.backend
    _close(out, want, "out")
    for field in ("lse", "max") + (("probs",) if backend != "flash" else ()):
        _close(getattr(aux, field), getattr(want_aux, field), field)

    def loss(fn):
        def value(q, k, v, bias):
            out, aux = fn(q, k, v, bias)
            extra = 0.0 if aux.probs is None else jnp.sum(aux.probs ** 2)
            return jnp.sum(out * jnp.cos(out)) + jnp.sum(aux.lse) + extra
        return value

    got = jax.grad(loss(restored.call), argnums=(0, 1, 2, 3))(q, k, v, bias)
    expected = jax.grad(loss(f), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, w, name in zip(got, expected, ("q", "k", "v", "bias")):
        _close(g, w, f"d{name}", loose=q.dtype == jnp.bfloat16)


def test_export_with_dropout_replays_the_same_mask():
    requires_flash_check()
    q, k, v = _inputs("flash")

    @jax.jit
    def f(q, k, v, key):
        return ax.attention(q, k, v, dropout_rate=0.2, key=key, backend="flash")

    key = jax.random.key(3)
    restored = jax.export.deserialize(jax.export.export(f)(q, k, v, key).serialize())
    out, aux = restored.call(q, k, v, key)
    want, want_aux = f(q, k, v, key)
    _close(out, want, "out")
    np.testing.assert_array_equal(np.asarray(aux.rng_state), np.asarray(want_aux.rng_state))


def test_export_softmax_round_trip():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 5, 7)), jnp.float32)
    f = jax.jit(lambda x: ax.softmax(x, causal=True))
    restored = jax.export.deserialize(jax.export.export(f)(x).serialize(vjp_order=1))
    probs, aux = restored.call(x)
    want, want_aux = f(x)
    _close(probs, want, "probs")
    _close(aux.lse, want_aux.lse, "lse")
    g = jax.grad(lambda x: jnp.sum(restored.call(x)[1].lse))(x)
    _close(g, jax.grad(lambda x: jnp.sum(f(x)[1].lse))(x), "dlogits")


def requires_flash_check():
    if not HAS_FLASH:
        pytest.skip("the compiled kernels are not built")
