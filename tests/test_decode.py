"""Decode on CPU (`csrc/cpu/decode_cpu.h`): q_seq 1..16 against long keys, served inside the
`flash` backend, against the float64 NumPy oracle of the test suite (out, lse, max, dq, dk, dv,
dsink and the gradient through lse). Tolerances: float32 2e-5 (outputs, statistics) and 1e-4
(gradients) relative to the largest entry; bfloat16 inputs 2e-2 / 5e-2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnaux as ax

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="the decode form is the CPU kernels'")


def _problem(seed, b, sq, skv, hq, hk, d, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, skv, hk, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, skv, hk, d)), dtype)
    w = jnp.asarray(rng.standard_normal((b, sq, hq, d)), jnp.float32)
    u = jnp.asarray(rng.standard_normal((b, hq, sq)), jnp.float32)
    return q, k, v, w, u


def _run(backend, q, k, v, w, u, options):
    def loss(q, k, v, sink):
        out, aux = ax.attention(q, k, v, backend=backend, sink=sink, **options)
        lse = jnp.where(jnp.isfinite(aux.lse), aux.lse, 0.0)
        return (jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(lse * u),
                (out, aux.lse, aux.max))

    sink = options.pop("sink", None)
    grads, stats = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sink)
    return stats, grads


def _close(got, want, rel, what):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{what}: finiteness")
    scale = max(1.0, np.abs(want[finite]).max(initial=0.0))
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=rel * scale, err_msg=what)


CASES = {
    # (b, sq, skv, hq, hk, d), options: one row per kv head (dot form), several (matrix form)
    "one_row": ((3, 1, 4500, 4, 4, 64), {}),
    "gqa_rows": ((2, 4, 3000, 8, 2, 64), dict(causal="bottom_right")),
    "sixteen_rows_window": ((1, 16, 2500, 2, 2, 128), dict(causal=True, window=(700, 0))),
    "lengths_softcap_sink": ((3, 2, 2100, 4, 1, 64),
                             dict(q_seqlens=jnp.asarray([2, 1, 0]),
                                  kv_seqlens=jnp.asarray([2100, 5, 0]), softcap=7.0,
                                  sink=jnp.asarray([0.5, -1.0, 0.0, 2.0]))),
    "odd_head_dim": ((2, 3, 900, 3, 3, 40), dict(causal="bottom_right")),
    # one row per kv head, d 128, every head's keys cut by lengths, window and softcap (the
    # bfloat16 form reads 16 (key, head) rows at a time across kv heads and tiles)
    "one_row_lengths_window": ((3, 1, 2600, 6, 6, 128),
                               dict(kv_seqlens=jnp.asarray([2600, 701, 0]), causal="bottom_right",
                                    window=(900, 0), softcap=9.0)),
    # 6 rows per kv head (GQA 3 x q_seq 2), d 128, 2 kv heads: the dot forms (DotTileRows,
    # DotTileRowsBf16), whose requests for K and V ahead go into L2
    "few_rows_lengths_window": ((3, 2, 2300, 6, 2, 128),
                                dict(kv_seqlens=jnp.asarray([2300, 900, 0]), causal="bottom_right",
                                     window=(800, 0), softcap=8.0)),
    # the same with 8 kv heads (the products served float32 here until 2026-11-27); bfloat16's
    # dot form pads the 6 rows to 8 per score sum
    "few_rows_many_heads": ((2, 2, 1500, 24, 8, 128),
                            dict(kv_seqlens=jnp.asarray([1500, 333]), causal="bottom_right")),
}


# every case in float32; bfloat16 (AVX-512 BF16 dot products where the CPU has them) once per
# form: one row (dot products) and several (rows in the lanes)
PARAMS = [(name, "float32") for name in sorted(CASES)] + [("one_row", "bfloat16"),
                                                          ("one_row_lengths_window", "bfloat16"),
                                                          ("few_rows_lengths_window", "bfloat16"),
                                                          ("few_rows_many_heads", "bfloat16"),
                                                          ("gqa_rows", "bfloat16"),
                                                          ("sixteen_rows_window", "bfloat16")]


@pytest.mark.parametrize(("name", "dtype"), PARAMS)
def test_decode_matches_the_reference(name, dtype):
    shape, options = CASES[name]
    q, k, v, w, u = _problem(hash(name) % 1000, *shape, dtype=jnp.dtype(dtype))
    e = ax.explain(q, k, v, **options)
    assert e.backend == "flash" and "decode form" in e.reasons["flash"], str(e)
    (out, lse, mx), grads = _run("flash", q, k, v, w, u, dict(options))
    (r_out, r_lse, r_mx), r_grads = _run("reference", q.astype(jnp.float32),
                                         k.astype(jnp.float32), v.astype(jnp.float32), w, u,
                                         dict(options))
    tol, gtol = (2e-5, 1e-4) if dtype == "float32" else (2e-2, 5e-2)
    _close(out, r_out, tol, "out")
    _close(lse, r_lse, tol, "lse")
    _close(mx, r_mx, tol, "max")
    for n, g, r in zip(("dq", "dk", "dv"), grads[:3], r_grads[:3], strict=True):
        _close(g, r, gtol, n)
    if options.get("sink") is not None:
        _close(grads[3], r_grads[3], gtol, "dsink")


def test_nan_in_keys_no_row_sees_stays_out():
    """NaN stored in keys and values that the causal rule, the window or the lengths hide never
    reaches an output or a gradient (both forms)."""
    for sq, hq in ((1, 2), (4, 8)):
        q, k, v, w, u = _problem(5, 2, sq, 3000, hq, 2, 64)
        k = k.at[:, 2900:].set(jnp.nan)  # past kv_seqlens
        v = v.at[:, 2900:].set(jnp.nan)
        k = k.at[:, 10:20].set(jnp.nan)  # left of the window
        v = v.at[:, 10:20].set(jnp.nan)
        options = dict(kv_seqlens=jnp.asarray([2900, 2000]), causal="bottom_right",
                       window=(1500, 0))
        (out, lse, _), grads = _run("flash", q, k, v, w, u, dict(options))
        for name, x in (("out", out), ("lse", lse), ("dq", grads[0])):
            assert np.isfinite(np.asarray(x)).all(), name
        assert np.isfinite(np.asarray(grads[1][:, :2000])).all()
        assert np.all(np.asarray(grads[1][:, 10:20]) == 0)
