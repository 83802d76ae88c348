"""Packed sequences on the CPU flash kernels skip the tiles their segment ids hide (issue 22,
step 1): a (query tile, key tile) pair whose keys lie outside the segments of the tile's rows is
not computed, keys at its edges are trimmed, and a tile inside one segment needs no per-element
mask. Results must not change: against the pure-JAX reference (float32, the `TOL` of
`conftest.py`) for documents that straddle tile boundaries (64 rows and keys per tile), sorted
and unsorted ids, with causal masks, lengths and a bias, forward and gradients."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    TOL,
    assert_close,
    attention_and_grads,
    loss_weights,
    make_inputs,
    requires_flash,
)

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
