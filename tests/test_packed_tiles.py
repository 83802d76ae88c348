"""Packed sequences on the CPU flash and probs kernels skip the tiles their segment ids hide
(issue 22): a (query tile, key tile) pair whose keys lie outside the segments of the tile's rows
is not computed, keys at its edges are trimmed, and a tile inside one segment needs no
per-element mask. Results must not change: against the pure-JAX reference (float32, the `TOL` of
`conftest.py`) for documents that straddle tile boundaries (64 rows and keys per tile), sorted
and unsorted ids, with causal masks, lengths and a bias, forward and gradients; for `probs` also
P and the gradients through it, P and dbias exactly 0 on the pairs of different segments, and a
query segment with no key (lse = -inf, out = 0, P = 0)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    TOL,
    assert_close,
    attention_and_grads,
    loss_weights,
    make_inputs,
    probe_loss,
    requires_flash,
    split_options,
)

import attnaux
from attnaux import _ffi

T = 320  # 5 tiles of 64


def _segments(kind: str, rng) -> np.ndarray:
    if kind == "sorted":  # documents of 50, 70, 36, 100 and 64 tokens: boundaries inside tiles
        return np.repeat(np.arange(5), [50, 70, 36, 100, 64]).astype(np.int32)
    if kind == "one":  # a single document: every tile inside one segment
        return np.zeros(T, np.int32)
    return rng.integers(0, 4, T).astype(np.int32)  # interleaved ids: no tile can be skipped


@requires_flash
@pytest.mark.parametrize("kind", ["sorted", "one", "interleaved"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_flash_matches_reference(kind, causal):
    rng = np.random.default_rng(0)
    seg = np.stack([_segments(kind, rng), _segments("sorted", rng)])  # [2, T]
    q, k, v = make_inputs(1, 2, T, T, 4, 2, 16, 16, jnp.float32)
    w, u = loss_weights(2, q, v)
    options = dict(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), causal=causal,
                   q_seqlens=jnp.asarray([T, 290]), kv_seqlens=jnp.asarray([300, T]),
                   bias=jnp.asarray(rng.standard_normal((1, 4, T, T)), jnp.float32))
    out, aux, grads = attention_and_grads(q, k, v, w, u, backend="flash", **options)
    r_out, r_aux, r_grads = attention_and_grads(q, k, v, w, u, backend="reference", **options)
    tol = TOL[jnp.float32]
    assert_close(out, r_out, tol["out"], "out")
    assert_close(aux.lse, r_aux.lse, tol["lse"], "lse")
    for name in grads:
        assert_close(grads[name], r_grads[name], tol["grad"], f"d{name}")


requires_probs = pytest.mark.skipif(
    not _ffi.has_target("attnaux_probs_fwd", "cpu"),
    reason="the compiled `probs` kernels are not registered for cpu",
)


def _with_probs(backend, q, k, v, w, u, z, **options):
    """`(out, aux, grads)` of `probe_loss(out, lse) + sum(P * z)` with `return_probs=True`, jitted:
    the gradients flow through out, lse and P."""
    diff, arrays, static = split_options(q, k, v, options)

    def loss(diff, arrays):
        extra = {n: x for n, x in diff.items() if n not in ("q", "k", "v")}
        out, aux = attnaux.attention(diff["q"], diff["k"], diff["v"], **extra, **arrays,
                                     **static, return_probs=True, backend=backend)
        return probe_loss(out, aux.lse, w, u) + jnp.sum(aux.probs * z), (out, aux)

    (_, (out, aux)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff, arrays)
    return out, aux, grads


@requires_probs
@pytest.mark.parametrize("kind", ["sorted", "no_key", "gap", "interleaved"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_probs_matches_reference(kind, causal):
    rng = np.random.default_rng(1)
    q_ids = _segments("interleaved" if kind == "interleaved" else "sorted", rng)
    kv_ids = q_ids.copy()
    if kind == "no_key":  # rows 130..139 (inside the 100-token document) have no key
        q_ids[130:140] = 9
    if kind == "gap":  # unsorted keys: query block 1 (documents 1, 2) skips key tile 2 but not 3
        kv_ids[128:192] = 7
        kv_ids[200:211] = 1
    seg_q = np.stack([q_ids, _segments("sorted", rng)])  # [2, T]
    seg_kv = np.stack([kv_ids, _segments("sorted", rng)])
    q, k, v = make_inputs(2, 2, T, T, 4, 2, 16, 16, jnp.float32)
    w, u = loss_weights(3, q, v)
    z = jnp.asarray(rng.standard_normal((2, 4, T, T)), jnp.float32)
    options = dict(q_segment_ids=jnp.asarray(seg_q), kv_segment_ids=jnp.asarray(seg_kv),
                   causal=causal, q_seqlens=jnp.asarray([T, 290]),
                   kv_seqlens=jnp.asarray([300, T]),
                   bias=jnp.asarray(rng.standard_normal((1, 4, T, T)), jnp.float32))
    out, aux, grads = _with_probs("probs", q, k, v, w, u, z, **options)
    r_out, r_aux, r_grads = _with_probs("reference", q, k, v, w, u, z, **options)
    assert aux.backend == "probs"
    tol = TOL[jnp.float32]
    assert_close(out, r_out, tol["out"], "out")
    assert_close(aux.lse, r_aux.lse, tol["lse"], "lse")
    assert_close(aux.max, r_aux.max, tol["lse"], "max")
    assert_close(aux.probs, r_aux.probs, tol["out"], "probs")
    assert set(grads) == set(r_grads)
    for name in grads:
        assert_close(grads[name], r_grads[name], tol["grad"], f"d{name}")
    # The skipped pairs are written as exact zeros: in P, and in the bias gradient (a sum over
    # the batch here) where both batch elements hide the pair.
    hidden = seg_q[:, None, :, None] != seg_kv[:, None, None, :]  # [2, 1, T, T]
    probs, dbias = np.asarray(aux.probs), np.asarray(grads["bias"])
    assert np.all(probs[np.broadcast_to(hidden, probs.shape)] == 0)
    assert np.all(dbias[np.broadcast_to(hidden.all(0, keepdims=True), dbias.shape)] == 0)
    if kind == "no_key":
        assert np.all(np.isneginf(np.asarray(aux.lse)[0, :, 130:140]))
        assert np.all(np.asarray(out)[0, 130:140] == 0)
        assert np.all(probs[0, :, 130:140] == 0)


# three seeds (every causal mode) in the default run (~5 s each), the rest in the slow sweep
@pytest.mark.parametrize("seed", [0, 1, 2, *(pytest.param(s, marks=pytest.mark.slow)
                                              for s in range(3, 8))])
def test_segment_row_usage_matches_visibility(seed):
    """The binary-search row usage (long packed rows) equals the dense visibility pattern's, over
    causal / bottom-right / window rules, lengths, and sorted or unsorted ids."""
    from attnaux import _masking
    from attnaux._internal import canonical_problem

    rng = np.random.default_rng(seed)
    q_seq, kv_seq = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    causal = [False, True, "bottom_right"][seed % 3]
    window = [None, (3, None), (0, None), (None, 2)][seed % 4]
    if causal and window is not None and window[1] is not None:
        window = None
    q = jnp.zeros((2, q_seq, 2, 8))
    k = jnp.zeros((2, kv_seq, 1, 8))
    q_ids = rng.integers(0, 3, (2, q_seq)).astype(np.int32)
    kv_ids = rng.integers(0, 3, (2, kv_seq)).astype(np.int32)
    if seed % 2:
        q_ids, kv_ids = np.sort(q_ids, 1), np.sort(kv_ids, 1)
    problem = canonical_problem(
        q, k, k, causal=causal, window=window, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
        q_seqlens=rng.integers(0, q_seq + 1, 2).astype(np.int32),
        kv_seqlens=rng.integers(0, kv_seq + 1, 2).astype(np.int32))
    # under jit: one compile each instead of one an eager op (~90, most of the test's time)
    rows, cols = jax.jit(lambda a: _masking._segment_row_usage(a, problem.options))(
        problem.arrays)
    visible = jax.jit(lambda a: _masking.visibility(a, problem.options))(
        problem.arrays)  # [B, 1, Sq, Skv]
    np.testing.assert_array_equal(rows[..., 0], visible.any(axis=3)[:, 0])
    np.testing.assert_array_equal(cols[..., 0], visible.any(axis=2)[:, 0])
