"""Dropout with a replayable RNG state, softcap and attention sinks (issue 3).

The compiled `flash` kernel and the pure-JAX `reference` draw the dropout keep-mask from the same
documented Philox counter layout, so the two must agree to float32 rounding with dropout on; the
mask the kernel really used is extracted exactly (with one-hot values) and compared bit for bit
with `attnaux.introspect.dropout_mask`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_close,
    attention_and_grads,
    loss_weights,
    make_inputs,
    make_options,
    requires_flash,
    tol,
)

import attnaux as ax
from attnaux import introspect as ai

F32 = jnp.float32


def kernel_keep_mask(batch, heads, q_seq, kv_seq, rate, key, backend="flash", **options):
    """The keep-mask a backend really applied, read off its output: with q = 0 every visible key
    has probability 1/kv_seq, and with one-hot values v[j] = e_j the output is
    out[i, j] = keep(i, j) / (kv_seq * (1 - rate))."""
    q = jnp.zeros((batch, q_seq, heads, 4), F32)
    k = jnp.zeros((batch, kv_seq, 1, 4), F32)
    v = jnp.broadcast_to(jnp.eye(kv_seq, dtype=F32)[None, :, None, :], (batch, kv_seq, 1, kv_seq))
    out, aux = ax.attention(q, k, v, dropout_rate=rate, key=key, backend=backend, **options)
    scaled = np.asarray(out) * kv_seq * (1 - rate)  # [B, Sq, H, Skv], 0 or 1
    assert np.all((np.abs(scaled) < 1e-5) | (np.abs(scaled - 1) < 1e-5))
    return np.transpose(scaled > 0.5, (0, 2, 1, 3)), aux, q, k


@requires_flash
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kernel_mask_is_dropout_mask_bit_for_bit(rate):
    keep, aux, q, k = kernel_keep_mask(2, 3, 37, 67, rate, jax.random.key(7))
    replay = np.asarray(ai.dropout_mask(aux, q, k, dropout_rate=rate))
    assert keep.shape == replay.shape
    assert np.array_equal(keep, replay), f"{(keep != replay).sum()} of {keep.size} differ"


@requires_flash
def test_dropped_fraction_over_a_million_elements():
    rate = 0.3
    keep, aux, q, k = kernel_keep_mask(8, 8, 128, 128, rate, jax.random.key(3))
    assert keep.size == 2**20
    assert abs((1 - keep.mean()) - rate) < 0.01
    assert np.array_equal(keep, np.asarray(ai.dropout_mask(aux, q, k, dropout_rate=rate)))


def test_reference_mask_is_dropout_mask():
    rate = 0.4
    keep, aux, q, k = kernel_keep_mask(1, 2, 9, 33, rate, jax.random.key(1), backend="reference")
    assert np.array_equal(keep, np.asarray(ai.dropout_mask(aux, q, k, dropout_rate=rate)))


CASES = {
    "plain": dict(),
    "causal_gqa": dict(causal=True),
    "bottom_right_window": dict(causal="bottom_right", window=(5, None)),
    "mask_bias": dict(mask="B1QK", bias="HQK"),
    "seqlens": dict(q_seqlens="edges", kv_seqlens="rand"),
    "segments": dict(segments=3),
    "softcap_sink": dict(softcap=5.0, sink=True),
    "everything": dict(causal=True, mask="b1QK", bias="B1QK", kv_seqlens="rand", segments=2,
                       softcap=8.0, sink=True),
}


@requires_flash
# each case batched or not in turn, the other form in the slow run
@pytest.mark.parametrize("name,batch", [
    pytest.param(name, batch, id=f"{'b3' if batch else 'unbatched'}-{name}",
                 marks=[pytest.mark.slow] if (n + (batch == ())) % 2 else [])
    for n, name in enumerate(sorted(CASES)) for batch in ((), (3,))])
def test_flash_equals_reference_with_dropout(name, batch):
    """The reference draws its mask from the same Philox layout, so with dropout on both must
    agree on out, lse and every gradient (the backward regenerates the mask from rng_state)."""
    q, k, v = make_inputs(11, batch, 29, 43, 4, 2, 32, 16)
    opts = make_options(5, batch or (1,), 29, 43, 4, **CASES[name])
    if batch == ():  # make_options builds batched arrays; drop the unit batch dimension
        opts = {n: (x[0] if n in ("q_seqlens", "kv_seqlens", "q_segment_ids", "kv_segment_ids")
                    or (n in ("bias", "mask") and x.ndim == 4) else x) for n, x in opts.items()}
    w, u = loss_weights(1, q, v)
    key = jax.random.key(42)
    got = attention_and_grads(q, k, v, w, u, backend="flash", dropout_rate=0.25, key=key, **opts)
    want = attention_and_grads(q, k, v, w, u, backend="reference", dropout_rate=0.25, key=key,
                               **opts)
    assert_close(got[0], want[0], tol(F32, "out"), "out")
    assert_close(got[1].lse, want[1].lse, tol(F32, "lse"), "lse")
    assert np.array_equal(np.asarray(got[1].rng_state), np.asarray(want[1].rng_state))
    for n in want[2]:
        assert_close(got[2][n], want[2][n], tol(F32, "grad"), f"d{n}")


@requires_flash
def test_dropout_output_from_replayed_mask():
    """Independent of the reference's dropout code: out = (P * keep / (1 - rate)) @ v with P from
    a dropout-free call and keep from `dropout_mask`."""
    q, k, v = make_inputs(2, (2,), 17, 31, 4, 1, 16, 8)
    rate = 0.35
    out, aux = ax.attention(q, k, v, causal=True, dropout_rate=rate, key=jax.random.key(9))
    _, aux_p = ax.attention(q, k, v, causal=True, return_probs=True)
    keep = ai.dropout_mask(aux, q, k, dropout_rate=rate)
    weights = jnp.where(keep, aux_p.probs / (1 - rate), 0)
    expected = jnp.einsum("bhqk,bkhd->bqhd", weights, jnp.repeat(v, 4, axis=2),
                          precision="highest")
    assert_close(out, expected, tol(F32, "out"), "out")
    assert_close(aux.lse, aux_p.lse, tol(F32, "lse"), "lse (dropout does not change lse)")


@requires_flash
def test_same_key_bitwise_identical_different_keys_differ():
    q, k, v = make_inputs(3, (2,), 33, 33, 4, 2, 32, 32)

    def run(key):
        def loss(q, k, v):
            out, aux = ax.attention(q, k, v, dropout_rate=0.2, key=key)
            return jnp.sum(out**2) + jnp.sum(aux.lse), (out, aux.lse)

        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return [np.asarray(x) for x in (out, lse, *grads)]

    first, again = run(jax.random.key(1)), run(jax.random.key(1))
    for a, b in zip(first, again):
        assert np.array_equal(a, b)
    other = run(jax.random.key(2))
    assert not np.array_equal(first[0], other[0])
    assert np.array_equal(first[1], other[1])  # lse does not see dropout


@requires_flash
def test_vmap_with_dropout_matches_per_element_calls():
    """Under vmap each mapped element gets the mask of its own unbatched call (the mask is a
    function of rng_state and the call's shapes, not of how it was batched)."""
    q, k, v = make_inputs(4, (3,), 16, 24, 2, 2, 16, 16)
    key = jax.random.key(5)
    f = lambda q: ax.attention(q, k[0], v[0], dropout_rate=0.5, key=key)[0]
    mapped = jax.vmap(f)(q)
    for n in range(3):
        assert np.array_equal(np.asarray(mapped[n]), np.asarray(f(q[n])))


def test_rate_zero_and_missing_key():
    q, k, v = make_inputs(5, (), 8, 8, 2, 2, 8, 8)
    out0, aux0 = ax.attention(q, k, v, dropout_rate=0.0, key=jax.random.key(0))
    out, aux = ax.attention(q, k, v)
    assert aux0.rng_state is None and aux.rng_state is None
    assert np.array_equal(np.asarray(out0), np.asarray(out))
    with pytest.raises(ValueError, match="dropout_rate=0.1.*needs a PRNG key"):
        ax.attention(q, k, v, dropout_rate=0.1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(dropout_rate=1.0), ValueError, r"dropout_rate.*\[0, 1\)"),
        (dict(dropout_rate=-0.1), ValueError, r"dropout_rate.*\[0, 1\)"),
        (dict(softcap=0.0), ValueError, "softcap.*positive"),
        (dict(softcap=-2.0), ValueError, "softcap.*positive"),
        (dict(sink=jnp.zeros((3,))), (ValueError, TypeError), "sink"),
        (dict(dropout_rate=0.1, key=jnp.zeros((3,), jnp.uint32)), TypeError, "key"),
        (dict(dropout_rate=0.1, key=jnp.zeros((2,), jnp.float32)), TypeError, "key"),
    ],
)
def test_bad_dropout_softcap_sink_arguments(kwargs, error, match):
    q, k, v = make_inputs(6, (2,), 8, 8, 4, 2, 8, 8)
    with pytest.raises(error, match=match):
        ax.attention(q, k, v, **kwargs)
    with pytest.raises(error, match=match):  # also with the jaxtyping layer off
        ax.attention.__wrapped__(q, k, v, **kwargs)


@requires_flash
@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_softcap_stats_are_of_capped_logits(backend):
    q, k, v = make_inputs(7, (1,), 12, 20, 2, 2, 16, 16)
    q = q * 20  # large logits, so the cap matters
    cap = 3.0
    out, aux = ax.attention(q, k, v, softcap=cap, backend=backend)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / 4.0
    capped = cap * jnp.tanh(logits / cap)
    assert_close(aux.max, capped.max(-1), (1e-5, 1e-5), "max")
    assert_close(aux.lse, jax.nn.logsumexp(capped, -1), (1e-5, 1e-5), "lse")
    assert float(aux.max.max()) <= cap


@requires_flash
@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_zero_sink_is_off_by_one_softmax(backend):
    q, k, v = make_inputs(8, (2,), 10, 14, 3, 3, 8, 8)
    out, aux = ax.attention(q, k, v, sink=jnp.zeros((3,)), backend=backend)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(8)
    e = jnp.exp(logits)
    expected = jnp.einsum("bhqk,bkhd->bqhd", e / (1 + e.sum(-1, keepdims=True)), v,
                          precision="highest")
    assert_close(out, expected, (1e-5, 1e-5), "out")
    assert_close(aux.lse, jnp.log1p(e.sum(-1)), (1e-5, 1e-5), "lse includes the sink")
    assert_close(aux.max, logits.max(-1), (1e-5, 1e-5), "max excludes the sink")


@requires_flash
@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_fully_masked_row_with_sink(backend):
    q, k, v = make_inputs(9, (1,), 6, 6, 2, 1, 8, 8)
    sink = jnp.array([0.5, -1.5])
    mask = jnp.ones((1, 1, 6, 6), bool).at[:, :, 2, :].set(False)

    def loss(q, k, v, sink):
        out, aux = ax.attention(q, k, v, mask=mask, sink=sink, q_seqlens=jnp.array([5]),
                                backend=backend)
        return jnp.sum(out) + jnp.sum(aux.lse), (out, aux)

    (_, (out, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, sink)
    for row in (2, 5):  # fully masked, and padding
        assert np.all(np.asarray(out[0, row]) == 0)
        assert np.allclose(np.asarray(aux.lse[0, :, row]), np.asarray(sink))
        assert np.all(np.isneginf(np.asarray(aux.max[0, :, row])))
        assert np.all(np.asarray(grads[0][0, row]) == 0)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))


@requires_flash
def test_sink_gradient_matches_reference_with_everything():
    q, k, v = make_inputs(10, (2, 2), 19, 23, 4, 2, 16, 16, jnp.float32)
    opts = make_options(3, (2, 2), 19, 23, 4, sink=True, bias="bHQK", causal="bottom_right",
                        window=(4, 2), kv_seqlens="edges", softcap=6.0)
    w, u = loss_weights(2, q, v)
    got = attention_and_grads(q, k, v, w, u, backend="flash", **opts)
    want = attention_and_grads(q, k, v, w, u, backend="reference", **opts)
    for n in want[2]:
        assert_close(got[2][n], want[2][n], tol(F32, "grad"), f"d{n}")
