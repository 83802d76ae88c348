"""`score_mod` under `jax.shard_map` (batch sharded over 4 devices) and under `jax.jit` with a
sharded batch: out, lse and the gradients of q and of the captured table equal the single-device
call (float32, 2e-5 / 1e-4 relative to the largest entry)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import attnaux as ax

S = 150


def _f(q, k, v, rel):
    out, aux = ax.attention(q, k, v, causal=True,
                            score_mod=lambda s, b, h, i, j: s + rel[i - j + S])
    return out, aux.lse


def _loss(q, k, v, rel):
    out, lse = _f(q, k, v, rel)
    return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))


def _close(got, want, rel, what):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * max(1.0, np.abs(want).max()),
                               err_msg=what)


def test_score_mod_under_shard_map_and_sharded_jit():
    mesh = jax.make_mesh((4,), ("b",), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = (jax.random.normal(jax.random.key(i), (4, S, 4, 16)) for i in range(3))
    rel = jax.random.normal(jax.random.key(5), (2 * S,))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    grads = jax.shard_map(lambda q, k, v, rel: jax.grad(_loss, argnums=(0, 3))(q, k, v, rel),
                          mesh=mesh, in_specs=(P("b"), P("b"), P("b"), P()),
                          out_specs=(P("b"), P()))
    dq, drel = jax.jit(grads)(put(q, P("b")), put(k, P("b")), put(v, P("b")), put(rel, P()))
    want_dq, want_drel = jax.grad(_loss, argnums=(0, 3))(q, k, v, rel)
    _close(dq, want_dq, 1e-4, "dq under shard_map")
    _close(drel, want_drel, 1e-4, "d(captured table) under shard_map")
    out, lse = jax.jit(_f)(put(q, P("b")), put(k, P("b")), put(v, P("b")), rel)
    want_out, want_lse = _f(q, k, v, rel)
    _close(out, want_out, 2e-5, "out, jit with a sharded batch")
    _close(lse, want_lse, 2e-5, "lse, jit with a sharded batch")


def test_sharded_jit_over_batch_and_heads_sees_global_indices():
    """The compiled score program under `jax.jit` with batch and heads split 2 x 2: a function
    of the head and batch index (per-head slopes, a per-batch offset) sees the global indices
    (the shard's origin travels in the kernel's block state), gradients of the slopes too."""
    mesh = jax.make_mesh((2, 2), ("b", "h"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    q, k, v = (jax.random.normal(jax.random.key(i), (4, 70, 4, 16)) for i in range(3))
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])

    def loss(q, k, v, slopes):
        out, aux = ax.attention(
            q, k, v, causal=True,
            score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j) + 0.5 * b)
        assert aux.backend == "flash"
        return jnp.sum(out**2) + jnp.sum(aux.lse), (out, aux.lse)

    grad = jax.grad(loss, argnums=(0, 3), has_aux=True)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("b", None, "h")))  # noqa: E731
    (dq, dslopes), (out, lse) = jax.jit(grad)(put(q), put(k), put(v), slopes)
    (want_dq, want_dslopes), (want_out, want_lse) = jax.jit(grad)(q, k, v, slopes)
    _close(out, want_out, 2e-5, "out, batch x heads sharded")
    _close(lse, want_lse, 2e-5, "lse, batch x heads sharded")
    _close(dq, want_dq, 1e-4, "dq, batch x heads sharded")
    _close(dslopes, want_dslopes, 1e-4, "d(slopes), batch x heads sharded")
    r_out, r_aux = ax.attention(
        q, k, v, causal=True, backend="reference",
        score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j) + 0.5 * b)
    _close(want_out, r_out, 2e-5, "out against the materialised reference")


def test_dropout_with_functions_under_sharded_jit():
    """Dropout next to score_mod, batch and heads split 2 x 2: each shard draws its part of the
    unsharded call's keep-mask (the origin in the block state), so out equals the unsharded
    call and the materialised reference with the same key."""
    mesh = jax.make_mesh((2, 2), ("b", "h"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    q, k, v = (jax.random.normal(jax.random.key(i), (4, 70, 4, 16)) for i in range(3))
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
    key = jax.random.key(9)

    def f(q, k, v, backend="auto"):
        out, aux = ax.attention(q, k, v, causal=True, dropout_rate=0.3, key=key,
                                score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j),
                                backend=backend)
        return out

    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("b", None, "h")))  # noqa: E731
    out = jax.jit(f)(put(q), put(k), put(v))
    _close(out, jax.jit(f)(q, k, v), 2e-5, "out, batch x heads sharded, dropout")
    _close(out, f(q, k, v, "reference"), 2e-5, "out against the reference, dropout")
