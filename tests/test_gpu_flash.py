"""The GPU `flash` backend (cuDNN fused attention) against `reference`, on the GPU.

Every test here is marked `gpu` and skipped without a GPU (conftest.py), and skipped when this
build has no CUDA handlers (`attnaux._ext_cuda`). Both backends run through the public API on the
same inputs; the reference computes in float32 at HIGHEST matmul precision.

Tolerances: `out` and the gradients use conftest's TOL for the input dtype (cuDNN, like the CPU
kernel, accumulates in float32 and rounds P / dS to the input dtype for its tensor-core products,
which the bf16/f16 rows of TOL already allow for). `lse` and `max` get 1e-4 (relative, and absolute
of the largest entry) instead of 2e-5: cuDNN evaluates exp/log with the hardware's approximate
`ex2`/`lg2` (relative error ~2**-22 per call) on logits pre-multiplied by log2(e), then converts
back. Biases are rounded to the input dtype first, so the comparison does not depend on whether
cuDNN takes the float32 bias or (fallback) a bias converted to the input dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_close,
    attention_and_grads,
    dtype_id,
    loss_weights,
    make_inputs,
    make_options,
    tol,
)

import attnaux
from attnaux import _ffi

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _ffi.ext_cuda() is None,
        reason=f"attnaux._ext_cuda was not built ({_ffi.CUDA_IMPORT_ERROR}); see the README, "
        "'GPU build and test'",
    ),
]

STATS_TOL = (1e-4, 1e-4)

# (name, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, options)
CASES = [
    ("plain", 2, 128, 128, 4, 4, 64, 64, {}),
    ("odd_lengths_gqa", 2, 100, 77, 4, 2, 64, 64, {}),
    ("causal", 2, 128, 128, 4, 4, 64, 64, dict(causal=True)),
    ("causal_q_longer", 1, 160, 96, 4, 4, 64, 64, dict(causal=True)),
    ("bottom_right", 2, 96, 160, 4, 2, 64, 64, dict(causal="bottom_right")),
    ("bottom_right_q_longer", 2, 160, 96, 4, 4, 64, 64, dict(causal="bottom_right")),
    ("gqa_causal", 2, 128, 128, 8, 2, 64, 64, dict(causal=True)),
    ("mqa_d128", 2, 128, 128, 8, 1, 128, 128, {}),
    ("scale", 2, 128, 128, 4, 4, 64, 64, dict(scale=0.3)),
    ("d128_v64", 2, 128, 128, 4, 4, 128, 64, {}),
    ("d256", 1, 128, 128, 2, 2, 256, 256, dict(causal=True)),
    ("bias_full", 2, 128, 128, 4, 4, 64, 64, dict(bias="BHQK")),
    ("bias_heads", 2, 128, 128, 4, 4, 64, 64, dict(bias="bHQK")),
    ("bias_shared", 2, 128, 128, 4, 4, 64, 64, dict(bias="QK")),
    ("bias_batch", 2, 128, 128, 4, 4, 64, 64, dict(bias="B1QK")),
    ("bias_row_broadcast", 2, 128, 96, 4, 4, 64, 64, dict(bias="BH1K")),
    ("bias_causal", 2, 128, 128, 4, 2, 64, 64, dict(bias="bHQK", causal=True)),
    ("window_causal", 2, 128, 128, 4, 4, 64, 64, dict(window=(32, 0), causal=True)),
    ("window_two_sided", 2, 128, 128, 4, 4, 64, 64, dict(window=(16, 8))),
    ("window_left_only", 2, 128, 160, 4, 4, 64, 64, dict(window=(20, None))),
    ("window_bottom_right", 2, 96, 160, 4, 4, 64, 64,
     dict(window=(24, None), causal="bottom_right")),
    ("window_q_longer", 1, 160, 96, 4, 4, 64, 64, dict(window=(16, 4))),
    ("seqlens", 4, 128, 128, 4, 4, 64, 64, dict(q_seqlens="rand", kv_seqlens="rand")),
    ("seqlens_edges_causal", 6, 96, 96, 4, 2, 64, 64,
     dict(q_seqlens="edges", kv_seqlens="edges", causal=True)),
    ("seqlens_bias", 4, 128, 128, 4, 4, 64, 64, dict(kv_seqlens="rand", bias="BHQK")),
    ("seqlens_bottom_right", 4, 96, 128, 4, 4, 64, 64,
     dict(q_seqlens="rand", kv_seqlens="rand", causal="bottom_right")),
    ("seqlens_window", 4, 128, 128, 4, 4, 64, 64, dict(kv_seqlens="rand", window=(16, 4))),
    ("batch_dims", (2, 3), 64, 64, 4, 4, 64, 64, dict(causal=True)),
    ("unbatched", (), 64, 80, 4, 4, 64, 64, {}),
]
F16_CASES = {"plain", "causal", "bottom_right", "bias_full", "seqlens", "window_causal", "d256"}
PARAMS = [pytest.param(c, jnp.bfloat16, id=f"{c[0]}-bf16") for c in CASES] + [
    pytest.param(c, jnp.float16, id=f"{c[0]}-f16") for c in CASES if c[0] in F16_CASES
]


def _setup(case, dtype, seed=0):
    name, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, options = case
    batch = (batch,) if isinstance(batch, int) else batch
    q, k, v = make_inputs(seed, batch, q_seq, kv_seq, q_heads, kv_heads, qk_dim, v_dim, dtype)
    opts = make_options(seed + 1, batch, q_seq, kv_seq, q_heads, **options)
    if "bias" in opts:
        opts["bias"] = opts["bias"].astype(dtype).astype(jnp.float32)
    return q, k, v, opts


def _require_flash(q, k, v, opts):
    explanation = attnaux.explain(q, k, v, **opts)
    if explanation.backend != "flash":
        pytest.skip(f"cuDNN does not serve this configuration here: {explanation.reasons['flash']}")
    assert explanation.implementation.startswith("cuDNN")


@pytest.mark.parametrize("case, dtype", PARAMS)
def test_parity_with_reference(case, dtype):
    q, k, v, opts = _setup(case, dtype)
    _require_flash(q, k, v, opts)
    w, u = loss_weights(3, q, v)  # the loss uses out and lse: gradients through aux.lse too
    out, aux, grads = attention_and_grads(q, k, v, w, u, backend="flash", **opts)
    r_out, r_aux, r_grads = attention_and_grads(q, k, v, w, u, backend="reference", **opts)
    assert aux.backend == "flash"
    assert out.dtype == q.dtype and aux.lse.dtype == jnp.float32
    assert_close(out, r_out, tol(dtype, "out"), "out")
    assert_close(aux.lse, r_aux.lse, STATS_TOL, "lse")
    assert_close(aux.max, r_aux.max, STATS_TOL, "max")
    for name in grads:
        assert_close(grads[name], r_grads[name], tol(dtype, "grad"), f"d{name}")


@pytest.mark.parametrize(
    "name", ["plain", "causal", "bias_heads", "seqlens", "window_two_sided", "d256"]
)
def test_gradients_without_lse_cotangent(name):
    """Only `out` in the loss: the backward runs with no lse term (symbolic zero)."""
    case = next(c for c in CASES if c[0] == name)
    q, k, v, opts = _setup(case, jnp.bfloat16, seed=5)
    _require_flash(q, k, v, opts)
    w, _ = loss_weights(7, q, v)
    diff = {"q": q, "k": k, "v": v}
    if "bias" in opts:
        diff["bias"] = opts.pop("bias")

    def loss(diff, backend):
        extra = {n: x for n, x in diff.items() if n not in ("q", "k", "v")}
        out, _ = attnaux.attention(diff["q"], diff["k"], diff["v"], backend=backend, **extra,
                                   **opts)
        return jnp.sum(out.astype(jnp.float32) * w)

    got = jax.jit(jax.grad(lambda d: loss(d, "flash")))(diff)
    want = jax.jit(jax.grad(lambda d: loss(d, "reference")))(diff)
    for n in got:
        assert_close(got[n], want[n], tol(jnp.bfloat16, "grad"), f"d{n}")


def test_lse_only_gradient():
    """A z-loss on lse alone (no output cotangent) flows through cuDNN's backward."""
    q, k, v = make_inputs(11, 2, 128, 128, 4, 4, 64, 64, jnp.bfloat16)

    def zloss(q, k, v, backend):
        _, aux = attnaux.attention(q, k, v, causal=True, backend=backend)
        return jnp.mean(aux.lse**2)

    got = jax.jit(jax.grad(lambda *a: zloss(*a, "flash"), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: zloss(*a, "reference"), argnums=(0, 1, 2)))(q, k, v)
    for g, r, n in zip(got, want, "qkv", strict=True):
        assert_close(g, r, tol(jnp.bfloat16, "grad"), f"d{n}")


def test_cudnn_targets_in_hlo():
    q, k, v = make_inputs(0, 2, 64, 64, 4, 4, 64, 64, jnp.bfloat16)
    f = lambda q, k, v: attnaux.attention(q, k, v, causal=True)
    hlo = jax.jit(f).lower(q, k, v).as_text()
    assert "attnaux_flash_fwd_cudnn" in hlo

    def loss(q, k, v):
        out, aux = f(q, k, v)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(aux.lse)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert "attnaux_flash_fwd_cudnn" in hlo and "attnaux_flash_bwd_cudnn" in hlo
    assert "attnaux_flash_fwd\"" not in hlo  # not the CPU target


def test_graphs_are_built_once():
    ext = _ffi.ext_cuda()
    q, k, v = make_inputs(1, 2, 192, 192, 4, 4, 64, 64, jnp.bfloat16)

    def loss(q, k, v):
        out, aux = attnaux.attention(q, k, v, window=(40, 3))
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(aux.lse)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(g(q, k, v))
    before = ext.graph_cache_stats()
    for seed in range(3):
        q2, k2, v2 = make_inputs(seed + 100, 2, 192, 192, 4, 4, 64, 64, jnp.bfloat16)
        jax.block_until_ready(g(q2, k2, v2))
    # a fresh jit of the same computation reuses the cached graphs as well
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    after = ext.graph_cache_stats()
    assert after["builds"] == before["builds"], (before, after)
    assert after["size"] == before["size"]
    assert after["hits"] > before["hits"]


def test_not_served_on_gpu_goes_to_reference():
    q, k, v = make_inputs(0, 1, 64, 64, 2, 2, 64, 64, jnp.float32)
    ex = attnaux.explain(q, k, v)
    assert ex.backend != "flash" and "bfloat16" in ex.reasons["flash"]
    with pytest.raises(ValueError, match="flash"):
        attnaux.attention(q, k, v, backend="flash")
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    key = jax.random.key(0)
    for opts, word in (
        (dict(dropout_rate=0.1, key=key), "dropout"),
        (dict(softcap=5.0), "softcap"),
        (dict(sink=jnp.zeros((2,))), "sink"),
        (dict(mask=jnp.ones((64, 64), bool)), "mask"),
        (dict(q_segment_ids=jnp.zeros((1, 64), jnp.int32)), "segment"),
        (dict(bias=jnp.zeros((64, 64)), causal="bottom_right"), "bias"),
    ):
        ex = attnaux.explain(qb, kb, vb, **opts)
        assert ex.backend != "flash", opts
        assert word in ex.reasons["flash"], ex.reasons["flash"]
        out, aux = attnaux.attention(qb, kb, vb, **opts)  # auto still works
        assert aux.backend != "flash"
    qo, ko, vo = make_inputs(0, 1, 64, 64, 2, 2, 60, 60, jnp.bfloat16)
    assert "multiples of 8" in attnaux.explain(qo, ko, vo).reasons["flash"]


def test_vmap_matches_reference():
    q, k, v = make_inputs(2, (3, 2), 96, 96, 4, 2, 64, 64, jnp.bfloat16)
    bias = jnp.asarray(np.random.default_rng(0).standard_normal((3, 1, 4, 96, 96)), jnp.float32)
    bias = bias.astype(jnp.bfloat16).astype(jnp.float32)

    def f(q, k, v, bias, backend):
        out, aux = attnaux.attention(q, k, v, bias=bias, causal=True, backend=backend)
        return out, aux.lse

    def loss(q, k, v, bias, backend):
        out, lse = jax.vmap(lambda *a: f(*a, backend))(q, k, v, bias)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

    got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "flash"), argnums=(0, 1, 2, 3)))(
        q, k, v, bias)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2, 3)))(
        q, k, v, bias)
    for g, r, n in zip(got[1], want[1], ["q", "k", "v", "bias"], strict=True):
        assert_close(g, r, tol(jnp.bfloat16, "grad"), f"vmap d{n}")


def test_padding_never_reaches_outputs():
    q, k, v = make_inputs(4, 3, 96, 112, 4, 4, 64, 64, jnp.bfloat16)
    q_len = jnp.array([96, 50, 0], jnp.int32)
    kv_len = jnp.array([40, 112, 7], jnp.int32)
    rows_q = (jnp.arange(96)[None, :] >= q_len[:, None])[:, :, None, None]
    rows_k = (jnp.arange(112)[None, :] >= kv_len[:, None])[:, :, None, None]
    qn, kn, vn = jnp.where(rows_q, jnp.nan, q), jnp.where(rows_k, jnp.inf, k), jnp.where(
        rows_k, jnp.nan, v)
    w, u = loss_weights(0, q, v)
    opts = dict(q_seqlens=q_len, kv_seqlens=kv_len, causal=True)
    out, aux, grads = attention_and_grads(qn, kn, vn, w, u, backend="flash", **opts)
    r_out, r_aux, r_grads = attention_and_grads(q, k, v, w, u, backend="reference", **opts)
    assert_close(out, r_out, tol(jnp.bfloat16, "out"), "out")
    assert_close(aux.lse, r_aux.lse, STATS_TOL, "lse")
    for n in grads:
        assert np.isfinite(np.asarray(grads[n], np.float32)).all(), n
        assert_close(grads[n], r_grads[n], tol(jnp.bfloat16, "grad"), f"d{n}")


def test_zero_sized():
    q, k, v = make_inputs(0, 2, 16, 0, 2, 2, 64, 64, jnp.bfloat16)
    out, aux = attnaux.attention(q, k, v, backend="flash")
    assert out.shape == (2, 16, 2, 64) and not np.asarray(out, np.float32).any()
    assert np.isneginf(np.asarray(aux.lse)).all() and np.isneginf(np.asarray(aux.max)).all()


def test_graph_cache_report():
    """Not a check: prints what was built (bias dtype taken, workspace) for the test log."""
    for key, what in _ffi.ext_cuda().graph_cache_entries():
        print(f"{key}: {what}")
    print("cuDNN version", _ffi.ext_cuda().cudnn_version(), "dtype ids", dtype_id(jnp.bfloat16))
