"""`attnaux.parallel` on a one-device mesh, on whatever platform runs the tests (the C++ flash
kernels on CPU, cuDNN on GPU): with `layout="zigzag"` the device holds two chunks, so the ring's
block calls include a full block, a causal block on the diagonal and a skipped one, and every
path of the block forward and backward runs. The multi-device runs are in `tests/spmd`.

Reference: `attnaux.attention` with the same backend on the same arrays. Tolerances: float32 on
CPU as in `tests/spmd/test_parallel.py` (1e-5); bfloat16 on GPU, where both sides round their
outputs to bfloat16 (2 ulp = 1.6e-2 relative) and cuDNN accumulates dq with atomics.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_FLASH
from jax.sharding import PartitionSpec as P

import attnaux as ax
import attnaux.parallel as par

pytestmark = pytest.mark.skipif(not HAS_FLASH, reason="the compiled kernels are not built")


def _setup(axis: str, seq: int, seed: int):
    """A one-device mesh over `axis`, the tolerance of the platform, and `q, k, v` (GQA 4:2,
    dim 64) in the platform's flash dtype (bfloat16 for cuDNN)."""
    gpu = jax.default_backend() == "gpu"
    dtype, tol = (jnp.bfloat16, 2e-2) if gpu else (jnp.float32, 1e-5)
    mesh = jax.make_mesh((1,), (axis,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])
    ks = jax.random.split(jax.random.key(seed), 3)
    heads = (4, 2, 2)
    return mesh, tol, tuple(jax.random.normal(key, (2, seq, h, 64), dtype)
                            for key, h in zip(ks, heads))


def _check(cp, plain, q, k, v, tol):
    """`cp(q, k, v) -> (out, lse)` (the ring, jitted) against `plain` (the one-call flash):
    the values, and the gradients of `sum(sin(out)) + 0.3 * sum(lse)`."""
    def loss(fn):
        return lambda q, k, v: (jnp.sum(jnp.sin(fn(q, k, v)[0].astype(jnp.float32)))
                                + 0.3 * jnp.sum(fn(q, k, v)[1]))

    # both sides jitted (eager, the reference side compiled each of its ops on its own)
    for got, want, name in zip(jax.jit(cp)(q, k, v), jax.jit(plain)(q, k, v), ("out", "lse")):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol, err_msg=name)
    grads = jax.jit(jax.grad(loss(cp), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(q, k, v)
    for g, w, name in zip(grads, want, "qkv"):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = max(1.0, float(np.abs(w).max()))
        assert float(np.abs(g - w).max()) <= tol * scale, f"d{name}"


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("causal", [True, False])
def test_zigzag_on_one_device(strategy, causal):
    mesh, tol, (q, k, v) = _setup("sp", seq=128, seed=0)
    seqlens = jnp.asarray([128, 77], jnp.int32)

    def cp(q, k, v):
        def local(q, k, v, lens):
            out, aux = par.ring_attention(q, k, v, axis_name="sp", causal=causal,
                                          layout="zigzag", strategy=strategy, kv_seqlens=lens)
            return out, aux.lse
        return jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),),
                             out_specs=(P(None, "sp"), P(None, None, "sp")))(q, k, v, seqlens)

    def plain(q, k, v):
        out, aux = ax.attention(q, k, v, causal=causal, kv_seqlens=seqlens, backend="flash")
        return out, aux.lse

    _check(cp, plain, q, k, v, tol)


@pytest.mark.parametrize("options", [
    dict(causal=True, window=(20, 0)), dict(causal=False, window=(70, 10)),
    dict(causal="bottom_right", q_seqlens=jnp.asarray([100, 37]),
         kv_seqlens=jnp.asarray([128, 30]))],
    ids=["causal-window20", "window70-10", "bottom-right-lengths"])
def test_zigzag_windows_on_one_device(options):
    """Windows and a bottom-right mask with lengths on a one-device zigzag ring (chunks of 64:
    the blocks have shifts 0 and +-64, plus kv_len - q_len of each row): on GPU each block is a
    static cuDNN call (`_ring._band`, `_ring._diagonal_kind`)."""
    mesh, tol, (q, k, v) = _setup("sp", seq=128, seed=2)

    def cp(q, k, v):
        def local(q, k, v):
            out, aux = par.ring_attention(q, k, v, axis_name="sp", layout="zigzag", **options)
            return out, aux.lse
        return jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                             out_specs=(P(None, "sp"), P(None, None, "sp")))(
            *(par.zigzag(x, 1, axis=1) for x in (q, k, v)))

    def plain(q, k, v):
        out, aux = ax.attention(q, k, v, backend="flash", **options)
        return out, aux.lse

    _check(cp, plain, q, k, v, tol)


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_zigzag_dropout_on_one_device(strategy):
    """Dropout on a one-device zigzag ring with the compiled kernels (the C++ kernels on CPU;
    on a Hopper GPU attnaux's own kernels, which draw each block's part of the whole problem's
    keep-mask): equal to the `reference` backend (attnaux's generator) with the same key."""
    mesh, tol, (q, k, v) = _setup("sp", seq=128, seed=3)
    if jax.default_backend() == "gpu" and not str(
            getattr(jax.devices()[0], "compute_capability", "")).startswith("9."):
        pytest.skip("dropout under context parallelism on GPU needs attnaux's Hopper kernels")
    options = dict(causal=True, window=(90, 0), dropout_rate=0.25,
                   kv_seqlens=jnp.asarray([128, 101], jnp.int32))
    key = jax.random.key(8)

    def cp(q, k, v):
        def local(q, k, v, key):
            out, aux = par.ring_attention(q, k, v, axis_name="sp", layout="zigzag",
                                          strategy=strategy, key=key, **options)
            return out, aux.lse
        out, lse = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),),
                                 out_specs=(P(None, "sp"), P(None, None, "sp")))(
            *(par.zigzag(x, 1, axis=1) for x in (q, k, v)), key)
        return par.unzigzag(out, 1, axis=1), par.unzigzag(lse, 1, axis=2)

    def plain(q, k, v):
        out, aux = ax.attention(q, k, v, backend="reference", key=key, **options)
        return out, aux.lse

    _check(cp, plain, q, k, v, tol)


@pytest.mark.parametrize("check_vma", [True, False])
def test_attention_inside_shard_map_on_one_device(check_vma):
    """`attnaux.attention` (the platform's flash backend: cuDNN on GPU) inside `jax.shard_map`,
    forward and gradients with a replicated sink, against the same call outside (issue 20; the
    multi-device runs are in `tests/spmd/test_spmd.py`)."""
    mesh, tol, (q, k, v) = _setup("x", seq=64, seed=1)
    sink = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)

    def loss(q, k, v, sink):
        out, aux = ax.attention(q, k, v, causal=True, sink=sink, backend="flash")
        return jnp.sum(jnp.sin(out.astype(jnp.float32))) + jnp.sum(aux.lse)

    f = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2, 3)), mesh=mesh,
                              in_specs=(P("x"), P("x"), P("x"), P()),
                              out_specs=(P("x"), P("x"), P("x"), P()), check_vma=check_vma))
    for g, w, name in zip(f(q, k, v, sink), jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sink),
                          ("q", "k", "v", "sink")):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert float(np.abs(g - w).max()) <= tol * max(1.0, float(np.abs(w).max())), f"d{name}"
