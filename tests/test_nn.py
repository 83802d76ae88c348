"""attnaux.nn.MultiheadAttention: a drop-in for equinox.nn.MultiheadAttention returning aux."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux
from attnaux.nn import MultiheadAttention

KW = dict(use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True)


def pair(**kwargs):
    key = jax.random.key(0)
    ours = MultiheadAttention(4, 32, key_size=24, value_size=20, output_size=16, qk_size=8,
                              vo_size=6, **KW, **kwargs, key=key)
    theirs = eqx.nn.MultiheadAttention(4, 32, key_size=24, value_size=20, output_size=16,
                                       qk_size=8, vo_size=6, **KW, key=jax.random.key(1))
    return ours, theirs


def inputs(q_seq=10, kv_seq=13):
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    return (jax.random.normal(k1, (q_seq, 32)), jax.random.normal(k2, (kv_seq, 24)),
            jax.random.normal(k3, (kv_seq, 20)))


def test_weights_load_both_ways(tmp_path):
    ours, theirs = pair()
    assert [x.shape for x in jax.tree.leaves(eqx.filter(ours, eqx.is_array))] == [
        x.shape for x in jax.tree.leaves(eqx.filter(theirs, eqx.is_array))]
    eqx.tree_serialise_leaves(tmp_path / "theirs.eqx", theirs)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "theirs.eqx", ours)
    assert np.array_equal(loaded.query_proj.weight, theirs.query_proj.weight)
    eqx.tree_serialise_leaves(tmp_path / "ours.eqx", ours)
    back = eqx.tree_deserialise_leaves(tmp_path / "ours.eqx", theirs)
    assert np.array_equal(back.output_proj.bias, ours.output_proj.bias)


@pytest.mark.parametrize("mask_kind", [None, "2d", "3d"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_matches_equinox(tmp_path, mask_kind, backend):
    ours, theirs = pair(backend=backend)
    eqx.tree_serialise_leaves(tmp_path / "w.eqx", theirs)
    ours = eqx.tree_deserialise_leaves(tmp_path / "w.eqx", ours)
    q, k, v = inputs()
    rng = np.random.default_rng(0)
    mask = None
    if mask_kind is not None:  # random masks with at least one visible key per row
        shape = (10, 13) if mask_kind == "2d" else (4, 10, 13)
        m = rng.random(shape) < 0.6
        m[..., 0] = True
        mask = jnp.asarray(m)
    out, aux = ours(q, k, v, mask)
    expected = theirs(q, k, v, mask)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert aux.lse.shape == (4, 10) and aux.max.shape == (4, 10)


def test_causal_gqa_and_transforms():
    layer = MultiheadAttention(8, 64, kv_heads=2, causal=True, key=jax.random.key(3))
    assert layer.key_proj.weight.shape == (2 * 8, 64)
    x = jax.random.normal(jax.random.key(4), (5, 12, 64))

    @eqx.filter_jit
    def loss(layer, x):
        out, aux = jax.vmap(lambda x: layer(x, x, x))(x)
        return jnp.mean(out**2) + 1e-3 * jnp.mean(aux.lse**2)

    grads = eqx.filter_grad(loss)(layer, x)
    assert jnp.all(jnp.isfinite(grads.query_proj.weight))
    # Against the reference backend and a causal mask written out.
    out, aux = jax.vmap(lambda x: layer(x, x, x))(x)
    tril = jnp.tril(jnp.ones((12, 12), bool))
    out_ref, aux_ref = jax.vmap(
        lambda x: layer(x, x, x, tril, causal=False, backend="reference")
    )(x)
    np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux.lse, aux_ref.lse, rtol=1e-5, atol=1e-5)


def test_dropout_needs_key_and_inference_turns_it_off():
    layer = MultiheadAttention(2, 16, dropout_p=0.5, key=jax.random.key(5))
    x = jax.random.normal(jax.random.key(6), (7, 16))
    with pytest.raises(RuntimeError, match="key"):
        layer(x, x, x)
    out_a, aux_a = layer(x, x, x, key=jax.random.key(1))
    out_b, _ = layer(x, x, x, key=jax.random.key(2))
    assert aux_a.rng_state is not None and not np.allclose(out_a, out_b)
    out_inf, aux_inf = layer(x, x, x, inference=True)
    assert aux_inf.rng_state is None
    eval_layer = eqx.nn.inference_mode(layer)
    np.testing.assert_array_equal(eval_layer(x, x, x)[0], out_inf)


def test_process_heads_and_bad_arguments():
    layer = MultiheadAttention(2, 16, key=jax.random.key(7))
    x = jax.random.normal(jax.random.key(8), (7, 16))
    flipped, _ = layer(x, x, x, process_heads=lambda q, k, v: (q, k, -v))
    plain, _ = layer(x, x, x)
    assert not np.allclose(flipped, plain)
    with pytest.raises(ValueError, match="must not change the shape"):
        layer(x, x, x, process_heads=lambda q, k, v: (q[:3], k, v))
    with pytest.raises(ValueError, match="kv_heads"):
        MultiheadAttention(4, 16, kv_heads=3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="equal length"):
        layer(x, x, x[:3])
    assert attnaux.nn.MultiheadAttention is MultiheadAttention
